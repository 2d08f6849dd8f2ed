package engine

import (
	"slices"
	"testing"
)

// TestSyntheticSharePrefix: the synthetic engine shares full pages like the
// transformer: a sharer decodes exactly what it decodes from scratch, the
// shared pages count once and are freed with their last holder, and a
// truncation into a shared page copies it.
func TestSyntheticSharePrefix(t *testing.T) {
	const total = 32
	e, err := NewSynthetic(SyntheticConfig{Pages: total, MaxContext: 1024})
	if err != nil {
		t.Fatal(err)
	}
	p := make([]int32, 3*PageTokens+5)
	for i := range p {
		p[i] = int32(i*7%50 + 1)
	}
	want := decode(t, e, 9, p, 10)
	e.Release(9)
	if e.FreePages() != total {
		t.Fatalf("free %d after release, want %d", e.FreePages(), total)
	}
	decode(t, e, 1, p, 4)
	used := total - e.FreePages()
	if err := e.SharePrefix(2, 1, 3); err != nil {
		t.Fatal(err)
	}
	if got := total - e.FreePages(); got != used {
		t.Fatalf("sharing 3 pages used %d pages, want %d (none new)", got, used)
	}
	if got := decode(t, e, 2, p[3*PageTokens:], 10); !slices.Equal(got, want) {
		t.Fatalf("sharer decoded %v, from scratch %v", got, want)
	}
	e.Release(1)
	if err := e.Truncate(2, 2*PageTokens+3); err != nil {
		t.Fatal(err)
	}
	e.Release(2)
	if e.FreePages() != total {
		t.Fatalf("free %d after every holder released, want %d", e.FreePages(), total)
	}
}
