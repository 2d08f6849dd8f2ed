package placer

import (
	"math/rand/v2"
	"testing"

	"github.com/lumen-project/lumen/policy"
)

func worker(id string, used uint64, running, waiting uint32) policy.Worker {
	return policy.Worker{ID: id, Eligible: true, KVPagesTotal: 1000, KVPagesUsed: used, Running: running, Waiting: waiting}
}

// TestPrefixIndexOverlap: a worker's overlap is the run of the prompt's
// hashes, from the first, its events stored and did not remove; a reset
// forgets the worker.
func TestPrefixIndexOverlap(t *testing.T) {
	x := NewPrefixIndex()
	ws := []policy.Worker{worker("a", 0, 0, 0), worker("b", 0, 0, 0), worker("c", 0, 0, 0)}
	x.Apply("a", []uint64{1, 2, 3, 4}, nil)
	x.Apply("b", []uint64{1, 2, 3}, []uint64{2})
	x.Apply("c", []uint64{2, 3}, nil) // no first page: no overlap
	got := x.Overlaps(ws, []uint64{1, 2, 3, 9}, nil)
	if got[0] != 3 || got[1] != 1 || got[2] != 0 {
		t.Fatalf("overlaps %v, want [3 1 0]", got)
	}
	x.Reset("a")
	if got := x.Overlaps(ws, []uint64{1, 2, 3}, got); got[0] != 0 || x.Len("a") != 0 {
		t.Fatalf("after a's reset: overlap %d, %d hashes", got[0], x.Len("a"))
	}
}

// TestPickPrefixIsPickServingWithoutOverlap: with no overlap anywhere the
// choice is exactly policy.PickServing's, on random views (seed printed).
func TestPickPrefixIsPickServingWithoutOverlap(t *testing.T) {
	seed := uint64(rand.Uint32())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	for range 2000 {
		ws := make([]policy.Worker, 1+rng.IntN(8))
		for i := range ws {
			ws[i] = worker(string(rune('a'+i)), uint64(rng.IntN(1000)), uint32(rng.IntN(40)), uint32(rng.IntN(5)))
			ws[i].Eligible = rng.IntN(5) > 0
			ws[i].PendingPages = uint64(rng.IntN(100))
		}
		if a, b := PickPrefix(ws, make([]int, len(ws))), policy.PickServing(ws); a != b {
			t.Fatalf("views %+v: PickPrefix %d, PickServing %d", ws, a, b)
		}
	}
}

// TestPickPrefixIsContinuous: the affinity a cached prefix buys is worth
// its pages, so a worker holding it wins against a freer one until the
// other's freeness exceeds it by the overlap; and it shrinks as the
// holder's queue grows, with no step: the score falls strictly with every
// request waiting there, and the choice moves to the freer worker at the
// queue where the discounted overlap no longer covers the gap.
func TestPickPrefixIsContinuous(t *testing.T) {
	// b is freer by 10 pages a request: (1000−500)/10 = 50 against
	// (1000−400)/10 = 60.
	ws := []policy.Worker{worker("a", 500, 10, 0), worker("b", 400, 10, 0)}
	for _, c := range []struct{ overlap, want int }{{0, 1}, {9, 1}, {11, 0}, {300, 0}} {
		if got := PickPrefix(ws, []int{c.overlap, 0}); got != c.want {
			t.Errorf("a holds %d pages of the prompt: chose %d, want %d", c.overlap, got, c.want)
		}
	}
	// a holds 100 pages; its queue grows: the score falls continuously.
	prev := PrefixScore(&ws[0], 100)
	switched := -1
	for q := uint32(1); q <= 40; q++ {
		ws[0].Waiting = q
		s := PrefixScore(&ws[0], 100)
		if s >= prev {
			t.Fatalf("queue %d: score %g, not below %g at %d", q, s, prev, q-1)
		}
		prev = s
		if switched < 0 && PickPrefix(ws, []int{100, 0}) == 1 {
			switched = int(q)
		}
	}
	// Freeness of a with q waiting: 500/(10+q); the hit 100/(1+q); b's 60.
	want := -1
	for q := 1; q <= 40; q++ {
		if 500.0/float64(10+q)+100.0/float64(1+q) < 60 {
			want = q
			break
		}
	}
	if switched != want || want < 0 {
		t.Fatalf("the choice moved to b at a queue of %d, want %d", switched, want)
	}
	// An ineligible worker is never chosen, whatever it holds.
	ws[0].Eligible = false
	if got := PickPrefix(ws, []int{1000, 0}); got != 1 {
		t.Fatalf("chose %d, an ineligible worker", got)
	}
	ws[1].Eligible = false
	if got := PickPrefix(ws, []int{1000, 0}); got != -1 {
		t.Fatalf("chose %d with no worker eligible", got)
	}
}
