package workload

import (
	"math"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"
)

// TestZipfLengths checks Llumnix's power-law lengths: the mean before the
// cap is the asked one, the sampled mean is the exact one, the shortest
// length is the most likely at the Zipf weight of rank 1, and the cap
// binds.
func TestZipfLengths(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 2))
	for _, mean := range []int{128, 256, 512} {
		alpha, _ := LlumnixAlpha(mean)
		z, err := NewZipf(mean, alpha, LlumnixMaxLen)
		if err != nil {
			t.Fatal(err)
		}
		uncapped, _ := NewZipf(mean, alpha, math.MaxInt32)
		// Rounding up adds at most one token on average to the asked mean.
		if m := uncapped.ExactMean(); m < float64(mean) || m > float64(mean)+1 {
			t.Errorf("mean %d: uncapped exact mean %.2f", mean, m)
		}
		exact := z.ExactMean()
		binds := uncapped.length(2*mean-1) > LlumnixMaxLen
		if exact > uncapped.ExactMean() || binds && exact == uncapped.ExactMean() || exact < 0.8*float64(mean) {
			t.Errorf("mean %d: capped mean %.2f, uncapped %.2f", mean, exact, uncapped.ExactMean())
		}
		// P(rank 1) = 1 / Σ k^−α over the 2·mean−1 ranks.
		h := 0.0
		for k := 1; k < 2*mean; k++ {
			h += math.Pow(float64(k), -alpha)
		}
		const n = 400000
		sum, shortest, capped := 0.0, 0, 0
		short := z.length(1)
		for range n {
			x := z.Sample(r)
			if x < 1 || x > LlumnixMaxLen {
				t.Fatalf("mean %d: length %d outside [1, %d]", mean, x, LlumnixMaxLen)
			}
			sum += float64(x)
			if x == short {
				shortest++
			}
			if x == LlumnixMaxLen {
				capped++
			}
		}
		if got := sum / n; math.Abs(got-exact)/exact > 0.03 {
			t.Errorf("mean %d: sampled mean %.1f, exact %.1f", mean, got, exact)
		}
		if got, want := float64(shortest)/n, 1/h; math.Abs(got-want) > 0.01 {
			t.Errorf("mean %d: P(shortest length %d) sampled %.3f, Zipf %.3f", mean, short, got, want)
		}
		if binds != (capped > 0) {
			t.Errorf("mean %d: %d of %d draws at the cap, longest uncapped length %d", mean, capped, n, uncapped.length(2*mean-1))
		}
	}
}

func TestLlumnixTraceNames(t *testing.T) {
	for _, name := range LlumnixTraces {
		tr, err := LlumnixTrace(name)
		if err != nil {
			t.Fatal(err)
		}
		if tr.PromptZipf == nil || tr.OutputZipf == nil {
			t.Fatalf("%s: no zipf lengths", name)
		}
	}
	tr, _ := LlumnixTrace("128-512")
	if tr.PromptZipf.Mean != 128 || tr.OutputZipf.Mean != 512 || tr.OutputZipf.Alpha != 1.15 {
		t.Fatalf("128-512: prompt %+v, output %+v", tr.PromptZipf, tr.OutputZipf)
	}
	for _, bad := range []string{"", "128", "128-", "100-100", "256x256", "256-256-256"} {
		if _, err := LlumnixTrace(bad); err == nil {
			t.Errorf("trace %q accepted", bad)
		}
	}
	if _, err := NewZipf(0, 1.5, 10); err == nil {
		t.Error("mean 0 accepted")
	}
}

// TestGenerateRequestCount: a run of Requests arrivals has exactly that
// many, the same for the same seed, and Gamma gaps of the asked CV.
func TestGenerateRequestCount(t *testing.T) {
	tr, err := LlumnixTrace("256-256")
	if err != nil {
		t.Fatal(err)
	}
	for _, cv := range []float64{0, 4} {
		c := Config{Seed: 3, Rate: 8, Requests: 10000, CV: cv, Trace: tr}
		a, err := GenerateLazy(c)
		if err != nil {
			t.Fatal(err)
		}
		if len(a) != 10000 {
			t.Fatalf("CV %g: %d arrivals, want 10000", cv, len(a))
		}
		b, _ := GenerateLazy(c)
		for i := range a {
			if a[i].At != b[i].At || a[i].PromptLen() != b[i].PromptLen() || a[i].Output != b[i].Output {
				t.Fatalf("CV %g: arrival %d differs between two runs of one seed", cv, i)
			}
		}
		c.Seed = 4
		if d, _ := GenerateLazy(c); reflect.DeepEqual(a[0].At, d[0].At) && a[0].Output == d[0].Output && a[1].At == d[1].At {
			t.Fatalf("CV %g: seeds 3 and 4 gave the same arrivals", cv)
		}
		var gaps []float64
		prompt, output := 0.0, 0.0
		for i := range a {
			prompt += float64(a[i].PromptLen())
			output += float64(a[i].Output)
			if i > 0 {
				gaps = append(gaps, (a[i].At - a[i-1].At).Seconds())
			}
		}
		m, v := 0.0, 0.0
		for _, g := range gaps {
			m += g
		}
		m /= float64(len(gaps))
		for _, g := range gaps {
			v += (g - m) * (g - m)
		}
		got := math.Sqrt(v/float64(len(gaps))) / m
		want := max(cv, 1)
		if math.Abs(m-1.0/8)/(1.0/8) > 0.1 || math.Abs(got-want)/want > 0.2 {
			t.Errorf("CV %g: mean gap %.4f s (want 0.125), CV %.2f", cv, m, got)
		}
		for _, x := range []struct {
			name      string
			got, want float64
		}{{"prompt", prompt / 10000, tr.MeanPrompt()}, {"output", output / 10000, tr.MeanOutput()}} {
			if math.Abs(x.got-x.want)/x.want > 0.08 {
				t.Errorf("CV %g: mean %s %.1f, trace %.1f", cv, x.name, x.got, x.want)
			}
		}
	}
	if _, err := GenerateLazy(Config{Seed: 1, Rate: 8, Requests: -1, Trace: tr}); err == nil {
		t.Error("a negative request count was accepted")
	}
}
