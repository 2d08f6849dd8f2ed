package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/lumen-project/lumen/internal/progress"
	"github.com/lumen-project/lumen/worker/engine"
)

// PacingConfig is `lumen bench pacing`.
type PacingConfig struct {
	// Workers is the number of engines decoding concurrently.
	Workers int
	// Batch is the number of sequences per decode step.
	Batch int
	// Profile is the timing profile and TimeScale its time scale.
	Profile   string
	TimeScale float64
	// Duration is how long each engine decodes.
	Duration time.Duration
	// JSONPath, when set, receives the figures as JSON.
	JSONPath string
}

// DefaultPacingConfig is `lumen bench pacing` without flags.
func DefaultPacingConfig() PacingConfig {
	return PacingConfig{Workers: 64, Batch: 32, Profile: "qwen3-14b-h100", TimeScale: 1, Duration: 20 * time.Second}
}

// Pacing runs paced synthetic engines decoding at once and measures how
// close each decode step comes to the profile's time.
func Pacing(cfg PacingConfig) error {
	profile, ok, err := engine.LookupProfile(cfg.Profile)
	if err != nil || !ok {
		return fmt.Errorf("-profile: need a profile: %v", err)
	}
	want := time.Duration(float64(profile.StepTime(cfg.Batch, 0)) * cfg.TimeScale)
	fmt.Printf("%d synthetic engines, %s at time-scale %g, batch %d: the profile's decode step is %s\n",
		cfg.Workers, profile.Name, cfg.TimeScale, cfg.Batch, want)
	var mu sync.Mutex
	var ratios []float64
	var wg sync.WaitGroup
	start := time.Now()
	meter := progress.New("bench pacing", "s", cfg.Duration.Seconds())
	stopMeter := make(chan struct{})
	go func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-stopMeter:
				return
			case <-t.C:
				meter.Set(time.Since(start).Round(time.Second).Seconds(), "decoding")
			}
		}
	}()
	for w := 0; w < cfg.Workers; w++ {
		wg.Go(func() {
			syn, _ := engine.NewSynthetic(engine.SyntheticConfig{Pages: profile.KVPages(), MaxContext: profile.MaxContext})
			e := engine.NewPaced(syn, profile, cfg.TimeScale)
			ctx := context.Background()
			chunks := make([]engine.Chunk, cfg.Batch)
			for i := range chunks {
				chunks[i] = engine.Chunk{Seq: engine.SeqID(i), Tokens: []int32{int32(w), int32(i)}, Sample: 1}
			}
			// Prefill, then measure decode steps only.
			out, err := e.Forward(ctx, chunks)
			if err != nil {
				panic(err)
			}
			var local []float64
			for time.Since(start) < cfg.Duration {
				for i := range chunks {
					chunks[i].Tokens = out[i]
				}
				t0 := time.Now()
				if out, err = e.Forward(ctx, chunks); err != nil {
					panic(err)
				}
				local = append(local, float64(time.Since(t0))/float64(want))
			}
			mu.Lock()
			ratios = append(ratios, local...)
			mu.Unlock()
		})
	}
	wg.Wait()
	close(stopMeter)
	meter.Set(cfg.Duration.Seconds(), "")
	meter.Finish("")
	res, err := pacingSummary(ratios, want)
	if err != nil {
		return err
	}
	printPacingSummary(os.Stdout, res)
	if cfg.JSONPath != "" {
		return writeJSON(cfg.JSONPath, res)
	}
	return nil
}

// pacingSummary sorts ratios (each step's actual over the profile's time)
// and returns the figures under their JSON keys.
func pacingSummary(ratios []float64, want time.Duration) (map[string]float64, error) {
	if len(ratios) == 0 {
		return nil, errors.New("bench: no decode step finished: lengthen -duration")
	}
	sort.Float64s(ratios)
	var sum float64
	for _, r := range ratios {
		sum += r
	}
	pct := func(p float64) float64 { return ratios[int(float64(len(ratios)-1)*p)] }
	res := map[string]float64{
		"steps": float64(len(ratios)), "step_target_ms": float64(want.Microseconds()) / 1000,
		"ratio_mean": sum / float64(len(ratios)), "ratio_p50": pct(0.5), "ratio_p90": pct(0.9), "ratio_p99": pct(0.99), "ratio_max": ratios[len(ratios)-1],
	}
	within := 0
	for _, r := range ratios {
		if r >= 0.95 && r <= 1.05 {
			within++
		}
	}
	res["within_5pct"] = float64(within) / float64(len(ratios))
	return res, nil
}

// printPacingSummary prints the line `lumen bench pacing` ends with.
func printPacingSummary(w io.Writer, res map[string]float64) {
	fmt.Fprintf(w, "%d decode steps: actual/profile time mean %.4f, p50 %.4f, p90 %.4f, p99 %.4f, max %.4f; %.1f%% of steps within 5%%\n",
		int(res["steps"]), res["ratio_mean"], res["ratio_p50"], res["ratio_p90"], res["ratio_p99"], res["ratio_max"], 100*res["within_5pct"])
}
