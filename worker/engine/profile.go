package engine

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"
)

// Profile is the GPU and model a worker emulates: how long a step takes as a
// function of its shape, how big the KV cache and weights are, how fast bytes
// move. Values and their sources are in docs/calibration.md (vLLM on
// H100/H200, PCIe Gen5).
type Profile struct {
	Name  string
	Model string
	GPU   string
	// KV cache: bf16, 2 × layers × kv_heads × head_dim × 2 bytes per token.
	Layers, KVHeads, HeadDim int
	WeightBytes              int64
	GPUMemBytes              int64
	MaxContext               int
	// A decode step over B sequences takes DecodeBaseMs + DecodePerSeqMs·B
	// (weights read once, each sequence's KV read); verifying K drafts per
	// sequence in the same fused pass adds VerifyPerPosMs·B·K (the extra
	// positions' FLOPs: 2 × parameters / tensor throughput). See Step.
	DecodeBaseMs, DecodePerSeqMs, VerifyPerPosMs float64
	// DecodeContext, when set, makes a decode step grow with the context
	// its rows read: each row costs the KV read of its own context at
	// HBMBytesPerSec, where DecodePerSeqMs is what a row of
	// DecodeRefContext tokens costs (docs/calibration.md, "Step times").
	// Off, every row costs DecodePerSeqMs whatever its length: the
	// profiles' default, which the benchmark setups' figures were measured
	// with.
	DecodeContext bool
	// HBMBytesPerSec is the GPU's memory bandwidth (the datasheet's).
	HBMBytesPerSec float64
	// DecodeRefContext is the context, in tokens per row, at which
	// DecodePerSeqMs holds: with DecodeContext a row of that length costs
	// exactly DecodePerSeqMs.
	DecodeRefContext int
	// Prefill tokens run at this rate, on top of the step's base time.
	PrefillTokensPerSec float64
	H2DBytesPerSec      float64 // pinned host → GPU
	D2HBytesPerSec      float64 // GPU → pinned host
	DiskBytesPerSec     float64 // weights from the page cache
	EngineInit          time.Duration
	// A replacement node's reload (Reload cold): the weights read from
	// cold storage at ColdDiskBytesPerSec, the engine initialised with
	// cold compilation caches in ColdEngineInit (0: EngineInit).
	ColdDiskBytesPerSec float64
	ColdEngineInit      time.Duration
	// InterconnectBytesPerSec is the KV copy between two instances (live
	// migration); 0 takes DefaultInterconnectBytesPerSec.
	InterconnectBytesPerSec float64
}

// DefaultInterconnectBytesPerSec is a KV copy between GPUs of two instances
// at 25 GB/s (one 200 Gb/s link between nodes: docs/calibration.md,
// "Transfers and model loads").
const DefaultInterconnectBytesPerSec = 25e9

// KVBytesPerToken is bf16 K and V over every layer.
func (p Profile) KVBytesPerToken() int64 { return int64(2 * p.Layers * p.KVHeads * p.HeadDim * 2) }

// KVPages is how many 16-token pages fit in 90% of GPU memory after weights.
func (p Profile) KVPages() int {
	free := int64(float64(p.GPUMemBytes)*0.9) - p.WeightBytes
	return int(free / (p.KVBytesPerToken() * PageTokens))
}

// SaturatedRate is a worker's modelled saturated throughput in requests
// per second: each request costs its prefill plus its share of the decode
// steps of a full batch, the batch being the smaller of the running cap and
// what the KV cache holds at the mean context. The recovery benchmark and
// the simulator calibrate their load against it.
func (p Profile) SaturatedRate(maxRunning int, meanPrompt, meanOutput float64) (perWorker float64, batch int) {
	ctxPages := (meanPrompt + meanOutput/2) / PageTokens
	batch = min(maxRunning, int(float64(p.KVPages())/(ctxPages+1)))
	step := p.StepTime(batch, 0).Seconds()
	perReq := meanPrompt/p.PrefillTokensPerSec + meanOutput*step/float64(batch)
	return 1 / perReq, batch
}

// StepShape is what one engine step costs on a GPU: Rows decoding rows,
// each verifying K drafts in the fused pass (rows without drafts padded to
// K), Prefill prefill tokens, and Context, the KV positions the decoding
// rows attend to, summed over them (each row's cached positions and its
// new ones). Context counts only with Profile.DecodeContext.
type StepShape struct {
	Rows, K, Prefill int
	Context          int
}

// BatchStep is the shape of a batch whose i-th chunk's sequence holds
// cached(i) positions before the step: BatchShape, and the context its
// decoding rows read. The pacer and the simulator both take a step's
// shape from it.
func BatchStep(batch []Chunk, cached func(i int) int) StepShape {
	var s StepShape
	s.Rows, s.K, s.Prefill = BatchShape(batch)
	for i, ch := range batch {
		if ch.Sample > 1 || len(ch.Tokens) == 1 {
			s.Context += cached(i) + len(ch.Tokens)
		}
	}
	return s
}

// Step is the emulated time of one engine step of shape s:
//
//	DecodeBaseMs + DecodePerSeqMs·Rows + VerifyPerPosMs·Rows·K + Prefill / PrefillTokensPerSec
//
// and with DecodeContext each row's share of DecodePerSeqMs is its own KV
// read, (Context − Rows·DecodeRefContext) × KV bytes per token /
// HBMBytesPerSec more: the step is the weights' read (in DecodeBaseMs)
// plus every row's context over the memory bandwidth, plus the fixed and
// per-row overheads (a profile without HBMBytesPerSec has no such mode).
// A verification reads each row's KV once whatever K. Every step time of
// the pacer and the simulator comes from here.
func (p Profile) Step(s StepShape) time.Duration {
	// The order of the sums is the one the figures were measured with:
	// the verification's term is added to the rounded step.
	ms := p.DecodeBaseMs + p.DecodePerSeqMs*float64(s.Rows)
	if s.Prefill > 0 {
		ms += float64(s.Prefill) / p.PrefillTokensPerSec * 1000
	}
	if p.DecodeContext && s.Rows > 0 && p.HBMBytesPerSec > 0 {
		ms += p.contextReadMs(s.Context - s.Rows*p.DecodeRefContext)
	}
	d := time.Duration(ms * float64(time.Millisecond))
	if s.K > 0 {
		d += time.Duration(p.VerifyPerPosMs * float64(s.Rows*s.K) * float64(time.Millisecond))
	}
	return d
}

// Slowed is the profile with every engine step f times as long (f > 0):
// the decode line, the verification, the prefill rate and the context's
// read all scale, so Step of any shape is f times p's (to the
// nanosecond's rounding). KV imports and model loads keep their times.
// A what-if for the simulator (lumen sim -step-scale): how much a few
// percent of a step, as the real processes' host adds between steps,
// move the figures at a given load.
func (p Profile) Slowed(f float64) Profile {
	p.DecodeBaseMs *= f
	p.DecodePerSeqMs *= f
	p.VerifyPerPosMs *= f
	p.PrefillTokensPerSec /= f
	if p.HBMBytesPerSec > 0 {
		p.HBMBytesPerSec /= f
	}
	return p
}

// contextReadMs is the time to read tokens positions of KV from HBM.
func (p Profile) contextReadMs(tokens int) float64 {
	return float64(tokens) * float64(p.KVBytesPerToken()) / p.HBMBytesPerSec * 1000
}

// WeightReadMs is the time to read the weights from HBM once, the floor
// of a memory-bound decode step (DecodeBaseMs holds it and the fixed
// launch overhead).
func (p Profile) WeightReadMs() float64 { return float64(p.WeightBytes) / p.HBMBytesPerSec * 1000 }

// StepTime is Step of decodeRows rows at the reference context (what a
// caller that does not know the rows' lengths assumes: the profile's
// fitted line) and prefillTokens tokens prefilled.
func (p Profile) StepTime(decodeRows, prefillTokens int) time.Duration {
	return p.StepTimeK(decodeRows, 0, prefillTokens)
}

// StepTimeK is Step of a fused verification at the reference context:
// rows decoding sequences, each at K+1 positions (rows without drafts
// padded), plus prefillTokens. The weights are read once whatever K: a
// memory-bound step at small batch grows little with K (B = 8, K = 4 on
// Qwen3-14B/H100: 14.1 ms against 12.5), a large batch much more (B = 128:
// 52 ms against 26), where drafting pays only with high acceptance.
func (p Profile) StepTimeK(rows, k, prefillTokens int) time.Duration {
	return p.Step(StepShape{Rows: rows, K: k, Prefill: prefillTokens, Context: rows * p.DecodeRefContext})
}

// ImportTime is the host-to-GPU copy of n KV pages.
func (p Profile) ImportTime(n int) time.Duration {
	b := float64(int64(n) * PageTokens * p.KVBytesPerToken())
	return time.Duration(b / p.H2DBytesPerSec * float64(time.Second))
}

// MigrationTime is the copy of n KV pages to another instance.
func (p Profile) MigrationTime(n int) time.Duration {
	bw := p.InterconnectBytesPerSec
	if bw == 0 {
		bw = DefaultInterconnectBytesPerSec
	}
	return time.Duration(float64(int64(n)*PageTokens*p.KVBytesPerToken()) / bw * float64(time.Second))
}

// LoadTime is weights from disk into host memory, then host to GPU, then
// engine initialisation.
func (p Profile) LoadTime() time.Duration {
	s := float64(p.WeightBytes)/p.DiskBytesPerSec + float64(p.WeightBytes)/p.H2DBytesPerSec
	return time.Duration(s*float64(time.Second)) + p.EngineInit
}

// Profiles are the built-in profiles by name.
var Profiles = map[string]Profile{
	"qwen3-14b-h100": {Name: "qwen3-14b-h100", Model: "Qwen3-14B", GPU: "NVIDIA H100 80GB HBM3",
		Layers: 40, KVHeads: 8, HeadDim: 128, WeightBytes: 29.5e9, GPUMemBytes: 80e9, MaxContext: 32768,
		DecodeBaseMs: 11.6, DecodePerSeqMs: 0.114, VerifyPerPosMs: 0.05, PrefillTokensPerSec: 20000,
		HBMBytesPerSec: 3.35e12, DecodeRefContext: DecodeRefContext,
		H2DBytesPerSec: 35e9, D2HBytesPerSec: 50e9, DiskBytesPerSec: 3.8e9, EngineInit: 15 * time.Second,
		ColdDiskBytesPerSec: ColdDiskBytesPerSec, ColdEngineInit: ColdEngineInit},
	"qwen3-32b-h100": {Name: "qwen3-32b-h100", Model: "Qwen3-32B", GPU: "NVIDIA H100 80GB HBM3",
		Layers: 64, KVHeads: 8, HeadDim: 128, WeightBytes: 65.5e9, GPUMemBytes: 80e9, MaxContext: 32768,
		DecodeBaseMs: 23.83, DecodePerSeqMs: 0.1714, VerifyPerPosMs: 0.10, PrefillTokensPerSec: 10000,
		HBMBytesPerSec: 3.35e12, DecodeRefContext: DecodeRefContext,
		H2DBytesPerSec: 35e9, D2HBytesPerSec: 50e9, DiskBytesPerSec: 3.8e9, EngineInit: 15 * time.Second,
		ColdDiskBytesPerSec: ColdDiskBytesPerSec, ColdEngineInit: ColdEngineInit},
	// Qwen3-32B over two H100s, tensor parallel 2 (llm-d's prefix-cache
	// benchmark pod, docs/calibration.md): the weights and the KV cache
	// split over both GPUs, the bandwidth and the FLOP/s doubled. Decode
	// reads half the weights per GPU, 65.5 GB / 6.7 TB/s = 9.8 ms, plus
	// the one-GPU profile's 4.2 ms of overhead and 2 ms of all-reduces
	// (two per layer); a row costs half the one-GPU row; prefill is two
	// GPUs at 640 TFLOP/s over 2 × 32.8e9 FLOPs a token.
	"qwen3-32b-2xh100": {Name: "qwen3-32b-2xh100", Model: "Qwen3-32B", GPU: "2 × NVIDIA H100 80GB HBM3 (TP 2)",
		Layers: 64, KVHeads: 8, HeadDim: 128, WeightBytes: 65.5e9, GPUMemBytes: 160e9, MaxContext: 32768,
		DecodeBaseMs: 16.0, DecodePerSeqMs: 0.0857, VerifyPerPosMs: 0.05, PrefillTokensPerSec: 19500,
		HBMBytesPerSec: 6.7e12, DecodeRefContext: DecodeRefContext,
		H2DBytesPerSec: 70e9, D2HBytesPerSec: 100e9, DiskBytesPerSec: 3.8e9, EngineInit: 15 * time.Second,
		ColdDiskBytesPerSec: ColdDiskBytesPerSec, ColdEngineInit: ColdEngineInit},
	// H200: decode is memory-bound, 4.8 / 3.35 TB/s ≈ 1.43× faster; prefill is
	// compute-bound and unchanged.
	"qwen3-14b-h200": {Name: "qwen3-14b-h200", Model: "Qwen3-14B", GPU: "NVIDIA H200 141GB HBM3e",
		Layers: 40, KVHeads: 8, HeadDim: 128, WeightBytes: 29.5e9, GPUMemBytes: 141e9, MaxContext: 32768,
		DecodeBaseMs: 11.6 / 1.43, DecodePerSeqMs: 0.114 / 1.43, VerifyPerPosMs: 0.05, PrefillTokensPerSec: 20000,
		HBMBytesPerSec: 4.8e12, DecodeRefContext: DecodeRefContext,
		H2DBytesPerSec: 35e9, D2HBytesPerSec: 50e9, DiskBytesPerSec: 3.8e9, EngineInit: 15 * time.Second,
		ColdDiskBytesPerSec: ColdDiskBytesPerSec, ColdEngineInit: ColdEngineInit},
	// The draft: 1.2 GB of weights read per step (0.36 ms at 3.35 TB/s)
	// plus launch overheads. It loads in well under a second from the page
	// cache (docs/calibration.md); its engine init (a small model's CUDA graphs
	// and memory profiling, in a process whose CUDA context is up) is taken
	// as 1 s. Its step is launch-bound, not memory-bound: it has no
	// context-dependent mode (DecodeRefContext 0), and a cold reload reads
	// its weights from cold storage but keeps its 1 s initialisation
	// (docs/calibration.md, "Transfers and model loads").
	"qwen3-0.6b-h100": {Name: "qwen3-0.6b-h100", Model: "Qwen3-0.6B", GPU: "NVIDIA H100 80GB HBM3",
		Layers: 28, KVHeads: 8, HeadDim: 128, WeightBytes: 1.2e9, GPUMemBytes: 80e9, MaxContext: 32768,
		DecodeBaseMs: 1.8, DecodePerSeqMs: 0.02, VerifyPerPosMs: 0.002, PrefillTokensPerSec: 150000,
		HBMBytesPerSec: 3.35e12,
		H2DBytesPerSec: 35e9, D2HBytesPerSec: 50e9, DiskBytesPerSec: 3.8e9, EngineInit: 1 * time.Second,
		ColdDiskBytesPerSec: ColdDiskBytesPerSec},
	// Llumnix's instance, LLaMA-7B on an A10 (llama.go): the simulator's
	// figure llumnix, and paced workers on the same numbers.
	"llama-7b-a10": LlamaA10,
}

// LookupProfile returns a profile by name; "none" returns false with no error.
func LookupProfile(name string) (Profile, bool, error) {
	if name == "none" || name == "" {
		return Profile{}, false, nil
	}
	p, ok := Profiles[name]
	if !ok {
		names := make([]string, 0, len(Profiles))
		for n := range Profiles {
			names = append(names, n)
		}
		sort.Strings(names)
		return Profile{}, false, fmt.Errorf("%w: unknown profile %q: use none or one of %s", ErrBadInput, name, strings.Join(names, ", "))
	}
	return p, true, nil
}

// StepStats records emulated and actual step times.
type StepStats struct {
	Steps    int
	Emulated time.Duration // sum of the profile's times (scaled)
	Actual   time.Duration // sum of the wall times
}

// Paced makes an engine take the time its profile says: after each call it
// waits out the difference between the emulated time (scaled by Scale) and
// the time the call really took.
type Paced struct {
	Engine
	Profile Profile
	Scale   float64 // 1 = real time; 0.1 = ten times faster

	mu    sync.Mutex // guards stats and debt
	stats StepStats
	// debt is how far the past steps ran over their emulated time (timers
	// wake late); the next wait is shortened by it, so a worker's emulated
	// time does not drift. Capped at one step.
	debt time.Duration
	// Sleep is the clock's wait (time.Sleep by default).
	Sleep func(time.Duration)
}

// NewPaced wraps e.
func NewPaced(e Engine, p Profile, scale float64) *Paced {
	return &Paced{Engine: e, Profile: p, Scale: scale, Sleep: time.Sleep}
}

func (p *Paced) pace(start time.Time, emulated time.Duration) {
	emulated = time.Duration(float64(emulated) * p.Scale)
	p.mu.Lock()
	debt := p.debt
	p.mu.Unlock()
	if wait := emulated - time.Since(start) - debt; wait > 0 {
		p.Sleep(wait)
	}
	actual := time.Since(start)
	p.mu.Lock()
	p.debt = min(max(p.debt+actual-emulated, 0), emulated)
	p.stats.Steps++
	p.stats.Emulated += emulated
	p.stats.Actual += actual
	p.mu.Unlock()
}

// Forward runs the batch and waits out its emulated time, Profile.Step of
// its shape (BatchStep).
func (p *Paced) Forward(ctx context.Context, batch []Chunk) ([][]int32, error) {
	start := time.Now()
	// The context each row reads is what its sequence held before the
	// step (Forward appends to it); only DecodeContext charges it.
	cached := func(int) int { return 0 }
	if p.Profile.DecodeContext {
		cached = func(i int) int { return p.Engine.Len(batch[i].Seq) }
	}
	shape := BatchStep(batch, cached)
	out, err := p.Engine.Forward(ctx, batch)
	if err != nil {
		return out, err
	}
	p.pace(start, p.Profile.Step(shape))
	return out, nil
}

// ImportPages imports the pages and waits out their host-to-GPU copy at the
// profile's bandwidth: a restore is not free, only cheaper than prefill.
func (p *Paced) ImportPages(seq SeqID, pages [][]byte) error {
	start := time.Now()
	if err := p.Engine.ImportPages(seq, pages); err != nil {
		return err
	}
	p.pace(start, p.Profile.ImportTime(len(pages)))
	return nil
}

// Load loads the weights and waits out the profile's load time.
func (p *Paced) Load(ctx context.Context) error {
	start := time.Now()
	if err := p.Engine.Load(ctx); err != nil {
		return err
	}
	wait := time.Duration(float64(p.Profile.LoadTime())*p.Scale) - time.Since(start)
	if wait <= 0 {
		return nil
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// BatchShape is what a batch costs on a GPU: decoding rows, the widest
// verification (drafts per row; every row is padded to it in the fused
// pass) and prefill tokens.
func BatchShape(batch []Chunk) (rows, k, prefill int) {
	for _, ch := range batch {
		switch {
		case ch.Sample > 1:
			rows++
			k = max(k, ch.Sample-1)
		case len(ch.Tokens) == 1:
			rows++
		default:
			prefill += len(ch.Tokens)
		}
	}
	return rows, k, prefill
}

// Stats returns the step statistics so far.
func (p *Paced) Stats() StepStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stats
}
