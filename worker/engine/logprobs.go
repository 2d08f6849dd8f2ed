package engine

import (
	"fmt"
	"math"
)

// MaxTopLogprobs is the most alternatives a sampled token's Logprobs lists
// (vLLM's and OpenAI's limit).
const MaxTopLogprobs = 20

// TokenLogprob is a token and its log probability.
type TokenLogprob struct {
	Token   int32
	Logprob float32
}

// Logprobs are a sampled token's log probability and the most likely tokens
// at its position, most likely first (the lowest id first among equals).
//
// They are the model's own distribution at the position — the log-softmax
// of the logits, before temperature and top-p (vLLM's default, "raw"
// logprobs) — so they do not depend on the sampling parameters, only on the
// token history: a resumed, migrated or speculatively verified request gets
// the same values, bit for bit, as a failure-free run.
type Logprobs struct {
	Logprob float32
	Top     []TokenLogprob
}

// checkLogprobs validates a chunk's logprob request.
func checkLogprobs(ch Chunk) error {
	if len(ch.Targets) > len(ch.Tokens) || len(ch.Scores) != len(ch.Targets) {
		return fmt.Errorf("%w: %d targets with %d score slots in a chunk of %d tokens", ErrBadInput, len(ch.Targets), len(ch.Scores), len(ch.Tokens))
	}
	if ch.Logprobs == nil && ch.Targets == nil {
		return nil
	}
	if ch.Logprobs != nil && len(ch.Logprobs) != ch.Sample {
		return fmt.Errorf("%w: %d logprob slots for %d sampled tokens", ErrBadInput, len(ch.Logprobs), ch.Sample)
	}
	if ch.TopLogprobs < 0 || ch.TopLogprobs > MaxTopLogprobs {
		return fmt.Errorf("%w: top_logprobs %d must be in [0, %d]", ErrBadInput, ch.TopLogprobs, MaxTopLogprobs)
	}
	return nil
}

// logSoftmax returns the chosen token's log probability under logits and
// the k most likely tokens. The normaliser is summed in float64 in id
// order, so the result is a function of the logits alone. Tokens at −Inf
// (never produced) are never among the top.
func logSoftmax(logits []float32, chosen int32, k int) Logprobs {
	maxv := math.Inf(-1)
	for _, v := range logits {
		maxv = max(maxv, float64(v))
	}
	var sum float64
	for _, v := range logits {
		sum += math.Exp(float64(v) - maxv)
	}
	lse := maxv + math.Log(sum)
	lp := Logprobs{Logprob: float32(float64(logits[chosen]) - lse)}
	if k == 0 {
		return lp
	}
	// Selection by insertion: k ≤ 20, the vocabulary a few hundred.
	top := make([]int32, 0, k)
	for i, v := range logits {
		if math.IsInf(float64(v), -1) {
			continue
		}
		if len(top) == k && v <= logits[top[k-1]] {
			continue
		}
		j := len(top)
		if j < k {
			top = append(top, 0)
		} else {
			j = k - 1
		}
		for j > 0 && logits[top[j-1]] < v {
			top[j] = top[j-1]
			j--
		}
		top[j] = int32(i)
	}
	lp.Top = make([]TokenLogprob, len(top))
	for i, id := range top {
		lp.Top[i] = TokenLogprob{Token: id, Logprob: float32(float64(logits[id]) - lse)}
	}
	return lp
}
