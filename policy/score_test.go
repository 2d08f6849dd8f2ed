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
