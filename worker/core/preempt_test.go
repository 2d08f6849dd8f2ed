package core

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
)

// pagedRig drives a Core directly over an engine of total KV pages, of
// which the Core's requests hold CachedPages: each step's free pages are
// the rest, and every sampled token is 7.
type pagedRig struct {
	t     *testing.T
	c     *Core
	total int
	now   time.Time
}

func newPagedRig(t *testing.T, total int, cfg Config) *pagedRig {
	cfg.TotalPages, cfg.Preemption = total, PreemptVLLM
	if cfg.MaxRunning == 0 {
		cfg.MaxRunning = 16
	}
	if cfg.MaxWaiting == 0 {
		cfg.MaxWaiting = 64
	}
	if cfg.TokenBudget == 0 {
		cfg.TokenBudget = 512
	}
	return &pagedRig{t: t, c: New(cfg, nil), total: total, now: time.Unix(1000, 0)}
}

func (g *pagedRig) submit(id string, prompt, maxTokens int) *Request {
	r := &Request{ID: id, History: make([]int32, prompt), Prompt: prompt, MaxTokens: maxTokens, Arrived: g.now}
	for i := range r.History {
		r.History[i] = int32(32 + len(id) + i%50)
	}
	g.c.Submit(r)
	if o := g.c.Output(); len(o.Events) > 0 {
		g.t.Fatalf("submit %s: %+v", id, o.Events)
	}
	return r
}

// next builds the next step and returns it, as text ("id:fed+n/sample"
// per chunk), with the Output it asked for.
func (g *pagedRig) next() (Step, string, Output) {
	st := g.c.Next(g.now, g.total-g.c.CachedPages())
	return st, batchText(st), g.c.Output()
}

// done completes the step.
func (g *pagedRig) done(st Step) {
	out := make([][]int32, len(st.Batch))
	for i, ch := range st.Batch {
		for range ch.Sample {
			out[i] = append(out[i], 7)
		}
	}
	g.now = g.now.Add(10 * time.Millisecond)
	g.c.Done(g.now, out)
	if o := g.c.Output(); slices.ContainsFunc(o.Events, func(e Event) bool { return e.Err != nil }) {
		g.t.Fatalf("errors: %+v", o.Events)
	}
}

// steps runs the steps whose batches are want, in order.
func (g *pagedRig) steps(want ...string) {
	g.t.Helper()
	for i, w := range want {
		st, got, o := g.next()
		if got != w {
			g.t.Fatalf("step %d: batch %q, want %q", i+1, got, w)
		}
		if o.Preemptions != 0 {
			g.t.Fatalf("step %d: %d preemptions, want none", i+1, o.Preemptions)
		}
		g.done(st)
	}
}

func batchText(st Step) string {
	parts := make([]string, len(st.Batch))
	for i, ch := range st.Batch {
		parts[i] = fmt.Sprintf("%s:%d+%d/%d", st.Reqs[i].ID, st.Reqs[i].Fed(), len(ch.Tokens), ch.Sample)
	}
	return strings.Join(parts, " ")
}

func ids(rs []*Request) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.ID
	}
	return out
}

// waitingIDs is the waiting queue, head first.
func waitingIDs(c *Core) []string { return ids(c.Requests()[c.Running():]) }

// TestPreemptDecodePreemptsNewest: an older request whose decode needs a
// new page when none is free preempts the most recently admitted request —
// not itself — and decodes in the same step; the victim, its cache dropped
// under a new sequence, heads the waiting queue and is not re-admitted in
// that step. Before, the older request sat the step out while the newer
// one decoded.
func TestPreemptDecodePreemptsNewest(t *testing.T) {
	g := newPagedRig(t, 2, Config{})
	a := g.submit("a", 15, 17) // its page is full after one decode
	b := g.submit("b", 8, 20)
	g.steps("a:0+15/1 b:0+8/1", "a:15+1/1 b:8+1/1") // both pages held, none free
	oldSeq := b.Seq()
	st, got, o := g.next() // a's position 16 needs a page; b's 9 has room
	if got != "a:16+1/1" {
		t.Fatalf("batch %q, want a's decode alone (b preempted)", got)
	}
	if o.Preemptions != 1 || !slices.Contains(o.Release, oldSeq) {
		t.Fatalf("%d preemptions, releases %v; want b's sequence %d released", o.Preemptions, o.Release, oldSeq)
	}
	if w := waitingIDs(g.c); !slices.Equal(w, []string{"b"}) || b.Fed() != 0 || b.Seq() == oldSeq {
		t.Fatalf("waiting %v, b fed %d seq %d (was %d); want b at the head, its cache dropped under a new sequence", w, b.Fed(), b.Seq(), oldSeq)
	}
	if len(st.Restores) != 0 || g.c.Running() != 1 || a.Fed() != 16 {
		t.Fatalf("running %d, restores %d, a fed %d", g.c.Running(), len(st.Restores), a.Fed())
	}
	g.done(st)
	// The victim recomputes its prompt and its output so far (9 tokens)
	// once the pages are there: a's 2 pages and b's 1 leave no headroom
	// until a ends, so it waits.
	for range 200 {
		if g.c.Idle() {
			break
		}
		st, _, _ := g.next()
		g.done(st)
	}
	if !g.c.Idle() || len(b.History) != 8+20 || len(a.History) != 15+17 {
		t.Fatalf("idle %v, a %d tokens, b %d", g.c.Idle(), len(a.History), len(b.History))
	}
}

// TestPreemptNewestPreemptsItself: the newest running request whose decode
// needs a page when none is free is preempted itself; the older ones run.
// Before, it sat the step out holding its pages.
func TestPreemptNewestPreemptsItself(t *testing.T) {
	g := newPagedRig(t, 2, Config{})
	g.submit("a", 8, 20)
	b := g.submit("b", 15, 17)
	g.steps("a:0+8/1 b:0+15/1", "a:8+1/1 b:15+1/1")
	st, got, o := g.next() // b's position 16 needs a page; a's 9 has room
	if got != "a:9+1/1" {
		t.Fatalf("batch %q, want a's decode alone", got)
	}
	if o.Preemptions != 1 || g.c.Running() != 1 || !slices.Equal(waitingIDs(g.c), []string{"b"}) || b.Fed() != 0 {
		t.Fatalf("%d preemptions, %d running, waiting %v, b fed %d; want b preempted, at the head", o.Preemptions, g.c.Running(), waitingIDs(g.c), b.Fed())
	}
	g.done(st)
}

// TestPreemptRepeatsForEachRowShort: rows short of a page each preempt the
// newest remaining request, in running order, until they fit: the oldest
// takes the newest's page, the next the one before. The victims head the
// queue in admission order. (A chunk needs at most one new page — a
// prefill chunk shrinks to the pages there are — so one victim that held
// a page makes a row fit.)
func TestPreemptRepeatsForEachRowShort(t *testing.T) {
	g := newPagedRig(t, 4, Config{})
	g.submit("a", 15, 20)
	g.submit("b", 15, 20)
	g.submit("c", 8, 20)
	g.submit("d", 8, 20)
	g.steps("a:0+15/1 b:0+15/1 c:0+8/1 d:0+8/1", "a:15+1/1 b:15+1/1 c:8+1/1 d:8+1/1")
	st, got, o := g.next()
	if got != "a:16+1/1 b:16+1/1" {
		t.Fatalf("batch %q, want a and b, each on a victim's page", got)
	}
	if w := waitingIDs(g.c); o.Preemptions != 2 || !slices.Equal(w, []string{"c", "d"}) {
		t.Fatalf("%d preemptions, waiting %v; want c and d preempted, c first", o.Preemptions, w)
	}
	g.done(st)
}

// TestPreemptPrefillChunkShrinksThenPreempts: a running request's prefill
// chunk shrinks to the free pages rather than preempt; at a page boundary
// with none free it preempts like a decode — the newest, here itself.
func TestPreemptPrefillChunkShrinksThenPreempts(t *testing.T) {
	g := newPagedRig(t, 4, Config{TokenBudget: 30})
	g.submit("a", 8, 40)
	g.steps("a:0+8/1")
	p := g.submit("p", 60, 4)
	// p's first chunk (29 tokens, 2 pages) fits with a page of headroom
	// for a; its second shrinks from 29 to the 19 tokens of the last page.
	g.steps("a:8+1/1 p:0+29/0", "a:9+1/1 p:29+19/0")
	st, got, o := g.next()
	if got != "a:10+1/1" || o.Preemptions != 1 || p.Fed() != 0 || !slices.Equal(waitingIDs(g.c), []string{"p"}) {
		t.Fatalf("batch %q, %d preemptions, p fed %d, waiting %v; want p (no page for its next chunk, the newest) preempted",
			got, o.Preemptions, p.Fed(), waitingIDs(g.c))
	}
	g.done(st)
}

// TestPreemptSparesMigrations: requests stopped for their migration's
// commit and a destination's pre-allocation hold their pages and are never
// victims, though the stopped one was admitted last: the newest running
// request is.
func TestPreemptSparesMigrations(t *testing.T) {
	g := newPagedRig(t, 4, Config{})
	if _, err := g.c.AcceptStage(g.now, IncomingStage{ID: "m", Epoch: 1, Stage: 1, Hashes: []uint64{42}}, g.total); err != nil {
		t.Fatal(err)
	}
	g.submit("a", 15, 20)
	g.submit("b", 8, 20)
	s := g.submit("s", 8, 20)
	g.steps("a:0+15/1 b:0+8/1 s:0+8/1")
	if err := g.c.MigrateOut("s", 0); err != nil {
		t.Fatal(err)
	}
	if stage, err := g.c.NextStage("s", 0); err != nil || !stage.Last {
		t.Fatalf("stage %+v, %v; want the last", stage, err)
	}
	g.c.Output()
	g.steps("a:15+1/1 b:8+1/1") // 4 pages held: a, b, s and m
	st, got, o := g.next()
	if got != "a:16+1/1" || o.Preemptions != 1 || !slices.Equal(waitingIDs(g.c), []string{"b"}) {
		t.Fatalf("batch %q, %d preemptions, waiting %v; want b preempted", got, o.Preemptions, waitingIDs(g.c))
	}
	if migrating, stopped := g.c.Migrating("s"); !migrating || !stopped || len(o.MigrationsEnded) != 0 || s.Fed() != 8 {
		t.Fatalf("s migrating %v stopped %v, fed %d, migrations ended %v; want s untouched", migrating, stopped, s.Fed(), o.MigrationsEnded)
	}
	if g.c.Incoming() != 1 || g.c.IncomingPages("m") != 1 {
		t.Fatalf("%d pre-allocations, m holds %d pages; want m untouched", g.c.Incoming(), g.c.IncomingPages("m"))
	}
	g.done(st)
}

// TestPreemptOutputsUnderPressure: under heavy preemption, every step runs
// every running request unless the token budget ran out (nobody sits a
// step out for a page), the victims are the newest running requests and
// no one is admitted in a step that preempted; and every request's tokens
// are those it gets alone.
func TestPreemptOutputsUnderPressure(t *testing.T) {
	total := 0
	for seed := uint64(1); seed <= 6; seed++ {
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			t.Logf("seed %d", seed)
			rng := rand.New(rand.NewPCG(seed, 22))
			const pages, budget = 16, 48
			h := newHarness(t, pages, Config{TokenBudget: budget, MaxRunning: 8, Preemption: PreemptVLLM}, nil)
			want := map[string][]int32{}
			type arrival struct {
				id     string
				prompt []int32
				n      int
			}
			var queue []arrival
			for i := range 20 {
				p, n := prompt(rng, 10+rng.IntN(90)), 5+rng.IntN(60)
				id := fmt.Sprintf("r%d", i)
				want[id] = reference(t, p, n)
				queue = append(queue, arrival{id, p, n})
			}
			for i := 0; len(queue) > 0 || !h.c.Idle(); i++ {
				if i > 20000 {
					t.Fatal("no progress after 20000 steps")
				}
				for len(queue) > 0 && rng.IntN(3) == 0 {
					h.submit(queue[0].id, queue[0].prompt, nil, queue[0].n)
					queue = queue[1:]
				}
				if h.c.Idle() {
					continue
				}
				stepChecked(t, h, budget)
			}
			for id, w := range want {
				if !slices.Equal(h.out[id], w) {
					t.Errorf("%s: got %v, want %v", id, h.out[id], w)
				}
			}
			if len(h.errs) > 0 {
				t.Errorf("errors: %v", h.errs)
			}
			if h.eng.FreePages() != pages {
				t.Errorf("%d pages free at the end, want %d", h.eng.FreePages(), pages)
			}
			t.Logf("%d preemptions", h.total.Preemptions)
			total += h.total.Preemptions
		})
	}
	if total < 30 {
		t.Fatalf("%d preemptions over the seeds: the cache is not tight enough to test them", total)
	}
}

// stepChecked is harness.step with the scheduling rules checked on the
// step Next builds.
func stepChecked(t *testing.T, h *harness, budget int) {
	t.Helper()
	before := slices.Clone(h.c.Requests()[:h.c.Running()])
	st := h.c.Next(h.now, h.eng.FreePages())
	preempted := h.c.out.Preemptions
	h.apply()
	after := h.c.Requests()[:h.c.Running()]
	tokens := 0
	for _, ch := range st.Batch {
		tokens += len(ch.Tokens)
	}
	for _, r := range after {
		if !slices.Contains(st.Reqs, r) && tokens < budget {
			t.Fatalf("%s runs and sits the step out with %d of %d tokens of the budget used: batch %s", r.ID, tokens, budget, batchText(st))
		}
	}
	// The survivors are a prefix of the running order, the victims the
	// rest; nobody new runs after a preemption.
	if preempted > 0 {
		if len(after) > len(before) || !slices.Equal(after, before[:len(after)]) {
			t.Fatalf("running %v before a step that preempted %d, %v after", ids(before), preempted, ids(after))
		}
		if w := waitingIDs(h.c); !slices.Equal(w[:len(before)-len(after)], ids(before[len(after):])) {
			t.Fatalf("victims %v, waiting %v: the victims should head it in admission order", ids(before[len(after):]), w)
		}
	}
	if len(st.Batch) == 0 {
		return
	}
	for _, rs := range st.Restores {
		if err := h.eng.ImportPages(rs.Seq, rs.Pages); err != nil {
			t.Fatal(err)
		}
	}
	out, err := h.eng.Forward(context.Background(), st.Batch)
	if err != nil {
		t.Fatalf("step %s: %v", batchText(st), err)
	}
	h.now = h.now.Add(10 * time.Millisecond)
	h.c.Done(h.now, out)
	h.apply()
}
