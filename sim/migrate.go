package sim

import (
	"errors"
	"fmt"
	"time"

	"github.com/lumen-project/lumen/fsm"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
)

// Live migration (Config.Migration), as the cluster runs it: the leader's
// round (controller/migration.go) asks the fsm for the stage-timeout aborts
// and the migrations policy.PlanMigrations decides, and applies them; the
// source's worker (worker/migrate.go) takes each stage from its core between
// steps, the stage crosses the interconnect, the destination's core accepts
// it into its pre-allocated sequence between its own steps and the ack
// brings the next stage; after the last stage's ack the source commits
// (FinishMigration), ends the request's stream with the new placement, and
// the gateway calls the destination, whose core adopts the pre-allocated
// sequence. Every decision is the core's and the fsm's; only the copy's
// duration and the messages' delays are modelled.

// maxQueuedReported caps a load report's queued ids, as the worker's
// reporter does (worker.maxQueuedReported).
const maxQueuedReported = 512

// MigrationStats are a run's live-migration counters.
type MigrationStats struct {
	// Started: MigrateCmds applied; Committed: FinishMigration commits
	// applied; Aborted: migrations that ended otherwise, by cause
	// (AbortCauses, fsm.MigrationCause's words and the source's).
	Started, Committed, Aborted int
	AbortCauses                 map[string]int
	// Stages and Pages the sources sent (core.Output); Reclaimed the
	// pre-allocations the destinations' cores reclaimed after their
	// timeout (core.Core.Expire).
	Stages, Pages, Reclaimed int
	// Queued: migrations whose request had no KV cache yet at its start
	// (it waited in the source's queue, or was preempted); Redispatched:
	// those the plan made as re-dispatches of queued requests
	// (fsm.PlannedMigration.Redispatch; one may have started since).
	Queued, Redispatched int
	// HeldTokens: tokens the destinations' held pre-steps sampled before
	// the migrated requests' calls arrived (core.Output.HeldTokens).
	HeldTokens int
	// Downtimes are the client's gaps at the switches: from the last token
	// the source streamed to the first the destination did.
	Downtimes []time.Duration
}

func (m *MigrationStats) abort(cause string) {
	m.Aborted++
	if m.AbortCauses == nil {
		m.AbortCauses = map[string]int{}
	}
	m.AbortCauses[cause]++
}

// simMigration is one migration under way, from the MigrateCmd's apply to
// the source's CommitOut (or the abort).
type simMigration struct {
	id       string
	epoch    uint64
	r        *simRequest
	src, dst *simWorker
	// The processes it involves (a process is its incarnation and its
	// kill generation): an event of a killed one is void.
	srcGen, dstGen uint64
	srcInc, dstInc uint64
	// committed: the commit is applied, the source's CommitOut is on its
	// way; done: nothing more happens (the commit's CommitOut ran, or it
	// was aborted).
	committed, done bool
	// started is when the MigrateCmd was applied.
	started time.Duration
}

func (m *simMigration) srcOK() bool {
	return m.src.alive && m.src.gen == m.srcGen && m.src.inc == m.srcInc
}

func (m *simMigration) dstOK() bool {
	return m.dst.alive && m.dst.gen == m.dstGen && m.dst.inc == m.dstInc
}

// between runs fn on w's scheduler between two steps (the worker's
// sched.do): now when no step is in flight, else once it is done; fn is
// dropped if the process dies first.
func (s *Sim) between(w *simWorker, fn func()) {
	if !w.alive {
		return
	}
	if !w.busy {
		fn()
		return
	}
	w.between = append(w.between, fn)
}

// runBetween runs the calls that waited for the step that just ended.
func (s *Sim) runBetween(w *simWorker) {
	for len(w.between) > 0 && w.alive {
		fn := w.between[0]
		w.between = w.between[1:]
		fn()
	}
	w.between = w.between[:0]
}

// migrationRound is the leader's round (controller.migrationRound): abort
// the migrations not committed within Timing.MigrationTimeout of their
// start, then apply what the fsm's PlanMigrations decides, each batch as
// one log entry.
func (s *Sim) migrationRound() {
	t := s.cfg.Timing
	cutoff := s.clock().Add(-t.MigrationTimeout).UnixNano()
	reason := fmt.Sprintf("%s: not committed within %s of its start", fsm.ReasonTimeout, t.MigrationTimeout)
	if aborts := s.fsm.MigrationsStartedBefore(cutoff, reason); len(aborts) > 0 {
		cmds := make([]*pb.Command, len(aborts))
		for i, c := range aborts {
			cmds[i] = &pb.Command{Body: &pb.Command_FinishMigration{FinishMigration: c}}
		}
		res := s.applyEntry(cmds)
		for i, c := range aborts {
			// The source hears the ABORTED event (abortedByController).
			if m := s.migByID[c.RequestId]; res[i].Err == nil && m != nil && m.epoch == c.Epoch && m.dst.id == c.ToWorker && !m.committed {
				s.abortMigration(m, "timeout", false)
			}
		}
	}
	plan := s.planMigrations()
	if len(plan) == 0 {
		return
	}
	cmds := make([]*pb.Command, len(plan))
	for i, p := range plan {
		cmds[i] = &pb.Command{Body: &pb.Command_Migrate{Migrate: p.Cmd}}
	}
	res := s.applyEntry(cmds)
	for i, p := range plan {
		if res[i].Err != nil {
			continue // the table moved on since the plan: the next round decides again
		}
		if p.Redispatch {
			s.res.Migrations.Redispatched++
		}
		s.startMigration(p.Cmd, res[i].Placement)
	}
}

// drainInterval is how often the leader looks for a worker newly DRAINING
// between its rounds (controller.DrainInterval).
const drainInterval = 50 * time.Millisecond

// drainStart is the leader seeing a worker go DRAINING at its next
// drainInterval tick and planning the drains then (controller.drainStarts):
// what it cannot place waits for the rounds.
func (s *Sim) drainStart() {
	if !s.cfg.Migration {
		return // no leader rounds in this run
	}
	tick := (s.now/drainInterval + 1) * drainInterval
	s.at(tick, func() {
		plan, _ := s.fsm.PlanDrains(nil)
		if len(plan) == 0 {
			return
		}
		cmds := make([]*pb.Command, len(plan))
		for i, p := range plan {
			cmds[i] = &pb.Command{Body: &pb.Command_Migrate{Migrate: p.Cmd}}
		}
		res := s.applyEntry(cmds)
		for i, p := range plan {
			if res[i].Err == nil {
				if p.Redispatch {
					s.res.Migrations.Redispatched++
				}
				s.startMigration(p.Cmd, res[i].Placement)
			}
		}
	})
}

// startMigration follows a MigrateCmd applied for placement pl: its source
// hears the Migration STARTED event a commit later and starts.
func (s *Sim) startMigration(c *pb.MigrateCmd, pl *pb.Placement) {
	src, dst, r := s.worker(pl.WorkerId), s.worker(c.ToWorker), s.byID[c.RequestId]
	if src == nil || dst == nil || r == nil {
		s.fail("migration of %s from %s to %s: unknown to the simulator", c.RequestId, pl.WorkerId, c.ToWorker)
		return
	}
	if old := s.migByID[c.RequestId]; old != nil {
		if old.committed && old.dst.id == pl.WorkerId && c.Epoch > old.epoch {
			// The last migration committed and its switch is still a
			// commit away (commitMigration): the placement is the
			// destination's already, and a round planned the next move
			// from there. The new source has not adopted the request (the
			// gateway's call has not come), so its MigrateOut finds no
			// such request and it aborts the move, as the worker does.
			s.res.Migrations.Started++
			s.res.Migrations.abort("source")
			s.apply(&pb.Command{Body: &pb.Command_FinishMigration{FinishMigration: &pb.FinishMigrationCmd{RequestId: c.RequestId,
				Epoch: c.Epoch, Reason: "aborted by the source: the request is not adopted yet", ToWorker: c.ToWorker, ToIncarnation: c.ToIncarnation}}})
			return
		}
		s.fail("migration of %s started while one is under way (epoch %d, to %s)", c.RequestId, old.epoch, old.dst.id)
		return
	}
	m := &simMigration{id: c.RequestId, epoch: c.Epoch, r: r, src: src, dst: dst, srcGen: src.gen, dstGen: dst.gen,
		srcInc: pl.WorkerIncarnation, dstInc: c.ToIncarnation, started: s.now}
	s.migs = append(s.migs, m)
	s.migByID[m.id] = m
	s.res.Migrations.Started++
	if !m.srcOK() {
		// Killed before the leader knew (MarkFailed comes after
		// DetectDelay): no process hears the event, and the recovery
		// plan takes the placement, MIGRATING or not.
		s.res.Migrations.abort("source_failed")
		s.endMigration(m)
		return
	}
	s.at(s.now+s.cfg.Timing.CommitDelay, func() {
		if m.done || !m.srcOK() {
			return
		}
		s.between(m.src, func() { s.migrateOut(m) })
	})
}

// migrateOut is the source's start: the core marks the request migrating.
func (s *Sim) migrateOut(m *simMigration) {
	if m.done {
		return
	}
	if !m.dstOK() {
		// Dead before the leader knew, or since: the source cannot
		// reach it.
		s.abortMigration(m, "destination_failed", true)
		return
	}
	if err := m.src.core.MigrateOut(m.id, m.epoch); err != nil {
		s.abortMigration(m, "source", true) // it ended meanwhile, or the event is stale
		return
	}
	if r := m.src.core.Lookup(m.id); r != nil && r.Fed() == 0 {
		s.res.Migrations.Queued++
	}
	s.nextStage(m)
}

// nextStage takes the next stage from the source's core (between its
// steps) and puts it on the interconnect: it reaches the destination after
// pages × page bytes / Timing.InterconnectBytesPerSec, plus LinkLatency.
// The copies out of one worker share its link, and those into one its
// link's other direction: a bulk stage starts when both are free (a drain
// runs many at once; balance moves one in and one out per worker), and a
// last stage, whose request has stopped, goes ahead of them (the stages
// already on the wire keep their arrival: a last stage's ≤ 17 pages,
// ~2 ms, are not taken from them).
func (s *Sim) nextStage(m *simMigration) {
	if m.done {
		return
	}
	st, err := m.src.core.NextStage(m.id, m.epoch)
	s.flush(m.src)
	if err != nil {
		s.abortMigration(m, "source", true)
		return
	}
	if st.Last {
		s.publish(m.src) // it left the running set
	}
	arrive := s.now
	if d := s.migProf.MigrationTime(st.Pages()); st.Last {
		// The stop-and-copy goes first: its request has stopped, and
		// its few pages push the bulk copies queued on both links back.
		arrive += d
		m.src.migOutFree, m.dst.migInFree = max(m.src.migOutFree, s.now)+d, max(m.dst.migInFree, s.now)+d
	} else if st.Pages() > 0 {
		arrive = max(s.now, m.src.migOutFree, m.dst.migInFree) + d
		m.src.migOutFree, m.dst.migInFree = arrive, arrive
	}
	arrive += s.cfg.Timing.LinkLatency
	s.at(arrive, func() {
		if m.done {
			return // aborted meanwhile (a kill of the destination aborts at once)
		}
		if !m.dstOK() {
			s.abortMigration(m, "destination_failed", true) // gone, or a new incarnation that was not asked
			return
		}
		s.between(m.dst, func() { s.acceptStage(m, st) })
	})
}

// acceptStage is the destination taking a stage into its pre-allocation
// (worker.takeStage), between its steps; its ack brings the source the
// next stage, or, after the last, the commit.
func (s *Sim) acceptStage(m *simMigration, st core.MigrationStage) {
	if m.done {
		return
	}
	d := m.dst
	in := core.IncomingStage{ID: st.ID, Epoch: st.Epoch, Stage: st.Stage, First: st.First, Hashes: st.Hashes, Last: st.Last,
		Tail: st.Tail, History: st.History, Holder: st.Holder, Checkpointed: st.Checkpointed, Hold: st.Hold}
	_, err := d.core.AcceptStage(s.clock(), in, s.cfg.KVPages-d.core.CachedPages()-d.core.EvictablePages())
	s.flush(d)
	if err != nil {
		cause := "destination"
		if errors.Is(err, core.ErrMigrationOutOfPages) || errors.Is(err, core.ErrMigrationFull) {
			cause = "destination_full"
			d.reporter.Refused() // as the worker's takeStage does
			s.publish(d)
		}
		s.abortMigration(m, cause, true)
		return
	}
	s.publish(d) // takeStage's publishStats: the pages are in use
	if st.Last {
		s.wake(d) // the held pre-step decodes it in the next step
	}
	// A pre-allocation that hears nothing more is reclaimed by the
	// destination's core after its migration timeout.
	gen := d.gen
	s.at(s.now+core.DefaultMigrationTimeout, func() {
		if d.gen == gen && d.alive {
			s.between(d, func() {
				if d.core.Expire(s.clock()) > 0 {
					s.flush(d)
					s.wake(d) // the pages it held may be what the queue waits for
				}
			})
		}
	})
	if !m.srcOK() {
		return
	}
	if !st.Last {
		s.between(m.src, func() { s.nextStage(m) })
		return
	}
	s.commitMigration(m)
}

// commitMigration is the source's FinishMigration commit after the last
// stage's ack. A commit later the gateway sees the COMMITTED event
// (gateway/moves.go): it cuts the source's stream and calls the
// destination with the journal's tokens; the source, which learns of the
// commit then too, frees the request between its steps (CommitOut).
func (s *Sim) commitMigration(m *simMigration) {
	res := s.apply(&pb.Command{Body: &pb.Command_FinishMigration{FinishMigration: &pb.FinishMigrationCmd{RequestId: m.id,
		Epoch: m.epoch, Commit: true, Reason: "every page copied", ToWorker: m.dst.id, ToIncarnation: m.dstInc}}})
	if res.Err != nil {
		s.abortMigration(m, "not_committed", true)
		return
	}
	m.committed = true
	s.res.Migrations.Committed++
	pl := res.Placement
	s.at(s.now+s.cfg.Timing.CommitDelay, func() {
		s.endMigration(m)
		if r := m.r; r.call != nil && r.worker == m.src.id && r.epoch == m.epoch {
			s.switchStream(r, pl)
		} // else the kill broke the stream: the gateway polls and finds the destination
		if m.srcOK() {
			s.between(m.src, func() {
				m.src.core.CommitOut(m.id, m.epoch)
				s.flush(m.src)
				s.wake(m.src) // its pages and slot are free
			})
		}
	})
}

// switchStream is the gateway following a committed migration: the call
// at the source is given up and the request continues at pl.
func (s *Sim) switchStream(r *simRequest, pl *pb.Placement) {
	r.call = nil
	r.migrated = r.out > 0
	s.generate(r, pl)
}

// abortMigration ends m without a move: the source's core lets the request
// run on, the destination frees its pre-allocation, and (tell) the
// controller applies the abort.
func (s *Sim) abortMigration(m *simMigration, cause string, tell bool) {
	if m.done {
		return
	}
	s.endMigration(m)
	s.res.Migrations.abort(cause)
	if m.srcOK() {
		s.between(m.src, func() {
			if m.src.core.AbortOut(m.id, m.epoch) {
				s.flush(m.src)
				s.publish(m.src)
				s.wake(m.src)
			}
		})
	}
	if m.dstOK() {
		s.between(m.dst, func() {
			if m.dst.core.AbortIn(m.id, m.epoch) {
				s.flush(m.dst)
				s.publish(m.dst)
				s.wake(m.dst)
			}
		})
	}
	if tell {
		// Refused when the tables ended it already (the request completed,
		// a worker failed): nothing to do then.
		s.apply(&pb.Command{Body: &pb.Command_FinishMigration{FinishMigration: &pb.FinishMigrationCmd{RequestId: m.id,
			Epoch: m.epoch, Reason: "aborted by the source: " + cause, ToWorker: m.dst.id, ToIncarnation: m.dstInc}}})
	}
}

func (s *Sim) endMigration(m *simMigration) {
	m.done = true
	if s.migByID[m.id] == m {
		delete(s.migByID, m.id)
	}
	for i, x := range s.migs {
		if x == m {
			s.migs = append(s.migs[:i], s.migs[i+1:]...)
			break
		}
	}
}

// migrationsEnded aborts the migrations whose request left the source's
// core (it finished, or was preempted).
func (s *Sim) migrationsEnded(ends []core.MigrationEnd) {
	for _, e := range ends {
		if m := s.migByID[e.ID]; m != nil && m.epoch == e.Epoch && !m.committed {
			s.abortMigration(m, "request_left", true)
		}
	}
}

// killMigrations is w's kill seen by its migrations: those out of it end
// (its stopped requests' streams break, the fsm's recovery takes the
// placement, and a destination keeps its copy until the recovery's call
// adopts it or its timeout reclaims it); those into it are aborted by
// their sources at once (the stream broke).
// gen is the killed process's.
func (s *Sim) killMigrations(w *simWorker, gen uint64) {
	for _, m := range append([]*simMigration(nil), s.migs...) {
		switch {
		case m.src == w && m.srcGen == gen:
			if r := m.r; r.call != nil && w.core.Lookup(m.id) == r.call {
				s.broke(r) // stopped: not among the core's running or waiting
			}
			if !m.committed {
				s.res.Migrations.abort("source_failed")
			}
			s.endMigration(m)
		case m.dst == w && m.dstGen == gen && !m.committed:
			s.abortMigration(m, "destination_failed", true)
		}
	}
}
