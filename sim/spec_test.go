package sim

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// TestReloadTimeline: with speculation a restarted worker serves again at
// the moment the plain reload would (Profile.LoadTime): the draft loads
// alongside the target's disk read, ASSIST lasts until the target's engine
// is initialised, HOTSWAP is the host-to-GPU copy alone. In a run, the
// phases commit at those moments from the kill, the registration once the
// failure is detected.
func TestReloadTimeline(t *testing.T) {
	draft := engine.Profiles[DefaultDraftProfile]
	for _, name := range []string{"qwen3-14b-h100", "qwen3-32b-h100", "qwen3-14b-h200"} {
		p := engine.Profiles[name]
		for _, scale := range []float64{1, 0.25, 0.1} {
			tl := ReloadTimeline(p, draft, scale)
			plain := time.Duration(float64(p.LoadTime()) * scale)
			if tl.Full != plain {
				t.Errorf("%s ×%g: full service at %s, the plain reload at %s", name, scale, tl.Full, plain)
			}
			if d := tl.Hotswap - (tl.Disk + tl.Init); d < -time.Microsecond || d > time.Microsecond {
				t.Errorf("%s ×%g: HOTSWAP at %s, the disk read and init end at %s", name, scale, tl.Hotswap, tl.Disk+tl.Init)
			}
			if tl.Full-tl.Hotswap != tl.H2D || tl.Draft >= tl.Hotswap {
				t.Errorf("%s ×%g: %+v", name, scale, tl)
			}
		}
	}
	// 14B: the draft at 1.35 s, HOTSWAP at 22.76 s, full service at 23.61 s.
	tl := ReloadTimeline(engine.Profiles["qwen3-14b-h100"], draft, 1)
	if tl.Draft.Round(10*time.Millisecond) != 1350*time.Millisecond || tl.Hotswap.Round(10*time.Millisecond) != 22760*time.Millisecond ||
		tl.Full.Round(10*time.Millisecond) != 23610*time.Millisecond {
		t.Errorf("qwen3-14b-h100: %+v", tl)
	}

	cfg := smallConfig(t, 4, policy.Lumen, 4, 12, 10*time.Second)
	cfg.Speculation = true
	cfg.Failures = []Failure{{Worker: 0, At: 3 * time.Second, Restart: true}}
	res, err := Run(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Phases) != 1 {
		t.Fatalf("phases: %+v", res.Phases)
	}
	ph, at := res.Phases[0], ReloadTimeline(cfg.Profile, draft, cfg.Timing.ReloadScale)
	kill := 3 * time.Second
	if ph.Kill != kill || ph.Registered != kill+cfg.Timing.DetectDelay || ph.Assist != kill+at.Draft ||
		ph.Hotswap != kill+at.Hotswap || ph.Full != kill+at.Full {
		t.Fatalf("phases %+v, timeline %+v", ph, at)
	}
	if len(res.Pairings) != 1 || res.Pairings[0].From != ph.Assist || res.Pairings[0].To != ph.Hotswap {
		t.Fatalf("pairings %+v, phases %+v", res.Pairings, ph)
	}
}

// TestDraftAgreement: the draft agrees with the target at a share α of
// positions, the same share at every α, and the same draw every time.
func TestDraftAgreement(t *testing.T) {
	for _, alpha := range []float64{0.5, 0.7, 0.9} {
		n, ok := 200000, 0
		for i := range n {
			if agrees(1, i%997, 1000+i/997, alpha) {
				ok++
			}
			if agrees(1, i%997, 1000+i/997, alpha) != agrees(1, i%997, 1000+i/997, alpha) {
				t.Fatal("not deterministic")
			}
		}
		if got := float64(ok) / float64(n); math.Abs(got-alpha) > 0.005 {
			t.Errorf("α %g: %.4f of the positions agree", alpha, got)
		}
	}
}

// specRun runs cfg with speculation and, at each (time, action), acts on
// the simulation: white-box failures that depend on who the fsm paired.
// Run's checks hold: every token a client got equals the reference's
// (onToken), every request ended once, nothing is left.
func specRun(t *testing.T, cfg Config, acts map[time.Duration]func(s *Sim)) *Result {
	t.Helper()
	cfg.Speculation = true
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for at, fn := range acts {
		s.at(at, func() { fn(s) })
	}
	s.Run()
	if s.err != nil {
		t.Fatal(s.err)
	}
	if err := s.Check(); err != nil {
		t.Fatal(err)
	}
	if s.res.Ended != len(cfg.Arrivals) || s.res.Failed != 0 {
		t.Fatalf("%d of %d ended, %d failed", s.res.Ended, len(cfg.Arrivals), s.res.Failed)
	}
	return &s.res
}

// TestSpecFailures: the failure cases of issue 14 in the simulator — the
// drafter dies in ASSIST, its partner dies in ASSIST (the drafter is paired
// again), a second failure during HOTSWAP, the hot-swapping worker dies —
// and every output still equals the failure-free, speculation-free
// reference, token by token.
func TestSpecFailures(t *testing.T) {
	seed := uint64(6)
	t.Logf("seed %d", seed)
	base := smallConfig(t, seed, policy.Lumen, 4, 30, 12*time.Second)
	base.Timing.ReloadScale = 0.2 // ASSIST from 1.07 s to 4.55 s after the kill, HOTSWAP 0.17 s
	tl := ReloadTimeline(base.Profile, engine.Profiles[DefaultDraftProfile], base.Timing.ReloadScale)
	kill := 3 * time.Second
	mid := kill + (tl.Draft+tl.Hotswap)/2
	killTarget := func(restart bool) func(s *Sim) {
		return func(s *Sim) {
			a := s.workers[0].as
			if a == nil {
				t.Fatalf("at %s worker-1 is not paired", s.now)
			}
			s.kill(a.target, restart)
		}
	}
	cases := []struct {
		name  string
		fails []Failure
		acts  map[time.Duration]func(s *Sim)
		check func(t *testing.T, res *Result)
	}{
		{name: "one restart", fails: []Failure{{Worker: 0, At: kill, Restart: true}},
			check: func(t *testing.T, res *Result) {
				if len(res.Pairings) != 1 || res.Spec.AcceptedTokens == 0 {
					t.Errorf("pairings %+v, %+v", res.Pairings, res.Spec)
				}
			}},
		{name: "drafter dies in ASSIST", fails: []Failure{{Worker: 0, At: kill, Restart: true}, {Worker: 0, At: mid, Restart: true}},
			check: func(t *testing.T, res *Result) {
				// Two restarts, each paired in its ASSIST.
				if len(res.Pairings) != 2 || res.Pairings[0].To != mid || len(res.Phases) != 2 || res.Phases[1].Full == 0 {
					t.Errorf("pairings %+v, phases %+v", res.Pairings, res.Phases)
				}
			}},
		{name: "partner dies in ASSIST", fails: []Failure{{Worker: 0, At: kill, Restart: true}},
			acts: map[time.Duration]func(s *Sim){mid: killTarget(false)},
			check: func(t *testing.T, res *Result) {
				// Paired again once the fsm saw the failure.
				if len(res.Pairings) != 2 || res.Pairings[0].Target == res.Pairings[1].Target ||
					res.Pairings[1].From != mid+base.Timing.DetectDelay {
					t.Errorf("pairings %+v", res.Pairings)
				}
			}},
		{name: "a second failure in HOTSWAP", fails: []Failure{{Worker: 0, At: kill, Restart: true}, {Worker: 2, At: kill + tl.Hotswap + tl.H2D/2, Restart: true}},
			check: func(t *testing.T, res *Result) {
				if len(res.Phases) != 2 || res.Phases[0].Full == 0 || res.Phases[1].Full == 0 {
					t.Errorf("phases %+v", res.Phases)
				}
			}},
		{name: "the hot-swapping worker dies", fails: []Failure{{Worker: 0, At: kill, Restart: true}, {Worker: 0, At: kill + tl.Hotswap + tl.H2D/2, Restart: true}},
			check: func(t *testing.T, res *Result) {
				if len(res.Phases) != 2 || res.Phases[0].Full != 0 || res.Phases[0].Hotswap == 0 || res.Phases[1].Full == 0 {
					t.Errorf("phases %+v", res.Phases)
				}
			}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := base
			cfg.Failures = c.fails
			res := specRun(t, cfg, c.acts)
			t.Logf("%d drafted, %d verified, %d accepted; pairings %+v", res.Spec.Drafted, res.Spec.DraftTokens, res.Spec.AcceptedTokens, res.Pairings)
			if res.Spec.AcceptedTokens == 0 {
				t.Error("nothing accepted")
			}
			c.check(t, res)
		})
	}
}

// TestSpecKGoals is issue 14's adaptive-K goal in the simulator, on the
// spec-k figure as `lumen sim -figure spec-k` runs it (deterministic):
// adaptive K within 3% of the best fixed K at α = 0.5, 0.7 and 0.9, and at
// least 10% above fixed K = 4 at α = 0.5, at both batch sizes.
func TestSpecKGoals(t *testing.T) {
	o := DefaultSpecKOptions()
	t.Logf("seed %d", o.Seed)
	f, err := RunSpecK(o)
	if err != nil {
		t.Fatal(err)
	}
	if len(f.Points) != len(o.Alphas)*len(o.Batches) {
		t.Fatalf("%d points", len(f.Points))
	}
	for _, p := range f.Points {
		t.Logf("α %g batch %d: fixed %.0f, adaptive %.0f (K %.2f), best K %d: %+.1f%%, vs K=4 %+.1f%%",
			p.Alpha, p.Batch, p.Fixed, p.Adaptive, p.AdaptiveK, p.BestK, 100*p.VsBest(), 100*p.VsK(4))
		if p.VsBest() < -0.03 {
			t.Errorf("α %g batch %d: adaptive %.0f tokens/s is %.1f%% below the best fixed K (%d: %.0f)",
				p.Alpha, p.Batch, p.Adaptive, -100*p.VsBest(), p.BestK, p.Fixed[p.BestK])
		}
		if p.Alpha == 0.5 && p.VsK(4) < 0.10 {
			t.Errorf("α 0.5 batch %d: adaptive %.0f tokens/s is only %+.1f%% against fixed K = 4 (%.0f)",
				p.Batch, p.Adaptive, 100*p.VsK(4), p.Fixed[4])
		}
		// Drafting never stalls the target: K = 0 with a drafter paired is
		// the plain decode rate, and speculation at the best K beats it
		// wherever the model says drafting pays.
		if p.PipelinedK > 0 && p.Fixed[p.BestK] <= p.Fixed[0] {
			t.Errorf("α %g batch %d: no fixed K beats K = 0", p.Alpha, p.Batch)
		}
	}
}

// TestPipelinedTokens: the pipelined model against its closed form's
// limits — K = 0 commits one token; α = 1 commits K+1 every step; at α = 0
// nothing is accepted.
func TestPipelinedTokens(t *testing.T) {
	if core.PipelinedTokens(0.7, 0) != 1 || core.PipelinedTokens(0, 4) != 1 {
		t.Fatal("K = 0 or α = 0")
	}
	if got := core.PipelinedTokens(1, 4); math.Abs(got-5) > 1e-9 {
		t.Fatalf("α = 1, K = 4: %g", got)
	}
	// Always below drafts-on-time.
	for _, a := range []float64{0.3, 0.5, 0.7, 0.9} {
		for k := 1; k <= 8; k++ {
			if core.PipelinedTokens(a, k) >= core.ExpectedTokens(a, k) {
				t.Errorf("α %g K %d: %g ≥ %g", a, k, core.PipelinedTokens(a, k), core.ExpectedTokens(a, k))
			}
		}
	}
}

// TestSpecKBound: the simulator takes the workers' bound on K
// (core.MaxSpecK), not one of its own (issue 21, defect 9: it accepted up
// to 64, where a worker's drafter stream broke from 32 on).
func TestSpecKBound(t *testing.T) {
	for _, k := range []int{-1, 0, core.MaxSpecK} {
		c := Config{Workers: 2, Spec: SpecOptions{K: k}}
		if errs := c.validateSpec(); len(errs) != 0 {
			t.Errorf("Spec.K %d: %v", k, errs)
		}
	}
	c := Config{Workers: 2, Spec: SpecOptions{K: core.MaxSpecK + 1}}
	errs := c.validateSpec()
	if len(errs) != 1 || !errors.Is(errs[0], core.ErrSpecK) || !strings.Contains(errs[0].Error(), "33 is outside [0, 32]") {
		t.Fatalf("Spec.K %d: %v, want one error naming it and the bound", core.MaxSpecK+1, errs)
	}
}
