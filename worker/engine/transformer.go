package engine

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"sync"

	"github.com/lumen-project/lumen/tokenizer"
)

// TransformerConfig configures a Transformer.
type TransformerConfig struct {
	// Path is the safetensors file of the model.
	Path string
	// Pages is the KV cache size in pages of PageTokens tokens.
	Pages int
}

// Transformer is a decoder-only transformer in pure Go, float32, over a paged
// KV cache. One call computes one batch on the calling goroutine (one core).
type Transformer struct {
	cfg TransformerConfig

	mu   sync.Mutex // guards everything below
	w    *Weights
	mc   ModelConfig
	cos  []float32 // [max_context][head_dim/2]
	sin  []float32
	kv   []float32 // pages × layers × {K,V} × PageTokens × kvDim
	free []int32   // free page ids (a stack)
	seqs map[SeqID]*sequence
	buf  scratch
	// shared counts, for each page more than one sequence holds, its
	// holders (share.go); a page not in it has one.
	shared map[int32]int32
}

type sequence struct {
	pages []int32
	n     int // positions in the cache
}

// NewTransformer reads the model's config from its file (weights load with
// Load) and allocates the KV cache.
func NewTransformer(cfg TransformerConfig) (*Transformer, error) {
	w, err := LoadWeights(cfg.Path)
	if err != nil {
		return nil, err
	}
	if cfg.Pages <= 0 {
		return nil, fmt.Errorf("%w: KV cache pages must be > 0, got %d", ErrBadInput, cfg.Pages)
	}
	t := &Transformer{cfg: cfg, mc: w.Config, seqs: map[SeqID]*sequence{}}
	t.w = w
	t.initCache()
	return t, nil
}

func (t *Transformer) initCache() {
	c := t.mc
	t.kv = make([]float32, t.cfg.Pages*c.Layers*2*PageTokens*c.KVHeads*c.HeadDim)
	t.free = t.free[:0]
	for p := t.cfg.Pages - 1; p >= 0; p-- {
		t.free = append(t.free, int32(p))
	}
	half := c.HeadDim / 2
	t.cos = make([]float32, c.MaxContext*half)
	t.sin = make([]float32, c.MaxContext*half)
	for pos := 0; pos < c.MaxContext; pos++ {
		for i := 0; i < half; i++ {
			freq := 1 / math.Pow(c.RopeTheta, float64(2*i)/float64(c.HeadDim))
			a := float64(pos) * freq
			t.cos[pos*half+i] = float32(math.Cos(a))
			t.sin[pos*half+i] = float32(math.Sin(a))
		}
	}
}

// Info implements Engine.
func (t *Transformer) Info() Info {
	return Info{Backend: "transformer", Model: t.mc.Name, Vocab: t.mc.Vocab, MaxContext: t.mc.MaxContext,
		PageTokens: PageTokens, KVBytesPerToken: t.mc.KVBytesPerToken(), WeightBytes: t.mc.Params() * 4,
		TotalPages: t.cfg.Pages}
}

// Load implements Engine.
func (t *Transformer) Load(ctx context.Context) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.w != nil {
		return nil
	}
	w, err := LoadWeights(t.cfg.Path)
	if err != nil {
		return err
	}
	if w.Config != t.mc {
		return fmt.Errorf("%w: %s changed: model %s, expected %s", ErrBadWeights, t.cfg.Path, w.Config.Name, t.mc.Name)
	}
	t.w = w
	return nil
}

// Install loads weights already read into host memory (LoadWeights of this
// engine's file): the CPU engine's counterpart of the host-to-GPU copy, the
// second stage of a staged load (TransformerStages).
func (t *Transformer) Install(w *Weights) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if w.Config != t.mc {
		return fmt.Errorf("%w: weights of model %s, this engine runs %s", ErrBadWeights, w.Config.Name, t.mc.Name)
	}
	t.w = w
	return nil
}

// Path is the safetensors file the engine loads.
func (t *Transformer) Path() string { return t.cfg.Path }

// Unload implements Engine.
func (t *Transformer) Unload() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.w = nil
	t.seqs = map[SeqID]*sequence{}
	t.shared = nil
	t.free = t.free[:0]
	for p := t.cfg.Pages - 1; p >= 0; p-- {
		t.free = append(t.free, int32(p))
	}
}

// Loaded implements Engine.
func (t *Transformer) Loaded() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.w != nil
}

// FreePages implements Engine.
func (t *Transformer) FreePages() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.free)
}

// Len implements Engine.
func (t *Transformer) Len(seq SeqID) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := t.seqs[seq]; s != nil {
		return s.n
	}
	return 0
}

// Release implements Engine.
func (t *Transformer) Release(seq SeqID) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := t.seqs[seq]; s != nil {
		t.drop(s.pages)
		delete(t.seqs, seq)
	}
}

// Truncate implements Engine.
func (t *Transformer) Truncate(seq SeqID, n int) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.seqs[seq]
	if s == nil {
		return fmt.Errorf("%w: unknown sequence %d", ErrBadInput, seq)
	}
	if n < 0 || n > s.n {
		return fmt.Errorf("%w: truncate sequence %d of %d positions to %d", ErrBadInput, seq, s.n, n)
	}
	keep := (n + PageTokens - 1) / PageTokens
	if n%PageTokens != 0 && t.shared[s.pages[keep-1]] > 1 {
		// The kept page is partial and shared: the positions the
		// sequence writes next are its own (copy on write).
		if len(t.free) == 0 {
			return ErrOutOfPages
		}
		t.copyOnWrite(s, keep-1)
	}
	t.drop(s.pages[keep:])
	s.pages, s.n = s.pages[:keep], n
	return nil
}

func (t *Transformer) pageFloats() int { return PageTokens * t.mc.KVHeads * t.mc.HeadDim }

// kvAt returns the K (v=0) or V (v=1) slice of a page for a layer.
func (t *Transformer) kvAt(page int32, layer, v int) []float32 {
	pf := t.pageFloats()
	off := ((int(page)*t.mc.Layers+layer)*2 + v) * pf
	return t.kv[off : off+pf]
}

// ExportPage implements Engine: per layer, the page's K then V, float32
// little-endian.
func (t *Transformer) ExportPage(seq SeqID, i int) ([]byte, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.seqs[seq]
	if s == nil || i < 0 || (i+1)*PageTokens > s.n {
		return nil, fmt.Errorf("%w: sequence %d has no full page %d", ErrBadInput, seq, i)
	}
	out := make([]byte, 0, PageTokens*int(t.mc.KVBytesPerToken()))
	for l := 0; l < t.mc.Layers; l++ {
		for v := 0; v < 2; v++ {
			for _, f := range t.kvAt(s.pages[i], l, v) {
				out = binary.LittleEndian.AppendUint32(out, math.Float32bits(f))
			}
		}
	}
	return out, nil
}

// ImportPages implements Engine.
func (t *Transformer) ImportPages(seq SeqID, pages [][]byte) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := t.seqs[seq]; s != nil && s.n > 0 {
		return fmt.Errorf("%w: import into sequence %d, which already holds %d positions", ErrBadInput, seq, s.n)
	}
	want := PageTokens * int(t.mc.KVBytesPerToken())
	for i, p := range pages {
		if len(p) != want {
			return fmt.Errorf("%w: page %d is %d bytes, a page of %s is %d", ErrBadInput, i, len(p), t.mc.Name, want)
		}
	}
	if len(pages)*PageTokens > t.mc.MaxContext {
		return fmt.Errorf("%w: %d pages exceed the context of %d tokens", ErrBadInput, len(pages), t.mc.MaxContext)
	}
	if len(pages) > len(t.free) {
		return ErrOutOfPages
	}
	s := &sequence{}
	for _, p := range pages {
		id := t.free[len(t.free)-1]
		t.free = t.free[:len(t.free)-1]
		s.pages = append(s.pages, id)
		t.fillPage(id, p)
	}
	s.n = len(pages) * PageTokens
	t.seqs[seq] = s
	return nil
}

// ExportTail implements Engine: the partial last page in ExportPage's
// layout, the positions past the sequence's end zero.
func (t *Transformer) ExportTail(seq SeqID) ([]byte, int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.seqs[seq]
	if s == nil {
		return nil, 0, fmt.Errorf("%w: unknown sequence %d", ErrBadInput, seq)
	}
	n := s.n % PageTokens
	if n == 0 {
		return nil, 0, nil
	}
	kvd := t.mc.KVHeads * t.mc.HeadDim
	out := make([]byte, 0, PageTokens*int(t.mc.KVBytesPerToken()))
	for l := 0; l < t.mc.Layers; l++ {
		for v := 0; v < 2; v++ {
			for j, f := range t.kvAt(s.pages[s.n/PageTokens], l, v) {
				if j >= n*kvd {
					f = 0
				}
				out = binary.LittleEndian.AppendUint32(out, math.Float32bits(f))
			}
		}
	}
	return out, n, nil
}

// AppendPages implements Engine.
func (t *Transformer) AppendPages(seq SeqID, pages [][]byte, tail []byte, n int) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if n < 0 || n >= PageTokens {
		return fmt.Errorf("%w: a tail of %d positions: a partial page holds 0..%d", ErrBadInput, n, PageTokens-1)
	}
	s := t.seqs[seq]
	have := 0
	if s != nil {
		have = s.n
	}
	if have%PageTokens != 0 {
		return fmt.Errorf("%w: append to sequence %d, which holds %d positions, not a whole number of pages", ErrBadInput, seq, have)
	}
	all := pages
	if n > 0 {
		all = append(slices.Clip(pages), tail)
	}
	want := PageTokens * int(t.mc.KVBytesPerToken())
	for i, p := range all {
		if len(p) != want {
			return fmt.Errorf("%w: page %d is %d bytes, a page of %s is %d", ErrBadInput, i, len(p), t.mc.Name, want)
		}
	}
	if end := have + len(pages)*PageTokens + n; end > t.mc.MaxContext {
		return fmt.Errorf("%w: sequence %d would hold %d positions, beyond the context of %d", ErrBadInput, seq, end, t.mc.MaxContext)
	}
	if len(all) > len(t.free) {
		return ErrOutOfPages
	}
	if s == nil {
		s = &sequence{}
		t.seqs[seq] = s
	}
	for _, p := range all {
		id := t.free[len(t.free)-1]
		t.free = t.free[:len(t.free)-1]
		s.pages = append(s.pages, id)
		t.fillPage(id, p)
	}
	s.n = have + len(pages)*PageTokens + n
	return nil
}

// fillPage writes an exported page's bytes into page id.
func (t *Transformer) fillPage(id int32, p []byte) {
	off := 0
	for l := 0; l < t.mc.Layers; l++ {
		for v := 0; v < 2; v++ {
			dst := t.kvAt(id, l, v)
			for j := range dst {
				dst[j] = math.Float32frombits(binary.LittleEndian.Uint32(p[off:]))
				off += 4
			}
		}
	}
}

// row is one position computed in a Forward call.
type row struct {
	seq   *sequence
	pos   int
	token int32
}

// scratch holds Forward's buffers between calls.
type scratch struct {
	x, h, q, k, v, att, o, g, u []float32
	scores                      []float32
	logits                      []float32
}

func grow(b []float32, n int) []float32 {
	if cap(b) < n {
		return make([]float32, n)
	}
	return b[:n]
}

// Forward implements Engine.
func (t *Transformer) Forward(ctx context.Context, batch []Chunk) ([][]int32, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.w == nil {
		return nil, ErrNotLoaded
	}
	c := t.mc
	// Validate and count pages before changing anything.
	if err := checkBatch(batch, c.Vocab, c.MaxContext, len(t.free), func(id SeqID) (int, int) {
		if s := t.seqs[id]; s != nil {
			return s.n, len(s.pages)
		}
		return 0, 0
	}); err != nil {
		return nil, err
	}
	// Allocate pages and lay out the rows.
	var rows []row
	for _, ch := range batch {
		s := t.seqs[ch.Seq]
		if s == nil {
			s = &sequence{}
			t.seqs[ch.Seq] = s
		}
		for i, tok := range ch.Tokens {
			pos := s.n + i
			if pos/PageTokens >= len(s.pages) {
				s.pages = append(s.pages, t.free[len(t.free)-1])
				t.free = t.free[:len(t.free)-1]
			}
			rows = append(rows, row{seq: s, pos: pos, token: tok})
		}
	}
	t.forward(rows)
	for _, ch := range batch {
		t.seqs[ch.Seq].n += len(ch.Tokens)
	}
	// Sample.
	out := make([][]int32, len(batch))
	r := 0
	for bi, ch := range batch {
		for j, target := range ch.Targets {
			ch.Scores[j] = logSoftmax(t.logits(r+j), target, ch.TopLogprobs)
		}
		first := r + len(ch.Tokens) - ch.Sample
		for j := 0; j < ch.Sample; j++ {
			logits := t.logits(first + j)
			tok := sample(logits, ch.Params, ch.OutIndex+j)
			out[bi] = append(out[bi], tok)
			if ch.Logprobs != nil {
				ch.Logprobs[j] = logSoftmax(logits, tok, ch.TopLogprobs)
			}
		}
		r += len(ch.Tokens)
	}
	return out, nil
}

// forward runs every layer over the rows, leaving the final hidden states in
// buf.x. K and V of every row are written to the cache before attention, so
// a row attends to earlier rows of its own sequence in the same call.
func (t *Transformer) forward(rows []row) {
	c, w, b := t.mc, t.w, &t.buf
	R, H := len(rows), c.Hidden
	qd, kvd, hd := c.Heads*c.HeadDim, c.KVHeads*c.HeadDim, c.HeadDim
	b.x, b.h = grow(b.x, R*H), grow(b.h, R*H)
	b.q, b.k, b.v = grow(b.q, R*qd), grow(b.k, R*kvd), grow(b.v, R*kvd)
	b.att, b.o = grow(b.att, R*qd), grow(b.o, R*H)
	b.g, b.u = grow(b.g, R*c.FFN), grow(b.u, R*c.FFN)
	for r, rw := range rows {
		copy(b.x[r*H:(r+1)*H], w.Embed[int(rw.token)*H:(int(rw.token)+1)*H])
	}
	scale := float32(1 / math.Sqrt(float64(hd)))
	group := c.Heads / c.KVHeads
	for l := range w.Layers {
		lw := &w.Layers[l]
		rmsnorm(b.h, b.x, lw.AttnNorm, R, H, c.NormEps)
		matmul(b.q, b.h, lw.WQ, R, H, qd)
		matmul(b.k, b.h, lw.WK, R, H, kvd)
		matmul(b.v, b.h, lw.WV, R, H, kvd)
		for r, rw := range rows {
			t.rope(b.q[r*qd:(r+1)*qd], rw.pos, c.Heads)
			t.rope(b.k[r*kvd:(r+1)*kvd], rw.pos, c.KVHeads)
			page, slot := rw.seq.pages[rw.pos/PageTokens], rw.pos%PageTokens
			copy(t.kvAt(page, l, 0)[slot*kvd:(slot+1)*kvd], b.k[r*kvd:(r+1)*kvd])
			copy(t.kvAt(page, l, 1)[slot*kvd:(slot+1)*kvd], b.v[r*kvd:(r+1)*kvd])
		}
		for r, rw := range rows {
			b.scores = grow(b.scores, rw.pos+1)
			for hh := 0; hh < c.Heads; hh++ {
				kvh := hh / group
				q := b.q[r*qd+hh*hd : r*qd+(hh+1)*hd]
				maxs := float32(math.Inf(-1))
				for p := 0; p <= rw.pos; p++ {
					kpage := t.kvAt(rw.seq.pages[p/PageTokens], l, 0)
					off := (p%PageTokens)*kvd + kvh*hd
					s := dot(q, kpage[off:off+hd]) * scale
					b.scores[p] = s
					maxs = max(maxs, s)
				}
				var sum float32
				for p := 0; p <= rw.pos; p++ {
					e := float32(math.Exp(float64(b.scores[p] - maxs)))
					b.scores[p] = e
					sum += e
				}
				out := b.att[r*qd+hh*hd : r*qd+(hh+1)*hd]
				clear(out)
				for p := 0; p <= rw.pos; p++ {
					vpage := t.kvAt(rw.seq.pages[p/PageTokens], l, 1)
					off := (p%PageTokens)*kvd + kvh*hd
					axpy(out, b.scores[p]/sum, vpage[off:off+hd])
				}
			}
		}
		matmul(b.o, b.att, lw.WO, R, qd, H)
		add(b.x, b.o)
		rmsnorm(b.h, b.x, lw.MLPNorm, R, H, c.NormEps)
		matmul(b.g, b.h, lw.WGate, R, H, c.FFN)
		matmul(b.u, b.h, lw.WUp, R, H, c.FFN)
		for i, g := range b.g {
			b.g[i] = g / (1 + float32(math.Exp(float64(-g)))) * b.u[i]
		}
		matmul(b.o, b.g, lw.WDown, R, c.FFN, H)
		add(b.x, b.o)
	}
	rmsnorm(b.h, b.x, w.Norm, R, H, c.NormEps)
}

// logits computes the vocabulary logits of row r (after forward).
func (t *Transformer) logits(r int) []float32 {
	c, w, b := t.mc, t.w, &t.buf
	H := c.Hidden
	h := b.h[r*H : (r+1)*H]
	b.logits = grow(b.logits, c.Vocab)
	if c.TiedEmbeddings {
		for v := 0; v < c.Vocab; v++ {
			b.logits[v] = dot(h, w.Embed[v*H:(v+1)*H])
		}
	} else {
		matmul(b.logits, h, w.LMHead, 1, H, c.Vocab)
	}
	maskUnproducible(b.logits)
	return b.logits
}

// maskUnproducible keeps generation to bytes, <|eos|> and <|im_end|>: the
// other special tokens and the unused ids are never sampled.
func maskUnproducible(logits []float32) {
	inf := float32(math.Inf(-1))
	for _, id := range []int32{tokenizer.TokBOS, tokenizer.TokPad, tokenizer.TokImStart} {
		logits[id] = inf
	}
	for i := tokenizer.FirstUnused; i < len(logits); i++ {
		logits[i] = inf
	}
}

// rope rotates each head's pairs (i, i+half) by the position's angles.
func (t *Transformer) rope(x []float32, pos, heads int) {
	hd := t.mc.HeadDim
	half := hd / 2
	cos, sin := t.cos[pos*half:(pos+1)*half], t.sin[pos*half:(pos+1)*half]
	for h := 0; h < heads; h++ {
		v := x[h*hd : (h+1)*hd]
		for i := 0; i < half; i++ {
			a, bb := v[i], v[i+half]
			v[i] = a*cos[i] - bb*sin[i]
			v[i+half] = a*sin[i] + bb*cos[i]
		}
	}
}

// matmul sets out[r] = in[r] · W for R rows, W stored [k][n]. The weight row
// k is read once for all rows, and each out[r][j] accumulates over k in the
// same order whatever R is: a row's result does not depend on its batch.
func matmul(out, in, w []float32, R, K, N int) {
	out = out[:R*N]
	clear(out)
	for k := 0; k < K; k++ {
		wr := w[k*N : (k+1)*N]
		for r := 0; r < R; r++ {
			if a := in[r*K+k]; a != 0 {
				axpy(out[r*N:(r+1)*N], a, wr)
			}
		}
	}
}

// axpy sets y += a·x.
func axpy(y []float32, a float32, x []float32) {
	x = x[:len(y)]
	i := 0
	for ; i+4 <= len(y); i += 4 {
		y[i] += a * x[i]
		y[i+1] += a * x[i+1]
		y[i+2] += a * x[i+2]
		y[i+3] += a * x[i+3]
	}
	for ; i < len(y); i++ {
		y[i] += a * x[i]
	}
}

func dot(a, b []float32) float32 {
	b = b[:len(a)]
	var s0, s1, s2, s3 float32
	i := 0
	for ; i+4 <= len(a); i += 4 {
		s0 += a[i] * b[i]
		s1 += a[i+1] * b[i+1]
		s2 += a[i+2] * b[i+2]
		s3 += a[i+3] * b[i+3]
	}
	for ; i < len(a); i++ {
		s0 += a[i] * b[i]
	}
	return (s0 + s1) + (s2 + s3)
}

func add(x, y []float32) {
	y = y[:len(x)]
	for i := range x {
		x[i] += y[i]
	}
}

func rmsnorm(out, x, weight []float32, R, H int, eps float32) {
	for r := 0; r < R; r++ {
		xr, or := x[r*H:(r+1)*H], out[r*H:(r+1)*H]
		var ss float32
		for _, v := range xr {
			ss += v * v
		}
		inv := float32(1 / math.Sqrt(float64(ss/float32(H)+eps)))
		for i, v := range xr {
			or[i] = v * inv * weight[i]
		}
	}
}
