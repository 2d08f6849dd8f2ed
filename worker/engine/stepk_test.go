package engine

import (
	"context"
	"testing"
	"time"
)

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

// TestStepTimeK checks the fused verification step's cost against the
// figures docs/calibration.md derives for Qwen3-14B on an H100: B = 8, K = 4
// costs about 14.1 ms against 12.5 plain; B = 128, K = 4 about 51–52 ms
// against 26.
func TestStepTimeK(t *testing.T) {
	p := Profiles["qwen3-14b-h100"]
	for _, c := range []struct {
		rows, k     int
		want, plain float64
	}{{8, 4, 14.1, 12.5}, {128, 4, 51.8, 26.2}} {
		got, plain := ms(p.StepTimeK(c.rows, c.k, 0)), ms(p.StepTimeK(c.rows, 0, 0))
		if got < c.want*0.99 || got > c.want*1.01 || plain < c.plain*0.99 || plain > c.plain*1.01 {
			t.Errorf("B = %d, K = %d: %.2f ms against %.2f plain; calibration %.1f against %.1f", c.rows, c.k, got, plain, c.want, c.plain)
		}
	}
	// K = 0 is the plain step; the cost grows with K and with the batch,
	// and the growth with K is steeper at a larger batch.
	for _, rows := range []int{1, 8, 64} {
		for _, prefill := range []int{0, 300} {
			if a, b := p.StepTimeK(rows, 0, prefill), p.StepTime(rows, prefill); a != b {
				t.Errorf("B = %d: K = 0 costs %v, the plain step %v", rows, a, b)
			}
		}
		for k := 1; k <= 8; k++ {
			if p.StepTimeK(rows, k, 0) <= p.StepTimeK(rows, k-1, 0) {
				t.Errorf("B = %d: K = %d costs no more than K = %d", rows, k, k-1)
			}
		}
	}
	small := ms(p.StepTimeK(8, 4, 0)) / ms(p.StepTimeK(8, 0, 0))
	large := ms(p.StepTimeK(128, 4, 0)) / ms(p.StepTimeK(128, 0, 0))
	if small > 1.2 || large < 1.9 {
		t.Errorf("K = 4 multiplies the step by %.2f at B = 8 and %.2f at B = 128; want ≤ 1.2 and ≥ 1.9", small, large)
	}
}

// TestPacedChargesTheFusedStep: a batch with a verification row is charged
// StepTimeK of its shape — every decoding row padded to the widest K.
func TestPacedChargesTheFusedStep(t *testing.T) {
	syn, _ := NewSynthetic(SyntheticConfig{Pages: 64})
	p := Profiles["qwen3-14b-h100"]
	paced := NewPaced(syn, p, 1)
	paced.Sleep = func(time.Duration) {}
	ctx := context.Background()
	prompt := func(n int) []int32 {
		out := make([]int32, n)
		for i := range out {
			out[i] = int32(40 + i%50)
		}
		return out
	}
	if _, err := paced.Forward(ctx, []Chunk{{Seq: 1, Tokens: prompt(20), Sample: 1}, {Seq: 2, Tokens: prompt(9), Sample: 1}}); err != nil {
		t.Fatal(err)
	}
	before := paced.Stats().Emulated
	batch := []Chunk{
		{Seq: 1, Tokens: prompt(4), Sample: 4},  // the last token and 3 drafts
		{Seq: 2, Tokens: prompt(1), Sample: 1},  // a plain decode, padded
		{Seq: 3, Tokens: prompt(30), Sample: 1}, // a prefill
		{Seq: 4, Tokens: prompt(12), Sample: 0}, // a prefill chunk
	}
	rows, k, prefill := BatchShape(batch)
	if rows != 2 || k != 3 || prefill != 42 {
		t.Fatalf("shape %d rows, K %d, %d prefill; want 2, 3, 42", rows, k, prefill)
	}
	if _, err := paced.Forward(ctx, batch); err != nil {
		t.Fatal(err)
	}
	if got, want := paced.Stats().Emulated-before, p.StepTimeK(2, 3, 42); got != want {
		t.Fatalf("charged %v, StepTimeK %v", got, want)
	}
}
