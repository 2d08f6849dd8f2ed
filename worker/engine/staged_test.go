package engine

import (
	"context"
	"math"
	"testing"
	"time"
)

// TestSyntheticDraftAgreesAtAlpha: the synthetic draft proposes the
// synthetic target's next token at a rate alpha over many positions, and
// never the target's token when it disagrees; a replayed prefix gets the
// same draft.
func TestSyntheticDraftAgreesAtAlpha(t *testing.T) {
	ctx := context.Background()
	for _, alpha := range []float64{0, 0.5, 0.7, 1} {
		target, _ := NewSynthetic(SyntheticConfig{Pages: 4096})
		draft, err := NewSyntheticDraft(SyntheticConfig{Pages: 4096}, alpha, 7)
		if err != nil {
			t.Fatal(err)
		}
		agree, total := 0, 0
		for s := SeqID(1); s <= 40; s++ {
			prompt := []int32{int32(s), 40, 41}
			for n := 0; n < 100; n++ {
				tOut, err := target.Forward(ctx, []Chunk{{Seq: s, Tokens: prompt, Sample: 1}})
				if err != nil {
					t.Fatal(err)
				}
				dOut, err := draft.Forward(ctx, []Chunk{{Seq: s, Tokens: prompt, Sample: 1}})
				if err != nil {
					t.Fatal(err)
				}
				if dOut[0][0] == tOut[0][0] {
					agree++
				}
				total++
				prompt = tOut[0]
			}
		}
		got := float64(agree) / float64(total)
		if math.Abs(got-alpha) > 0.03 {
			t.Errorf("alpha %v: the draft agreed at %.3f of %d positions", alpha, got, total)
		}
	}
	d1, _ := NewSyntheticDraft(SyntheticConfig{Pages: 64}, 0.5, 7)
	d2, _ := NewSyntheticDraft(SyntheticConfig{Pages: 64}, 0.5, 7)
	a, _ := d1.Forward(ctx, []Chunk{{Seq: 1, Tokens: []int32{1, 2, 3, 4}, Sample: 4}})
	b, _ := d2.Forward(ctx, []Chunk{{Seq: 9, Tokens: []int32{1, 2}, Sample: 2}})
	c, _ := d2.Forward(ctx, []Chunk{{Seq: 9, Tokens: []int32{3, 4}, Sample: 2}})
	if got := append(b[0], c[0]...); !equal(got, a[0]) {
		t.Errorf("drafts depend on batching: %v in one chunk, %v in two", a[0], got)
	}
	if _, err := NewSyntheticDraft(SyntheticConfig{Pages: 64}, 1.5, 0); err == nil {
		t.Error("alpha 1.5 accepted")
	}
}

func equal(a, b []int32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestTransformerStages: the staged load reads the file into host memory
// first and loads the engine only at ToDevice; the engine then computes
// what a directly loaded one does.
func TestTransformerStages(t *testing.T) {
	e := newEngine(t, 64)
	e.Unload()
	st := TransformerStages(e)
	ctx := context.Background()
	if err := st.ToHost(ctx); err != nil {
		t.Fatal(err)
	}
	if e.Loaded() {
		t.Fatal("loaded before ToDevice")
	}
	if err := st.ToDevice(ctx); err != nil {
		t.Fatal(err)
	}
	if !e.Loaded() {
		t.Fatal("not loaded after ToDevice")
	}
	r := request{prompt: []int32{70, 71, 72}, max: 8}
	if got, want := reference(t, e, r), reference(t, newEngine(t, 64), r); !equal(got, want) {
		t.Errorf("after a staged load %v, loaded directly %v", got, want)
	}
}

// TestPacedStagesTakeTheProfileTimes: ToHost takes the disk read and the
// engine's initialisation, ToDevice the host-to-GPU copy, both scaled; a
// cancelled context ends the wait.
func TestPacedStagesTakeTheProfileTimes(t *testing.T) {
	p := Profiles["qwen3-14b-h100"]
	if got, want := p.HostLoadTime()+p.HotswapTime(), p.LoadTime(); got != want {
		t.Fatalf("HostLoadTime + HotswapTime = %s, LoadTime %s", got, want)
	}
	e, _ := NewSynthetic(SyntheticConfig{Pages: 64})
	e.Unload()
	const scale = 0.002 // 22.8 s → 46 ms; 0.84 s → 1.7 ms
	st := LoadStages(e).Paced(p, scale)
	ctx := context.Background()
	for _, s := range []struct {
		name string
		f    func(context.Context) error
		want time.Duration
	}{{"ToHost", st.ToHost, p.HostLoadTime()}, {"ToDevice", st.ToDevice, p.HotswapTime()}} {
		start := time.Now()
		if err := s.f(ctx); err != nil {
			t.Fatal(err)
		}
		if took, min := time.Since(start), time.Duration(float64(s.want)*scale); took < min {
			t.Errorf("%s took %s, the profile says at least %s", s.name, took, min)
		}
	}
	if !e.Loaded() {
		t.Error("not loaded after ToDevice")
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := LoadStages(e).Paced(p, 1).ToHost(cctx); err == nil {
		t.Error("a cancelled ToHost returned no error")
	}
}
