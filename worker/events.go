package worker

import (
	"context"
	"time"

	"google.golang.org/grpc"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// The worker follows the controller's event stream for what the control
// plane decides about it: a migration of one of its requests starting or
// being aborted by the leader, a migration into it being aborted
// (migrate.go), its own phase becoming DRAINING (drain.go), and its own
// incarnation marked FAILED while it runs on (a report then makes it
// rejoin: worker.go). It follows
// one replica at a time, as the gateway does (ctlclient.Watch), and moves
// on when the stream breaks, when the replica stops answering its probe,
// or when the replica knows no leader (cut off from the quorum, its stream
// would go silent).
//
// A watch that starts from "now" — the first, and one after the replica no
// longer kept the events asked for (OutOfRange) — has not seen what came
// before: every time a stream starts, the worker reads its own row of the
// worker table on that replica, and a DRAINING phase there drains it as
// the event would have. (A migration event missed costs only time: the
// leader aborts a migration that does not finish within its timeout.)

// eventProbeInterval is how often the watched replica is probed.
const eventProbeInterval = time.Second

// watchEvents follows the event stream until the worker stops.
func (w *Worker) watchEvents() {
	watch := w.ctl.EventWatch(eventProbeInterval, w.onEvent)
	watch.Logger, watch.Started = w.log, w.readOwnPhase
	_ = watch.Run(w.stopCtx)
}

// readOwnPhase reads this worker's row from the worker table of the replica
// a watch starts on, and drains the worker if that row says DRAINING.
func (w *Worker) readOwnPhase(ctx context.Context, cc *grpc.ClientConn) error {
	ctx, cancel := context.WithTimeout(ctx, eventProbeInterval)
	defer cancel()
	resp, err := pb.NewControllerClient(cc).ListWorkers(ctx, &pb.ListWorkersRequest{Consistency: pb.Consistency_CONSISTENCY_STALE})
	if err != nil {
		return err
	}
	inc := w.incarnation.Load()
	for _, row := range resp.Workers {
		if row.Id != w.cfg.ID || row.Incarnation != inc {
			continue
		}
		switch row.Phase {
		case pb.WorkerPhase_WORKER_PHASE_DRAINING:
			w.drainByMigration("the worker table says this worker is DRAINING (its event was not seen)")
		case pb.WorkerPhase_WORKER_PHASE_FAILED:
			w.reportNow()
		}
	}
	return nil
}

// onEvent acts on the events that concern this worker's incarnation.
func (w *Worker) onEvent(ev *pb.Event) {
	inc := w.incarnation.Load()
	switch b := ev.Body.(type) {
	case *pb.Event_Migration:
		mg := b.Migration
		if mg.Placement == nil {
			return
		}
		if mg.ToWorker == w.cfg.ID && mg.ToIncarnation == inc && mg.Stage == pb.Migration_STAGE_ABORTED {
			w.abortedIn(mg, ev.Index)
			return
		}
		if mg.FromWorker != w.cfg.ID || mg.FromIncarnation != inc {
			return
		}
		switch mg.Stage {
		case pb.Migration_STAGE_STARTED:
			w.startMigrationOut(mg, ev.Index)
		case pb.Migration_STAGE_ABORTED:
			w.abortedByController(mg, ev.Index)
		}
	case *pb.Event_PhaseChanged:
		pc := b.PhaseChanged
		if pc.WorkerId != w.cfg.ID || pc.Incarnation != inc {
			return
		}
		switch pc.To {
		case pb.WorkerPhase_WORKER_PHASE_DRAINING:
			w.drainByMigration("the controller set this worker's phase to DRAINING")
		case pb.WorkerPhase_WORKER_PHASE_FAILED:
			// Marked failed while this process runs on (a pause, a
			// partition): the report's refusal makes it rejoin
			// (registerAndReport). An idle worker would send none.
			w.reportNow()
		}
	}
}
