package sim

import (
	"fmt"

	"github.com/lumen-project/lumen/fsm"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
)

// What issue 23's figure (llumnix.go) measures inside a run: round-robin
// dispatch, the preemption loss of every preempted request, the
// fragmentation of the cluster's KV memory, and how the leader's round
// uses the policy's migration plan.

// MigrationFilter is how the simulated leader applies policy.PlanMigrations'
// plan.
type MigrationFilter int

const (
	// MigrateAsPlanned applies the plan as controller.migrationRound does.
	MigrateAsPlanned MigrationFilter = iota
	// MigrateNoRedispatch applies the plan less its balance re-dispatches
	// of queued requests (drains keep theirs): the policy's migrations of
	// running requests alone, for what the re-dispatches contribute.
	MigrateNoRedispatch
)

// (-migration-plan running-only, head-room, destination-headroom and
// both-headrooms were experiments on the policy before i23-policy: only
// requests with a cache migrate as pages, a blocked source sends the
// request that covers its head's lack, and a destination's room counts
// its queue head and its requests' growth, in the policy itself now.)

// MigrationFilters name the filters for flags and the JSON.
var MigrationFilters = map[string]MigrationFilter{"as-planned": MigrateAsPlanned, "no-redispatch": MigrateNoRedispatch}

func (f MigrationFilter) String() string {
	for n, v := range MigrationFilters {
		if v == f {
			return n
		}
	}
	return fmt.Sprintf("MigrationFilter(%d)", int(f))
}

// planMigrations is the round's plan under Config.MigrationFilter.
func (s *Sim) planMigrations() []fsm.PlannedMigration {
	plan, _ := s.fsm.PlanMigrations(nil)
	if s.cfg.MigrationFilter != MigrateNoRedispatch {
		return plan
	}
	out := plan[:0]
	for _, p := range plan {
		if p.Drain || !p.Redispatch {
			out = append(out, p)
		}
	}
	return out
}

// roundRobin names the next worker in full service, in turn, as d's
// serving worker (Config.RoundRobin); with none it leaves the choice to
// Apply.
func (s *Sim) roundRobin(d *pb.DispatchCmd) {
	n := len(s.workers)
	for k := range n {
		w := s.workers[(s.rr+k)%n]
		if w.alive && w.phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
			d.WorkerId, d.WorkerIncarnation = w.id, w.inc
			s.rr = (s.rr + k + 1) % n
			return
		}
	}
}

// notePreempted finds the requests w's core just preempted: a live call
// whose cache held positions after its last step and holds none now.
func (s *Sim) notePreempted(w *simWorker) {
	for _, req := range w.core.Requests() {
		sr := req.Sink.(*simRequest)
		if sr.call != req || req.Fed() != 0 || sr.kvFed == 0 {
			continue
		}
		if sr.preemptedAt < 0 {
			sr.preemptedAt, sr.fedAtPreempt = s.now, sr.kvFed
		} else {
			// Preempted again before it got back what it had: the loss
			// runs on from the first preemption.
			sr.fedAtPreempt = max(sr.fedAtPreempt, sr.kvFed)
		}
		sr.preempted, sr.kvFed = true, 0
	}
}

// refilled notes the KV positions of the requests of the step that just
// ended, and ends the preemption loss of those whose cache is back to what
// it held when they were preempted.
func (s *Sim) refilled(st core.Step) {
	for _, req := range st.Reqs {
		sr, ok := req.Sink.(*simRequest)
		if !ok || sr.call != req {
			continue
		}
		sr.kvFed = req.Fed()
		if sr.preemptedAt >= 0 && sr.kvFed >= sr.fedAtPreempt {
			sr.preemptLoss += s.now - sr.preemptedAt
			sr.preemptedAt = -1
		}
	}
}

// sampleFragmentation records the free KV pages of the live workers whose
// queue head needs more pages than they have free, as a fraction of the
// cluster's pages: memory that is free but of no use to the requests
// waiting where it is (Llumnix's fragmentation).
//
// It also counts, per live worker and sample, why a blocked queue head
// stays blocked (Result.Blocked): whether another worker has room for it,
// and whether the migration limits (one out of a source, one into a
// destination) stand in the way.
func (s *Sim) sampleFragmentation() {
	total, stuck := 0, 0
	b := &s.res.Blocked
	var outs, ins map[*simWorker]bool
	for _, w := range s.workers {
		if !w.alive {
			continue
		}
		b.WorkerSamples++
		total += s.cfg.KVPages
		free := s.cfg.KVPages - s.cachedPages(w)
		head := w.core.HeadPages()
		if w.core.Waiting() == 0 || head <= free {
			continue
		}
		stuck += free
		b.Blocked++
		b.DeficitPages += head - free
		if outs == nil {
			outs, ins = map[*simWorker]bool{}, map[*simWorker]bool{}
			for _, m := range s.migs {
				// Under way before this instant: a round of this instant
				// (the rounds and the samples share instants) does not
				// count as what the sample found.
				if m.started < s.now {
					outs[m.src], ins[m.dst] = true, true
				}
			}
		}
		room, idle := false, false
		for _, x := range s.workers {
			if x == w || !x.alive || x.phase != pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
				continue
			}
			if s.cfg.KVPages-s.cachedPages(x)-x.core.HeadPages() >= head {
				room = true
				idle = idle || !ins[x]
			}
		}
		if outs[w] {
			b.MigratingOut++
		}
		if !room {
			continue
		}
		b.RoomElsewhere++
		switch {
		case outs[w]:
			b.RoomSourceBusy++
		case !idle:
			b.RoomDestinationsBusy++
		}
	}
	if total > 0 {
		s.res.Fragmentation = append(s.res.Fragmentation, queueSample{At: s.now, Waiting: float64(stuck) / float64(total)})
	}
}

// BlockedStats count, over the queue samples and the live workers, the
// worker-samples whose queue head needs more KV pages than the worker has
// free (Blocked), the pages it lacks summed (DeficitPages), and those
// with a migration out under way (MigratingOut). RoomElsewhere are the
// blocked ones for which another worker in full service has room for the
// head (free pages less its own head's); of those, RoomSourceBusy had a
// migration out under way (the one-out limit), RoomDestinationsBusy had
// none but every worker with room had one in (the one-in limit): the rest
// no limit explains — between two rounds, or the policy planned nothing
// from the worker.
type BlockedStats struct {
	WorkerSamples, Blocked, DeficitPages, MigratingOut  int
	RoomElsewhere, RoomSourceBusy, RoomDestinationsBusy int
}
