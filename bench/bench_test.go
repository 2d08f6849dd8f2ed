package bench

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/recoverystudy"
	"github.com/lumen-project/lumen/internal/servingstats"
	"github.com/lumen-project/lumen/internal/workload"
)

func ms(v ...int) []time.Duration {
	out := make([]time.Duration, len(v))
	for i, x := range v {
		out[i] = time.Duration(x) * time.Millisecond
	}
	return out
}

func keys(m map[string]float64) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func TestPercentileMs(t *testing.T) {
	if got := percentileMs(nil, 0.99); got != 0 {
		t.Fatalf("no samples: %v", got)
	}
	d := ms(5, 1, 3, 2, 4)
	for p, want := range map[float64]float64{0: 1, 0.5: 3, 0.99: 4, 1: 5} {
		if got := percentileMs(d, p); got != want {
			t.Errorf("p%v = %v, want %v", p, got, want)
		}
	}
	if got := percentileMs(ms(1)[:1], 0.5); got != 1 {
		t.Fatalf("one sample: %v", got)
	}
	if got := percentileMs([]time.Duration{1500 * time.Microsecond}, 0.5); got != 1.5 {
		t.Fatalf("sub-millisecond precision lost: %v", got)
	}
}

func TestGatewayFiguresKeysAndRow(t *testing.T) {
	a := &streamResult{ttft: ms(10, 20, 30), tokens: 1000, wall: time.Second, errors: 1}
	b := &streamResult{ttft: ms(11, 21, 35), tokens: 900, wall: time.Second, errors: 2}
	out := map[string]float64{}
	row := gatewayFigures(out, 100, a, b)
	want := []string{"added_ttft_p99_ms_100", "direct_tokens_per_s_100", "direct_ttft_p50_ms_100", "direct_ttft_p99_ms_100",
		"errors_100", "gateway_tokens_per_s_100", "gateway_ttft_p50_ms_100", "gateway_ttft_p99_ms_100", "throughput_loss_pct_100"}
	if got := keys(out); !reflect.DeepEqual(got, want) {
		t.Fatalf("keys %v\nwant %v", got, want)
	}
	// p99 of three samples is the second: 20 and 21 ms.
	if out["added_ttft_p99_ms_100"] != 1 || out["errors_100"] != 3 || math.Abs(out["throughput_loss_pct_100"]-10) > 1e-9 {
		t.Fatalf("figures %v", out)
	}
	if row.name != "100 streams" || row.direct != "TTFT p50 20.0 p99 20.0 ms, 1000 tok/s" ||
		row.gw != "TTFT p50 21.0 p99 21.0 ms, 900 tok/s" || row.diff != "p99 TTFT +1.0 ms, throughput -10.0%" {
		t.Fatalf("row %+v", row)
	}
	var w bytes.Buffer
	printGatewayTable(&w, []gatewayRow{row})
	wantTable := "\n" +
		"load         straight to the worker                   through the gateway                      gateway's cost\n" +
		"100 streams  TTFT p50 20.0 p99 20.0 ms, 1000 tok/s    TTFT p50 21.0 p99 21.0 ms, 900 tok/s     p99 TTFT +1.0 ms, throughput -10.0%\n" +
		"(goal, issue 16: <= 2 ms added p99 TTFT at 1, 100 and 500 streams; <= 1% throughput loss at 500)\n"
	if w.String() != wantTable {
		t.Fatalf("table\n%q\nwant\n%q", w.String(), wantTable)
	}
}

func TestGatewayPrompt(t *testing.T) {
	p := gatewayPrompt(28)
	if len(p) != 28 || p[0] != 'a' || p[25] != 'z' || p[26] != 'a' || p[27] != 'b' {
		t.Fatalf("prompt %v", p)
	}
}

func TestPacingSummary(t *testing.T) {
	if _, err := pacingSummary(nil, time.Millisecond); err == nil {
		t.Fatal("no steps summarized without an error")
	}
	res, err := pacingSummary([]float64{1.2, 0.9, 1.04, 1.0}, 12500*time.Microsecond)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{"steps": 4, "step_target_ms": 12.5, "ratio_mean": 1.035, "ratio_p50": 1.0, "ratio_p90": 1.04,
		"ratio_p99": 1.04, "ratio_max": 1.2, "within_5pct": 0.5}
	if !reflect.DeepEqual(keys(res), keys(want)) {
		t.Fatalf("keys %v, want %v", keys(res), keys(want))
	}
	for k, v := range want {
		if math.Abs(res[k]-v) > 1e-9 {
			t.Errorf("%s = %v, want %v", k, res[k], v)
		}
	}
	var w bytes.Buffer
	printPacingSummary(&w, res)
	if got := w.String(); got != "4 decode steps: actual/profile time mean 1.0350, p50 1.0000, p90 1.0400, p99 1.0400, max 1.2000; 50.0% of steps within 5%\n" {
		t.Fatalf("line %q", got)
	}
}

func TestPrintControllerTable(t *testing.T) {
	var w bytes.Buffer
	printControllerTable(&w, []controllerRow{{"Dispatch, 1 callers", "100/s", ""}, {"failover", "median 0.5 s", "median <= 1 s"}})
	want := "\n" + pad("measure", 44) + " " + pad("result", 58) + " goal\n" +
		pad("Dispatch, 1 callers", 44) + " " + pad("100/s", 58) + " \n" +
		pad("failover", 44) + " " + pad("median 0.5 s", 58) + " median <= 1 s\n"
	if w.String() != want {
		t.Fatalf("table\n%q\nwant\n%q", w.String(), want)
	}
}

func pad(s string, n int) string { return s + strings.Repeat(" ", n-len(s)) }

// The JSON keys of bench recovery are read by scripts and the docs.
func TestRecoveryFiguresJSONKeys(t *testing.T) {
	b, err := json.Marshal(recoveryFigures{})
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	var got []string
	for k := range m {
		got = append(got, k)
	}
	sort.Strings(got)
	want := []string{"affected_from_s", "affected_requests", "affected_to_s", "affected_tpot_mean_ms", "affected_ttft_mean_ms",
		"affected_ttft_p99_ms", "arrival_rate_per_s", "checkpoint_bytes_sent", "cluster_recovery_s", "common_affected_requests", "common_affected_tpot_mean_ms",
		"common_affected_ttft_mean_ms", "common_affected_ttft_p99_ms", "failed_requests", "host_gap_pct", "interrupted",
		"interrupted_recovery_mean_s", "interrupted_recovery_p99_s", "pacing_overrun_pct", "pages_reused", "plan_ms",
		"pre_failure_ttft_mean_ms", "preemptions", "recovered", "recovery_s", "requests", "restored_fraction", "resume_mean_ms", "resume_p99_ms",
		"saturated_rate_per_s", "time_scale", "tokens_recomputed", "tpot_mean_ms", "ttft_mean_ms", "ttft_p99_ms", "wrong_outputs"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("keys %v\nwant %v", got, want)
	}
}

func TestRequestBodies(t *testing.T) {
	reqs := []workload.Request{{Prompt: []int32{5, 6}, Output: 7}}
	got := requestBodies(reqs)
	// What the benchmark sent before the client was shared.
	want, _ := json.Marshal(map[string]any{"model": "lumen-tiny", "prompt": reqs[0].Prompt, "max_tokens": reqs[0].Output,
		"temperature": 0, "stream": true, "stream_options": map[string]any{"include_usage": true}})
	if len(got) != 1 || string(got[0]) != string(want) {
		t.Fatalf("body %s\nwant %s", got[0], want)
	}
}

func TestRunFigures(t *testing.T) {
	o := &runOutcome{
		recs: []*servingstats.Record{
			// Before warmup: counted, not timed.
			{ID: "a", Arrival: 0, Chunks: ms(100, 110), Tokens: 2},
			// After warmup, before the failure: TTFT 50 ms, TPOT 10 ms.
			{ID: "b", Arrival: 2 * time.Second, Chunks: []time.Duration{2050 * time.Millisecond, 2060 * time.Millisecond, 2070 * time.Millisecond}, Tokens: 3},
			// After the failure, interrupted, resumed.
			{ID: "c", Arrival: 6 * time.Second, Chunks: []time.Duration{6100 * time.Millisecond, 6110 * time.Millisecond, 8110 * time.Millisecond}, Tokens: 3},
			{ID: "d", Arrival: 7 * time.Second, Err: errors.New("HTTP 503")},
		},
		texts:       []string{"x", "y", "wrong", ""},
		interrupted: map[string]bool{"c": true, "d": true},
		failAt:      8 * time.Second,
		restored:    12, recomputed: 34, emulated: 10, paced: 11, stepGap: 0.55,
	}
	o.markInterrupted()
	if !o.recs[2].Interrupted || !o.recs[3].Interrupted || o.recs[0].Interrupted || o.recs[1].Interrupted {
		t.Fatal("the records of the requests in the recovery plans are not the ones marked interrupted")
	}
	f := runFigures(o, []string{"x", "y", "z", "w"}, time.Second, 5*time.Second)
	if f.Requests != 4 || f.FailedRequests != 1 || f.WrongOutputs != 1 || f.Interrupted != 2 {
		t.Fatalf("counts %+v", f)
	}
	if f.TTFTMeanMs != 75 || f.PreFailureTTFTMs != 50 {
		t.Fatalf("TTFT mean %v, before the failure %v", f.TTFTMeanMs, f.PreFailureTTFTMs)
	}
	if f.PagesReused != 12 || f.TokensRecomputed != 34 || math.Abs(f.PacingOverrunPct-10) > 1e-9 || math.Abs(f.HostGapPct-5) > 1e-9 {
		t.Fatalf("pages %v, tokens %v, overrun %v, host gap %v", f.PagesReused, f.TokensRecomputed, f.PacingOverrunPct, f.HostGapPct)
	}
	if f.ResumeMeanMs <= 0 {
		t.Fatalf("the interrupted request's resume was not timed: %+v", f)
	}
}

// TestRunFiguresInEmulatedTime: a run at -time-scale 2 whose clock read
// every time twice as late gives the figures of the same run at scale 1,
// in emulated time as lumen sim reports them: times divided once, counts
// untouched, and stop-and-restart's regenerations judged on the emulated
// pauses (request d's pause after the kill starts within ResumeGrace in
// emulated time, not on the clock).
func TestRunFiguresInEmulatedTime(t *testing.T) {
	outcome := func(k time.Duration) *runOutcome {
		o := &runOutcome{
			recs: []*servingstats.Record{
				{ID: "b", Arrival: k * 2 * time.Second, Chunks: []time.Duration{k * 2050 * time.Millisecond, k * 2060 * time.Millisecond, k * 2070 * time.Millisecond}, Tokens: 3},
				{ID: "c", Arrival: k * 6 * time.Second, Chunks: []time.Duration{k * 6100 * time.Millisecond, k * 6110 * time.Millisecond, k * 8110 * time.Millisecond}, Tokens: 3},
				{ID: "d", Arrival: k * 7800 * time.Millisecond, Chunks: []time.Duration{k * 8300 * time.Millisecond, k * 8450 * time.Millisecond, k * 9200 * time.Millisecond}, Tokens: 3},
			},
			texts:       []string{"y", "z", "w"},
			interrupted: map[string]bool{"c": true, "d": true},
			queue:       []servingstats.Sample{{At: k * 7 * time.Second, Waiting: 3}},
			failAt:      k * 8 * time.Second, planAt: k * 8010 * time.Millisecond,
			assistS: float64(k) * 4,
			// Counts, the same at any scale.
			restored: 3, restoredReqs: 1, ckptPages: 10, recomputed: 5, emulated: 100, paced: 101, preemptions: 4, stepGap: 5,
			draftTokens: 50, acceptedTokens: 25,
			regenerates: true, regenerated: 7,
		}
		o.markInterrupted()
		return o
	}
	prompts := []int{10, 20, 100}
	slow, want := outcome(2), outcome(1)
	slow.finish(2, prompts)
	want.finish(1, prompts)
	if !reflect.DeepEqual(slow, want) {
		t.Fatalf("rescaled %+v\nwant %+v", slow, want)
	}
	// c and d had streamed before their pauses ended: their prompts and
	// the 7 tokens decoded again, on top of the workers' 5.
	if want.recomputed != 5+7+20+100 {
		t.Fatalf("recomputed %v, want %v", want.recomputed, 5+7+20+100)
	}
	refs := []string{"y", "z", "w"}
	got, ref := runFigures(slow, refs, time.Second, 5*time.Second), runFigures(want, refs, time.Second, 5*time.Second)
	if math.Abs(got.TTFTMeanMs-650.0/3) > 1e-9 || got.TPOTMeanMs != ref.TPOTMeanMs || got.ResumeMeanMs != ref.ResumeMeanMs || got.ResumeMeanMs <= 0 {
		t.Fatalf("at scale 2: TTFT %v ms, TPOT %v, resume %v; at scale 1: %v, %v, %v",
			got.TTFTMeanMs, got.TPOTMeanMs, got.ResumeMeanMs, ref.TTFTMeanMs, ref.TPOTMeanMs, ref.ResumeMeanMs)
	}
	if !reflect.DeepEqual(got, ref) {
		t.Fatalf("figures at scale 2 %+v\nat scale 1 %+v", got, ref)
	}
}

// TestColumnsNamedOnce: a column named twice in -columns is refused (its
// second run would replace the first's figures), naming it.
func TestColumnsNamedOnce(t *testing.T) {
	cfg := RecoveryConfig{Columns: "lumen, lumen-no-spec,lumen"}
	if _, err := cfg.columns(); err == nil || !strings.Contains(err.Error(), `"lumen" is named twice`) {
		t.Fatalf("-columns lumen,lumen-no-spec,lumen: err %v", err)
	}
	cfg.Columns = "lumen,lumen-no-spec"
	if cols, err := cfg.columns(); err != nil || len(cols) != 2 {
		t.Fatalf("-columns lumen,lumen-no-spec: %v, %v", cols, err)
	}
}

func TestPrintRecoveryTable(t *testing.T) {
	figs := map[string]*recoveryFigures{}
	for i, c := range []string{"stop-and-restart", "recompute", "fixed-checkpoint", "lumen-no-spec", "lumen", "lumen-no-failure", "no-checkpoint-no-failure"} {
		figs[c] = &recoveryFigures{Figures: recoverystudy.Figures{TTFTMeanMs: float64(100 + 10*i), TTFTP99Ms: 200, TPOTMeanMs: 20, RecoveryS: 2, ClusterRecoveryS: 2,
			Recovered: true, PagesReused: float64(i), Requests: 50, FailedRequests: 0}, WrongOutputs: i % 2}
	}
	figs["stop-and-restart"].Recovered = false
	sr := &figs["stop-and-restart"].Figures
	sr.AffectedTTFTMeanMs, sr.ReferenceTTFTMeanMs, sr.AffectedTTFTP99Ms, sr.ReferenceTTFTP99Ms = 800, 200, 3000, 1000
	sr.AffectedTPOTMeanMs, sr.ReferenceTPOTMeanMs, sr.InterruptedRecoveryMeanS, sr.InterruptedRecoveryP99S = 40, 25, 1.5, 4.25
	figs["lumen"].AffectedTTFTMeanMs, figs["lumen"].InterruptedRecoveryMeanS = 400, 0.75
	sr.CommonTTFTMeanMs, figs["lumen"].CommonTTFTMeanMs = 600, 450
	rule := servingstats.RecoveryRule{Window: 5 * time.Second, Step: 250 * time.Millisecond, Tolerance: 0.10, QueueSlack: 1}
	var w bytes.Buffer
	printRecoveryTable(&w, recoverystudy.Setups[0], figs, rule)
	lines := strings.Split(w.String(), "\n")
	for _, want := range []string{
		"w4 (4 workers, qwen3-32b-h100, 1 failed)",
		pad("", 24) + "   stop-and-restart          recompute   fixed-checkpoint      lumen-no-spec              lumen   lumen-no-failure no-checkpoint-no-failure",
		pad("TTFT mean (ms)", 24) + "              100.0              110.0              120.0              130.0              140.0              150.0              160.0",
		pad("recovery (s)", 24) + "               >2.0               2.00               2.00               2.00               2.00               2.00               2.00",
		pad("  affected", 24) + "              800.0                0.0                0.0                0.0              400.0                0.0                0.0",
		pad("interrupted -> token (s)", 24) + "        1.50 / 4.25        0.00 / 0.00        0.00 / 0.00        0.00 / 0.00        0.75 / 0.00        0.00 / 0.00        0.00 / 0.00",
		"  lumen vs stop-and-restart: TTFT mean -50.0% / -25.0%, p99 -100.0% / n/a, TPOT -100.0% / n/a; interrupted -> token -50.0%, cluster recovery +0.0%",
		"  stop-and-restart over no-checkpoint-no-failure: TTFT mean 4.00x, p99 3.00x, TPOT 1.60x",
		pad("requests / failed", 24) + "             50 / 0             50 / 0             50 / 0             50 / 0             50 / 0             50 / 0             50 / 0",
		"lumen vs stop-and-restart: TTFT mean +40.0%, p99 +0.0%, TPOT +0.0%, recovery +0.0%",
		"lumen vs recompute: TTFT mean +27.3%, p99 +0.0%, TPOT +0.0%, recovery +0.0%",
		"lumen vs lumen-no-spec (the assist's share): TTFT mean +7.7%, p99 +0.0%, TPOT +0.0%, recovery +0.0%",
		"checkpointing in steady state (lumen vs none, no failure): TTFT mean -6.2%, TPOT +0.0% (goal: within 2%)",
		pad("outputs != reference", 24) + "                  0                  1                  0                  1                  0                  1                  0",
	} {
		found := false
		for _, l := range lines {
			found = found || l == want
		}
		if !found {
			t.Errorf("no line %q in\n%s", want, w.String())
		}
	}
}

func TestControllerFigures(t *testing.T) {
	out := map[string]float64{}
	dispatchFigures(out, "", 64, loadResult{ops: 300, elapsed: 3 * time.Second, lat: ms(4, 1, 2)})
	row := failoverFigures(out, []float64{0.9, 0.4, 1.5})
	want := map[string]float64{"dispatch_per_s_64": 100, "dispatch_p50_ms_64": 2, "dispatch_p99_ms_64": 2,
		"failover_median_s": 0.9, "failover_max_s": 1.5, "failover_min_s": 0.4}
	if !reflect.DeepEqual(out, want) {
		t.Fatalf("figures %v\nwant %v", out, want)
	}
	if row != (controllerRow{"failover, 3 kills of the leader", "median 0.900 s  max 1.500 s  min 0.400 s", "median <= 1 s, max <= 2 s"}) {
		t.Fatalf("row %+v", row)
	}
}

// The gateway's own-time quantiles come from histogram deltas as
// Prometheus's histogram_quantile reads them.
func TestOwnQuantile(t *testing.T) {
	b := func(ns ...float64) []ownBucket {
		les := []float64{0.001, 0.002, 0.004, math.Inf(1)}
		var out []ownBucket
		for i, n := range ns {
			out = append(out, ownBucket{les[i], n})
		}
		return out
	}
	before := &ownSample{buckets: map[string][]ownBucket{"p": b(5, 5, 5, 5)}, cpu: 1, requests: 10}
	after := &ownSample{buckets: map[string][]ownBucket{"p": b(5, 105, 205, 205)}, cpu: 3, requests: 210}
	d := after.minus(before)
	if d.cpu != 2 || d.requests != 200 {
		t.Fatalf("delta cpu %v requests %v, want 2 and 200", d.cpu, d.requests)
	}
	// 200 observations: 100 in (1, 2] ms, 100 in (2, 4] ms.
	if got := d.quantileMs("p", 0.5); math.Abs(got-2) > 1e-9 {
		t.Errorf("p50 %v ms, want 2", got)
	}
	if got := d.quantileMs("p", 0.99); math.Abs(got-3.96) > 1e-9 {
		t.Errorf("p99 %v ms, want 3.96", got)
	}
	if got := d.quantileMs("none", 0.5); !math.IsNaN(got) {
		t.Errorf("no observations: %v, want NaN", got)
	}
}

// The Raft write stream's keys come from the replicas' counters: fsyncs
// (all ops), entries and bytes written, commands and bytes proposed by
// type, each a difference over the phase.
func TestRaftWriteFigures(t *testing.T) {
	l0 := parseRaftWrites(`# HELP lumen_controller_raft_fsyncs_total x
lumen_controller_raft_fsyncs_total{op="delete"} 0
lumen_controller_raft_fsyncs_total{op="logs"} 100
lumen_controller_raft_fsyncs_total{op="stable"} 4
lumen_controller_raft_log_entries_total 200
lumen_controller_raft_log_bytes_total 1000
lumen_controller_proposed_commands_total{command="dispatch"} 50
lumen_controller_proposed_bytes_total{command="dispatch"} 1500
`)
	l1 := parseRaftWrites(`lumen_controller_raft_fsyncs_total{op="delete"} 1
lumen_controller_raft_fsyncs_total{op="logs"} 303
lumen_controller_raft_fsyncs_total{op="stable"} 4
lumen_controller_raft_log_entries_total 1000
lumen_controller_raft_log_bytes_total 41000
lumen_controller_proposed_commands_total{command="dispatch"} 6050
lumen_controller_proposed_bytes_total{command="dispatch"} 181500
lumen_controller_proposed_commands_total{command="complete"} 2000
lumen_controller_proposed_bytes_total{command="complete"} 40000
lumen_controller_proposed_commands_total{command="noop"} 0
`)
	f0 := parseRaftWrites(`lumen_controller_raft_fsyncs_total{op="logs"} 10`)
	f1 := parseRaftWrites(`lumen_controller_raft_fsyncs_total{op="logs"} 210`)
	out := map[string]float64{}
	rows := raftWriteFigures(out, 64, l0, l1, f0, f1, 2*time.Second)
	want := map[string]float64{
		"raft_fsyncs_per_s_64": 102, "raft_fsyncs_per_s_follower_64": 100,
		"raft_log_entries_per_s_64": 400, "raft_log_bytes_per_s_64": 20000, "raft_entries_per_fsync_64": 400.0 / 102,
		"raft_commands_per_s_64": 4000, "raft_commands_per_fsync_64": 4000.0 / 102,
		"raft_commands_per_s_64_dispatch": 3000, "raft_bytes_per_s_64_dispatch": 90000, "raft_fsyncs_per_s_64_dispatch": 102 * 0.75,
		"raft_commands_per_s_64_complete": 1000, "raft_bytes_per_s_64_complete": 20000, "raft_fsyncs_per_s_64_complete": 102 * 0.25,
	}
	if !reflect.DeepEqual(out, want) {
		t.Fatalf("figures %v\nwant %v", out, want)
	}
	if len(rows) != 3 || rows[1].name != "    complete: commands, bytes, fsyncs/s" || rows[2].value != "3000, 90000, 76.5" {
		t.Fatalf("rows %+v", rows)
	}
	// No fsync in the phase (the counters unreadable): no keys.
	out = map[string]float64{}
	if rows := raftWriteFigures(out, 64, l0, l0, f0, f0, time.Second); rows != nil || len(out) != 0 {
		t.Fatalf("no writes gave %v, %v", rows, out)
	}
}
