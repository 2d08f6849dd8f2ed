// Package engine runs a decoder-only transformer over a paged KV cache.
//
// Two backends implement Engine: Transformer, a real float32 transformer in
// pure Go (RMSNorm, rotary positions, grouped-query attention, SwiGLU), and
// Synthetic, whose next token and KV bytes are hashes of the token prefix and
// cost nearly nothing. A Profile describes the GPU and model being emulated;
// Paced wraps an engine so each step takes the time the profile says.
//
// The oracle. One code path computes every position, whether it arrives in a
// prefill, a chunk of a prefill, a decode step or a verification pass: a
// batch is a list of (sequence, position, token) rows; each matrix product
// accumulates over the weight rows in the same order for every row, and
// attention for a row reads only its own sequence's cache, positions in
// order. So for greedy decoding (and seeded sampling, whose randomness is a
// hash of the seed and the output index) a request's tokens are the same
// whether it ran alone or batched, prefilled at once or in chunks, or
// resumed from exported pages followed by a partial prefill.
package engine

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/lumen-project/lumen/internal/kvpage"
	"github.com/lumen-project/lumen/tokenizer"
)

// PageTokens is the number of tokens in one KV page: kvpage.Tokens, named
// here for the engine's many uses.
const PageTokens = kvpage.Tokens

// ModelConfig describes a decoder-only transformer.
type ModelConfig struct {
	Name       string  `json:"name"`
	Vocab      int     `json:"vocab"`
	Hidden     int     `json:"hidden"`
	Layers     int     `json:"layers"`
	Heads      int     `json:"heads"`
	KVHeads    int     `json:"kv_heads"`
	HeadDim    int     `json:"head_dim"`
	FFN        int     `json:"ffn"`
	MaxContext int     `json:"max_context"`
	RopeTheta  float64 `json:"rope_theta"`
	NormEps    float32 `json:"norm_eps"`
	// TiedEmbeddings uses the token embedding as the unembedding.
	TiedEmbeddings bool `json:"tied_embeddings"`
}

// DefaultTarget is the model `lumen model init` writes as the target: small
// enough that one CPU core decodes over 1,000 tokens/s at batch 32.
func DefaultTarget() ModelConfig {
	return ModelConfig{Name: "lumen-tiny", Vocab: tokenizer.VocabSize, Hidden: 128, Layers: 4, Heads: 4, KVHeads: 2,
		HeadDim: 32, FFN: 384, MaxContext: 2048, RopeTheta: 10000, NormEps: 1e-5, TiedEmbeddings: false}
}

// DefaultDraft is the draft: the target's first two layers, same vocabulary.
func DefaultDraft() ModelConfig {
	c := DefaultTarget()
	c.Name, c.Layers = "lumen-tiny-draft", 2
	return c
}

// Validate checks that the dimensions fit together.
func (c ModelConfig) Validate() error {
	var errs []error
	pos := map[string]int{"vocab": c.Vocab, "hidden": c.Hidden, "layers": c.Layers, "heads": c.Heads,
		"kv_heads": c.KVHeads, "head_dim": c.HeadDim, "ffn": c.FFN, "max_context": c.MaxContext}
	for _, k := range []string{"vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "max_context"} {
		if pos[k] <= 0 {
			errs = append(errs, fmt.Errorf("%s must be > 0, got %d", k, pos[k]))
		}
	}
	if c.KVHeads > 0 && c.Heads%c.KVHeads != 0 {
		errs = append(errs, fmt.Errorf("heads (%d) must be a multiple of kv_heads (%d)", c.Heads, c.KVHeads))
	}
	if c.HeadDim%2 != 0 {
		errs = append(errs, fmt.Errorf("head_dim (%d) must be even for rotary embeddings", c.HeadDim))
	}
	if c.RopeTheta <= 0 || c.NormEps <= 0 {
		errs = append(errs, fmt.Errorf("rope_theta (%v) and norm_eps (%v) must be > 0", c.RopeTheta, c.NormEps))
	}
	if c.Vocab < tokenizer.NumSpecial+256 {
		errs = append(errs, fmt.Errorf("vocab (%d) must hold 256 bytes and %d special tokens", c.Vocab, tokenizer.NumSpecial))
	}
	if len(errs) > 0 {
		return fmt.Errorf("engine: model config %q: %w", c.Name, errors.Join(errs...))
	}
	return nil
}

// KVBytesPerToken is the float32 KV cache of one token across all layers.
func (c ModelConfig) KVBytesPerToken() int64 {
	return int64(2 * c.Layers * c.KVHeads * c.HeadDim * 4)
}

// Params counts the weights.
func (c ModelConfig) Params() int64 {
	h, q, kv := int64(c.Hidden), int64(c.Heads*c.HeadDim), int64(c.KVHeads*c.HeadDim)
	per := h + h*q + 2*h*kv + q*h + h + 3*h*int64(c.FFN)
	n := int64(c.Vocab)*h + int64(c.Layers)*per + h
	if !c.TiedEmbeddings {
		n += h * int64(c.Vocab)
	}
	return n
}

func (c ModelConfig) marshal() string {
	b, _ := json.Marshal(c)
	return string(b)
}
