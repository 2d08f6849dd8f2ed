package bench

import (
	"bytes"
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/servingstats"
	"github.com/lumen-project/lumen/internal/workload"
)

func TestSwitchGap(t *testing.T) {
	toks := ms(100, 112, 125, 160, 172)
	// The commit's stamp falls between the source's last token (125) and
	// the destination's first (160).
	last, first, ok := switchGap(toks, 140*time.Millisecond, 0)
	if !ok || last != 125*time.Millisecond || first != 160*time.Millisecond {
		t.Fatalf("switch %v → %v (%v)", last, first, ok)
	}
	// A stamp on a token belongs to the gap that ends there.
	if last, first, _ := switchGap(toks, 112*time.Millisecond, 0); last != 100*time.Millisecond || first != 112*time.Millisecond {
		t.Fatalf("stamp on a token: %v → %v", last, first)
	}
	// No stamp inside the stream: the longest gap after from.
	if last, first, ok := switchGap(toks, time.Second, 0); !ok || last != 125*time.Millisecond || first != 160*time.Millisecond {
		t.Fatalf("fallback %v → %v (%v)", last, first, ok)
	}
	if last, first, _ := switchGap(ms(0, 100, 110, 130), time.Second, 100*time.Millisecond); last != 110*time.Millisecond || first != 130*time.Millisecond {
		t.Fatalf("fallback from 100 ms: %v → %v", last, first)
	}
	if _, _, ok := switchGap(ms(5), time.Second, 0); ok {
		t.Fatal("a switch found in one token")
	}
}

func TestDowntimeParts(t *testing.T) {
	s := downtimeSample{tokens: ms(100, 112, 125, 160, 172), trigger: 100 * time.Millisecond,
		stamp: 131 * time.Millisecond, seen: 140 * time.Millisecond}
	p, ok := partsOf(s)
	want := downtimeParts{gap: 35 * time.Millisecond, stopCopy: 6 * time.Millisecond, commit: 9 * time.Millisecond, gateway: 20 * time.Millisecond}
	if !ok || p != want {
		t.Fatalf("parts %+v, want %+v", p, want)
	}
	// The destination's part, measured, comes out of the gateway's.
	s.dest, s.destOK = 14*time.Millisecond, true
	p, _ = partsOf(s)
	want.gateway, want.dest = 6*time.Millisecond, 14*time.Millisecond
	if p != want {
		t.Fatalf("parts %+v, want %+v", p, want)
	}
	if p.stopCopy+p.commit+p.gateway+p.dest != p.gap {
		t.Fatal("the parts do not add up to the gap")
	}
	if _, ok := partsOf(downtimeSample{tokens: ms(1)}); ok {
		t.Fatal("parts of a stream with no switch")
	}
}

func TestWindowGaps(t *testing.T) {
	streams := [][]time.Duration{ms(0, 10, 20, 30, 40, 50), ms(5, 18, 31, 44)}
	got := windowGaps(streams, []window{{10 * time.Millisecond, 30 * time.Millisecond}, {40 * time.Millisecond, 60 * time.Millisecond}})
	// Stream 1: 10→20, 20→30, 40→50; stream 2: 18→31 ends past 30, 31→44
	// starts before 40: neither counts.
	want := ms(10, 10, 10)
	if len(got) != len(want) {
		t.Fatalf("gaps %v, want %v", got, want)
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("gaps %v, want %v", got, want)
		}
	}
	if g := windowGaps(streams, nil); len(g) != 0 {
		t.Fatalf("gaps outside every window: %v", g)
	}
}

func TestMedians(t *testing.T) {
	if medianMs(nil) != 0 || medianOf(nil) != 0 {
		t.Fatal("the median of nothing is not 0")
	}
	d := ms(30, 10, 20)
	if got := medianMs(d); got != 20 {
		t.Fatalf("median %v", got)
	}
	if d[0] != 30*time.Millisecond {
		t.Fatal("medianMs sorted its argument")
	}
	if got := medianMs(ms(10, 40, 20, 30)); got != 25 {
		t.Fatalf("even median %v", got)
	}
	if got := medianOf([]float64{3, 1, 2, 10}); got != 2.5 {
		t.Fatalf("even median %v", got)
	}
}

// Gamma arrivals: the mean gap is 1/rate and the coefficient of variation
// cv, Poisson (cv 1) and bursty (cv 4) alike.
func TestGammaGaps(t *testing.T) {
	for _, cv := range []float64{1, 4} {
		const seed = 42
		t.Logf("seed %d, cv %g", seed, cv)
		g := gammaGaps(rand.New(rand.NewPCG(seed, 0)), 20, cv, 400000)
		var sum, sq float64
		for _, d := range g {
			if d < 0 {
				t.Fatalf("negative gap %v", d)
			}
			x := d.Seconds()
			sum += x
			sq += x * x
		}
		n := float64(len(g))
		mean := sum / n
		sd := math.Sqrt(sq/n - mean*mean)
		if math.Abs(mean-0.05)/0.05 > 0.03 {
			t.Errorf("cv %g: mean gap %.5f s, want 0.05", cv, mean)
		}
		if math.Abs(sd/mean-cv)/cv > 0.08 {
			t.Errorf("cv %g: measured cv %.3f", cv, sd/mean)
		}
	}
}

func TestBurstWorkload(t *testing.T) {
	reqs, err := burstWorkload(3, 30, 4, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	again, _ := burstWorkload(3, 30, 4, 20*time.Second)
	if len(reqs) == 0 || len(again) != len(reqs) {
		t.Fatalf("%d and %d requests", len(reqs), len(again))
	}
	// The Azure generator's requests, in its order, re-timed.
	azure, err := workload.Generate(workload.Config{Seed: 3, Rate: 30, Duration: 400 * time.Second, Trace: workload.AzureConversation})
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range reqs {
		if r.At != again[i].At || r.At >= 20*time.Second || (i > 0 && r.At < reqs[i-1].At) {
			t.Fatalf("arrival %d at %v (previous %v, again %v)", i, r.At, reqs[max(i-1, 0)].At, again[i].At)
		}
		if r.Output != azure[i].Output || len(r.Prompt) != len(azure[i].Prompt) || string(r.Prompt) != string(azure[i].Prompt) {
			t.Fatalf("request %d is not the generator's", i)
		}
	}
}

// sampleAt is a migration at n tokens whose client gap is gap ms: the
// source's last token at 100 ms, the commit's stamp 5 ms later, the
// leader's event 3 ms after that, the last follower's 2 ms later still.
func sampleAt(n int, gatewayMs float64, gap int) downtimeSample {
	return downtimeSample{length: n, gatewayMs: gatewayMs, tokens: ms(88, 100, 100+gap, 100+gap+12), trigger: 88 * time.Millisecond,
		started: 60 * time.Millisecond, stamp: 105 * time.Millisecond, seen: 108 * time.Millisecond, seenLast: 110 * time.Millisecond,
		rpc: 4 * time.Millisecond, dest: 18 * time.Millisecond, destOK: n != 256}
}

func testMigrationRaw() *migrationRaw {
	r := &migrationRaw{profileStep: 12630 * time.Microsecond, batch: 9, aborted: 1, differing: 0, failed: 0,
		bgOn: ms(13, 13, 14, 12), bgOff: ms(12, 13, 13, 12)}
	for i, n := range migrationLengths {
		for k := 0; k < 3; k++ {
			r.samples = append(r.samples, sampleAt(n, float64(30+i+k), 30+i+k))
		}
	}
	r.recompute = []recomputeSample{
		{lastBefore: 90 * time.Millisecond, kill: 100 * time.Millisecond, seen: 120 * time.Millisecond, first: 600 * time.Millisecond, recomputed: 8192},
		{lastBefore: 90 * time.Millisecond, kill: 100 * time.Millisecond, seen: 130 * time.Millisecond, first: 630 * time.Millisecond, recomputed: 8193},
	}
	rec := func(arrival, first int, n int) *servingstats.Record {
		c := make([]time.Duration, n)
		for i := range c {
			c[i] = time.Duration(first+10*i) * time.Millisecond
		}
		return &servingstats.Record{Arrival: time.Duration(arrival) * time.Millisecond, Chunks: c}
	}
	r.burstOn = []*burstResult{{window: 150 * time.Millisecond, recs: []*servingstats.Record{rec(0, 100, 10), rec(0, 300, 11)}, preemptions: 2,
		migrations: 7, aborted: 1, downtimeCount: 7, downtimeSum: 0.21, paced: 10.1, emulated: 10}}
	r.burstOff = []*burstResult{{window: 150 * time.Millisecond, recs: []*servingstats.Record{rec(0, 100, 10), rec(0, 500, 10), {Arrival: 0, Err: errors.New("HTTP 503")}},
		preemptions: 5, failed: 1, wrong: 1, paced: 10, emulated: 10}}
	r.drain = &drainResult{streams: 56, onDrained: 32, empty: 5500 * time.Millisecond, left: 6 * time.Second, committed: 32,
		downtimeN: 32, downtimeMs: 31}
	return r
}

func TestMigrationFigures(t *testing.T) {
	f := migrationFigures(testMigrationRaw())
	// The contract: these keys, exactly.
	for _, k := range []string{"downtime_ms_256", "downtime_ms_1024", "downtime_ms_4096", "downtime_ms_8192", "decode_step_ms",
		"recompute_ms_8192", "slowdown_pct", "burst_p99_ttft_ms_on", "burst_p99_ttft_ms_off", "burst_throughput_loss_pct",
		"drain_recomputed_tokens", "drain_outputs_differing"} {
		if _, ok := f[k]; !ok {
			t.Errorf("no key %s", k)
		}
	}
	near := func(k string, want float64) {
		t.Helper()
		if math.Abs(f[k]-want) > 1e-9 {
			t.Errorf("%s = %v, want %v", k, f[k], want)
		}
	}
	// Medians of 30+i, 31+i, 32+i.
	near("downtime_ms_256", 31)
	near("downtime_ms_8192", 34)
	near("downtime_max_ms_8192", 35)
	near("downtime_flatness", 34.0/31)
	near("downtime_client_ms_1024", 32)
	near("downtime_stop_copy_ms_1024", 5)
	near("downtime_commit_ms_1024", 3)
	near("downtime_gateway_ms_1024", 32-8-18)
	near("downtime_dest_ms_1024", 18)
	near("downtime_gateway_ms_256", 31-8)
	if _, ok := f["downtime_dest_ms_256"]; ok {
		t.Error("a destination's part with none measured")
	}
	near("migration_ms_4096", 45)
	near("migrate_rpc_ms", 4)
	near("commit_follower_lag_ms", 2)
	near("downtime_migrations_256", 3)
	near("downtime_aborted", 1)
	near("decode_step_ms", 12.63)
	near("decode_step_measured_ms", 12.5)
	// Background TPOT: 13 during, 12.5 without.
	near("slowdown_pct", 4)
	// Recompute: seen → first token, medians of 480 and 500.
	near("recompute_ms_8192", 490)
	near("recompute_gap_ms_8192", 525)
	near("recompute_tokens_8192", 8192.5)
	// TTFT p99 (nearest rank) of {100, 300} and of {100, 500}.
	near("burst_p99_ttft_ms_on", 300)
	near("burst_p99_ttft_ms_off", 500)
	near("burst_mean_ttft_ms_on", 200)
	near("burst_mean_ttft_ms_off", 300)
	// 21 tokens in 400 ms against 20 in 590 ms.
	near("burst_tokens_per_s_on", 52.5)
	near("burst_tokens_per_s_off", 20/0.59)
	near("burst_throughput_loss_pct", 100*(1-52.5/(20/0.59)))
	near("burst_makespan_s_on", 0.4)
	// Before 150 ms: 5 tokens on, 5 off (the 300 and 500 ms streams start later).
	near("burst_window_tokens_per_s_on", 5/0.15)
	near("burst_window_loss_pct", 0)
	near("burst_preemptions_on", 2)
	near("burst_preemptions_off", 5)
	near("burst_requests", 2)
	near("burst_runs", 1)
	near("burst_pacing_overrun_pct_on", 1)
	near("burst_pacing_overrun_pct_off", 0)
	near("burst_p99_ttft_ms_on_1", 300)
	near("burst_failed_off", 1)
	near("burst_outputs_differing_off", 1)
	near("burst_downtime_mean_ms", 30)
	near("drain_recomputed_tokens", 0)
	near("drain_outputs_differing", 0)
	near("drain_empty_s", 5.5)
	near("drain_streams_on_worker", 32)

	// A phase not run leaves its keys out.
	f = migrationFigures(&migrationRaw{drain: &drainResult{}})
	if _, ok := f["downtime_ms_256"]; ok {
		t.Errorf("downtime keys without a downtime phase: %v", keys(f))
	}
	if _, ok := f["drain_recomputed_tokens"]; !ok {
		t.Errorf("no drain keys: %v", keys(f))
	}
}

// Pairs of burst runs pool: every request's TTFT, tokens over the summed
// makespans, counters summed.
func TestBurstPooled(t *testing.T) {
	run := func(first, n int, preempt float64) *burstResult {
		c := make([]time.Duration, n)
		for i := range c {
			c[i] = time.Duration(first+10*i) * time.Millisecond
		}
		return &burstResult{window: time.Second, recs: []*servingstats.Record{{Chunks: c}}, preemptions: preempt}
	}
	r := &migrationRaw{burstOn: []*burstResult{run(100, 11, 1), run(900, 11, 2)}, burstOff: []*burstResult{run(200, 11, 0), run(2000, 11, 4)}}
	f := migrationFigures(r)
	// TTFTs on {100, 900}, off {200, 2000}: p99 is the larger.
	if f["burst_p99_ttft_ms_on"] != 900 || f["burst_p99_ttft_ms_off"] != 2000 || f["burst_p99_ttft_ms_on_1"] != 100 || f["burst_p99_ttft_ms_off_2"] != 2000 {
		t.Fatalf("p99s %v", f)
	}
	// 22 tokens over 0.2 + 1.0 s on, over 0.3 + 2.1 s off.
	if math.Abs(f["burst_tokens_per_s_on"]-22/1.2) > 1e-9 || math.Abs(f["burst_tokens_per_s_off"]-22/2.4) > 1e-9 {
		t.Fatalf("throughput %v / %v", f["burst_tokens_per_s_on"], f["burst_tokens_per_s_off"])
	}
	if f["burst_preemptions_on"] != 3 || f["burst_preemptions_off"] != 4 || f["burst_requests"] != 2 || f["burst_runs"] != 2 {
		t.Fatalf("counts %v", f)
	}
	var w bytes.Buffer
	printMigrationTable(&w, f)
	if !strings.Contains(w.String(), "| burst p99 TTFT, migration on / off (2 requests in 2 run(s) each) | 900 / 2000 ms (2.22× lower; each pair: 100 / 200, 900 / 2000) | on ≤ half of off | met |\n") {
		t.Fatalf("table\n%s", w.String())
	}
}

func TestPrintMigrationTable(t *testing.T) {
	var w bytes.Buffer
	printMigrationTable(&w, migrationFigures(testMigrationRaw()))
	out := w.String()
	for _, want := range []string{
		"| measure | result | goal | verdict |",
		"| downtime, 256 tokens (median of 3; max) | 31.0 ms = 2.5 steps (max 32.0) | ≤ one step (12.6 ms) | **missed** |",
		"| downtime max/min over the lengths | 1.10 | ≤ 1.5 | met |",
		"| decode step at batch 9 | profile 12.63 ms; measured 12.5 ms | — | — |",
		"| TPOT of the other requests, during migrations vs without | +4.00% (13.00 vs 12.50 ms) | ≤ 1% | **missed** |",
		"| burst p99 TTFT, migration on / off (2 requests in 1 run(s) each) | 300 / 500 ms (1.67× lower) | on ≤ half of off | **missed** |",
		"| drain: tokens recomputed | 0 | 0 | met |",
		"| burst migrations (committed / aborted) | 7 / 1; downtime 30.0 ms on average | — | — |",
		"| drain of a worker with 32 streams: time to empty / to LEFT | 5.50 s / 6.00 s (32 migrations, 0 aborted; downtime 31.0 ms on average) | — | — |",
		"| 8192 | 34.0 | 34.0 | 5.0 | 3.0 | 8.0 | 18.0 | 45.0 |",
		"| 256 | 31.0 | 31.0 | 5.0 | 3.0 | 23.0 | — | 45.0 |",
	} {
		if !strings.Contains(out, want+"\n") {
			t.Errorf("no line %q in\n%s", want, out)
		}
	}
	// Only the phases run.
	w.Reset()
	printMigrationTable(&w, migrationFigures(&migrationRaw{drain: &drainResult{streams: 3}}))
	if strings.Contains(w.String(), "| downtime,") || !strings.Contains(w.String(), "drain: outputs ≠ reference | 0 of 3 (failed 0) | 0 | met |") {
		t.Errorf("drain only:\n%s", w.String())
	}
}

func TestAbortReason(t *testing.T) {
	for in, want := range map[string]string{
		"the destination w3 refused stage 1 (MIGRATE_REFUSAL_OUT_OF_PAGES): worker: migration: the destination is out of KV pages": "refused: out_of_pages",
		"worker: migration: the request left the source: the request was preempted":                                                "the request was preempted",
		"stage timeout: not committed within 5s of its start":                                                                      "stage timeout",
		"request completed": "request completed",
		"stage 1: export the partial page: 0 positions, the core counts 0: engine: bad input: unknown sequence 176": "stage N: export the partial page: N positions, the core counts N: engine: bad input: unknown sequence N",
		`worker: migration: no such request here under that epoch: request "cmpl-8efb", epoch 0`:                    `worker: migration: no such request here under that epoch: request "…", epoch N`,
	} {
		if got := abortReason(in); got != want {
			t.Errorf("abortReason(%q) = %q, want %q", in, got, want)
		}
	}
	if got := abortSummary(map[string]int{"b": 2, "a": 2, "c": 5}); got != "5 c, 2 a, 2 b" {
		t.Errorf("summary %q", got)
	}
}
