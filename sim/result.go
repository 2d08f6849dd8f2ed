package sim

import (
	"fmt"
	"strconv"
	"strings"
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
	// RunSteps are the steps that ended in a decode run (runs.go): the
	// simulator's own cost, not a figure.
	RunSteps uint64
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
	n := len(s.reqs)
	// The records, their first and last token times and their ids are
	// cut from three blocks, not allocated one by one: at 10,000 workers
	// a run of 60 s has 2.7 million of them.
	recs := make([]servingstats.Record, n)
	chunks := make([]time.Duration, 2*n)
	ids := requestIDs(n)
	s.res.Records = make([]*servingstats.Record, n)
	for i := range n {
		rec := &recs[i]
		s.res.Records[i] = rec
		rec.ID, rec.Arrival = ids(i), s.cfg.Arrivals[i].At
		d, x := s.done[i], s.doneExtra[i]
		if r := s.reqs[i]; r != nil { // open, or kept (Config.keepRequests)
			d = r.doneRecord()
			x = &reqExtra{failed: r.failed, resumeEnd: r.resumeEnd, afterFail: r.afterFail, preemptLoss: r.preemptLoss}
			rec.Arrival = r.arrival
		} else if d.ended == 0 { // had not arrived when the run stopped
			rec.Err = errOpen
			continue
		}
		if x == nil {
			x = &reqExtra{}
		}
		rec.Tokens, rec.Err, rec.Interrupted = int(d.out), x.failed, d.flags&doneInterrupted != 0
		if d.ended == 0 {
			rec.Err = errOpen
		}
		if d.out > 0 {
			rec.Chunks = chunks[2*i : 2*i+1 : 2*i+1]
			rec.Chunks[0] = d.first
			if d.out > 1 {
				rec.Chunks = chunks[2*i : 2*i+2 : 2*i+2]
				rec.Chunks[1] = d.last
			}
		}
		if d.flags&donePreempted != 0 {
			s.res.PreemptionLosses = append(s.res.PreemptionLosses, x.preemptLoss)
		}
		if d.flags&doneInterrupted != 0 {
			s.res.Interrupted++
			if d.flags&doneRestored != 0 {
				s.res.Restored++
			}
			if d.flags&doneLiveCopy != 0 {
				s.res.LiveCopy++
			}
			if d.flags&doneCheckpointed != 0 {
				s.res.Checkpointed++
			}
			if x.failed == nil && x.resumeEnd > 0 {
				s.res.Resumes = append(s.res.Resumes, x.resumeEnd-s.firstFail)
			}
			if x.failed == nil && x.afterFail > 0 {
				s.res.Recoveries = append(s.res.Recoveries, x.afterFail-s.firstFail)
			}
		}
	}
}

// requestIDs returns the record id of arrival i, fmt.Sprintf("r%07d", i),
// each a substring of one string built for all n.
func requestIDs(n int) func(i int) string {
	var b strings.Builder
	off := make([]int32, n+1)
	var buf [24]byte
	for i := range n {
		d := strconv.AppendInt(buf[:0], int64(i), 10)
		b.WriteByte('r')
		for range 7 - len(d) {
			b.WriteByte('0')
		}
		b.Write(d)
		off[i+1] = int32(b.Len())
	}
	all := b.String()
	return func(i int) string { return all[off[i]:off[i+1]] }
}

var errOpen = fmt.Errorf("sim: still open when the run stopped")

// Check verifies conservation at the end of a run: every arrival ended
// exactly once; every live worker's KV cache is empty, with no request
// stopped for a migration and no pre-allocation for one left; no
// migration is under way; after a last reconciliation no checkpoint page
// is left in any store; the fsm holds no placement and no reservation.
func (s *Sim) Check() error {
	for i, r := range s.reqs {
		ended := int(s.done[i].ended)
		if r != nil {
			ended = r.ended
		} else if ended == 0 {
			return fmt.Errorf("sim: conservation: request %d never arrived", i)
		}
		if ended != 1 {
			return fmt.Errorf("sim: conservation: request %d ended %d times", i, ended)
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
