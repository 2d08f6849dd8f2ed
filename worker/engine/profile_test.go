package engine

import "testing"

// TestSaturatedRate: the throughput model the recovery benchmark and the
// simulator calibrate against.
func TestSaturatedRate(t *testing.T) {
	p, ok, err := LookupProfile("qwen3-14b-h100")
	if err != nil || !ok {
		t.Fatalf("profile: %v %v", ok, err)
	}
	perWorker, batch := p.SaturatedRate(4, 1000, 200)
	if batch != 4 || perWorker <= 0 {
		t.Fatalf("a cap of 4 running: batch %d, %v req/s", batch, perWorker)
	}
	// The KV cache bounds the batch when the cap does not.
	_, big := p.SaturatedRate(1<<20, 1000, 200)
	if big >= 1<<20 || big < 4 {
		t.Fatalf("uncapped batch %d", big)
	}
	// Longer requests fit fewer at once and complete fewer per second.
	slow, longBatch := p.SaturatedRate(1<<20, 4000, 800)
	if longBatch > big || slow >= perWorker*float64(big)/4 {
		t.Fatalf("longer requests: batch %d (short: %d), %v req/s", longBatch, big, slow)
	}
}
