package worker

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
)

// A holder is told to drop a request's pages only by the serving worker that
// sent them (a release when the request ends there). When the request is
// recomputed elsewhere, rebalanced, re-dispatched, or its worker fails or
// rejoins, nobody tells the holder, while the controller frees the
// reservation: the pages would stay forever and the store would fill. So the
// holder reconciles its store against the placement table, the source of
// truth for what it holds.

// reconcileHolds runs reconcile passes every ReconcileInterval until the
// worker stops.
func (w *Worker) reconcileHolds() {
	t := time.NewTicker(w.cfg.ReconcileInterval)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
		}
		w.reconcilePass(w.stopCtx)
	}
}

// reconcilePass frees the pages of every request the placement table no
// longer names this worker for, and returns how many it freed.
//
// Each request is first looked up with a stale read (any replica, cheap);
// only when that says the pages are not held here is the decision confirmed
// with a linearizable read. A lagging replica can miss a placement just
// dispatched or just moved here, but a page only arrives here after the
// gateway saw its placement committed, so a linearizable read that does not
// name this worker means the placement moved on (or ended). Pages that
// arrive while a request is being looked up are not freed with it: the next
// pass decides on them.
func (w *Worker) reconcilePass(ctx context.Context) (freed int) {
	defer func() {
		w.metrics.ckptPasses.Inc()
		if freed > 0 {
			used, _, _ := w.store.usage()
			w.log.Info("freed the checkpoint pages of requests no longer held here", "requests", freed, "stored_bytes", used)
		}
	}()
	for _, h := range w.store.requests() {
		if ctx.Err() != nil {
			return freed
		}
		held, err := w.holds(ctx, h.req, pb.Consistency_CONSISTENCY_STALE)
		if err == nil && !held {
			held, err = w.holds(ctx, h.req, pb.Consistency_CONSISTENCY_LINEARIZABLE)
		}
		if err != nil {
			// The controller is out of reach: keep everything, try again
			// at the next pass.
			w.log.Debug("checkpoint reconciliation stopped", "request", h.req, "error", err)
			return freed
		}
		if !held && w.store.releaseUnchanged(h.req, h.gen) {
			freed++
			w.metrics.ckptFreed.Inc()
			w.log.Debug("freed the checkpoint pages of a request no longer held here", "request", h.req)
		}
	}
	return freed
}

// holds reads a request's placement and reports whether this worker should
// keep its pages.
func (w *Worker) holds(ctx context.Context, req string, c pb.Consistency) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	resp, err := w.ctl.GetPlacement(ctx, &pb.GetPlacementRequest{RequestId: req, Consistency: c})
	switch {
	case status.Code(err) == codes.NotFound:
		return false, nil // completed, or never placed
	case err != nil:
		return true, err
	}
	return keepsPages(resp.Placement, w.cfg.ID), nil
}

// keepsPages reports whether worker self keeps a request's checkpoint pages
// under placement p (core.KeepsPages), or holds one of its further copies
// (issue 24's replica_holders).
func keepsPages(p *pb.Placement, self string) bool {
	for _, h := range p.GetReplicaHolders() {
		if h == self {
			return true
		}
	}
	return core.KeepsPages(p.GetHolderId(), p.GetWorkerId(), p.GetState() != pb.PlacementState_PLACEMENT_STATE_RUNNING, self)
}
