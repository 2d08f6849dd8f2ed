package worker

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/lumen-project/lumen/gpu"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// A drain by migration empties a worker without recomputing anything: its
// phase becomes DRAINING (an operator's `lumen worker drain`, or this
// worker's own GPU fault), the control plane places nothing new here and
// migrates every request away, and once nothing runs, waits, or migrates
// here any more, the worker leaves — Shutdown, which commits LEFT — and
// Exited closes. It keeps serving the calls of requests placed here until
// they move (a graceful Shutdown, by contrast, refuses every call at once).

// drainPoll is how often a draining worker checks whether it is empty.
const drainPoll = 50 * time.Millisecond

// drainByMigration starts a drain by migration, unless one or a shutdown
// is under way.
func (w *Worker) drainByMigration(reason string) {
	w.mu.Lock()
	if w.draining || w.leaving {
		w.mu.Unlock()
		return
	}
	w.leaving = true
	w.mu.Unlock()
	w.setLocalPhase(pb.WorkerPhase_WORKER_PHASE_DRAINING)
	w.log.Info("draining by migration: every request moves to another worker, then this worker leaves", "reason", reason)
	// Not on the WaitGroup: it ends in Shutdown, which waits for it.
	go w.leaveWhenEmpty()
}

// isLeaving reports whether a drain by migration is under way.
func (w *Worker) isLeaving() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.leaving
}

// leaveWhenEmpty shuts the worker down once nothing runs, waits, or
// migrates here.
func (w *Worker) leaveWhenEmpty() {
	t := time.NewTicker(drainPoll)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
		}
		if w.sched.busy() == 0 && w.migratingOut() == 0 {
			break
		}
	}
	w.log.Info("drained: nothing runs here any more; leaving")
	w.Shutdown(context.Background())
}

// Exited closes when the worker has shut down, by Shutdown or after a
// drain by migration emptied it.
func (w *Worker) Exited() <-chan struct{} { return w.exited }

// benignXIDs are the XIDs that do not drain a worker: errors of the
// application, which the GPU survives (graphics engine exception, memory
// page fault, stopped processing, preemptive cleanup).
var benignXIDs = []uint64{13, 31, 43, 45}

// watchGPU follows the GPU health source until the worker stops: a fault
// that the GPU does not survive marks it unhealthy and drains the worker
// by migration (a proactive drain: its requests move before the GPU fails
// them).
func (w *Worker) watchGPU() {
	ch, err := w.cfg.GPUHealth.Watch(w.stopCtx, w.cfg.GPUs)
	if err != nil {
		w.log.Info("no GPU health events", "reason", err)
		return
	}
	for ev := range ch {
		w.gpuFault(ev)
	}
}

// gpuFault acts on one health event.
func (w *Worker) gpuFault(ev gpu.HealthEvent) {
	w.metrics.gpuFaults.WithLabelValues(ev.Kind).Inc()
	switch {
	case ev.Kind == "ecc-single-bit":
		w.log.Warn("corrected GPU memory error (single-bit ECC)", "gpu", ev.UUID)
		return
	case ev.Kind == "xid" && slices.Contains(benignXIDs, ev.Code):
		w.log.Warn("GPU XID of an application error; the GPU goes on", "gpu", ev.UUID, "xid", ev.Code)
		return
	}
	reason := fmt.Sprintf("GPU fault: %s", ev.Kind)
	if ev.Kind == "xid" {
		reason = fmt.Sprintf("GPU fault: XID %d", ev.Code)
	}
	if ev.UUID != "" {
		reason += " on " + ev.UUID
	}
	w.metrics.gpuHealthy.Set(0)
	w.log.Error("the GPU reported a fault; marking it unhealthy and draining this worker by migration", "gpu", ev.UUID,
		"kind", ev.Kind, "code", ev.Code)
	if w.isDraining() || w.isLeaving() {
		return
	}
	w.drainByMigration(reason)
	w.goFunc(func() { w.commitDraining(reason) })
}

// commitDraining commits DRAINING for this incarnation, retrying until the
// controller applies it or the worker stops: the control plane migrates
// the requests of a DRAINING worker.
func (w *Worker) commitDraining(reason string) {
	if w.ctl == nil {
		return
	}
	for wait := 50 * time.Millisecond; ; wait = min(2*wait, time.Second) {
		ctx, cancel := context.WithTimeout(w.stopCtx, 3*time.Second)
		_, err := w.ctl.SetWorkerPhase(ctx, &pb.SetWorkerPhaseRequest{WorkerId: w.cfg.ID, Incarnation: w.incarnation.Load(),
			Phase: pb.WorkerPhase_WORKER_PHASE_DRAINING, Reason: reason})
		cancel()
		if err == nil {
			return
		}
		w.log.Warn("DRAINING not committed yet; retrying", "error", err)
		select {
		case <-w.stop:
			return
		case <-time.After(wait):
		}
	}
}
