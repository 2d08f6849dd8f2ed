package placer

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
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

// TestPrefixScoreOverCommitted: an over-committed worker's freeness is the
// pages it is short (policy.Freeness), and a hit then counts in pages too
// (overlap × batch / (1 + waiting)): a worker caching the prompt wins
// against one less short by fewer pages than the hit is worth. Counted
// as a share per request (overlap / (1 + waiting)), the hit was lost
// against any difference in pages short, and at llm-d's load ladder past
// saturation every group's requests scattered. The score is continuous
// where the sum crosses 0, and with pages to spare it is the line of
// TestPickPrefixIsContinuous.
func TestPrefixScoreOverCommitted(t *testing.T) {
	// a: 1000 used and 300 queued pages, 10 running, 2 waiting: 300
	// short; b: 200 short, the same batch. a caches 100 pages of the
	// prompt, worth 100 × 12 / 3 = 400 pages: 100 free.
	a := worker("a", 1000, 10, 2)
	a.QueuedPages = 300
	b := worker("b", 1000, 10, 2)
	b.QueuedPages = 200
	if got := PrefixScore(&a, 0); got != -300 {
		t.Fatalf("a without a hit scores %g, want -300 (the pages short)", got)
	}
	if got, want := PrefixScore(&a, 100), 100.0/12; got != want {
		t.Fatalf("a with a 100-page hit scores %g, want %g", got, want)
	}
	if got := PickPrefix([]policy.Worker{a, b}, []int{100, 0}); got != 0 {
		t.Fatalf("chose %d: b, 100 pages less short, over a caching 100 pages of the prompt", got)
	}
	// A 20-page hit is worth 80 pages: a stays 220 short, b wins.
	if got := PickPrefix([]policy.Worker{a, b}, []int{20, 0}); got != 1 {
		t.Fatalf("chose %d: a 20-page hit outweighed 100 pages short", got)
	}
	// Continuous and rising in the overlap across the sum's 0 (a hit of
	// 75 pages is worth the 300 short).
	prev := PrefixScore(&a, 0)
	for o := 1; o <= 150; o++ {
		s := PrefixScore(&a, o)
		if s <= prev || s-prev > 4.0+1e-9 {
			t.Fatalf("overlap %d: score %g after %g (a step, or not rising)", o, s, prev)
		}
		prev = s
	}
	// With pages to spare it is Freeness + overlap / (1 + waiting).
	c := worker("c", 400, 10, 2)
	if got, want := PrefixScore(&c, 30), c.Freeness()+30.0/3; math.Abs(got-want) > 1e-9 {
		t.Fatalf("c scores %g, want %g", got, want)
	}
}

// TestTakePrefix: a lone gateway's replica chooses the worker holding the
// prompt's prefix when it is not much busier, counts the placement there
// like Take, and with no overlap chooses what Take chooses.
func TestTakePrefix(t *testing.T) {
	tab := &pb.LoadTable{AppliedIndex: 5, Workers: []*pb.WorkerLoad{
		row("w1", 1, full, 40, 2), row("w2", 3, full, 45, 3)}}
	r, plain := New(), New()
	r.Update(tab)
	plain.Update(tab)
	x := NewPrefixIndex()
	hashes := []uint64{11, 12, 13, 14}
	w, _, ok := r.TakePrefix("a", 64, hashes, x)
	want, _, _ := plain.Take("a", 64)
	if !ok || w != want || w != "w1" {
		t.Fatalf("no overlap: took %s (%v), Take took %s", w, ok, want)
	}
	// Without the prefix w1 is still the freer, (100−40−4)/3 ≈ 18.7
	// against (100−45)/3 ≈ 18.3; w2 holding the prompt's 4 pages adds 4.
	if w, _, _ := plain.Take("b", 64); w != "w1" {
		t.Fatalf("without the prefix Take took %s", w)
	}
	x.Apply("w2", hashes, nil)
	if w, inc, ok := r.TakePrefix("b", 64, hashes, x); !ok || w != "w2" || inc != 3 {
		t.Fatalf("w2 holds the prompt: took %s@%d (%v)", w, inc, ok)
	}
	if vs := r.Views(); vs[1].PendingRequests != 1 || vs[0].PendingRequests != 1 {
		t.Fatalf("own placements not counted: %+v", vs)
	}
	// Excluded, w2 is not chosen whatever it holds.
	if w, _, _ := r.TakePrefix("c", 64, hashes, x, "w2"); w != "w1" {
		t.Fatalf("took %s, excluded", w)
	}
}

// TestPrefixIndexMatchesReference: the inverted index answers Overlaps as
// the per-worker walk does (each worker's hashes from the first, until one
// is missing), through random stores, removals, resets and replacements
// over shared and private prefixes, with ws sorted and shuffled (seed
// printed).
func TestPrefixIndexMatchesReference(t *testing.T) {
	seed := uint64(rand.Uint32())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 2))
	const workers = 70 // more than one word of slots
	x := NewPrefixIndex()
	ref := map[string]map[uint64]bool{}
	ids := make([]string, workers)
	for i := range ids {
		ids[i] = fmt.Sprintf("w%03d", i)
	}
	// Prompts: chains over a small alphabet, so prefixes are shared.
	chain := func() []uint64 {
		h := make([]uint64, 1+rng.IntN(12))
		for i := range h {
			h[i] = uint64(rng.IntN(4))<<8 | uint64(i)
			if i > 0 {
				h[i] ^= h[i-1] << 16
			}
		}
		return h
	}
	for step := range 4000 {
		w := ids[rng.IntN(workers)]
		if ref[w] == nil {
			ref[w] = map[uint64]bool{}
		}
		switch op := rng.IntN(20); {
		case op < 12:
			st := chain()
			var rm []uint64
			if rng.IntN(3) == 0 {
				rm = chain()
			}
			x.Apply(w, st, rm)
			for _, h := range st {
				ref[w][h] = true
			}
			for _, h := range rm {
				delete(ref[w], h)
			}
		case op < 14:
			x.Reset(w)
			delete(ref, w)
		case op < 15:
			st := chain()
			x.Replace(w, st)
			ref[w] = map[uint64]bool{}
			for _, h := range st {
				ref[w][h] = true
			}
		default:
			ws := make([]policy.Worker, 0, workers)
			for _, id := range ids {
				if rng.IntN(4) > 0 {
					ws = append(ws, worker(id, 0, 0, 0))
				}
			}
			if rng.IntN(2) == 0 {
				rng.Shuffle(len(ws), func(i, j int) { ws[i], ws[j] = ws[j], ws[i] })
			}
			q := chain()
			got := x.Overlaps(ws, q, nil)
			for i := range ws {
				want := 0
				for _, h := range q {
					if !ref[ws[i].ID][h] {
						break
					}
					want++
				}
				if got[i] != want {
					t.Fatalf("step %d: %s overlaps %d of %v, want %d", step, ws[i].ID, got[i], q, want)
				}
			}
		}
		if n := x.Len(w); n != len(ref[w]) {
			t.Fatalf("step %d: %s holds %d hashes, want %d", step, w, n, len(ref[w]))
		}
	}
}
