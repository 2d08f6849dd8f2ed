package core

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

func runTok(id string, idx int) int32 {
	h := int32(0)
	for _, b := range []byte(id) {
		h = h*31 + int32(b)
	}
	return 32 + (h+int32(idx)*7)%90&0x7f
}

// runScenario builds a Core with random requests (prompts, outputs, some
// resumed with tokens already out, half with a holder) and steps it as a
// caller does until its pending step is a decode run, or reports false.
func runScenario(seed uint64) (*Core, time.Time, bool) {
	rng := rand.New(rand.NewPCG(seed, 7))
	c := New(Config{Self: "w", TokenBudget: 4096, MaxRunning: 64, MaxWaiting: 64, TotalPages: 1 << 20}, nil)
	now := time.Unix(1000, 0)
	n := 1 + rng.IntN(20)
	for i := range n {
		prompt := 1 + rng.IntN(90)
		outs := 0
		if rng.IntN(4) == 0 {
			outs = rng.IntN(20)
		}
		id := fmt.Sprintf("r%d", i)
		h := make([]int32, 0, prompt+outs)
		for k := range prompt {
			h = append(h, int32(40+k%50))
		}
		for k := range outs {
			h = append(h, runTok(id, k))
		}
		r := &Request{ID: id, History: h, Prompt: prompt, MaxTokens: outs + 40 + rng.IntN(60), Arrived: now}
		if rng.IntN(2) == 0 {
			r.Holder, r.Reserved = "h", 1<<40
		}
		c.Submit(r)
	}
	for range 200 {
		st := c.Next(now, 1<<20-c.CachedPages())
		if len(st.Batch) == 0 {
			return nil, now, false
		}
		if c.DecodeRun() && rng.IntN(3) > 0 {
			c.Output()
			return c, now, true
		}
		now = now.Add(time.Duration(10+rng.IntN(20)) * time.Millisecond)
		c.Done(now, stepTokens(st))
		c.Output()
	}
	return nil, now, false
}

func stepTokens(st Step) [][]int32 {
	out := make([][]int32, len(st.Batch))
	for i, ch := range st.Batch {
		if ch.Sample > 0 {
			out[i] = []int32{runTok(st.Reqs[i].ID, ch.OutIndex)}
		}
	}
	return out
}

// outputsByRequest is what a caller sees of Outputs: each request's events
// and checkpoint pages, in order.
type runSeen struct {
	events map[string][]string
	pages  map[string][]string
}

func (s *runSeen) add(o Output) {
	for _, ev := range o.Events {
		s.events[ev.Req.ID] = append(s.events[ev.Req.ID], fmt.Sprintf("%d:%d:%v:%d:%v:%v:%s", ev.Index, ev.Token, ev.Finish, ev.Latency, ev.First, ev.Err, ev.At.Format(time.RFC3339Nano)))
	}
	for _, p := range o.Checkpoints {
		s.pages[p.Req.ID] = append(s.pages[p.Req.ID], fmt.Sprintf("%s:%d:%d:%x:%d", p.Holder, p.Page, p.Seq, p.Hash, p.Reserved))
	}
}

func requestState(c *Core) string {
	var out string
	for _, r := range c.running {
		out += fmt.Sprintf("%s fed %d hist %v hashes %x sent %d last %s seq %d\n", r.ID, r.fed, r.History, r.hashes, r.ckptSent, r.lastToken.Format(time.RFC3339Nano), r.seq)
	}
	return out + fmt.Sprintf("cached %d", c.CachedPages())
}

func stepString(st Step) string {
	var out string
	for i, ch := range st.Batch {
		out += fmt.Sprintf("%s seq %d tokens %v sample %d out %d|", st.Reqs[i].ID, ch.Seq, ch.Tokens, ch.Sample, ch.OutIndex)
	}
	return out
}

// TestDecodeRunMatchesSteps: a decode run's rows advanced one at a time,
// in random pieces and orders (AdvanceRow), then Next, leave the Core as
// the same steps through Done and Next do: every request's history, fed
// positions, page hashes, pages sent and last token time, each request's
// events and checkpoint pages in order, and the next step.
func TestDecodeRunMatchesSteps(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	runs := 0
	for trial := range 300 {
		s := seed + uint64(trial)
		a, start, ok := runScenario(s)
		if !ok {
			continue
		}
		b, _, _ := runScenario(s)
		runs++
		rng := rand.New(rand.NewPCG(s, 9))
		limit := 1 << 30
		for _, r := range a.running {
			limit = min(limit, r.MaxTokens-r.Outputs())
		}
		steps := 1 + rng.IntN(limit-1) // no row finishes
		times := make([]time.Time, steps)
		now := start
		for k := range times {
			now = now.Add(time.Duration(5+rng.IntN(30)) * time.Millisecond)
			times[k] = now
		}
		// a: the steps through Done and Next.
		sa := &runSeen{events: map[string][]string{}, pages: map[string][]string{}}
		st := a.pending
		for k := range steps {
			a.Done(times[k], stepTokens(st))
			st = a.Next(times[k], 1<<20-a.CachedPages())
			sa.add(a.Output())
		}
		// b: row by row, in pieces, the rows in a random order.
		sb := &runSeen{events: map[string][]string{}, pages: map[string][]string{}}
		rows := b.pending.Reqs
		done := make([]int, len(rows))
		out0 := make([]int, len(rows))
		for i, ch := range b.pending.Batch {
			out0[i] = ch.OutIndex
		}
		for slices.ContainsFunc(done, func(d int) bool { return d < steps }) {
			i := rng.IntN(len(rows))
			if done[i] == steps {
				continue
			}
			n := 1 + rng.IntN(steps-done[i])
			toks := make([]int32, n)
			for k := range toks {
				toks[k] = runTok(rows[i].ID, out0[i]+done[i]+k)
			}
			if b.AdvanceRow(i, times[done[i]:done[i]+n], toks) {
				t.Fatalf("seed %d: row %d ended before its last token", s, i)
			}
			done[i] += n
			sb.add(b.Output())
		}
		stb := b.Next(times[steps-1], 1<<20-b.CachedPages())
		sb.add(b.Output())
		if got, want := requestState(b), requestState(a); got != want {
			t.Fatalf("seed %d, %d steps: state\n%s\nwant\n%s", s, steps, got, want)
		}
		if got, want := stepString(stb), stepString(st); got != want {
			t.Fatalf("seed %d: next step\n%s\nwant\n%s", s, got, want)
		}
		for id, ev := range sa.events {
			if !slices.Equal(sb.events[id], ev) || !slices.Equal(sb.pages[id], sa.pages[id]) {
				t.Fatalf("seed %d: %s: events\n%v\npages %v\nwant\n%v\npages %v", s, id, sb.events[id], sb.pages[id], ev, sa.pages[id])
			}
		}
		if len(sb.events) != len(sa.events) || len(sb.pages) != len(sa.pages) {
			t.Fatalf("seed %d: events of %d requests, pages of %d; want %d, %d", s, len(sb.events), len(sb.pages), len(sa.events), len(sa.pages))
		}
		// One token past a row's last: it ends, and says so.
		for i, r := range b.pending.Reqs {
			left := r.MaxTokens - r.Outputs()
			toks := make([]int32, left)
			tm := make([]time.Time, left)
			for k := range tm {
				tm[k] = now
			}
			if !b.AdvanceRow(i, tm, toks) {
				t.Fatalf("seed %d: row %d did not end at MaxTokens", s, i)
			}
			break
		}
	}
	if runs < 100 {
		t.Fatalf("seed %d: only %d scenarios reached a decode run", seed, runs)
	}
}

// TestDecodeRunRefuses: what keeps a pending step from starting a run.
func TestDecodeRunRefuses(t *testing.T) {
	now := time.Unix(1000, 0)
	mk := func() (*Core, *Request) {
		c := New(Config{Self: "w", TokenBudget: 4096, MaxRunning: 8, MaxWaiting: 8, TotalPages: 1 << 20}, nil)
		r := &Request{ID: "a", History: make([]int32, 20), Prompt: 20, MaxTokens: 50, Arrived: now}
		c.Submit(r)
		c.Done(now, stepTokens(c.Next(now, 1<<20)))
		return c, r
	}
	c, _ := mk()
	c.Next(now, 1<<20)
	if !c.DecodeRun() {
		t.Fatal("a lone decoding request is a run")
	}
	c, _ = mk()
	c.Submit(&Request{ID: "b", History: make([]int32, 20), Prompt: 20, MaxTokens: 5, Arrived: now})
	c.Next(now, 1<<20)
	if c.DecodeRun() {
		t.Fatal("a step with a prefill is not a run")
	}
	c, r := mk()
	r.Stop = map[int32]bool{7: true}
	c.Next(now, 1<<20)
	if c.DecodeRun() {
		t.Fatal("a request with stop tokens is not in a run")
	}
	c, _ = mk()
	c.SetSpec(SpecConfig{K: 2})
	c.Next(now, 1<<20)
	if c.DecodeRun() {
		t.Fatal("a Core that verifies drafts is not in a run")
	}
	c, r = mk()
	c.SetHolder(r.ID, r.Epoch, "h", 1<<30) // every page to send again
	c.Next(now, 1<<20)
	if c.DecodeRun() {
		t.Fatal("a request behind on its checkpoint is not in a run")
	}
}

// TestPageHashesIsFNV: PageHashes is hash/fnv's FNV-1a over the previous
// page's hash and the page's tokens, little endian, page by page, and
// extends a shorter prefix's hashes to the same values.
func TestPageHashesIsFNV(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		tokens := make([]int32, rng.IntN(200))
		for i := range tokens {
			tokens[i] = int32(rng.Uint32())
		}
		var want []uint64
		var b [8]byte
		for i := 0; (i+1)*16 <= len(tokens); i++ {
			h := fnv.New64a()
			if i > 0 {
				binary.LittleEndian.PutUint64(b[:], want[i-1])
				h.Write(b[:])
			}
			for _, x := range tokens[i*16 : (i+1)*16] {
				binary.LittleEndian.PutUint32(b[:4], uint32(x))
				h.Write(b[:4])
			}
			want = append(want, h.Sum64())
		}
		got := PageHashes(tokens, nil)
		if !slices.Equal(got, want) {
			t.Fatalf("%d tokens: %x, want %x", len(tokens), got, want)
		}
		if k := rng.IntN(len(want) + 1); !slices.Equal(PageHashes(tokens, slices.Clone(want[:k])), want) {
			t.Fatalf("%d tokens extending %d hashes: not the same", len(tokens), k)
		}
	}
}
