package core

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/lumen-project/lumen/worker/engine"
)

// gateRig is a target Core of n decoding rows (16-token prompts, one
// output each), adaptive K over Qwen3-14B/H100's step cost, and room for
// waiting more requests than run.
func gateRig(t *testing.T, running, submitted int) *Core {
	t.Helper()
	prof := engine.Profiles["qwen3-14b-h100"]
	c := New(Config{Self: "self", TokenBudget: 8192, MaxRunning: running, MaxWaiting: submitted}, nil)
	c.SetSpec(TargetSpec(0, &prof, 0))
	for i := range submitted {
		prompt := make([]int32, 16)
		for j := range prompt {
			prompt[j] = int32(1 + (i+j)%50)
		}
		c.Submit(&Request{ID: fmt.Sprint("r", i), History: prompt, Prompt: 16, MaxTokens: 100})
	}
	now := time.Unix(0, 0)
	st := c.Next(now, 1<<20)
	if len(st.Batch) != running {
		t.Fatalf("the prefill step has %d chunks, want %d", len(st.Batch), running)
	}
	out := make([][]int32, len(st.Batch))
	for i := range out {
		out[i] = []int32{7}
	}
	c.Done(now, out)
	c.Output()
	return c
}

// offer gives the first n running rows 8 drafts each.
func offer(c *Core, n int) {
	for i := range n {
		r := c.Lookup(fmt.Sprint("r", i))
		c.OfferDrafts(r.ID, len(r.History), slices.Repeat([]int32{7}, 8))
	}
}

func verifying(st Step) int {
	n := 0
	for _, ch := range st.Batch {
		if ch.Sample > 1 {
			n++
		}
	}
	return n
}

// TestAdaptiveKCountsRowsWithDrafts: every decoding row pays the fused
// pass for the step's K (rows without drafts are padded to it), so a
// large batch verifies only when enough of its rows hold drafts to pay
// for that. Before, adaptive K assumed every row had its drafts: at 128
// rows, two rows with drafts made the whole batch a K-draft pass, a step
// that commits fewer tokens per second than a plain decode (the 64-worker
// defect of issue 22: lumen behind lumen-no-spec).
func TestAdaptiveKCountsRowsWithDrafts(t *testing.T) {
	c := gateRig(t, 128, 128)
	offer(c, 2)
	st := c.Next(time.Unix(1, 0), 1<<20)
	if n := verifying(st); n != 0 {
		t.Fatalf("2 of 128 rows hold drafts: %d rows verify (K %d), want a plain decode", n, st.Batch[0].Sample-1)
	}
	if c.SpecK() == 0 {
		t.Fatal("the drafter is asked for K = 0: with all rows drafted, drafting pays at 128 rows and acceptance 0.7")
	}
	c.Done(time.Unix(1, 0), sampled(st))
	offer(c, 128)
	st = c.Next(time.Unix(2, 0), 1<<20)
	if n := verifying(st); n != 128 {
		t.Fatalf("every row holds drafts: %d of 128 verify, want all", n)
	}
}

// TestVerificationAfterAdmissions: a verification's positions come out of
// the token budget and the free pages that waiting requests need to start,
// so drafts are verified only with what the step has left once the
// waiting requests that fit are admitted. Before, the running requests'
// verifications came first and the admitted request's prefill shrank to
// the budget they left (its first token a step later).
func TestVerificationAfterAdmissions(t *testing.T) {
	prof := engine.Profiles["qwen3-14b-h100"]
	c := New(Config{Self: "self", TokenBudget: 24, MaxRunning: 8, MaxWaiting: 8}, nil)
	c.SetSpec(TargetSpec(0, &prof, 0))
	prompt := func(i int) []int32 { return slices.Repeat([]int32{int32(1 + i)}, 4) }
	for i := range 4 {
		c.Submit(&Request{ID: fmt.Sprint("r", i), History: prompt(i), Prompt: 4, MaxTokens: 100})
	}
	now := time.Unix(0, 0)
	st := c.Next(now, 1<<20)
	c.Done(now, sampled(st))
	c.Output()
	offer(c, 4)
	c.Submit(&Request{ID: "late", History: slices.Repeat([]int32{9}, 16), Prompt: 16, MaxTokens: 100})
	st = c.Next(time.Unix(1, 0), 1<<20)
	var prefill, drafts int
	for i, ch := range st.Batch {
		switch {
		case st.Reqs[i].ID == "late":
			prefill = len(ch.Tokens)
		case ch.Sample > 1:
			drafts += ch.Sample - 1
		}
	}
	if prefill != 16 {
		t.Fatalf("the admitted request prefills %d of its 16 tokens (the drafts took %d of the budget of 24)", prefill, drafts)
	}
	if drafts != 24-16-4 {
		t.Fatalf("%d drafts verified with 4 tokens of the budget left, want 4", drafts)
	}
}

// sampled is a token per sampled position of each chunk.
func sampled(st Step) [][]int32 {
	out := make([][]int32, len(st.Batch))
	for i, ch := range st.Batch {
		out[i] = slices.Repeat([]int32{7}, ch.Sample)
	}
	return out
}
