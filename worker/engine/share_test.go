package engine

import (
	"context"
	"math/rand"
	"slices"
	"testing"

	"github.com/lumen-project/lumen/tokenizer"
)

// decode feeds tokens to seq (one chunk) and then its samples one at a
// time until it has n tokens, greedy.
func decode(t *testing.T, e Engine, seq SeqID, tokens []int32, n int) []int32 {
	t.Helper()
	ctx := context.Background()
	out, err := e.Forward(ctx, []Chunk{{Seq: seq, Tokens: tokens, Sample: 1}})
	if err != nil {
		t.Fatal(err)
	}
	gen := []int32{out[0][0]}
	for len(gen) < n {
		out, err = e.Forward(ctx, []Chunk{{Seq: seq, Tokens: gen[len(gen)-1:], Sample: 1, OutIndex: len(gen)}})
		if err != nil {
			t.Fatal(err)
		}
		gen = append(gen, out[0][0])
	}
	return gen
}

// TestSharePrefixIsBitIdentical: a sequence that starts with another's
// full pages by reference (prefix caching on) decodes greedily exactly the
// tokens it decodes computing them itself (off), while the owner goes on
// writing its own pages and after the owner is released; the shared pages
// count once and are freed with their last holder; a truncation into a
// shared page copies it and leaves the other holder's outputs unchanged.
func TestSharePrefixIsBitIdentical(t *testing.T) {
	seed := int64(rand.Uint32())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	const total = 64
	e := newEngine(t, total)
	tok := func(n int) []int32 {
		p := make([]int32, n)
		for i := range p {
			p[i] = int32(rng.Intn(tokenizer.VocabSize))
		}
		return p
	}
	shared := tok(3 * PageTokens) // three full pages
	pa, pb := append(slices.Clip(shared), tok(7)...), append(slices.Clip(shared), tok(11)...)
	wantA, wantB := reference(t, e, request{prompt: pa, max: 20}), reference(t, e, request{prompt: pb, max: 20})

	// a computes its prompt; b shares a's three full pages and computes
	// the rest of its own.
	ctx := context.Background()
	outA, err := e.Forward(ctx, []Chunk{{Seq: 1, Tokens: pa, Sample: 1}})
	if err != nil {
		t.Fatal(err)
	}
	used := total - e.FreePages()
	if err := e.SharePrefix(2, 1, 3); err != nil {
		t.Fatal(err)
	}
	if e.Len(2) != 3*PageTokens || total-e.FreePages() != used {
		t.Fatalf("after sharing: b holds %d positions, %d pages in use (want %d, %d)", e.Len(2), total-e.FreePages(), 3*PageTokens, used)
	}
	gotB := decode(t, e, 2, pb[3*PageTokens:], 10)
	// a goes on decoding beside b, then is released; b finishes alone.
	gotA := []int32{outA[0][0]}
	for len(gotA) < 20 {
		out, err := e.Forward(ctx, []Chunk{{Seq: 1, Tokens: gotA[len(gotA)-1:], Sample: 1, OutIndex: len(gotA)}})
		if err != nil {
			t.Fatal(err)
		}
		gotA = append(gotA, out[0][0])
	}
	e.Release(1)
	for len(gotB) < 20 {
		out, err := e.Forward(ctx, []Chunk{{Seq: 2, Tokens: gotB[len(gotB)-1:], Sample: 1, OutIndex: len(gotB)}})
		if err != nil {
			t.Fatal(err)
		}
		gotB = append(gotB, out[0][0])
	}
	if !slices.Equal(gotA, wantA) || !slices.Equal(gotB, wantB) {
		t.Fatalf("with shared pages: a %v b %v; computed alone: a %v b %v", gotA, gotB, wantA, wantB)
	}
	e.Release(2)
	if e.FreePages() != total {
		t.Fatalf("%d of %d pages free after both released", e.FreePages(), total)
	}

	// c shares d's pages and truncates into the second (copy on write),
	// then recomputes from there: d's outputs are its reference's, and so
	// are c's.
	outD, err := e.Forward(ctx, []Chunk{{Seq: 3, Tokens: pa, Sample: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.SharePrefix(4, 3, 3); err != nil {
		t.Fatal(err)
	}
	cut := PageTokens + 5
	if err := e.Truncate(4, cut); err != nil {
		t.Fatal(err)
	}
	// c's tokens after the cut differ from d's: written into d's page
	// they would change d's outputs.
	pc := append(slices.Clip(shared[:cut]), tok(30)...)
	wantC := reference(t, e, request{prompt: pc, max: 20})
	gotC := decode(t, e, 4, pc[cut:], 20)
	// d decodes over its pages after c wrote past the cut.
	gotD := []int32{outD[0][0]}
	for len(gotD) < 20 {
		out, err := e.Forward(ctx, []Chunk{{Seq: 3, Tokens: gotD[len(gotD)-1:], Sample: 1, OutIndex: len(gotD)}})
		if err != nil {
			t.Fatal(err)
		}
		gotD = append(gotD, out[0][0])
	}
	e.Release(3)
	if !slices.Equal(gotC, wantC) || !slices.Equal(gotD, wantA) {
		t.Fatalf("after a truncation into a shared page: c %v d %v, want %v and %v", gotC, gotD, wantC, wantA)
	}
	if err := e.Truncate(3, 0); err == nil {
		t.Fatal("truncated a released sequence")
	}
	if n := e.Len(4)/PageTokens + 1; e.SharePrefix(5, 4, n) == nil {
		t.Fatalf("shared %d full pages of a sequence holding %d positions", n, e.Len(4))
	}
	e.Release(4)
	if e.FreePages() != total {
		t.Fatalf("%d of %d pages free at the end", e.FreePages(), total)
	}
}
