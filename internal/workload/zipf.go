package workload

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
)

// Zipf is Llumnix's power-law length distribution (its benchmark's
// gen_random_response_lens, "zipf"): a rank k in [1, 2·Mean−1] drawn with
// probability ∝ k^−Alpha, times Mean / E[k] rounded up, capped at Cap.
// Llumnix rescales by the mean of the sample it drew; here the scale is
// the distribution's exact mean, so that a run's lengths do not depend on
// how many requests it has (docs/calibration.md, "Llumnix's workloads").
// Build one with NewZipf.
type Zipf struct {
	Mean  int
	Alpha float64
	Cap   int
	cdf   []float64 // cdf[k-1] = P(rank <= k)
	scale float64
}

// NewZipf returns the distribution of mean mean (before the cap), shape
// alpha, capped at cap tokens.
func NewZipf(mean int, alpha float64, cap int) (*Zipf, error) {
	if mean < 1 || cap < 1 || !(alpha > 0) || math.IsInf(alpha, 0) {
		return nil, fmt.Errorf("workload: zipf lengths need a mean >= 1 (%d), a finite alpha > 0 (%g) and a cap >= 1 (%d)", mean, alpha, cap)
	}
	n := max(2*mean-1, 1)
	z := &Zipf{Mean: mean, Alpha: alpha, Cap: cap, cdf: make([]float64, n)}
	sum, ksum := 0.0, 0.0
	for k := 1; k <= n; k++ {
		w := math.Pow(float64(k), -alpha)
		sum += w
		ksum += float64(k) * w
		z.cdf[k-1] = sum
	}
	for i := range z.cdf {
		z.cdf[i] /= sum
	}
	z.cdf[n-1] = 1
	z.scale = float64(mean) / (ksum / sum)
	return z, nil
}

// length is rank k's length in tokens.
func (z *Zipf) length(k int) int {
	return min(z.Cap, max(1, int(math.Ceil(float64(k)*z.scale))))
}

// Sample draws one length (one Float64 of r).
func (z *Zipf) Sample(r *rand.Rand) int {
	u := r.Float64()
	k := sort.SearchFloat64s(z.cdf, u) + 1 // the first rank whose cdf >= u
	return z.length(min(k, len(z.cdf)))
}

// ExactMean is the mean length, after the rounding and the cap.
func (z *Zipf) ExactMean() float64 {
	m, prev := 0.0, 0.0
	for i, c := range z.cdf {
		m += (c - prev) * float64(z.length(i+1))
		prev = c
	}
	return m
}

// LlumnixMaxLen is the cap of Llumnix's generated traces, prompt and
// output alike.
const LlumnixMaxLen = 6144

// LlumnixAlpha is the Zipf shape Llumnix's benchmark takes for a mean
// length with the 6,144 cap (1024: 1.0005, 512: 1.15, 256: 1.5, 128: 2.0);
// false for any other mean.
func LlumnixAlpha(mean int) (float64, bool) {
	switch mean {
	case 128:
		return 2.0, true
	case 256:
		return 1.5, true
	case 512:
		return 1.15, true
	case 1024:
		return 1.0005, true
	}
	return 0, false
}

// LlumnixTraces are the five generated traces of Llumnix's evaluation
// (OSDI'24, §6.1), "input-output" mean lengths.
var LlumnixTraces = []string{"128-128", "256-256", "512-512", "128-512", "512-128"}

// LlumnixTrace is a generated trace of Llumnix's: name "IN-OUT", the mean
// prompt and output lengths, each Zipf (LlumnixAlpha) capped at
// LlumnixMaxLen.
func LlumnixTrace(name string) (Trace, error) {
	in, out, ok := strings.Cut(name, "-")
	mi, err1 := strconv.Atoi(in)
	mo, err2 := strconv.Atoi(out)
	ai, ok1 := LlumnixAlpha(mi)
	ao, ok2 := LlumnixAlpha(mo)
	if !ok || err1 != nil || err2 != nil || !ok1 || !ok2 {
		return Trace{}, fmt.Errorf("workload: trace %q: want IN-OUT with mean lengths of 128, 256, 512 or 1024 (Llumnix's: %s)", name, strings.Join(LlumnixTraces, ", "))
	}
	p, err := NewZipf(mi, ai, LlumnixMaxLen)
	if err != nil {
		return Trace{}, err
	}
	o, err := NewZipf(mo, ao, LlumnixMaxLen)
	if err != nil {
		return Trace{}, err
	}
	return Trace{Name: "llumnix-zipf-" + name, PromptZipf: p, OutputZipf: o}, nil
}
