package worker

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/liveness"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// Progressive recovery, the restarted worker's side (docs/architecture.md,
// "Progressive recovery in the daemon"). A worker that restarts after a failure registers
// in LOADING_DRAFT and loads its draft model; in ASSIST it drafts for the
// full-service worker the controller pairs it with while its target's
// weights load into host memory in the background; HOTSWAP is the copy to
// the device; then FULL_SERVICE. Each phase change is a committed
// SetWorkerPhase.
//
// Restart after a failure is told by a run marker in the data directory,
// written at start and removed at the end of a clean shutdown: a marker
// found at start means the last run of this worker ended without one
// (killed, crashed, the machine lost). The marker is local and known before
// any controller answers, so the draft starts loading at once, and it says
// exactly what matters: the last run did not hand its work back. The
// controller's row would say less — a clean shutdown that could not reach
// the quorum leaves a row that is not LEFT, and a fresh `lumen dev` has no
// rows at all — and needs the quorum before the worker can start loading.
// A worker without a data directory cannot tell, and always starts fresh.

// runMarker is the marker's file name in the data directory.
const runMarker = "running"

// markRunning reports whether dataDir holds the marker of a run that did
// not shut down cleanly, and writes this run's.
func markRunning(dataDir string) (restarted bool, err error) {
	if dataDir == "" {
		return false, nil
	}
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return false, err
	}
	path := filepath.Join(dataDir, runMarker)
	if _, err := os.Stat(path); err == nil {
		restarted = true
	}
	body := fmt.Sprintf("pid %d since %s\n", os.Getpid(), time.Now().Format(time.RFC3339))
	if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
		return false, fmt.Errorf("worker: write the run marker: %w", err)
	}
	return restarted, nil
}

// clearRunning removes the marker: the run ended cleanly.
func clearRunning(dataDir string) error {
	if dataDir == "" {
		return nil
	}
	if err := os.Remove(filepath.Join(dataDir, runMarker)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// recovering: p is a phase of progressive recovery before full service.
func recovering(p pb.WorkerPhase) bool {
	switch p {
	case pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT, pb.WorkerPhase_WORKER_PHASE_ASSIST, pb.WorkerPhase_WORKER_PHASE_HOTSWAP:
		return true
	}
	return false
}

// Phase is the phase this process is in (or entering: its commit may be
// in flight).
func (w *Worker) Phase() pb.WorkerPhase { return pb.WorkerPhase(w.phase.Load()) }

func (w *Worker) setLocalPhase(p pb.WorkerPhase) {
	w.phase.Store(int32(p))
	w.metrics.setPhase(p)
}

// commitPhaseLocked commits phase for the current incarnation, retrying
// until the controller applies it (a leader that dies mid-call, a quorum
// being elected) or the recovery stops; false when it stopped. A phase
// already committed commits again as a no-op. w.phaseMu must be held; it
// is released while waiting to retry, so a registration can run between
// attempts.
func (w *Worker) commitPhaseLocked(phase pb.WorkerPhase, reason string) bool {
	if w.ctl == nil {
		return true
	}
	for wait := 50 * time.Millisecond; ; wait = min(2*wait, time.Second) {
		inc := w.incarnation.Load()
		ctx, cancel := context.WithTimeout(w.recoverCtx, 3*time.Second)
		_, err := w.ctl.SetWorkerPhase(ctx, &pb.SetWorkerPhaseRequest{WorkerId: w.cfg.ID, Incarnation: inc, Phase: phase, Reason: reason})
		cancel()
		if err == nil {
			return true
		}
		if w.recoverCtx.Err() != nil {
			return false
		}
		w.log.Warn("phase change not committed yet; retrying", "phase", phaseName(phase), "incarnation", inc, "error", err,
			"reason", ctlclient.Reason(err))
		// Wait without the lock: when the refusal is for an incarnation
		// the controller marked failed (a pause outlived the failure
		// detector), the load reporter rejoins as a new incarnation and
		// registers it under phaseMu — and registration commits the local
		// phase. Holding the lock here deadlocked the two (found by the
		// jepsen assist-kill + pause-worker run): the worker never served
		// again.
		w.phaseMu.Unlock()
		select {
		case <-w.recoverCtx.Done():
			w.phaseMu.Lock()
			return false
		case <-time.After(wait):
		}
		w.phaseMu.Lock()
	}
}

// enterPhase moves this process to phase and commits it; false when the
// recovery stopped first.
func (w *Worker) enterPhase(phase pb.WorkerPhase, reason string) bool {
	w.phaseMu.Lock()
	defer w.phaseMu.Unlock()
	from := w.Phase()
	w.setLocalPhase(phase)
	if !w.commitPhaseLocked(phase, reason) {
		return false
	}
	w.log.Info("phase committed", "from", phaseName(from), "to", phaseName(phase), "reason", reason)
	return true
}

// loadTarget loads the engine's weights in one go (a fresh start).
func (w *Worker) loadTarget() error {
	start := time.Now()
	w.log.Info("loading the model")
	st := w.cfg.Recovery.Target
	if err := st.ToHost(context.Background()); err != nil {
		return fmt.Errorf("worker: load the model into host memory: %w", err)
	}
	if err := st.ToDevice(context.Background()); err != nil {
		return fmt.Errorf("worker: load the model onto the device: %w", err)
	}
	w.log.Info("model loaded", "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// recoverProgressively walks LOADING_DRAFT → ASSIST → HOTSWAP →
// FULL_SERVICE. The target's weights start loading into host memory at
// once, beside the draft's load (1.2 GB against 29.5 for Qwen3-0.6B and
// 14B: they overlap), so that progressive recovery reaches full service
// no later than a plain reload would; ASSIST lasts from the draft's load
// to the end of the target's. When the target is in host memory before
// the draft is loaded there is nothing to assist for, and the worker goes
// from LOADING_DRAFT to HOTSWAP. It stops when the worker shuts down.
func (w *Worker) recoverProgressively() {
	ctx := w.recoverCtx
	rc := w.cfg.Recovery
	began := time.Now()
	w.log.Info("restarted after a failure: progressive recovery", "phase", phaseName(w.Phase()))
	host := make(chan error, 1)
	go func() { host <- w.retry(ctx, "read the model into host memory", rc.Target.ToHost) }()
	hostDone := false
	var hostErr error
	defer func() {
		if !hostDone {
			<-host // ends with ctx
		}
	}()
	draftErr := rc.LoadDraft(ctx)
	if w.ctl != nil {
		select {
		case <-w.registered:
		case <-ctx.Done():
			return
		}
	}
	if ctx.Err() != nil {
		return
	}
	phaseStart := began
	endPhase := func(p pb.WorkerPhase) {
		w.metrics.phaseSeconds.WithLabelValues(phaseName(p)).Set(time.Since(phaseStart).Seconds())
		phaseStart = time.Now()
	}
	endPhase(pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT)
	select {
	case hostErr = <-host:
		hostDone = true
	default:
	}
	switch {
	case draftErr != nil:
		// Without a draft the worker cannot assist (and must not be
		// paired, keeping a partner from another drafter); it still loads.
		w.log.Error("could not load the draft model; recovering without assisting", "error", draftErr)
	case hostDone:
		w.log.Info("the model reached host memory before the draft loaded: nothing to assist for")
	default:
		if !w.enterPhase(pb.WorkerPhase_WORKER_PHASE_ASSIST, "draft model loaded; the model loads into host memory") {
			return
		}
		actx, stopAssist := context.WithCancel(ctx)
		assisted := make(chan struct{})
		go func() {
			defer close(assisted)
			w.assist(actx)
		}()
		hostErr, hostDone = <-host, true
		stopAssist()
		<-assisted
		endPhase(pb.WorkerPhase_WORKER_PHASE_ASSIST)
	}
	rc.Draft.Unload()
	if !hostDone {
		hostErr, hostDone = <-host, true
	}
	if hostErr != nil {
		return // stopped
	}
	if !w.enterPhase(pb.WorkerPhase_WORKER_PHASE_HOTSWAP, "model in host memory; copying it to the device") {
		return
	}
	if w.retry(ctx, "copy the model to the device", rc.Target.ToDevice) != nil {
		return
	}
	endPhase(pb.WorkerPhase_WORKER_PHASE_HOTSWAP)
	if !w.enterPhase(pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, "model on the device") {
		return
	}
	w.log.Info("progressive recovery done: in full service", "took", time.Since(began).Round(time.Millisecond))
}

// retry runs f until it succeeds or ctx ends (then ctx's error).
func (w *Worker) retry(ctx context.Context, what string, f func(context.Context) error) error {
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, 5*time.Second) {
		err := f(ctx)
		if err == nil || ctx.Err() != nil {
			return ctx.Err()
		}
		w.log.Error("could not "+what+"; retrying", "error", err, "in", wait)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
	}
}

// --- the drafter ---

// partner is the worker this one drafts for.
type partner struct {
	id          string
	incarnation uint64
	addr        string
}

// pairPoll is how often the drafter reads the worker table for its
// pairing (and, while it assists, for the end of it).
const pairPoll = 100 * time.Millisecond

// paired reads the worker table: the partner the controller paired this
// incarnation with, if any, in full service; err when the table could not
// be read.
func (w *Worker) paired(ctx context.Context) (p partner, ok bool, err error) {
	if w.ctl == nil {
		return partner{}, false, nil
	}
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	resp, err := w.ctl.ListWorkers(cctx, &pb.ListWorkersRequest{})
	if err != nil {
		return partner{}, false, err
	}
	byID := map[string]*pb.Worker{}
	for _, r := range resp.Workers {
		byID[r.Id] = r
	}
	me := byID[w.cfg.ID]
	if me == nil || me.Incarnation != w.incarnation.Load() {
		return partner{}, false, nil
	}
	t := byID[me.PairedWorker]
	if !core.Paired(me, t) {
		return partner{}, false, nil
	}
	return partner{id: t.Id, incarnation: t.Incarnation, addr: t.GrpcAddr}, true, nil
}

// assist drafts for whichever partner the controller pairs this worker
// with, until ctx ends: when a partner dies or the pairing ends, it waits
// for the next.
func (w *Worker) assist(ctx context.Context) {
	d := core.NewDrafter(0)
	eng := w.cfg.Recovery.Draft
	d.SetMaxContext(eng.Info().MaxContext)
	for ctx.Err() == nil {
		p, ok, _ := w.paired(ctx)
		if !ok {
			select {
			case <-ctx.Done():
			case <-time.After(pairPoll):
			}
			continue
		}
		start := time.Now()
		w.log.Info("assisting", "partner", p.id, "partner_incarnation", p.incarnation, "addr", p.addr)
		err := w.assistSession(ctx, p, d, eng)
		d.Reset()
		w.applyDrafter(d.Output(), eng)
		w.metrics.assistSecs.Add(time.Since(start).Seconds())
		if ctx.Err() != nil {
			return
		}
		w.log.Info("the assist of a partner ended; waiting to be paired", "partner", p.id, "error", err)
		select {
		case <-ctx.Done():
		case <-time.After(pairPoll):
		}
	}
}

// applyDrafter frees and truncates what the drafter asks of the draft
// engine.
func (w *Worker) applyDrafter(o core.DrafterOutput, eng engine.Engine) {
	for _, seq := range o.Release {
		eng.Release(seq)
	}
	for _, tr := range o.Truncates {
		if err := eng.Truncate(tr.Seq, tr.Len); err != nil {
			w.log.Debug("draft truncate", "seq", tr.Seq, "len", tr.Len, "error", err)
		}
	}
	w.metrics.drafted.Add(float64(o.Drafted))
	w.metrics.draftSteps.Add(float64(o.DraftSteps))
}

// errPairingEnded ends an assist whose pairing the table no longer shows.
var errPairingEnded = errors.New("worker: the controller ended the pairing")

// assistSession drafts for p over one Assist stream until it breaks, the
// pairing ends or ctx ends.
func (w *Worker) assistSession(ctx context.Context, p partner, d *core.Drafter, eng engine.Engine) error {
	var wg sync.WaitGroup
	defer wg.Wait() // the stream's reader and the pairing's watcher, once cancelled and closed
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	cc, err := grpc.NewClient(p.addr, w.dialCreds, liveness.DialOption(liveness.DefaultTime, liveness.DefaultTimeout))
	if err != nil {
		return err
	}
	defer cc.Close()
	stream, err := pb.NewInferenceClient(cc).Assist(sctx)
	if err != nil {
		return err
	}
	if err := stream.Send(&pb.DraftBatch{DrafterId: w.cfg.ID, DrafterIncarnation: w.incarnation.Load()}); err != nil {
		return err
	}
	mirror := make(chan *pb.MirrorBatch, 64)
	recvErr := make(chan error, 1)
	wg.Go(func() {
		for {
			mb, err := stream.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			select {
			case mirror <- mb:
			case <-sctx.Done():
				return
			}
		}
	})
	// The pairing ends in the table when the partner fails or leaves (its
	// stream may hang, not break, when it is only paused).
	wg.Go(func() {
		for w.ctl != nil {
			select {
			case <-sctx.Done():
				return
			case <-time.After(pairPoll):
			}
			// A failed read is not the end of a pairing; the next read
			// decides.
			if q, ok, err := w.paired(sctx); err == nil && (!ok || q != p) {
				cancel(errPairingEnded)
				return
			}
		}
	})
	apply := func(mb *pb.MirrorBatch) {
		for _, u := range mb.Updates {
			d.Apply(core.MirrorUpdate{ID: u.RequestId, From: int(u.From), Tokens: u.Tokens, Ended: u.Ended})
		}
		d.SetK(int(mb.K))
	}
	for {
		for drained := false; !drained; {
			select {
			case mb := <-mirror:
				apply(mb)
			default:
				drained = true
			}
		}
		w.applyDrafter(d.Output(), eng)
		st := d.Next(eng.FreePages())
		if len(st.Batch) == 0 {
			select {
			case mb := <-mirror:
				apply(mb)
				continue
			case err := <-recvErr:
				return err
			case <-sctx.Done():
				return context.Cause(sctx)
			}
		}
		out, err := eng.Forward(sctx, st.Batch)
		if err != nil {
			return fmt.Errorf("draft engine: %w", err)
		}
		d.Done(out)
		o := d.Output()
		w.applyDrafter(o, eng)
		if len(o.Drafts) == 0 {
			continue
		}
		b := &pb.DraftBatch{Drafts: make([]*pb.DraftTokens, len(o.Drafts))}
		for i, dr := range o.Drafts {
			b.Drafts[i] = &pb.DraftTokens{RequestId: dr.ID, Base: uint32(dr.Base), Tokens: dr.Tokens}
		}
		if err := stream.Send(b); err != nil {
			return err
		}
	}
}
