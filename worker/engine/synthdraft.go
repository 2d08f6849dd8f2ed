package engine

import (
	"fmt"
	"math"
)

// NewSyntheticDraft returns a synthetic draft engine for the synthetic target:
// at each position it proposes the token the target computes there (the
// same hash of the same prefix) with probability alpha, and another token
// otherwise. The choice is a hash of the prefix and seed, so a replayed
// prefix gets the same draft: the acceptance a target measures is alpha per
// position, whatever the batching, as with a real draft model whose
// agreement is alpha (docs/calibration.md, "Speculative decoding": 0.6–0.75 for
// a small draft).
func NewSyntheticDraft(cfg SyntheticConfig, alpha float64, seed uint64) (*Synthetic, error) {
	if math.IsNaN(alpha) || alpha < 0 || alpha > 1 {
		return nil, fmt.Errorf("%w: draft agreement alpha %v must be in [0, 1]", ErrBadInput, alpha)
	}
	if cfg.Model == "" {
		cfg.Model = "synthetic-draft"
	}
	s, err := NewSynthetic(cfg)
	if err != nil {
		return nil, err
	}
	s.token = func(h uint64, p Sampling, outIndex int) int32 {
		t := synthToken(h, p, outIndex)
		if unitHash(seed^h, 0) < alpha {
			return t
		}
		// Another printable byte, never the target's.
		return ' ' + (t-' '+1+int32(mix(h, int32(seed))%94))%95
	}
	return s, nil
}
