package gateway

import (
	"context"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// flight is one in-flight request's worker stream as the move watcher sees
// it. Moves are fenced by the placement epoch, which the controller bumps
// on every move: an event cuts the stream only when it announces a newer
// epoch than the stream's, so a late event from a lagging replica (or one
// delivered twice across a reconnect) never cuts a stream that already runs
// where the event says.
type flight struct {
	// epoch is the placement epoch of the running stream, or of the last
	// one when none runs.
	epoch uint64
	// cancel cuts the running stream; nil between streams.
	cancel context.CancelCauseFunc
	// newer is the newest placement an event announced (epoch > epoch),
	// for the next stream to start from; nil when none did.
	newer *pb.Placement
	// placed is the placement the Dispatch of a request started before
	// its commit committed (the fast path): a later stream at its epoch
	// carries its holder. refused is set when that Dispatch was refused:
	// the stream is cut, and a stream not begun yet does not begin.
	placed  *pb.Placement
	refused *refusedError
	// holder is the holder the running stream's call named.
	holder string
	// recomputeOn is the target of the last recovery plan that moved the
	// request in RECOMPUTE mode (no checkpoint to restore there), "" when
	// the last plan restores it (prefix routing only: resumeByPrefix).
	recomputeOn string
}

// movedError ends a worker stream that an event moved: the request
// continues at to, without asking the controller again. migration says a
// live migration moved it (its source is alive and stopped it; the
// destination holds its pages), not a recovery.
type movedError struct {
	to        *pb.Placement
	migration bool
}

func (e *movedError) Error() string {
	return fmt.Sprintf("gateway: the controller moved the request to %s (epoch %d)", e.to.WorkerId, e.to.Epoch)
}

// follow starts tracking request id (a dispatch id) for move events.
func (g *Gateway) follow(id string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.flights[id] = &flight{}
}

// unfollow stops tracking request id.
func (g *Gateway) unfollow(id string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.flights, id)
}

// beginStream registers the stream about to run for request id with cancel
// and returns the placement it must use: pl, or a newer one an event
// announced meanwhile, or the committed placement at pl's epoch (it names
// the holder). A non-nil refused says the placement was refused: no stream
// runs.
func (g *Gateway) beginStream(id string, pl *pb.Placement, cancel context.CancelCauseFunc) (*pb.Placement, *refusedError) {
	g.mu.Lock()
	defer g.mu.Unlock()
	f := g.flights[id]
	if f == nil {
		return pl, nil
	}
	if f.refused != nil {
		return pl, f.refused
	}
	if f.newer != nil && f.newer.Epoch > pl.Epoch {
		pl = f.newer
	}
	if f.placed != nil && f.placed.Epoch == pl.Epoch && pl.HolderId == "" && f.placed.WorkerId == pl.WorkerId {
		pl = f.placed
	}
	f.newer, f.epoch, f.cancel, f.holder = nil, pl.Epoch, cancel, pl.HolderId
	return pl, nil
}

// endStream unregisters request id's stream.
func (g *Gateway) endStream(id string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if f := g.flights[id]; f != nil {
		f.cancel = nil
	}
}

// placementMoved handles a PlacementMoved event, or a live migration's
// commit (migration): a request in flight whose stream runs at an older
// epoch is cut, and continues at pl.
func (g *Gateway) placementMoved(pl *pb.Placement, migration bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	f := g.flights[pl.RequestId]
	if f == nil || pl.Epoch <= f.epoch || (f.newer != nil && pl.Epoch <= f.newer.Epoch) {
		return // not ours, or stale: the stream already runs at this epoch or later
	}
	f.newer = pl
	if f.cancel != nil {
		f.cancel(&movedError{to: pl, migration: migration})
	}
}

// watchMoves follows the controller's events and cuts the worker stream of
// any in-flight request whose placement moved: a worker that hangs (and
// breaks no stream) is caught by Serf, and its requests resume where the
// recovery plan put them. It follows one replica at a time (ctlclient.Watch)
// and moves on to the next when the stream breaks, when the replica stops
// answering (the connection's keepalive, or the probe every
// WatchProbeInterval) or when it has lost its leader.
//
// A stream that starts from the replica's applied index (after OutOfRange:
// the events asked for are no longer kept) misses the moves before it;
// every stream therefore starts by reading the in-flight requests'
// placements from its replica (readMoves), which is at least as new as the
// stream's start.
func (g *Gateway) watchMoves() {
	w := &ctlclient.Watch[pb.Event]{Conns: g.watchConns, ProbeInterval: g.cfg.WatchProbeInterval, Logger: g.log,
		Open: ctlclient.WatchEventsOn, Index: ctlclient.EventIndex, Deliver: g.onEvent, Started: g.startWatch}
	_ = w.Run(g.ctx)
}

// readMoves reads the placements of the requests in flight from the
// replica cc, in calls of at most ctlclient.MaxGetPlacements ids, and
// applies each as a PlacementMoved event would: the epoch fence makes one
// the stream already runs at a no-op. Each call has the watch's probe
// interval to answer (a paused replica is left for the next, as its probe
// would be). A controller without GetPlacements is not read.
func (g *Gateway) readMoves(ctx context.Context, cc *grpc.ClientConn) error {
	g.mu.Lock()
	ids := make([]string, 0, len(g.flights))
	for id := range g.flights {
		ids = append(ids, id)
	}
	g.mu.Unlock()
	c := pb.NewControllerClient(cc)
	for start := 0; start < len(ids); start += ctlclient.MaxGetPlacements {
		part := ids[start:min(start+ctlclient.MaxGetPlacements, len(ids))]
		rctx, cancel := context.WithTimeout(ctx, g.cfg.WatchProbeInterval)
		resp, err := c.GetPlacements(rctx, &pb.GetPlacementsRequest{RequestIds: part, Consistency: pb.Consistency_CONSISTENCY_STALE})
		cancel()
		if status.Code(err) == codes.Unimplemented {
			return nil
		}
		if err != nil {
			return fmt.Errorf("reading the placements of %d requests in flight: %w", len(part), err)
		}
		for _, pl := range resp.Placements {
			g.placementMoved(pl, false)
		}
	}
	return nil
}

// startWatch runs when the event stream opens on a replica: it reads the
// cluster's strategy and the in-flight requests' placements from it.
func (g *Gateway) startWatch(ctx context.Context, cc *grpc.ClientConn) error {
	if err := g.readStrategy(ctx, cc); err != nil {
		return err
	}
	return g.readMoves(ctx, cc)
}

// readStrategy reads the cluster's strategy from the replica whose event
// stream just opened: its state is at least as new as the stream's start,
// and the StrategyChanged events the stream brings keep it current.
func (g *Gateway) readStrategy(ctx context.Context, cc *grpc.ClientConn) error {
	st, err := ctlclient.Probe(ctx, pb.NewOperatorClient(cc), g.cfg.WatchProbeInterval)
	if err != nil {
		return err
	}
	g.strategy.Store(int32(st.Strategy))
	return nil
}

// regenerates reports whether a resumed call sends the prompt alone, its
// output tokens to be decoded again (stop-and-restart: the strategy the
// watcher last saw). Until the strategy is known a resume carries the whole
// history, as under every other strategy.
func (g *Gateway) regenerates() bool {
	return policy.Strategy(g.strategy.Load()).Regenerates()
}

// onEvent acts on one event; a repeat (an event of the index in progress
// when a stream broke, delivered again) is harmless: the epoch fence.
func (g *Gateway) onEvent(ev *pb.Event) {
	if rp := ev.GetRecoveryPlan(); rp != nil && g.kv != nil {
		// Before the plan's PlacementMoved events (the same index,
		// emitted after it): a recomputed resume may be placed by prefix.
		g.recoveryPlanned(rp)
	}
	if mv := ev.GetPlacementMoved(); mv != nil && mv.Placement != nil {
		g.placementMoved(mv.Placement, false)
	}
	// A committed migration moves the stream too (the source's last
	// message usually says so first; the epoch fence makes either one
	// enough).
	if mg := ev.GetMigration(); mg != nil && mg.Stage == pb.Migration_STAGE_COMMITTED && mg.Placement != nil {
		g.placementMoved(mg.Placement, true)
	}
	if sc := ev.GetStrategyChanged(); sc != nil {
		g.strategy.Store(int32(sc.To))
	}
	g.watched.Store(ev.Index)
}
