package engine

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sort"
)

// Errors.
var (
	// ErrOutOfPages: the KV cache cannot hold what the call needs; nothing
	// was changed. The scheduler preempts a sequence and retries.
	ErrOutOfPages = errors.New("engine: out of KV pages")
	// ErrNotLoaded: the weights are not loaded.
	ErrNotLoaded = errors.New("engine: weights not loaded")
	// ErrBadInput: a token, position or parameter is out of range.
	ErrBadInput = errors.New("engine: bad input")
)

// SeqID names a sequence in an engine's KV cache.
type SeqID uint64

// Sampling are a request's sampling parameters. Temperature 0 is greedy.
type Sampling struct {
	Temperature float32
	TopP        float32 // (0, 1]; 0 means 1
	Seed        uint64
}

// Validate checks the parameters.
func (s Sampling) Validate() error {
	if math.IsNaN(float64(s.Temperature)) || s.Temperature < 0 || s.Temperature > 2 {
		return fmt.Errorf("%w: temperature %v must be in [0, 2]", ErrBadInput, s.Temperature)
	}
	if math.IsNaN(float64(s.TopP)) || s.TopP < 0 || s.TopP > 1 {
		return fmt.Errorf("%w: top_p %v must be in (0, 1]", ErrBadInput, s.TopP)
	}
	return nil
}

// Chunk is one sequence's share of a Forward call: Tokens are appended at the
// sequence's next positions, and the next token is sampled after each of the
// last Sample of them (1 for prefill and decode, K+1 to verify K drafts).
type Chunk struct {
	Seq      SeqID
	Tokens   []int32
	Sample   int
	Params   Sampling
	OutIndex int // output index of the first sampled token; seeds sampling
	// Logprobs, when not nil, has one slot per sampled token (len Sample):
	// Forward fills slot j with the log probabilities of the j-th token it
	// samples, with the TopLogprobs (0..MaxTopLogprobs) most likely tokens
	// at its position. The caller owns the slice.
	Logprobs    []Logprobs
	TopLogprobs int
	// Targets, when not nil, asks for the log probabilities of given
	// tokens at the chunk's first len(Targets) positions (a prompt's
	// logprobs: the target at a prompt position is the prompt's next
	// token): Forward fills Scores[j] with Targets[j]'s log probability at
	// the chunk's position j, with the TopLogprobs most likely tokens
	// there. The caller owns Scores (len(Targets) slots).
	Targets []int32
	Scores  []Logprobs
}

// Info describes an engine.
type Info struct {
	Backend         string // "transformer" or "synthetic"
	Model           string
	Vocab           int
	MaxContext      int
	PageTokens      int
	KVBytesPerToken int64
	WeightBytes     int64
	TotalPages      int
}

// PageBytes is the size of one exported KV page.
func (i Info) PageBytes() int { return int(i.KVBytesPerToken) * i.PageTokens }

// Engine computes tokens over a paged KV cache. Implementations are safe for
// concurrent use, but a worker drives one from its scheduler goroutine.
type Engine interface {
	Info() Info
	// Load brings the weights into memory; Unload frees them (and every
	// sequence). Loaded reports which.
	Load(ctx context.Context) error
	Unload()
	Loaded() bool
	// Forward runs a batch and returns, per chunk, the sampled tokens. It
	// changes nothing when it fails.
	Forward(ctx context.Context, batch []Chunk) ([][]int32, error)
	// Len returns how many positions of seq are in the cache.
	Len(seq SeqID) int
	// Truncate drops the cache of seq from position n on.
	Truncate(seq SeqID, n int) error
	// ExportPage returns the KV bytes of seq's full page i.
	ExportPage(seq SeqID, i int) ([]byte, error)
	// ImportPages fills an empty seq with full pages (its first
	// len(pages)·PageTokens positions).
	ImportPages(seq SeqID, pages [][]byte) error
	// ExportTail returns the KV bytes of seq's positions past its last
	// full page, as a page whose later positions are zero, and how many
	// positions they are (nil and 0 when there are none).
	ExportTail(seq SeqID) (tail []byte, n int, err error)
	// AppendPages appends full pages to seq, which holds a whole number of
	// pages (none for a new one), then, when n > 0, the first n positions
	// of tail (an ExportTail's page), after which seq takes no more. It is
	// how a live migration's stages arrive in the destination's
	// pre-allocated sequence. It changes nothing when it fails. Unlike
	// ImportPages a paced engine does not charge it to the step: on a GPU
	// the copy between instances runs beside compute, and its sender paces
	// the transfer.
	AppendPages(seq SeqID, pages [][]byte, tail []byte, n int) error
	// Release frees seq.
	Release(seq SeqID)
	FreePages() int
}

// checkBatch validates a Forward batch before anything changes, and fails
// with ErrOutOfPages when the cache has fewer than the free pages it needs.
// held returns a sequence's cached positions and its pages.
func checkBatch(batch []Chunk, vocab, maxContext, free int, held func(SeqID) (n, pages int)) error {
	need := 0
	seen := make(map[SeqID]bool, len(batch))
	for _, ch := range batch {
		if seen[ch.Seq] {
			return fmt.Errorf("%w: sequence %d appears twice in one batch", ErrBadInput, ch.Seq)
		}
		seen[ch.Seq] = true
		if ch.Sample < 0 || ch.Sample > len(ch.Tokens) {
			return fmt.Errorf("%w: sample %d of %d tokens", ErrBadInput, ch.Sample, len(ch.Tokens))
		}
		if err := ch.Params.Validate(); err != nil {
			return err
		}
		if err := checkLogprobs(ch); err != nil {
			return err
		}
		for _, tok := range ch.Tokens {
			if tok < 0 || int(tok) >= vocab {
				return fmt.Errorf("%w: token id %d outside the vocabulary [0, %d)", ErrBadInput, tok, vocab)
			}
		}
		for _, tok := range ch.Targets {
			if tok < 0 || int(tok) >= vocab {
				return fmt.Errorf("%w: target token id %d outside the vocabulary [0, %d)", ErrBadInput, tok, vocab)
			}
		}
		n, have := held(ch.Seq)
		if n+len(ch.Tokens) > maxContext {
			return fmt.Errorf("%w: sequence %d would reach %d positions, beyond the context of %d", ErrBadInput, ch.Seq, n+len(ch.Tokens), maxContext)
		}
		need += (n+len(ch.Tokens)+PageTokens-1)/PageTokens - have
	}
	if need > free {
		return ErrOutOfPages
	}
	return nil
}

// sample picks the next token from logits: argmax (lowest id on ties) when
// greedy; otherwise temperature and top-p with a uniform drawn from a hash of
// the seed and the output index, so the choice does not depend on batching.
func sample(logits []float32, p Sampling, outIndex int) int32 {
	if p.Temperature == 0 {
		best := 0
		for i, v := range logits {
			if v > logits[best] {
				best = i
			}
		}
		return int32(best)
	}
	type cand struct {
		id int
		p  float64
	}
	maxv := logits[0]
	for _, v := range logits {
		maxv = max(maxv, v)
	}
	cands := make([]cand, 0, len(logits))
	var sum float64
	for i, v := range logits {
		if math.IsInf(float64(v), -1) {
			continue
		}
		e := math.Exp(float64(v-maxv) / float64(p.Temperature))
		cands = append(cands, cand{i, e})
		sum += e
	}
	sort.SliceStable(cands, func(a, b int) bool { return cands[a].p > cands[b].p })
	topP := float64(p.TopP)
	if topP == 0 {
		topP = 1
	}
	var kept float64
	n := 0
	for n < len(cands) {
		kept += cands[n].p / sum
		n++
		if kept >= topP {
			break
		}
	}
	u := unitHash(p.Seed, uint64(outIndex)) * kept * sum
	var acc float64
	for _, c := range cands[:n] {
		acc += c.p
		if u < acc {
			return int32(c.id)
		}
	}
	return int32(cands[n-1].id)
}

// unitHash maps (seed, index) to [0, 1) (splitmix64).
func unitHash(seed, index uint64) float64 {
	z := seed + 0x9e3779b97f4a7c15*(index+1)
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	z ^= z >> 31
	return float64(z>>11) / float64(1<<53)
}
