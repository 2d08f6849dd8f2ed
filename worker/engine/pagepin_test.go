package engine

import (
	"context"
	"math/rand"
	"slices"
	"testing"
)

// TestSharePagesAndAdopt, on both engines: a holder of one page (what the
// daemon's prefix cache keeps per cached page) keeps exactly that page; a
// sequence that filled the same prefix itself gives its copies up for the
// holders' (AdoptPage) and decodes on unchanged; a new sequence made of the
// holders' pages (SharePages) decodes what it decodes from scratch; and
// releasing a holder frees its page whatever holds the pages after it.
func TestSharePagesAndAdopt(t *testing.T) {
	seed := int64(rand.Uint32())
	t.Logf("seed %d", seed)
	const total = 48
	engines := map[string]func() Engine{
		"transformer": func() Engine { return newEngine(t, total) },
		"synthetic": func() Engine {
			e, err := NewSynthetic(SyntheticConfig{Pages: total, MaxContext: 1024})
			if err != nil {
				t.Fatal(err)
			}
			return e
		},
	}
	for name, mk := range engines {
		t.Run(name, func(t *testing.T) {
			rng := rand.New(rand.NewSource(seed))
			e := mk()
			sh := e.(PageSharer)
			vocab := int(e.Info().Vocab)
			tok := func(n int) []int32 {
				p := make([]int32, n)
				for i := range p {
					p[i] = int32(1 + rng.Intn(vocab-1))
				}
				return p
			}
			prefix := tok(3 * PageTokens)
			pa, pb, pc := append(slices.Clip(prefix), tok(5)...), append(slices.Clip(prefix), tok(9)...), append(slices.Clip(prefix), tok(2)...)
			want := map[SeqID][]int32{}
			for i, p := range [][]int32{pa, pb, pc} {
				want[SeqID(i+1)] = decode(t, e, 90, p, 8)
				e.Release(90)
			}
			if e.FreePages() != total {
				t.Fatalf("%d of %d pages free before the test", e.FreePages(), total)
			}
			ctx := context.Background()
			// a prefills in one chunk, b page by page: the same prefix's
			// KV computed twice.
			outA, err := e.Forward(ctx, []Chunk{{Seq: 1, Tokens: pa, Sample: 1}})
			if err != nil {
				t.Fatal(err)
			}
			for i := 0; i < 3; i++ {
				if _, err := e.Forward(ctx, []Chunk{{Seq: 2, Tokens: pb[i*PageTokens : (i+1)*PageTokens]}}); err != nil {
					t.Fatal(err)
				}
			}
			holders := []SeqID{100, 101, 102}
			var from []PageRef
			for i, hd := range holders {
				if err := sh.SharePages(hd, []PageRef{{Seq: 1, Page: i}}); err != nil {
					t.Fatal(err)
				}
				from = append(from, PageRef{Seq: hd})
			}
			before := e.FreePages()
			for i, hd := range holders {
				if err := sh.AdoptPage(2, i, PageRef{Seq: hd}); err != nil {
					t.Fatal(err)
				}
			}
			if got := e.FreePages(); got != before+3 {
				t.Fatalf("adopting 3 pages: %d free, want %d (b's copies freed)", got, before+3)
			}
			gotB := decode(t, e, 2, pb[3*PageTokens:], 8)
			gotA := []int32{outA[0][0]}
			for len(gotA) < 8 {
				out, err := e.Forward(ctx, []Chunk{{Seq: 1, Tokens: gotA[len(gotA)-1:], Sample: 1, OutIndex: len(gotA)}})
				if err != nil {
					t.Fatal(err)
				}
				gotA = append(gotA, out[0][0])
			}
			e.Release(1)
			e.Release(2)
			if got := total - e.FreePages(); got != 3 {
				t.Fatalf("%d pages in use with only the 3 holders left", got)
			}
			// c starts with the holders' pages.
			if err := sh.SharePages(3, from); err != nil {
				t.Fatal(err)
			}
			if got := total - e.FreePages(); got != 3 || e.Len(3) != 3*PageTokens {
				t.Fatalf("after sharing: %d pages in use, c holds %d positions (want 3, %d)", got, e.Len(3), 3*PageTokens)
			}
			gotC := decode(t, e, 3, pc[3*PageTokens:], 8)
			for seq, got := range map[SeqID][]int32{1: gotA, 2: gotB, 3: gotC} {
				if !slices.Equal(got, want[seq]) {
					t.Fatalf("sequence %d decoded %v, from scratch %v", seq, got, want[seq])
				}
			}
			e.Release(3)
			// The first page's holder goes while the later pages' stay:
			// its page is freed at once.
			e.Release(100)
			if got := total - e.FreePages(); got != 2 {
				t.Fatalf("%d pages in use after the first holder went, want 2", got)
			}
			if err := sh.SharePages(4, []PageRef{{Seq: 101, Page: 1}}); err == nil {
				t.Fatal("shared page 1 of a one-page holder")
			}
			if err := sh.AdoptPage(101, 0, PageRef{Seq: 77}); err == nil {
				t.Fatal("adopted a page of a sequence that does not exist")
			}
			e.Release(101)
			e.Release(102)
			if e.FreePages() != total {
				t.Fatalf("%d of %d pages free at the end", e.FreePages(), total)
			}
		})
	}
}
