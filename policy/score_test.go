package policy

import (
	"math"
	"math/rand"
	"testing"
	"time"
)

// TestHolderScoreIsRoundedLikeEveryArch: h(r)'s score q + λ·p must round
// the product before the sum on every architecture. The Go spec lets a
// compiler fuse x*y + z into one FMA (arm64 does; amd64 does from GOAMD64=v3),
// and a fused score can order two workers differently from an unfused one, so
// a mixed quorum would pick different holders for the same log entry. Run it
// with GOAMD64=v3 (or on arm64) to see a fused score.
func TestHolderScoreIsRoundedLikeEveryArch(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	differ := 0 // cases where a fused score would differ
	for i := 0; i < 100000; i++ {
		w := Worker{QueueWaitMs: rng.Float64() * 100, Held: uint32(1 + rng.Intn(50)),
			Reserved: uint64(rng.Int63n(1 << 34)), H2DBytesPerSec: 1e9 + rng.Float64()*3e10}
		lambda := rng.Float64() * 4
		p := w.RestoreDelayMs()
		want := w.QueueWaitMs + float64(lambda*p) // explicit conversion: rounded product
		if math.FMA(lambda, p, w.QueueWaitMs) != want {
			differ++
		}
		if got := holderScore(&w, lambda); got != want {
			t.Fatalf("holderScore(q=%v, held=%d, reserved=%d, h2d=%v, λ=%v) = %v, want the rounded %v (fused is %v)",
				w.QueueWaitMs, w.Held, w.Reserved, w.H2DBytesPerSec, lambda, got, want, math.FMA(lambda, p, w.QueueWaitMs))
		}
	}
	if differ == 0 {
		t.Fatal("no case where fusing would change the score: the test checks nothing")
	}
	t.Logf("%d of 100000 scores would differ if fused", differ)
}

// TestHolderSpreadsCopies: h(r) must spread checkpoints over the workers
// rather than pile them on the one with the lowest q_w. With the seed's
// p_w(r) (the mean footprint of what w holds) every worker holding one
// copy of the same size scores the same, and every later copy went to the
// lowest-index (or lowest-q_w) worker: 73 of 80 here. p_w(r) over the
// total footprint held makes each copy cost its holder's restore queue.
func TestHolderSpreadsCopies(t *testing.T) {
	const (
		n         = 9 // worker 0 serves, 1..8 may hold
		copies    = 80
		footprint = 2048 * 163840 // 2k tokens of Qwen3-14B KV
	)
	ws := make([]Worker, n)
	for i := range ws {
		ws[i] = Worker{ID: string(rune('a' + i)), Eligible: true, QueueWaitMs: 20,
			CheckpointBudget: 1 << 40, H2DBytesPerSec: 25e9}
	}
	ws[1].QueueWaitMs = 10 // the least loaded worker: it should take more, not all
	idx := NewHolderIndex(ws, 1)
	for range copies {
		h, why := ChooseHolder(Lumen, ws, idx, 0, footprint, 1)
		if h < 0 {
			t.Fatalf("no holder: %v", why)
		}
		ws[h].Held++
		ws[h].Reserved += footprint
		idx.Update(h, &ws[h])
		if ref, _ := PickHolder(ws[:], 0, footprint, 1); ref < 0 {
			t.Fatal("the reference found no holder")
		}
	}
	most, least := 0, copies
	for i := 1; i < n; i++ {
		most, least = max(most, int(ws[i].Held)), min(least, int(ws[i].Held))
	}
	// 80 copies over 8 holders: 10 each; the 10 ms lead in q_w is worth
	// 10 ms / 13.4 ms a copy, less than one copy.
	if most-least > 2 {
		held := make([]uint32, n)
		for i := range ws {
			held[i] = ws[i].Held
		}
		t.Fatalf("copies per worker %v: h(r) piles them (most %d, least %d)", held, most, least)
	}
}
