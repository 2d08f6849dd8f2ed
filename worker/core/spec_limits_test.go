package core

import (
	"errors"
	"strings"
	"testing"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// TestANewDrafterIsMeasuredAfresh is defect 10 of issue 21: the acceptance
// estimate was seeded once per target, so after one poor drafter adaptive
// K was 0 — nothing verified, nothing measured — for every drafter after
// it. SetSpec, called when a drafter attaches, starts the estimate again
// from the prior, and a good drafter's drafts are verified.
func TestANewDrafterIsMeasuredAfresh(t *testing.T) {
	sc := SpecConfig{Adaptive: true, Cost: gpuCost("qwen3-14b-h100")}
	c := New(Config{TokenBudget: 256, MaxRunning: 4, MaxWaiting: 4}, nil)
	c.SetSpec(sc)
	r := &Request{ID: "a", History: make([]int32, 20), Prompt: 20, MaxTokens: 4000}
	c.Submit(r)
	now := time.Unix(0, 0)
	st := c.Next(now, 1000)
	c.Done(now, [][]int32{{99}})
	// A poor drafter: every first draft is wrong.
	poor := 0
	for ; c.NextK() > 0; poor++ {
		if poor > 200 {
			t.Fatalf("K still %d after 200 verifications that accepted nothing (acceptance %.2f)", c.NextK(), c.Acceptance())
		}
		c.OfferDrafts("a", len(r.History), []int32{1, 2, 3, 4, 5, 6, 7, 8})
		st = c.Next(now, 1000)
		if len(st.Batch) != 1 || st.Batch[0].Sample < 2 {
			t.Fatalf("verification %d: %+v", poor, st.Batch)
		}
		out := make([]int32, st.Batch[0].Sample)
		for i := range out {
			out[i] = 99
		}
		c.Done(now, [][]int32{out})
	}
	t.Logf("K = 0 after %d poor verifications (acceptance %.2f)", poor, c.Acceptance())
	c.Output()

	c.SetSpec(sc) // a good drafter attaches
	if got := c.Acceptance(); got != PriorAcceptance {
		t.Fatalf("a new drafter starts at acceptance %.3f, want the prior %.2f", got, PriorAcceptance)
	}
	c.OfferDrafts("a", len(r.History), []int32{99, 99, 99, 99, 99, 99, 99, 99})
	st = c.Next(now, 1000)
	if len(st.Batch) != 1 || st.Batch[0].Sample < 2 {
		t.Fatalf("the new drafter's drafts are not verified (K %d, acceptance %.2f): %+v", c.SpecK(), c.Acceptance(), st.Batch)
	}
}

// TestSpecKLimit is defect 9 of issue 21: one bound on K, named in the
// refusal, and the drafter's line at that bound is one the target takes.
func TestSpecKLimit(t *testing.T) {
	for _, k := range []int{0, 1, DefaultKMax, MaxSpecK} {
		if err := CheckSpecK(k); err != nil {
			t.Errorf("K %d: %v", k, err)
		}
	}
	for _, k := range []int{-1, MaxSpecK + 1, 64} {
		err := CheckSpecK(k)
		if !errors.Is(err, ErrSpecK) || !strings.Contains(err.Error(), "outside [0, 32]") {
			t.Errorf("K %d: %v, want ErrSpecK naming [0, 32]", k, err)
		}
	}
	d := NewDrafter(MaxSpecK + 10)
	if d.K() != MaxSpecK {
		t.Fatalf("drafter K %d, want it capped at %d", d.K(), MaxSpecK)
	}
	d.Apply(MirrorUpdate{ID: "a", Tokens: make([]int32, 40)})
	longest := 0
	for range 200 {
		st := d.Next(1 << 20)
		if len(st.Batch) == 0 {
			break
		}
		out := make([][]int32, len(st.Batch))
		for i, ch := range st.Batch {
			if ch.Sample > 0 {
				out[i] = []int32{5}
			}
		}
		d.Done(out)
		for _, dr := range d.Output().Drafts {
			longest = max(longest, len(dr.Tokens))
		}
	}
	if longest != MaxDraftTokens {
		t.Fatalf("the longest line at K = %d is %d drafts, the target takes %d", MaxSpecK, longest, MaxDraftTokens)
	}
}

// TestPaired: the one pairing check, over the rows the fsm writes.
func TestPaired(t *testing.T) {
	const (
		assist = pb.WorkerPhase_WORKER_PHASE_ASSIST
		full   = pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE
		load   = pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT
	)
	row := func(id, partner string, phase pb.WorkerPhase) *pb.Worker {
		return &pb.Worker{Id: id, PairedWorker: partner, Phase: phase}
	}
	cases := []struct {
		name      string
		d, target *pb.Worker
		want      bool
	}{
		{"paired", row("d", "t", assist), row("t", "d", full), true},
		{"the target names another", row("d", "t", assist), row("t", "e", full), false},
		{"the drafter names another", row("d", "u", assist), row("t", "d", full), false},
		{"unpaired rows", row("d", "", assist), row("", "", full), false},
		{"the target left full service", row("d", "t", assist), row("t", "d", pb.WorkerPhase_WORKER_PHASE_DRAINING), false},
		{"the drafter is not in ASSIST", row("d", "t", load), row("t", "d", full), false},
		{"no target row", row("d", "t", assist), nil, false},
		{"no drafter row", nil, row("t", "d", full), false},
	}
	for _, c := range cases {
		if got := Paired(c.d, c.target); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}
