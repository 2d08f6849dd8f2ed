package sim

import (
	"bytes"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/recoverystudy"
	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// TestHangDetection: a hung worker (Timing.Hang) breaks none of its
// streams before Serf's detection: no interrupted request resumes before
// DetectDelay, while on the fast path most resume well before it; the
// calls placed on it meanwhile hang with it, and it reloads from the
// detection.
func TestHangDetection(t *testing.T) {
	seed := uint64(7)
	t.Logf("seed %d", seed)
	run := func(hang bool) (*Result, *Sim) {
		cfg := smallConfig(t, seed, policy.Lumen, 4, 12, 12*time.Second)
		cfg.Timing.Hang = hang
		cfg.Timing.DetectDelay = DefaultHangDetect
		if !hang {
			cfg.Timing.DetectDelay = DefaultTiming().DetectDelay
		}
		cfg.Failures = []Failure{{Worker: 0, At: 4 * time.Second, Restart: true}}
		s, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		w := s.workers[0]
		hung, rejoined := 0, time.Duration(0)
		s.advance(func() bool {
			if s.now < cfg.Failures[0].At+cfg.Timing.DetectDelay {
				hung = max(hung, len(w.hungCalls))
			}
			if rejoined == 0 && s.now > cfg.Failures[0].At && w.alive {
				rejoined = s.now
			}
			return false
		})
		if s.err != nil {
			t.Fatal(s.err)
		}
		s.res.End = s.now
		s.finish()
		if err := s.Check(); err != nil {
			t.Fatal(err)
		}
		reload := time.Duration(float64(cfg.Profile.LoadTime()) * cfg.Timing.ReloadScale)
		want := cfg.Failures[0].At + reload
		if hang {
			want += cfg.Timing.DetectDelay
			if hung == 0 {
				t.Errorf("no call hung with the worker")
			}
		}
		if rejoined != want {
			t.Errorf("hang %v: the worker rejoined at %v, want %v", hang, rejoined, want)
		}
		return &s.res, s
	}
	hang, _ := run(true)
	fast, _ := run(false)
	if hang.Interrupted == 0 || len(hang.Resumes) == 0 {
		t.Fatalf("the hang interrupted %d requests, %d resumed", hang.Interrupted, len(hang.Resumes))
	}
	for _, d := range hang.Resumes {
		if d < DefaultHangDetect {
			t.Errorf("an interrupted request resumed %v after the hang, before its detection (%v)", d, DefaultHangDetect)
		}
	}
	early := 0
	for _, d := range fast.Resumes {
		if d < DefaultHangDetect {
			early++
		}
	}
	if early*2 < len(fast.Resumes) {
		t.Errorf("on the fast path only %d of %d interrupted requests resumed within %v", early, len(fast.Resumes), DefaultHangDetect)
	}
}

// TestReloadInSim: a cold reload keeps the failed worker down for the
// replacement node's load, a fixed one for its duration; the draft's load
// is cold too.
func TestReloadInSim(t *testing.T) {
	for _, c := range []struct {
		in   string
		want time.Duration // before ReloadScale
	}{{"warm", engine.Profiles["qwen3-14b-h100"].LoadTime()}, {"cold", 0}, {"40s", 40 * time.Second}} {
		r, err := engine.ParseReload(c.in)
		if err != nil {
			t.Fatal(err)
		}
		cfg := smallConfig(t, 3, policy.StopAndRestart, 3, 6, 20*time.Second)
		cfg.Timing.Reload = r
		cfg.Failures = []Failure{{Worker: 0, At: 2 * time.Second, Restart: true}}
		want := c.want
		if want == 0 {
			p, _ := cfg.Profile.WithReload(r)
			want = p.LoadTime()
			if want < 90*time.Second {
				t.Fatalf("cold reload %v", want)
			}
		}
		s, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		w := s.workers[0]
		s.advance(func() bool { return s.now > 2*time.Second && w.alive })
		if got, exp := s.now-2*time.Second, time.Duration(float64(want)*cfg.Timing.ReloadScale); got < exp-time.Millisecond || got > exp+time.Millisecond {
			t.Errorf("-reload %s: back after %v, want %v", c.in, got, exp)
		}
		if c.in == "cold" && s.draftProf.LoadTime() <= engine.Profiles[DefaultDraftProfile].LoadTime() {
			t.Errorf("cold: the draft loads in %v, as warm", s.draftProf.LoadTime())
		}
	}
	cfg := smallConfig(t, 3, policy.Lumen, 2, 4, 2*time.Second)
	cfg.Timing.Reload = engine.Reload{Kind: engine.ReloadFixed, Duration: time.Millisecond}
	if _, err := New(cfg); !errors.Is(err, ErrInvalid) {
		t.Errorf("a reload shorter than the weights' copy: %v, want ErrInvalid", err)
	}
}

// TestDecodeContextInSim: with Timing.DecodeContext a decode step costs
// the context its rows read, so the same batch decodes slower at long
// prompts and faster at short ones than the fitted line, which does not
// see the lengths.
func TestDecodeContextInSim(t *testing.T) {
	tpot := func(n, prompt int, on bool) time.Duration {
		var reqs []workload.Request
		for i := range n {
			p := make([]int32, prompt)
			for j := range p {
				p[j] = int32(32 + (i+j)%95)
			}
			reqs = append(reqs, workload.Request{At: time.Duration(i) * time.Microsecond, Prompt: p, Output: 64})
		}
		cfg := smallConfig(t, 1, policy.Lumen, 1, 1, time.Second)
		cfg.Arrivals = reqs
		cfg.Timing.DecodeContext = on
		res, err := Run(cfg)
		if err != nil {
			t.Fatal(err)
		}
		var sum time.Duration
		for _, r := range res.Records {
			d, ok := r.TPOT()
			if !ok {
				t.Fatalf("no TPOT: %+v", r)
			}
			sum += d
		}
		return sum / time.Duration(len(res.Records))
	}
	shortOff, longOff := tpot(32, 100, false), tpot(32, 6000, false)
	shortOn, longOn := tpot(32, 100, true), tpot(32, 6000, true)
	t.Logf("TPOT of 32 requests: 100-token prompts %v off, %v on; 6000-token %v off, %v on", shortOff, shortOn, longOff, longOn)
	if shortOn >= shortOff || longOn <= longOff {
		t.Errorf("the context changed nothing: 100 tokens %v off, %v on; 6000 tokens %v off, %v on", shortOff, shortOn, longOff, longOn)
	}
	// One request alone decodes one row a step: 11.6 + 0.114 ms off, and
	// on its mean context (6,032 positions) reads 4,632 more than the
	// reference's, 0.23 ms more at 0.049 µs a token.
	p := engine.Profiles["qwen3-14b-h100"]
	off, on := tpot(1, 6000, false), tpot(1, 6000, true)
	wantOn := p.Step(engine.StepShape{Rows: 1}) + time.Duration(float64(6032-engine.DecodeRefContext)*float64(p.KVBytesPerToken())/p.HBMBytesPerSec*1e9)
	if d := ms(off) - ms(p.StepTime(1, 0)); d < -0.01 || d > 0.01 {
		t.Errorf("alone, off: TPOT %v, the step %v", off, p.StepTime(1, 0))
	}
	if d := ms(on) - ms(wantOn); d < -0.01 || d > 0.01 {
		t.Errorf("alone, on: TPOT %v, want %v", on, wantOn)
	}
}

// TestStepScaleInSim: Timing.StepScale (lumen sim -step-scale) makes every
// step that many times the profile's: a request alone decodes at that many
// times the TPOT, and its prefill is as much longer.
func TestStepScaleInSim(t *testing.T) {
	run := func(f float64) (ttft, tpot time.Duration) {
		p := make([]int32, 3000)
		for j := range p {
			p[j] = int32(32 + j%95)
		}
		cfg := smallConfig(t, 1, policy.Lumen, 1, 1, time.Second)
		cfg.Arrivals = []workload.Request{{Prompt: p, Output: 64}}
		cfg.Timing.DecodeContext, cfg.Timing.StepScale = true, f
		res, err := Run(cfg)
		if err != nil {
			t.Fatal(err)
		}
		r := res.Records[0]
		first, ok1 := r.TTFT()
		d, ok2 := r.TPOT()
		if !ok1 || !ok2 {
			t.Fatalf("no TTFT or TPOT: %+v", r)
		}
		return first, d
	}
	ttft, tpot := run(0)
	for _, f := range []float64{1, 1.03, 1.5} {
		gotTTFT, gotTPOT := run(f)
		t.Logf("×%g: TTFT %v (%v), TPOT %v (%v)", f, gotTTFT, ttft, gotTPOT, tpot)
		if r := float64(gotTPOT) / float64(tpot); math.Abs(r-f) > 1e-4 {
			t.Errorf("StepScale %g: TPOT %v, %.5f× the profile's %v", f, gotTPOT, r, tpot)
		}
		// The prefill's steps scale; the dispatch's commit does not.
		commit := DefaultTiming().CommitDelay
		if r := float64(gotTTFT-commit) / float64(ttft-commit); math.Abs(r-f) > 1e-3 {
			t.Errorf("StepScale %g: TTFT %v, the prefill %.4f× the profile's (%v)", f, gotTTFT, r, ttft)
		}
	}
	bad := smallConfig(t, 1, policy.Lumen, 1, 1, time.Second)
	bad.Timing.StepScale = 3
	if _, err := New(bad); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "StepScale") {
		t.Fatalf("StepScale 3: %v, want ErrInvalid naming StepScale", err)
	}
}

// A profile without a memory bandwidth cannot take the context's cost.
func TestDecodeContextNeedsBandwidth(t *testing.T) {
	cfg := smallConfig(t, 1, policy.Lumen, 2, 4, 2*time.Second)
	cfg.Profile.HBMBytesPerSec = 0
	cfg.Timing.DecodeContext = true
	if _, err := New(cfg); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "HBMBytesPerSec") {
		t.Fatalf("%v, want ErrInvalid naming HBMBytesPerSec", err)
	}
}

func TestParseDetect(t *testing.T) {
	for in, want := range map[string]struct {
		d    time.Duration
		hang bool
	}{"fast": {45 * time.Millisecond, false}, "hang": {DefaultHangDetect, true}, "200ms": {200 * time.Millisecond, false}, "hang:5.6s": {5600 * time.Millisecond, true}} {
		d, hang, err := ParseDetect(in)
		if err != nil || d != want.d || hang != want.hang {
			t.Errorf("ParseDetect(%q) = %v, %v, %v; want %v, %v", in, d, hang, err, want.d, want.hang)
		}
	}
	for _, in := range []string{"slow", "0s", "-1s", "hang:", "hang:fast"} {
		if _, _, err := ParseDetect(in); !errors.Is(err, ErrInvalid) {
			t.Errorf("ParseDetect(%q): %v, want ErrInvalid", in, err)
		}
	}
}

// TestCommandConditions: -max-running overrides the named setups' caps
// only when given; -detect, -reload and -decode-context reach the timing;
// -load 0.95 is accepted.
func TestCommandConditions(t *testing.T) {
	c := DefaultCommand()
	c.Setups = "w4-mild,w8-mild"
	s, err := c.setups()
	if err != nil || s[0].MaxRunning != 64 || s[1].MaxRunning != 32 {
		t.Fatalf("without -max-running: %+v, %v", s, err)
	}
	c.MaxRunning, c.Given["max-running"] = 256, true
	if s, err = c.setups(); err != nil || s[0].MaxRunning != 256 || s[1].MaxRunning != 256 {
		t.Fatalf("-max-running 256: %+v, %v", s, err)
	}
	if s[0].StepTokens() != 2048 {
		t.Fatalf("the default token budget: %d", s[0].StepTokens())
	}
	c.TokenBudget = 8192
	if s, err = c.setups(); err != nil || s[0].StepTokens() != 8192 || s[1].TokenBudget != 8192 {
		t.Fatalf("-token-budget 8192: %+v, %v", s, err)
	}
	c.TokenBudget = 0
	if w4, _ := recoverystudy.Lookup("w4-mild"); w4.MaxRunning != 64 || w4.TokenBudget != 0 {
		t.Fatalf("the override changed the prototype setup: %+v", w4)
	}
	// The headline setups carry the stress; a flag given overrides it for
	// every setup, one not given leaves each setup's own.
	c = DefaultCommand()
	c.Setups = "w8,w8-mild"
	if s, err = c.setups(); err != nil || s[0].Conditions != recoverystudy.Stress || s[0].MaxRunning != 256 ||
		s[1].Load != 0.7 || s[1].Reload != "warm" || s[1].Detect != "fast" || s[1].DecodeContext {
		t.Fatalf("the setups' own conditions: %+v, %v", s, err)
	}
	c.Load, c.Reload, c.DecodeContext = 0.5, "40s", "off"
	c.Given["load"], c.Given["reload"], c.Given["decode-context"] = true, true, true
	if s, err = c.setups(); err != nil || s[0].Load != 0.5 || s[0].Reload != "40s" || s[0].DecodeContext || s[0].Detect != "fast" || s[1].Load != 0.5 {
		t.Fatalf("-load 0.5 -reload 40s -decode-context off: %+v, %v", s, err)
	}
	if tm, err := DefaultTiming().Under(s[0].Conditions); err != nil || tm.Reload.Kind != engine.ReloadFixed || tm.DecodeContext {
		t.Fatalf("timing under %+v: %+v, %v", s[0].Conditions, tm, err)
	}
	if _, err := DefaultTiming().Under(recoverystudy.Conditions{Reload: "lukewarm"}); err == nil || !strings.Contains(err.Error(), "reload") {
		t.Fatalf("a bad reload: %v", err)
	}
	// -preemption vllm reaches the workers' cores; a bad rule is refused
	// by name.
	c = DefaultCommand()
	c.Setups, c.Preemption, c.Given["preemption"] = "w8", "vllm", true
	if s, err = c.setups(); err != nil || s[0].Preemption != "vllm" {
		t.Fatalf("-preemption vllm: %+v, %v", s, err)
	}
	if tm, err := DefaultTiming().Under(s[0].Conditions); err != nil || tm.Preemption != core.PreemptVLLM {
		t.Fatalf("timing under -preemption vllm: %+v, %v", tm, err)
	}
	c.Preemption = "lifo"
	if _, err := c.timing(); err == nil || !strings.Contains(err.Error(), `-preemption: preemption "lifo"`) {
		t.Fatalf("-preemption lifo: %v", err)
	}
	// -stress puts a custom setup at the headline stress, but for the
	// flags given.
	c = DefaultCommand()
	c.Workers, c.Stress, c.Detect, c.Given["detect"] = 64, true, "hang", true
	if s, err = c.setups(); err != nil || s[0].MaxRunning != StressMaxRunning || s[0].Load != recoverystudy.StressLoad ||
		s[0].Reload != "cold" || s[0].Detect != "hang" || !s[0].DecodeContext || s[0].Timeline(false).FailAt != recoverystudy.StressFailAt {
		t.Fatalf("-workers 64 -stress -detect hang: %+v, %v", s, err)
	}
	c = DefaultCommand()
	c.Detect, c.Reload, c.DecodeContext = "hang", "cold", "on"
	tm, err := c.timing()
	if err != nil || !tm.Hang || tm.DetectDelay != DefaultHangDetect || tm.Reload.Kind != engine.ReloadCold || !tm.DecodeContext {
		t.Fatalf("timing %+v, %v", tm, err)
	}
	dc := DefaultCommand()
	if def, _ := dc.timing(); def != DefaultTiming() {
		t.Fatalf("the default command's timing %+v is not DefaultTiming's", def)
	}
	for _, bad := range []func(*Command){
		func(c *Command) { c.Detect = "later" },
		func(c *Command) { c.Reload = "lukewarm" },
		func(c *Command) { c.DecodeContext = "yes" },
		func(c *Command) { c.StepScale = 2.5 },
		func(c *Command) { c.MaxRunning = 0 },
		func(c *Command) { c.TokenBudget = -1 },
		func(c *Command) { c.Figure, c.TokenBudget, c.Given["token-budget"] = "load", 4096, true },
	} {
		c := DefaultCommand()
		c.Out, c.Errs = &bytes.Buffer{}, &bytes.Buffer{}
		bad(&c)
		if err := c.Run(); err == nil || !strings.Contains(err.Error(), "-") {
			t.Errorf("%+v: %v", c, err)
		}
	}
	st := Study{Setup: CustomSetup(2, "qwen3-14b-h100", 1, 32, 80e9), Seed: 1, Load: 0.95, Timing: DefaultTiming(),
		Timeline: Timeline{Warmup: time.Second, FailAt: 2 * time.Second, Duration: 4 * time.Second, Calibration: 4 * time.Second, ReloadScale: 0.05}}
	if _, err := st.Run(); err != nil {
		t.Fatalf("load 0.95: %v", err)
	}
}

// TestVLLMBatchCapBindsKV: at vLLM's 256 sequences a Qwen3-14B worker's KV
// cache, not the cap, bounds the batch: offered twice its saturated rate,
// it fills its cache; at the setups' cap of 32 it never does (issue 22:
// the KV cache was 17% used).
func TestVLLMBatchCapBindsKV(t *testing.T) {
	seed := uint64(4)
	t.Logf("seed %d", seed)
	p := engine.Profiles["qwen3-14b-h100"]
	tr := workload.AzureConversation
	peak := func(maxRunning int) (float64, int) {
		per, batch := p.SaturatedRate(maxRunning, tr.Prompt.Mean(), tr.Output.Mean())
		if maxRunning == 256 && batch >= 256 {
			t.Fatalf("the KV cache holds %d rows of the mean context: it does not bind", batch)
		}
		cfg := smallConfig(t, seed, policy.Lumen, 1, 2*per, 30*time.Second)
		cfg.MaxRunning = maxRunning
		s, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		used := 0
		s.advance(func() bool {
			if w := s.workers[0]; w.alive {
				used = max(used, w.core.CachedPages())
			}
			return false
		})
		if s.err != nil {
			t.Fatal(s.err)
		}
		return float64(used) / float64(p.KVPages()), s.res.Preemptions
	}
	small, _ := peak(32)
	big, preempted := peak(256)
	t.Logf("peak KV use: %.0f%% at a cap of 32, %.0f%% at 256 (%d preemptions)", 100*small, 100*big, preempted)
	if small > 0.5 || big < 0.95 {
		t.Errorf("peak KV use %.0f%% at a cap of 32, %.0f%% at 256; want under 50%% and over 95%%", 100*small, 100*big)
	}
}
