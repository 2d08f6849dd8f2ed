package sim

import (
	"flag"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/engine"
)

var (
	benchWorkers  = flag.Int("sim.workers", 64, "BenchmarkScale: workers")
	benchDuration = flag.Duration("sim.duration", 600*time.Second, "BenchmarkScale: arrivals span")
	benchProfile  = flag.String("sim.profile", "qwen3-14b-h100", "BenchmarkScale: profile")
	benchFail     = flag.Int("sim.fail", 1, "BenchmarkScale: workers killed at a quarter of the run")
)

// BenchmarkScale is the speed goal: one lumen column of -sim.workers
// workers for -sim.duration of arrivals at 70% of the modelled capacity
// (not calibrated: a benchmark of the simulator, not of the cluster), with
// -sim.fail failures. It reports simulated events per second and the
// fsm's Apply p99s.
func BenchmarkScale(b *testing.B) {
	p := engine.Profiles[*benchProfile]
	tr := workload.AzureConversation
	per, _ := p.SaturatedRate(32, tr.Prompt.Mean(), tr.Output.Mean())
	reqs, err := workload.GenerateLazy(workload.Config{Seed: 1, Rate: 0.7 * per * float64(*benchWorkers), Duration: *benchDuration, Trace: tr})
	if err != nil {
		b.Fatal(err)
	}
	cfg := Config{Workers: *benchWorkers, Profile: p, Strategy: policy.Lumen, TokenBudget: 2048, MaxRunning: 32, MaxWaiting: 4096,
		CheckpointBudget: 80e9, Arrivals: reqs, Timing: DefaultTiming(), MeasureApply: true}
	for i := range *benchFail {
		cfg.Failures = append(cfg.Failures, Failure{Worker: i, At: *benchDuration / 4, Restart: true})
	}
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		res, err := Run(cfg)
		if err != nil {
			b.Fatal(err)
		}
		wall := time.Since(start)
		b.ReportMetric(float64(res.Events)/wall.Seconds(), "events/s")
		b.ReportMetric(float64(res.Events), "events")
		b.ReportMetric(float64(len(reqs)), "requests")
		b.ReportMetric(float64(res.InFlightAtFail), "in-flight")
		b.ReportMetric(res.End.Seconds(), "simulated-s")
		b.ReportMetric(wall.Seconds(), "wall-s")
		b.ReportMetric(percentileMs(res.ApplyDispatch, 0.99), "dispatch-p99-ms")
		b.ReportMetric(percentileMs(res.ApplyMarkFailed, 0.99), "markfailed-p99-ms")
	}
}
