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

// SyntheticPageBytes is the size of an exported synthetic page: the page's
// 16 token ids, its prefix hash, and filler derived from that hash. (Capacity
// and transfer times are accounted with the profile's KV bytes per token.)
const SyntheticPageBytes = 1024

// SyntheticConfig configures a Synthetic engine.
type SyntheticConfig struct {
	Pages           int
	MaxContext      int   // default 32768
	KVBytesPerToken int64 // reported for accounting; default 160 KiB (Qwen3-14B)
	WeightBytes     int64
	Model           string
}

// Synthetic is an engine whose next token is a hash of the token prefix: as
// deterministic as the transformer, and nearly free, so dozens of workers fit
// on one small machine.
type Synthetic struct {
	cfg SyntheticConfig

	// token is the next token after a prefix with hash h (synthToken; a
	// synthetic draft's agrees with it only some of the time). Fixed at
	// construction.
	token func(h uint64, p Sampling, outIndex int) int32

	mu     sync.Mutex // guards everything below
	loaded bool
	free   int
	seqs   map[SeqID]*synthSeq
	// refs counts the holders of shared pages (SharePages), by the hash
	// of the prefix through the page's end, as the transformer's shared
	// does by page id: present only with two holders or more. A
	// synthetic page's content is its prefix, so pages with one hash are
	// interchangeable and the count is what decides when one is freed.
	refs map[uint64]int
}

type synthSeq struct {
	tokens []int32
	hashes []uint64 // hashes[p] = hash of tokens[0..p]
	pages  int
	shared []bool // shared[i]: page i may be shared (released by refs); absent past its end
}

// isShared reports whether q's page i may be shared.
func (q *synthSeq) isShared(i int) bool { return i < len(q.shared) && q.shared[i] }

// setShared marks q's page i as one that may be shared.
func (q *synthSeq) setShared(i int) {
	for len(q.shared) <= i {
		q.shared = append(q.shared, false)
	}
	q.shared[i] = true
}

// dropPage gives up q's page i: freed unless another holder shares it.
func (s *Synthetic) dropPage(q *synthSeq, i int) {
	if !q.isShared(i) {
		s.free++
		return
	}
	k := q.hashes[(i+1)*PageTokens-1]
	switch c := s.refs[k]; {
	case c > 2:
		s.refs[k] = c - 1
	case c == 2:
		delete(s.refs, k)
	default:
		s.free++
	}
}

// SharePrefix implements PageSharer: dst starts with src's first n full
// pages by reference, allocating none.
func (s *Synthetic) SharePrefix(dst, src SeqID, n int) error {
	from, err := prefixRefs(src, n)
	if err != nil {
		return err
	}
	return s.SharePages(dst, from)
}

// SharePages implements PageSharer: dst holds the listed full pages, in
// order, by reference, allocating none. A synthetic page's content is its
// tokens and their prefix hashes, which dst takes over.
func (s *Synthetic) SharePages(dst SeqID, from []PageRef) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if d := s.seqs[dst]; d != nil && len(d.tokens) > 0 {
		return fmt.Errorf("%w: share into sequence %d, which already holds %d positions", ErrBadInput, dst, len(d.tokens))
	}
	for _, f := range from {
		if err := s.checkFullPage(f); err != nil {
			return err
		}
		if f.Seq == dst {
			return fmt.Errorf("%w: sequence %d shared with itself", ErrBadInput, dst)
		}
	}
	if s.refs == nil {
		s.refs = map[uint64]int{}
	}
	m := len(from) * PageTokens
	d := &synthSeq{tokens: make([]int32, 0, m), hashes: make([]uint64, 0, m), pages: len(from)}
	for i, f := range from {
		q := s.seqs[f.Seq]
		lo, hi := f.Page*PageTokens, (f.Page+1)*PageTokens
		k := q.hashes[hi-1]
		s.refs[k] = max(s.refs[k], 1) + 1
		q.setShared(f.Page)
		d.tokens = append(d.tokens, q.tokens[lo:hi]...)
		d.hashes = append(d.hashes, q.hashes[lo:hi]...)
		d.setShared(i)
	}
	s.seqs[dst] = d
	return nil
}

// AdoptPage implements PageSharer: seq's page i, filled with the same
// prefix as from's page, is given up for a reference to from's.
func (s *Synthetic) AdoptPage(seq SeqID, i int, from PageRef) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.checkFullPage(PageRef{Seq: seq, Page: i}); err != nil {
		return err
	}
	if err := s.checkFullPage(from); err != nil {
		return err
	}
	q, f := s.seqs[seq], s.seqs[from.Seq]
	k := q.hashes[(i+1)*PageTokens-1]
	if fk := f.hashes[(from.Page+1)*PageTokens-1]; fk != k {
		return fmt.Errorf("%w: page %d of sequence %d (prefix hash %x) cannot take page %d of sequence %d (prefix hash %x): their prefixes differ",
			ErrBadInput, i, seq, k, from.Page, from.Seq, fk)
	}
	if seq == from.Seq || q.isShared(i) && f.isShared(from.Page) {
		return nil // one page already (pages with one hash are one here)
	}
	if s.refs == nil {
		s.refs = map[uint64]int{}
	}
	// Give up q's copy, then hold the other by reference.
	s.dropPage(q, i)
	s.refs[k] = max(s.refs[k], 1) + 1
	f.setShared(from.Page)
	q.setShared(i)
	return nil
}

// checkFullPage reports an error unless f names a full page of a sequence.
func (s *Synthetic) checkFullPage(f PageRef) error {
	q := s.seqs[f.Seq]
	if q == nil || f.Page < 0 || (f.Page+1)*PageTokens > len(q.tokens) {
		have := 0
		if q != nil {
			have = len(q.tokens) / PageTokens
		}
		return fmt.Errorf("%w: sequence %d has %d full pages, page %d asked for", ErrBadInput, f.Seq, have, f.Page)
	}
	return nil
}

// NewSynthetic returns a loaded synthetic engine.
func NewSynthetic(cfg SyntheticConfig) (*Synthetic, error) {
	if cfg.Pages <= 0 {
		return nil, fmt.Errorf("%w: KV cache pages must be > 0, got %d", ErrBadInput, cfg.Pages)
	}
	if cfg.MaxContext == 0 {
		cfg.MaxContext = 32768
	}
	if cfg.KVBytesPerToken == 0 {
		cfg.KVBytesPerToken = 160 << 10
	}
	if cfg.Model == "" {
		cfg.Model = "synthetic"
	}
	return &Synthetic{cfg: cfg, token: synthToken, loaded: true, free: cfg.Pages, seqs: map[SeqID]*synthSeq{}}, nil
}

// Info implements Engine.
func (s *Synthetic) Info() Info {
	return Info{Backend: "synthetic", Model: s.cfg.Model, Vocab: tokenizer.VocabSize, MaxContext: s.cfg.MaxContext,
		PageTokens: PageTokens, KVBytesPerToken: s.cfg.KVBytesPerToken, WeightBytes: s.cfg.WeightBytes, TotalPages: s.cfg.Pages}
}

// Load implements Engine.
func (s *Synthetic) Load(context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.loaded = true
	return nil
}

// Unload implements Engine.
func (s *Synthetic) Unload() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.loaded, s.free, s.seqs, s.refs = false, s.cfg.Pages, map[SeqID]*synthSeq{}, nil
}

// Loaded implements Engine.
func (s *Synthetic) Loaded() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.loaded
}

// FreePages implements Engine.
func (s *Synthetic) FreePages() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.free
}

// Len implements Engine.
func (s *Synthetic) Len(seq SeqID) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if q := s.seqs[seq]; q != nil {
		return len(q.tokens)
	}
	return 0
}

// Release implements Engine.
func (s *Synthetic) Release(seq SeqID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if q := s.seqs[seq]; q != nil {
		for i := q.pages - 1; i >= 0; i-- {
			s.dropPage(q, i)
		}
		delete(s.seqs, seq)
	}
}

// Truncate implements Engine.
func (s *Synthetic) Truncate(seq SeqID, n int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	q := s.seqs[seq]
	if q == nil || n < 0 || n > len(q.tokens) {
		return fmt.Errorf("%w: truncate sequence %d to %d", ErrBadInput, seq, n)
	}
	keep := (n + PageTokens - 1) / PageTokens
	if n%PageTokens != 0 && q.isShared(keep-1) && s.free == 0 && s.refs[q.hashes[keep*PageTokens-1]] >= 2 {
		// The cut page is shared and will be written: it needs a copy.
		return ErrOutOfPages
	}
	for i := q.pages - 1; i >= keep; i-- {
		s.dropPage(q, i)
	}
	if n%PageTokens != 0 && q.isShared(keep-1) {
		// Copy on write: drop the shared page, take one of q's own.
		s.dropPage(q, keep-1)
		s.free--
		q.shared[keep-1] = false
	}
	if len(q.shared) > keep {
		q.shared = q.shared[:keep]
	}
	q.tokens, q.hashes = q.tokens[:n], q.hashes[:n]
	q.pages = keep
	return nil
}

// mix extends a prefix hash by one token.
func mix(h uint64, tok int32) uint64 {
	h ^= uint64(uint32(tok)) + 0x9e3779b97f4a7c15 + h<<6 + h>>2
	h *= 0xff51afd7ed558ccd
	return h ^ h>>33
}

// Forward implements Engine.
func (s *Synthetic) Forward(_ context.Context, batch []Chunk) ([][]int32, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.loaded {
		return nil, ErrNotLoaded
	}
	if err := checkBatch(batch, tokenizer.VocabSize, s.cfg.MaxContext, s.free, func(id SeqID) (int, int) {
		if q := s.seqs[id]; q != nil {
			return len(q.tokens), q.pages
		}
		return 0, 0
	}); err != nil {
		return nil, err
	}
	out := make([][]int32, len(batch))
	for i, ch := range batch {
		q := s.seqs[ch.Seq]
		if q == nil {
			q = &synthSeq{}
			s.seqs[ch.Seq] = q
		}
		for j, tok := range ch.Tokens {
			h := uint64(0x51ab1e)
			if len(q.hashes) > 0 {
				h = q.hashes[len(q.hashes)-1]
			}
			h = mix(h, tok)
			q.tokens, q.hashes = append(q.tokens, tok), append(q.hashes, h)
			if j < len(ch.Targets) {
				ch.Scores[j] = synthLogprobs(h, ch.Targets[j], ch.TopLogprobs)
			}
			if k := j - (len(ch.Tokens) - ch.Sample); k >= 0 {
				tok := s.token(h, ch.Params, ch.OutIndex+k)
				out[i] = append(out[i], tok)
				if ch.Logprobs != nil {
					ch.Logprobs[k] = synthLogprobs(h, tok, ch.TopLogprobs)
				}
			}
		}
		pages := (len(q.tokens) + PageTokens - 1) / PageTokens
		s.free -= pages - q.pages
		q.pages = pages
	}
	return out, nil
}

// synthToken is the next token after a prefix with hash h: a printable ASCII
// byte, so text stays text; sampling mixes in the seed and output index.
func synthToken(h uint64, p Sampling, outIndex int) int32 {
	if p.Temperature > 0 {
		h = mix(h, int32(unitHash(p.Seed, uint64(outIndex))*(1<<30)))
	}
	return int32(' ' + h%95)
}

// synthLogits is the synthetic model's distribution after a prefix with
// hash h: the 95 printable bytes ranked cyclically from its greedy token
// (' ' + h%95, rank 0) on, rank r with logit −r/2; every other token −Inf.
// Its log-softmax is what the synthetic engine reports as logprobs: like
// the transformer's, a function of the token history alone, before
// temperature and top-p (a sampled token's rank can be anything: the
// synthetic sampler draws uniformly, not from this distribution).
func synthLogits(h uint64) []float32 {
	logits := make([]float32, tokenizer.VocabSize)
	inf := float32(math.Inf(-1))
	for i := range logits {
		logits[i] = inf
	}
	g := int(h % 95)
	for r := 0; r < 95; r++ {
		logits[' '+(g+r)%95] = -float32(r) / 2
	}
	return logits
}

// synthLogprobs are the Logprobs of tok after a prefix with hash h.
func synthLogprobs(h uint64, tok int32, k int) Logprobs {
	return logSoftmax(synthLogits(h), tok, k)
}

// ExportPage implements Engine.
func (s *Synthetic) ExportPage(seq SeqID, i int) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	q := s.seqs[seq]
	if q == nil || i < 0 || (i+1)*PageTokens > len(q.tokens) {
		return nil, fmt.Errorf("%w: sequence %d has no full page %d", ErrBadInput, seq, i)
	}
	return encodeSynthPage(q.tokens[i*PageTokens:(i+1)*PageTokens], q.hashes[(i+1)*PageTokens-1]), nil
}

// ExportTail implements Engine.
func (s *Synthetic) ExportTail(seq SeqID) ([]byte, int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	q := s.seqs[seq]
	if q == nil {
		return nil, 0, fmt.Errorf("%w: unknown sequence %d", ErrBadInput, seq)
	}
	full := len(q.tokens) / PageTokens * PageTokens
	if full == len(q.tokens) {
		return nil, 0, nil
	}
	return encodeSynthPage(q.tokens[full:], q.hashes[len(q.tokens)-1]), len(q.tokens) - full, nil
}

// encodeSynthPage is a page's bytes: its tokens (zero past them), the
// prefix hash through its last token, and filler derived from the hash.
func encodeSynthPage(tokens []int32, h uint64) []byte {
	out := make([]byte, 0, SyntheticPageBytes)
	for j := range PageTokens {
		var t int32
		if j < len(tokens) {
			t = tokens[j]
		}
		out = binary.LittleEndian.AppendUint32(out, uint32(t))
	}
	out = binary.LittleEndian.AppendUint64(out, h)
	for x := h; len(out) < SyntheticPageBytes; {
		x = mix(x, 1)
		out = binary.LittleEndian.AppendUint64(out, x)
	}
	return out
}

// decodeSynthPage appends the first n tokens of page p to q, extending the
// prefix hash chain, and checks the page's hash.
func decodeSynthPage(q *synthSeq, p []byte, n int, i int) error {
	if len(p) != SyntheticPageBytes {
		return fmt.Errorf("%w: page %d is %d bytes, a synthetic page is %d", ErrBadInput, i, len(p), SyntheticPageBytes)
	}
	h := uint64(0x51ab1e)
	if len(q.hashes) > 0 {
		h = q.hashes[len(q.hashes)-1]
	}
	for j := range n {
		tok := int32(binary.LittleEndian.Uint32(p[4*j:]))
		h = mix(h, tok)
		q.tokens, q.hashes = append(q.tokens, tok), append(q.hashes, h)
	}
	if got := binary.LittleEndian.Uint64(p[4*PageTokens:]); got != h {
		return fmt.Errorf("%w: page %d is corrupt: prefix hash %x, tokens give %x", ErrBadInput, i, got, h)
	}
	return nil
}

// ImportPages implements Engine: it rebuilds the sequence from the pages'
// tokens and checks each page's hash and filler.
func (s *Synthetic) ImportPages(seq SeqID, pages [][]byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if q := s.seqs[seq]; q != nil && len(q.tokens) > 0 {
		return fmt.Errorf("%w: import into sequence %d, which already holds %d positions", ErrBadInput, seq, len(q.tokens))
	}
	if len(pages) > s.free {
		return ErrOutOfPages
	}
	q := &synthSeq{}
	for i, p := range pages {
		if err := decodeSynthPage(q, p, PageTokens, i); err != nil {
			return err
		}
	}
	q.pages = len(pages)
	s.free -= q.pages
	s.seqs[seq] = q
	return nil
}

// AppendPages implements Engine.
func (s *Synthetic) AppendPages(seq SeqID, pages [][]byte, tail []byte, n int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n < 0 || n >= PageTokens {
		return fmt.Errorf("%w: a tail of %d positions: a partial page holds 0..%d", ErrBadInput, n, PageTokens-1)
	}
	old := s.seqs[seq]
	if old == nil {
		old = &synthSeq{}
	}
	if len(old.tokens)%PageTokens != 0 {
		return fmt.Errorf("%w: append to sequence %d, which holds %d positions, not a whole number of pages", ErrBadInput, seq, len(old.tokens))
	}
	need := len(pages)
	if n > 0 {
		need++
	}
	if len(old.tokens)+len(pages)*PageTokens+n > s.cfg.MaxContext {
		return fmt.Errorf("%w: sequence %d would hold %d positions, beyond the context of %d", ErrBadInput, seq,
			len(old.tokens)+len(pages)*PageTokens+n, s.cfg.MaxContext)
	}
	if need > s.free {
		return ErrOutOfPages
	}
	q := &synthSeq{tokens: slices.Clone(old.tokens), hashes: slices.Clone(old.hashes), pages: old.pages, shared: slices.Clone(old.shared)}
	for i, p := range pages {
		if err := decodeSynthPage(q, p, PageTokens, i); err != nil {
			return err
		}
	}
	if n > 0 {
		if err := decodeSynthPage(q, tail, n, len(pages)); err != nil {
			return err
		}
	}
	q.pages += need
	s.free -= need
	s.seqs[seq] = q
	return nil
}
