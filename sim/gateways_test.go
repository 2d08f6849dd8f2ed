package sim

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/engine"
)

// TestGatewaysBalance is issue 16's balance goal at a size that fits in
// `go test`: 16 workers at 70% load, 30 s of Poisson arrivals, the
// dispatch inside Apply against 1 gateway and 4 (internal/placer as it
// is, and choosing by ChoosePartitionFill) on the same arrivals. Every
// run checks each token a client got against the reference's (onToken)
// and conservation (Run's Check: every request ended once, no placement
// left in the fsm). One gateway is held to the goal (5%); 4 choosing by
// ChoosePartitionFill to 15%: in shares of 4 workers a gateway's
// preference costs more balance than in the 64-worker figure's shares of
// 16 (docs/benchmarks.md: +6.5% running_cv at 16 workers over 120 s,
// +10.9% here over 40 s at seed 3). 4 gateways with placer's choice herd:
// that is logged, and partition-fill must herd less.
func TestGatewaysBalance(t *testing.T) {
	o := DefaultGatewayOptions()
	// Saturated: what the calibration measures for 16 workers (101.7/s
	// at seed 3), without running it.
	o.Workers, o.Seed, o.Saturated = 16, 3, 100
	t.Logf("seed %d", o.Seed)
	o.Timeline = Timeline{Warmup: 3 * time.Second, Duration: 30 * time.Second, ReloadScale: 1}
	f, err := RunGateways(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%.1f requests/s (%d), saturated %.1f/s", f.RatePerSec, f.Requests, f.SaturatedPerSec)
	names := []string{"apply", "gateways-1", "gateways-4", "gateways-4-partition-fill"}
	if len(f.Runs) != len(names) {
		t.Fatalf("%d runs, want %v", len(f.Runs), names)
	}
	for i, r := range f.Runs {
		t.Logf("%s: TTFT mean %.1f ms (%+.2f%%), p99 %.1f ms, running_cv %.4f (%+.2f%%), herded %.1f%%, table age %.2f ms",
			r.Dispatch, r.TTFTMeanMs, r.TTFTMeanVsApplyPct, r.TTFTP99Ms, r.RunningCV, r.RunningCVVsApplyPct, r.HerdedPct, r.TableAgeMeanMs)
		if r.Dispatch != names[i] || r.TTFTMeanMs <= 0 || r.RunningCV <= 0 {
			t.Fatalf("run %d: %+v, want %s with figures", i, r, names[i])
		}
		if i > 0 && (r.Placed == 0 || r.Fallback > 4) {
			t.Errorf("%s: %g placements from a replica, %g sent to Apply", r.Dispatch, r.Placed, r.Fallback)
		}
	}
	for i, bound := range map[int]float64{1: 5, 3: 15} {
		r := f.Runs[i]
		if r.TTFTMeanVsApplyPct > bound || r.RunningCVVsApplyPct > bound {
			t.Errorf("%s: TTFT mean %+.2f%%, running_cv %+.2f%% against Apply's (bound %g%%)", r.Dispatch, r.TTFTMeanVsApplyPct, r.RunningCVVsApplyPct, bound)
		}
	}
	if f.Runs[3].HerdedPct >= f.Runs[2].HerdedPct {
		t.Errorf("partition-fill herds as much as placer's choice: %.1f%% of placements against %.1f%%", f.Runs[3].HerdedPct, f.Runs[2].HerdedPct)
	}
}

// gatewayConfig is 8 workers with gateways, arrivals at 30/s for d.
func gatewayConfig(t *testing.T, gateways int, d time.Duration) Config {
	t.Helper()
	p := engine.Profiles["qwen3-14b-h100"]
	reqs, err := workload.GenerateLazy(workload.Config{Seed: 5, Rate: 30, Duration: d, Trace: workload.AzureConversation})
	if err != nil {
		t.Fatal(err)
	}
	st := Study{Setup: Setup{Workers: 8, Profile: "qwen3-14b-h100", MaxRunning: 32, Budget: 80e9}, Timeline: Timeline{ReloadScale: 1},
		Seed: 5, Timing: DefaultTiming()}
	cfg := st.config(p, policy.Lumen, reqs)
	cfg.Gateways = gateways
	return cfg
}

// TestGatewaysRefusedPlacement: 4 of 8 workers are killed and not
// restarted while the gateways' tables are 500 ms apart, so they keep
// choosing them after MarkFailed: Apply refuses those placements (ErrWorkerUnavailable), the
// gateway cancels the call and places the request again elsewhere with
// its tokens; requests that were running there resume through the
// recovery plan. Nothing fails, every output equals the reference
// (onToken), conservation holds (Check), and the run is deterministic.
func TestGatewaysRefusedPlacement(t *testing.T) {
	run := func() *Result {
		cfg := gatewayConfig(t, 4, 12*time.Second)
		cfg.Timing.WatchInterval = 500 * time.Millisecond
		for i := range 4 {
			cfg.Failures = append(cfg.Failures, Failure{Worker: i, At: 4 * time.Second})
		}
		res, err := Run(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	res := run()
	g := res.Gateways
	t.Logf("%d requests: %d placed by gateways, %d by Apply, %d refused, %d interrupted", res.Requests, g.Placed, g.Fallback, g.Refused, res.Interrupted)
	if res.Failed != 0 || res.Ended != res.Requests {
		t.Fatalf("%d of %d ended, %d failed", res.Ended, res.Requests, res.Failed)
	}
	if g.Refused == 0 || res.Interrupted == 0 {
		t.Fatalf("the failure refused no placement (%d) or interrupted no request (%d): the test tests nothing", g.Refused, res.Interrupted)
	}
	a, _ := json.Marshal(res.Records)
	b, _ := json.Marshal(run().Records)
	if string(a) != string(b) {
		t.Fatal("two runs of the same config differ")
	}
}
