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

// TestPriorityVictimIsNormal: the running set is in priority order, so a
// high-priority request admitted after two normal ones is stepped first,
// and the preemption victim (the set's last) is the newest normal request,
// not the high-priority one, the newest of all, which was the victim
// before priorities.
func TestPriorityVictimIsNormal(t *testing.T) {
	g := newPagedRig(t, 64, Config{})
	g.submit("a", 15, 17)
	g.submit("b", 8, 20)
	g.steps("a:0+15/1 b:0+8/1")
	g.submitPri("h", 8, 20, -1)
	g.steps("a:15+1/1 b:8+1/1 h:0+8/1", "h:8+1/1 a:16+1/1 b:9+1/1")
	if got := ids(g.c.Requests()); !slices.Equal(got, []string{"h", "a", "b"}) {
		t.Fatalf("running %v, want [h a b]", got)
	}
	if freed := g.c.preempt(); freed != 1 {
		t.Fatalf("the victim freed %d pages, want b's 1", freed)
	}
	if w := waitingIDs(g.c); !slices.Equal(w, []string{"b"}) {
		t.Fatalf("waiting %v after a preemption, want [b]", w)
	}
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

// TestPriorityHoldsNormalPrefill: execution priority. While a
// high-priority request prefills, a normal request that is prefilling in
// chunks runs no chunk and no normal request is admitted: the step holds
// the urgent prefill and the decodes only. Once it decodes, the normal
// prefill goes on.
func TestPriorityHoldsNormalPrefill(t *testing.T) {
	g := newPagedRig(t, 64, Config{TokenBudget: 16})
	g.submit("d", 4, 50)
	g.steps("d:0+4/1")
	g.submit("long", 40, 4) // prefills in chunks of what the budget leaves
	g.steps("d:4+1/1 long:0+15/0")
	g.submitPri("h", 20, 4, -1)
	g.submit("n", 4, 4)
	g.steps("d:5+1/1 h:0+15/0", "h:15+5/1 d:6+1/1", "h:20+1/1 d:7+1/1 long:15+14/0")
}
