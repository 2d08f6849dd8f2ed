package engine

import (
	"context"
	"math"
	"testing"
	"time"
)

func within(got, want, tol float64) bool { return math.Abs(got-want) <= tol*math.Abs(want) }

// TestDecodeContextCalibration checks the context-dependent decode step
// against docs/calibration.md ("Engine defaults", "Step times"), Qwen3-14B
// on an H100: the weights read in 8.8 ms at 3.35 TB/s, 0.049 µs per
// context token held (160 KiB at 3.35 TB/s), 32 requests of 1.4k tokens
// ≈ 2.2 ms of KV reads and 256 of them ≈ 17 ms; at the reference context
// the step is the fitted line's, so turning the mode on changes nothing
// there.
func TestDecodeContextCalibration(t *testing.T) {
	p := Profiles["qwen3-14b-h100"]
	if got := p.WeightReadMs(); !within(got, 8.8, 0.01) {
		t.Errorf("weights read in %.3f ms; calibration 8.8", got)
	}
	if over := p.DecodeBaseMs - p.WeightReadMs(); over < 2.5 || over > 3.1 {
		t.Errorf("fixed overhead %.2f ms beside the weights; calibration ~2.8", over)
	}
	if got := p.contextReadMs(1) * 1000; !within(got, 0.049, 0.01) {
		t.Errorf("%.4f µs per context token; calibration 0.049", got)
	}
	on := p
	on.DecodeContext = true
	// The KV reads of B rows of 1.4k tokens: the step with them less the
	// step whose rows read nothing.
	for _, c := range []struct {
		rows int
		want float64
	}{{32, 2.2}, {256, 17.5}} {
		full := on.Step(StepShape{Rows: c.rows, Context: c.rows * 1400})
		empty := on.Step(StepShape{Rows: c.rows})
		if got := ms(full - empty); !within(got, c.want, 0.02) {
			t.Errorf("%d rows of 1.4k tokens read their KV in %.2f ms; calibration %.1f", c.rows, got, c.want)
		}
	}
	// At the reference context the mode changes no step; it grows with
	// the context read, at any K and beside a prefill.
	for _, rows := range []int{1, 8, 64, 256} {
		for _, k := range []int{0, 3} {
			for _, prefill := range []int{0, 512} {
				ref := StepShape{Rows: rows, K: k, Prefill: prefill, Context: rows * DecodeRefContext}
				if a, b := on.Step(ref), p.StepTimeK(rows, k, prefill); a != b {
					t.Errorf("B = %d, K = %d, prefill %d at the reference context: %v with the mode on, %v off", rows, k, prefill, a, b)
				}
				long := ref
				long.Context *= 4
				if on.Step(long) <= on.Step(ref) || p.Step(long) != p.Step(ref) {
					t.Errorf("B = %d, K = %d: 4× the context costs %v against %v on, %v against %v off",
						rows, k, on.Step(long), on.Step(ref), p.Step(long), p.Step(ref))
				}
			}
		}
	}
	// A full KV cache of Qwen3-14B (16,212 pages, 259k tokens) is read in
	// (72 − 29.5) GB / 3.35 TB/s ≈ 12.7 ms.
	tokens := p.KVPages() * PageTokens
	if got := p.contextReadMs(tokens); !within(got, 12.7, 0.02) {
		t.Errorf("the whole KV cache (%d tokens) reads in %.2f ms; derived 12.7", tokens, got)
	}
	// 256 rows of 1,000 tokens, the KV cache nearly full: the step is
	// shorter than the fitted line's at the reference context.
	if a, b := on.Step(StepShape{Rows: 256, Context: 256 * 1000}), p.StepTime(256, 0); a >= b {
		t.Errorf("256 rows of 1k tokens: %v with the mode on, not below the line's %v", a, b)
	}
}

// TestProfilesHaveBandwidth: every built-in profile can turn the mode on.
func TestProfilesHaveBandwidth(t *testing.T) {
	for name, p := range Profiles {
		if p.HBMBytesPerSec <= 0 {
			t.Errorf("%s: no HBM bandwidth", name)
		}
		// Llumnix's instance is derived with the mode on (its step is
		// fitted at short context, the context read on top), and the
		// figure llumnix runs it so; the others' figures were not.
		if p.DecodeContext != (name == LlamaA10.Name) {
			t.Errorf("%s: the mode is %v by default; the setups' figures were measured with it only for %s", name, p.DecodeContext, LlamaA10.Name)
		}
		if p.DecodeRefContext > 0 && p.contextReadMs(p.DecodeRefContext) >= p.DecodePerSeqMs {
			t.Errorf("%s: a row of the reference context reads its KV in %.3f ms, more than the %.3f ms a row costs",
				name, p.contextReadMs(p.DecodeRefContext), p.DecodePerSeqMs)
		}
	}
}

// TestBatchStepContext: a decoding or verifying row reads its cached
// positions and its new ones; a prefill chunk is not a decoding row.
func TestBatchStepContext(t *testing.T) {
	held := []int{100, 2000, 0, 37}
	batch := []Chunk{
		{Seq: 1, Tokens: make([]int32, 1), Sample: 1},  // decode
		{Seq: 2, Tokens: make([]int32, 4), Sample: 4},  // verify 3 drafts
		{Seq: 3, Tokens: make([]int32, 50), Sample: 1}, // prefill
		{Seq: 4, Tokens: make([]int32, 20), Sample: 0}, // prefill chunk
	}
	got := BatchStep(batch, func(i int) int { return held[i] })
	want := StepShape{Rows: 2, K: 3, Prefill: 70, Context: 101 + 2004}
	if got != want {
		t.Fatalf("shape %+v, want %+v", got, want)
	}
}

// TestPacedChargesTheContext: with the mode on, the pacer charges the
// context its engine's sequences hold.
func TestPacedChargesTheContext(t *testing.T) {
	syn, _ := NewSynthetic(SyntheticConfig{Pages: 256})
	p := Profiles["qwen3-14b-h100"]
	p.DecodeContext = true
	paced := NewPaced(syn, p, 1)
	paced.Sleep = func(time.Duration) {}
	ctx := context.Background()
	prompt := make([]int32, 1000)
	for i := range prompt {
		prompt[i] = int32(40 + i%50)
	}
	if _, err := paced.Forward(ctx, []Chunk{{Seq: 1, Tokens: prompt, Sample: 1}}); err != nil {
		t.Fatal(err)
	}
	before := paced.Stats().Emulated
	if _, err := paced.Forward(ctx, []Chunk{{Seq: 1, Tokens: prompt[:1], Sample: 1}}); err != nil {
		t.Fatal(err)
	}
	if got, want := paced.Stats().Emulated-before, p.Step(StepShape{Rows: 1, Context: 1001}); got != want {
		t.Fatalf("charged %v for a row of 1,001 positions, Step %v", got, want)
	}
}

// TestReload: warm is the profile's load; cold a replacement node's
// (docs/calibration.md: 1.5–3 minutes for Qwen3-14B, 2.5–5 for
// Qwen3-32B); a duration is the whole reload, its copy to the GPU kept.
func TestReload(t *testing.T) {
	for _, c := range []struct {
		name     string
		lo, hi   time.Duration
		warmLoad time.Duration
	}{{"qwen3-14b-h100", 90 * time.Second, 3 * time.Minute, 23600 * time.Millisecond},
		{"qwen3-32b-h100", 150 * time.Second, 5 * time.Minute, 34100 * time.Millisecond}} {
		p := Profiles[c.name]
		if got := p.LoadTime(); got.Round(100*time.Millisecond) != c.warmLoad {
			t.Errorf("%s: warm load %v; calibration %v", c.name, got, c.warmLoad)
		}
		warm, err := p.WithReload(Reload{})
		if err != nil || warm != p {
			t.Errorf("%s: warm changed the profile (%v)", c.name, err)
		}
		cold, err := p.WithReload(Reload{Kind: ReloadCold})
		if err != nil {
			t.Fatal(err)
		}
		if got := cold.LoadTime(); got < c.lo || got > c.hi {
			t.Errorf("%s: cold reload %v, outside %v–%v", c.name, got, c.lo, c.hi)
		}
		if d := cold.HotswapTime() - p.HotswapTime(); d < -time.Microsecond || d > time.Microsecond || cold.Step(StepShape{Rows: 8}) != p.Step(StepShape{Rows: 8}) {
			t.Errorf("%s: cold changed the copy to the GPU or the step", c.name)
		}
		fixed, err := p.WithReload(Reload{Kind: ReloadFixed, Duration: 3 * time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		if d := fixed.LoadTime() - 3*time.Minute; d < -time.Microsecond || d > time.Microsecond {
			t.Errorf("%s: a 3m reload loads in %v", c.name, fixed.LoadTime())
		}
		if d := fixed.HotswapTime() - p.HotswapTime(); d < -time.Microsecond || d > time.Microsecond {
			t.Errorf("%s: a 3m reload copies to the GPU in %v, the profile in %v", c.name, fixed.HotswapTime(), p.HotswapTime())
		}
		if _, err := p.WithReload(Reload{Kind: ReloadFixed, Duration: p.HotswapTime() / 2}); err == nil {
			t.Errorf("%s: a reload shorter than the copy to the GPU was accepted", c.name)
		}
	}
	// The draft reads its weights from cold storage too, and keeps its
	// initialisation.
	d := Profiles["qwen3-0.6b-h100"]
	cd, _ := d.WithReload(Reload{Kind: ReloadCold})
	if cd.EngineInit != d.EngineInit || cd.LoadTime() <= d.LoadTime() || cd.LoadTime() > 5*time.Second {
		t.Errorf("cold draft: init %v, load %v (warm %v)", cd.EngineInit, cd.LoadTime(), d.LoadTime())
	}
}

func TestParseReload(t *testing.T) {
	for in, want := range map[string]Reload{"warm": {}, "": {}, "cold": {Kind: ReloadCold}, "90s": {Kind: ReloadFixed, Duration: 90 * time.Second}} {
		got, err := ParseReload(in)
		if err != nil || got != want {
			t.Errorf("ParseReload(%q) = %+v, %v; want %+v", in, got, err, want)
		}
		if in != "" {
			if back, _ := ParseReload(got.String()); back != got {
				t.Errorf("%q: String %q reads back as %+v", in, got.String(), back)
			}
		}
	}
	for _, in := range []string{"hot", "-3s", "0s", "3"} {
		if _, err := ParseReload(in); err == nil {
			t.Errorf("ParseReload(%q) accepted", in)
		}
	}
}
