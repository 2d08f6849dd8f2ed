package workload

import (
	"math"
	"math/rand/v2"
	"reflect"
	"sort"
	"testing"
	"time"
)

// TestAzureConversationMatchesTrace samples the lengths and compares mean,
// median, p90 and p99 with the published trace figures.
func TestAzureConversationMatchesTrace(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 1))
	for _, c := range []struct {
		name  string
		d     Dist
		stats [4]float64
	}{{"prompt", AzureConversation.Prompt, AzureConversation.PromptStats}, {"output", AzureConversation.Output, AzureConversation.OutputStats}} {
		const n = 200000
		xs := make([]float64, n)
		sum := 0.0
		for i := range xs {
			xs[i] = float64(c.d.Sample(r))
			sum += xs[i]
		}
		sort.Float64s(xs)
		got := [4]float64{sum / n, xs[n/2], xs[n*9/10], xs[n*99/100]}
		for k, name := range []string{"mean", "median", "p90", "p99"} {
			if rel := math.Abs(got[k]-c.stats[k]) / c.stats[k]; rel > 0.03 {
				t.Errorf("%s %s: sampled %.0f, trace %.0f (%.1f%% off)", c.name, name, got[k], c.stats[k], 100*rel)
			}
		}
		if rel := math.Abs(c.d.Mean()-c.stats[0]) / c.stats[0]; rel > 0.01 {
			t.Errorf("%s: exact mean %.1f, trace %.0f", c.name, c.d.Mean(), c.stats[0])
		}
	}
}

func TestGenerateIsSeededAndPoisson(t *testing.T) {
	c := Config{Seed: 7, Rate: 50, Duration: 200 * time.Second, Trace: AzureConversation}
	a, err := Generate(c)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Generate(c)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("the same seed gave different requests")
	}
	c.Seed = 8
	if d, _ := Generate(c); reflect.DeepEqual(a, d) {
		t.Fatal("different seeds gave the same requests")
	}
	// 10,000 expected arrivals: a Poisson count is within 4 sigma (400).
	if n := len(a); n < 9600 || n > 10400 {
		t.Fatalf("%d arrivals at 50/s over 200 s", n)
	}
	for i, r := range a {
		if i > 0 && r.At < a[i-1].At {
			t.Fatalf("arrival %d out of order", i)
		}
		if r.At >= c.Duration || r.Output < 1 || len(r.Prompt) < 1 {
			t.Fatalf("arrival %d: %+v", i, r)
		}
		for _, tok := range r.Prompt {
			if tok < 32 || tok > 126 {
				t.Fatalf("token %d is not printable ASCII", tok)
			}
		}
	}
	if _, err := Generate(Config{Rate: 0, Duration: time.Second, Trace: AzureConversation}); err == nil {
		t.Fatal("rate 0 accepted")
	}
}

// TestGenerateLazy checks that the lazy requests carry Generate's times,
// lengths and prompt ids without holding the ids.
func TestGenerateLazy(t *testing.T) {
	c := Config{Seed: 11, Rate: 40, Duration: 30 * time.Second, Trace: AzureConversation}
	eager, _ := Generate(c)
	lazy, err := GenerateLazy(c)
	if err != nil || len(lazy) != len(eager) {
		t.Fatalf("%d lazy, %d eager (%v)", len(lazy), len(eager), err)
	}
	for i := range lazy {
		l, e := &lazy[i], &eager[i]
		if l.Prompt != nil || l.At != e.At || l.Output != e.Output || l.PromptLen() != e.PromptLen() {
			t.Fatalf("arrival %d: lazy %+v, eager at %s, %d+%d tokens", i, *l, e.At, e.PromptLen(), e.Output)
		}
		if p := l.AppendPrompt(nil); !reflect.DeepEqual(p, e.Prompt) || !reflect.DeepEqual(p, l.AppendPrompt(nil)) {
			t.Fatalf("arrival %d: the lazy prompt differs", i)
		}
		if !reflect.DeepEqual(l.Materialize(), *e) {
			t.Fatalf("arrival %d: Materialize differs", i)
		}
	}
}
