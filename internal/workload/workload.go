// Package workload generates seeded request streams shaped like public LLM
// traces, for benchmarks and fault-injection runs.
//
// No trace file ships with lumen (nothing is downloaded at run time), so a
// trace is described by its quantiles (docs/calibration.md, "Workloads") and sampled through a
// piecewise-linear quantile function whose knots reproduce the published
// mean, median, p90 and p99.
package workload

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"time"
)

// Knot is one point (p, value) of a quantile function.
type Knot struct{ P, V float64 }

// Dist is a distribution given by its quantile function: knots at
// increasing p from 0 to 1, joined linearly.
type Dist []Knot

// Quantile returns the value at probability p in [0, 1].
func (d Dist) Quantile(p float64) float64 {
	i := sort.Search(len(d), func(i int) bool { return d[i].P >= p })
	switch {
	case i == 0:
		return d[0].V
	case i == len(d):
		return d[len(d)-1].V
	}
	a, b := d[i-1], d[i]
	return a.V + (b.V-a.V)*(p-a.P)/(b.P-a.P)
}

// Mean is the distribution's exact mean (the integral of the quantile
// function).
func (d Dist) Mean() float64 {
	m := 0.0
	for i := 1; i < len(d); i++ {
		m += (d[i].P - d[i-1].P) * (d[i].V + d[i-1].V) / 2
	}
	return m
}

// Sample draws one value, rounded to a whole token, at least 1.
func (d Dist) Sample(r *rand.Rand) int {
	return max(1, int(math.Round(d.Quantile(r.Float64()))))
}

// Trace is a request-length shape.
type Trace struct {
	Name           string
	Prompt, Output Dist
	// Published figures the knots reproduce: mean, median, p90, p99.
	PromptStats, OutputStats [4]float64
	// PromptZipf and OutputZipf, when set, replace Prompt and Output
	// (Llumnix's generated traces, LlumnixTrace).
	PromptZipf, OutputZipf *Zipf
}

// samplePrompt and sampleOutput draw a length, each with one Float64 of r.
func (t *Trace) samplePrompt(r *rand.Rand) int {
	if t.PromptZipf != nil {
		return t.PromptZipf.Sample(r)
	}
	return t.Prompt.Sample(r)
}

func (t *Trace) sampleOutput(r *rand.Rand) int {
	if t.OutputZipf != nil {
		return t.OutputZipf.Sample(r)
	}
	return t.Output.Sample(r)
}

// MeanPrompt and MeanOutput are the trace's exact mean lengths.
func (t *Trace) MeanPrompt() float64 {
	if t.PromptZipf != nil {
		return t.PromptZipf.ExactMean()
	}
	return t.Prompt.Mean()
}

func (t *Trace) MeanOutput() float64 {
	if t.OutputZipf != nil {
		return t.OutputZipf.ExactMean()
	}
	return t.Output.Mean()
}

// AzureConversation is the Azure LLM inference trace 2023, conversation:
// prompt tokens mean 1155, median 1020, p90 2734, p99 4142; output tokens
// mean 211, median 129, p90 424, p99 601. Both are heavy at the short end
// (the mean sits close to the median while p90 is 2.7× and 3.3× it), so the
// lower knots fall steeply.
var AzureConversation = Trace{
	Name: "azure-2023-conversation",
	Prompt: Dist{{0, 8}, {0.2, 60}, {0.3, 200}, {0.4, 750}, {0.5, 1020}, {0.75, 1500},
		{0.9, 2734}, {0.99, 4142}, {1, 6000}},
	Output:      Dist{{0, 4}, {0.25, 70}, {0.5, 129}, {0.75, 380}, {0.9, 424}, {0.99, 601}, {1, 900}},
	PromptStats: [4]float64{1155, 1020, 2734, 4142},
	OutputStats: [4]float64{211, 129, 424, 601},
}

// Request is one arrival.
type Request struct {
	At     time.Duration // offset from the start of the run
	Prompt []int32       // token ids; nil for a lazy request (PromptLen, AppendPrompt)
	Output int           // tokens to generate (max_tokens)
	// Priority is the request's priority (the API's priority: lower is
	// more urgent, 0 the default); MarkHighPriority sets it.
	Priority int32

	// A lazy request (Lazy, GenerateLazy) keeps its prompt's length and
	// the generator's state before its first token instead of the ids.
	n      int
	hi, lo uint64
	tok    func(uint32) int32
	// drawn: tok is GenerateLazy's default, 32 + (x>>1)%95, computed
	// inline by AppendPrompt (a call a token was most of its cost).
	drawn bool
}

// Lazy returns a request whose prompt is n tokens, each tok of the next
// Uint32 of a rand.Rand over src, without keeping them: it saves src's
// state and advances src past the n draws, as drawing them would.
// AppendPrompt draws them again, the same ones, when they are needed.
func Lazy(at time.Duration, n, output int, src *rand.PCG, tok func(uint32) int32) Request {
	b, err := src.MarshalBinary()
	if err != nil || len(b) != 20 {
		panic(fmt.Sprintf("workload: PCG state: %v (%d bytes)", err, len(b)))
	}
	r := Request{At: at, Output: output, n: n, hi: binary.BigEndian.Uint64(b[4:]), lo: binary.BigEndian.Uint64(b[12:]), tok: tok}
	for range n {
		src.Uint64()
	}
	return r
}

// PromptLen is the prompt's length in tokens.
func (r *Request) PromptLen() int {
	if r.tok == nil {
		return len(r.Prompt)
	}
	return r.n
}

// AppendPrompt appends the prompt's token ids to dst: Prompt, or for a
// lazy request the ids drawn again from the saved state.
func (r *Request) AppendPrompt(dst []int32) []int32 {
	if r.tok == nil {
		return append(dst, r.Prompt...)
	}
	var b [20]byte
	copy(b[:], "pcg:")
	binary.BigEndian.PutUint64(b[4:], r.hi)
	binary.BigEndian.PutUint64(b[12:], r.lo)
	var src rand.PCG
	if err := src.UnmarshalBinary(b[:]); err != nil {
		panic(err)
	}
	dst = slices.Grow(dst, r.n)
	if r.drawn {
		for range r.n {
			dst = append(dst, defaultDraw(uint32(src.Uint64()>>32)))
		}
		return dst
	}
	for range r.n {
		// rand.Rand.Uint32 of the PCG, without the interface call.
		dst = append(dst, r.tok(uint32(src.Uint64()>>32)))
	}
	return dst
}

// defaultDraw is GenerateLazy's token of a draw x without Config.Tokens:
// the default token function of x >> 1.
func defaultDraw(x uint32) int32 { return 32 + int32((x>>1)%95) }

// Materialize returns r with its prompt's ids in Prompt.
func (r Request) Materialize() Request {
	if r.tok == nil {
		return r
	}
	p := r.AppendPrompt(make([]int32, 0, r.n))
	return Request{At: r.At, Prompt: p, Output: r.Output}
}

// Config describes a run's arrivals.
type Config struct {
	Seed     uint64
	Rate     float64       // mean arrivals per second
	Duration time.Duration // arrivals in [0, Duration)
	// Requests, when > 0, is the run's size instead of Duration: exactly
	// that many arrivals, however long they take (Llumnix's runs are
	// 10,000 requests).
	Requests int
	// CV is the coefficient of variation of the gaps between arrivals: 0
	// (or 1) is a Poisson process, exponential gaps; any other value draws
	// the gaps from a Gamma distribution of shape 1/CV² and mean 1/Rate,
	// bursty above 1 (Llumnix's burst experiments use CV = 2 to 8, with
	// Gamma arrivals). Poisson runs draw exactly what they drew before CV
	// existed.
	CV    float64
	Trace Trace
	// Tokens maps a draw in [0, 1<<31) to a prompt token id; default:
	// printable ASCII (32..126), which every lumen engine accepts.
	Tokens func(uint32) int32
}

// Generate returns the arrivals, sorted by time. The same config gives the
// same requests, byte for byte.
func Generate(c Config) ([]Request, error) {
	reqs, err := GenerateLazy(c)
	for i := range reqs {
		reqs[i] = reqs[i].Materialize()
	}
	return reqs, err
}

// GenerateLazy returns Generate's arrivals as lazy requests (Lazy): the
// same times, lengths and prompt ids (AppendPrompt), without holding the
// ids — a few tens of bytes a request.
func GenerateLazy(c Config) ([]Request, error) {
	if c.Rate <= 0 || c.Requests < 0 || c.Requests == 0 && c.Duration <= 0 {
		return nil, fmt.Errorf("workload: rate (%g/s) and duration (%s) or request count (%d) must be positive", c.Rate, c.Duration, c.Requests)
	}
	if c.CV < 0 || math.IsNaN(c.CV) || math.IsInf(c.CV, 0) {
		return nil, fmt.Errorf("workload: the arrivals' CV (%g) must be a finite number >= 0", c.CV)
	}
	if (len(c.Trace.Prompt) < 2 && c.Trace.PromptZipf == nil) || (len(c.Trace.Output) < 2 && c.Trace.OutputZipf == nil) {
		return nil, fmt.Errorf("workload: trace %q has no length distributions", c.Trace.Name)
	}
	tok := c.Tokens
	if tok == nil {
		tok = func(x uint32) int32 { return 32 + int32(x%95) }
	}
	draw := func(x uint32) int32 { return tok(x >> 1) }
	if c.Tokens == nil {
		draw = defaultDraw
	}
	src := rand.NewPCG(c.Seed, 0x6c756d656e)
	r := rand.New(src)
	gap := func() float64 { return r.ExpFloat64() / c.Rate }
	if c.CV != 0 && c.CV != 1 {
		shape := 1 / (c.CV * c.CV)
		gap = func() float64 { return Gamma(r, shape) / (shape * c.Rate) }
	}
	var out []Request
	t := 0.0
	for {
		t += gap()
		at := time.Duration(t * float64(time.Second))
		if c.Requests > 0 && len(out) == c.Requests || c.Requests == 0 && at >= c.Duration {
			return out, nil
		}
		n := c.Trace.samplePrompt(r)
		req := Lazy(at, n, 0, src, draw)
		req.drawn = c.Tokens == nil
		req.Output = c.Trace.sampleOutput(r)
		out = append(out, req)
	}
}

// Gamma draws from the Gamma distribution of the given shape and scale 1
// (mean shape, variance shape): Marsaglia and Tsang's method, with
// Gamma(k) = Gamma(k+1)·U^(1/k) for a shape k below 1.
func Gamma(r *rand.Rand, shape float64) float64 {
	if shape < 1 {
		return Gamma(r, shape+1) * math.Pow(r.Float64(), 1/shape)
	}
	d := shape - 1.0/3
	c := 1 / math.Sqrt(9*d)
	for {
		x := r.NormFloat64()
		v := 1 + c*x
		if v <= 0 {
			continue
		}
		v = v * v * v
		u := r.Float64()
		if u < 1-0.0331*x*x*x*x || math.Log(u) < 0.5*x*x+d*(1-v+math.Log(v)) {
			return d * v
		}
	}
}

// HighPriorityValue is the priority MarkHighPriority gives a request: the
// API's priority -1, more urgent than the default 0.
const HighPriorityValue = -1

// MarkHighPriority gives each request, independently with probability
// fraction, priority HighPriorityValue (Llumnix's priority experiment:
// 10% of the requests), and the rest priority 0. The draws come from a
// stream of their own (seed, and a constant of this function's), so the
// arrivals and lengths are those of the unmarked run whatever the fraction,
// and the same seed marks the same requests.
func MarkHighPriority(reqs []Request, fraction float64, seed uint64) {
	src := rand.New(rand.NewPCG(seed, 0x7072696f72697479))
	for i := range reqs {
		reqs[i].Priority = 0
		if src.Float64() < fraction {
			reqs[i].Priority = HighPriorityValue
		}
	}
}
