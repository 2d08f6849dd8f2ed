package sim

import (
	"fmt"
	"time"

	"github.com/lumen-project/lumen/internal/servingstats"
	"github.com/lumen-project/lumen/worker/loadreport"
)

type queueSample = servingstats.Sample

// Result is what one simulation measured.
type Result struct {
	Requests, Ended, Failed int
	// End is when the last request ended; Events the events processed;
	// Steps the engine steps run.
	End    time.Duration
	Events uint64
	Steps  uint64
	// FailAt is the first kill (0 for none); PlanAt when the first
	// MarkFailed was applied; InFlightAtFail the requests running or
	// waiting on the workers just before it.
	FailAt, PlanAt time.Duration
	InFlightAtFail int
	// Summed over the workers' cores (ResumeCachedPages: pages resumed
	// requests found in the prefix cache, core.Output.ResumeCachedPages).
	RestoredPages, RecomputedTokens, Preemptions, ResumeCachedPages int
	// Issue 24: the interrupted requests a call restored pages of from a
	// checkpoint store after the failure (of Interrupted); the checkpoint
	// bytes the serving workers sent, every copy counted; the checkpoint
	// bytes held in the live workers' stores at each queue sample.
	Restored int
	LiveCopy int // of Interrupted, those whose plan found a live copy
	// Checkpointed: of LiveCopy, those whose live copy held at least one
	// page (a request interrupted before its first page filled has
	// nothing a restore could serve).
	Checkpointed        int
	CheckpointBytesSent uint64
	CheckpointHostBytes []uint64
	// SameDomain and ShortReplicas are the fsm's DomainCounts at the end:
	// placements whose copy had to share the serving worker's node, and
	// those with fewer copies than asked.
	SameDomain, ShortReplicas uint64
	// Queue is the requests waiting at live workers, sampled.
	Queue []servingstats.Sample
	// CalibrationTokens are the tokens delivered in the second half of a
	// StopAt run.
	CalibrationTokens int
	// Wall-clock durations of fsm.Apply (Config.MeasureApply).
	ApplyDispatch, ApplyMarkFailed []time.Duration

	// Records is what a client saw of each request, by arrival; Resumes
	// the resume latency of each interrupted request that completed (to
	// the first token of its first call after the failure); Recoveries,
	// of the same requests, the time from the failure to the client's
	// next token (after a regeneration, the first token not sent before).
	Records     []*servingstats.Record
	Interrupted int
	Resumes     []time.Duration
	Recoveries  []time.Duration

	// Speculation (Config.Speculation): the counters, every pairing, and
	// every restart's phases.
	Spec     SpecStats
	Pairings []Pairing
	Phases   []PhaseSpan
	// WorkerTokens (Config.TokenSeries) is, at each queue sample, each
	// worker's committed tokens so far (by worker index).
	WorkerTokens [][]int
	// Delivered[k] is the output tokens that reached clients in second k
	// of the run.
	Delivered []int
	// Migrations counts live migration (Config.Migration).
	Migrations MigrationStats
	// Gateways counts issue 16's gateways (Config.Gateways); Spread is the
	// running requests across the workers at each queue sample.
	Gateways GatewayStats
	Spread   []SpreadSample
	// PreemptionLosses is, for each request preempted at least once, the
	// time from each preemption until its cache again held what it held
	// then (the wait for its re-prefill plus the recompute), summed over
	// its preemptions; Fragmentation, at each queue sample, the free KV
	// pages of the live workers whose queue head waits for more pages than
	// they have free, as a fraction of the cluster's pages (llumnixsim.go).
	PreemptionLosses []time.Duration
	Fragmentation    []servingstats.Sample
	Blocked          BlockedStats

	// Raft is the Raft write stream, by command type (fsm.CommandType),
	// over Config.RaftFrom..RaftTo: what the simulator applies is what a
	// leader would propose. LoadReports counts the load reports by why
	// they were sent (worker/loadreport), over the same span.
	Raft        map[string]RaftCount
	LoadReports map[loadreport.Reason]int

	// The workers' prefix caches (Config.PrefixCache): the history tokens
	// of the requests admitted with an empty cache, and of them those the
	// cache held (core.Output.CacheQueryTokens, CacheHitTokens).
	CacheQueryTokens, CacheHitTokens int
	// PrefixResumes counts the recomputed resumes placed by their cached
	// prefix rather than at the recovery plan's target (prefixResume).
	PrefixResumes int
	// CacheQueries[k] and CacheHits[k] are the same counted in second k
	// of the run.
	CacheQueries, CacheHits []int
	// Cells is, with Config.Cells > 1, each cell's part (cells.go); nil
	// for one quorum.
	Cells []CellStats
	// Config.StepTrace: every engine step, and each request's admission
	// (by arrival).
	StepTrace []StepRecord
	ReqTrace  []ReqTrace
}

// RaftCount is one command type's part of the Raft write stream: its
// commands, and their bytes in the log entries.
type RaftCount struct {
	Commands int
	Bytes    int64
}

// finish builds the per-request records.
func (s *Sim) finish() {
	for _, c := range s.cells {
		same, short := c.fsm.DomainCounts()
		s.res.SameDomain += same
		s.res.ShortReplicas += short
	}
	s.finishCells()
	s.res.Records = make([]*servingstats.Record, len(s.reqs))
	for i, r := range s.reqs {
		if r == nil { // had not arrived when the run stopped
			s.res.Records[i] = &servingstats.Record{ID: fmt.Sprintf("r%07d", i), Arrival: s.cfg.Arrivals[i].At, Err: errOpen}
			continue
		}
		rec := &servingstats.Record{ID: fmt.Sprintf("r%07d", r.idx), Arrival: r.arrival, Tokens: r.out, Err: r.failed, Interrupted: r.interrupted}
		if r.ended == 0 {
			rec.Err = errOpen
		}
		if r.out > 0 {
			rec.Chunks = []time.Duration{r.first}
			if r.out > 1 {
				rec.Chunks = append(rec.Chunks, r.last)
			}
		}
		s.res.Records[i] = rec
		if r.preempted {
			s.res.PreemptionLosses = append(s.res.PreemptionLosses, r.preemptLoss)
		}
		if r.interrupted {
			s.res.Interrupted++
			if r.restored {
				s.res.Restored++
			}
			if r.liveCopy {
				s.res.LiveCopy++
			}
			if r.checkpointed {
				s.res.Checkpointed++
			}
			if r.failed == nil && r.resumeEnd > 0 {
				s.res.Resumes = append(s.res.Resumes, r.resumeEnd-s.firstFail)
			}
			if r.failed == nil && r.afterFail > 0 {
				s.res.Recoveries = append(s.res.Recoveries, r.afterFail-s.firstFail)
			}
		}
	}
}

var errOpen = fmt.Errorf("sim: still open when the run stopped")

// Check verifies conservation at the end of a run: every arrival ended
// exactly once; every live worker's KV cache is empty, with no request
// stopped for a migration and no pre-allocation for one left; no
// migration is under way; after a last reconciliation no checkpoint page
// is left in any store; the fsm holds no placement and no reservation.
func (s *Sim) Check() error {
	for i, r := range s.reqs {
		if r == nil {
			return fmt.Errorf("sim: conservation: request %d never arrived", i)
		}
		if r.ended != 1 {
			return fmt.Errorf("sim: conservation: request %d ended %d times", r.idx, r.ended)
		}
	}
	for _, w := range s.workers {
		if !w.alive {
			continue
		}
		if !w.core.Idle() || w.core.CachedPages() != 0 || w.busy || w.core.Stopped() != 0 || w.core.Incoming() != 0 {
			return fmt.Errorf("sim: conservation: %s still has %d running, %d waiting, %d stopped for a migration, %d pre-allocations for migrations in, %d KV pages",
				w.id, w.core.Running(), w.core.Waiting(), w.core.Stopped(), w.core.Incoming(), w.core.CachedPages())
		}
		s.reconcile(w)
		if w.store.used != 0 || len(w.store.reqs) != 0 {
			return fmt.Errorf("sim: conservation: %s's checkpoint store keeps %d bytes of %d requests", w.id, w.store.used, len(w.store.reqs))
		}
	}
	if len(s.migs) != 0 {
		m := s.migs[0]
		return fmt.Errorf("sim: conservation: %d migrations still under way (request %s, %s to %s)", len(s.migs), m.id, m.src.id, m.dst.id)
	}
	for _, c := range s.cells {
		if _, n := c.fsm.Counts(); n != 0 {
			return fmt.Errorf("sim: conservation: the fsm keeps %d placements%s", n, c.name())
		}
		for id, u := range c.fsm.HolderUsage() {
			if u[0] != 0 {
				return fmt.Errorf("sim: conservation: %d bytes still reserved on %s", u[0], id)
			}
		}
	}
	return nil
}

func percentileMs(xs []time.Duration, p float64) float64 { return servingstats.Percentile(xs, p) }
