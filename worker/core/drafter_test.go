package core

import (
	"context"
	"slices"
	"testing"

	"github.com/lumen-project/lumen/worker/engine"
)

// draftRig drives a Drafter over a real synthetic engine as its protocol
// says: Apply, Next, run the batch, Done, then apply Output to the engine.
type draftRig struct {
	t      *testing.T
	d      *Drafter
	eng    *engine.Synthetic
	pages  int
	drafts map[string]Draft // the latest drafts sent, by request
	last   DrafterOutput
}

func newDraftRig(t *testing.T, k, pages int) *draftRig {
	eng, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: pages})
	if err != nil {
		t.Fatal(err)
	}
	return &draftRig{t: t, d: NewDrafter(k), eng: eng, pages: pages, drafts: map[string]Draft{}}
}

// apply carries out the Drafter's Output on the engine and checks that the
// engine holds what the Drafter counts.
func (g *draftRig) apply() DrafterOutput {
	g.t.Helper()
	o := g.d.Output()
	for _, s := range o.Release {
		g.eng.Release(s)
	}
	for _, tr := range o.Truncates {
		if err := g.eng.Truncate(tr.Seq, tr.Len); err != nil {
			g.t.Fatalf("truncate: %v", err)
		}
	}
	for _, dr := range o.Drafts {
		g.drafts[dr.ID] = dr
	}
	if free := g.eng.FreePages(); free != g.pages-g.d.CachedPages() {
		g.t.Fatalf("draft engine has %d free pages, the drafter counts %d in use of %d", free, g.d.CachedPages(), g.pages)
	}
	for _, r := range g.d.reqs {
		if n := g.eng.Len(r.seq); n != r.fed {
			g.t.Fatalf("request %s: the draft cache holds %d positions, the drafter counts %d", r.id, n, r.fed)
		}
	}
	g.last = o
	return o
}

// step runs one draft step; it returns the step (empty: nothing to draft).
func (g *draftRig) step() DraftStep {
	g.t.Helper()
	st := g.d.Next(g.eng.FreePages())
	if len(st.Batch) == 0 {
		return st
	}
	out, err := g.eng.Forward(context.Background(), st.Batch)
	if err != nil {
		g.t.Fatalf("draft forward: %v", err)
	}
	g.d.Done(out)
	g.apply()
	return st
}

// until runs draft steps until nothing is left to draft.
func (g *draftRig) until() int {
	n := 0
	for ; len(g.step().Batch) > 0; n++ {
		if n > 1000 {
			g.t.Fatal("the drafter never settles")
		}
	}
	return n
}

// greedy is the synthetic model's greedy continuation of h, n tokens.
func greedy(t *testing.T, h []int32, n int) []int32 { return reference(t, h, n) }

func TestDrafterLookaheadAndPositions(t *testing.T) {
	const k = 3
	g := newDraftRig(t, k, 64)
	hist := []int32{40, 41, 42, 43, 44, 45, 46}
	g.d.Apply(MirrorUpdate{ID: "a", From: 0, Tokens: hist})
	g.apply()
	st := g.step()
	if len(st.Batch) != 1 || !slices.Equal(st.Batch[0].Tokens, hist) || st.Batch[0].Sample != 1 || st.Pos[0] != len(hist) {
		t.Fatalf("first draft step %+v, want the whole history sampling position %d", st, len(hist))
	}
	g.until()
	want := greedy(t, hist, 2*k+1)
	if dr := g.drafts["a"]; dr.Base != len(hist) || !slices.Equal(dr.Tokens, want) {
		t.Fatalf("drafts %+v, want base %d and the lookahead 2K+1 = %v", dr, len(hist), want)
	}
	// Each step after the prefill fed exactly the last draft.
	if r := g.d.reqs["a"]; r.fed != len(hist)+2*k {
		t.Fatalf("draft cache %d positions, want %d (every draft but the last)", r.fed, len(hist)+2*k)
	}
}

// TestDrafterFollowsTheTarget: committed tokens equal to the drafts keep the
// drafts beyond them and the cache; a mismatch truncates the cache at the
// first wrong draft and replays from the target's token.
func TestDrafterFollowsTheTarget(t *testing.T) {
	const k = 2
	g := newDraftRig(t, k, 64)
	hist := []int32{50, 51, 52, 53, 54}
	g.d.Apply(MirrorUpdate{ID: "a", Tokens: hist})
	g.until()
	line := g.drafts["a"].Tokens // 5 drafts
	// The target accepts two drafts and its own token equals the third.
	g.d.Apply(MirrorUpdate{ID: "a", From: len(hist), Tokens: line[:3]})
	if o := g.apply(); len(o.Truncates) != 0 {
		t.Fatalf("matching tokens truncated the draft cache: %+v", o.Truncates)
	}
	r := g.d.reqs["a"]
	if !slices.Equal(r.drafts(), line[3:]) || r.fed != len(hist)+4 {
		t.Fatalf("drafts %v fed %d; want %v kept and the cache untouched", r.drafts(), r.fed, line[3:])
	}
	st := g.step()
	if len(st.Batch) != 1 || !slices.Equal(st.Batch[0].Tokens, line[4:5]) || st.Pos[0] != len(hist)+5 {
		t.Fatalf("after acceptance the step feeds %v at %v, want the last draft", st.Batch, st.Pos)
	}
	g.until()
	h2 := append(slices.Clone(hist), line[:3]...)
	if dr := g.drafts["a"]; dr.Base != len(h2) || len(dr.Tokens) != 2*k+1 {
		t.Fatalf("drafts %+v, want %d from base %d", dr, 2*k+1, len(h2))
	}
	// The target rejects the first draft beyond h2: its token differs.
	wrong := (g.drafts["a"].Tokens[0]-32+1)%95 + 32
	g.d.Apply(MirrorUpdate{ID: "a", From: len(h2), Tokens: []int32{wrong}})
	o := g.apply()
	if len(o.Truncates) != 1 || o.Truncates[0].Len != len(h2) {
		t.Fatalf("truncates %+v, want the cache cut at %d (the first wrong draft)", o.Truncates, len(h2))
	}
	st = g.step()
	if len(st.Batch) != 1 || !slices.Equal(st.Batch[0].Tokens, []int32{wrong}) || st.Pos[0] != len(h2)+1 {
		t.Fatalf("replay %+v, want the target's token fed, sampling position %d", st, len(h2)+1)
	}
	g.until()
	h3 := append(slices.Clone(h2), wrong)
	if dr := g.drafts["a"]; dr.Base != len(h3) || !slices.Equal(dr.Tokens, greedy(t, h3, 2*k+1)) {
		t.Fatalf("drafts after the replay %+v, want the greedy continuation of the target's history", dr)
	}
	// A history the target went beyond the drafts with, in one update.
	more := greedy(t, h3, 2*k+4)
	more[2*k+3] = (more[2*k+3]-32+1)%95 + 32
	g.d.Apply(MirrorUpdate{ID: "a", From: len(h3), Tokens: more})
	g.apply()
	g.until()
	h4 := append(slices.Clone(h3), more...)
	if dr := g.drafts["a"]; dr.Base != len(h4) || !slices.Equal(dr.Tokens, greedy(t, h4, 2*k+1)) {
		t.Fatalf("drafts %+v after a history longer than the line", dr)
	}
}

// TestDrafterSetK: K = 0 stops drafting; a larger K drafts further.
func TestDrafterSetK(t *testing.T) {
	g := newDraftRig(t, 1, 64)
	g.d.Apply(MirrorUpdate{ID: "a", Tokens: []int32{60, 61, 62}})
	g.until()
	if n := len(g.drafts["a"].Tokens); n != 3 {
		t.Fatalf("%d drafts at K = 1, want 3", n)
	}
	g.d.SetK(0)
	g.d.Apply(MirrorUpdate{ID: "b", Tokens: []int32{70, 71}})
	if st := g.step(); len(st.Batch) != 0 {
		t.Fatalf("K = 0 drafts: %+v", st)
	}
	g.d.SetK(-3)
	if g.d.K() != 0 {
		t.Fatalf("K %d after SetK(-3)", g.d.K())
	}
	g.d.SetK(4)
	g.until()
	if na, nb := len(g.drafts["a"].Tokens), len(g.drafts["b"].Tokens); na != 9 || nb != 9 {
		t.Fatalf("%d and %d drafts at K = 4, want 9", na, nb)
	}
}

// TestDrafterQueuesUpdatesDuringAStep: an update that arrives between Next
// and Done waits for Done; the step's tokens land first.
func TestDrafterQueuesUpdatesDuringAStep(t *testing.T) {
	g := newDraftRig(t, 2, 64)
	g.d.Apply(MirrorUpdate{ID: "a", Tokens: []int32{80, 81, 82, 83}})
	g.d.Apply(MirrorUpdate{ID: "b", Tokens: []int32{90, 91}})
	g.apply()
	g.step()
	st := g.d.Next(g.eng.FreePages())
	if len(st.Batch) != 2 {
		t.Fatalf("batch %+v", st.Batch)
	}
	ra := g.d.reqs["a"]
	fedA := ra.fed
	g.d.Apply(MirrorUpdate{ID: "b", Ended: true})
	g.d.Apply(MirrorUpdate{ID: "a", From: 4, Tokens: []int32{1}}) // a mismatch
	g.d.Apply(MirrorUpdate{ID: "c", Tokens: []int32{100, 101}})
	if g.d.Requests() != 2 || ra.fed != fedA || len(g.d.out.Release)+len(g.d.out.Truncates) != 0 {
		t.Fatalf("updates applied during the step: %d requests, fed %d (was %d), output %+v", g.d.Requests(), ra.fed, fedA, g.d.out)
	}
	out, err := g.eng.Forward(context.Background(), st.Batch)
	if err != nil {
		t.Fatal(err)
	}
	g.d.Done(out)
	o := g.apply()
	if len(o.Release) != 1 || len(o.Truncates) != 1 || o.Truncates[0].Len != 4 || g.d.Requests() != 2 {
		t.Fatalf("after Done: %+v, %d requests; want b released, a cut at 4, c added", o, g.d.Requests())
	}
	if _, ok := g.d.reqs["c"]; !ok {
		t.Fatal("c not added at Done")
	}
	g.until()
}

// TestDrafterResetFreesEverything: Reset releases every draft sequence, also
// between Next and Done, and updates queued during the step (the pairing's
// old stream) do not come back after it.
func TestDrafterResetFreesEverything(t *testing.T) {
	g := newDraftRig(t, 3, 32)
	for i, id := range []string{"a", "b", "c"} {
		h := make([]int32, 20+7*i)
		for j := range h {
			h[j] = int32(32 + (i*13+j*5)%95)
		}
		g.d.Apply(MirrorUpdate{ID: id, Tokens: h})
	}
	g.apply()
	g.step()
	g.step()
	st := g.d.Next(g.eng.FreePages())
	if len(st.Batch) == 0 {
		t.Fatal("nothing to draft")
	}
	// The old pairing's stream delivered an update mid-step, then the
	// pairing ended.
	g.d.Apply(MirrorUpdate{ID: "a", From: 20, Tokens: []int32{33}})
	g.d.Apply(MirrorUpdate{ID: "d", Tokens: []int32{1, 2, 3}})
	g.d.Reset()
	out, err := g.eng.Forward(context.Background(), st.Batch)
	if err != nil {
		t.Fatal(err)
	}
	g.d.Done(out)
	o := g.apply()
	if g.d.Requests() != 0 || g.d.CachedPages() != 0 || g.eng.FreePages() != 32 || len(o.Drafts) != 0 {
		t.Fatalf("after Reset: %d requests, %d cached pages, %d of 32 free, drafts %+v", g.d.Requests(), g.d.CachedPages(), g.eng.FreePages(), o.Drafts)
	}
	// A new pairing starts clean and drafts again.
	g.d.Apply(MirrorUpdate{ID: "a", Tokens: []int32{40, 41, 42}})
	g.until()
	g.d.Reset()
	g.apply()
	if g.eng.FreePages() != 32 || g.d.Requests() != 0 {
		t.Fatalf("%d of 32 pages free after the second Reset", g.eng.FreePages())
	}
}

// TestDrafterIgnoresAGap: an update that does not continue what the
// drafter has (its stream lost one) adds nothing.
func TestDrafterIgnoresAGap(t *testing.T) {
	g := newDraftRig(t, 2, 16)
	g.d.Apply(MirrorUpdate{ID: "x", From: 5, Tokens: []int32{1}})
	if g.d.Requests() != 0 {
		t.Fatalf("a request created from a gap: %d requests", g.d.Requests())
	}
	g.d.Apply(MirrorUpdate{ID: "a", Tokens: []int32{40, 41}})
	g.d.Apply(MirrorUpdate{ID: "a", From: 3, Tokens: []int32{42}})
	if r := g.d.reqs["a"]; r.n != 2 {
		t.Fatalf("a gap changed the history: %v", r.hist())
	}
}

// TestDrafterPageLimit: with too few pages a request waits; the others
// draft, and nothing overflows.
func TestDrafterPageLimit(t *testing.T) {
	g := newDraftRig(t, 2, 3)
	long := make([]int32, 40) // 3 pages
	for i := range long {
		long[i] = int32(32 + i)
	}
	g.d.Apply(MirrorUpdate{ID: "a", Tokens: []int32{40, 41}})
	g.d.Apply(MirrorUpdate{ID: "b", Tokens: long})
	g.apply()
	g.until()
	if n := len(g.drafts["a"].Tokens); n != 5 {
		t.Fatalf("a drafted %d", n)
	}
	if _, ok := g.drafts["b"]; ok {
		t.Fatal("b drafted without the pages for its history")
	}
	g.d.Apply(MirrorUpdate{ID: "a", Ended: true})
	g.apply()
	g.until()
	// 40 + 4 fed positions fit in 3 pages; the fifth draft is not fed.
	if n := len(g.drafts["b"].Tokens); n != 5 {
		t.Fatalf("b drafted %d after a left, want 5", n)
	}
}

// TestDrafterTruncateThenEnd: a request cut back and then ended before the
// caller collects Output is only released (its truncation would name a
// sequence the release already freed).
func TestDrafterTruncateThenEnd(t *testing.T) {
	g := newDraftRig(t, 2, 16)
	g.d.Apply(MirrorUpdate{ID: "a", Tokens: []int32{40, 41, 42}})
	g.until()
	g.d.Apply(MirrorUpdate{ID: "a", From: 3, Tokens: []int32{(g.drafts["a"].Tokens[0]-32+1)%95 + 32}})
	g.d.Apply(MirrorUpdate{ID: "a", Ended: true})
	if o := g.apply(); len(o.Release) != 1 || len(o.Truncates) != 0 {
		t.Fatalf("output %+v, want the release alone", o)
	}
	if g.eng.FreePages() != 16 {
		t.Fatalf("%d of 16 pages free", g.eng.FreePages())
	}
}

// TestDrafterStopsAtTheContext: a request whose line reaches the draft
// engine's context drafts no further — one that did would fail the draft
// step, and with it the drafts of every request, at every retry.
func TestDrafterStopsAtTheContext(t *testing.T) {
	eng, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 16, MaxContext: 64})
	if err != nil {
		t.Fatal(err)
	}
	g := &draftRig{t: t, d: NewDrafter(4), eng: eng, pages: 16, drafts: map[string]Draft{}}
	g.d.SetMaxContext(eng.Info().MaxContext)
	long := make([]int32, 60)
	for i := range long {
		long[i] = int32(32 + i)
	}
	g.d.Apply(MirrorUpdate{ID: "a", Tokens: long})
	g.d.Apply(MirrorUpdate{ID: "b", Tokens: long[:10]})
	g.until()
	// a: positions 60..64 drafted (64 fed at most), b: the whole lookahead.
	if na, nb := len(g.drafts["a"].Tokens), len(g.drafts["b"].Tokens); na != 5 || nb != 9 {
		t.Fatalf("a drafted %d (want 5, up to the context), b %d (want 9)", na, nb)
	}
	// A history past the draft's context drafts nothing, and harms none.
	g.d.Apply(MirrorUpdate{ID: "c", Tokens: append(slices.Clone(long), long[:10]...)})
	g.d.Apply(MirrorUpdate{ID: "b", From: 10, Tokens: g.drafts["b"].Tokens[:3]})
	g.until()
	if _, ok := g.drafts["c"]; ok {
		t.Fatal("c drafted beyond the context")
	}
	if nb := len(g.drafts["b"].Tokens); nb != 9 {
		t.Fatalf("b has %d drafts after c came, want 9", nb)
	}
}
