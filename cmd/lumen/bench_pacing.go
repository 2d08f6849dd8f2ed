package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/lumen-project/lumen/worker/engine"
)

func init() {
	register("bench pacing", "64 paced synthetic engines decoding at once: does each step take the profile's time?", runBenchPacing)
}

func runBenchPacing(args []string) error {
	fs := flag.NewFlagSet("bench pacing", flag.ContinueOnError)
	workers := fs.Int("workers", 64, "engines decoding concurrently")
	batch := fs.Int("batch", 32, "sequences per decode step")
	profileName := fs.String("profile", "qwen3-14b-h100", "timing profile")
	scale := fs.Float64("time-scale", 1, "time scale")
	d := fs.Duration("duration", 20*time.Second, "how long each engine decodes")
	jsonPath := fs.String("json", "", "write the figures as JSON")
	if err := fs.Parse(args); err != nil {
		return err
	}
	profile, ok, err := engine.LookupProfile(*profileName)
	if err != nil || !ok {
		return fmt.Errorf("-profile: need a profile: %v", err)
	}
	want := time.Duration(float64(profile.StepTime(*batch, 0)) * *scale)
	fmt.Printf("%d synthetic engines, %s at time-scale %g, batch %d: the profile's decode step is %s\n",
		*workers, profile.Name, *scale, *batch, want)
	var mu sync.Mutex
	var ratios []float64
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < *workers; w++ {
		wg.Go(func() {
			syn, _ := engine.NewSynthetic(engine.SyntheticConfig{Pages: profile.KVPages(), MaxContext: profile.MaxContext})
			e := engine.NewPaced(syn, profile, *scale)
			ctx := context.Background()
			chunks := make([]engine.Chunk, *batch)
			for i := range chunks {
				chunks[i] = engine.Chunk{Seq: engine.SeqID(i), Tokens: []int32{int32(w), int32(i)}, Sample: 1}
			}
			// Prefill, then measure decode steps only.
			out, err := e.Forward(ctx, chunks)
			if err != nil {
				panic(err)
			}
			var local []float64
			for time.Since(start) < *d {
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
	fmt.Printf("%d decode steps: actual/profile time mean %.4f, p50 %.4f, p90 %.4f, p99 %.4f, max %.4f; %.1f%% of steps within 5%%\n",
		len(ratios), res["ratio_mean"], res["ratio_p50"], res["ratio_p90"], res["ratio_p99"], res["ratio_max"], 100*res["within_5pct"])
	if *jsonPath != "" {
		b, _ := json.MarshalIndent(res, "", "  ")
		return os.WriteFile(*jsonPath, append(b, '\n'), 0o644)
	}
	return nil
}
