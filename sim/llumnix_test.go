package sim

import (
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/worker/engine"
)

// TestLlamaA10Profile checks the profile against its derivation and
// against Llumnix's measured LLaMA-7B decode steps (44–53 ms).
func TestLlamaA10Profile(t *testing.T) {
	p := LlamaA10
	if got := p.KVBytesPerToken(); got != 512<<10 {
		t.Fatalf("KV per token %d, want 512 KiB", got)
	}
	// (0.9 × 24 GB − 13.48 GB) / (16 × 512 KiB) = 967.9.
	if got := p.KVPages(); got != 967 {
		t.Fatalf("KV pages %d, want 967", got)
	}
	if w := p.WeightReadMs(); math.Abs(w-22.47) > 0.01 {
		t.Fatalf("weight read %.2f ms, want 22.47", w)
	}
	step := func(rows, context int) float64 {
		return float64(p.Step(engine.StepShape{Rows: rows, Context: context})) / 1e6
	}
	// One request: 44 ms at a short context, up to 53 at 8k (Llumnix's
	// migration microbenchmark runs sequences up to 8k tokens).
	for _, c := range []struct {
		rows, context int
		lo, hi        float64
	}{{1, 64, 44, 44.3}, {1, 8192, 44, 53}, {8, 8 * 1000, 44, 53}, {32, 15000, 44, 75}} {
		if got := step(c.rows, c.context); got < c.lo || got > c.hi {
			t.Errorf("step of %d rows over %d context tokens: %.1f ms, want [%g, %g]", c.rows, c.context, got, c.lo, c.hi)
		}
	}
	// A row's KV read is 512 KiB at 600 GB/s a token: 0.874 µs.
	if d := step(1, 10064) - step(1, 64); math.Abs(d-8.74) > 0.01 {
		t.Errorf("10,000 more context tokens cost %.3f ms, want 8.74", d)
	}
	// Prefill: 6,000 tokens/s on top of the step.
	if d := float64(p.StepTime(0, 6000)-p.StepTime(0, 0)) / 1e6; math.Abs(d-1000) > 0.5 {
		t.Errorf("6,000 prefill tokens cost %.1f ms, want 1000", d)
	}
}

// fixedArrivals are n requests of the given lengths, gap apart.
func fixedArrivals(n, prompt, output int, gap time.Duration) []workload.Request {
	out := make([]workload.Request, n)
	for i := range out {
		p := make([]int32, prompt)
		for k := range p {
			p[k] = int32(32 + (i+k)%95)
		}
		out[i] = workload.Request{At: time.Duration(i) * gap, Prompt: p, Output: output}
	}
	return out
}

func llumnixTestConfig(workers, kvPages int, reqs []workload.Request) Config {
	o := DefaultLlumnixOptions()
	o.Workers, o.Requests = workers, len(reqs)
	cfg := o.config(ColINFaaS, reqs)
	cfg.KVPages = kvPages
	return cfg
}

// TestRoundRobinDispatch: round-robin gives arrival i to worker i mod n;
// the freeness dispatch does not on the same arrivals.
func TestRoundRobinDispatch(t *testing.T) {
	var reqs []workload.Request
	for i := range 40 {
		// Lengths differ: the freeness tells the workers apart.
		r := fixedArrivals(1, 64+(i*397)%1500, 4+(37*i)%50, 0)[0]
		r.At = time.Duration(i) * 5 * time.Millisecond
		reqs = append(reqs, r)
	}
	for _, rr := range []bool{true, false} {
		cfg := llumnixTestConfig(4, 0, reqs)
		cfg.RoundRobin = rr
		cfg.keepRequests = true // read after the run
		s, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		s.Run()
		if s.err != nil {
			t.Fatal(s.err)
		}
		if err := s.Check(); err != nil {
			t.Fatal(err)
		}
		mismatch := 0
		for i, r := range s.reqs {
			if want := fmt.Sprintf("worker-%d", i%4+1); r.worker != want {
				mismatch++
				if rr {
					t.Errorf("round-robin: request %d on %s, want %s", i, r.worker, want)
				}
			}
		}
		if !rr && mismatch == 0 {
			t.Error("the freeness dispatch placed every request as round-robin would")
		}
	}
}

// TestPreemptionLossAndFragmentation: one worker whose KV cache holds two
// of the four requests at their full length, under vLLM's preemption by
// recompute: requests are preempted, each preempted request's loss is at
// least one step (its recompute) and at most its whole time in the
// system, and while a request waits for pages the free pages count as
// fragmentation. With room for all four, nothing is preempted and nothing
// is fragmented.
func TestPreemptionLossAndFragmentation(t *testing.T) {
	// 4 × (100 + 300 tokens) = 100 pages at their end; 50 pages hold two.
	reqs := fixedArrivals(4, 100, 300, 0)
	cfg := llumnixTestConfig(1, 50, reqs)
	res, err := Run(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if res.Preemptions == 0 || len(res.PreemptionLosses) == 0 || len(res.PreemptionLosses) > len(reqs) {
		t.Fatalf("%d preemptions, %d preempted requests of %d", res.Preemptions, len(res.PreemptionLosses), len(reqs))
	}
	base := time.Duration(LlamaA10.DecodeBaseMs * float64(time.Millisecond))
	var e2eMax time.Duration
	for _, r := range res.Records {
		e2eMax = max(e2eMax, r.Chunks[len(r.Chunks)-1]-r.Arrival)
	}
	for i, d := range res.PreemptionLosses {
		if d < base || d > e2eMax {
			t.Errorf("preempted request %d: loss %s, want [%s, %s]", i, d, base, e2eMax)
		}
	}
	stuck := 0
	for _, s := range res.Fragmentation {
		if s.Waiting < 0 || s.Waiting > 1 {
			t.Fatalf("fragmentation %g at %s", s.Waiting, s.At)
		}
		if s.Waiting > 0 {
			stuck++
		}
	}
	if stuck == 0 {
		t.Errorf("no fragmentation sampled in %d samples with %d preemptions", len(res.Fragmentation), res.Preemptions)
	}
	// One worker: a blocked head has nowhere else to go. A blocked head
	// with no page free counts as blocked but fragments nothing.
	if b := res.Blocked; b.Blocked < stuck || b.RoomElsewhere != 0 || b.WorkerSamples != len(res.Fragmentation) || b.DeficitPages < b.Blocked {
		t.Errorf("blocked stats %+v, %d fragmented samples of %d", b, stuck, len(res.Fragmentation))
	}
	t.Logf("%d preemptions of %d requests, losses %v; fragmented in %d of %d samples", res.Preemptions, len(res.PreemptionLosses),
		res.PreemptionLosses, stuck, len(res.Fragmentation))

	res, err = Run(llumnixTestConfig(1, 200, reqs))
	if err != nil {
		t.Fatal(err)
	}
	if res.Preemptions != 0 || len(res.PreemptionLosses) != 0 {
		t.Errorf("room for all: %d preemptions, losses %v", res.Preemptions, res.PreemptionLosses)
	}
	for _, s := range res.Fragmentation {
		if s.Waiting != 0 {
			t.Fatalf("room for all: fragmentation %g at %s", s.Waiting, s.At)
		}
	}
}

// TestLlumnixFigureSmall runs the figure at a small scale: every column on
// the same arrivals with the contract's keys, only lumen migrates, and
// the same seed gives the same figures.
func TestLlumnixFigureSmall(t *testing.T) {
	o := DefaultLlumnixOptions()
	o.Workers, o.Requests, o.Traces = 4, 400, []string{"128-128"}
	o.Rates = map[string][]float64{"128-128": {12}}
	run := func() (*LlumnixFigure, map[string]map[string]any) {
		f, err := RunLlumnix(o)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range f.Points {
			for _, c := range p.Columns {
				c.WallS = 0
			}
		}
		data, _ := json.Marshal(f)
		var raw struct {
			Points []struct {
				Columns map[string]map[string]any `json:"columns"`
			} `json:"points"`
		}
		if err := json.Unmarshal(data, &raw); err != nil {
			t.Fatal(err)
		}
		return f, raw.Points[0].Columns
	}
	f, cols := run()
	for _, col := range LlumnixColumns {
		c, ok := cols[col]
		if !ok {
			t.Fatalf("column %s missing", col)
		}
		for _, k := range []string{"prefill_mean_ms", "prefill_p99_ms", "decode_p99_ms", "e2e_mean_ms", "e2e_p99_ms",
			"preemption_loss_ms", "fragmentation_pct", "throughput_tokens_s"} {
			if _, ok := c[k]; !ok {
				t.Errorf("%s: key %s missing", col, k)
			}
		}
		if v := c["throughput_tokens_s"].(float64); v <= 0 {
			t.Errorf("%s: throughput %g", col, v)
		}
	}
	pt := f.Points[0]
	if pt.Requests != 400 || pt.Columns[ColLumen].MigrationsCommitted == 0 ||
		pt.Columns[ColINFaaS].MigrationsStarted != 0 || pt.Columns[ColRoundRobin].MigrationsStarted != 0 {
		t.Errorf("requests %d; migrations committed: lumen %d, started: infaas++ %d, round-robin %d", pt.Requests,
			pt.Columns[ColLumen].MigrationsCommitted, pt.Columns[ColINFaaS].MigrationsStarted, pt.Columns[ColRoundRobin].MigrationsStarted)
	}
	a, _ := json.Marshal(f)
	f2, _ := run()
	if b, _ := json.Marshal(f2); string(a) != string(b) {
		t.Error("the same seed gave different figures")
	}
	var out strings.Builder
	f.Print(&out)
	if !strings.Contains(out.String(), "P99 prefill × lower") || !strings.Contains(out.String(), "infaas++") {
		t.Errorf("table:\n%s", out.String())
	}
}

// TestMigrationFilters: near saturation (queue heads block), the policy re-dispatches blocked workers' queued requests, and a
// request without a KV cache moves only as a re-dispatch the policy
// planned (or one preempted after its worker's report: a few);
// no-redispatch plans none and still migrates running requests.
func TestMigrationFilters(t *testing.T) {
	tr, err := workload.LlumnixTrace("256-256")
	if err != nil {
		t.Fatal(err)
	}
	reqs, err := workload.GenerateLazy(workload.Config{Seed: 2, Rate: 2.6, Requests: 1500, CV: 4, Trace: tr})
	if err != nil {
		t.Fatal(err)
	}
	type counts struct{ started, committed, queued, redispatched, preempted int }
	got := map[MigrationFilter]counts{}
	for _, f := range []MigrationFilter{MigrateAsPlanned, MigrateNoRedispatch} {
		cfg := llumnixTestConfig(4, 0, reqs)
		cfg.Migration, cfg.MigrationFilter = true, f
		res, err := Run(cfg)
		if err != nil {
			t.Fatal(err)
		}
		m := res.Migrations
		got[f] = counts{m.Started, m.Committed, m.Queued, m.Redispatched, res.Preemptions}
		if m.Committed == 0 {
			t.Errorf("%s: no migration committed", f)
		}
		if (m.Queued-m.Redispatched)*50 > m.Started {
			t.Errorf("%s: %d of %d migrations of requests without a KV cache, %d planned as re-dispatches", f, m.Queued, m.Started, m.Redispatched)
		}
	}
	t.Logf("started, committed, without a cache, re-dispatches planned, preemptions: %+v", got)
	if got[MigrateAsPlanned].redispatched == 0 || got[MigrateNoRedispatch].redispatched != 0 {
		t.Errorf("re-dispatches planned: as planned %d, no-redispatch %d", got[MigrateAsPlanned].redispatched, got[MigrateNoRedispatch].redispatched)
	}
}

func TestLlumnixFlags(t *testing.T) {
	for _, c := range []struct {
		args map[string]string
		want string
	}{
		{map[string]string{"arrivals": "gamma:0"}, "-arrivals"},
		{map[string]string{"arrivals": "bursty"}, "-arrivals"},
		{map[string]string{"requests": "0"}, "-requests"},
		{map[string]string{"trace-mix": "100-100"}, "-trace-mix"},
		{map[string]string{"rates": "fast"}, "-rates"},
		{map[string]string{"migration-plan": "all"}, "-migration-plan"},
		{map[string]string{"workers": "1"}, "-workers"},
		{map[string]string{"load": "0.5"}, "-load does not apply"},
		{map[string]string{"migration-interval": "1ms"}, "-migration-interval"},
	} {
		cmd := DefaultCommand()
		cmd.Figure = LlumnixFigureName
		cmd.Out, cmd.Errs = &strings.Builder{}, &strings.Builder{}
		for k, v := range c.args {
			cmd.Given[k] = true
			switch k {
			case "arrivals":
				cmd.Arrivals = v
			case "requests":
				fmt.Sscan(v, &cmd.Requests)
			case "trace-mix":
				cmd.TraceMix = v
			case "rates":
				cmd.Rates = v
			case "migration-plan":
				cmd.MigrationPlan = v
			case "workers":
				fmt.Sscan(v, &cmd.Workers)
			case "load":
				fmt.Sscan(v, &cmd.Load)
			case "migration-interval":
				cmd.MigrationInterval, _ = time.ParseDuration(v)
			}
		}
		err := cmd.Run()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: error %v, want one naming %q", c.args, err, c.want)
		}
	}
	cmd := DefaultCommand()
	cmd.Given["trace-mix"], cmd.TraceMix = true, "256-256"
	if err := cmd.Run(); err == nil || !strings.Contains(err.Error(), "-figure llumnix only") {
		t.Errorf("-trace-mix without the figure: %v", err)
	}
}

// TestPriorityServedAhead (issue 23): Llumnix's priority experiment at a
// small scale where queues form (4 workers, 128-128 at 11 req/s, Gamma
// CV 4, seed pinned): on the same arrivals, lumen+priority serves the
// high-priority class ahead — its mean and P99 prefill below the normal
// class's and below its own P99 in lumen without priorities — while in
// infaas++ (priorities ignored) the queues are real: the normal class's
// P99 prefill is many times the high class's floor.
func TestPriorityServedAhead(t *testing.T) {
	const seed = 1
	t.Logf("seed %d", seed)
	o := DefaultLlumnixOptions()
	o.Workers, o.Requests, o.Traces, o.CV, o.Seed = 4, 3000, []string{"128-128"}, 4, seed
	o.Rates = map[string][]float64{"128-128": {11}}
	o.PriorityFraction = LlumnixPriorityFraction
	f, err := RunLlumnix(o)
	if err != nil {
		t.Fatal(err)
	}
	pt := f.Points[0]
	base, nopri, pri := pt.Columns[ColINFaaS], pt.Columns[ColLumen], pt.Columns[ColLumenPriority]
	for _, col := range LlumnixPriorityColumns {
		c := pt.Columns[col]
		t.Logf("%-15s high %d: prefill mean %.0f ms, P99 %.0f ms (floor %.0f); normal: mean %.0f ms, P99 %.0f ms", col, c.HighRequests,
			c.HighPrefillMeanMs, c.HighPrefillP99Ms, c.HighPrefillFloorP99Ms, c.NormalPrefillMeanMs, c.NormalPrefillP99Ms)
	}
	if pri.HighRequests < 200 || pri.HighRequests != base.HighRequests || pri.HighPrefillFloorP99Ms != base.HighPrefillFloorP99Ms {
		t.Fatalf("high-priority requests: %d (infaas++ %d), floors %g / %g: the columns should share the arrivals", pri.HighRequests,
			base.HighRequests, pri.HighPrefillFloorP99Ms, base.HighPrefillFloorP99Ms)
	}
	if base.NormalPrefillP99Ms < 5*base.HighPrefillFloorP99Ms {
		t.Fatalf("infaas++'s normal P99 prefill %.0f ms is under 5× the floor %.0f ms: no queue formed, the setup tests nothing",
			base.NormalPrefillP99Ms, base.HighPrefillFloorP99Ms)
	}
	if pri.HighPrefillMeanMs >= pri.NormalPrefillMeanMs || pri.HighPrefillP99Ms >= pri.NormalPrefillP99Ms {
		t.Errorf("lumen+priority: high prefill mean %.0f / P99 %.0f ms, normal %.0f / %.0f ms: the high class is not served ahead",
			pri.HighPrefillMeanMs, pri.HighPrefillP99Ms, pri.NormalPrefillMeanMs, pri.NormalPrefillP99Ms)
	}
	if pri.HighPrefillP99Ms >= nopri.HighPrefillP99Ms {
		t.Errorf("high-priority P99 prefill %.0f ms with priorities, %.0f ms without", pri.HighPrefillP99Ms, nopri.HighPrefillP99Ms)
	}
	if g := pt.PriorityGains["high_prefill_p99_x_vs_lumen"]; g != nopri.HighPrefillP99Ms/pri.HighPrefillP99Ms {
		t.Errorf("priority_gains high_prefill_p99_x_vs_lumen %g, want %g", g, nopri.HighPrefillP99Ms/pri.HighPrefillP99Ms)
	}
}
