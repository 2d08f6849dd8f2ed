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

// TestNoVerificationWhileRequestsWait: a verification's positions come out
// of the step's token budget and the free pages that waiting requests need
// to start, and lengthen the step their prefill waits for; adaptive K does
// not verify while requests wait (vLLM turns speculation off past a queue
// depth too: --speculative-disable-by-batch-size).
func TestNoVerificationWhileRequestsWait(t *testing.T) {
	c := gateRig(t, 4, 5)
	offer(c, 4)
	st := c.Next(time.Unix(1, 0), 1<<20)
	if n := verifying(st); n != 0 {
		t.Fatalf("a request waits: %d rows verify, want none", n)
	}
	c.Done(time.Unix(1, 0), sampled(st))
	c.Cancel(c.Lookup("r4"))
	c.Output()
	offer(c, 4)
	if n := verifying(c.Next(time.Unix(2, 0), 1<<20)); n != 4 {
		t.Fatalf("nothing waits: %d of 4 rows verify, want 4", n)
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
