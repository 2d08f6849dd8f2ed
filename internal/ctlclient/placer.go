package ctlclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// MaxPlaceBatch is the most dispatches, and the most completes, one
// PlaceBatch may carry (the controller refuses more).
const MaxPlaceBatch = 4096

// AcceptedHeader is the header metadata key the leader sends when it
// accepts a Place stream; a refused stream ends without it.
const AcceptedHeader = "lumen-place-leader"

// DefaultPlaceProbeInterval is PlacerOptions.ProbeInterval's default:
// shorter than a watch's (DefaultProbeInterval), since every fast-path
// Dispatch waits on the Place stream.
const DefaultPlaceProbeInterval = time.Second

// DefaultMaxCompletes is PlacerOptions.MaxCompletes's default: the
// gateway's completion flusher keeps as many while the controller is
// unreachable.
const DefaultMaxCompletes = 1 << 16

var (
	// ErrPlacerClosed: Dispatch after Close.
	ErrPlacerClosed = errors.New("ctlclient: placer closed")
	// ErrCompletesFull: Complete while MaxCompletes completes wait for an
	// acknowledgement (no leader has answered for a while). Nothing was
	// taken: call again later with the same ids.
	ErrCompletesFull = errors.New("ctlclient: too many completes unacknowledged; retry later")
)

// PlacerOptions tune a Placer. The zero value is the default.
type PlacerOptions struct {
	// MaxInflight is how many batches may be sent and not yet answered
	// (default 4: the leader pipelines their log entries). Whatever callers submit meanwhile waits and goes in the
	// next batch: group commit on the client.
	MaxInflight int
	// MaxBatch caps the dispatches (and the completes) of one batch
	// (default and at most MaxPlaceBatch).
	MaxBatch int
	// OnError, when set, is told why a stream broke or could not open (for
	// logs); the Placer reconnects by itself.
	OnError func(addr string, err error)
	// ProbeInterval is how often the Placer asks the replica its stream
	// runs on for its status (Operator.ClusterStatus), and how long it
	// waits for the answer (default DefaultPlaceProbeInterval). A replica that
	// does not answer in time (SIGSTOPped: its kernel still acknowledges
	// TCP, so the stream never breaks; or behind a link that drops
	// packets), that knows no leader, or that no longer leads loses the
	// stream: the Placer opens one on the next replica and sends what was
	// unanswered again. A dead stream is thus left within two intervals,
	// well inside a gateway's DispatchTimeout; the connection's keepalive
	// (liveness.DefaultTime + DefaultTimeout) is the slower backstop.
	ProbeInterval time.Duration
	// MaxCompletes bounds the completes not yet acknowledged, queued and
	// in flight (default DefaultMaxCompletes). Past it Complete refuses
	// with ErrCompletesFull, so that a caller's own backpressure holds
	// while no leader answers.
	MaxCompletes int
}

// Placer is a gateway's Place stream to the leader: placements and
// completions of many requests over one stream, batched.
//
// Semantics:
//   - Dispatch submits one placement and waits for its result. What callers
//     submit while MaxInflight batches are unanswered goes out together in
//     the next batch, and the leader proposes a batch's commands together.
//   - The stream is opened on the leader: the Placer tries the replica a
//     NOT_LEADER refusal named first, then the others in turn, and
//     reconnects the same way when the stream breaks (leader lost, replica
//     down). Batches sent and not answered on a broken stream are sent
//     again, whole, on the next: Dispatch and Complete are idempotent by
//     request id, so a request gets exactly one placement whatever the
//     number of sends (a resent Dispatch returns the placement it got; one
//     of a completed id fails REQUEST_COMPLETED).
//   - Dispatch's errors are the unary Dispatch's: a gRPC status with the
//     code, message and ErrorInfo reason the controller gave (Reason works:
//     WORKER_UNAVAILABLE, SESSION_EXPIRED, REQUEST_COMPLETED, …), or the
//     caller's context's error. A Dispatch whose context ends before it is
//     sent is not sent; one that ends after may still commit (a later
//     Dispatch of the same id returns that placement).
//   - Complete is fire-and-forget: the ids go out in the next batch and are
//     sent again until a batch carrying them is answered (on any leader).
//   - Close stops new Dispatches (they fail ErrPlacerClosed), waits until
//     every Complete so far is acknowledged or ctx ends, then closes the
//     stream; Dispatches still waiting fail ErrPlacerClosed.
//
// A Placer is safe for concurrent use.
type Placer struct {
	c    *Client
	opts PlacerOptions

	// mu guards the fields below it.
	mu        sync.Mutex
	queue     []*placeCall // dispatches not yet in a sent batch
	completes []string     // completes not yet in a sent batch
	inflight  []*sentBatch // sent on the current stream, not yet answered
	closing   bool
	hint      string // the address to try first
	idle      chan struct{}
	// silent is the replica whose stream was abandoned for failing its
	// probe: a NOT_LEADER hint naming it (a follower that has not seen the
	// election yet) is not followed until a stream is accepted again.
	silent string

	kick   chan struct{} // buffered 1: something to send, or room to send it
	cancel context.CancelFunc
	done   chan struct{}
}

type placeCall struct {
	ctx  context.Context
	req  *pb.DispatchRequest
	done chan placeOutcome // buffered 1
}

type placeOutcome struct {
	resp *pb.DispatchResponse
	err  error
}

type sentBatch struct {
	seq       uint64
	calls     []*placeCall
	completes []string
}

// NewPlacer starts a Placer on the client's replicas. It connects in the
// background; Close it when done.
func (c *Client) NewPlacer(opts PlacerOptions) *Placer {
	if opts.MaxInflight < 1 {
		opts.MaxInflight = 4
	}
	if opts.MaxBatch < 1 || opts.MaxBatch > MaxPlaceBatch {
		opts.MaxBatch = MaxPlaceBatch
	}
	if opts.ProbeInterval <= 0 {
		opts.ProbeInterval = DefaultPlaceProbeInterval
	}
	if opts.MaxCompletes < 1 {
		opts.MaxCompletes = DefaultMaxCompletes
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Placer{c: c, opts: opts, kick: make(chan struct{}, 1), cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		p.run(ctx)
	}()
	return p
}

func (p *Placer) wake() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// Dispatch places one request over the stream and returns its placement,
// or the error the unary Dispatch would (see Placer). The Placer may still
// read req after Dispatch returned early (its context ended with the
// request in a batch): never modify req after the call.
func (p *Placer) Dispatch(ctx context.Context, req *pb.DispatchRequest) (*pb.DispatchResponse, error) {
	call := &placeCall{ctx: ctx, req: req, done: make(chan placeOutcome, 1)}
	p.mu.Lock()
	if p.closing {
		p.mu.Unlock()
		return nil, ErrPlacerClosed
	}
	p.queue = append(p.queue, call)
	p.mu.Unlock()
	p.wake()
	select {
	case o := <-call.done:
		return o.resp, o.err
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// Complete ends requests: fire-and-forget, sent until acknowledged. It
// refuses with ErrCompletesFull, taking none of ids, when they would carry
// the completes unacknowledged past MaxCompletes (a call while none is
// unacknowledged is always taken).
func (p *Placer) Complete(ids ...string) error {
	if len(ids) == 0 {
		return nil
	}
	p.mu.Lock()
	if n := p.unackedLocked(); n > 0 && n+len(ids) > p.opts.MaxCompletes {
		p.mu.Unlock()
		return fmt.Errorf("%w (%d waiting, limit %d)", ErrCompletesFull, n, p.opts.MaxCompletes)
	}
	p.completes = append(p.completes, ids...)
	p.mu.Unlock()
	p.wake()
	return nil
}

// TakeCompletes returns the completes not yet sent and forgets them, for a
// caller that sends them another way (a controller that serves no Place
// stream: no stream would ever send them). Those in flight on a stream
// stay, sent again until acknowledged.
func (p *Placer) TakeCompletes() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	ids := p.completes
	p.completes = nil
	p.checkIdleLocked()
	return ids
}

// unackedLocked counts the completes queued and in flight. p.mu must be
// held.
func (p *Placer) unackedLocked() int {
	n := len(p.completes)
	for _, b := range p.inflight {
		n += len(b.completes)
	}
	return n
}

// Pending returns how many dispatches and completes are not yet answered.
func (p *Placer) Pending() (dispatches, completes int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	dispatches, completes = len(p.queue), len(p.completes)
	for _, b := range p.inflight {
		dispatches += len(b.calls)
		completes += len(b.completes)
	}
	return dispatches, completes
}

// Close flushes the completes (until they are acknowledged or ctx ends),
// then stops the stream. It returns an error naming how many completes were
// left unacknowledged, if any.
func (p *Placer) Close(ctx context.Context) error {
	p.mu.Lock()
	p.closing = true
	idle := make(chan struct{})
	p.idle = idle
	p.checkIdleLocked()
	p.mu.Unlock()
	p.wake()
	var err error
	select {
	case <-idle:
	case <-ctx.Done():
		_, n := p.Pending()
		err = fmt.Errorf("ctlclient: placer closed with %d completes unacknowledged: %w", n, ctx.Err())
	}
	p.cancel()
	<-p.done
	p.mu.Lock()
	calls := p.queue
	for _, b := range p.inflight {
		calls = append(calls, b.calls...)
	}
	p.queue, p.inflight = nil, nil
	p.mu.Unlock()
	for _, c := range calls {
		c.done <- placeOutcome{err: ErrPlacerClosed}
	}
	return err
}

// checkIdleLocked closes idle once closing and no complete is left.
func (p *Placer) checkIdleLocked() {
	if p.idle == nil || len(p.completes) > 0 {
		return
	}
	for _, b := range p.inflight {
		if len(b.completes) > 0 {
			return
		}
	}
	close(p.idle)
	p.idle = nil
}

// run keeps a stream to the leader open and serves it.
func (p *Placer) run(ctx context.Context) {
	tried, fails := 0, 0
	for ctx.Err() == nil {
		addr := p.nextAddr(tried)
		accepted, err := p.serve(ctx, addr)
		if ctx.Err() != nil {
			return
		}
		if accepted {
			// The stream served, then broke: start over at the hint (the
			// leader it named, the same replica, or the next one after a
			// replica that failed its probe).
			tried, fails = 0, 0
			continue
		}
		if p.opts.OnError != nil {
			p.opts.OnError(addr, err)
		}
		if h := LeaderHint(err); h != "" && h != addr && h != p.silentAddr() {
			p.mu.Lock()
			p.hint = h
			p.mu.Unlock()
			tried = 0
		} else {
			tried++
		}
		// A refusal naming a leader that is not ready yet, or no leader at
		// all: back off after the first, up to 200 ms.
		fails++
		if fails > 1 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(min(5*time.Millisecond<<min(fails-2, 6), 200*time.Millisecond)):
			}
		}
	}
}

func (p *Placer) silentAddr() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.silent
}

// nextAddr is the hint first, then the replicas in turn.
func (p *Placer) nextAddr(tried int) string {
	p.mu.Lock()
	hint := p.hint
	p.mu.Unlock()
	if hint != "" {
		if tried == 0 {
			return hint
		}
		tried--
	}
	return p.c.addrs[(int(p.c.next.Load())+tried)%len(p.c.addrs)]
}

// errSilent marks a stream abandoned because its replica failed the probe.
var errSilent = errors.New("ctlclient: the Place stream's replica failed its probe")

// serve opens a Place stream on addr and serves it until it breaks or the
// replica fails its probe. accepted says the leader accepted the stream;
// err is why it was refused or could not open, or why it ended.
func (p *Placer) serve(ctx context.Context, addr string) (accepted bool, err error) {
	cc, err := p.c.connTo(addr)
	if err != nil {
		return false, err
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// Opening, and the leader's acceptance, within one attempt's time.
	timer := time.AfterFunc(p.c.AttemptTimeout, cancel)
	stream, err := pb.NewControllerClient(cc).Place(sctx)
	if err != nil {
		timer.Stop()
		return false, err
	}
	md, _ := stream.Header()
	timer.Stop()
	if len(md.Get(AcceptedHeader)) == 0 {
		_, err := stream.Recv()
		if err == nil || err == io.EOF {
			err = status.Errorf(codes.Unavailable, "controller at %s ended the Place stream without accepting it", addr)
		}
		return false, err
	}
	p.mu.Lock()
	p.hint, p.silent = addr, ""
	p.mu.Unlock()

	// Three goroutines, owned here: each ends with sctx, and serve waits
	// for all three. The first to end says why the stream ended.
	ended := make(chan error, 3)
	go func() { ended <- p.receive(stream) }()
	go func() { ended <- p.send(sctx, stream) }()
	go func() { ended <- p.probe(sctx, cc, addr) }()
	broke := <-ended
	cancel()
	<-ended
	<-ended
	if p.opts.OnError != nil && ctx.Err() == nil {
		p.opts.OnError(addr, broke)
	}
	p.requeue(broke)
	p.mu.Lock()
	if h := LeaderHint(broke); h != "" && h != addr {
		p.hint = h
	} else if errors.Is(broke, errSilent) {
		// Reopen on the next replica; the silent one is tried again only
		// in turn.
		p.silent, p.hint = addr, p.c.addrs[(p.c.indexOf(addr)+1)%len(p.c.addrs)]
	}
	p.mu.Unlock()
	return true, broke
}

// probe asks the stream's replica for its status every ProbeInterval,
// each answer due within ProbeInterval, until ctx ends. It returns why the
// stream must be abandoned: no answer in time, no leader known, or another
// replica leads (the error then names it, as a NOT_LEADER refusal does).
func (p *Placer) probe(ctx context.Context, cc *grpc.ClientConn, addr string) error {
	op := pb.NewOperatorClient(cc)
	t := time.NewTicker(p.opts.ProbeInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		st, err := Probe(ctx, op, p.opts.ProbeInterval)
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.Is(err, ErrNoLeader):
			return silentError(addr, "knows no leader", "")
		case err != nil:
			return silentError(addr, fmt.Sprintf("did not answer its status probe within %s (%v)", p.opts.ProbeInterval, status.Convert(err).Message()), "")
		case st.LeaderId != st.NodeId:
			return silentError(addr, fmt.Sprintf("no longer leads (%s does)", st.LeaderId), st.LeaderGrpcAddr)
		}
	}
}

// silentError is an Unavailable status (the batches are sent again) that
// wraps errSilent, and names the leader (LeaderHint) when leader is set.
func silentError(addr, why, leader string) error {
	st := status.New(codes.Unavailable, fmt.Sprintf("controller at %s %s: leaving its Place stream", addr, why))
	if leader != "" {
		if d, err := st.WithDetails(&errdetails.ErrorInfo{Domain: ErrorDomain, Reason: ReasonNotLeader,
			Metadata: map[string]string{MetaLeaderAddr: leader}}); err == nil {
			st = d
		}
	}
	return &probeError{st: st}
}

// probeError is a status error that also matches errSilent.
type probeError struct{ st *status.Status }

func (e *probeError) Error() string              { return e.st.Err().Error() }
func (e *probeError) GRPCStatus() *status.Status { return e.st }
func (e *probeError) Is(target error) bool       { return target == errSilent }

// permanent: a stream error that sending the same batch again would get
// again (the batch itself is wrong).
func permanent(err error) bool {
	switch status.Code(err) {
	case codes.InvalidArgument, codes.ResourceExhausted, codes.FailedPrecondition, codes.PermissionDenied, codes.Unauthenticated, codes.Unimplemented:
		return true
	}
	return false
}

// requeue puts what a broken stream left unanswered back in front of the
// queues, in order, to be sent on the next stream. A batch the controller
// refused as malformed fails instead (its dispatches get the error; its
// completes are dropped).
func (p *Placer) requeue(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var calls []*placeCall
	var completes []string
	for i, b := range p.inflight {
		if i == 0 && permanent(err) {
			for _, c := range b.calls {
				c.done <- placeOutcome{err: err}
			}
			continue
		}
		calls = append(calls, b.calls...)
		completes = append(completes, b.completes...)
	}
	p.inflight = nil
	p.queue = append(calls, p.queue...)
	p.completes = append(completes, p.completes...)
	p.checkIdleLocked()
}

// send sends batches while there is something to send and room in flight.
func (p *Placer) send(ctx context.Context, stream grpc.BidiStreamingClient[pb.PlaceBatch, pb.PlaceResults]) error {
	var seq uint64
	for {
		b := p.take(&seq)
		if b == nil {
			select {
			case <-p.kick:
				continue
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		msg := &pb.PlaceBatch{Seq: b.seq, Dispatches: make([]*pb.DispatchRequest, len(b.calls)), Completes: b.completes}
		for i, c := range b.calls {
			msg.Dispatches[i] = c.req
		}
		if err := stream.Send(msg); err != nil {
			// The real error comes from Recv.
			<-ctx.Done()
			return err
		}
	}
}

// take builds the next batch and records it in flight, or returns nil when
// there is nothing to send or no room.
func (p *Placer) take(seq *uint64) *sentBatch {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.inflight) >= p.opts.MaxInflight {
		return nil
	}
	// Dispatches whose caller gave up before they were sent are dropped.
	kept := p.queue[:0]
	for _, c := range p.queue {
		if c.ctx.Err() == nil {
			kept = append(kept, c)
		}
	}
	clear(p.queue[len(kept):])
	p.queue = kept
	if len(p.queue) == 0 && len(p.completes) == 0 {
		return nil
	}
	*seq++
	b := &sentBatch{seq: *seq}
	n := min(len(p.queue), p.opts.MaxBatch)
	b.calls = append([]*placeCall(nil), p.queue[:n]...)
	p.queue = p.queue[n:]
	m := min(len(p.completes), p.opts.MaxBatch)
	b.completes = append([]string(nil), p.completes[:m]...)
	p.completes = p.completes[m:]
	p.inflight = append(p.inflight, b)
	return b
}

// receive delivers answers, in order, until the stream breaks.
func (p *Placer) receive(stream grpc.BidiStreamingClient[pb.PlaceBatch, pb.PlaceResults]) error {
	for {
		res, err := stream.Recv()
		if err == io.EOF {
			return status.Error(codes.Unavailable, "controller ended the Place stream")
		}
		if err != nil {
			return err
		}
		p.mu.Lock()
		if len(p.inflight) == 0 || p.inflight[0].seq != res.Seq || len(res.Dispatches) != len(p.inflight[0].calls) {
			want := "none"
			if len(p.inflight) > 0 {
				want = fmt.Sprintf("seq %d with %d results", p.inflight[0].seq, len(p.inflight[0].calls))
			}
			p.mu.Unlock()
			return status.Errorf(codes.Internal, "Place answer seq %d with %d results, expected %s", res.Seq, len(res.Dispatches), want)
		}
		b := p.inflight[0]
		p.inflight = p.inflight[1:]
		p.checkIdleLocked()
		p.mu.Unlock()
		for i, c := range b.calls {
			c.done <- outcome(res.Dispatches[i])
		}
		p.wake()
	}
}

// outcome turns a PlaceResult into what the unary Dispatch returns.
func outcome(r *pb.PlaceResult) placeOutcome {
	if codes.Code(r.Code) == codes.OK {
		return placeOutcome{resp: r.Response}
	}
	st := status.New(codes.Code(r.Code), r.Message)
	if r.Reason != "" {
		if d, err := st.WithDetails(&errdetails.ErrorInfo{Reason: r.Reason, Domain: ErrorDomain}); err == nil {
			st = d
		}
	}
	return placeOutcome{err: st.Err()}
}
