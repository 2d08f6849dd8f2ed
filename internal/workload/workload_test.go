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

// TestGamma checks the sampler's mean and coefficient of variation at the
// shapes the bursty arrivals use (CV = 4 is shape 1/16), and that Generate
// with a CV keeps the rate and makes the gaps that bursty.
func TestGamma(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, cv := range []float64{0.5, 2, 4} {
		shape := 1 / (cv * cv)
		const n = 400000
		var sum, sq float64
		for range n {
			x := Gamma(r, shape)
			if x < 0 || math.IsNaN(x) {
				t.Fatalf("shape %g: drew %g", shape, x)
			}
			sum += x
			sq += x * x
		}
		mean := sum / n
		sd := math.Sqrt(sq/n - mean*mean)
		if math.Abs(mean/shape-1) > 0.03 || math.Abs(sd/mean/cv-1) > 0.05 {
			t.Errorf("shape %g: mean %g (want %g), CV %g (want %g)", shape, mean, shape, sd/mean, cv)
		}
	}
	c := Config{Seed: 9, Rate: 200, Duration: 100 * time.Second, Trace: AzureConversation, CV: 4}
	a, err := GenerateLazy(c)
	if err != nil {
		t.Fatal(err)
	}
	// The count over 100 s is far more variable than Poisson's (its
	// standard deviation is about CV·sqrt(rate·duration) = 566): 4 sigma.
	if n := len(a); n < 20000-2300 || n > 20000+2300 {
		t.Fatalf("%d arrivals at 200/s over 100 s with CV 4", n)
	}
	var sum, sq float64
	for i := 1; i < len(a); i++ {
		g := (a[i].At - a[i-1].At).Seconds()
		sum += g
		sq += g * g
	}
	n := float64(len(a) - 1)
	mean := sum / n
	if cv := math.Sqrt(sq/n-mean*mean) / mean; cv < 3 || cv > 5 {
		t.Errorf("the gaps' CV is %.2f, asked 4", cv)
	}
	if _, err := Generate(Config{Rate: 1, Duration: time.Second, Trace: AzureConversation, CV: -1}); err == nil {
		t.Fatal("CV -1 accepted")
	}
}

// TestDefaultDraw: GenerateLazy's prompts drawn inline (defaultDraw) are
// those of its token function through the draw closure, as before.
func TestDefaultDraw(t *testing.T) {
	tok := func(x uint32) int32 { return 32 + int32(x%95) }
	draw := func(x uint32) int32 { return tok(x >> 1) }
	for _, x := range []uint32{0, 1, 2, 189, 190, 1<<32 - 1, 1 << 31, 123456789} {
		if defaultDraw(x) != draw(x) {
			t.Fatalf("%d: %d, want %d", x, defaultDraw(x), draw(x))
		}
	}
	reqs, err := GenerateLazy(Config{Seed: 3, Rate: 50, Duration: 5 * time.Second, Trace: AzureConversation})
	if err != nil {
		t.Fatal(err)
	}
	for i := range reqs {
		r := reqs[i]
		if !r.drawn {
			t.Fatal("GenerateLazy without Tokens draws inline")
		}
		slow := r
		slow.drawn, slow.tok = false, draw
		if !reflect.DeepEqual(r.AppendPrompt(nil), slow.AppendPrompt(nil)) {
			t.Fatalf("arrival %d: the inline draw differs", i)
		}
	}
}
