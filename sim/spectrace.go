package sim

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"slices"
	"sort"
	"time"

	"github.com/lumen-project/lumen/internal/servingstats"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// The speculation trace (issue 22, Config.StepTrace): where the TTFT of
// the requests that arrive while drafters assist goes, lumen against
// lumen-no-spec on the same arrivals. The simulator records every engine
// step (its modelled time, and what it would have been without the
// verification's positions) and when each request was first admitted and
// where; SpecTraceReport joins two runs by request.

// StepRecord is one engine step of one worker.
type StepRecord struct {
	At, Dur time.Duration
	// Plain is the step's modelled time without its verification
	// positions (K = 0, the context a plain decode reads): Dur − Plain is
	// what verifying cost every request in the step.
	Plain  time.Duration
	Worker int32
	// Rows are the decoding rows, Verifying those that verify drafts (at
	// K, the step's widest), Prefill the prefill tokens; Waiting the
	// requests left in the worker's queue for the step, Admitted those
	// admitted in it; Committed the tokens it committed.
	Rows, Verifying, K, Prefill, Waiting, Admitted, Committed int32
	// Assisted: the worker was a drafter's target when the step started.
	Assisted bool
	// Drafts is the draft tokens verified.
	Drafts int32
	// The worker's KV pages in use, its queue head's pages and its
	// running requests when the step started (what its load report says:
	// policy.Worker.Freeness).
	Used, Head, Running int32
}

// ReqTrace is when and where a request's call was admitted (its first
// chunk ran) before its first token.
type ReqTrace struct {
	Admitted time.Duration // 0: never admitted before its first token
	Worker   int32
	Assisted bool // at a drafter's target
	call     *core.Request
}

// traceStep records the step st of w about to run for dur.
func (s *Sim) traceStep(w *simWorker, st core.Step, shape engine.StepShape, dur time.Duration) {
	rec := StepRecord{At: s.now, Dur: dur, Worker: int32(workerIndex(w.id)), Rows: int32(shape.Rows), K: int32(shape.K),
		Prefill: int32(shape.Prefill), Waiting: int32(w.core.Waiting()), Assisted: w.as != nil && w.as.target == w,
		Used: int32(w.core.CachedPages()), Head: int32(w.core.HeadPages()), Running: int32(w.core.Running())}
	plain := shape
	plain.K = 0
	for i, ch := range st.Batch {
		if ch.Sample > 1 {
			rec.Verifying++
			rec.Drafts += int32(ch.Sample - 1)
			plain.Context -= ch.Sample - 1
		}
		r, ok := st.Reqs[i].Sink.(*simRequest)
		if !ok || r.first >= 0 || r.call != st.Reqs[i] {
			continue
		}
		if t := &s.res.ReqTrace[r.idx]; t.call != r.call {
			t.call, t.Admitted, t.Worker, t.Assisted = r.call, s.now, rec.Worker, rec.Assisted
			rec.Admitted++
		}
	}
	// Dur less the restores' imports: Plain is the same step's.
	rec.Plain = dur - s.cfg.Profile.Step(shape) + s.cfg.Profile.Step(plain)
	s.res.StepTrace = append(s.res.StepTrace, rec)
	w.traceAt = len(s.res.StepTrace) - 1
}

// SpecTraceReport writes where the TTFT of the requests arriving while
// lumen's drafters assisted goes: lumen (run) against lumen-no-spec
// (noSpec) on the same arrivals, both with Config.StepTrace. The window
// is from the first pairing to the last one's end; a worker counts as
// assisted at t when it was a drafter's target in lumen's run at t (in
// both runs: the same workers over the same spans).
func SpecTraceReport(out io.Writer, run, noSpec *Result, warmup time.Duration) {
	if len(run.Pairings) == 0 || len(run.ReqTrace) == 0 || len(noSpec.ReqTrace) != len(run.ReqTrace) {
		fmt.Fprintf(out, "spec trace: no pairing or no trace\n")
		return
	}
	from, to := run.Pairings[0].From, run.Pairings[0].To
	spans := map[int32][][2]time.Duration{}
	for _, p := range run.Pairings {
		from, to = min(from, p.From), max(to, p.To)
		i := int32(workerIndex(p.Target))
		spans[i] = append(spans[i], [2]time.Duration{p.From, p.To})
	}
	assisted := func(w int32, t time.Duration) bool {
		for _, sp := range spans[w] {
			if t >= sp[0] && t < sp[1] {
				return true
			}
		}
		return false
	}
	fmt.Fprintf(out, "\nspec trace: %d pairings, assist window %.1f–%.1f s; requests arriving in it, lumen vs lumen-no-spec (same arrivals)\n",
		len(run.Pairings), from.Seconds(), to.Seconds())
	type acc struct {
		n                            int
		ttft1, ttft0, q1, q0, p1, p0 float64 // ms sums: TTFT, queue (arrival → admission), admission → first token
		t1, t0                       []time.Duration
	}
	var all acc
	cls := map[string]*acc{}
	order := []string{}
	add := func(k string, d1, d0, q1, q0 time.Duration) {
		a := cls[k]
		if a == nil {
			a = &acc{}
			cls[k] = a
			order = append(order, k)
		}
		for _, a := range []*acc{a, &all} {
			a.n++
			a.ttft1 += ms(d1)
			a.ttft0 += ms(d0)
			a.q1 += ms(q1)
			a.q0 += ms(q0)
			a.p1 += ms(d1 - q1)
			a.p0 += ms(d0 - q0)
			a.t1 = append(a.t1, d1)
			a.t0 = append(a.t0, d0)
		}
	}
	type pair struct {
		i      int
		d1, d0 time.Duration
	}
	var pairs []pair
	for i, r := range run.Records {
		r0 := noSpec.Records[i]
		if r.Arrival < warmup || r.Arrival < from || r.Arrival >= to || r.Err != nil || r0.Err != nil || r.Interrupted {
			continue
		}
		d1, ok1 := r.TTFT()
		d0, ok0 := r0.TTFT()
		t1, t0 := run.ReqTrace[i], noSpec.ReqTrace[i]
		if !ok1 || !ok0 || t1.Admitted == 0 || t0.Admitted == 0 {
			continue
		}
		k1 := "unassisted"
		if t1.Assisted {
			k1 = "assisted"
		}
		k0 := "unassisted"
		if assisted(t0.Worker, t0.Admitted) {
			k0 = "assisted"
		}
		add("lumen at "+k1+", no-spec at "+k0+" worker", d1, d0, t1.Admitted-r.Arrival, t0.Admitted-r0.Arrival)
		pairs = append(pairs, pair{i, d1, d0})
	}
	sort.Strings(order)
	fmt.Fprintf(out, "| requests | n | TTFT mean lumen / no-spec (ms) | excess | queue lumen / no-spec | admission → token lumen / no-spec | TTFT p99 lumen / no-spec |\n| --- | --- | --- | --- | --- | --- | --- |\n")
	row := func(name string, a *acc) {
		n := float64(a.n)
		fmt.Fprintf(out, "| %s | %d | %.1f / %.1f | %+.1f | %.1f / %.1f | %.1f / %.1f | %.0f / %.0f |\n", name, a.n, a.ttft1/n, a.ttft0/n,
			(a.ttft1-a.ttft0)/n, a.q1/n, a.q0/n, a.p1/n, a.p0/n, servingstats.Percentile(a.t1, 0.99), servingstats.Percentile(a.t0, 0.99))
	}
	for _, k := range order {
		row(k, cls[k])
	}
	row("all", &all)
	// The tail: where lumen's slowest 1% were served, and the no-spec
	// run's slowest 1%.
	if len(pairs) > 0 {
		n := max(len(pairs)/100, 1)
		tail := func(by func(p pair) time.Duration, tr []ReqTrace, lumen bool) (int, float64) {
			ps := slices.Clone(pairs)
			slices.SortFunc(ps, func(a, b pair) int { return int(by(b) - by(a)) })
			at := 0
			var sum float64
			for _, p := range ps[:n] {
				t := tr[p.i]
				if lumen && t.Assisted || !lumen && assisted(t.Worker, t.Admitted) {
					at++
				}
				sum += ms(by(p))
			}
			return at, sum / float64(n)
		}
		a1, m1 := tail(func(p pair) time.Duration { return p.d1 }, run.ReqTrace, true)
		a0, m0 := tail(func(p pair) time.Duration { return p.d0 }, noSpec.ReqTrace, false)
		fmt.Fprintf(out, "slowest 1%% (%d): lumen mean %.0f ms, %d at assisted workers; no-spec mean %.0f ms, %d at the same workers' spans\n", n, m1, a1, m0, a0)
	}
	// The steps of the assisted workers over their pairings, lumen's and
	// the same workers' over the same spans without speculation.
	type sacc struct {
		steps, verif                          int
		dur, plain, vdur, vplain, rows, kRows float64
		waiting, admitted, committed, drafts  float64
		taxWaiting                            float64 // Σ (Dur − Plain) × (waiting + admitted), ms·requests
		span                                  time.Duration
	}
	stepStats := func(res *Result) *sacc {
		var a sacc
		for _, st := range res.StepTrace {
			if !assisted(st.Worker, st.At) {
				continue
			}
			a.steps++
			a.dur += ms(st.Dur)
			a.plain += ms(st.Plain)
			a.rows += float64(st.Rows)
			a.waiting += float64(st.Waiting)
			a.admitted += float64(st.Admitted)
			a.committed += float64(st.Committed)
			if st.Verifying > 0 {
				a.verif++
				a.vdur += ms(st.Dur)
				a.vplain += ms(st.Plain)
				a.kRows += float64(st.Verifying)
				a.drafts += float64(st.Drafts)
				a.taxWaiting += ms(st.Dur-st.Plain) * float64(st.Waiting+st.Admitted)
			}
		}
		for _, sp := range spans {
			for _, s := range sp {
				a.span += s[1] - s[0]
			}
		}
		return &a
	}
	s1, s0 := stepStats(run), stepStats(noSpec)
	fmt.Fprintf(out, "| assisted workers' steps over their pairings | lumen | lumen-no-spec |\n| --- | --- | --- |\n")
	f := func(name, format string, v1, v0 float64) {
		fmt.Fprintf(out, "| %s | "+format+" | "+format+" |\n", name, v1, v0)
	}
	per := func(x float64, n int) float64 {
		if n == 0 {
			return 0
		}
		return x / float64(n)
	}
	f("steps", "%.0f", float64(s1.steps), float64(s0.steps))
	f("step mean (ms)", "%.2f", per(s1.dur, s1.steps), per(s0.dur, s0.steps))
	f("share of steps verifying", "%.3f", per(float64(s1.verif), s1.steps), per(float64(s0.verif), s0.steps))
	f("verifying step mean / its plain time (ms)", "%.2f", per(s1.vdur, s1.verif), 0)
	f("  … plain time of the same steps (ms)", "%.2f", per(s1.vplain, s1.verif), 0)
	f("decode rows per step", "%.1f", per(s1.rows, s1.steps), per(s0.rows, s0.steps))
	f("verifying rows per verifying step", "%.1f", per(s1.kRows, s1.verif), 0)
	f("drafts per verifying row", "%.2f", s1.drafts/max(s1.kRows, 1), 0)
	f("waiting per step", "%.1f", per(s1.waiting, s1.steps), per(s0.waiting, s0.steps))
	f("admitted (calls' first chunk) per second", "%.1f", s1.admitted/s1.span.Seconds(), s0.admitted/s0.span.Seconds())
	f("tokens committed per second", "%.0f", s1.committed/s1.span.Seconds(), s0.committed/s0.span.Seconds())
	f("tokens per step", "%.1f", per(s1.committed, s1.steps), per(s0.committed, s0.steps))
	f("verification time × (waiting + admitted), s·requests", "%.1f", s1.taxWaiting/1000, 0)
	f("verification time, share of the spans", "%.3f", (s1.dur-s1.plain)/1000/s1.span.Seconds(), 0)
	sp := run.Spec
	k := 0.0
	if sp.KRows > 0 {
		k = float64(sp.KSum) / float64(sp.KRows)
	}
	fmt.Fprintf(out, "acceptance %.3f (%d of %d drafts), K asked %.2f per verifying row, %d verifications\n\n",
		float64(sp.AcceptedTokens)/float64(max(sp.DraftTokens, 1)), sp.AcceptedTokens, sp.DraftTokens, k, sp.Verifications)
}

// WriteSpecTrace writes a traced run's requests (path-req.csv: arrival,
// TTFT, admission, worker, assisted, interrupted, tokens) and steps
// (path-steps.csv), times in ms, for analysis by hand.
func WriteSpecTrace(path string, res *Result) error {
	f, err := os.Create(path + "-req.csv")
	if err != nil {
		return err
	}
	b := bufio.NewWriter(f)
	fmt.Fprintln(b, "idx,arrival_ms,ttft_ms,admitted_ms,worker,assisted,interrupted,tokens,err")
	for i, r := range res.Records {
		d, _ := r.TTFT()
		t := res.ReqTrace[i]
		fmt.Fprintf(b, "%d,%.3f,%.3f,%.3f,%d,%t,%t,%d,%t\n", i, ms(r.Arrival), ms(d), ms(t.Admitted), t.Worker, t.Assisted, r.Interrupted, r.Tokens, r.Err != nil)
	}
	if err := b.Flush(); err != nil {
		return err
	}
	f.Close()
	if f, err = os.Create(path + "-steps.csv"); err != nil {
		return err
	}
	b = bufio.NewWriter(f)
	fmt.Fprintln(b, "at_ms,dur_ms,plain_ms,worker,rows,verifying,k,prefill,waiting,admitted,committed,assisted,drafts,used,head,running")
	for _, s := range res.StepTrace {
		fmt.Fprintf(b, "%.3f,%.3f,%.3f,%d,%d,%d,%d,%d,%d,%d,%d,%t,%d,%d,%d,%d\n", ms(s.At), ms(s.Dur), ms(s.Plain), s.Worker, s.Rows, s.Verifying, s.K,
			s.Prefill, s.Waiting, s.Admitted, s.Committed, s.Assisted, s.Drafts, s.Used, s.Head, s.Running)
	}
	if err := b.Flush(); err != nil {
		return err
	}
	return f.Close()
}
