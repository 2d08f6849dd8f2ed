package bench

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/lumen-project/lumen/internal/servingstats"
	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/sim"
)

// The llumnix phase of `lumen bench migration` (issue 23): the simulator's
// figure llumnix (`lumen sim -figure llumnix`) at reduced scale on real
// processes — a few paced synthetic workers of Llumnix's instance
// (llama-7b-a10), one of its Zipf traces, Gamma arrivals — with its two
// columns on the same arrivals: infaas++ (the freeness dispatch, migration
// off) and lumen (migration on). The simulator then runs the same setup
// (the same workers, trace, CV, rate, request count and seed: the same
// arrivals, request for request), and the phase compares the two P99
// prefill gains.

// LlumnixBench is the llumnix phase's setup.
type LlumnixBench struct {
	// Trace is one of workload.LlumnixTraces.
	Trace string
	// CV is the arrivals' coefficient of variation (0: Poisson; Llumnix's
	// Gamma CVs are 2 to 8).
	CV float64
	// Rate is the arrivals per second; 0: Llumnix's middle rate for the
	// trace (sim.LlumnixRates, on 16 instances) scaled to Workers.
	Rate float64
	// Requests a column; Workers paced workers.
	Requests, Workers int
}

// DefaultLlumnixBench: 256-256 (Llumnix's headline trace), Gamma CV 4, its
// 7.8 req/s on 16 instances scaled to 8 workers (3.9 req/s), 300 requests
// (about 80 s of arrivals; the longest outputs, 6,144 tokens at 44 ms a
// step, take some 5 minutes more).
func DefaultLlumnixBench() LlumnixBench {
	return LlumnixBench{Trace: "256-256", CV: 4, Requests: 300, Workers: 8}
}

// llumnixProfile is the llumnix phase's profile without -profile.
const llumnixProfile = "llama-7b-a10"

// The phase's columns, as the simulator names them; their JSON keys end
// in _infaas and _lumen.
var llumnixBenchColumns = []struct{ col, key string }{{sim.ColINFaaS, "infaas"}, {sim.ColLumen, "lumen"}}

// llumnixRaw is what the phase measured.
type llumnixRaw struct {
	setup   LlumnixBench
	profile string
	// cols by column key (infaas, lumen): the real processes; sim the
	// simulator's point on the same arrivals.
	cols map[string]*llumnixColumn
	sim  *sim.LlumnixPoint
}

// llumnixColumn is one column's run on real processes.
type llumnixColumn struct {
	run *burstResult
	// lastArrival: the arrivals' span as the workload has it.
	lastArrival time.Duration
	// The workers' lumen_worker_preemption_loss_seconds, summed.
	lossCount, lossSum float64
	// frag: the fragmentation samples' mean (a fraction); fragSamples
	// how many there were.
	frag        float64
	fragSamples int
}

// llumnixWorkerArgs are the workers' flags: the simulator's setup
// (sim.DefaultLlumnixOptions) — vLLM's batch cap of 256, Llumnix's 12,800
// tokens a step, preemption by recompute, the context-dependent decode
// step.
func llumnixWorkerArgs(profile string, o sim.LlumnixOptions) []string {
	args := migWorkerArgs(profile)
	for i := range args {
		if args[i] == "-token-budget" {
			args[i+1] = fmt.Sprint(o.TokenBudget)
		}
	}
	return append(args, "-max-running", fmt.Sprint(o.MaxRunning), "-preemption", "vllm", "-decode-context", "-checkpoint-budget", "1GiB")
}

// llumnixOptions is the simulator's figure on the phase's setup.
func llumnixOptions(b LlumnixBench, rate float64, seed uint64) sim.LlumnixOptions {
	o := sim.DefaultLlumnixOptions()
	o.Traces, o.Rates = []string{b.Trace}, map[string][]float64{b.Trace: {rate}}
	o.CV, o.Requests, o.Workers, o.Seed = b.CV, b.Requests, b.Workers, seed
	return o
}

// llumnixRate is the phase's rate: b.Rate, or Llumnix's middle rate for
// the trace scaled from 16 instances to b.Workers.
func llumnixRate(b LlumnixBench) (float64, error) {
	if b.Rate > 0 {
		return b.Rate, nil
	}
	rs := sim.LlumnixRates[b.Trace]
	if len(rs) == 0 {
		return 0, fmt.Errorf("trace %q has no Llumnix rate: give -rate", b.Trace)
	}
	return math.Round(rs[len(rs)/2]*float64(b.Workers)/16*100) / 100, nil
}

// checkLlumnixBench says what is wrong with a setup, naming the limit.
func checkLlumnixBench(b LlumnixBench) error {
	if _, err := workload.LlumnixTrace(b.Trace); err != nil {
		return fmt.Errorf("-trace: %w", err)
	}
	switch {
	case b.CV < 0 || b.CV > 20 || math.IsNaN(b.CV):
		return fmt.Errorf("-cv %g: must be in [0, 20] (0 Poisson; Llumnix's Gamma CVs: 2, 4, 6, 8)", b.CV)
	case b.Rate < 0 || b.Rate > 1000 || math.IsNaN(b.Rate):
		return fmt.Errorf("-rate %g: must be in (0, 1000] requests/s (0: Llumnix's rate for the trace, scaled to -workers)", b.Rate)
	case b.Requests < 1 || b.Requests > 20000:
		return fmt.Errorf("-requests %d: must be in [1, 20000] (each column runs them all on real processes)", b.Requests)
	case b.Workers < 2 || b.Workers > 32:
		return fmt.Errorf("-workers %d: must be in [2, 32] (each is an OS process on this machine)", b.Workers)
	}
	return nil
}

// runLlumnix is the llumnix phase: the arrivals, infaas++ and lumen on
// fresh clusters, then the simulator on the same setup.
func (r *migrationRaw) runLlumnix(ctx context.Context, cfg MigrationConfig, dir string) error {
	b := cfg.Llumnix
	if err := checkLlumnixBench(b); err != nil {
		return err
	}
	profile := cfg.Profile
	if profile == "" {
		profile = llumnixProfile
	}
	rate, err := llumnixRate(b)
	if err != nil {
		return err
	}
	b.Rate = rate
	tr, _ := workload.LlumnixTrace(b.Trace)
	o := llumnixOptions(b, rate, cfg.Seed)
	// The simulator's arrivals, materialised: the same times, lengths and
	// prompts (workload.Generate is GenerateLazy's, with the ids).
	reqs, err := workload.Generate(workload.Config{Seed: cfg.Seed, Rate: rate, Requests: b.Requests, CV: b.CV, Trace: tr})
	if err != nil {
		return err
	}
	refs, err := syntheticReferences(reqs)
	if err != nil {
		return err
	}
	bodies := requestBodies(reqs)
	args := llumnixWorkerArgs(profile, o)
	last := reqs[len(reqs)-1].At
	fmt.Printf("== llumnix: %d workers paced as %s (batches of %d, %d tokens a step, preemption by recompute, the context-dependent step);\n"+
		"   trace %s, %s arrivals at %g/s, %d requests (%.0f s of arrivals, seed %d); infaas++ (migration off), then lumen (on)\n",
		b.Workers, profile, o.MaxRunning, o.TokenBudget, b.Trace, sim.ArrivalsName(b.CV), rate, len(reqs), last.Seconds(), cfg.Seed)
	ll := &llumnixRaw{setup: b, profile: profile, cols: map[string]*llumnixColumn{}}
	r.llumnix = ll
	for _, c := range llumnixBenchColumns {
		mode := pb.MigrationMode_MIGRATION_MODE_OFF
		if c.col == sim.ColLumen {
			mode = pb.MigrationMode_MIGRATION_MODE_ON
		}
		fmt.Printf("-- %s\n", c.col)
		col, err := llumnixRun(ctx, dir+"-"+c.key, b.Workers, args, mode, reqs, bodies, refs)
		if err != nil {
			return fmt.Errorf("%s: %w", c.col, err)
		}
		col.lastArrival = last
		ll.cols[c.key] = col
		g := col.figures()
		fmt.Printf("   prefill p99 %.0f ms, mean %.0f ms; decode p99 %.1f ms; e2e p99 %.0f ms; %.0f preemptions (loss %.0f ms each), fragmentation %.2f%%;\n"+
			"   %.0f migrations (%.0f aborted); %d failed, %d outputs differ\n",
			g.PrefillP99Ms, g.PrefillMeanMs, g.DecodeP99Ms, g.E2EP99Ms, col.run.preemptions, g.PreemptionLossMs, g.FragmentationPct,
			col.run.migrations, col.run.aborted, col.run.failed, col.run.wrong)
	}
	fmt.Printf("-- the simulator on the same setup and arrivals\n")
	sf, err := sim.RunLlumnix(o)
	if err != nil {
		return fmt.Errorf("the simulator: %w", err)
	}
	ll.sim = &sf.Points[0]
	return nil
}

// llumnixRun runs one column on a fresh cluster: no checkpoints (the
// simulator's figure runs recompute-history), live migration as mode, the
// load table sampled for the fragmentation while the arrivals run.
func llumnixRun(ctx context.Context, dir string, workers int, args []string, mode pb.MigrationMode,
	reqs []workload.Request, bodies [][]byte, refs []string) (*llumnixColumn, error) {
	m, err := startMigCluster(ctx, dir, workers, args, mode)
	if err != nil {
		return nil, err
	}
	defer m.close()
	if err := m.setStrategy(ctx, &pb.SetStrategyRequest{Strategy: pb.Strategy(policy.RecomputeHistory)}); err != nil {
		return nil, err
	}
	fr := &fragSampler{}
	sctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { _ = m.ctl.WatchLoad(sctx, 50*time.Millisecond, 0, fr.update) })
	wg.Go(func() { fr.sample(sctx, 250*time.Millisecond) })
	run, err := m.serve(ctx, reqs[len(reqs)-1].At, reqs, bodies, refs)
	stop()
	wg.Wait()
	if err != nil {
		return nil, err
	}
	col := &llumnixColumn{run: run}
	col.frag, col.fragSamples = fr.mean()
	col.lossCount = m.sumMetric(ctx, "lumen_worker_preemption_loss_seconds_count")
	col.lossSum = m.sumMetric(ctx, "lumen_worker_preemption_loss_seconds_sum")
	return col, nil
}

// fragSampler keeps the newest load table and samples Llumnix's
// fragmentation from it: the free KV pages of the workers in full service
// whose queue head needs more pages than they have free, as a share of
// those workers' pages (the simulator's sampleFragmentation, from the
// workers' load reports as the controller holds them).
type fragSampler struct {
	mu      sync.Mutex
	table   *pb.LoadTable
	sum     float64
	samples int
}

func (s *fragSampler) update(t *pb.LoadTable) {
	s.mu.Lock()
	if s.table == nil || t.AppliedIndex >= s.table.AppliedIndex {
		s.table = t
	}
	s.mu.Unlock()
}

func (s *fragSampler) sample(ctx context.Context, every time.Duration) {
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		s.mu.Lock()
		if v, ok := fragmentationOf(s.table); ok {
			s.sum += v
			s.samples++
		}
		s.mu.Unlock()
	}
}

func (s *fragSampler) mean() (float64, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.samples == 0 {
		return 0, 0
	}
	return s.sum / float64(s.samples), s.samples
}

// fragmentationOf is one load table's fragmentation (fragSampler); false
// without a worker in full service.
func fragmentationOf(t *pb.LoadTable) (float64, bool) {
	if t == nil {
		return 0, false
	}
	var total, stuck float64
	for _, w := range t.Workers {
		l := w.Load
		if w.Phase != pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE || l == nil {
			continue
		}
		total += float64(l.KvPagesTotal)
		free := float64(l.KvPagesTotal) - float64(l.KvPagesUsed)
		if l.Waiting > 0 && float64(l.QueueHeadPages) > free {
			stuck += free
		}
	}
	if total == 0 {
		return 0, false
	}
	return stuck / total, true
}

// figures are the column's figures under the simulator's definitions
// (sim.LlumnixFigures): prefill latency the TTFT, decode latency a
// request's mean time per output token after its first, end-to-end from
// the arrival to the last token, every request that ended; the preemption
// loss per preemption; the throughput the output tokens delivered per
// second until the last arrival's whole second.
func (c *llumnixColumn) figures() sim.LlumnixFigures {
	var prefill, decode, e2e []time.Duration
	tokens := 0
	last := int(c.lastArrival / time.Second)
	delivered := 0
	for _, r := range c.run.recs {
		if r == nil || r.Err != nil {
			continue
		}
		tokens += len(r.Chunks)
		if d, ok := r.TTFT(); ok {
			prefill = append(prefill, d)
			e2e = append(e2e, r.Chunks[len(r.Chunks)-1]-r.Arrival)
		}
		if d, ok := r.TPOT(); ok {
			decode = append(decode, d)
		}
		for _, t := range r.Chunks {
			if t < time.Duration(last)*time.Second {
				delivered++
			}
		}
	}
	f := sim.LlumnixFigures{OutputTokens: tokens, Preemptions: int(c.run.preemptions)}
	f.PrefillMeanMs, f.PrefillP99Ms = servingstats.Mean(prefill), servingstats.Percentile(prefill, 0.99)
	f.DecodeMeanMs, f.DecodeP99Ms = servingstats.Mean(decode), servingstats.Percentile(decode, 0.99)
	f.E2EMeanMs, f.E2EP99Ms = servingstats.Mean(e2e), servingstats.Percentile(e2e, 0.99)
	if c.lossCount > 0 {
		f.PreemptionLossMs = 1000 * c.lossSum / c.lossCount
	}
	if n := len(c.run.recs); n > 0 {
		f.PreemptionLossPerRequestMs = 1000 * c.lossSum / float64(n)
	}
	f.FragmentationPct = 100 * c.frag
	if last > 0 {
		f.ThroughputTokS = float64(delivered) / float64(last)
	}
	_, span := c.run.throughput()
	f.MakespanS = span.Seconds()
	return f
}

// llumnixKeys are the simulator's contract keys, as the phase emits them
// per column.
func llumnixKeys(f *sim.LlumnixFigures) map[string]float64 {
	return map[string]float64{"prefill_mean_ms": f.PrefillMeanMs, "prefill_p99_ms": f.PrefillP99Ms, "decode_p99_ms": f.DecodeP99Ms,
		"e2e_mean_ms": f.E2EMeanMs, "e2e_p99_ms": f.E2EP99Ms, "preemption_loss_ms": f.PreemptionLossMs,
		"fragmentation_pct": f.FragmentationPct, "throughput_tokens_s": f.ThroughputTokS,
		"decode_mean_ms": f.DecodeMeanMs, "preemption_loss_per_request_ms": f.PreemptionLossPerRequestMs, "makespan_s": f.MakespanS}
}

// ratioOf is a over b (× lower with migration), 0 without a figure.
func ratioOf(a, b float64) float64 {
	if a <= 0 || b <= 0 {
		return 0
	}
	return a / b
}

// figures adds the phase's figures to f: per column, the contract keys
// with _infaas or _lumen (the real processes) and sim_ before them (the
// simulator); the gains (infaas++'s over lumen's); the outputs that
// differ from their failure-free reference. Nothing without the phase.
func (l *llumnixRaw) figures(f map[string]float64) {
	if l == nil || len(l.cols) == 0 {
		return
	}
	f["llumnix_workers"], f["llumnix_requests"], f["llumnix_rate_per_s"], f["llumnix_cv"] =
		float64(l.setup.Workers), float64(l.setup.Requests), l.setup.Rate, l.setup.CV
	real := map[string]*sim.LlumnixFigures{}
	differing, failed := 0, 0
	for _, c := range llumnixBenchColumns {
		col := l.cols[c.key]
		if col == nil {
			continue
		}
		g := col.figures()
		real[c.key] = &g
		for k, v := range llumnixKeys(&g) {
			f[k+"_"+c.key] = v
		}
		f["preemptions_"+c.key] = col.run.preemptions
		f["fragmentation_samples_"+c.key] = float64(col.fragSamples)
		f["migrations_"+c.key], f["migrations_aborted_"+c.key] = col.run.migrations, col.run.aborted
		f["outputs_differing_"+c.key], f["failed_"+c.key] = float64(col.run.wrong), float64(col.run.failed)
		if col.run.emulated > 0 {
			f["pacing_overrun_pct_"+c.key] = 100 * (col.run.paced/col.run.emulated - 1)
		}
		differing, failed = differing+col.run.wrong, failed+col.run.failed
		if l.sim != nil {
			if sc := l.sim.Columns[c.col]; sc != nil {
				for k, v := range llumnixKeys(sc) {
					f["sim_"+k+"_"+c.key] = v
				}
				f["sim_preemptions_"+c.key] = float64(sc.Preemptions)
			}
		}
	}
	f["llumnix_outputs_differing"], f["llumnix_failed"] = float64(differing), float64(failed)
	if real["infaas"] == nil || real["lumen"] == nil {
		return
	}
	f["llumnix_prefill_p99_x"] = ratioOf(real["infaas"].PrefillP99Ms, real["lumen"].PrefillP99Ms)
	f["llumnix_prefill_mean_x"] = ratioOf(real["infaas"].PrefillMeanMs, real["lumen"].PrefillMeanMs)
	if l.sim != nil {
		f["sim_llumnix_prefill_p99_x"] = l.sim.Gains["prefill_p99_x"]
		f["sim_llumnix_prefill_mean_x"] = l.sim.Gains["prefill_mean_x"]
		f["llumnix_prefill_p99_x_vs_sim"] = ratioOf(f["llumnix_prefill_p99_x"], f["sim_llumnix_prefill_p99_x"])
	}
}

// printLlumnixRows adds the phase's rows to the table.
func printLlumnixRows(row func(m, res, goal, v string), has func(...string) bool, f map[string]float64) {
	if !has("prefill_p99_ms_infaas", "prefill_p99_ms_lumen") {
		return
	}
	setup := fmt.Sprintf("%.0f workers, %.0f requests at %g/s, CV %g", f["llumnix_workers"], f["llumnix_requests"], f["llumnix_rate_per_s"], f["llumnix_cv"])
	for _, k := range []struct{ key, label, unit string }{
		{"prefill_p99_ms", "P99 prefill", "ms"}, {"prefill_mean_ms", "mean prefill", "ms"}, {"decode_p99_ms", "P99 decode", "ms"},
		{"e2e_mean_ms", "mean end-to-end", "ms"}, {"e2e_p99_ms", "P99 end-to-end", "ms"}, {"preemption_loss_ms", "preemption loss per preemption", "ms"},
		{"fragmentation_pct", "fragmentation", "%"}, {"throughput_tokens_s", "throughput", "tokens/s"},
	} {
		simv := ""
		if has("sim_" + k.key + "_infaas") {
			simv = fmt.Sprintf("; simulator %s / %s", num(f["sim_"+k.key+"_infaas"]), num(f["sim_"+k.key+"_lumen"]))
		}
		row(fmt.Sprintf("llumnix (%s): %s, infaas++ / lumen", setup, k.label),
			fmt.Sprintf("%s / %s %s%s", num(f[k.key+"_infaas"]), num(f[k.key+"_lumen"]), k.unit, simv), "—", "—")
	}
	row("llumnix: preemptions, infaas++ / lumen", fmt.Sprintf("%.0f / %.0f (simulator %.0f / %.0f)", f["preemptions_infaas"], f["preemptions_lumen"],
		f["sim_preemptions_infaas"], f["sim_preemptions_lumen"]), "—", "—")
	row("llumnix: lumen's migrations (committed / aborted)", fmt.Sprintf("%.0f / %.0f", f["migrations_lumen"], f["migrations_aborted_lumen"]), "—", "—")
	if has("llumnix_prefill_p99_x", "sim_llumnix_prefill_p99_x") {
		x, sx := f["llumnix_prefill_p99_x"], f["sim_llumnix_prefill_p99_x"]
		same := x > 0 && sx > 0 && (x > 1) == (sx > 1)
		within := x > 0 && sx > 0 && math.Max(x/sx, sx/x) <= 1.5
		row("llumnix: P99 prefill × lower with migration, real / simulator", fmt.Sprintf("%.2f× / %.2f× (real ÷ simulator %.2f)", x, sx, f["llumnix_prefill_p99_x_vs_sim"]),
			"the same direction, within a factor of 1.5", verdict(same && within))
	}
	row("llumnix: outputs ≠ reference (both columns)", fmt.Sprintf("%.0f of %.0f (failed %.0f)", f["llumnix_outputs_differing"], 2*f["llumnix_requests"],
		f["llumnix_failed"]), "0", verdict(f["llumnix_outputs_differing"]+f["llumnix_failed"] == 0))
}

// num writes a figure with the digits that matter at its size.
func num(v float64) string {
	switch a := math.Abs(v); {
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}
