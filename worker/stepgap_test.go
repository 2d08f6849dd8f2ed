package worker

import (
	"context"
	"slices"
	"testing"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// TestStepGapCountsHostTimeNotIdle: lumen_worker_step_gap_seconds_total
// counts the host's time between the steps of a running request, and not
// the time the worker waited for work: a request that arrives after an
// idle spell adds at most its own call's time, however long the spell.
func TestStepGapCountsHostTimeNotIdle(t *testing.T) {
	h := start(t, 256, nil)
	ctx := context.Background()
	run := func(id string, prompt []int32) time.Duration {
		t.Helper()
		want := reference(t, prompt, 24)
		begin := time.Now()
		out, _, err := h.generate(ctx, &pb.GenerateRequest{RequestId: id, Prompt: prompt, MaxTokens: 24})
		wall := time.Since(begin)
		if err != nil || !slices.Equal(out, want) {
			t.Fatalf("%s: %v, %v; want %v", id, out, err, want)
		}
		return wall
	}
	gap := func() time.Duration {
		return time.Duration(counterValue(h.w.metrics.stepGap) * float64(time.Second))
	}
	wallA := run("a", []int32{104, 101, 108, 108, 111})
	g1 := gap()
	if g1 <= 0 || g1 > wallA {
		t.Fatalf("24 steps back to back: host gap %v, want more than 0 and at most the call's %v", g1, wallA)
	}
	// Idle for four times as long as a's call: counted, it would be more
	// than b's whole call.
	idle := 4 * wallA
	aDone := time.Now()
	reference(t, []int32{119, 111, 114, 108, 100}, 24) // b's reference meanwhile
	if left := idle - time.Since(aDone); left > 0 {
		<-time.After(left)
	}
	wallB := run("b", []int32{119, 111, 114, 108, 100})
	if g := gap() - g1; g <= 0 || g > wallB {
		t.Fatalf("after %v idle: b's host gap %v, want more than 0 and at most its call's %v", time.Since(aDone)-wallB, g, wallB)
	}
}
