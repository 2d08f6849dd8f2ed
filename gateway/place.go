package gateway

// The gateway's Place stream (issue 16): one stream to the leader carries
// every placement and completion this gateway sends, in batches the leader
// proposes together. Everything sent goes in one order — a request's
// completion always after its Dispatch — and a stream that breaks before
// its batches were answered sends them again, in the same order, on the
// next leader (Dispatch and Complete are idempotent by request id). A
// controller that does not serve Place (Unimplemented) is called unary, as
// before the stream existed.

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// placeBatchMax is the most dispatches (and, separately, completions) one
// PlaceBatch carries: the controller's limit.
const placeBatchMax = 4096

// placeOp is one dispatch, or one set of completions, waiting for its
// answer.
type placeOp struct {
	dispatch  *pb.DispatchRequest
	completes []string
	done      chan placeAnswer // buffered 1
}

type placeAnswer struct {
	resp     *pb.DispatchResponse
	complete *pb.CompleteResponse
	err      error
}

// sentBatch is a batch on the stream, not answered yet.
type sentBatch struct {
	seq uint64
	ops []*placeOp
}

// placeLink owns the gateway's Place stream.
type placeLink struct {
	g     *Gateway
	conns []*grpc.ClientConn
	// unary is set while the controller does not serve Place: ops go as
	// unary calls.
	unary atomic.Bool

	mu       sync.Mutex // guards queue and inflight
	queue    []*placeOp // not sent yet, in order
	inflight []sentBatch
	kick     chan struct{} // buffered 1: the queue grew
}

func newPlaceLink(g *Gateway, conns []*grpc.ClientConn) *placeLink {
	return &placeLink{g: g, conns: conns, kick: make(chan struct{}, 1)}
}

func (l *placeLink) enqueue(op *placeOp) {
	l.mu.Lock()
	l.queue = append(l.queue, op)
	l.mu.Unlock()
	select {
	case l.kick <- struct{}{}:
	default:
	}
}

// dispatch places a request. The Dispatch is sent even when ctx ends
// first: what the gateway sends later (the request's completion) follows
// it.
func (l *placeLink) dispatch(ctx context.Context, req *pb.DispatchRequest) (*pb.DispatchResponse, error) {
	if l.unary.Load() {
		return l.g.ctl.Dispatch(ctx, req)
	}
	op := &placeOp{dispatch: req, done: make(chan placeAnswer, 1)}
	l.enqueue(op)
	select {
	case a := <-op.done:
		return a.resp, a.err
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// complete completes requests, after every dispatch sent before.
func (l *placeLink) complete(ctx context.Context, ids []string) error {
	if l.unary.Load() {
		_, err := l.g.ctl.Complete(ctx, &pb.CompleteRequest{RequestIds: ids})
		return err
	}
	op := &placeOp{completes: ids, done: make(chan placeAnswer, 1)}
	l.enqueue(op)
	select {
	case a := <-op.done:
		return a.err
	case <-ctx.Done():
		// Sent later all the same; the completer keeps the ids and sends
		// them again (Complete is idempotent).
		return status.FromContextError(ctx.Err()).Err()
	}
}

// run keeps a Place stream open to whichever replica serves it (the
// leader) until the gateway stops.
func (l *placeLink) run() {
	wait := 20 * time.Millisecond
	for i := 0; ; i++ {
		cc := l.conns[i%len(l.conns)]
		sent, err := l.runOn(cc)
		if l.g.ctx.Err() != nil {
			l.failAll(errClosingLink)
			return
		}
		if status.Code(err) == codes.Unimplemented {
			// A controller without the stream: unary calls, and a look
			// again later.
			if !l.unary.Swap(true) {
				l.g.log.Info("the controller does not serve the Place stream; placing with unary calls", "controller", cc.Target())
			}
			l.drainUnary()
			select {
			case <-l.g.stop:
				return
			case <-time.After(2 * time.Second):
			}
			continue
		}
		l.g.log.Debug("place stream ended; trying the next controller", "controller", cc.Target(), "error", err)
		if sent {
			wait = 20 * time.Millisecond
		}
		if (i+1)%len(l.conns) != 0 {
			continue
		}
		select {
		case <-l.g.stop:
			l.failAll(errClosingLink)
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, 500*time.Millisecond)
	}
}

var errClosingLink = status.Error(codes.Unavailable, "gateway: closing; the placement stream is shut")

// failAll answers every op waiting with err.
func (l *placeLink) failAll(err error) {
	l.mu.Lock()
	ops := l.queue
	for _, b := range l.inflight {
		ops = append(ops, b.ops...)
	}
	l.queue, l.inflight = nil, nil
	l.mu.Unlock()
	for _, op := range ops {
		op.done <- placeAnswer{err: err}
	}
}

// drainUnary sends what waits as unary calls, in order.
func (l *placeLink) drainUnary() {
	l.mu.Lock()
	ops := l.queue
	l.queue = nil
	l.mu.Unlock()
	for _, op := range ops {
		ctx, cancel := context.WithTimeout(l.g.ctx, l.g.cfg.DispatchTimeout)
		var a placeAnswer
		if op.dispatch != nil {
			a.resp, a.err = l.g.ctl.Dispatch(ctx, op.dispatch)
		} else {
			a.complete, a.err = l.g.ctl.Complete(ctx, &pb.CompleteRequest{RequestIds: op.completes})
		}
		cancel()
		op.done <- a
	}
}

// runOn runs one Place stream on cc until it breaks; sent says a batch was
// answered on it.
func (l *placeLink) runOn(cc *grpc.ClientConn) (answered bool, err error) {
	ctx, cancel := context.WithCancel(l.g.ctx)
	defer cancel()
	st, err := pb.NewControllerClient(cc).Place(ctx)
	if err != nil {
		return false, err
	}
	broke := make(chan error, 1)
	recvDone := make(chan struct{})
	var got atomic.Bool
	go func() { // ends with the stream: runOn cancels ctx and waits for it
		defer close(recvDone)
		for {
			res, err := st.Recv()
			if err != nil {
				broke <- err
				return
			}
			if !l.answer(res) {
				broke <- status.Errorf(codes.Internal, "gateway: place stream answered batch %d out of order", res.Seq)
				return
			}
			if !got.Load() {
				got.Store(true)
				if l.unary.Swap(false) {
					l.g.log.Info("placing over the Place stream", "controller", cc.Target())
				}
			}
		}
	}()
	defer func() {
		cancel()
		<-recvDone // no late answer of this stream matches the next one's batches
		// What was sent and not answered goes again, first.
		l.mu.Lock()
		var ops []*placeOp
		for _, b := range l.inflight {
			ops = append(ops, b.ops...)
		}
		l.queue = append(ops, l.queue...)
		l.inflight = nil
		l.mu.Unlock()
		answered = got.Load()
	}()
	var seq uint64
	for {
		l.mu.Lock()
		var batch *pb.PlaceBatch
		var ops []*placeOp
		nd, nc := 0, 0
		for len(l.queue) > 0 {
			op := l.queue[0]
			if op.dispatch != nil {
				// A batch applies its completions after its dispatches: a
				// dispatch queued after a completion waits for the next.
				if nc > 0 || nd == placeBatchMax {
					break
				}
			} else if nc > 0 && nc+len(op.completes) > placeBatchMax {
				break
			}
			if batch == nil {
				seq++
				batch = &pb.PlaceBatch{Seq: seq}
			}
			if op.dispatch != nil {
				batch.Dispatches = append(batch.Dispatches, op.dispatch)
				nd++
			} else {
				batch.Completes = append(batch.Completes, op.completes...)
				nc += len(op.completes)
			}
			ops = append(ops, op)
			l.queue = l.queue[1:]
		}
		if batch != nil {
			l.inflight = append(l.inflight, sentBatch{seq: seq, ops: ops})
		}
		l.mu.Unlock()
		if batch != nil {
			if err := st.Send(batch); err != nil {
				return got.Load(), <-broke // the stream's own error
			}
			continue
		}
		select {
		case <-l.kick:
		case err := <-broke:
			return got.Load(), err
		case <-l.g.stop:
			return got.Load(), errClosingLink
		}
	}
}

// answer delivers the answers of the oldest batch on the stream; false when
// res is not its answer.
func (l *placeLink) answer(res *pb.PlaceResults) bool {
	l.mu.Lock()
	if len(l.inflight) == 0 || l.inflight[0].seq != res.Seq {
		l.mu.Unlock()
		return false
	}
	b := l.inflight[0]
	l.inflight = l.inflight[1:]
	l.mu.Unlock()
	i := 0
	for _, op := range b.ops {
		if op.dispatch == nil {
			op.done <- placeAnswer{complete: res.Complete}
			continue
		}
		var a placeAnswer
		if i < len(res.Dispatches) {
			a = resultOf(res.Dispatches[i])
		} else {
			a.err = status.Errorf(codes.Internal, "gateway: place stream answered %d of batch %d's dispatches", len(res.Dispatches), res.Seq)
		}
		i++
		op.done <- a
	}
	return true
}

// resultOf turns a PlaceResult into what the unary Dispatch would return.
func resultOf(r *pb.PlaceResult) placeAnswer {
	if codes.Code(r.Code) == codes.OK {
		if r.Response == nil || r.Response.Placement == nil {
			return placeAnswer{err: status.Error(codes.Internal, "gateway: place stream answered a dispatch with no placement")}
		}
		return placeAnswer{resp: r.Response}
	}
	st := status.New(codes.Code(r.Code), r.Message)
	if r.Reason != "" {
		if d, err := st.WithDetails(&errdetails.ErrorInfo{Reason: r.Reason, Domain: ctlclient.ErrorDomain}); err == nil {
			st = d
		}
	}
	return placeAnswer{err: st.Err()}
}

// isWorkerUnavailable: the Dispatch named a worker the FSM no longer
// counts alive.
func isWorkerUnavailable(err error) bool {
	return ctlclient.Reason(err) == reasonWorkerUnavailable
}

// reasonWorkerUnavailable is the ErrorInfo reason of a Dispatch refused
// because the worker it named failed or left.
const reasonWorkerUnavailable = "WORKER_UNAVAILABLE"
