package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/lumen-project/lumen/internal/kvpage"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// event is one message to a request's stream.
type event struct {
	resp *pb.GenerateResponse
	err  error // terminal error
}

// mailbox carries a request's events from the scheduler to its stream
// without ever blocking the scheduler.
type mailbox struct {
	mu     sync.Mutex // guards events
	events []event
	notify chan struct{} // buffered 1
}

func newMailbox() *mailbox { return &mailbox{notify: make(chan struct{}, 1)} }

func (m *mailbox) put(e event) {
	m.mu.Lock()
	m.events = append(m.events, e)
	m.mu.Unlock()
	select {
	case m.notify <- struct{}{}:
	default:
	}
}

func (m *mailbox) take() []event {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := m.events
	m.events = nil
	return out
}

// request is a Generate call inside the scheduler. Only the scheduler
// goroutine touches it after submission.
type request struct {
	id        string
	epoch     uint64 // the placement epoch the call was made for
	seq       engine.SeqID
	history   []int32 // prompt, then every output token
	prompt    int     // prompt length
	outStart  int     // output tokens that arrived already generated
	maxTokens int     // total output tokens
	params    engine.Sampling
	stop      map[int32]bool
	fed       int // history tokens in the KV cache
	arrived   time.Time
	started   time.Time // first prefill chunk (zero until then)
	lastToken time.Time
	box       *mailbox

	// Checkpointing: the holder, the prefix hash of each full page in the
	// cache, and how many pages have been queued for the holder.
	holder       string
	reserved     uint64 // the request's reserved footprint on the holder
	hashes       []uint64
	ckptSent     int
	restoreTried bool
}

func (r *request) outputs() int { return len(r.history) - r.prompt }

// pagesFor is the KV pages n tokens need.
func pagesFor(n int) int { return kvpage.Pages(n) }

// scheduler batches requests continuously over the engine.
type scheduler struct {
	w   *Worker
	eng engine.Engine
	cfg *Config

	submit chan *request
	cancel chan *request // a call that ended: drop its request if still its own
	reset  chan error    // end every request with this error (the worker rejoined)
	stop   chan struct{}
	done   chan struct{}

	// Owned by run.
	waiting []*request
	running []*request // in admission order
	byID    map[string]*request
	nextSeq engine.SeqID

	// stats is read by the load reporter.
	statsMu sync.Mutex // guards stats
	stats   schedStats
}

type schedStats struct {
	running, waiting int
	queueHeadPages   int
	waits            []timedWait // prefill-start waits in the window
}

type timedWait struct {
	at   time.Time
	wait time.Duration
}

func newScheduler(w *Worker) *scheduler {
	return &scheduler{w: w, eng: w.cfg.Engine, cfg: &w.cfg, submit: make(chan *request, 256), cancel: make(chan *request, 256),
		reset: make(chan error), stop: make(chan struct{}), done: make(chan struct{}), byID: map[string]*request{}}
}

func (s *scheduler) run() {
	defer close(s.done)
	ctx := context.Background()
	for {
		if len(s.running) == 0 && len(s.waiting) == 0 {
			select {
			case r := <-s.submit:
				s.admit(r)
			case r := <-s.cancel:
				s.dropIfCurrent(r)
			case err := <-s.reset:
				s.failAll(err)
			case <-s.stop:
				s.failAll(errShutdown)
				return
			}
		}
		s.drainIntake()
		s.publishStats()
		select {
		case <-s.stop:
			s.failAll(errShutdown)
			return
		default:
		}
		if len(s.running) == 0 && len(s.waiting) == 0 {
			continue
		}
		s.step(ctx)
		s.publishStats()
	}
}

func (s *scheduler) drainIntake() {
	for {
		select {
		case r := <-s.submit:
			s.admit(r)
		case r := <-s.cancel:
			s.dropIfCurrent(r)
		case err := <-s.reset:
			s.failAll(err)
		default:
			return
		}
	}
}

func (s *scheduler) admit(r *request) {
	if old, dup := s.byID[r.id]; dup {
		// A call made for an older placement epoch comes from before a
		// move (a gateway that read a lagging replica): it is refused and
		// the request runs on.
		if r.epoch < old.epoch {
			r.box.put(event{err: fmt.Errorf("%w: request %q runs under epoch %d, this call carries epoch %d",
				errStaleEpoch, r.id, old.epoch, r.epoch)})
			return
		}
		// The gateway calls again for a request only when it has given
		// up on its previous call (the stream broke on its side, or the
		// controller moved the request and back): the latest call of an
		// equal or newer epoch wins.
		// Refusing it made a race into a client-visible error: the old
		// call's cancellation can reach the scheduler after the new call.
		s.drop(old.id, errSuperseded)
	}
	if len(s.waiting) >= s.cfg.MaxWaiting {
		r.box.put(event{err: fmt.Errorf("%w: %d requests wait", errQueueFull, len(s.waiting))})
		return
	}
	s.nextSeq++
	r.seq = s.nextSeq
	s.byID[r.id] = r
	if r.outStart > 0 {
		// A resumed request (its worker failed, or it moved) goes ahead of
		// new ones, behind earlier resumes: its client is already waiting
		// mid-stream, and a failure should cost it a delay, not a queue.
		i := 0
		for i < len(s.waiting) && s.waiting[i].outStart > 0 {
			i++
		}
		s.waiting = slices.Insert(s.waiting, i, r)
	} else {
		s.waiting = append(s.waiting, r)
	}
	s.w.metrics.waiting.Set(float64(len(s.waiting)))
}

// drop removes a request wherever it is and frees its pages; err, when not
// nil, is sent to its stream.
func (s *scheduler) drop(id string, err error) {
	r, ok := s.byID[id]
	if !ok {
		return
	}
	delete(s.byID, id)
	s.eng.Release(r.seq)
	s.waiting = remove(s.waiting, r)
	s.running = remove(s.running, r)
	if err != errShutdown && err != errRejoined {
		// A request handed back (at shutdown, or by an incarnation that
		// was marked failed) keeps its checkpoint: it resumes from it
		// elsewhere.
		s.releaseCheckpoint(r)
	}
	if err != nil {
		r.box.put(event{err: err})
	}
}

// dropIfCurrent drops r when it is still the request under its id (a newer
// call may have taken the id over).
func (s *scheduler) dropIfCurrent(r *request) {
	if cur, ok := s.byID[r.id]; ok && cur == r {
		s.drop(r.id, nil)
	}
}

func remove(q []*request, r *request) []*request {
	for i, x := range q {
		if x == r {
			return append(q[:i], q[i+1:]...)
		}
	}
	return q
}

func (s *scheduler) failAll(err error) {
	for id := range s.byID {
		s.drop(id, err)
	}
}

// step builds one batch — every running request's next decode or prefill
// chunk, then waiting requests while the token budget and KV pages allow —
// runs it, and delivers the tokens. When the running requests' next chunks
// cannot get KV pages it preempts the most recently admitted request (its
// cache is dropped and it waits to be recomputed) and tries again without
// admitting anyone, so a victim is never re-admitted into the same squeeze.
func (s *scheduler) step(ctx context.Context) {
	admit := true
	for {
		batch, reqs := s.build(admit)
		if len(batch) == 0 {
			switch {
			case len(s.running) > 0:
				s.preempt() // every running request waits for a page
				admit = false
				continue
			case admit && len(s.waiting) > 0:
				// The head cannot fit even alone: it never will.
				head := s.waiting[0]
				s.drop(head.id, fmt.Errorf("%w: it needs %d KV pages, the worker has %d", errTooLarge,
					pagesFor(len(head.history)+1), s.eng.Info().TotalPages))
			}
			return
		}
		start := time.Now()
		out, err := s.eng.Forward(ctx, batch)
		if errors.Is(err, engine.ErrOutOfPages) && len(s.running) > 0 {
			s.preempt()
			admit = false
			continue
		}
		if err != nil {
			// A request the engine refuses fails alone; the rest go on.
			for _, r := range reqs {
				s.drop(r.id, fmt.Errorf("worker: engine: %w", err))
			}
			return
		}
		s.w.metrics.stepSeconds.Observe(time.Since(start).Seconds())
		s.w.metrics.batchRows.Observe(float64(rows(batch)))
		s.deliver(batch, reqs, out)
		s.checkpoint(reqs)
		return
	}
}

func rows(b []engine.Chunk) int {
	n := 0
	for _, c := range b {
		n += len(c.Tokens)
	}
	return n
}

// build takes each running request's next chunk while the token budget and
// the free KV pages last (a prefill chunk shrinks to the pages there are),
// then, when admit is set, waiting requests whose first chunk — after the
// checkpoint pages they will import — fits, leaving a page of headroom per
// running request for its coming decodes.
func (s *scheduler) build(admit bool) ([]engine.Chunk, []*request) {
	budget := s.cfg.TokenBudget
	free := s.eng.FreePages()
	var batch []engine.Chunk
	var reqs []*request
	// add takes up to n tokens of r's pending history, as far as free
	// pages allow, and reports whether it took any.
	add := func(r *request, n int) bool {
		pending := r.history[r.fed:]
		n = min(n, len(pending), budget)
		held := pagesFor(r.fed)
		n = min(n, (held+free)*engine.PageTokens-r.fed)
		if n <= 0 {
			return false
		}
		sample := 0
		if n == len(pending) {
			sample = 1
		}
		batch = append(batch, engine.Chunk{Seq: r.seq, Tokens: pending[:n], Sample: sample, Params: r.params, OutIndex: r.outputs()})
		reqs = append(reqs, r)
		budget -= n
		free -= pagesFor(r.fed+n) - held
		return true
	}
	for _, r := range s.running {
		if budget == 0 {
			break
		}
		add(r, budget)
	}
	if !admit {
		return batch, reqs
	}
	free -= len(s.running)
	for len(s.waiting) > 0 && budget > 0 && len(s.running) < s.cfg.MaxRunning {
		r := s.waiting[0]
		pages, hashes := s.restorable(r)
		if pagesFor(min(len(r.history), len(pages)*engine.PageTokens+budget)) > free {
			break
		}
		s.waiting = s.waiting[1:]
		s.running = append(s.running, r)
		s.restore(r, pages, hashes)
		free -= pagesFor(r.fed)
		if r.started.IsZero() {
			r.started = time.Now()
			s.recordWait(r.started.Sub(r.arrived))
		}
		add(r, budget)
	}
	return batch, reqs
}

func (s *scheduler) preempt() {
	victim := s.running[len(s.running)-1]
	s.running = s.running[:len(s.running)-1]
	s.eng.Release(victim.seq)
	s.nextSeq++
	victim.seq, victim.fed, victim.ckptSent, victim.hashes = s.nextSeq, 0, 0, nil
	s.waiting = append([]*request{victim}, s.waiting...)
	s.w.metrics.preemptions.Inc()
}

func (s *scheduler) deliver(batch []engine.Chunk, reqs []*request, out [][]int32) {
	now := time.Now()
	for i, ch := range batch {
		r := reqs[i]
		r.fed += len(ch.Tokens)
		if len(out[i]) == 0 {
			continue
		}
		tok := out[i][0]
		r.history = append(r.history, tok)
		idx := r.outputs() - 1
		if idx == r.outStart {
			s.w.metrics.ttft.Observe(now.Sub(r.arrived).Seconds())
		} else {
			s.w.metrics.tpot.Observe(now.Sub(r.lastToken).Seconds())
		}
		r.lastToken = now
		resp := &pb.GenerateResponse{Token: tok, Index: uint32(idx), PromptTokens: uint32(r.prompt)}
		switch {
		case r.stop[tok]:
			resp.Done, resp.FinishReason = true, pb.FinishReason_FINISH_REASON_STOP
		case r.outputs() >= r.maxTokens:
			resp.Done, resp.FinishReason = true, pb.FinishReason_FINISH_REASON_LENGTH
		}
		r.box.put(event{resp: resp})
		if resp.Done {
			delete(s.byID, r.id)
			s.eng.Release(r.seq)
			s.running = remove(s.running, r)
			s.w.metrics.completed.Inc()
			s.releaseCheckpoint(r)
		}
	}
}

func (s *scheduler) recordWait(d time.Duration) {
	s.w.metrics.queueDelay.Observe(d.Seconds())
	s.statsMu.Lock()
	s.stats.waits = append(s.stats.waits, timedWait{time.Now(), d})
	s.statsMu.Unlock()
}

func (s *scheduler) publishStats() {
	head := 0
	if len(s.waiting) > 0 {
		head = pagesFor(len(s.waiting[0].history))
	}
	s.statsMu.Lock()
	prev := s.stats.running + s.stats.waiting
	s.stats.running, s.stats.waiting, s.stats.queueHeadPages = len(s.running), len(s.waiting), head
	s.statsMu.Unlock()
	// A large change in the load is reported at once, not at the next tick.
	if now := len(s.running) + len(s.waiting); now > prev+max(prev/10, 4) || now < prev-max(prev/10, 4) {
		select {
		case s.w.loadKick <- struct{}{}:
		default:
		}
	}
	s.w.metrics.running.Set(float64(len(s.running)))
	s.w.metrics.waiting.Set(float64(len(s.waiting)))
}

// snapshot returns the load figures and q_w over the window.
func (s *scheduler) snapshot(window time.Duration) (running, waiting, headPages int, qw float64) {
	s.statsMu.Lock()
	defer s.statsMu.Unlock()
	cut := time.Now().Add(-window)
	kept := s.stats.waits[:0]
	var sum time.Duration
	for _, w := range s.stats.waits {
		if w.at.After(cut) {
			kept = append(kept, w)
			sum += w.wait
		}
	}
	s.stats.waits = kept
	if len(kept) > 0 {
		qw = float64(sum.Microseconds()) / 1000 / float64(len(kept))
	}
	return s.stats.running, s.stats.waiting, s.stats.queueHeadPages, qw
}

// restorable returns the longest prefix of a newly admitted request's pages
// that this worker's checkpoint store holds (it was the request's holder),
// and their hashes; nil for a new request or one already tried.
func (s *scheduler) restorable(r *request) ([][]byte, []uint64) {
	if r.restoreTried || r.fed > 0 || r.outStart == 0 {
		return nil, nil // a new request: nothing was checkpointed
	}
	// At least one token must be left to compute the next one.
	hashes := pageHashes(r.history[:len(r.history)-1], nil)
	pages := s.w.store.prefix(hashes)
	return pages, hashes[:len(pages)]
}

// restore imports the pages restorable found, so only the rest of the
// request's history is prefilled.
func (s *scheduler) restore(r *request, pages [][]byte, hashes []uint64) {
	if r.restoreTried || r.fed > 0 {
		return
	}
	r.restoreTried = true
	if r.outStart == 0 {
		return
	}
	if len(pages) > 0 {
		if err := s.eng.ImportPages(r.seq, pages); err == nil {
			r.fed = len(pages) * engine.PageTokens
			r.hashes = hashes
			s.w.metrics.restoredPages.Add(float64(len(pages)))
			s.w.store.release(r.id) // consumed: the request runs here now
		}
	}
	s.w.metrics.recomputed.Add(float64(len(r.history) - r.fed))
}

// checkpoint queues the pages that filled in this step for the holder.
func (s *scheduler) checkpoint(reqs []*request) {
	for _, r := range reqs {
		if r.holder == "" || r.holder == s.cfg.ID {
			continue
		}
		if _, live := s.byID[r.id]; !live {
			continue
		}
		r.hashes = pageHashes(r.history[:r.fed], r.hashes)
		if r.ckptSent == len(r.hashes) {
			continue // no page filled this step
		}
		snd := s.w.sender(r.holder)
	queue:
		for ; r.ckptSent < len(r.hashes); r.ckptSent++ {
			select {
			case snd.jobs <- ckptJob{req: r.id, reserved: r.reserved, seq: r.seq, page: r.ckptSent, hash: r.hashes[r.ckptSent]}:
			default:
				break queue // the holder is slow: this checkpoint falls behind
			}
		}
	}
}

func (s *scheduler) releaseCheckpoint(r *request) {
	if r.holder != "" && r.holder != s.cfg.ID && r.ckptSent > 0 {
		s.w.sender(r.holder).release(r.id)
	}
}
