package sim

import (
	"fmt"

	"github.com/lumen-project/lumen/fsm"
	"github.com/lumen-project/lumen/policy"
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
	// MigrateAsPlanned applies the plan as controller.migrationRound does:
	// the policy may pick a request still waiting in its source's queue
	// (no KV cache yet), which then moves with no pages and waits again at
	// the destination.
	MigrateAsPlanned MigrationFilter = iota
	// MigrateRunningOnly orders each source's requests with those holding
	// a KV cache first (then the policy's shortest first) and drops a
	// planned move of a request that holds none: only running requests
	// migrate, the rule issue 23 asks of the policy (the policy itself is
	// not changed here).
	MigrateRunningOnly
)

// MigrationFilters name the filters for flags and the JSON.
var MigrationFilters = map[string]MigrationFilter{"as-planned": MigrateAsPlanned, "running-only": MigrateRunningOnly}

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
	if s.cfg.MigrationFilter != MigrateRunningOnly {
		plan, _ := s.fsm.PlanMigrations(nil)
		return plan
	}
	hasKV := func(p *policy.Placed) bool {
		w := s.worker(p.Worker)
		if w == nil || !w.alive {
			return false
		}
		r := w.core.Lookup(p.RequestID)
		return r != nil && r.Fed() > 0
	}
	order := func(a, b *policy.Placed) int {
		ka, kb := hasKV(a), hasKV(b)
		if ka != kb {
			if ka {
				return -1
			}
			return 1
		}
		return policy.ShortestFirst(a, b)
	}
	plan, _ := s.fsm.PlanMigrations(order)
	out := plan[:0]
	for _, p := range plan {
		pl, _ := s.fsm.Placement(p.Cmd.RequestId)
		if pl != nil && hasKV(&policy.Placed{RequestID: pl.RequestId, Worker: pl.WorkerId}) {
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
func (s *Sim) sampleFragmentation() {
	total, stuck := 0, 0
	for _, w := range s.workers {
		if !w.alive {
			continue
		}
		total += s.cfg.KVPages
		free := s.cfg.KVPages - w.core.CachedPages()
		if w.core.Waiting() > 0 && w.core.HeadPages() > free {
			stuck += free
		}
	}
	if total > 0 {
		s.res.Fragmentation = append(s.res.Fragmentation, queueSample{At: s.now, Waiting: float64(stuck) / float64(total)})
	}
}
