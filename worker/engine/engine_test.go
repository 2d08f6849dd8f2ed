package engine

import (
	"context"
	"encoding/binary"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestSamplingDeterministicAndBounded(t *testing.T) {
	logits := []float32{1, 3, 3, 0.5, -1}
	if got := sample(logits, Sampling{}, 0); got != 1 {
		t.Fatalf("greedy tie picked %d, want the lower id 1", got)
	}
	p := Sampling{Temperature: 0.8, TopP: 0.9, Seed: 42}
	counts := map[int32]int{}
	for i := 0; i < 2000; i++ {
		a, b := sample(logits, p, i), sample(logits, p, i)
		if a != b {
			t.Fatal("same seed and index sampled differently")
		}
		counts[a]++
	}
	if counts[4] != 0 || counts[1] == 0 || counts[2] == 0 {
		t.Fatalf("top-p sampling counts %v", counts)
	}
}

func TestProfileStepTimes(t *testing.T) {
	p := Profiles["qwen3-14b-h100"]
	// docs/calibration.md, "Step times": 12.5 ms at batch 8, 18.9 at 64 (vLLM, H100).
	for _, c := range []struct {
		batch int
		ms    float64
	}{{8, 12.5}, {64, 18.9}} {
		got := float64(p.StepTime(c.batch, 0)) / 1e6
		if got < c.ms*0.98 || got > c.ms*1.02 {
			t.Errorf("batch %d: %.2f ms, calibration %.1f ms", c.batch, got, c.ms)
		}
	}
	if kv := p.KVBytesPerToken(); kv != 160<<10 {
		t.Errorf("Qwen3-14B KV per token %d, want 160 KiB", kv)
	}
	if kv := Profiles["qwen3-32b-h100"].KVBytesPerToken(); kv != 256<<10 {
		t.Errorf("Qwen3-32B KV per token %d, want 256 KiB", kv)
	}
	if kv := Profiles["qwen3-0.6b-h100"].KVBytesPerToken(); kv != 112<<10 {
		t.Errorf("Qwen3-0.6B KV per token %d, want 112 KiB", kv)
	}
	if _, _, err := LookupProfile("qwen3-7b-a100"); err == nil || !strings.Contains(err.Error(), "qwen3-14b-h100") {
		t.Fatalf("unknown profile: %v", err)
	}
}

func TestPacedWaitsOutEmulatedTime(t *testing.T) {
	syn, _ := NewSynthetic(SyntheticConfig{Pages: 64})
	p := NewPaced(syn, Profiles["qwen3-14b-h100"], 0.5)
	var slept time.Duration
	p.Sleep = func(d time.Duration) { slept += d }
	batch := []Chunk{{Seq: 1, Tokens: []int32{1}, Sample: 1}, {Seq: 2, Tokens: []int32{2}, Sample: 1}}
	if _, err := p.Forward(context.Background(), batch); err != nil {
		t.Fatal(err)
	}
	want := time.Duration(float64(Profiles["qwen3-14b-h100"].StepTime(2, 0)) * 0.5)
	if slept > want || slept < want-2*time.Millisecond {
		t.Fatalf("slept %s for an emulated %s step", slept, want)
	}
	if s := p.Stats(); s.Steps != 1 || s.Emulated != want {
		t.Fatalf("stats %+v", s)
	}
}

func TestPacedImportTakesTheCopyTime(t *testing.T) {
	syn, _ := NewSynthetic(SyntheticConfig{Pages: 8})
	prof := Profiles["qwen3-32b-h100"]
	// 16 tokens × 256 KiB over 35 GB/s: 119.8 µs a page.
	if got := prof.ImportTime(10); got < 1190*time.Microsecond || got > 1205*time.Microsecond {
		t.Fatalf("10 pages of Qwen3-32B: %s, want about 1.198 ms", got)
	}
	prompt := make([]int32, 33)
	if _, err := syn.Forward(context.Background(), []Chunk{{Seq: 1, Tokens: prompt, Sample: 1}}); err != nil {
		t.Fatal(err)
	}
	var pages [][]byte
	for i := range 2 {
		b, err := syn.ExportPage(1, i)
		if err != nil {
			t.Fatal(err)
		}
		pages = append(pages, b)
	}
	p := NewPaced(syn, prof, 1)
	var slept time.Duration
	p.Sleep = func(d time.Duration) { slept += d }
	if err := p.ImportPages(2, pages); err != nil {
		t.Fatal(err)
	}
	if want := prof.ImportTime(2); slept > want || slept < want/2 {
		t.Fatalf("slept %s for a %s copy", slept, want)
	}
	if syn.Len(2) != 32 {
		t.Fatalf("imported sequence holds %d positions, want 32", syn.Len(2))
	}
}

func TestSyntheticImportChecksPages(t *testing.T) {
	s, _ := NewSynthetic(SyntheticConfig{Pages: 8})
	ctx := context.Background()
	prompt := make([]int32, 40)
	for i := range prompt {
		prompt[i] = int32(i)
	}
	if _, err := s.Forward(ctx, []Chunk{{Seq: 1, Tokens: prompt, Sample: 1}}); err != nil {
		t.Fatal(err)
	}
	page, err := s.ExportPage(1, 1)
	if err != nil {
		t.Fatal(err)
	}
	first, _ := s.ExportPage(1, 0)
	page[3] ^= 1 // corrupt a token
	if err := s.ImportPages(2, [][]byte{first, page}); err == nil || !strings.Contains(err.Error(), "corrupt") {
		t.Fatalf("corrupt page accepted: %v", err)
	}
	if _, err := s.ExportPage(1, 2); err == nil {
		t.Fatal("exported a page that is not full")
	}
}

// writeRaw writes a safetensors file from a header and data.
func writeRaw(t *testing.T, header string, data []byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "w.safetensors")
	var b []byte
	b = binary.LittleEndian.AppendUint64(b, uint64(len(header)))
	b = append(append(b, header...), data...)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestBadWeightFiles(t *testing.T) {
	good := testModel(t)
	full, err := os.ReadFile(good)
	if err != nil {
		t.Fatal(err)
	}
	truncated := filepath.Join(t.TempDir(), "truncated.safetensors")
	os.WriteFile(truncated, full[:len(full)-100], 0o644)

	small := DefaultTarget()
	small.Layers = 1
	mismatched := filepath.Join(t.TempDir(), "mismatched.safetensors")
	w := InitWeights(small, 1, 1, 1)
	w.Config.Layers = 2 // config says 2 layers, tensors hold 1
	if err := w.Save(mismatched); err != nil {
		t.Fatal(err)
	}
	wrongShape := filepath.Join(t.TempDir(), "shape.safetensors")
	w2 := InitWeights(small, 1, 1, 1)
	w2.Norm = w2.Norm[:10]
	sh := shapes(w2.Config)
	ts := map[string]Tensor{}
	for name, p := range w2.tensors() {
		ts[name] = Tensor{Shape: sh[name], Data: *p}
	}
	ts["norm.weight"] = Tensor{Shape: []int{10}, Data: w2.Norm}
	if err := WriteSafetensors(wrongShape, ts, map[string]string{"config": w2.Config.marshal()}); err != nil {
		t.Fatal(err)
	}

	tooShort := filepath.Join(t.TempDir(), "short.safetensors")
	os.WriteFile(tooShort, []byte{1, 2, 3}, 0o644)
	cases := []struct {
		name, path, want string
	}{
		{"missing file", filepath.Join(t.TempDir(), "nope"), "no such file"},
		{"truncated", truncated, "outside the"},
		{"too short", tooShort, "too short for the 8-byte header length"},
		{"no config", writeRaw(t, "{}", nil), "no \"config\""},
		{"header beyond file", writeRaw(t, `{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, nil), "outside the 0 data bytes"},
		{"not json", writeRaw(t, "{nope", nil), "not JSON"},
		{"bf16", writeRaw(t, `{"a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}}`, []byte{0, 0}), "dtype BF16; only F32"},
		{"size mismatch", writeRaw(t, `{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}`, make([]byte, 4)), "needs 8 bytes, offsets give 4"},
		{"overlap", writeRaw(t, `{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, make([]byte, 8)), "overlap"},
		{"missing tensors", mismatched, "missing tensors"},
		{"wrong shape", wrongShape, "tensor norm.weight has shape [10]"},
	}
	for _, c := range cases {
		_, err := LoadWeights(c.path)
		if err == nil || !errors.Is(err, ErrBadWeights) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an ErrBadWeights containing %q", c.name, err, c.want)
		}
	}
	if _, err := LoadWeights(good); err != nil {
		t.Fatalf("good file: %v", err)
	}
}

// TestDraftAgreement checks the draft predicts the target's greedy next
// token often enough for speculation to pay (and reports the rate).
func TestDraftAgreement(t *testing.T) {
	rate, err := DraftAgreement(modelDir, 16, 48)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("greedy agreement of draft with target: %.1f%%", rate*100)
	if rate < 0.5 {
		t.Fatalf("draft agrees on %.1f%% of tokens; speculation needs well over half", rate*100)
	}
}

// TestPacedCarriesOverrun checks that a step that overran its emulated time
// (a timer woke late) shortens the next wait, so emulated time does not drift.
func TestPacedCarriesOverrun(t *testing.T) {
	syn, _ := NewSynthetic(SyntheticConfig{Pages: 64})
	p := NewPaced(syn, Profiles["qwen3-14b-h100"], 1)
	step := Profiles["qwen3-14b-h100"].StepTime(1, 0)
	var waits []time.Duration
	p.Sleep = func(d time.Duration) {
		waits = append(waits, d)
		time.Sleep(d + 2*time.Millisecond) // the clock wakes 2 ms late
	}
	for i := 0; i < 2; i++ {
		if _, err := p.Forward(context.Background(), []Chunk{{Seq: 1, Tokens: []int32{int32(i)}, Sample: 1}}); err != nil {
			t.Fatal(err)
		}
	}
	if len(waits) != 2 || waits[0] < step-time.Millisecond || waits[1] > waits[0]-time.Millisecond {
		t.Fatalf("waits %v for %s steps: the second did not make up the first's overrun", waits, step)
	}
}

// TestProfileSlowed: Slowed(f) makes every step f times as long, whatever
// its shape (decode, verification, prefill, the context's read), to the
// nanosecond's rounding; KV imports keep their time.
func TestProfileSlowed(t *testing.T) {
	shapes := []StepShape{{Rows: 1}, {Rows: 64}, {Rows: 200, Prefill: 1848}, {Prefill: 2048}, {Rows: 16, K: 4},
		{Rows: 128, Context: 128 * 3000}, {Rows: 8, K: 2, Prefill: 500, Context: 8 * 200}}
	for _, name := range []string{"qwen3-14b-h100", "qwen3-32b-h100", "qwen3-0.6b-h100"} {
		for _, ctx := range []bool{false, true} {
			p := Profiles[name]
			p.DecodeContext = ctx && p.HBMBytesPerSec > 0
			for _, f := range []float64{1.03, 0.8, 2} {
				q := p.Slowed(f)
				for _, s := range shapes {
					want := float64(p.Step(s)) * f
					if got := float64(q.Step(s)); math.Abs(got-want) > 2 {
						t.Errorf("%s (context %v) × %g, %+v: %v, want %v", name, p.DecodeContext, f, s, time.Duration(got), time.Duration(want))
					}
				}
				if q.ImportTime(100) != p.ImportTime(100) || q.LoadTime() != p.LoadTime() {
					t.Errorf("%s × %g: imports %v, loads %v; the profile's %v, %v", name, f, q.ImportTime(100), q.LoadTime(), p.ImportTime(100), p.LoadTime())
				}
			}
		}
	}
}
