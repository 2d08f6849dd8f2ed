package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/tokenizer"
)

// Default max_tokens when a request names none.
const (
	defaultCompletionTokens = 16
	defaultChatTokens       = 256
)

type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// statusWriter records the status for metrics.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (s *statusWriter) WriteHeader(code int) {
	if s.code == 0 {
		s.code = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Flush() {
	if f, ok := s.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (g *Gateway) serve(hw http.ResponseWriter, r *http.Request, chat bool) {
	arrived := time.Now()
	w := &statusWriter{ResponseWriter: hw}
	endpoint := "completions"
	if chat {
		endpoint = "chat"
	}
	defer func() {
		code := w.code
		if code == 0 {
			code = 200
		}
		g.metrics.requests.WithLabelValues(endpoint, strconv.Itoa(code)).Inc()
	}()
	if !g.enterHandler() {
		writeError(w, errClosing)
		return
	}
	defer g.handlers.Done()
	if !g.authorized(r) {
		writeError(w, errUnauthorized)
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, g.cfg.MaxBodyBytes)
	req, err := decodeRequest(r.Body)
	if err != nil {
		var mbe *http.MaxBytesError
		var ae *apiError
		switch {
		case errors.As(err, &mbe):
			writeError(w, &apiError{Status: 413, Type: "invalid_request_error",
				Message: fmt.Sprintf("the request body exceeds %d bytes", g.cfg.MaxBodyBytes)})
		case errors.As(err, &ae):
			writeError(w, ae)
		default:
			writeError(w, badRequest("", "reading the body: %v", err))
		}
		return
	}
	defMax := defaultCompletionTokens
	if chat {
		defMax = defaultChatTokens
	}
	p, aerr := req.validate(chat, defMax)
	if aerr != nil {
		writeError(w, aerr)
		return
	}
	if req.Model != g.cfg.Model {
		writeError(w, &apiError{Status: 404, Type: "invalid_request_error", Param: "model", Code: "model_not_found",
			Message: fmt.Sprintf("the model `%s` does not exist; this gateway serves `%s`", req.Model, g.cfg.Model)})
		return
	}
	// Tokenize and check against the model's vocabulary and context.
	var prompt []int32
	stopTokens := []int32{tokenizer.TokEOS}
	switch {
	case chat:
		msgs := make([]tokenizer.Message, len(req.Messages))
		for i, m := range req.Messages {
			msgs[i] = tokenizer.Message{Role: m.Role, Content: string(m.Content)}
		}
		prompt = g.tok.ApplyChatTemplate(msgs)
		stopTokens = append(stopTokens, tokenizer.TokImEnd)
	case req.Prompt.text != nil:
		prompt = g.tok.Encode(*req.Prompt.text)
	default:
		prompt = req.Prompt.tokens
		for i, id := range prompt {
			if id >= tokenizer.VocabSize {
				writeError(w, badRequest("prompt", "prompt[%d] = %d is not a token id: the vocabulary is [0, %d)", i, id, tokenizer.VocabSize))
				return
			}
		}
	}
	g.mu.Lock()
	maxCtx := g.maxContext
	g.mu.Unlock()
	// max_tokens 0 (echo alone) runs one token on the worker, which
	// the client never sees.
	workerMax := max(p.maxTokens, 1)
	if len(prompt)+workerMax > maxCtx {
		param := "max_tokens"
		if len(prompt) >= maxCtx {
			param = "prompt"
		}
		writeError(w, badRequest(param, "this model's context is %d tokens; the prompt has %d and max_tokens is %d", maxCtx, len(prompt), p.maxTokens))
		return
	}
	if !p.seeded {
		p.seed = uint64(time.Now().UnixNano()) // fixed for the request's life, resumes included
	}
	// A request of n samples holds n admission slots: each is a request on
	// a worker. best_of draws p.bestOf ≥ n of them.
	n := p.bestOf
	taken := 0
	for ; taken < n; taken++ {
		select {
		case g.admit <- struct{}{}:
			continue
		default:
		}
		break
	}
	release := sync.OnceFunc(func() {
		for range taken {
			<-g.admit
		}
	})
	if taken < n {
		release()
		writeError(w, &apiError{Status: 429, Type: "rate_limit_error", Code: "too_many_requests", RetryAfter: retryAfter,
			Message: fmt.Sprintf("the gateway has %d requests in flight, its limit (a request of n samples counts n); retry later", g.cfg.MaxConcurrent)})
		return
	}
	defer release()
	g.metrics.inflight.Add(float64(n))
	defer g.metrics.inflight.Sub(float64(n))

	prefix := "cmpl-"
	if chat {
		prefix = "chatcmpl-"
	}
	// Each sample is a request of its own to the cluster (its own
	// placement, journal and resumes), under the response's id with its
	// index, and with the seed plus its index, so that the samples differ
	// and each is reproducible.
	id := newID(prefix)
	samples := make([]*entry, n)
	for i := range samples {
		sp, sid := p, id
		if n > 1 {
			sid = fmt.Sprintf("%s-%d", id, i)
			sp.seed = p.seed + uint64(i)
		}
		if p.bestOf > p.n {
			// Ranked by their tokens' logprobs, which the journal then
			// keeps (the response carries them only when asked for).
			sp.logprobs = true
		}
		samples[i] = &entry{id: sid, prompt: prompt, params: sp, maxToken: workerMax, arrived: arrived}
	}
	// The handler's context ends with the client or, once Close has given
	// handlers their grace, with the gateway.
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	defer context.AfterFunc(g.ctx, cancel)()
	// Set up before the first Dispatch: a Dispatch that commits after its
	// caller gave up (the client left, or DispatchTimeout ran out during an
	// election) has a placement in the gateway's session all the same, and
	// every attempt id is completed; one never placed is answered NotFound,
	// which is harmless. The slots go back before the flusher is waited on:
	// a flusher that falls behind holds up the handlers that finished, never
	// the admission of new requests.
	defer func() {
		release()
		for _, e := range samples {
			ids := e.dispatchIDs()
			complete := func() {
				// A completion must follow its Dispatch: the controller
				// refuses a Dispatch of a completed id.
				for _, ch := range e.unsettled {
					<-ch
				}
				for _, id := range ids {
					g.completeLater(id)
				}
			}
			// Waiting for a commit here would hold the response open (its
			// body ends when the handler returns).
			if len(e.unsettled) == 0 || !g.goFunc(complete) {
				complete()
			}
		}
	}()
	out := newResponder(w, chat, req.Stream, req.StreamOptions != nil && req.StreamOptions.IncludeUsage, id, g.cfg.Model, n)
	out.withLogprobs(p)
	var first sync.Once
	// With prefix routing (its workers cache prefixes) the samples share
	// the prompt's pages: sample 0 runs first, and the others are placed
	// on the worker that gave its first token once it has (its prompt's
	// full pages are in that worker's cache then), so they prefill only
	// what follows the last full page. A prompt with no full page has
	// nothing to share: its samples start together, each placed on its
	// own.
	var share *sampleShare
	if n > 1 && g.kv != nil && len(samples[0].promptHashes()) > 0 {
		share = &sampleShare{ready: make(chan struct{})}
	}
	run := func(i int) error {
		e := samples[i]
		// Followed before the Dispatch: a move event that arrives between
		// the commit and Dispatch's answer is kept for the first stream.
		g.follow(e.dispatchID())
		defer func() { g.unfollow(e.dispatchID()) }()
		var placement *pb.Placement
		var aerr *apiError
		switch {
		case share != nil && i == 0:
			defer share.release("") // sample 0 ended first: the others go on their own
			placement, aerr = g.place(ctx, e, false)
		case share != nil:
			select {
			case <-share.ready:
			case <-ctx.Done():
				return ctx.Err()
			}
			if share.worker != "" {
				placement, aerr = g.placeAt(ctx, e, share.worker)
			} else {
				placement, aerr = g.place(ctx, e, false)
			}
		default:
			placement, aerr = g.place(ctx, e, false)
		}
		if aerr != nil {
			return aerr
		}
		text := &textStream{stop: p.stop}
		echoed := false
		finish, err := g.generate(ctx, e, placement, stopTokens, func(tok int32) bool {
			first.Do(func() { g.metrics.ttft.Observe(time.Since(arrived).Seconds()) })
			if share != nil && i == 0 {
				share.release(e.on)
			}
			if p.echo && !echoed {
				// With the first token (its message carried the
				// prompt's logprobs): the prompt, before any of the
				// completion.
				echoed = true
				out.echo(i, prompt, e.promptLPs, p.logprobs)
				if p.maxTokens == 0 {
					return true // the prompt alone: the token is not the client's
				}
			}
			g.metrics.tokens.Inc()
			var lp *pb.GenerateResponse
			if p.logprobs {
				lp = e.lps[len(e.lps)-1]
			}
			delta, stopped := text.push([]byte(g.tok.DecodeToken(tok)))
			out.delta(i, delta, lp)
			return stopped
		})
		if err != nil {
			return err
		}
		if p.maxTokens == 0 {
			finish = "length" // the prompt alone: the one token run is the worker's
		}
		out.delta(i, text.flush(), nil)
		out.finishChoice(i, finish)
		return nil
	}
	if n == 1 {
		err = run(0)
	} else {
		// The samples run side by side; the first to fail ends the others
		// (the request fails as one).
		var once sync.Once
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				if e := run(i); e != nil {
					once.Do(func() { err = e; cancel() })
				}
			})
		}
		wg.Wait()
	}
	if err != nil {
		if r.Context().Err() != nil || g.ctx.Err() != nil {
			return // the client went away (or the gateway closed); the worker streams were cancelled
		}
		// A request that ends in an error is what lumen promises not to
		// happen short of bad input or overload: always worth a line in
		// the log.
		var ae *apiError
		tokens := 0
		for _, e := range samples {
			tokens += len(e.out)
		}
		if errors.As(err, &ae) && ae.Status == 429 {
			g.log.Debug("request refused: every worker's queue is full", "request", id, "error", err)
		} else {
			g.log.Warn("request failed", "request", id, "samples", n, "tokens", tokens, "error", err)
		}
		out.fail(err)
		return
	}
	g.metrics.e2e.Observe(time.Since(arrived).Seconds())
	u := usage{PromptTokens: len(prompt), TotalTokens: len(prompt)}
	if p.maxTokens > 0 { // max_tokens 0 (echo alone): no completion token is the client's
		for _, e := range samples {
			u.CompletionTokens += len(e.out)
			u.TotalTokens += len(e.out)
		}
	}
	if p.bestOf > p.n {
		out.keep(bestSamples(samples, p.n))
	}
	out.end(u)
}

var errClosing = &apiError{Status: 503, Type: "server_error", Code: "gateway_closing",
	Message: "the gateway is shutting down; retry on another gateway"}

// dispatchError says why a request could not be placed, from the cause: no
// session yet, the session just expired, no controller answering, or no
// worker able to take it.
func dispatchError(err error) *apiError {
	msg := status.Convert(err).Message()
	ae := &apiError{Status: 503, Type: "server_error"}
	switch {
	case errors.Is(err, errNoSession):
		ae.Code = "no_controller_session"
		ae.Message = "the gateway has no controller session: no controller answered within the dispatch timeout; retry later"
	case ctlclient.Reason(err) == ctlclient.ReasonSessionExpired:
		ae.Code = "session_expired"
		ae.Message = fmt.Sprintf("the gateway's controller session expired while placing the request: %s; retry", msg)
	case status.Code(err) == codes.FailedPrecondition:
		ae.Code = "no_worker"
		ae.Message = fmt.Sprintf("no worker can take the request: %s", msg)
	case status.Code(err) == codes.Unavailable, status.Code(err) == codes.DeadlineExceeded,
		status.Code(err) == codes.Canceled, errors.Is(err, context.DeadlineExceeded):
		ae.Code = "controller_unavailable"
		ae.Message = fmt.Sprintf("no controller placed the request in time: %s; retry later", msg)
	default:
		ae.Code = "dispatch_failed"
		ae.Message = fmt.Sprintf("the controller refused to place the request: %s", msg)
	}
	return ae
}

// sampleShare is where sample 0 of a request of n samples gave its first
// token: ready is closed then, or when sample 0 ended without one (worker
// "": the others are placed on their own).
type sampleShare struct {
	once   sync.Once
	ready  chan struct{}
	worker string
}

func (s *sampleShare) release(worker string) {
	s.once.Do(func() {
		s.worker = worker
		close(s.ready)
	})
}

// Errors a request can end with.
var (
	// errNotResumable wraps worker errors that a resume would not fix.
	errNotResumable = errors.New("gateway: request refused by the worker")
	// errResumeTimeout: the request's stream broke and it could not be
	// resumed within Config.ResumeTimeout.
	errResumeTimeout = errors.New("gateway: resume timed out")
	// errDiverged: a stop-and-restart resume regenerated a token other
	// than the one the client has; the request continues from the journal.
	errDiverged = errors.New("gateway: regenerated output differs from the journal")
)

// queueFullError: the worker refused the request because its waiting queue
// is full (ResourceExhausted: core.ErrQueueFull). Not the request's fault:
// it is placed on another worker, or the client is told to come back.
type queueFullError struct {
	worker string
	msg    string
}

func (e *queueFullError) Error() string {
	return fmt.Sprintf("gateway: worker %s refused the request, its queue full: %s", e.worker, e.msg)
}

// retryAfter is the Retry-After of a 429 (the gateway's own limit, or every
// worker's queue full): about the time a queue takes to start a few of its
// requests.
const retryAfter = time.Second

// allFullError answers a request that streamed nothing when every worker
// the gateway could place it on has a full queue.
// last is the last refusal's text (its worker's, naming the queue's
// limit), "" when there was none.
func allFullError(workers []string, last string) *apiError {
	msg := fmt.Sprintf("every worker's queue is full (tried %s); retry after %s", strings.Join(workers, ", "), retryAfter)
	if last != "" {
		msg = fmt.Sprintf("every worker's queue is full (tried %s; last answer %s); retry after %s", strings.Join(workers, ", "), last, retryAfter)
	}
	return &apiError{Status: 429, Type: "rate_limit_error", Code: "queue_full", RetryAfter: retryAfter, Message: msg}
}

// fullAnswers are the full-queue refusals a request met since its last
// token (generate).
type fullAnswers struct {
	workers []string  // those that refused, each once; cleared after a wait
	since   time.Time // the first refusal
	n       int       // refusals, from the same worker included
	last    string    // the last refusal's text, as its worker gave it
	// pause is the wait before the next round over every worker; it
	// doubles each round, so that a request waiting for a queue costs a
	// Dispatch per round, not a stream of them.
	pause time.Duration
}

// completeLater hands a finished request to the completion flusher. The
// caller must hold no admission slot. Once Close has begun the flusher has
// drained its queue for the last time and the id is not sent.
func (g *Gateway) completeLater(id string) {
	select {
	case g.done <- id:
	case <-g.stop:
	}
}

// generate streams the request from its worker until it finishes, calling
// onToken for each new token in index order (true stops generation). When
// the worker stream breaks it resumes where the controller says the request
// continues: at the placement a move event announced, or where
// GetPlacement says. The resumed call carries the whole token history, or
// under stop-and-restart the prompt alone: the worker decodes the output
// again, and the gateway checks each regenerated token against the journal
// and suppresses it (the client sees neither a repeat nor a gap; its stall
// is the regeneration). A regenerated token that differs is counted
// (lumen_gateway_regenerated_tokens_total{result="mismatched"}) and logged,
// and the request continues from the journal instead. A resume has one
// deadline, ResumeTimeout from the break, for every attempt it takes; a
// new token ends it, and so does a regenerated one that matches.
func (g *Gateway) generate(ctx context.Context, e *entry, pl *pb.Placement, stopTokens []int32, onToken func(int32) bool) (string, error) {
	var resumeBy time.Time // zero while the request makes progress
	var broke error        // what broke the stream last
	// regen: the next call sends the prompt alone and its output is
	// decoded again (a resume under stop-and-restart).
	var regen bool
	// A live migration's downtime, as the client sees it: from the last
	// token before the switch to the first after it.
	var lastToken, switched time.Time
	var full fullAnswers
	deliver := onToken
	onToken = func(tok int32) bool {
		full = fullAnswers{} // progress: a queue took it
		now := time.Now()
		if !switched.IsZero() {
			g.metrics.migrationDowntime.Observe(now.Sub(switched).Seconds())
			switched = time.Time{}
		}
		lastToken = now
		return deliver(tok)
	}
	for {
		finish, used, progressed, err := g.stream(ctx, e, pl, resumeBy, regen, stopTokens, onToken)
		if err == nil || ctx.Err() != nil || errors.Is(err, errNotResumable) {
			return finish, err
		}
		if progressed {
			full = fullAnswers{} // a queue took it
		}
		var qf *queueFullError
		if errors.As(err, &qf) {
			// Not a break either: the worker never took the request.
			g.log.Debug("worker queue full; placing elsewhere", "request", e.id, "worker", qf.worker, "tokens", len(e.out))
			if full.n == 0 {
				full.since = time.Now()
			}
			full.n++
			full.last = qf.worker + ": " + qf.msg
			if !slices.Contains(full.workers, qf.worker) {
				full.workers = append(full.workers, qf.worker)
			}
			next, err := g.placeAfterFull(ctx, e, &full)
			if err != nil {
				return "", err
			}
			pl = next
			continue
		}
		var rf *refusedError
		if errors.As(err, &rf) {
			// The placement the request started under was refused (its
			// worker failed or left): placed again with the journal's
			// tokens, that worker excluded. Not a break: the resume
			// deadline is untouched.
			g.log.Debug("placement refused; placing again", "request", e.id, "worker", rf.worker, "tokens", len(e.out), "error", rf.err)
			// After a few refusals (a table stale about several workers)
			// the controller chooses.
			e.refusals++
			next, aerr := g.redispatch(ctx, e, rf.controller || e.refusals >= maxRefusals, rf.worker)
			if aerr != nil {
				return "", aerr
			}
			pl = next
			continue
		}
		pl = used
		if !errors.Is(err, errResumeTimeout) {
			broke = err
		}
		now := time.Now()
		if progressed || resumeBy.IsZero() {
			resumeBy = now.Add(g.cfg.ResumeTimeout)
		}
		if errors.Is(err, errResumeTimeout) || !now.Before(resumeBy) {
			return "", fmt.Errorf("%w: request %s was not resumed within %s (%d tokens streamed); last error: %v",
				errResumeTimeout, e.id, g.cfg.ResumeTimeout, len(e.out), broke)
		}
		if errors.Is(err, errDiverged) {
			// Logged and counted where it was seen. The same placement
			// again, with the journal: the worker continues from it.
			e.diverged, regen, e.regen = true, false, false
			continue
		}
		var mv *movedError
		// Under stop-and-restart every resume regenerates, except after a
		// live migration: its destination holds the request's pages, and
		// the call with its history continues there.
		regen = g.regenerates() && !e.diverged && !(errors.As(err, &mv) && mv.migration)
		e.regen = regen
		g.log.Debug("worker stream broke; resuming", "request", e.id, "worker", pl.WorkerId, "epoch", pl.Epoch, "tokens", len(e.out),
			"regenerate", regen, "error", err)
		if errors.As(err, &mv) {
			if mv.migration {
				g.metrics.resumes.WithLabelValues("migrated").Inc()
				switched = lastToken
				pl = mv.to
				continue
			}
			g.metrics.resumes.WithLabelValues("moved").Inc()
			next, aerr := g.resumeByPrefix(ctx, e, pl.WorkerId, mv.to)
			if aerr != nil {
				return "", aerr
			}
			pl = next
			continue
		}
		if status.Code(err) == codes.Unavailable {
			g.reportUnreachable(pl.WorkerId, err)
		}
		next, err := g.resumeTarget(ctx, e, pl, resumeBy)
		if err != nil {
			return "", err
		}
		pl = next
	}
}

// stream runs one Generate call, at pl or at a newer placement an event
// announced (used says which). A non-zero resumeBy is the resume's
// deadline: the call is cut there unless a new token arrived first
// (progressed). regen sends the prompt alone: the worker decodes the
// journal's output again, each token of it checked against the journal and
// not delivered (progress all the same), and a token that differs ends the
// call with errDiverged.
func (g *Gateway) stream(ctx context.Context, e *entry, pl *pb.Placement, resumeBy time.Time, regen bool, stopTokens []int32,
	onToken func(int32) bool) (finish string, used *pb.Placement, progressed bool, err error) {
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	id := e.dispatchID()
	pl, refused := g.beginStream(id, pl, cancel)
	defer g.endStream(id)
	used = pl
	e.on = pl.WorkerId
	if refused != nil {
		return "", used, false, refused
	}
	var deadline *time.Timer
	if !resumeBy.IsZero() {
		deadline = time.AfterFunc(time.Until(resumeBy), func() { cancel(errResumeTimeout) })
		defer deadline.Stop()
	}
	progress := func() {
		if deadline != nil {
			deadline.Stop() // the resume is over
		}
		progressed = true
	}
	// cut turns an error seen after sctx was cancelled into its cause: a
	// move, or the resume deadline.
	cut := func(err error) error {
		if sctx.Err() != nil && ctx.Err() == nil {
			return context.Cause(sctx)
		}
		return err
	}
	cc, err := g.workerConn(sctx, pl.WorkerId)
	if err != nil {
		return "", used, false, cut(err)
	}
	generated := e.out
	if regen {
		generated = nil
	}
	if !e.sent {
		// The gateway's own time to the worker: accept, decode, validate,
		// tokenize, admit and place (a commit's wait apart, on its own).
		e.sent = true
		phase := "accept_to_generate"
		if e.viaController {
			phase = "accept_to_generate_via_controller"
		}
		g.metrics.own.WithLabelValues(phase).Observe(time.Since(e.arrived).Seconds())
	}
	st, err := pb.NewInferenceClient(cc).Generate(sctx, &pb.GenerateRequest{
		RequestId: id, Prompt: e.prompt, Generated: generated, MaxTokens: uint32(e.maxToken),
		Sampling:   &pb.SamplingParams{Temperature: e.params.temperature, TopP: e.params.topP, Seed: e.params.seed},
		StopTokens: stopTokens, Epoch: pl.Epoch, Holder: pl.HolderId, ReplicaHolders: pl.ReplicaHolders,
		Logprobs: e.params.logprobs, TopLogprobs: uint32(e.params.topLogprobs), PromptLogprobs: e.wantsPromptLogprobs(),
		Priority: e.params.priority,
	})
	if err != nil {
		return "", used, false, cut(err)
	}
	for {
		r, err := st.Recv()
		got := time.Now()
		if err == io.EOF {
			return "", used, progressed, errors.New("gateway: worker stream ended without a last token")
		}
		if err != nil {
			switch status.Code(err) {
			case codes.InvalidArgument, codes.AlreadyExists:
				return "", used, progressed, fmt.Errorf("%w: %s", errNotResumable, status.Convert(err).Message())
			case codes.ResourceExhausted:
				return "", used, progressed, &queueFullError{worker: pl.WorkerId, msg: status.Convert(err).Message()}
			}
			return "", used, progressed, cut(err)
		}
		if r.Moved != nil {
			// A live migration committed: the source stopped the request
			// and the destination holds it; continue there.
			if r.Moved.Epoch <= pl.Epoch {
				return "", used, progressed, fmt.Errorf("gateway: worker %s says request %s moved, to epoch %d, not newer than the call's %d",
					pl.WorkerId, id, r.Moved.Epoch, pl.Epoch)
			}
			return "", used, progressed, &movedError{to: r.Moved, migration: true}
		}
		if regen && int(r.Index) < len(e.out) {
			// A token the client has: decoded again, suppressed.
			if e.out[r.Index] != r.Token || r.Done {
				g.metrics.regenerated.WithLabelValues("mismatched").Inc()
				g.log.Error("a regenerated token differs from the one the client has (decoding is not deterministic here); continuing from the journal",
					"request", e.id, "worker", pl.WorkerId, "index", r.Index, "token", r.Token, "journal", e.out[r.Index], "done", r.Done)
				return "", used, progressed, fmt.Errorf("%w: worker %s regenerated index %d as token %d (done %v), the journal holds %d",
					errDiverged, pl.WorkerId, r.Index, r.Token, r.Done, e.out[r.Index])
			}
			g.metrics.regenerated.WithLabelValues("matched").Inc()
			progress()
			continue
		}
		fresh, err := e.accept(r.Index, r.Token)
		if err != nil {
			return "", used, progressed, err // a gap or a conflict: resume from the journal
		}
		if fresh {
			e.noteLogprobs(r)
			progress()
			stopped := onToken(r.Token)
			// From the token's arrival to its bytes written (and flushed,
			// when streaming) to the client.
			g.metrics.own.WithLabelValues("token_to_write").Observe(time.Since(got).Seconds())
			if stopped {
				return "stop", used, true, nil
			}
		}
		if r.Done {
			if r.FinishReason == pb.FinishReason_FINISH_REASON_LENGTH {
				return "length", used, progressed, nil
			}
			return "stop", used, progressed, nil
		}
	}
}

// redispatch places the request again under its next attempt id, followed
// for move events before the Dispatch, excluding the workers named (where
// the last attempt failed or was refused); viaController leaves the choice
// to the controller. The attempt it leaves is completed with the others
// when the handler ends (serve), after its admission slot is back.
func (g *Gateway) redispatch(ctx context.Context, e *entry, viaController bool, exclude ...string) (*pb.Placement, *apiError) {
	g.nextAttempt(e)
	for _, w := range exclude {
		if !slices.Contains(e.excluded, w) {
			e.excluded = append(e.excluded, w)
		}
	}
	return g.place(ctx, e, viaController, e.excluded...)
}

// nextAttempt moves the request to its next attempt id, followed for move
// events before its Dispatch is sent.
func (g *Gateway) nextAttempt(e *entry) {
	g.unfollow(e.dispatchID())
	g.replica.Forget(e.dispatchID())
	e.attempt++
	g.follow(e.dispatchID())
}

// placeAfterFull places a request that a worker refused with its queue full
// under a new attempt id, on a worker that has not refused it (full): the
// replica's choice with those left out, as well as the workers its earlier
// attempts failed on. With no load table the controller chooses (it takes
// no exclusions, but its view counts queues), up to maxRefusals times.
//
// When no worker is left, a request that has streamed nothing is answered
// 429 (allFullError): a full queue is the cluster's overload, and the
// client is the one to wait. One that has streamed tokens is never failed
// for it: it waits, trying the freest worker again, until a queue takes it
// or ResumeTimeout after the first refusal.
func (g *Gateway) placeAfterFull(ctx context.Context, e *entry, full *fullAnswers) (*pb.Placement, error) {
	g.nextAttempt(e)
	for {
		if _, tables := g.replica.Applied(); tables > 0 {
			exclude := append(slices.Clone(e.excluded), full.workers...)
			if pl, ok, aerr := g.placeFast(e, exclude...); ok || aerr != nil {
				return pl, nilIfNone(aerr)
			}
		} else if full.n < maxRefusals {
			pl, aerr := g.place(ctx, e, true)
			return pl, nilIfNone(aerr)
		}
		if len(e.out) == 0 {
			return nil, allFullError(full.workers, full.last)
		}
		if time.Since(full.since) >= g.cfg.ResumeTimeout {
			return nil, fmt.Errorf("%w: request %s found every worker's queue full for %s (%d tokens streamed; tried %s)",
				errResumeTimeout, e.id, g.cfg.ResumeTimeout, len(e.out), strings.Join(full.workers, ", "))
		}
		full.pause = min(max(2*full.pause, 20*time.Millisecond), 500*time.Millisecond)
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(full.pause):
		}
		// A queue frees as its requests start: every worker is a
		// candidate again.
		full.workers, full.n = full.workers[:0], 0
	}
}

// nilIfNone turns a nil *apiError into a nil error (not an error holding a
// nil pointer).
func nilIfNone(aerr *apiError) error {
	if aerr == nil {
		return nil
	}
	return aerr
}

// maxRefusals is how many refused placements of a request the gateway's
// own choice may cost before the controller chooses.
const maxRefusals = 3

// resumeTarget finds where a request whose stream broke continues: the
// placement's worker once the controller moves it (recovery: a newer
// epoch), the same worker again when it does not move (a transient break),
// or a new placement for a request that broke before its first token or
// whose placement is gone (its session expired). It gives up at resumeBy.
func (g *Gateway) resumeTarget(ctx context.Context, e *entry, pl *pb.Placement, resumeBy time.Time) (*pb.Placement, error) {
	start := time.Now()
	wait := 20 * time.Millisecond
	var lastErr error
	for time.Now().Before(resumeBy) {
		attemptBy := time.Now().Add(5 * time.Second)
		if resumeBy.Before(attemptBy) {
			attemptBy = resumeBy
		}
		rctx, cancel := context.WithDeadline(ctx, attemptBy)
		resp, err := g.ctl.GetPlacement(rctx, &pb.GetPlacementRequest{RequestId: e.dispatchID()})
		cancel()
		if err != nil {
			lastErr = err
		}
		switch {
		case err == nil && resp.Placement.Epoch > pl.Epoch:
			g.metrics.resumes.WithLabelValues("moved").Inc()
			next, aerr := g.resumeByPrefix(ctx, e, pl.WorkerId, resp.Placement)
			if aerr != nil {
				return nil, aerr
			}
			return next, nil
		case status.Code(err) == codes.NotFound || (len(e.out) == 0 && time.Since(start) > time.Second):
			// The placement is gone (its session expired, and every
			// placement of the session was completed), or nothing was
			// streamed yet and it did not move: place it afresh under a new
			// attempt id. The new worker gets the journal's history and
			// continues at the next index.
			npl, aerr := g.redispatch(ctx, e, false, pl.WorkerId)
			if aerr != nil {
				return nil, aerr
			}
			g.metrics.resumes.WithLabelValues("redispatch").Inc()
			return npl, nil
		case err == nil && time.Since(start) > 3*time.Second:
			// Not moved (an older epoch is a lagging replica's view):
			// the same placement again.
			g.metrics.resumes.WithLabelValues("retry").Inc()
			return pl, nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(wait):
		}
		wait = min(2*wait, 250*time.Millisecond)
	}
	return nil, fmt.Errorf("%w: request %s was not resumed within %s (%d tokens streamed); last error: %v",
		errResumeTimeout, e.id, g.cfg.ResumeTimeout, len(e.out), lastErr)
}

// responder writes a completion as one JSON object or as server-sent
// events, for one choice or for n side by side (their chunks interleave in
// a stream, each with its index).
type responder struct {
	w            http.ResponseWriter
	chat, stream bool
	includeUsage bool
	id, model    string
	created      int64
	// mu serialises the choices' writes.
	mu      sync.Mutex
	started bool
	choices []*choiceOut
	// With logprobs: how many alternatives each token lists.
	lp    bool
	lpTop int
	// tail is every chunk's end after its choices (chunkTail), buf the
	// event being written (writeChunk).
	tail, buf []byte
}

// choiceOut is one choice's part of a response.
type choiceOut struct {
	text   []byte // not streaming: the whole text
	finish string // not streaming: why it ended
	// streamed: a chunk of it went out (chat's first carries the role)
	streamed bool
	// The tokens' logprobs not yet sent, and the text offset of the next
	// (completions).
	pending []*pb.GenerateResponse
	offset  int
	// nullFirst: pending starts with an echoed prompt's first token,
	// which has no logprob.
	nullFirst bool
}

// withLogprobs makes the responses carry the request's logprobs.
func (o *responder) withLogprobs(p params) { o.lp, o.lpTop = p.logprobs, p.topLogprobs }

// takeLogprobs formats and clears a choice's queued logprobs: its
// `logprobs`, null when the request did not ask for them (or a stream's
// chunk has no token of its own: the last).
func (o *responder) takeLogprobs(c *choiceOut) any {
	if !o.lp || o.stream && len(c.pending) == 0 {
		return nil
	}
	lps := c.pending
	c.pending = nil
	if o.chat {
		return chatLogprobs(lps, o.lpTop)
	}
	lp, next := completionsLogprobs(lps, c.offset, c.nullFirst)
	c.offset, c.nullFirst = next, false
	return lp
}

// echo adds the prompt to choice i, before its completion, with the
// prompt's logprobs when the request asks for logprobs: lps are prompt
// tokens 1 … n−1's (the first token has none: null).
func (o *responder) echo(i int, prompt []int32, lps []*pb.PromptLogprob, withLogprobs bool) {
	var text []byte
	var tk tokenizer.Tokenizer
	for _, tok := range prompt {
		text = append(text, tk.DecodeToken(tok)...)
	}
	o.mu.Lock()
	c := o.choices[i]
	if withLogprobs {
		c.nullFirst = true
		for k, tok := range prompt {
			r := &pb.GenerateResponse{Token: tok}
			if k > 0 && k-1 < len(lps) {
				r.Logprob, r.TopLogprobs = lps[k-1].Logprob, lps[k-1].TopLogprobs
			}
			c.pending = append(c.pending, r)
		}
	}
	o.mu.Unlock()
	o.delta(i, string(text), nil)
}

func newResponder(w http.ResponseWriter, chat, stream, includeUsage bool, id, model string, n int) *responder {
	o := &responder{w: w, chat: chat, stream: stream, includeUsage: includeUsage, id: id, model: model, created: time.Now().Unix()}
	for range n {
		o.choices = append(o.choices, &choiceOut{})
	}
	return o
}

func (o *responder) object() string {
	switch {
	case o.chat && o.stream:
		return "chat.completion.chunk"
	case o.chat:
		return "chat.completion"
	}
	return "text_completion"
}

func (o *responder) event(v any) {
	b, _ := json.Marshal(v)
	ev := make([]byte, 0, len(b)+8)
	ev = append(append(append(ev, "data: "...), b...), "\n\n"...)
	o.writeEvent(ev)
}

// writeEvent writes one whole event (`data: …\n\n`) and flushes it,
// starting the stream first when it has not started.
func (o *responder) writeEvent(ev []byte) {
	if !o.started {
		h := o.w.Header()
		h.Set("Content-Type", "text/event-stream")
		h.Set("Cache-Control", "no-cache")
		o.w.WriteHeader(200)
		o.started = true
	}
	_, _ = o.w.Write(ev)
	if f, ok := o.w.(http.Flusher); ok {
		f.Flush()
	}
}

func (o *responder) chunk(i int, text string, finish *string) map[string]any {
	c := o.choices[i]
	choice := map[string]any{"index": i, "finish_reason": finish}
	if o.chat {
		delta := map[string]any{}
		if !c.streamed {
			delta["role"] = "assistant"
		}
		if text != "" || finish == nil {
			delta["content"] = text
		}
		choice["delta"] = delta
	} else {
		choice["text"] = text
	}
	choice["logprobs"] = o.takeLogprobs(c)
	c.streamed = true
	return map[string]any{"id": o.id, "object": o.object(), "created": o.created, "model": o.model, "choices": []any{choice}}
}

// delta adds text to choice i, with the logprobs of the token that brought
// it when lp is not nil (they go out with the next chunk even when the
// text is held back: a stop sequence may be forming).
func (o *responder) delta(i int, text string, lp *pb.GenerateResponse) {
	o.mu.Lock()
	defer o.mu.Unlock()
	c := o.choices[i]
	if lp != nil {
		c.pending = append(c.pending, lp)
	}
	if text == "" && len(c.pending) == 0 {
		return
	}
	if !o.stream {
		c.text = append(c.text, text...)
		return
	}
	o.writeChunk(i, text, nil)
}

// bestSamples returns the indices of the n samples with the highest
// cumulative logprob of their tokens, highest first (ties: the lower
// index), as vLLM ranks best_of's.
func bestSamples(samples []*entry, n int) []int {
	score := make([]float64, len(samples))
	idx := make([]int, len(samples))
	for i, e := range samples {
		idx[i] = i
		for _, lp := range e.lps {
			score[i] += float64(lp.Logprob)
		}
	}
	sort.SliceStable(idx, func(a, b int) bool { return score[idx[a]] > score[idx[b]] })
	return idx[:n]
}

// keep makes the response the choices named, in that order, indexed from
// 0 (best_of's best). Not streaming only.
func (o *responder) keep(which []int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	kept := make([]*choiceOut, len(which))
	for i, k := range which {
		kept[i] = o.choices[k]
	}
	o.choices = kept
}

// finishChoice ends choice i: streaming, its last chunk with the reason.
func (o *responder) finishChoice(i int, reason string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.stream {
		o.choices[i].finish = reason
		return
	}
	o.writeChunk(i, "", &reason)
}

// end writes the response's end, every choice finished: the whole JSON
// object, or the usage chunk (when asked for) and the stream's [DONE].
func (o *responder) end(u usage) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.stream {
		choices := make([]any, len(o.choices))
		for i, c := range o.choices {
			choice := map[string]any{"index": i, "finish_reason": c.finish}
			if o.chat {
				choice["message"] = map[string]any{"role": "assistant", "content": string(c.text)}
			} else {
				choice["text"] = string(c.text)
			}
			choice["logprobs"] = o.takeLogprobs(c)
			choices[i] = choice
		}
		writeJSON(o.w, 200, map[string]any{"id": o.id, "object": o.object(), "created": o.created, "model": o.model,
			"choices": choices, "usage": u})
		return
	}
	if o.includeUsage {
		o.event(map[string]any{"id": o.id, "object": o.object(), "created": o.created, "model": o.model, "choices": []any{}, "usage": u})
	}
	fmt.Fprint(o.w, "data: [DONE]\n\n")
	if f, ok := o.w.(http.Flusher); ok {
		f.Flush()
	}
}

// fail ends an accepted request with an explicit error: a JSON error before
// the stream started, an error event after.
func (o *responder) fail(err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	var ae *apiError
	if !errors.As(err, &ae) {
		ae = &apiError{Status: 503, Type: "server_error", Message: err.Error()}
		switch {
		case errors.Is(err, errNotResumable):
			ae.Status, ae.Type = 400, "invalid_request_error"
		case errors.Is(err, errResumeTimeout):
			ae.Code = "resume_timeout"
		}
	}
	if o.stream && o.started {
		o.event(map[string]any{"error": ae})
		return
	}
	writeError(o.w, ae)
}

// reportUnreachable tells the leader a worker's stream broke (the fast path
// of failure detection), once per worker at a time.
func (g *Gateway) reportUnreachable(worker string, cause error) {
	g.mu.Lock()
	if g.reporting == nil {
		g.reporting = map[string]bool{}
	}
	if g.reporting[worker] {
		g.mu.Unlock()
		return
	}
	g.reporting[worker] = true
	g.mu.Unlock()
	started := g.goFunc(func() {
		defer func() { g.mu.Lock(); delete(g.reporting, worker); g.mu.Unlock() }()
		ctx, cancel := context.WithTimeout(g.ctx, 5*time.Second)
		defer cancel()
		if _, err := g.ctl.ReportUnreachable(ctx, &pb.ReportUnreachableRequest{WorkerId: worker, Reporter: "gateway",
			Detail: status.Convert(cause).Message()}); err != nil {
			g.log.Debug("report unreachable failed", "worker", worker, "error", err)
		}
	})
	if !started { // closing
		g.mu.Lock()
		delete(g.reporting, worker)
		g.mu.Unlock()
	}
}
