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
	// SharePages makes the new (absent or empty) sequence dst hold the
	// listed full pages, in order, by reference: dst holds
	// len(from)·PageTokens positions, and no page is allocated. The caller
	// vouches that each page's KV is what dst's positions there compute
	// (the daemon: the pages cached under dst's prefix hashes). A sequence
	// of one page (a cache's holder of that page) keeps exactly that page.
	SharePages(dst SeqID, from []PageRef) error
	// AdoptPage gives up seq's full page i for a reference to from's
	// page, which holds the same prefix's KV (a page two requests filled
	// at once): seq's own copy is freed unless another holder shares it.
	AdoptPage(seq SeqID, i int, from PageRef) error
}

// PageRef is full page Page (counted from 0) of sequence Seq.
type PageRef struct {
	Seq  SeqID
	Page int
}

// prefixRefs is src's first n pages, for SharePrefix.
func prefixRefs(src SeqID, n int) ([]PageRef, error) {
	if n < 0 {
		return nil, fmt.Errorf("%w: %d pages asked to share", ErrBadInput, n)
	}
	from := make([]PageRef, n)
	for i := range from {
		from[i] = PageRef{Seq: src, Page: i}
	}
	return from, nil
}

// SharePrefix implements PageSharer.
func (t *Transformer) SharePrefix(dst, src SeqID, n int) error {
	from, err := prefixRefs(src, n)
	if err != nil {
		return err
	}
	return t.SharePages(dst, from)
}

// SharePages implements PageSharer.
func (t *Transformer) SharePages(dst SeqID, from []PageRef) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if d := t.seqs[dst]; d != nil && d.n > 0 {
		return fmt.Errorf("%w: share into sequence %d, which already holds %d positions", ErrBadInput, dst, d.n)
	}
	for _, f := range from {
		if err := t.checkFullPage(f); err != nil {
			return err
		}
		if f.Seq == dst {
			return fmt.Errorf("%w: sequence %d shared with itself", ErrBadInput, dst)
		}
	}
	if t.shared == nil {
		t.shared = map[int32]int32{}
	}
	d := &sequence{pages: make([]int32, len(from)), n: len(from) * PageTokens}
	for i, f := range from {
		p := t.seqs[f.Seq].pages[f.Page]
		d.pages[i] = p
		t.shared[p] = max(t.shared[p], 1) + 1
	}
	t.seqs[dst] = d
	return nil
}

// AdoptPage implements PageSharer.
func (t *Transformer) AdoptPage(seq SeqID, i int, from PageRef) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.checkFullPage(PageRef{Seq: seq, Page: i}); err != nil {
		return err
	}
	if err := t.checkFullPage(from); err != nil {
		return err
	}
	s := t.seqs[seq]
	old, p := s.pages[i], t.seqs[from.Seq].pages[from.Page]
	if old == p {
		return nil
	}
	if t.shared == nil {
		t.shared = map[int32]int32{}
	}
	t.shared[p] = max(t.shared[p], 1) + 1
	s.pages[i] = p
	t.drop([]int32{old})
	return nil
}

// checkFullPage reports an error unless f names a full page of a sequence.
func (t *Transformer) checkFullPage(f PageRef) error {
	s := t.seqs[f.Seq]
	if s == nil || f.Page < 0 || (f.Page+1)*PageTokens > s.n {
		have := 0
		if s != nil {
			have = s.n / PageTokens
		}
		return fmt.Errorf("%w: sequence %d has %d full pages, page %d asked for", ErrBadInput, f.Seq, have, f.Page)
	}
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

// SharePages forwards to the paced engine's own (no step time).
func (p *Paced) SharePages(dst SeqID, from []PageRef) error {
	sh, ok := p.Engine.(PageSharer)
	if !ok {
		return fmt.Errorf("%w: engine %s does not share pages", ErrBadInput, p.Engine.Info().Backend)
	}
	return sh.SharePages(dst, from)
}

// AdoptPage forwards to the paced engine's own (no step time).
func (p *Paced) AdoptPage(seq SeqID, i int, from PageRef) error {
	sh, ok := p.Engine.(PageSharer)
	if !ok {
		return fmt.Errorf("%w: engine %s does not share pages", ErrBadInput, p.Engine.Info().Backend)
	}
	return sh.AdoptPage(seq, i, from)
}
