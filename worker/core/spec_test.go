package core

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/lumen-project/lumen/worker/engine"
)

// cpuishCost is a step-cost model whose verification positions are dear
// (0.3 ms each against 0.1 ms per decoding row): adaptive K drafts at
// batch 1 and stops (K = 0) from a few rows on, so K changes with the
// batch inside one run.
func cpuishCost(s engine.StepShape) time.Duration {
	p := engine.Profile{DecodeBaseMs: 2, DecodePerSeqMs: 0.1, VerifyPerPosMs: 0.3, PrefillTokensPerSec: 1e5}
	return p.Step(s)
}

func gpuCost(name string) func(s engine.StepShape) time.Duration {
	p := engine.Profiles[name]
	return p.Step
}

// TestSpecOracle runs a target Core and a Drafter in one loop over real
// engines — the transformer with its early-exit draft, and the synthetic
// engine with a draft that errs at a random rate — through random request
// mixes (varied lengths, greedy and seeded sampling, stop tokens),
// batching, chunked prefill and preemption under few KV pages, with the
// drafts delayed, dropped and reordered, the mirror stream delayed, updates
// landing mid-step, fixed and adaptive K changing mid-run, the pairing reset
// mid-run (also mid-step), calls superseded and canceled. Every request's
// tokens must be those of a run without speculation, every checkpoint page
// the speculating target exports must equal the plain run's page byte for
// byte, and both engines must end with every page free.
func TestSpecOracle(t *testing.T) {
	seed := testSeed(t)
	for _, backend := range []string{"synthetic", "transformer"} {
		t.Run(backend, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, uint64(len(backend))))
			trials, n, maxPrompt, maxOut := 300, 14, 60, 60
			if raceEnabled {
				trials = 100
			}
			var ref engine.Engine = newSynthetic(t, 4096)
			if backend == "transformer" {
				trials, n, maxPrompt, maxOut = 8, 10, 60, 48
				if raceEnabled || testing.Short() {
					trials, n, maxPrompt, maxOut = 2, 4, 20, 20
				}
				ref = newTransformer(t, false, 1024)
			}
			var sum specRig
			// A short run (race, -short) may by chance accept no draft:
			// the early-exit draft agrees rarely on some mixes. Trials go
			// on past the count until the run is not vacuous (at most
			// fourfold), so the checks below always have something to hold.
			vacuous := func() bool {
				return sum.total.Verifications == 0 || sum.total.AcceptedTokens == 0 || sum.comparedPages == 0 ||
					(backend == "synthetic" && sum.sampledAccepted == 0)
			}
			for trial := 0; trial < trials || (vacuous() && trial < 4*trials); trial++ {
				g := oracleTrial(t, rng, backend, ref, 2+rng.IntN(n), maxPrompt, maxOut)
				t.Logf("trial %d: %v", trial, g)
				if t.Failed() {
					t.Fatalf("seed %d, trial %d", seed, trial)
				}
				sum.total.Verifications += g.total.Verifications
				sum.total.AcceptedTokens += g.total.AcceptedTokens
				sum.sampledAccepted += g.sampledAccepted
				sum.total.Preemptions += g.total.Preemptions
				sum.comparedPages += g.comparedPages
				sum.resets += g.resets
				sum.total.RestoredPages += g.total.RestoredPages
			}
			if sum.total.Verifications == 0 || sum.total.AcceptedTokens == 0 || sum.comparedPages == 0 {
				t.Fatalf("seed %d: a vacuous run: %d verifications, %d drafts accepted, %d checkpoint pages compared",
					seed, sum.total.Verifications, sum.total.AcceptedTokens, sum.comparedPages)
			}
			// The early-exit draft drafts greedily; the synthetic one
			// agrees with sampled tokens too.
			if backend == "synthetic" && sum.sampledAccepted == 0 {
				t.Fatalf("seed %d: no draft accepted for a request that samples", seed)
			}
			if sum.total.Preemptions == 0 || sum.resets == 0 || sum.total.RestoredPages == 0 {
				t.Logf("no preemption, reset or restore happened (%d, %d, %d): the mix is too easy for this seed",
					sum.total.Preemptions, sum.resets, sum.total.RestoredPages)
			}
		})
	}
}

// oracleTrial runs one random trial and returns its rig (for counters).
func oracleTrial(t *testing.T, rng *rand.Rand, backend string, ref engine.Engine, n, maxPrompt, maxOut int) *specRig {
	reqs := randomSpecReqs(rng, n, maxPrompt, maxOut, rng.IntN(30))
	referenceRun(t, ref, reqs)
	addStops(rng, reqs)
	need := 0
	for _, q := range reqs {
		need = max(need, PagesFor(len(q.prompt)+q.max))
	}
	// Few target pages: requests admitted short grow into a squeeze.
	tgtPages, dftPages := need+rng.IntN(need+1), need+rng.IntN(4*need)
	var tgt, dft engine.Engine
	if backend == "transformer" {
		tgt, dft = newTransformer(t, false, tgtPages), newTransformer(t, true, dftPages)
	} else {
		tgt, dft = newSynthetic(t, tgtPages), newSynthetic(t, dftPages)
	}
	// The target holds the requests' checkpoints too: a call that takes
	// a request over restores its pages, then prefills the rest.
	store := memStore{}
	c := New(Config{Self: "self", TokenBudget: 8 + rng.IntN(64), MaxRunning: 1 + rng.IntN(8), MaxWaiting: 64, TotalPages: tgtPages}, store)
	g := newSpecRig(t, rng, c, tgt)
	g.holder, g.store = "h", store
	k := 1 + rng.IntN(DefaultKMax)
	g.withDrafter(NewDrafter(k), dft)
	g.dr.SetMaxContext(dft.Info().MaxContext)
	if backend == "synthetic" {
		g.agree = 0.3 + 0.7*rng.Float64()
	}
	v := tgt.Info().Vocab
	g.specCfgs = []SpecConfig{{K: 0}, {K: 1, Vocab: v}, {K: 2}, {K: 4, Vocab: v}, {K: 7},
		{Adaptive: true, KMax: 1 + rng.IntN(8), Cost: cpuishCost, Vocab: v}, {Adaptive: true, Cost: gpuCost("qwen3-14b-h100")}}
	c.SetSpec(SpecConfig{K: k, Vocab: v})
	// A third of the trials run a drafter that keeps up over a perfect
	// link, the rest a slow drafter over a link that loses and delays.
	switch rng.IntN(3) {
	case 0:
		g.faults = specFaults{midStepUpdate: 0.3, changeK: 0.02, supersede: 0.01}
	case 1:
		g.faults = specFaults{updateDelay: 1, draftDelay: 1, dropDraft: 0.1, reorderDraft: 0.1, midStepUpdate: 0.3,
			reset: 0.01, midStepReset: 0.005, changeK: 0.03, supersede: 0.02, cancel: 0.005, draftSteps: 2 + 2*k}
	default:
		g.faults = specFaults{updateDelay: rng.IntN(3), draftDelay: rng.IntN(4), dropDraft: rng.Float64() * 0.3,
			reorderDraft: rng.Float64() * 0.3, midStepUpdate: rng.Float64() * 0.5, reset: rng.Float64() * 0.02,
			midStepReset: rng.Float64() * 0.01, changeK: rng.Float64() * 0.05, supersede: rng.Float64() * 0.03,
			cancel: rng.Float64() * 0.01, draftSteps: 1 + rng.IntN(4)}
	}
	g.run(reqs)
	return g
}

// TestSpecTruncationLeavesThePlainKV: a verification whose third draft is
// wrong, crossing a page boundary, commits two drafts and the target's token
// and cuts the cache back to them; the page that filled is the plain run's,
// byte for byte, and so is every page after it.
func TestSpecTruncationLeavesThePlainKV(t *testing.T) {
	q := &specReq{id: "a", prompt: []int32{72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33}, max: 24}
	referenceRun(t, newTransformer(t, false, 64), []*specReq{q})
	tgt := newTransformer(t, false, 8)
	c := New(Config{Self: "self", TokenBudget: 64, MaxRunning: 4, MaxWaiting: 4, TotalPages: 8}, nil)
	c.SetSpec(SpecConfig{K: 4})
	g := newSpecRig(t, nil, c, tgt)
	g.holder = "h"
	var verified bool
	g.beforeStep = func() {
		r := c.Lookup("a")
		if r == nil || len(r.History) != 14 || verified {
			return
		}
		verified = true
		// History 14 (13 + ref[0]), 13 positions cached: the chunk is
		// positions 13..17, over the page boundary at 16.
		wrong := (q.ref[3]-32+1)%95 + 32
		c.OfferDrafts("a", 14, []int32{q.ref[1], q.ref[2], wrong, q.ref[4]})
	}
	g.run([]*specReq{q})
	if !verified || g.total.Verifications != 1 || g.total.AcceptedTokens != 2 || g.total.DraftTokens != 4 {
		t.Fatalf("verifications %d, accepted %d of %d; want 1, 2 of 4", g.total.Verifications, g.total.AcceptedTokens, g.total.DraftTokens)
	}
	if want := (13 + 24 - 1) / engine.PageTokens; g.comparedPages != want {
		t.Fatalf("%d checkpoint pages compared with the plain run's, want %d", g.comparedPages, want)
	}
}

// TestSpecStopsAndMaxTokensInsideAnAcceptedRun: drafts that run past a stop
// token, or past the last output token, commit up to it and no further,
// and the request ends there with its sequence freed.
func TestSpecStopsAndMaxTokensInsideAnAcceptedRun(t *testing.T) {
	for _, tc := range []struct {
		name string
		max  int
		stop int // output index of the stop token (-1: none)
	}{{"stop", 30, 5}, {"max tokens", 6, -1}} {
		t.Run(tc.name, func(t *testing.T) {
			q := &specReq{id: "a", prompt: []int32{80, 81, 82, 83, 84}, max: tc.max}
			referenceRun(t, newSynthetic(t, 64), []*specReq{q})
			if tc.stop >= 0 {
				// The stop token must not occur earlier in the reference.
				for slices.Contains(q.ref[:tc.stop], q.ref[tc.stop]) {
					tc.stop++
				}
				q.stop = map[int32]bool{q.ref[tc.stop]: true}
				q.setWant()
			}
			c := New(Config{Self: "self", TokenBudget: 64, MaxRunning: 4, MaxWaiting: 4, TotalPages: 16}, nil)
			c.SetSpec(SpecConfig{K: 8})
			g := newSpecRig(t, nil, c, newSynthetic(t, 16))
			g.beforeStep = func() {
				if r := c.Lookup("a"); r != nil && r.Outputs() == 2 {
					c.OfferDrafts("a", len(r.History), q.ref[2:min(len(q.ref), 12)]) // all correct
				}
			}
			g.run([]*specReq{q})
			if g.total.Verifications != 1 {
				t.Fatalf("%d verifications, want 1", g.total.Verifications)
			}
			if g.steps != 3 {
				t.Fatalf("%d steps, want 3: prefill, a decode, the verification that ends it", g.steps)
			}
		})
	}
}

// TestSpecDraftsThatDoNotFit: drafts shrink to the free pages, the token
// budget and the output left, and a request's stale or superseded drafts
// are never verified.
func TestSpecDraftsThatDoNotFit(t *testing.T) {
	q := &specReq{id: "a", prompt: make([]int32, 15), max: 30}
	for i := range q.prompt {
		q.prompt[i] = int32(40 + i)
	}
	referenceRun(t, newSynthetic(t, 64), []*specReq{q})
	c := New(Config{Self: "self", TokenBudget: 4, MaxRunning: 4, MaxWaiting: 4}, nil) // TotalPages unknown: the request could not finish in 2 pages
	c.SetSpec(SpecConfig{K: 8})
	c.Submit(&Request{ID: "a", History: slices.Clone(q.prompt), Prompt: 15, MaxTokens: 30})
	now := time.Unix(0, 0)
	// The prefill (15 tokens in chunks of 4).
	for i := 0; i < 4; i++ {
		st := c.Next(now, 2-c.CachedPages())
		out := make([][]int32, len(st.Batch))
		if st.Batch[0].Sample == 1 {
			out[0] = []int32{q.ref[0]}
		}
		c.Done(now, out)
	}
	r := c.Lookup("a")
	if r.fed != 15 || r.Outputs() != 1 {
		t.Fatalf("after the prefill: fed %d, %d outputs", r.fed, r.Outputs())
	}
	// Budget 4: three drafts at most, whatever is offered.
	c.OfferDrafts("a", 16, q.ref[1:9])
	st := c.Next(now, 2-c.CachedPages())
	if got := st.Batch[0].Sample; got != 4 {
		t.Fatalf("a verification of %d positions under a budget of 4", got)
	}
	c.Done(now, [][]int32{q.ref[1:5]})
	if r.Outputs() != 5 || r.fed != 19 {
		t.Fatalf("after the verification: %d outputs, fed %d; want 5, 19", r.Outputs(), r.fed)
	}
	// Stale drafts (their first tokens disagree with the history) are
	// dropped; drafts for a position beyond the history are ignored.
	c.Output()
	c.OfferDrafts("a", 18, []int32{(q.ref[3]-32+1)%95 + 32, q.ref[4], q.ref[5], q.ref[6]})
	if st := c.Next(now, 2-c.CachedPages()); st.Batch[0].Sample != 1 {
		t.Fatalf("stale drafts verified: %+v", st.Batch[0])
	}
	c.Done(now, [][]int32{{q.ref[5]}})
	c.OfferDrafts("a", 30, q.ref[12:20])
	if st := c.Next(now, 2-c.CachedPages()); st.Batch[0].Sample != 1 {
		t.Fatalf("drafts from beyond the history verified: %+v", st.Batch[0])
	}
	c.Done(now, [][]int32{{q.ref[6]}})
	// Late drafts whose first tokens the target committed are verified
	// from the history on.
	c.OfferDrafts("a", 20, q.ref[5:12])
	if st := c.Next(now, 2-c.CachedPages()); st.Batch[0].Sample != 4 || !slices.Equal(st.Batch[0].Tokens, q.ref[6:10]) {
		t.Fatalf("late drafts: %+v, want the last token and ref[7:10]", st.Batch[0])
	}
	c.Done(now, [][]int32{q.ref[7:11]})
	if r.Outputs() != 11 {
		t.Fatalf("%d outputs after the late drafts, want 11", r.Outputs())
	}

	// Pages: one free page past a full one bounds the drafts to it.
	c2 := New(Config{Self: "self", TokenBudget: 64, MaxRunning: 4, MaxWaiting: 4}, nil)
	c2.SetSpec(SpecConfig{K: 8})
	c2.Submit(&Request{ID: "b", History: slices.Clone(q.prompt), Prompt: 15, MaxTokens: 30})
	st = c2.Next(now, 2)
	c2.Done(now, [][]int32{{q.ref[0]}})
	c2.OfferDrafts("b", 16, q.ref[1:30])
	// 15 cached in one page; one page free: positions 15..31, so the last
	// token and 16 drafts would fit, K = 8 allows 8.
	if st = c2.Next(now, 1); st.Batch[0].Sample != 9 {
		t.Fatalf("verification of %d positions with a page free, want 9", st.Batch[0].Sample)
	}
	c2.Done(now, [][]int32{q.ref[1:10]})
	// 24 cached, 2 pages held, none free: 7 positions left in the page.
	if st = c2.Next(now, 0); st.Batch[0].Sample != 8 {
		t.Fatalf("verification of %d positions in the 8 left of the last page, want 8", st.Batch[0].Sample)
	}
}

// TestChooseK checks adaptive K against the Qwen3-14B/H100 step costs.
func TestChooseK(t *testing.T) {
	p := engine.Profiles["qwen3-14b-h100"]
	cost := func(rows, k int) time.Duration { return p.StepTimeK(rows, k, 0) }
	at := func(rows int) func(int) time.Duration { return func(k int) time.Duration { return cost(rows, k) } }
	// Small batch: verification is nearly free, drafting pays even at a
	// low acceptance.
	for _, rows := range []int{1, 8} {
		for _, alpha := range []float64{0.3, 0.5, 0.7, 0.9} {
			if k := ChooseK(alpha, DefaultKMax, at(rows)); k < 1 {
				t.Errorf("B = %d, α = %.1f: K = %d, want ≥ 1", rows, alpha, k)
			}
		}
	}
	// Large batch, low acceptance: the extra positions cost more than they
	// commit (B = 128: one draft adds 6.4 ms to 26.2).
	for _, c := range []struct {
		rows  int
		alpha float64
	}{{128, 0.2}, {256, 0.3}, {512, 0.3}} {
		if k := ChooseK(c.alpha, DefaultKMax, at(c.rows)); k != 0 {
			t.Errorf("B = %d, α = %.1f: K = %d, want 0", c.rows, c.alpha, k)
		}
	}
	// K never falls as acceptance rises, nor rises with the batch.
	for _, rows := range []int{1, 8, 32, 128, 512} {
		prev := 0
		for a := 0.0; a < 1; a += 0.05 {
			k := ChooseK(a, DefaultKMax, at(rows))
			if k < prev {
				t.Errorf("B = %d: K %d at α = %.2f after %d", rows, k, a, prev)
			}
			prev = k
		}
	}
	for a := 0.1; a < 1; a += 0.1 {
		prev := DefaultKMax
		for _, rows := range []int{1, 8, 32, 128, 512} {
			k := ChooseK(a, DefaultKMax, at(rows))
			if k > prev {
				t.Errorf("α = %.1f: K %d at B = %d after %d", a, k, rows, prev)
			}
			prev = k
		}
	}
	// The choice is the argmax of tokens per unit time with a drafter one
	// step behind (PipelinedTokens).
	for _, rows := range []int{1, 32, 128} {
		for _, a := range []float64{0.3, 0.6, 0.85} {
			k := ChooseK(a, DefaultKMax, at(rows))
			best := PipelinedTokens(a, k) / float64(cost(rows, k))
			for j := 0; j <= DefaultKMax; j++ {
				if r := PipelinedTokens(a, j) / float64(cost(rows, j)); r > best*(1+1e-9) {
					t.Errorf("B = %d, α = %.2f: K = %d gives %.4g tokens/ns, K = %d %.4g", rows, a, k, best, j, r)
				}
			}
		}
	}
	if k := ChooseK(0.9, 3, at(1)); k != 3 {
		t.Errorf("K = %d beyond KMax 3", k)
	}
	if k := ChooseK(0.9, 8, func(int) time.Duration { return 0 }); k != 0 {
		t.Errorf("no cost known: K = %d, want 0", k)
	}
}

func TestExpectedTokens(t *testing.T) {
	for _, c := range []struct {
		alpha float64
		k     int
		want  float64
	}{{0, 4, 1}, {1, 4, 5}, {0.5, 0, 1}, {0.5, 1, 1.5}, {0.7, 4, (1 - math.Pow(0.7, 5)) / 0.3}, {0.9, 8, (1 - math.Pow(0.9, 9)) / 0.1}} {
		if got := ExpectedTokens(c.alpha, c.k); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("ExpectedTokens(%v, %d) = %v, want %v", c.alpha, c.k, got, c.want)
		}
	}
}

// TestAcceptanceConverges verifies drafts each right with probability α
// (so the accepted run is geometric) and checks the Core's estimate
// converges to α and the tokens committed per verification to
// ExpectedTokens(α, K).
func TestAcceptanceConverges(t *testing.T) {
	seed := testSeed(t)
	const k = 4
	for _, alpha := range []float64{0.3, 0.6, 0.9} {
		t.Run(fmt.Sprint(alpha), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, math.Float64bits(alpha)))
			var reqs []*specReq
			for i := range 8 {
				q := &specReq{id: fmt.Sprintf("r%d", i), max: 400, prompt: []int32{int32(40 + i), 50, 60}}
				reqs = append(reqs, q)
			}
			referenceRun(t, newSynthetic(t, 1024), reqs)
			c := New(Config{Self: "self", TokenBudget: 256, MaxRunning: 8, MaxWaiting: 8, TotalPages: 512}, nil)
			c.SetSpec(SpecConfig{K: k})
			if a := c.Acceptance(); math.Abs(a-PriorAcceptance) > 1e-9 {
				t.Fatalf("acceptance %v before any verification, want the prior %v", a, PriorAcceptance)
			}
			g := newSpecRig(t, nil, c, newSynthetic(t, 512))
			byID := map[string]*specReq{}
			for _, q := range reqs {
				byID[q.id] = q
			}
			g.beforeStep = func() {
				for _, r := range c.running {
					ref, pos := byID[r.ID].ref, r.Outputs()
					d := make([]int32, 0, k)
					for j := 0; j < k && pos+j < len(ref); j++ {
						tok := ref[pos+j]
						if rng.Float64() >= alpha {
							tok = (tok-32+1)%95 + 32
						}
						d = append(d, tok)
					}
					c.OfferDrafts(r.ID, len(r.History), d)
				}
			}
			g.run(reqs)
			if got := c.Acceptance(); math.Abs(got-alpha) > 0.06 {
				t.Errorf("seed %d: estimated acceptance %.3f, true %.2f", seed, got, alpha)
			}
			perVerify := float64(g.total.AcceptedTokens+g.total.Verifications) / float64(g.total.Verifications)
			if want := ExpectedTokens(alpha, k); math.Abs(perVerify-want)/want > 0.06 {
				t.Errorf("seed %d: %.3f tokens per verification, ExpectedTokens %.3f", seed, perVerify, want)
			}
			t.Logf("α %.2f: estimate %.3f, %.3f tokens per verification (expected %.3f), %v", alpha, c.Acceptance(), perVerify, ExpectedTokens(alpha, k), g)
		})
	}
}

// TestMirrorUpdates: a request the drafter has not seen comes whole, then
// its new tokens; requests that ended, were canceled or superseded while
// waiting come as Ended, in id order; a call superseded and running again
// comes whole; Reset starts over.
func TestMirrorUpdates(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 0))
	h := newHarness(t, 64, Config{MaxRunning: 2}, nil)
	var m Mirror
	if ups := m.Updates(h.c); len(ups) != 0 {
		t.Fatalf("updates from an idle core: %+v", ups)
	}
	pa, pb, pc := prompt(rng, 5), prompt(rng, 7), prompt(rng, 3)
	a := h.submit("a", pa, nil, 10)
	if ups := m.Updates(h.c); len(ups) != 0 {
		t.Fatalf("a waiting request mirrored: %+v", ups)
	}
	h.step()
	want := func(what string, got []MirrorUpdate, want ...MirrorUpdate) {
		t.Helper()
		ok := len(got) == len(want)
		for i := 0; ok && i < len(got); i++ {
			ok = got[i].ID == want[i].ID && got[i].From == want[i].From && got[i].Ended == want[i].Ended && slices.Equal(got[i].Tokens, want[i].Tokens)
		}
		if !ok {
			t.Fatalf("%s: updates\n %+v\nwant\n %+v", what, got, want)
		}
	}
	want("first", m.Updates(h.c), MirrorUpdate{ID: "a", From: 0, Tokens: a.History})
	h.step()
	want("delta", m.Updates(h.c), MirrorUpdate{ID: "a", From: 6, Tokens: a.History[6:7]})
	want("nothing new", m.Updates(h.c))
	b := h.submit("b", pb, nil, 10)
	h.step()
	want("a new one, in running order", m.Updates(h.c), MirrorUpdate{ID: "a", From: 7, Tokens: a.History[7:8]}, MirrorUpdate{ID: "b", From: 0, Tokens: b.History})
	// b's call is taken over by a new one, which waits: Ended for b.
	h.submit("c", pc, nil, 1)
	b2 := h.submit("b", pb, h.out["b"], 10)
	want("superseded while waiting", m.Updates(h.c), MirrorUpdate{ID: "b", Ended: true})
	h.step() // b2 (resumed) is admitted ahead of c
	want("the new call", m.Updates(h.c), MirrorUpdate{ID: "a", From: 8, Tokens: a.History[8:9]}, MirrorUpdate{ID: "b", From: 0, Tokens: b2.History})
	// Superseded and running again before the mirror looked: whole, no Ended.
	b3 := h.submit("b", pb, h.out["b"], 10)
	h.step()
	ups := m.Updates(h.c)
	if i := slices.IndexFunc(ups, func(u MirrorUpdate) bool { return u.ID == "b" }); i < 0 || ups[i].From != 0 || ups[i].Ended || !slices.Equal(ups[i].Tokens, b3.History) {
		t.Fatalf("a call superseded and running again: %+v", ups)
	}
	// Several leave at once: in id order, after the running ones.
	h.c.Cancel(b3)
	h.c.Cancel(a)
	h.apply()
	h.step() // c runs and ends (1 token)
	// c ran and ended between two looks: the drafter never heard of it.
	want("ended, in id order", m.Updates(h.c), MirrorUpdate{ID: "a", Ended: true}, MirrorUpdate{ID: "b", Ended: true})
	d := h.submit("d", pa, nil, 5)
	h.step()
	m.Updates(h.c)
	m.Reset()
	want("after Reset", m.Updates(h.c), MirrorUpdate{ID: "d", From: 0, Tokens: d.History})
}

// TestSpecBadDraftsNeverFailAStep: draft tokens come from another worker
// over the network; one outside the vocabulary must not fail the target's
// step (which would end every request in it): the drafts from it on are
// dropped.
func TestSpecBadDraftsNeverFailAStep(t *testing.T) {
	q := &specReq{id: "a", prompt: []int32{70, 71, 72}, max: 12}
	referenceRun(t, newSynthetic(t, 16), []*specReq{q})
	syn := newSynthetic(t, 16)
	vocab := syn.Info().Vocab
	c := New(Config{Self: "self", TokenBudget: 64, MaxRunning: 4, MaxWaiting: 4, TotalPages: 16}, nil)
	c.SetSpec(SpecConfig{K: 4, Vocab: vocab})
	g := newSpecRig(t, nil, c, syn)
	bad := [][]int32{{-1}, {int32(vocab)}, {1 << 30}}
	offered := 0
	g.beforeStep = func() {
		r := c.Lookup("a")
		if r == nil || r.Outputs() == 0 || offered == len(bad) {
			return
		}
		// One good draft, then a bad token, then good ones again.
		i := r.Outputs()
		c.OfferDrafts("a", len(r.History), slices.Concat([]int32{q.ref[i]}, bad[offered], q.ref[i+2:i+4]))
		offered++
	}
	g.run([]*specReq{q})
	if g.total.Verifications != len(bad) || g.total.DraftTokens != len(bad) || g.total.AcceptedTokens != len(bad) {
		t.Fatalf("%d verifications of %d drafts, %d accepted; want each good draft before a bad token verified alone",
			g.total.Verifications, g.total.DraftTokens, g.total.AcceptedTokens)
	}
}
