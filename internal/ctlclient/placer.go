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

// ErrPlacerClosed: Dispatch after Close.
var ErrPlacerClosed = errors.New("ctlclient: placer closed")

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

	mu        sync.Mutex
	queue     []*placeCall // dispatches not yet in a sent batch
	completes []string     // completes not yet in a sent batch
	inflight  []*sentBatch // sent on the current stream, not yet answered
	closing   bool
	hint      string // the address to try first
	idle      chan struct{}

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

// Complete ends requests: fire-and-forget, sent until acknowledged.
func (p *Placer) Complete(ids ...string) {
	if len(ids) == 0 {
		return
	}
	p.mu.Lock()
	p.completes = append(p.completes, ids...)
	p.mu.Unlock()
	p.wake()
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
		err := p.serve(ctx, addr)
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			// The stream served, then broke: start over at the hint (the
			// leader it named, or the same replica).
			tried, fails = 0, 0
			continue
		}
		if p.opts.OnError != nil {
			p.opts.OnError(addr, err)
		}
		if h := LeaderHint(err); h != "" && h != addr {
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

// serve opens a Place stream on addr and serves it until it breaks. It
// returns nil when the stream was accepted (and then broke), or why it was
// refused or could not open.
func (p *Placer) serve(ctx context.Context, addr string) error {
	cc, err := p.c.connTo(addr)
	if err != nil {
		return err
	}
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// Opening, and the leader's acceptance, within one attempt's time.
	timer := time.AfterFunc(p.c.AttemptTimeout, cancel)
	stream, err := pb.NewControllerClient(cc).Place(sctx)
	if err != nil {
		timer.Stop()
		return err
	}
	md, _ := stream.Header()
	timer.Stop()
	if len(md.Get(AcceptedHeader)) == 0 {
		_, err := stream.Recv()
		if err == nil || err == io.EOF {
			err = status.Errorf(codes.Unavailable, "controller at %s ended the Place stream without accepting it", addr)
		}
		return err
	}
	p.mu.Lock()
	p.hint = addr
	p.mu.Unlock()

	recvErr := make(chan error, 1)
	go func() { recvErr <- p.receive(stream) }()
	sendErr := make(chan error, 1)
	go func() { sendErr <- p.send(sctx, stream) }()
	var broke error
	select {
	case broke = <-recvErr:
		cancel()
		<-sendErr
	case broke = <-sendErr:
		cancel()
		<-recvErr
	}
	if p.opts.OnError != nil && ctx.Err() == nil {
		p.opts.OnError(addr, broke)
	}
	p.requeue(broke)
	if h := LeaderHint(broke); h != "" {
		p.mu.Lock()
		p.hint = h
		p.mu.Unlock()
	}
	return nil
}

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
