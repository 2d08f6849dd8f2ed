package gateway

// The gateway's Place stream (issue 16): one stream to the leader carries
// every placement and completion this gateway sends, in batches the leader
// proposes together (ctlclient.Placer: resends across leader changes, in
// order). A controller that does not serve Place (Unimplemented) is called
// unary, as before the stream existed.

import (
	"context"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// placeLink is the gateway's Place stream, or unary calls where the
// controller serves no stream.
type placeLink struct {
	g *Gateway
	p *ctlclient.Placer
	// unary is set once a controller answered Place with Unimplemented;
	// noStream is cancelled then, which takes the calls waiting in the
	// Placer out of it (none was sent: no stream was accepted).
	unary    atomic.Bool
	noStream context.Context
	toUnary  context.CancelFunc
	// made is closed once p is set (the Placer's OnError may run before).
	made chan struct{}
}

func newPlaceLink(g *Gateway) *placeLink {
	l := &placeLink{g: g, made: make(chan struct{})}
	l.noStream, l.toUnary = context.WithCancel(context.Background())
	l.p = g.ctl.NewPlacer(ctlclient.PlacerOptions{OnError: func(addr string, err error) {
		if status.Code(err) == codes.Unimplemented {
			if !l.unary.Swap(true) {
				g.log.Info("the controller does not serve the Place stream; placing with unary calls", "controller", addr)
				l.toUnary()
			}
			<-l.made
			l.rescue()
			return
		}
		if g.ctx.Err() == nil {
			g.log.Debug("place stream broke; reconnecting", "controller", addr, "error", err)
		}
	}})
	close(l.made)
	return l
}

// dispatch places a request and waits for its commit.
func (l *placeLink) dispatch(ctx context.Context, req *pb.DispatchRequest) (*pb.DispatchResponse, error) {
	if l.unary.Load() {
		return l.g.ctl.Dispatch(ctx, req)
	}
	pctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(l.noStream, cancel)
	resp, err := l.p.Dispatch(pctx, req)
	stop()
	cancel()
	if err != nil && l.noStream.Err() != nil && ctx.Err() == nil {
		return l.g.ctl.Dispatch(ctx, req)
	}
	return resp, err
}

// complete completes requests whose Dispatch outcome is known: over the
// stream, sent until a leader acknowledges them (the error is then nil
// at once, or ErrCompletesFull while the stream holds its limit
// unacknowledged: the flusher keeps the ids and tries again later, so its
// own bound holds); unary where there is no stream.
func (l *placeLink) complete(ctx context.Context, ids []string) error {
	if l.unary.Load() {
		_, err := l.g.ctl.Complete(ctx, &pb.CompleteRequest{RequestIds: ids})
		return err
	}
	if err := l.p.Complete(ids...); err != nil {
		return err
	}
	if l.unary.Load() {
		// The switch to unary calls came while the ids went in: its
		// rescue may have run before they did.
		l.rescue()
	}
	return nil
}

// rescue hands the completes the Placer still queues back to the flusher,
// which sends them unary: once the controller answered Unimplemented no
// stream sends them, and the gateway's first completes can go in before
// that answer (the stream opens in the background). The flusher's bound
// holds: the ids wait to be taken as a handler's do, and those left when
// the gateway stops are completed with its session.
func (l *placeLink) rescue() {
	ids := l.p.TakeCompletes()
	if len(ids) == 0 {
		return
	}
	go func() {
		for _, id := range ids {
			select {
			case l.g.done <- id:
			case <-l.g.stop:
				return
			}
		}
	}()
}

// close flushes the completions sent over the stream (for at most wait)
// and stops it.
func (l *placeLink) close(wait time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	if err := l.p.Close(ctx); err != nil && !l.unary.Load() {
		l.g.log.Warn("closing the place stream; the session's end completes what is left", "error", err)
	}
	l.toUnary()
}

// isWorkerUnavailable: the Dispatch named a worker the FSM no longer
// counts alive.
func isWorkerUnavailable(err error) bool {
	return ctlclient.Reason(err) == ctlclient.ReasonWorkerUnavailable
}
