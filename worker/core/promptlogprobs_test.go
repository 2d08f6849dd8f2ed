package core

import (
	"context"
	"errors"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/lumen-project/lumen/worker/engine"
)

// promptReference scores p in one chunk on a fresh synthetic engine:
// prompt token i's logprobs (i ≥ 1) with k alternatives.
func promptReference(t *testing.T, p []int32, k int) []engine.Logprobs {
	t.Helper()
	e, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 1024})
	if err != nil {
		t.Fatal(err)
	}
	scores := make([]engine.Logprobs, len(p)-1)
	if _, err := e.Forward(context.Background(), []engine.Chunk{{Seq: 1, Tokens: p, Sample: 1, Targets: p[1:], Scores: scores, TopLogprobs: k}}); err != nil {
		t.Fatal(err)
	}
	return scores
}

// TestPromptLogprobs: a request asking for its prompt's logprobs gets them
// on its first token — prompt tokens 1 … n−1's, as one chunk scores them —
// however its prefill is chunked (a token budget of 40 for a 100-token
// prompt), beside other requests, and through a preemption that recomputes
// it; its outputs are the reference's; it refuses to migrate before its
// first token. Seeded; the seed is printed.
func TestPromptLogprobs(t *testing.T) {
	const seed = 41
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	long, short := prompt(rng, 100), prompt(rng, 37)
	for _, tc := range []struct {
		name   string
		pages  int
		budget int
	}{
		{"one chunk", 256, 512},
		{"chunked", 256, 40},
		// 14 pages: the two requests' prompts (7 + 3 pages) and their
		// decodes outgrow them, and the newer is preempted.
		{"preempted", 14, 40},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.pages, Config{TokenBudget: tc.budget, Preemption: PreemptVLLM}, nil)
			var first []engine.Logprobs
			seen := 0
			a := &Request{ID: "a", History: append([]int32(nil), long...), Prompt: len(long), MaxTokens: 60, Arrived: h.now,
				PromptLogprobs: true, TopLogprobs: 3}
			h.c.Submit(a)
			h.apply()
			if err := h.c.MigrateOut("a", 0); !errors.Is(err, ErrScoringPrompt) {
				t.Fatalf("migrating out before the first token: %v, want ErrScoringPrompt", err)
			}
			h.submit("b", short, nil, 60)
			for i := 0; !h.c.Idle(); i++ {
				if i > 10000 {
					t.Fatal("no progress")
				}
				st := h.c.Next(h.now, h.eng.FreePages())
				h.apply()
				if len(st.Batch) == 0 {
					continue
				}
				out, err := h.eng.Forward(context.Background(), st.Batch)
				if err != nil {
					t.Fatal(err)
				}
				h.c.Done(h.now, out)
				o := h.c.Output()
				for _, s := range o.Release {
					h.eng.Release(s)
				}
				for _, ev := range o.Events {
					if ev.Err != nil {
						t.Fatalf("%s: %v", ev.Req.ID, ev.Err)
					}
					if ev.PromptLogprobs != nil {
						if ev.Req.ID != "a" || !ev.First {
							t.Fatalf("prompt logprobs on %s's token %d", ev.Req.ID, ev.Index)
						}
						first = ev.PromptLogprobs
						seen++
					}
					h.out[ev.Req.ID] = append(h.out[ev.Req.ID], ev.Token)
				}
				h.total.Preemptions += o.Preemptions
			}
			if seen != 1 {
				t.Fatalf("prompt logprobs came %d times, want once", seen)
			}
			if want := promptReference(t, long, 3); !reflect.DeepEqual(first, want) {
				t.Fatalf("prompt logprobs differ from one chunk's scores:\n got  %v\n want %v", first, want)
			}
			if got, want := h.out["a"], reference(t, long, 60); !reflect.DeepEqual(got, want) {
				t.Fatalf("a's outputs differ from the reference")
			}
			if got, want := h.out["b"], reference(t, short, 60); !reflect.DeepEqual(got, want) {
				t.Fatalf("b's outputs differ from the reference")
			}
			if tc.name == "preempted" && h.total.Preemptions == 0 {
				t.Fatal("nothing was preempted: the case tests nothing")
			}
			t.Logf("%d preemptions", h.total.Preemptions)
		})
	}
}

// TestPromptLogprobsBypassTheCache: with the prefix cache on, a request
// that scores its prompt prefills all of it — no hit on the pages an
// earlier request with the same prompt left — and gets every prompt
// token's logprobs; one that does not score hits the cache.
func TestPromptLogprobsBypassTheCache(t *testing.T) {
	rng := rand.New(rand.NewPCG(43, 0))
	p := prompt(rng, 80)
	h := newHarness(t, 256, Config{PrefixCache: true}, nil)
	run := func(id string, score bool) (got []engine.Logprobs, hitTokens int) {
		r := &Request{ID: id, History: append([]int32(nil), p...), Prompt: len(p), MaxTokens: 4, Arrived: h.now, PromptLogprobs: score, TopLogprobs: 2}
		h.c.Submit(r)
		h.apply()
		for !h.c.Idle() {
			st := h.c.Next(h.now, h.eng.FreePages()-h.c.EvictablePages())
			o := h.c.Output()
			hitTokens += o.CacheHitTokens
			for _, s := range o.Release {
				h.eng.Release(s)
			}
			if len(st.Batch) == 0 {
				continue
			}
			out, err := h.eng.Forward(context.Background(), st.Batch)
			if err != nil {
				t.Fatal(err)
			}
			h.c.Done(h.now, out)
			o = h.c.Output()
			for _, s := range o.Release {
				h.eng.Release(s)
			}
			for _, ev := range o.Events {
				if ev.Err != nil {
					t.Fatalf("%s: %v", id, ev.Err)
				}
				if ev.PromptLogprobs != nil {
					got = ev.PromptLogprobs
				}
			}
		}
		return got, hitTokens
	}
	run("warm", false)
	if _, hit := run("hit", false); hit == 0 {
		t.Fatal("a repeat of the prompt hit nothing: the cache is not on, the test tests nothing")
	}
	got, hit := run("scored", true)
	if hit != 0 {
		t.Fatalf("the scoring request took %d tokens from the cache", hit)
	}
	if want := promptReference(t, p, 2); !reflect.DeepEqual(got, want) {
		t.Fatalf("prompt logprobs with the cache on differ from one chunk's scores")
	}
}
