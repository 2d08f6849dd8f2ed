package core

import (
	"slices"
	"testing"
)

// submitPri is pagedRig.submit with a priority.
func (g *pagedRig) submitPri(id string, prompt, maxTokens int, priority int32) *Request {
	r := &Request{ID: id, History: make([]int32, prompt), Prompt: prompt, MaxTokens: maxTokens, Arrived: g.now, Priority: priority}
	for i := range r.History {
		r.History[i] = int32(32 + len(id) + i%50)
	}
	g.c.Submit(r)
	if o := g.c.Output(); len(o.Events) > 0 {
		g.t.Fatalf("submit %s: %+v", id, o.Events)
	}
	return r
}

// TestPriorityQueueOrder: the waiting queue is in priority order (lower is
// more urgent), arrival order within a priority, and a resume goes ahead
// of the new requests of its priority only: a high-priority request that
// arrives last is admitted first, before a normal resume.
func TestPriorityQueueOrder(t *testing.T) {
	g := newPagedRig(t, 64, Config{MaxRunning: 1})
	g.submit("run", 4, 100) // holds the only slot
	g.steps("run:0+4/1")
	g.submit("n1", 4, 4)
	g.submitPri("low", 4, 4, 5)
	g.submit("n2", 4, 4)
	res := &Request{ID: "res", History: make([]int32, 6), Prompt: 4, MaxTokens: 4, Arrived: g.now} // 2 outputs already
	g.c.Submit(res)
	g.submitPri("h1", 4, 4, -1)
	g.submitPri("h2", 4, 4, -1)
	if got, want := waitingIDs(g.c), []string{"h1", "h2", "res", "n1", "n2", "low"}; !slices.Equal(got, want) {
		t.Fatalf("waiting %v, want %v", got, want)
	}
}

// TestPriorityAdmitsAhead: one running slot; the high-priority request
// that arrived after two normal ones is admitted first when the slot
// frees, and they follow in arrival order.
func TestPriorityAdmitsAhead(t *testing.T) {
	g := newPagedRig(t, 64, Config{MaxRunning: 1})
	g.submit("a", 8, 2)
	g.steps("a:0+8/1")
	g.submit("b", 8, 2)
	g.submit("c", 8, 2)
	g.submitPri("h", 8, 2, -1)
	var order []string
	for range 20 {
		st, got, _ := g.next()
		if got == "" {
			break
		}
		for _, r := range st.Reqs {
			if r.ID != "a" && !slices.Contains(order, r.ID) {
				order = append(order, r.ID)
			}
		}
		g.done(st)
	}
	if want := []string{"h", "b", "c"}; !slices.Equal(order, want) {
		t.Fatalf("admitted %v after a, want %v", order, want)
	}
}

// TestPriorityVictimIsNormal: a high-priority request submitted after two
// normal ones is admitted and stepped first; when a decode then needs a
// page and none is free, the victim is the newest normal request, not the
// high-priority one (the last to arrive, which was the victim before
// priorities).
func TestPriorityVictimIsNormal(t *testing.T) {
	g := newPagedRig(t, 3, Config{})
	g.submit("a", 15, 17) // its page is full after one decode
	g.submit("b", 8, 20)
	g.submitPri("h", 8, 20, -1)
	g.steps("h:0+8/1 a:0+15/1 b:0+8/1", "h:8+1/1 a:15+1/1 b:8+1/1") // 3 pages held, none free
	st, got, o := g.next()                                          // a's position 16 needs a page
	if o.Preemptions != 1 {
		t.Fatalf("%d preemptions, want 1", o.Preemptions)
	}
	if got != "h:9+1/1 a:16+1/1" {
		t.Fatalf("batch %q, want h's and a's decodes (b, the newest normal request, preempted)", got)
	}
	if w := waitingIDs(g.c); !slices.Equal(w, []string{"b"}) {
		t.Fatalf("waiting %v, want [b]", w)
	}
	g.done(st)
}

// TestPriorityDisplacesNormal: a high-priority request that finds every
// running slot taken by normal requests takes the newest one's place (it
// waits again, at the head of the normal requests); a normal request
// never displaces one of its own priority that way, nor a more urgent one.
func TestPriorityDisplacesNormal(t *testing.T) {
	g := newPagedRig(t, 64, Config{MaxRunning: 2})
	g.submit("a", 4, 50)
	g.submit("b", 4, 50)
	g.steps("a:0+4/1 b:0+4/1")
	g.submit("n", 4, 4) // no slot, displaces nobody
	g.steps("a:4+1/1 b:4+1/1")
	g.submitPri("h", 4, 4, -1)
	st, got, o := g.next()
	if o.Preemptions != 1 || got != "a:5+1/1 h:0+4/1" {
		t.Fatalf("batch %q with %d preemptions, want a's decode and h's prefill (b displaced)", got, o.Preemptions)
	}
	if w := waitingIDs(g.c); !slices.Equal(w, []string{"b", "n"}) {
		t.Fatalf("waiting %v, want [b n]", w)
	}
	g.done(st)
	// h, now running, is never displaced by the normal requests.
	st, got, o = g.next()
	if o.Preemptions != 0 || got != "h:4+1/1 a:6+1/1" {
		t.Fatalf("batch %q with %d preemptions, want h's and a's decodes", got, o.Preemptions)
	}
	g.done(st)
}

// TestPriorityOutputsUnchanged: the greedy oracle. The same requests, run
// with and without priorities under memory pressure (preemptions), each
// produce the same tokens: priorities change when a request runs, never
// what it outputs.
func TestPriorityOutputsUnchanged(t *testing.T) {
	run := func(pri bool) (map[string][]int32, int) {
		g := newPagedRig(t, 8, Config{MaxRunning: 4})
		out := map[string][]int32{}
		preempted := 0
		for i := range 8 {
			p := int32(0)
			if pri && i%3 == 2 {
				p = -1
			}
			g.submitPri(string(rune('a'+i)), 20+5*i, 20+i, p)
		}
		for range 500 {
			st := g.c.Next(g.now, g.total-g.c.CachedPages())
			o := g.c.Output()
			preempted += o.Preemptions
			if len(st.Batch) == 0 {
				break
			}
			toks := make([][]int32, len(st.Batch))
			for i, ch := range st.Batch {
				r := st.Reqs[i]
				for range ch.Sample {
					// A fixed function of the history: greedy decoding.
					h := int32(0)
					for _, x := range r.History {
						h = h*31 + x
					}
					toks[i] = append(toks[i], 32+(h&63))
				}
			}
			g.c.Done(g.now, toks)
			for _, ev := range g.c.Output().Events {
				if ev.Err != nil {
					t.Fatalf("%s: %v", ev.Req.ID, ev.Err)
				}
				out[ev.Req.ID] = append(out[ev.Req.ID], ev.Token)
			}
		}
		return out, preempted
	}
	base, p0 := run(false)
	got, p1 := run(true)
	if len(base) != 8 || len(got) != 8 {
		t.Fatalf("finished %d and %d requests of 8", len(base), len(got))
	}
	if p0+p1 == 0 {
		t.Fatalf("no preemption in either run: the test does not exercise recompute")
	}
	for id, toks := range base {
		if !slices.Equal(toks, got[id]) {
			t.Errorf("%s: %v with priorities, %v without", id, got[id], toks)
		}
	}
}
