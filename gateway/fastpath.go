package gateway

// The request path off consensus (issue 16). The gateway keeps a replica of
// the controller's load table (WatchLoad, internal/placer) and chooses a
// new request's serving worker from it — policy.PickServing over the table
// plus its own placements the table does not count yet, the function Apply
// runs — then calls the worker's Generate at once, while the Dispatch that
// names that worker goes on the Place stream. The commit's answer only
// adds: the replica counts the placement until a table does, the move
// watcher's flight learns the placement (a later stream carries its
// holder), and the worker is told the checkpoint holder Apply chose
// (SetHolder, asynchronous: decoding never waits for it). A Dispatch
// refused because the chosen worker failed or left (WORKER_UNAVAILABLE)
// cuts the stream there; the request is placed again under a new attempt
// id, that worker excluded, with the journal's tokens. With no table yet,
// or no eligible worker in it, a request is placed as before: the Dispatch
// without a worker, waiting for its commit.

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// loadInterval is the most often the controller sends the load table.
const loadInterval = 10 * time.Millisecond

// refusedError cuts a stream whose placement the controller refused: the
// request is placed again, excluding worker (the fast path), or through
// the controller alone (controller: a refusal other than the worker's
// failure, which the controller's own choice answers as before).
type refusedError struct {
	worker     string
	controller bool
	err        error
}

func (e *refusedError) Error() string {
	return fmt.Sprintf("gateway: the controller refused to place the request on %s: %v", e.worker, e.err)
}

// watchLoad keeps the replica fed from the controller replicas' WatchLoad
// streams until the gateway stops.
func (g *Gateway) watchLoad() {
	_ = g.ctl.WatchLoad(g.ctx, loadInterval, g.cfg.WatchProbeInterval, func(t *pb.LoadTable) {
		// The gateway's share of the workers (placer's shares) is its
		// session's place among the table's sessions: the session tells
		// the replica its id when it changes (session.changed).
		g.replica.Update(t)
		g.tableAt.Store(time.Now().UnixNano())
		if g.kv != nil {
			g.kv.sync(t)
		}
	})
}

// place places the request's current attempt: on the worker the replica
// chooses, at once, with its Dispatch committing in parallel; or, with no
// table or no eligible worker in it (or when the controller must choose),
// through the controller, waiting for the commit. exclude names workers
// the request must not go to (one that just refused or failed it). The
// attempt must be followed (follow) before.
func (g *Gateway) place(ctx context.Context, e *entry, viaController bool, exclude ...string) (*pb.Placement, *apiError) {
	if !viaController {
		if pl, ok, aerr := g.placeFast(e, exclude...); ok || aerr != nil {
			return pl, aerr
		}
		if _, tables := g.replica.Applied(); tables == 0 {
			g.metrics.fallbacks.WithLabelValues("no_table").Inc()
		} else {
			g.metrics.fallbacks.WithLabelValues("no_worker").Inc()
		}
	}
	g.metrics.placements.WithLabelValues("controller").Inc()
	e.viaController = true
	dctx, cancel := context.WithTimeout(ctx, g.cfg.DispatchTimeout)
	defer cancel()
	resp, err := g.session.dispatch(dctx, dispatchRequest(e), g.link.dispatch)
	if err != nil {
		return nil, dispatchError(err)
	}
	return resp.Placement, nil
}

// placeFast places the request's current attempt on the worker the replica
// chooses, exclude left out, and sends its Dispatch in parallel; ok is
// false when the replica has no eligible worker (no table, or every one
// excluded).
func (g *Gateway) placeFast(e *entry, exclude ...string) (pl *pb.Placement, ok bool, aerr *apiError) {
	req := dispatchRequest(e)
	id := req.RequestId
	var w string
	var inc uint64
	if g.kv != nil {
		// By the cached prefix of what the call will carry (kvwatch.go):
		// the prompt for a new request, the prompt and the tokens
		// streamed so far for a re-placement that has some (a resume
		// whose placement was lost, a refusal, a full queue), the prompt
		// alone when the call regenerates them.
		w, inc, ok = g.replica.TakePrefix(id, req.PromptTokens, e.placeHashes(), g.kv.idx, exclude...)
	} else {
		w, inc, ok = g.replica.Take(id, req.PromptTokens, exclude...)
	}
	if !ok {
		return nil, false, nil
	}
	pl, aerr = g.sendPlaced(e, req, w, inc)
	return pl, aerr == nil, aerr
}

// placeAt places the request's current attempt on worker, as placeFast
// does, when the replica holds it eligible (the samples of one request
// after the first, where the first runs: serve), else as any request.
func (g *Gateway) placeAt(ctx context.Context, e *entry, worker string) (*pb.Placement, *apiError) {
	req := dispatchRequest(e)
	if inc, ok := g.replica.TakeAt(req.RequestId, worker, req.PromptTokens); ok {
		return g.sendPlaced(e, req, worker, inc)
	}
	return g.place(ctx, e, false)
}

// sendPlaced sends the Dispatch of req, which the replica placed on w (of
// incarnation inc), in parallel, and returns the placement the request
// starts under.
func (g *Gateway) sendPlaced(e *entry, req *pb.DispatchRequest, w string, inc uint64) (*pb.Placement, *apiError) {
	id := req.RequestId
	req.WorkerId, req.WorkerIncarnation = w, inc
	sent := time.Now()
	settled := make(chan struct{})
	if !g.goFunc(func() {
		defer close(settled)
		dctx, cancel := context.WithTimeout(g.ctx, g.cfg.DispatchTimeout)
		defer cancel()
		resp, err := g.session.dispatch(dctx, req, g.link.dispatch)
		g.placed(id, w, sent, resp, err)
	}) {
		g.replica.Forget(id)
		return nil, errClosing
	}
	e.unsettled = append(e.unsettled, settled)
	g.metrics.placements.WithLabelValues("replica").Inc()
	e.viaController = false
	return &pb.Placement{RequestId: id, WorkerId: w, WorkerIncarnation: inc,
		PromptTokens: req.PromptTokens, MaxTokens: req.MaxTokens, Priority: req.Priority}, nil
}

// dispatchRequest is the Dispatch of the request's current attempt, with
// no worker named.
func dispatchRequest(e *entry) *pb.DispatchRequest {
	return &pb.DispatchRequest{RequestId: e.dispatchID(), PromptTokens: uint32(len(e.prompt)), MaxTokens: uint32(e.maxToken),
		Priority: e.params.priority}
}

// placed takes the answer to a Dispatch that named worker: the request
// already runs there.
func (g *Gateway) placed(id, worker string, sent time.Time, resp *pb.DispatchResponse, err error) {
	if err == nil {
		g.metrics.commit.Observe(time.Since(sent).Seconds())
		pl := resp.Placement
		g.replica.Committed(id, pl.WorkerId, resp.Index)
		g.mu.Lock()
		f := g.flights[id]
		tell := false
		if f != nil {
			f.placed = pl
			// The stream runs at this placement (no move came first):
			// its worker learns the holder.
			tell = pl.HolderId != "" && f.epoch == pl.Epoch && f.newer == nil
		}
		g.mu.Unlock()
		if tell {
			g.goFunc(func() { g.setHolder(pl) })
		}
		return
	}
	g.replica.Forget(id)
	code := status.Code(err)
	if code == codes.Unavailable || code == codes.DeadlineExceeded || code == codes.Canceled {
		// No controller answered in time: the request runs on with no
		// placement, as a request whose session expired does; a break
		// finds it NotFound and places it afresh.
		if g.ctx.Err() == nil {
			g.metrics.refusals.WithLabelValues("unconfirmed").Inc()
			g.log.Warn("a placement was not confirmed in time; the request runs on unplaced", "request", id, "worker", worker, "error", err)
		}
		return
	}
	rf := &refusedError{worker: worker, err: err, controller: !isWorkerUnavailable(err)}
	if rf.controller {
		g.metrics.refusals.WithLabelValues("other").Inc()
	} else {
		g.metrics.refusals.WithLabelValues("worker_unavailable").Inc()
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if f := g.flights[id]; f != nil {
		f.refused = rf
		if f.cancel != nil {
			f.cancel(rf)
		}
	}
}

// setHolder tells the serving worker the holder of a placement that
// committed after the request started there. The commit can beat the
// Generate call to the worker's scheduler: a call not applied while the
// request's stream still runs at that placement is tried again, a few
// times, shortly after.
func (g *Gateway) setHolder(pl *pb.Placement) {
	ctx, cancel := context.WithTimeout(g.ctx, 5*time.Second)
	defer cancel()
	wait := 10 * time.Millisecond
	for try := 0; ; try++ {
		cc, err := g.workerConn(ctx, pl.WorkerId)
		var resp *pb.SetHolderResponse
		if err == nil {
			resp, err = pb.NewInferenceClient(cc).SetHolder(ctx, &pb.SetHolderRequest{RequestId: pl.RequestId, Epoch: pl.Epoch, Holder: pl.HolderId,
				ReplicaHolders: pl.ReplicaHolders})
		}
		if err != nil {
			g.metrics.setHolder.WithLabelValues("failed").Inc()
			g.log.Debug("SetHolder failed; the request runs without a checkpoint until it moves", "request", pl.RequestId, "worker", pl.WorkerId, "error", err)
			return
		}
		if resp.Applied {
			g.metrics.setHolder.WithLabelValues("applied").Inc()
			return
		}
		if try == 3 || !g.runsAt(pl) {
			// The request ended or moved, or its stream carried the
			// holder itself.
			g.metrics.setHolder.WithLabelValues("not_applied").Inc()
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait *= 4
	}
}

// runsAt says a stream of the request runs at placement pl.
func (g *Gateway) runsAt(pl *pb.Placement) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	f := g.flights[pl.RequestId]
	return f != nil && f.cancel != nil && f.epoch == pl.Epoch && f.newer == nil && f.holder == ""
}
