package sim

import (
	"fmt"
	"io"
	"math/rand/v2"
	"time"

	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// The spec-k figure: one target worker saturated with long decoding
// requests and one drafter paired with it (the fsm pairs them: the only
// worker in ASSIST with the only one in full service), committed tokens
// per second of the target for each fixed K and for adaptive K, at several
// acceptance rates and batch sizes. Issue 14's goals: adaptive within 3% of
// the best fixed K at every α, and at least 10% above fixed K = 4 at
// α = 0.5.

// SpecKOptions are the figure's parameters.
type SpecKOptions struct {
	Profile string
	Alphas  []float64
	Batches []int
	// KMax is the largest fixed K (and adaptive K's bound).
	KMax int
	// Prompt and Output are every request's lengths; Output must outlast
	// the run (the batch stays full).
	Prompt, Output int
	// Window: each run lasts 2×Window, the rate is measured over the
	// second (the first fills the batch and the drafter's cache, and lets
	// the acceptance estimate settle).
	Window time.Duration
	Seed   uint64
	Timing Timing
	Log    io.Writer
}

// DefaultSpecKOptions: Qwen3-14B on an H100, α = 0.5, 0.7, 0.9, batches of
// 32 and 128, K = 0 … 8, prompts of 256 tokens, 4 s measured after 4 s.
func DefaultSpecKOptions() SpecKOptions {
	return SpecKOptions{Profile: "qwen3-14b-h100", Alphas: []float64{0.5, 0.7, 0.9}, Batches: []int{32, 128}, KMax: core.DefaultKMax,
		Prompt: 256, Output: 8192, Window: 4 * time.Second, Seed: 1, Timing: DefaultTiming()}
}

// SpecKPoint is one (α, batch): the target's committed tokens per second
// with each fixed K (Fixed[K]) and with adaptive K.
type SpecKPoint struct {
	Alpha    float64   `json:"alpha"`
	Batch    int       `json:"batch"`
	Fixed    []float64 `json:"fixed_tok_s"`
	Adaptive float64   `json:"adaptive_tok_s"`
	// AdaptiveK is the K adaptive chose, mean over verification rows;
	// AcceptRate the accepted share of the verified drafts (adaptive).
	AdaptiveK  float64 `json:"adaptive_k_mean"`
	AcceptRate float64 `json:"adaptive_accept_rate"`
	// BestK is the best fixed K. PlainK is the K core.ChooseK picks at
	// the true α over the profile's StepTimeK (drafts always on time);
	// PipelinedK the one it picks with core.PipelinedTokens, what adaptive K
	// aims at.
	BestK      int `json:"best_fixed_k"`
	PlainK     int `json:"plain_model_k"`
	PipelinedK int `json:"pipelined_model_k"`
}

// VsBest is adaptive's rate over the best fixed K's, minus 1.
func (p SpecKPoint) VsBest() float64 { return p.Adaptive/p.Fixed[p.BestK] - 1 }

// VsK is adaptive's rate over fixed K = k's, minus 1.
func (p SpecKPoint) VsK(k int) float64 { return p.Adaptive/p.Fixed[k] - 1 }

// SpecKFigure is the figure.
type SpecKFigure struct {
	Name   string       `json:"name"`
	Points []SpecKPoint `json:"points"`
}

// RunSpecK runs the figure.
func RunSpecK(o SpecKOptions) (*SpecKFigure, error) {
	p, ok, err := engine.LookupProfile(o.Profile)
	if err != nil || !ok {
		return nil, fmt.Errorf("%w: spec-k: profile %q: %v", ErrInvalid, o.Profile, err)
	}
	if o.KMax < 1 || o.Window <= 0 || o.Prompt < 1 || o.Output < 1 {
		return nil, fmt.Errorf("%w: spec-k: KMax (%d), Window (%s), Prompt (%d) and Output (%d) must be positive", ErrInvalid, o.KMax, o.Window, o.Prompt, o.Output)
	}
	if err := core.CheckSpecK(o.KMax); err != nil {
		return nil, fmt.Errorf("%w: spec-k: KMax: %v", ErrInvalid, err)
	}
	f := &SpecKFigure{Name: "spec-k"}
	for _, alpha := range o.Alphas {
		for _, b := range o.Batches {
			pt := SpecKPoint{Alpha: alpha, Batch: b}
			for k := 0; k <= o.KMax; k++ {
				fk := k
				if k == 0 {
					fk = -1 // fixed K = 0
				}
				res, err := runSpecK(o, p, alpha, b, fk)
				if err != nil {
					return nil, err
				}
				pt.Fixed = append(pt.Fixed, float64(res.CalibrationTokens)/o.Window.Seconds())
				if pt.Fixed[k] > pt.Fixed[pt.BestK] {
					pt.BestK = k
				}
			}
			res, err := runSpecK(o, p, alpha, b, 0)
			if err != nil {
				return nil, err
			}
			pt.Adaptive = float64(res.CalibrationTokens) / o.Window.Seconds()
			if res.Spec.KRows > 0 {
				pt.AdaptiveK = float64(res.Spec.KSum) / float64(res.Spec.KRows)
			}
			if res.Spec.DraftTokens > 0 {
				pt.AcceptRate = float64(res.Spec.AcceptedTokens) / float64(res.Spec.DraftTokens)
			}
			cost := func(k int) time.Duration { return p.StepTimeK(b, k, 0) }
			pt.PlainK = core.ChooseKWith(alpha, o.KMax, cost, core.ExpectedTokens)
			pt.PipelinedK = core.ChooseK(alpha, o.KMax, cost)
			f.Points = append(f.Points, pt)
		}
	}
	if o.Log != nil {
		f.Print(o.Log)
	}
	return f, nil
}

// runSpecK is one run: b requests at time 0 on worker-1, worker-2 drafting
// for it; k as SpecOptions.K.
func runSpecK(o SpecKOptions, p engine.Profile, alpha float64, b, k int) (*Result, error) {
	rng := rand.New(rand.NewPCG(o.Seed, 0x5bec))
	reqs := make([]workload.Request, b)
	for i := range reqs {
		prompt := make([]int32, o.Prompt)
		for j := range prompt {
			prompt[j] = 32 + int32(rng.IntN(95))
		}
		reqs[i] = workload.Request{Prompt: prompt, Output: o.Output}
	}
	timing := o.Timing
	cfg := Config{Workers: 2, Profile: p, Strategy: policy.Lumen, TokenBudget: 2048, MaxRunning: b, MaxWaiting: b,
		// Room for every request's whole context: the figure is about
		// the step's economics, not memory.
		KVPages:     b * core.PagesFor(o.Prompt+o.Output+2*o.KMax+2),
		Arrivals:    reqs,
		StopAt:      2 * o.Window,
		Timing:      timing,
		Speculation: true,
		Spec:        SpecOptions{Alpha: alpha, K: k, Seed: o.Seed, AssistOnly: 1}}
	res, err := Run(cfg)
	if err != nil {
		return nil, fmt.Errorf("spec-k α=%g batch %d K=%d: %w", alpha, b, k, err)
	}
	return res, nil
}

// Print writes the figure as a table: tokens/s for each fixed K, adaptive,
// and adaptive's gain over the best fixed K and over K = 4.
func (f *SpecKFigure) Print(out io.Writer) {
	if len(f.Points) == 0 {
		return
	}
	kmax := len(f.Points[0].Fixed) - 1
	fmt.Fprintf(out, "\nfigure spec-k: the target's committed tokens/s, one drafter paired, by fixed K and adaptive\n")
	fmt.Fprintf(out, "(best: the best fixed K; plain and piped: core.ChooseK's K at the true alpha with drafts always on time (ExpectedTokens) and one step behind (PipelinedTokens))\n")
	fmt.Fprintf(out, "%5s %5s", "alpha", "batch")
	for k := 0; k <= kmax; k++ {
		fmt.Fprintf(out, " %7s", fmt.Sprintf("K=%d", k))
	}
	fmt.Fprintf(out, " %8s %6s %6s %6s %6s %8s %8s %7s\n", "adaptive", "K mean", "best", "plain", "piped", "vs best", "vs K=4", "accept")
	for _, p := range f.Points {
		fmt.Fprintf(out, "%5.2f %5d", p.Alpha, p.Batch)
		for _, v := range p.Fixed {
			fmt.Fprintf(out, " %7.0f", v)
		}
		vs4 := "n/a"
		if kmax >= 4 {
			vs4 = fmt.Sprintf("%+.1f%%", 100*p.VsK(4))
		}
		fmt.Fprintf(out, " %8.0f %6.2f %6d %6d %6d %+7.1f%% %8s %6.1f%%\n", p.Adaptive, p.AdaptiveK, p.BestK, p.PlainK, p.PipelinedK,
			100*p.VsBest(), vs4, 100*p.AcceptRate)
	}
	fmt.Fprintln(out)
}
