package core

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/lumen-project/lumen/tokenizer"
	"github.com/lumen-project/lumen/worker/engine"
)

// BenchmarkAssist runs the transformer target with its real early-exit
// draft (engine.InitModel: the target's first 2 of 4 layers) at batch 1, 8
// and 32: each op is one workload of that many greedy requests (English
// prompts of about 90 tokens, 64 output tokens each, all at once), decoded
// without drafts (off), with K = 4, and with adaptive K choosing from the
// measured acceptance and the Qwen3-14B/H100 step cost. The drafter runs
// in the same process between the target's steps until it has nothing left
// to draft (a drafter that keeps up); its time is not the target's.
//
// Metrics, over the target's decode steps with the whole batch running (the
// prefill step and the tail after the first request ends excluded):
//   - tokens/step: tokens committed per step per sequence (1 without drafts);
//   - accept_rate: drafts accepted / drafts verified (every verification);
//   - alpha: the probability a draft is accepted given the one before it
//     was, accepted / (accepted + rejections) over every verification: what
//     ExpectedTokens takes;
//   - K: the mean K of the steps;
//   - cpu_tokens/s: tokens committed per second of CPU time of the
//     target's thread (Next, the engine's Forward, Done, the truncations;
//     the benchmark's goroutine is locked to its thread), which other work
//     on the machine's cores does not inflate as it does wall time;
//   - wall_tokens/s: the same per second of wall time;
//   - gpu_tokens/s: tokens committed per second of the same steps costed
//     by engine.Profile.StepTimeK for qwen3-14b-h100.
//
// The CPU and GPU rates answer different questions. On a CPU the tiny
// model's step is compute-bound: a verification computes K+1 positions per
// sequence, about K+1 times a decode row, and commits fewer than K+1
// tokens, so on the CPU speculation costs more than it gives: cpu_tokens/s
// with drafts is the rate without times tokens/step / (K+1). A GPU step at these batches is memory-bound:
// the weights are read once whatever K, and each draft adds 0.05 ms per
// sequence to a 12–15 ms step; gpu_tokens/s is what the measured tokens per
// step buy there. ns/op covers the whole loop, drafter included.
func BenchmarkAssist(b *testing.B) {
	profile := engine.Profiles["qwen3-14b-h100"]
	modes := []struct {
		name string
		cfg  SpecConfig
	}{
		{"off", SpecConfig{}},
		{"K=4", SpecConfig{K: 4}},
		{"adaptive", SpecConfig{Adaptive: true, KMax: DefaultKMax, Cost: gpuCost(profile.Name)}},
	}
	for _, batch := range []int{1, 8, 32} {
		for _, mode := range modes {
			b.Run(fmt.Sprintf("batch=%d/%s", batch, mode.name), func(b *testing.B) {
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				_, cpuClock := threadCPU()
				var sum specRig
				for n := 0; n < b.N; n++ {
					g := assistWorkload(b, batch, mode.cfg, profile, n, cpuClock)
					sum.decodeSteps += g.decodeSteps
					sum.decodeRows += g.decodeRows
					sum.rejections += g.rejections
					sum.decodeTokens += g.decodeTokens
					sum.decodeTime += g.decodeTime
					sum.decodeCPU += g.decodeCPU
					sum.decodeModelled += g.decodeModelled
					sum.total.DraftTokens += g.total.DraftTokens
					sum.total.AcceptedTokens += g.total.AcceptedTokens
					sum.ksum += g.ksum
					sum.draftSteps += g.draftSteps
				}
				b.ReportMetric(float64(sum.decodeTokens)/float64(sum.decodeRows), "tokens/step")
				b.ReportMetric(float64(sum.ksum)/float64(sum.decodeSteps), "K")
				accept, alpha := 0.0, 0.0
				if a := sum.total.AcceptedTokens; sum.total.DraftTokens > 0 {
					accept = float64(a) / float64(sum.total.DraftTokens)
					alpha = float64(a) / float64(a+sum.rejections)
				}
				b.ReportMetric(accept, "accept_rate")
				b.ReportMetric(alpha, "alpha")
				if cpuClock {
					b.ReportMetric(float64(sum.decodeTokens)/sum.decodeCPU.Seconds(), "cpu_tokens/s")
				}
				b.ReportMetric(float64(sum.decodeTokens)/sum.decodeTime.Seconds(), "wall_tokens/s")
				b.ReportMetric(float64(sum.decodeTokens)/sum.decodeModelled.Seconds(), "gpu_tokens/s")
			})
		}
	}
}

// assistWorkload decodes one workload and returns the rig's counters.
func assistWorkload(b *testing.B, batch int, cfg SpecConfig, profile engine.Profile, round int, cpuClock bool) *specRig {
	const out = 64
	var tk tokenizer.Tokenizer
	var reqs []*specReq
	for i := range batch {
		p := tk.Encode(fmt.Sprintf("request %d of round %d: the cluster keeps serving while worker %d reloads its model from disk", i, round, i%7))
		reqs = append(reqs, &specReq{id: fmt.Sprintf("r%02d", i), prompt: p, max: out})
	}
	need := 0
	for _, q := range reqs {
		need += PagesFor(len(q.prompt) + out)
	}
	b.StopTimer()
	referenceRun(b, newTransformer(b, false, need), reqs)
	tgt, dft := newTransformer(b, false, need+batch), newTransformer(b, true, need+batch)
	b.StartTimer()
	c := New(Config{Self: "self", TokenBudget: 4096, MaxRunning: batch, MaxWaiting: batch, TotalPages: need + batch}, nil)
	c.SetSpec(cfg)
	g := newSpecRig(b, nil, c, tgt)
	g.profile = &profile
	g.fullRows, g.cpuClock = batch, cpuClock
	if cfg.K > 0 || cfg.Adaptive {
		g.withDrafter(NewDrafter(cfg.K), dft)
	}
	g.run(reqs)
	return g
}
