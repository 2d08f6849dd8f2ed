package engine

import (
	"context"
	"errors"
	"math/rand"
	"slices"
	"testing"
)

// TestAppendPagesContinuesTheSequence: a sequence exported page by page and
// appended stage by stage (full pages, then the partial last page) into
// another engine's sequence continues exactly as the original: the next
// tokens are the same, for both backends.
func TestAppendPagesContinuesTheSequence(t *testing.T) {
	syn1, _ := NewSynthetic(SyntheticConfig{Pages: 64})
	syn2, _ := NewSynthetic(SyntheticConfig{Pages: 64})
	for _, c := range []struct {
		name     string
		src, dst Engine
	}{{"synthetic", syn1, syn2}, {"transformer", newEngine(t, 64), newEngine(t, 64)}} {
		t.Run(c.name, func(t *testing.T) {
			seed := int64(5)
			t.Logf("seed %d", seed)
			rng := rand.New(rand.NewSource(seed))
			ctx := context.Background()
			prompt := make([]int32, 75) // 4 full pages and 11 positions
			for i := range prompt {
				prompt[i] = 32 + int32(rng.Intn(95))
			}
			out, err := c.src.Forward(ctx, []Chunk{{Seq: 1, Tokens: prompt, Sample: 1}})
			if err != nil {
				t.Fatal(err)
			}
			var pages [][]byte
			for i := range 4 {
				p, err := c.src.ExportPage(1, i)
				if err != nil {
					t.Fatal(err)
				}
				pages = append(pages, p)
			}
			tail, n, err := c.src.ExportTail(1)
			if err != nil || n != 11 {
				t.Fatalf("tail of %d positions (%v), want 11", n, err)
			}
			// Two stages: three pages, then the last page and the tail.
			if err := c.dst.AppendPages(7, pages[:3], nil, 0); err != nil {
				t.Fatal(err)
			}
			if err := c.dst.AppendPages(7, pages[3:], tail, n); err != nil {
				t.Fatal(err)
			}
			if c.dst.Len(7) != 75 || c.dst.FreePages() != 64-5 {
				t.Fatalf("destination holds %d positions, %d pages free; want 75 and 59", c.dst.Len(7), c.dst.FreePages())
			}
			if err := c.dst.AppendPages(7, pages[:1], nil, 0); err == nil {
				t.Fatal("appended past a partial page")
			}
			// Both continue with the same token.
			next := []Chunk{{Seq: 1, Tokens: out[0], Sample: 1, OutIndex: 1}}
			a, err := c.src.Forward(ctx, next)
			if err != nil {
				t.Fatal(err)
			}
			next[0].Seq = 7
			b, err := c.dst.Forward(ctx, next)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(a[0], b[0]) {
				t.Fatalf("after the append the destination samples %v, the source %v", b[0], a[0])
			}
			c.dst.Release(7)
			if c.dst.FreePages() != 64 {
				t.Fatalf("%d pages free after the release", c.dst.FreePages())
			}
		})
	}
}

// TestAppendPagesRefusals: out of pages and a sequence that does not end on
// a page boundary change nothing.
func TestAppendPagesRefusals(t *testing.T) {
	src, _ := NewSynthetic(SyntheticConfig{Pages: 8})
	dst, _ := NewSynthetic(SyntheticConfig{Pages: 2})
	if _, err := src.Forward(context.Background(), []Chunk{{Seq: 1, Tokens: make([]int32, 48), Sample: 1}}); err != nil {
		t.Fatal(err)
	}
	var pages [][]byte
	for i := range 3 {
		p, _ := src.ExportPage(1, i)
		pages = append(pages, p)
	}
	if err := dst.AppendPages(1, pages, nil, 0); !errors.Is(err, ErrOutOfPages) {
		t.Fatalf("3 pages into 2: %v", err)
	}
	if dst.FreePages() != 2 || dst.Len(1) != 0 {
		t.Fatalf("a refused append changed the engine: %d free, %d positions", dst.FreePages(), dst.Len(1))
	}
	if tail, n, err := src.ExportTail(1); tail != nil || n != 0 || err != nil {
		t.Fatalf("a whole number of pages has a tail: %d positions, %v", n, err)
	}
}
