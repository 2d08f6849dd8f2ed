package sim

import (
	"math"
	"time"

	"github.com/lumen-project/lumen/internal/kvpage"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// Decode runs (issue 26; core.DecodeRun). When a worker's step is one in
// which every running request decodes and nothing waits, the next steps
// are the same batch one position further until something comes into the
// worker or a request finishes. The simulator then keeps every step's end
// as an event, at the same instant and in the same order among the other
// events as before (each is scheduled when the previous one ends, as a
// step end always was), but an end no longer touches every row: the
// worker's rows get their tokens later, each in one go (core.AdvanceRow),
// so a row's memory is read once per several steps instead of once a
// step. What a step end does that others can see is done at that end:
//
//   - a row whose checkpoint page fills at this step gets its tokens up to
//     it, and the page goes to its holders now, in row order, as flush
//     sends it (a page the link's queue refuses ends the run);
//   - the load report's check reads the pages the rows hold as of this
//     step (counted here, not read from the lagging core);
//   - the next step's end is scheduled, at the time the profile gives the
//     same shape one position on (Profile.Step; its context grows by a
//     position a row).
//
// Tokens reach the clients late, each with the time it was committed
// (core.Event.At): a request's journal, first and last token times and
// the per-second delivered counts are as they were. Anything that reads
// or changes a worker in a run — a call, a cancel, a holder set, a kill,
// a pairing, the end of the run — first syncs it: every row gets its
// tokens to the last step that ended and Next builds the step in flight
// again (as it did when that step ended). The run ends (sync, then the
// usual Next) at the step before a request finishes, when a step would
// need more pages than are free (a row would sit it out), when a page is
// refused, or when the worker is paired with a drafter.
//
// -spec-trace, which records every step, runs without them.
//
// Config.NoDecodeRuns turns them off (lumen sim -decode-runs=false): every
// figure is the same byte for byte either way (TestDecodeRunsSameResult,
// and the runs of docs/benchmarks.md, "Issue 26: the simulator's speed").

// decodeRunsOff turns the decode runs off in every run (SetDecodeRuns).
var decodeRunsOff bool

// SetDecodeRuns turns the decode runs on or off in every run of this
// process (lumen sim -decode-runs; Config.NoDecodeRuns turns them off in
// one): a check that they change nothing.
func SetDecodeRuns(on bool) { decodeRunsOff = !on }

// decodeRun is a worker's decode run in progress.
type decodeRun struct {
	on    bool
	st    core.Step     // the run's batch: the core's pending step
	sinks []*simRequest // its rows' requests
	out0  []int         // each row's output index at the run's first step
	done  []int         // steps each row was given (AdvanceRow)
	ends  []time.Duration
	// fills[k] are the rows with a holder whose page fills at the steps
	// ≡ k (mod 16), in row order; allocs[k] the rows that start a page
	// at those steps.
	fills  [kvpage.Tokens][]int
	allocs [kvpage.Tokens]int
	// limit is the step at which the first row finishes: the steps
	// before it end in the run. cached is the KV pages the rows hold as
	// of the last step that ended (the core's CachedPages then).
	limit, cached int
	high          int              // the core's HighPriority
	shape         engine.StepShape // the first step's
	behind        bool             // a page was refused this step
	tm            []time.Time
	toks          []int32
}

// cachedPages is worker w's CachedPages as of now: its run's count while
// one runs.
func (s *Sim) cachedPages(w *simWorker) int {
	if w.run.on {
		return w.run.cached
	}
	return w.core.CachedPages()
}

// highPriority is w's core's HighPriority, its run's while one runs (the
// requests do not change in a run).
func (s *Sim) highPriority(w *simWorker) int {
	if w.run.on {
		return w.run.high
	}
	return w.core.HighPriority()
}

// startRun starts a decode run on w if the step st it just started (of
// shape) is the first of one.
func (s *Sim) startRun(w *simWorker, st core.Step, shape engine.StepShape) {
	if s.cfg.NoDecodeRuns || decodeRunsOff || s.noRuns || s.cfg.StepTrace || s.cfg.Migration || s.cfg.PrefixCache || s.cfg.TokenSeries || w.as != nil || len(w.between) > 0 ||
		!w.core.DecodeRun() {
		return
	}
	limit := math.MaxInt
	for i, ch := range st.Batch {
		req := st.Reqs[i]
		sr, ok := req.Sink.(*simRequest)
		// A client that waits for a token of its own (a first token, one
		// decoded again, the downtime of a migration) or a preemption's
		// loss to measure takes the usual path.
		if !ok || sr.call != req || ch.OutIndex != sr.out || sr.fresh || sr.preemptedAt >= 0 || sr.migrated {
			return
		}
		limit = min(limit, req.MaxTokens-req.Outputs())
	}
	if limit < 2 {
		return // a row finishes at this step
	}
	r := &w.run
	r.on, r.st, r.limit, r.cached, r.shape, r.behind = true, st, limit, w.core.CachedPages(), shape, false
	r.high = w.core.HighPriority()
	r.sinks, r.out0, r.done, r.ends = r.sinks[:0], r.out0[:0], r.done[:0], r.ends[:0]
	for k := range r.fills {
		r.fills[k], r.allocs[k] = r.fills[k][:0], 0
	}
	const P = kvpage.Tokens
	for i, ch := range st.Batch {
		req := st.Reqs[i]
		r.sinks = append(r.sinks, req.Sink.(*simRequest))
		r.out0 = append(r.out0, ch.OutIndex)
		r.done = append(r.done, 0)
		a := req.Fed() % P
		// Step s feeds position fed+s−1 (a new page when it is a multiple
		// of P) and leaves fed+s fed (a full page when a multiple of P).
		r.allocs[(P+1-a)%P]++
		if req.Holder != "" && req.Holder != w.id {
			r.fills[(P-a)%P] = append(r.fills[(P-a)%P], i)
		}
	}
}

// runStepDone is the end of a step of w's run (stepDone's part that
// others see; the rows' tokens wait).
func (s *Sim) runStepDone(w *simWorker) {
	r := &w.run
	r.ends = append(r.ends, s.now)
	sn := len(r.ends)
	s.res.RunSteps++
	r.cached += r.allocs[sn%kvpage.Tokens]
	w.busy = false
	for _, i := range r.fills[sn%kvpage.Tokens] {
		s.advanceRow(w, i, sn)
	}
	s.flush(w) // their tokens, and their pages to the holders now
	next := sn + 1
	if r.behind || next >= r.limit || r.allocs[next%kvpage.Tokens] > s.cfg.KVPages-r.cached || w.as != nil || len(w.between) > 0 || s.noRuns {
		// The run ends here: the usual end of a step, from flush on.
		s.endRun(w)
		s.runBetween(w)
		s.publish(w)
		if a := w.as; a != nil && a.target == w {
			s.mirror(a)
		}
		s.step(w)
		return
	}
	s.publish(w) // the report's check, with the pages as of this step
	shape := r.shape
	shape.Context += shape.Rows * sn
	s.res.Steps++
	w.busy = true
	s.atStep(s.now+s.cfg.Profile.Step(shape), w, w.gen)
}

// advanceRow gives row i of w's run its tokens up to step upTo.
func (s *Sim) advanceRow(w *simWorker, i, upTo int) {
	r := &w.run
	from := r.done[i]
	if from >= upTo {
		return
	}
	r.tm, r.toks = r.tm[:0], r.toks[:0]
	idx := r.sinks[i].idx
	for k := from; k < upTo; k++ {
		r.tm = append(r.tm, epoch.Add(r.ends[k]))
		r.toks = append(r.toks, token(idx, r.out0[i]+k))
	}
	r.done[i] = upTo
	if w.core.AdvanceRow(i, r.tm, r.toks) {
		s.fail("%s: decode run: request %s ended at a step of the run", w.id, r.st.Reqs[i].ID)
	}
}

// endRun gives every row of w's run its tokens to the last step that
// ended, delivers them, and ends the run; the core is whole again, its
// pending step the run's first (Next rebuilds the step in flight).
func (s *Sim) endRun(w *simWorker) {
	r := &w.run
	sn := len(r.ends)
	for i := range r.done {
		if r.done[i] < sn {
			s.advanceRow(w, i, sn)
			// Row by row: the core's event buffer holds one row's
			// tokens, not the whole run's (it keeps its largest size).
			s.flush(w)
		}
	}
	if sn > 0 {
		s.refilled(r.st) // as after the last step that ended
	}
	if got := w.core.CachedPages(); got != r.cached {
		s.fail("%s: decode run: %d KV pages held after %d steps, the run counted %d", w.id, got, sn, r.cached)
	}
	r.on = false
	clear(r.sinks)
	r.st = core.Step{}
}

// sync brings worker w's run, if any, to now before anything reads or
// changes the worker: the rows to the last step that ended, and the step
// in flight built again by Next as it was when that step ended.
func (s *Sim) sync(w *simWorker) {
	r := &w.run
	if !r.on {
		return
	}
	sn := len(r.ends)
	shape := r.shape
	s.endRun(w)
	if sn == 0 {
		return // the step in flight is the run's first, the core's pending
	}
	at := r.ends[sn-1]
	st := w.core.Next(epoch.Add(at), s.cfg.KVPages-w.core.CachedPages()-w.core.EvictablePages())
	s.flush(w)
	shape.Context += shape.Rows * sn
	if got := engine.BatchStep(st.Batch, func(i int) int { return len(st.Reqs[i].History) - 1 }); got != shape || len(st.Restores) > 0 {
		s.fail("%s: decode run: the step in flight is %+v, the run ran %+v", w.id, got, shape)
	}
	w.st = st
}

// syncAll syncs every worker (the end of a run; tests that read workers).
func (s *Sim) syncAll() {
	for _, w := range s.workers {
		if w.alive {
			s.sync(w)
		}
	}
}
