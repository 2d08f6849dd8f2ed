package worker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// Live migration, the daemons' side (docs/architecture.md, "Live migration
// in the worker"). What to
// send at each stage, when to stop the request, and what the destination
// keeps are the scheduling core's decisions (core/migrate.go); this file
// carries the pages and talks to the controller.
//
// The source learns that a request of its own migrates from the
// controller's event stream (events.go): a Migration STARTED that names
// this worker and incarnation as from_worker. The controller calls no
// worker, and the worker follows the stream anyway for its own phase (a
// drain); a missed event costs only time, as the leader aborts a migration
// that does not finish within its timeout.
//
// One goroutine per migration out (migrateOut) takes each stage from the
// core between steps, exports its pages while decoding goes on (a full page
// no longer changes), sends them on a Migrate stream, and waits for the
// destination's ack before the next. After the last stage's ack the source
// commits (FinishMigration): it is the side that acts on the outcome — it
// frees the request only after the commit, and it ends the client's stream
// with the new placement (GenerateResponse.moved), which the gateway
// follows at once. The destination only checks the placement, takes the
// pages and acknowledges them; the request's next call adopts them.
//
// Every way out that is not a commit is an abort: the request runs on at
// the source as if nothing happened, the destination is told (it frees the
// pre-allocation), and so is the controller. A destination whose source
// died mid-copy hears it from the controller: the Migration ABORTED event
// that names it as to_worker frees the pre-allocation at once (abortedIn);
// one that hears nothing at all reclaims it after Config.MigrationTimeout.

// Limits of the Migrate stream.
const (
	// migratePartBytes caps the page bytes of one stream message (gRPC
	// refuses messages over 4 MiB by default): a stage goes in parts.
	migratePartBytes = 1 << 20
	// migrateCommitTimeout bounds the resolution of a commit whose outcome
	// the controller did not confirm (a leader dying mid-call).
	migrateCommitTimeout = 15 * time.Second
	// migrateEndTimeout bounds the wait for the destination to take the
	// source's end message.
	migrateEndTimeout = 2 * time.Second
)

// errMigrationEnded cancels a migration out whose request left the core
// (it finished, was cancelled, preempted, superseded or handed back).
var errMigrationEnded = errors.New("worker: migration: the request left the source")

// migrationOut is one migration out under way.
type migrationOut struct {
	id    string
	epoch uint64
	to    string
	toInc uint64
	// index is the log index of its STARTED event: two migrations of a
	// request at the same epoch (the first aborted) differ by it.
	index  uint64
	ctx    context.Context
	cancel context.CancelCauseFunc
}

// startMigrationOut starts migrating a request of this worker, as the
// controller's Migration STARTED event mg, at log index index, says —
// unless it did already (a repeated event).
func (w *Worker) startMigrationOut(mg *pb.Migration, index uint64) {
	pl := mg.Placement
	w.mu.Lock()
	defer w.mu.Unlock()
	if old := w.outgoing[pl.RequestId]; (old != nil && old.index >= index) || w.migDone[pl.RequestId] >= index {
		return // a repeated event
	}
	// An earlier migration of the request still winding down (its abort
	// is applied, which is what let this one start) ends on its own.
	ctx, cancel := context.WithCancelCause(w.stopCtx)
	m := &migrationOut{id: pl.RequestId, epoch: pl.Epoch, to: mg.ToWorker, toInc: mg.ToIncarnation, index: index, ctx: ctx, cancel: cancel}
	w.outgoing[m.id] = m
	w.metrics.migrationsLive.WithLabelValues("out").Set(float64(len(w.outgoing)))
	w.goFunc(func() { w.migrateOut(m) })
}

// abortedByController cancels the migration out that the controller's
// ABORTED event mg, at log index index, ends: the one under way to the
// event's destination, started before it.
func (w *Worker) abortedByController(mg *pb.Migration, index uint64) {
	id := mg.Placement.RequestId
	w.mu.Lock()
	m := w.outgoing[id]
	w.mu.Unlock()
	if m != nil && m.epoch == mg.Placement.Epoch && m.to == mg.ToWorker && m.toInc == mg.ToIncarnation && m.index < index {
		m.cancel(fmt.Errorf("worker: migration: the controller aborted it: %s", mg.Reason))
	}
}

// migrationIn is a migration into this worker that it accepted: the
// migration's epoch, and the applied index of the placement read that
// accepted it — an ABORTED event at or below that index ends an earlier
// migration of the request, not this one.
type migrationIn struct {
	epoch uint64
	seen  uint64
}

// acceptedIn records that the migration of request id under epoch was
// accepted on a read at applied index seen.
func (w *Worker) acceptedIn(id string, epoch, seen uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.incoming == nil || len(w.incoming) > 4096 {
		// Records of migrations adopted by a recovery (no event ends
		// them) are dropped wholesale now and then, as migDone's are.
		w.incoming = map[string]migrationIn{}
	}
	w.incoming[id] = migrationIn{epoch: epoch, seen: seen}
}

// endedIn forgets the migration in of request id (its source ended it).
func (w *Worker) endedIn(id string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.incoming, id)
}

// abortedIn frees the pre-allocation of a migration into this worker that
// the controller's ABORTED event mg, at log index index, ends: the leader
// aborted it (its timeout, the request's end) or its source failed and the
// recovery does not reuse the copy (the copy a recovery reuses gets no
// ABORTED: its assignment says so). A source that dies sends no end on its
// stream; without the event the pages and the running slot would stay
// until MigrationTimeout. The event's placement is at the migration's
// epoch, or one past it when a recovery moved the request.
func (w *Worker) abortedIn(mg *pb.Migration, index uint64) {
	id := mg.Placement.RequestId
	w.mu.Lock()
	in, ok := w.incoming[id]
	ok = ok && index > in.seen && in.epoch <= mg.Placement.Epoch
	if ok {
		delete(w.incoming, id)
	}
	w.mu.Unlock()
	if !ok {
		return
	}
	// The count moves on the scheduler goroutine with the free, so that
	// whoever sees the pages freed (through the scheduler) sees it counted.
	aborted := false
	w.sched.do(w.stopCtx, func() {
		if aborted = w.sched.core.AbortIn(id, in.epoch); aborted {
			w.metrics.migrationsIn.WithLabelValues("aborted").Inc()
		}
		w.sched.apply()
	})
	if aborted {
		w.log.Info("the controller aborted a migration into this worker; its pages are freed", "request", id,
			"epoch", in.epoch, "reason", mg.Reason)
	}
}

// migrationEnded is the core's word that a migrating request left (called
// on the scheduler goroutine).
func (w *Worker) migrationEnded(e core.MigrationEnd) {
	w.mu.Lock()
	m := w.outgoing[e.ID]
	w.mu.Unlock()
	if m != nil && m.epoch == e.Epoch {
		m.cancel(fmt.Errorf("%w: %s", errMigrationEnded, e.Why))
	}
}

// migratingOut is how many migrations out are under way.
func (w *Worker) migratingOut() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.outgoing)
}

// migrateOut runs one migration out to its end.
func (w *Worker) migrateOut(m *migrationOut) {
	log := w.log.With("request", m.id, "epoch", m.epoch, "to", m.to)
	defer func() {
		m.cancel(nil)
		w.mu.Lock()
		if w.outgoing[m.id] == m {
			delete(w.outgoing, m.id)
		}
		if len(w.migDone) > 4096 {
			clear(w.migDone)
		}
		w.migDone[m.id] = max(w.migDone[m.id], m.index)
		w.metrics.migrationsLive.WithLabelValues("out").Set(float64(len(w.outgoing)))
		w.mu.Unlock()
	}()
	var err error
	if !w.sched.do(m.ctx, func() { err = w.sched.core.MigrateOut(m.id, m.epoch) }) {
		return
	}
	if err != nil {
		// Not here under that epoch: it ended, or the event is stale.
		log.Debug("not migrating a request that does not run here", "error", err)
		w.finishMigration(m, false, err.Error())
		return
	}
	log.Debug("migrating out")
	var stream *outStream
	sctx, scancel := context.WithCancel(w.stopCtx) // the stream outlives m.ctx to carry the end
	defer scancel()
	stopped, why := w.copyOut(sctx, m, &stream)
	if why == nil {
		pl, err := w.finishMigration(m, true, "every page copied")
		if err == nil {
			// Counted here, not when the core ends the stream: the
			// gateway may cut the stream on the commit's event first.
			w.metrics.migrationsOut.WithLabelValues("committed").Inc()
			committed := false
			w.sched.do(w.stopCtx, func() {
				if r := w.sched.core.Lookup(m.id); r != nil {
					if _, st := w.sched.core.Migrating(m.id); st {
						r.Sink.(*request).moved = pl
						committed = w.sched.core.CommitOut(m.id, m.epoch)
					}
				}
				w.sched.apply()
			})
			w.metrics.migrationStop.Observe(time.Since(stopped).Seconds())
			w.endStream(stream, &pb.MigrationEnd{Committed: true})
			log.Info("migrated a request", "new_epoch", pl.GetEpoch(), "stopped_for", time.Since(stopped), "stream_ended", committed)
			return
		}
		why = fmt.Errorf("the controller did not commit: %w", err)
	}
	if c := context.Cause(m.ctx); m.ctx.Err() != nil && c != nil && !errors.Is(why, c) {
		why = c
	}
	aborted := false
	w.sched.do(w.stopCtx, func() { aborted = w.sched.core.AbortOut(m.id, m.epoch); w.sched.apply() })
	if !stopped.IsZero() {
		w.metrics.migrationStop.Observe(time.Since(stopped).Seconds())
	}
	w.metrics.migrationsOut.WithLabelValues("aborted").Inc()
	w.endStream(stream, &pb.MigrationEnd{Reason: why.Error()})
	if _, err := w.finishMigration(m, false, why.Error()); err != nil {
		log.Debug("the controller did not take the abort", "error", err)
	}
	log.Info("migration aborted; the request runs on here", "reason", why, "was_migrating", aborted)
}

// outStream is a source's Migrate stream and the destination's answers,
// read off it by one goroutine until it ends (then acks is closed).
type outStream struct {
	st   grpc.BidiStreamingClient[pb.MigrateMessage, pb.MigrateAck]
	acks chan migrateAnswer
}

type migrateAnswer struct {
	ack *pb.MigrateAck
	err error
}

// copyOut sends the stages of m to its destination until the last one is
// acknowledged (why nil) or something stops it (why says what). stopped is
// when the request stopped (zero if it never did); *stream is the stream,
// once open; it lives as long as ctx.
func (w *Worker) copyOut(ctx context.Context, m *migrationOut, stream **outStream) (stopped time.Time, why error) {
	cause := func(err error) error {
		if m.ctx.Err() != nil {
			if c := context.Cause(m.ctx); c != nil {
				return c
			}
		}
		return err
	}
	dctx, cancel := context.WithTimeout(m.ctx, 3*time.Second)
	cc, err := w.peers.Conn(dctx, m.to)
	cancel()
	if err != nil {
		return stopped, cause(fmt.Errorf("the destination %s is unreachable: %w", m.to, err))
	}
	st, err := pb.NewInferenceClient(cc).Migrate(ctx)
	if err != nil {
		return stopped, cause(fmt.Errorf("open the Migrate stream to %s: %w", m.to, err))
	}
	out := &outStream{st: st, acks: make(chan migrateAnswer)}
	*stream = out
	w.goFunc(func() {
		defer close(out.acks)
		for {
			a, err := st.Recv()
			select {
			case out.acks <- migrateAnswer{a, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	})
	for {
		var stage core.MigrationStage
		var serr error
		if !w.sched.do(m.ctx, func() { stage, serr = w.sched.core.NextStage(m.id, m.epoch); w.sched.apply() }) {
			return stopped, cause(errShutdown)
		}
		if serr != nil {
			return stopped, cause(serr)
		}
		if stage.Last {
			stopped = time.Now()
		}
		start := time.Now()
		if err := w.sendStage(m.ctx, st, stage); err != nil {
			return stopped, cause(fmt.Errorf("stage %d: %w", stage.Stage, err))
		}
		var a migrateAnswer
		select {
		case a = <-out.acks:
		case <-m.ctx.Done():
			return stopped, cause(m.ctx.Err())
		}
		if a.err == nil && a.ack == nil {
			a.err = io.ErrUnexpectedEOF
		}
		if a.err != nil {
			return stopped, cause(fmt.Errorf("the destination %s broke the stream at stage %d: %w", m.to, stage.Stage, a.err))
		}
		if a.ack.Refusal != pb.MigrateRefusal_MIGRATE_REFUSAL_UNSPECIFIED {
			return stopped, fmt.Errorf("the destination %s refused stage %d (%s): %s", m.to, stage.Stage,
				a.ack.Refusal, a.ack.Detail)
		}
		w.log.Debug("migration stage copied", "request", m.id, "stage", stage.Stage, "pages", stage.Pages(), "last", stage.Last,
			"took", time.Since(start))
		if stage.Last {
			return stopped, nil
		}
	}
}

// sendStage exports a stage's pages and sends them in parts of at most
// migratePartBytes. With a timing profile it also waits out the transfer
// at the profile's interconnect bandwidth.
func (w *Worker) sendStage(ctx context.Context, stream grpc.BidiStreamingClient[pb.MigrateMessage, pb.MigrateAck], st core.MigrationStage) error {
	start := time.Now()
	eng := w.cfg.Engine
	part := func(first int) *pb.MigrationStage {
		return &pb.MigrationStage{RequestId: st.ID, Epoch: st.Epoch, FromWorker: w.cfg.ID, FromIncarnation: w.incarnation.Load(),
			Stage: uint32(st.Stage), FirstPage: uint32(first)}
	}
	send := func(m *pb.MigrationStage) error {
		return stream.Send(&pb.MigrateMessage{Body: &pb.MigrateMessage_Stage{Stage: m}})
	}
	msg, size := part(st.First), 0
	for i, h := range st.Hashes {
		data, err := eng.ExportPage(st.Seq, st.First+i)
		if err != nil {
			return fmt.Errorf("export page %d: %w", st.First+i, err)
		}
		if size+len(data) > migratePartBytes && len(msg.Pages) > 0 {
			msg.More = true
			if err := send(msg); err != nil {
				return err
			}
			msg, size = part(st.First+i), 0
		}
		msg.PrefixHashes = append(msg.PrefixHashes, h)
		msg.Pages = append(msg.Pages, data)
		size += len(data)
	}
	if st.Last {
		// A request with nothing in the cache (it was queued here, or
		// preempted) has no sequence in the engine to export from: the
		// stage carries its history alone, and the destination queues it
		// as a dispatch (a re-dispatch, at no KV cost).
		if st.Fed > 0 {
			tail, n, err := eng.ExportTail(st.Seq)
			if err != nil || n != st.Tail {
				return fmt.Errorf("export the partial page: %d positions, the core counts %d: %v", n, st.Tail, err)
			}
			msg.Tail, msg.TailPositions = tail, uint32(n)
		}
		msg.Last, msg.History = true, st.History
		msg.Holder, msg.CheckpointedPages = st.Holder, uint32(st.Checkpointed)
		h := st.Hold
		msg.PromptTokens, msg.MaxTokens, msg.Stop, msg.Logprobs = uint32(h.Prompt), uint32(h.MaxTokens), h.Stop, h.Logprobs
		msg.Temperature, msg.TopP, msg.Seed = h.Params.Temperature, h.Params.TopP, h.Params.Seed
	}
	if err := send(msg); err != nil {
		return err
	}
	if p, ok := eng.(*engine.Paced); ok && st.Pages() > 0 {
		// The migrations out of this worker share its link: each bulk
		// copy takes its turn at the profile's bandwidth (a drain runs
		// many at once); a last stage, whose request has stopped, goes
		// ahead of them and pushes them back.
		copyTime := time.Duration(float64(p.Profile.MigrationTime(st.Pages())) * p.Scale)
		w.mu.Lock()
		if w.linkFree.Before(start) {
			w.linkFree = start
		}
		w.linkFree = w.linkFree.Add(copyTime)
		until := w.linkFree
		if st.Last {
			until = start.Add(copyTime)
		}
		w.mu.Unlock()
		if wait := time.Until(until); wait > 0 {
			t := time.NewTimer(wait)
			defer t.Stop()
			select {
			case <-t.C:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
	return nil
}

// endStream tells the destination how the migration ended, closes the
// stream and waits (a while) for the destination to close its side; without
// a stream it does nothing.
func (w *Worker) endStream(stream *outStream, end *pb.MigrationEnd) {
	if stream == nil {
		return
	}
	if err := stream.st.Send(&pb.MigrateMessage{Body: &pb.MigrateMessage_End{End: end}}); err != nil {
		return
	}
	_ = stream.st.CloseSend()
	t := time.NewTimer(migrateEndTimeout)
	defer t.Stop()
	for {
		select {
		case _, ok := <-stream.acks:
			if !ok {
				return
			}
		case <-t.C:
			return
		case <-w.stop:
			return
		}
	}
}

// finishMigration commits or aborts m with the controller. A call whose
// outcome is unknown (the leader died with it) is resolved by reading the
// placement, and retried while it is still MIGRATING under m's epoch. On a
// commit it returns the placement at the destination.
func (w *Worker) finishMigration(m *migrationOut, commit bool, reason string) (*pb.Placement, error) {
	if w.ctl == nil {
		return nil, errors.New("worker: no controller")
	}
	ctx, cancel := context.WithTimeout(w.stopCtx, migrateCommitTimeout)
	defer cancel()
	req := &pb.FinishMigrationRequest{RequestId: m.id, Epoch: m.epoch, Commit: commit, Reason: reason, ToWorker: m.to,
		ToIncarnation: m.toInc}
	for wait := 50 * time.Millisecond; ; wait = min(2*wait, time.Second) {
		resp, err := w.ctl.FinishMigration(ctx, req)
		if err == nil {
			return resp.Placement, nil
		}
		if ctlclient.MigrationOver(err) {
			return nil, err
		}
		switch status.Code(err) {
		case codes.NotFound, codes.InvalidArgument, codes.PermissionDenied, codes.Unimplemented:
			return nil, err
		}
		// The outcome is unknown: the placement says.
		gp, gerr := w.ctl.GetPlacement(ctx, &pb.GetPlacementRequest{RequestId: m.id, Consistency: pb.Consistency_CONSISTENCY_LINEARIZABLE})
		switch {
		case status.Code(gerr) == codes.NotFound:
			return nil, gerr
		case gerr != nil:
		case gp.Placement.Epoch > m.epoch && gp.Placement.WorkerId == m.to && commit:
			return gp.Placement, nil
		case gp.Placement.Epoch != m.epoch || gp.Placement.State != pb.PlacementState_PLACEMENT_STATE_MIGRATING:
			return nil, fmt.Errorf("worker: migration: the placement is %s on %s at epoch %d", gp.Placement.State,
				gp.Placement.WorkerId, gp.Placement.Epoch)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("worker: migration: no controller settled it within %s: %w", migrateCommitTimeout, err)
		case <-time.After(wait):
		}
	}
}

// Migrate is the destination's side of a migration: it checks the
// placement, takes each stage into the pre-allocated sequence the core
// gives it, and acknowledges it.
func (s *inferenceServer) Migrate(stream grpc.BidiStreamingServer[pb.MigrateMessage, pb.MigrateAck]) error {
	return s.w.migrateIn(stream)
}

func (w *Worker) migrateIn(stream grpc.BidiStreamingServer[pb.MigrateMessage, pb.MigrateAck]) error {
	var id string
	var epoch uint64
	var stage *pb.MigrationStage // the stage being assembled from its parts
	held := false                // a pre-allocation exists here
	log := w.log
	for {
		m, err := stream.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			// The source is gone without an end: the pre-allocation stays
			// for a recovery to reuse, until the controller's ABORTED
			// event (abortedIn) or the migration timeout.
			if held {
				log.Info("the source's migration stream broke; its pages stay until the controller aborts the migration or the migration timeout", "error", err)
			}
			return err
		}
		if end := m.GetEnd(); end != nil {
			if id != "" {
				w.endedIn(id)
			}
			if !end.Committed && held {
				w.sched.do(w.stopCtx, func() {
					if w.sched.core.AbortIn(id, epoch) {
						w.metrics.migrationsIn.WithLabelValues("aborted").Inc()
					}
					w.sched.apply()
				})
				log.Info("the source aborted the migration; its pages are freed", "reason", end.Reason)
			}
			return nil
		}
		part := m.GetStage()
		if part == nil {
			return status.Error(codes.InvalidArgument, "worker: migration: a message with neither a stage nor an end")
		}
		if id == "" {
			log = w.log.With("request", part.RequestId, "epoch", part.Epoch, "from", part.FromWorker)
			r, detail, seen := w.checkMigrationIn(stream.Context(), part)
			if r != pb.MigrateRefusal_MIGRATE_REFUSAL_UNSPECIFIED {
				log.Info("refused a migration", "refusal", r, "detail", detail)
				return stream.Send(&pb.MigrateAck{Stage: part.Stage, Refusal: r, Detail: detail})
			}
			id, epoch = part.RequestId, part.Epoch
			w.acceptedIn(id, epoch, seen)
		}
		if part.RequestId != id || part.Epoch != epoch {
			return status.Errorf(codes.InvalidArgument, "worker: migration: the stream migrates %q under epoch %d, a part names %q under %d",
				id, epoch, part.RequestId, part.Epoch)
		}
		if len(part.Pages) != len(part.PrefixHashes) {
			return status.Errorf(codes.InvalidArgument, "worker: migration: %d pages with %d prefix hashes", len(part.Pages), len(part.PrefixHashes))
		}
		if stage == nil {
			stage = part
		} else {
			if part.Stage != stage.Stage || int(part.FirstPage) != int(stage.FirstPage)+len(stage.Pages) {
				return status.Errorf(codes.InvalidArgument, "worker: migration: a part of stage %d from page %d after stage %d's pages up to %d",
					part.Stage, part.FirstPage, stage.Stage, int(stage.FirstPage)+len(stage.Pages))
			}
			stage.Pages = append(stage.Pages, part.Pages...)
			stage.PrefixHashes = append(stage.PrefixHashes, part.PrefixHashes...)
			stage.Last, stage.Tail, stage.TailPositions, stage.History = part.Last, part.Tail, part.TailPositions, part.History
			stage.Holder, stage.CheckpointedPages = part.Holder, part.CheckpointedPages
			stage.PromptTokens, stage.MaxTokens, stage.Stop, stage.Logprobs = part.PromptTokens, part.MaxTokens, part.Stop, part.Logprobs
			stage.Temperature, stage.TopP, stage.Seed = part.Temperature, part.TopP, part.Seed
		}
		if part.More {
			continue
		}
		st := stage
		stage = nil
		ack := w.takeStage(stream.Context(), id, epoch, st)
		held = ack.Refusal == pb.MigrateRefusal_MIGRATE_REFUSAL_UNSPECIFIED
		if !held {
			w.metrics.migrationsIn.WithLabelValues("aborted").Inc()
			log.Info("refused a migration stage; the pre-allocation is freed", "stage", st.Stage, "refusal", ack.Refusal, "detail", ack.Detail)
		}
		if err := stream.Send(ack); err != nil || !held {
			return err
		}
	}
}

// takeStage gives a stage to the core and appends its pages to the
// pre-allocated sequence, on the scheduler goroutine, and says how it went.
func (w *Worker) takeStage(ctx context.Context, id string, epoch uint64, st *pb.MigrationStage) *pb.MigrateAck {
	in := core.IncomingStage{ID: id, Epoch: epoch, Stage: int(st.Stage), First: int(st.FirstPage), Hashes: st.PrefixHashes,
		Last: st.Last, Tail: int(st.TailPositions), History: st.History, Holder: st.Holder, Checkpointed: int(st.CheckpointedPages),
		Hold: core.Hold{Prompt: int(st.PromptTokens), MaxTokens: int(st.MaxTokens), Stop: st.Stop, Logprobs: st.Logprobs,
			Params: engine.Sampling{Temperature: st.Temperature, TopP: st.TopP, Seed: st.Seed}}}
	ack := &pb.MigrateAck{Stage: st.Stage}
	vocab := w.cfg.Engine.Info().Vocab
	for i, tok := range st.History {
		if tok < 0 || int(tok) >= vocab {
			ack.Refusal, ack.Detail = pb.MigrateRefusal_MIGRATE_REFUSAL_BAD_STAGE, fmt.Sprintf("history[%d] = %d is not a token id", i, tok)
			return ack
		}
	}
	if err := in.Hold.Params.Validate(); err != nil || int(st.PromptTokens) > len(st.History) {
		// No pre-step on parameters no call could carry: the call, which
		// is checked, computes the tokens.
		in.Hold = core.Hold{}
	}
	var err error
	eng := w.cfg.Engine
	ran := w.sched.do(ctx, func() {
		var seq engine.SeqID
		if seq, err = w.sched.core.AcceptStage(time.Now(), in, eng.FreePages()); err == nil {
			if err = eng.AppendPages(seq, st.Pages, st.Tail, in.Tail); err != nil {
				w.sched.core.AbortIn(id, epoch)
			}
		}
		ack.PagesHeld = uint32(w.sched.core.IncomingPages(id))
		w.sched.apply()
		w.sched.publishStats()
	})
	if !ran {
		err = errShutdown
	}
	if err != nil {
		ack.Refusal, ack.Detail = refusalOf(err), err.Error()
		if ack.Refusal == pb.MigrateRefusal_MIGRATE_REFUSAL_OUT_OF_PAGES {
			// Planned on figures that had drifted within the report
			// thresholds: report them now (loadreport.Reporter.Refused).
			w.reportMu.Lock()
			w.reporter.Refused()
			w.reportMu.Unlock()
			w.kickLoad()
		}
	}
	return ack
}

// refusalOf maps a stage's error to the wire's refusal.
func refusalOf(err error) pb.MigrateRefusal {
	switch {
	case errors.Is(err, core.ErrMigrationOutOfPages), errors.Is(err, core.ErrMigrationFull), errors.Is(err, engine.ErrOutOfPages):
		return pb.MigrateRefusal_MIGRATE_REFUSAL_OUT_OF_PAGES
	case errors.Is(err, core.ErrStaleEpoch):
		return pb.MigrateRefusal_MIGRATE_REFUSAL_STALE_EPOCH
	case errors.Is(err, core.ErrUnknownMigration):
		return pb.MigrateRefusal_MIGRATE_REFUSAL_UNKNOWN_REQUEST
	case errors.Is(err, core.ErrBadStage), errors.Is(err, engine.ErrBadInput):
		return pb.MigrateRefusal_MIGRATE_REFUSAL_BAD_STAGE
	}
	return pb.MigrateRefusal_MIGRATE_REFUSAL_UNAVAILABLE
}

// checkMigrationIn decides whether this worker takes a migration whose
// first message is part: it must serve, and the placement must be
// MIGRATING at the part's epoch, from the part's worker, towards this
// worker's incarnation. A stale read answers first; a linearizable one
// confirms a refusal (a lagging replica may not know the migration yet).
// seen is the applied index of the read that accepted it.
func (w *Worker) checkMigrationIn(ctx context.Context, part *pb.MigrationStage) (r pb.MigrateRefusal, detail string, seen uint64) {
	switch {
	case w.ctl == nil:
		return pb.MigrateRefusal_MIGRATE_REFUSAL_UNAVAILABLE, "a standalone worker (no controller) cannot check placements; it takes no migration", 0
	case w.isDraining() || w.isLeaving():
		return pb.MigrateRefusal_MIGRATE_REFUSAL_UNAVAILABLE, fmt.Sprintf("worker %s is draining", w.cfg.ID), 0
	case !w.cfg.Engine.Loaded():
		return pb.MigrateRefusal_MIGRATE_REFUSAL_UNAVAILABLE, fmt.Sprintf("worker %s is loading its model", w.cfg.ID), 0
	case part.Stage != 1 || part.FirstPage != 0:
		return pb.MigrateRefusal_MIGRATE_REFUSAL_UNKNOWN_REQUEST, fmt.Sprintf("a stream that starts at stage %d, page %d: no such migration here", part.Stage, part.FirstPage), 0
	}
	check := func(c pb.Consistency) (pb.MigrateRefusal, string) {
		cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		resp, err := w.ctl.GetPlacement(cctx, &pb.GetPlacementRequest{RequestId: part.RequestId, Consistency: c})
		switch {
		case status.Code(err) == codes.NotFound:
			return pb.MigrateRefusal_MIGRATE_REFUSAL_UNKNOWN_REQUEST, fmt.Sprintf("request %q has no placement", part.RequestId)
		case err != nil:
			return pb.MigrateRefusal_MIGRATE_REFUSAL_UNAVAILABLE, fmt.Sprintf("could not read the placement: %v", status.Convert(err).Message())
		}
		p, inc := resp.Placement, w.incarnation.Load()
		seen = resp.AppliedIndex
		switch {
		case p.State != pb.PlacementState_PLACEMENT_STATE_MIGRATING || p.Epoch != part.Epoch:
			return pb.MigrateRefusal_MIGRATE_REFUSAL_STALE_EPOCH, fmt.Sprintf("the placement is %s at epoch %d, the migration's epoch is %d",
				p.State, p.Epoch, part.Epoch)
		case p.MigrationTarget != w.cfg.ID || p.MigrationTargetIncarnation != inc:
			return pb.MigrateRefusal_MIGRATE_REFUSAL_UNKNOWN_REQUEST, fmt.Sprintf("the placement migrates to %s (incarnation %d), not to %s (incarnation %d)",
				p.MigrationTarget, p.MigrationTargetIncarnation, w.cfg.ID, inc)
		case p.WorkerId != part.FromWorker || p.WorkerIncarnation != part.FromIncarnation:
			return pb.MigrateRefusal_MIGRATE_REFUSAL_STALE_EPOCH, fmt.Sprintf("the placement runs on %s (incarnation %d), the stream comes from %s (incarnation %d)",
				p.WorkerId, p.WorkerIncarnation, part.FromWorker, part.FromIncarnation)
		}
		return pb.MigrateRefusal_MIGRATE_REFUSAL_UNSPECIFIED, ""
	}
	if r, _ := check(pb.Consistency_CONSISTENCY_STALE); r == pb.MigrateRefusal_MIGRATE_REFUSAL_UNSPECIFIED {
		return r, "", seen
	}
	r, detail = check(pb.Consistency_CONSISTENCY_LINEARIZABLE)
	return r, detail, seen
}
