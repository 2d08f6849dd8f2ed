package worker

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// The worker follows the controller's event stream for what the control
// plane decides about it: a migration of one of its requests starting or
// being aborted by the leader (migrate.go), and its own phase becoming
// DRAINING (drain.go). It follows one replica at a time, as the gateway
// does, and moves on when the stream breaks, when the replica stops
// answering its probe, or when the replica knows no leader (cut off from
// the quorum, its stream would go silent).

// eventProbeInterval is how often the watched replica is probed.
const eventProbeInterval = time.Second

// watchEvents follows the event stream until the worker stops.
func (w *Worker) watchEvents() {
	var from uint64
	for i := 0; ; i++ {
		err := w.watchOn(w.ctl.Conn(i), &from)
		if w.stopCtx.Err() != nil {
			return
		}
		if status.Code(err) == codes.OutOfRange {
			from = 0 // too far behind: start from now
		}
		w.log.Debug("event stream ended; moving to the next controller", "error", err)
		if (i+1)%len(w.ctl.Addrs()) != 0 {
			continue
		}
		select {
		case <-w.stop:
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// watchOn follows one replica's stream from *from, advancing it, until it
// breaks or the replica fails its probe.
func (w *Worker) watchOn(cc *grpc.ClientConn, from *uint64) error {
	ctx, cancel := context.WithCancelCause(w.stopCtx)
	defer cancel(nil)
	op := pb.NewOperatorClient(cc)
	probe := func(from *uint64) error {
		pctx, pcancel := context.WithTimeout(ctx, eventProbeInterval)
		defer pcancel()
		st, err := op.ClusterStatus(pctx, &pb.ClusterStatusRequest{})
		if err != nil {
			return err
		}
		if st.LeaderId == "" {
			return fmt.Errorf("worker: the watched controller %s knows no leader", st.NodeId)
		}
		if from != nil && *from == 0 {
			*from = st.AppliedIndex
		}
		return nil
	}
	if err := probe(from); err != nil {
		return err
	}
	stream, err := pb.NewControllerClient(cc).WatchEvents(ctx, &pb.WatchEventsRequest{FromIndex: *from})
	if err != nil {
		return err
	}
	probed := make(chan struct{})
	go func() { // owned here: it ends with ctx, and watchOn waits for it
		defer close(probed)
		t := time.NewTicker(eventProbeInterval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if err := probe(nil); err != nil {
					cancel(err)
					return
				}
			}
		}
	}()
	defer func() { cancel(nil); <-probed }()
	var last uint64
	for {
		ev, err := stream.Recv()
		if err != nil {
			if c := context.Cause(ctx); ctx.Err() != nil && c != nil && w.stopCtx.Err() == nil {
				err = c
			}
			return err
		}
		if ev.Index > last && last > 0 {
			// Every event of index last has arrived; a reconnect asks for
			// the rest of the index in progress again (each handler below
			// takes a repeat as a no-op).
			*from = last
		}
		last = ev.Index
		w.onEvent(ev)
	}
}

// onEvent acts on the events that concern this worker's incarnation.
func (w *Worker) onEvent(ev *pb.Event) {
	inc := w.incarnation.Load()
	switch b := ev.Body.(type) {
	case *pb.Event_Migration:
		mg := b.Migration
		if mg.FromWorker != w.cfg.ID || mg.FromIncarnation != inc || mg.Placement == nil {
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
		if pc.WorkerId == w.cfg.ID && pc.Incarnation == inc && pc.To == pb.WorkerPhase_WORKER_PHASE_DRAINING {
			w.drainByMigration("the controller set this worker's phase to DRAINING")
		}
	}
}
