package engine

import "fmt"

// Page sharing (issue 25's prefix caching): a sequence can start with
// another's full pages by reference instead of computing them again. A
// shared page is never written: a sequence writes only past its cached
// positions, sharing takes only full pages, and a truncation into a shared
// page copies it first. A page is freed when its last holder releases it.
// The worker daemon calls it with -prefix-cache on (worker/prefixcache.go).
// Both engines implement it: the transformer by page id, the synthetic
// engine by the page's prefix hash.

// PageSharer is an engine whose sequences can share full KV pages.
type PageSharer interface {
	// SharePrefix makes the new (absent or empty) sequence dst start with
	// the first n full pages of src, by reference: dst holds n·PageTokens
	// positions, and no page is allocated.
	SharePrefix(dst, src SeqID, n int) error
}

// SharePrefix implements PageSharer.
func (t *Transformer) SharePrefix(dst, src SeqID, n int) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if d := t.seqs[dst]; d != nil && d.n > 0 {
		return fmt.Errorf("%w: share into sequence %d, which already holds %d positions", ErrBadInput, dst, d.n)
	}
	s := t.seqs[src]
	if s == nil || n < 0 || n*PageTokens > s.n {
		have := 0
		if s != nil {
			have = s.n / PageTokens
		}
		return fmt.Errorf("%w: sequence %d has %d full pages, %d asked to share", ErrBadInput, src, have, n)
	}
	if dst == src {
		return fmt.Errorf("%w: sequence %d shared with itself", ErrBadInput, src)
	}
	if t.shared == nil {
		t.shared = map[int32]int32{}
	}
	d := &sequence{pages: append([]int32(nil), s.pages[:n]...), n: n * PageTokens}
	for _, p := range d.pages {
		t.shared[p] = max(t.shared[p], 1) + 1
	}
	t.seqs[dst] = d
	return nil
}

// drop gives up one holder's reference to each of pages, freeing those it
// held alone.
func (t *Transformer) drop(pages []int32) {
	for _, p := range pages {
		switch c := t.shared[p]; {
		case c > 2:
			t.shared[p] = c - 1
		case c == 2:
			delete(t.shared, p)
		default:
			t.free = append(t.free, p)
		}
	}
}

// copyOnWrite gives s a copy of its page i of its own (one free page is
// needed), dropping its reference to the shared one.
func (t *Transformer) copyOnWrite(s *sequence, i int) {
	old := s.pages[i]
	id := t.free[len(t.free)-1]
	t.free = t.free[:len(t.free)-1]
	for l := 0; l < t.mc.Layers; l++ {
		for v := 0; v < 2; v++ {
			copy(t.kvAt(id, l, v), t.kvAt(old, l, v))
		}
	}
	t.drop([]int32{old})
	s.pages[i] = id
}

// SharePrefix forwards to the paced engine's own (it costs no step time:
// nothing is computed or copied).
func (p *Paced) SharePrefix(dst, src SeqID, n int) error {
	sh, ok := p.Engine.(PageSharer)
	if !ok {
		return fmt.Errorf("%w: engine %s does not share pages", ErrBadInput, p.Engine.Info().Backend)
	}
	return sh.SharePrefix(dst, src, n)
}
