package core

import (
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
)

// bareNext is Next over an engine that has exactly the pages the Core does
// not hold (the simulator's accounting).
func bareNext(c *Core, total int) Step {
	return c.Next(time.Unix(0, 0), total-c.CachedPages())
}

// TestQueueWaitsForHeldPagesAndSlots is defect 4 of issue 21: when nothing
// ran and admission failed, Next refused the head of the queue with
// ErrTooLarge — one head per call, so the whole queue — although the pages
// or slots it lacked were only held: by a migration in (an idle
// destination gives it every free page, its headroom being zero running
// requests) or by a request stopped for its migration's commit. The queue
// must wait (Stalled) and run once they are released.
func TestQueueWaitsForHeldPagesAndSlots(t *testing.T) {
	cases := []struct {
		name    string
		pages   int
		running int
		// hold takes the pages or slots; release gives them back.
		hold, release func(t *testing.T, c *Core)
	}{
		{name: "a migration in holds every free page", pages: 8, running: 4,
			hold: func(t *testing.T, c *Core) {
				if _, err := c.AcceptStage(time.Unix(0, 0), IncomingStage{ID: "m", Epoch: 1, Stage: 1, Hashes: make([]uint64, 8)}, 8-c.CachedPages()); err != nil {
					t.Fatal(err)
				}
			},
			release: func(t *testing.T, c *Core) {
				if !c.AbortIn("m", 1) {
					t.Fatal("no pre-allocation to abort")
				}
			}},
		{name: "a migration in holds the only slot", pages: 64, running: 1,
			hold: func(t *testing.T, c *Core) {
				if _, err := c.AcceptStage(time.Unix(0, 0), IncomingStage{ID: "m", Epoch: 1, Stage: 1, Hashes: make([]uint64, 1)}, 64-c.CachedPages()); err != nil {
					t.Fatal(err)
				}
			},
			release: func(t *testing.T, c *Core) {
				if c.Expire(time.Unix(0, 0).Add(DefaultMigrationTimeout)) != 1 {
					t.Fatal("no pre-allocation expired")
				}
			}},
		{name: "a request stopped for its commit holds the only slot", pages: 64, running: 1,
			hold: func(t *testing.T, c *Core) {
				c.Submit(&Request{ID: "s", Epoch: 1, History: make([]int32, 20), Prompt: 20, MaxTokens: 10})
				if st := bareNext(c, 64); len(st.Batch) != 1 {
					t.Fatalf("batch %+v", st.Batch)
				}
				c.Done(time.Unix(0, 0), [][]int32{{1}})
				if err := c.MigrateOut("s", 1); err != nil {
					t.Fatal(err)
				}
				if st, err := c.NextStage("s", 1); err != nil || !st.Last {
					t.Fatalf("stage %+v, %v: want the last", st, err)
				}
			},
			release: func(t *testing.T, c *Core) {
				if !c.CommitOut("s", 1) {
					t.Fatal("nothing to commit")
				}
			}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := New(Config{TokenBudget: 256, MaxRunning: tc.running, MaxWaiting: 8, TotalPages: tc.pages}, nil)
			tc.hold(t, c)
			c.Output()
			for _, id := range []string{"a", "b", "c"} {
				c.Submit(&Request{ID: id, History: make([]int32, 20), Prompt: 20, MaxTokens: 4})
			}
			for i := range 4 { // the loop that used to drop one head per call
				if st := bareNext(c, tc.pages); len(st.Batch) != 0 {
					t.Fatalf("call %d: a batch %+v while the pages or slots are held", i, st.Batch)
				}
				for _, ev := range c.Output().Events {
					t.Fatalf("call %d: request %s refused while the pages were only held: %v", i, ev.Req.ID, ev.Err)
				}
				if !c.Stalled() {
					t.Fatalf("call %d: not stalled with %d waiting", i, c.Waiting())
				}
			}
			if c.Waiting() != 3 {
				t.Fatalf("%d waiting, want 3", c.Waiting())
			}
			tc.release(t, c)
			c.Output()
			done := map[string]bool{}
			for i := 0; len(done) < 3; i++ {
				if i > 100 {
					t.Fatalf("no progress after the release: %d running, %d waiting", c.Running(), c.Waiting())
				}
				st := bareNext(c, tc.pages)
				if len(st.Batch) == 0 {
					t.Fatalf("step %d: nothing runs after the release (stalled %v)", i, c.Stalled())
				}
				out := make([][]int32, len(st.Batch))
				for j, ch := range st.Batch {
					if ch.Sample > 0 {
						out[j] = []int32{7}
					}
				}
				c.Done(time.Unix(0, 0), out)
				for _, ev := range c.Output().Events {
					if ev.Err != nil {
						t.Fatalf("%s: %v", ev.Req.ID, ev.Err)
					}
					if ev.Finish != FinishNone {
						done[ev.Req.ID] = true
					}
				}
			}
		})
	}
}

// TestSubmitRefusesARequestThatNeverFits: a call whose prompt and
// max_tokens need more KV pages than the engine has is refused at Submit,
// with its pages and the limit in the message (issue 21, defect 4). It
// used to be admitted when its prompt fitted and then preempted forever,
// alone, each time its cache outgrew the engine. One position less fits,
// and completes.
func TestSubmitRefusesARequestThatNeverFits(t *testing.T) {
	h := newHarness(t, 4, Config{}, nil) // 64 positions
	p := make([]int32, 40)
	for i := range p {
		p[i] = int32(32 + i)
	}
	// 40 + 26 − 1 = 65 positions: 5 pages.
	h.submit("big", p, nil, 26)
	err := h.errs["big"]
	if !errors.Is(err, ErrTooLarge) {
		for i := 0; i < 200 && !h.c.Idle(); i++ {
			h.step()
		}
		t.Fatalf("refusal at Submit: %v; after 200 steps: %d tokens, %d preemptions, error %v",
			err, len(h.out["big"]), h.total.Preemptions, h.errs["big"])
	}
	for _, want := range []string{"max_tokens 26", "need 5 KV pages", "the engine has 4"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("message %q does not say %q", err, want)
		}
	}
	if h.c.Lookup("big") != nil || !h.c.Idle() {
		t.Fatal("the refused call was queued")
	}
	h.submit("fits", p, nil, 25) // 64 positions
	h.run()
	if h.errs["fits"] != nil || len(h.out["fits"]) != 25 {
		t.Fatalf("the largest request that fits: %d tokens, %v", len(h.out["fits"]), h.errs["fits"])
	}
	if h.total.Preemptions != 0 {
		t.Fatalf("%d preemptions of a request alone on the worker", h.total.Preemptions)
	}
}

// TestSubmitLeavesNoPhantomAfterAFailedAdoption is defect 8 of issue 21: a
// call that could not adopt its migration in's sequence (its history
// matches none of the pages) and then found the queue full was refused,
// but stayed in byID: Lookup found it, SetHolder and the Mirror saw a
// request that does not exist, HandBack sent it a second terminal error.
func TestSubmitLeavesNoPhantomAfterAFailedAdoption(t *testing.T) {
	c := New(Config{TokenBudget: 256, MaxRunning: 4, MaxWaiting: 1, TotalPages: 64}, nil)
	c.Submit(&Request{ID: "w", History: make([]int32, 20), Prompt: 20, MaxTokens: 4})
	if _, err := c.AcceptStage(time.Unix(0, 0), IncomingStage{ID: "x", Epoch: 1, Stage: 1, Hashes: []uint64{1, 2}}, 64); err != nil {
		t.Fatal(err)
	}
	c.Output()
	x := &Request{ID: "x", Epoch: 2, History: make([]int32, 40), Prompt: 40, MaxTokens: 4}
	c.Submit(x)
	o := c.Output()
	if len(o.Events) != 1 || !errors.Is(o.Events[0].Err, ErrQueueFull) {
		t.Fatalf("events %+v, want one ErrQueueFull", o.Events)
	}
	if r := c.Lookup("x"); r != nil {
		t.Fatalf("the refused call is still under its id: %+v", r)
	}
	if c.SetHolder("x", 2, "h", 1) {
		t.Fatal("SetHolder applied to a refused call")
	}
	c.HandBack(errors.New("shutdown"))
	for _, ev := range c.Output().Events {
		if ev.Req == x {
			t.Fatal("HandBack ended the refused call again")
		}
	}
}

// A resume is not refused for a full waiting queue: a call with output
// tokens already generated (its worker failed, or it moved) and one that
// takes over a request this Core holds are queued past MaxWaiting, while
// a new request is still refused. Its client is already streaming; the
// resumes are bounded by the requests admitted.
func TestResumeBypassesTheWaitingCap(t *testing.T) {
	c := New(Config{TokenBudget: 256, MaxRunning: 1, MaxWaiting: 1, TotalPages: 64}, nil)
	c.Submit(&Request{ID: "run", History: make([]int32, 8), Prompt: 8, MaxTokens: 4})
	if st := c.Next(time.Unix(0, 0), 64); len(st.Batch) != 1 {
		t.Fatalf("batch %v, want the first request", st.Batch)
	}
	c.Submit(&Request{ID: "wait", History: make([]int32, 8), Prompt: 8, MaxTokens: 4})
	c.Output()

	c.Submit(&Request{ID: "resumed", History: make([]int32, 10), Prompt: 8, MaxTokens: 4})
	c.Submit(&Request{ID: "run", Epoch: 1, History: make([]int32, 8), Prompt: 8, MaxTokens: 4})
	c.Submit(&Request{ID: "new", History: make([]int32, 8), Prompt: 8, MaxTokens: 4})
	var refused []string
	for _, ev := range c.Output().Events {
		if errors.Is(ev.Err, ErrQueueFull) {
			refused = append(refused, ev.Req.ID)
		}
	}
	if !slices.Equal(refused, []string{"new"}) {
		t.Fatalf("refused for a full queue: %v, want only the new request", refused)
	}
	var waiting []string
	for _, r := range c.Requests() {
		waiting = append(waiting, r.ID)
	}
	if want := []string{"resumed", "wait", "run"}; !slices.Equal(waiting, want) {
		t.Fatalf("the Core holds %v, want %v (the resume first, the taken-over call last)", waiting, want)
	}
}

// TestQueuedPages: the load report's queued pages are every waiting
// request's whole history in pages, the head's (HeadPages) included; what
// runs counts in CachedPages instead, never in both.
func TestQueuedPages(t *testing.T) {
	h := newHarness(t, 64, Config{MaxRunning: 1, TokenBudget: 512}, nil)
	rng := rand.New(rand.NewPCG(7, 7))
	h.submit("a", prompt(rng, 40), nil, 4)         // 3 pages
	h.submit("b", prompt(rng, 33), nil, 4)         // 3 pages
	h.submit("c", prompt(rng, 16), []int32{50}, 4) // a resume, queued first: 17 positions, 2 pages
	if h.c.QueuedPages() != 8 || h.c.HeadPages() != 2 {
		t.Fatalf("before a step: queued %d, head %d; want 8 (3 + 3 + 2), head 2", h.c.QueuedPages(), h.c.HeadPages())
	}
	h.step() // c runs (one slot)
	if q, head := h.c.QueuedPages(), h.c.HeadPages(); q != 6 || head != 3 || h.c.Waiting() != 2 {
		t.Fatalf("c running: queued %d pages, head %d, %d waiting; want 6, 3, 2", q, head, h.c.Waiting())
	}
	h.run()
	if h.c.QueuedPages() != 0 || h.c.HeadPages() != 0 {
		t.Fatalf("idle: queued %d, head %d", h.c.QueuedPages(), h.c.HeadPages())
	}
}
