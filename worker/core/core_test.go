package core

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/worker/engine"
)

// harness drives a Core over a real synthetic engine, as the protocol of
// use says, and records every batch as text.
type harness struct {
	t       *testing.T
	c       *Core
	eng     *engine.Synthetic
	now     time.Time
	batches []string
	out     map[string][]int32            // tokens streamed per request id
	lps     map[string][]*engine.Logprobs // their logprobs (nil: none sent)
	errs    map[string]error
	ckpt    map[string][]uint64 // checkpoint pages queued, by request
	refuse  func(CheckpointPage) bool
	total   Output         // counters summed
	ended   []MigrationEnd // migrations out the core ended
	// pages, when set, receives each checkpoint page's bytes, exported
	// from the engine before the step's releases.
	pages map[string]map[int][][]byte
}

// memStore holds pages by hash and knows no request ids: a call with no
// output tokens is a new request to it.
type memStore map[uint64][]byte

func (m memStore) Holds(string) bool { return false }

func (m memStore) Prefix(hashes []uint64) [][]byte {
	var out [][]byte
	for _, h := range hashes {
		p, ok := m[h]
		if !ok {
			break
		}
		out = append(out, p)
	}
	return out
}

func newHarness(t *testing.T, pages int, cfg Config, store Store) *harness {
	eng, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: pages})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.MaxWaiting == 0 {
		cfg.MaxWaiting = 64
	}
	if cfg.MaxRunning == 0 {
		cfg.MaxRunning = 16
	}
	if cfg.TokenBudget == 0 {
		cfg.TokenBudget = 512
	}
	cfg.TotalPages = pages
	return &harness{t: t, c: New(cfg, store), eng: eng, now: time.Unix(1000, 0), out: map[string][]int32{},
		errs: map[string]error{}, ckpt: map[string][]uint64{}, lps: map[string][]*engine.Logprobs{}}
}

func (h *harness) apply() {
	o := h.c.Output()
	if h.pages != nil {
		for _, p := range o.Checkpoints {
			data, err := h.eng.ExportPage(p.Seq, p.Page)
			if err != nil {
				h.t.Fatalf("exporting page %d of %s: %v", p.Page, p.Req.ID, err)
			}
			if h.pages[p.Req.ID] == nil {
				h.pages[p.Req.ID] = map[int][][]byte{}
			}
			h.pages[p.Req.ID][p.Page] = append(h.pages[p.Req.ID][p.Page], data)
		}
	}
	for _, s := range o.Release {
		h.eng.Release(s)
	}
	for _, tr := range o.Truncates {
		if err := h.eng.Truncate(tr.Seq, tr.Len); err != nil {
			h.t.Fatalf("truncate %+v: %v", tr, err)
		}
	}
	for _, ev := range o.Events {
		if ev.Err != nil {
			h.errs[ev.Req.ID] = ev.Err
			continue
		}
		h.out[ev.Req.ID] = append(h.out[ev.Req.ID], ev.Token)
		h.lps[ev.Req.ID] = append(h.lps[ev.Req.ID], ev.Logprobs)
	}
	var behind *Request
	for _, p := range o.Checkpoints {
		if p.Req == behind {
			continue
		}
		if h.refuse != nil && h.refuse(p) {
			h.c.CheckpointBehind(p.Req, p.Page)
			behind = p.Req
			continue
		}
		h.ckpt[p.Req.ID] = append(h.ckpt[p.Req.ID], p.Hash)
	}
	h.ended = append(h.ended, o.MigrationsEnded...)
	h.total.Preemptions += o.Preemptions
	h.total.Completed += o.Completed
	h.total.RestoredPages += o.RestoredPages
	h.total.RecomputedTokens += o.RecomputedTokens
	h.total.HeldTokens += o.HeldTokens
}

// step runs one engine step; false when there was nothing to run.
func (h *harness) step() bool {
	for {
		st := h.c.Next(h.now, h.eng.FreePages())
		h.apply()
		if len(st.Batch) == 0 {
			return false
		}
		if free := h.eng.FreePages(); free != h.eng.Info().TotalPages-h.c.CachedPages()+pagesOf(st.Restores) {
			h.t.Fatalf("engine has %d free pages, the core counts %d", free, h.eng.Info().TotalPages-h.c.CachedPages()+pagesOf(st.Restores))
		}
		ok := true
		for _, rs := range st.Restores {
			if err := h.eng.ImportPages(rs.Seq, rs.Pages); err != nil {
				h.c.RestoreFailed(rs.Req)
				h.apply()
				ok = false
				break
			}
		}
		if !ok {
			continue
		}
		var parts []string
		for i, ch := range st.Batch {
			parts = append(parts, fmt.Sprintf("%s:%d+%d/%d", st.Reqs[i].ID, st.Reqs[i].Fed(), len(ch.Tokens), ch.Sample))
		}
		out, err := h.eng.Forward(context.Background(), st.Batch)
		if err != nil {
			retry := h.c.StepFailed(err)
			h.apply()
			if retry {
				continue
			}
			return true
		}
		h.batches = append(h.batches, strings.Join(parts, " "))
		h.now = h.now.Add(10 * time.Millisecond)
		h.c.Done(h.now, out)
		h.apply()
		return true
	}
}

func pagesOf(rs []Restore) int {
	n := 0
	for _, r := range rs {
		n += len(r.Pages)
	}
	return n
}

func (h *harness) run() {
	for i := 0; !h.c.Idle(); i++ {
		if i > 10000 {
			h.t.Fatal("no progress after 10000 steps")
		}
		h.step()
	}
}

func (h *harness) submit(id string, prompt []int32, generated []int32, maxTokens int) *Request {
	r := &Request{ID: id, History: append(slices.Clone(prompt), generated...), Prompt: len(prompt), MaxTokens: maxTokens, Arrived: h.now}
	h.c.Submit(r)
	h.apply()
	return r
}

func prompt(rng *rand.Rand, n int) []int32 {
	p := make([]int32, n)
	for i := range p {
		p[i] = 32 + int32(rng.IntN(95))
	}
	return p
}

func reference(t *testing.T, p []int32, n int) []int32 {
	e, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 1024})
	if err != nil {
		t.Fatal(err)
	}
	out, err := e.Forward(context.Background(), []engine.Chunk{{Seq: 1, Tokens: p, Sample: 1}})
	if err != nil {
		t.Fatal(err)
	}
	toks := []int32{out[0][0]}
	for len(toks) < n {
		out, err = e.Forward(context.Background(), []engine.Chunk{{Seq: 1, Tokens: toks[len(toks)-1:], Sample: 1, OutIndex: len(toks)}})
		if err != nil {
			t.Fatal(err)
		}
		toks = append(toks, out[0][0])
	}
	return toks
}

// referenceLogprobs is the synthetic engine's run of p alone, with each
// token's logprobs and k alternatives.
func referenceLogprobs(t *testing.T, p []int32, n, k int) []engine.Logprobs {
	e, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 1024})
	if err != nil {
		t.Fatal(err)
	}
	var lps []engine.Logprobs
	in := p
	for len(lps) < n {
		slot := make([]engine.Logprobs, 1)
		out, err := e.Forward(context.Background(), []engine.Chunk{{Seq: 1, Tokens: in, Sample: 1, OutIndex: len(lps), Logprobs: slot, TopLogprobs: k}})
		if err != nil {
			t.Fatal(err)
		}
		lps, in = append(lps, slot[0]), out[0]
	}
	return lps
}

// TestCoreScenarios checks the batches the core builds, step by step.
func TestCoreScenarios(t *testing.T) {
	seed := uint64(7)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	p150, p100, p40 := prompt(rng, 150), prompt(rng, 100), prompt(rng, 40)
	cases := []struct {
		name   string
		pages  int
		cfg    Config
		script func(h *harness)
		want   []string // the first batches
		check  func(t *testing.T, h *harness)
	}{{
		name: "chunked prefill under the token budget", pages: 64, cfg: Config{TokenBudget: 64},
		script: func(h *harness) { h.submit("a", p150, nil, 3) },
		want:   []string{"a:0+64/0", "a:64+64/0", "a:128+22/1", "a:150+1/1", "a:151+1/1"},
	}, {
		name: "a decode and a prefill chunk share the budget", pages: 64, cfg: Config{TokenBudget: 64},
		script: func(h *harness) {
			h.submit("a", p40, nil, 4)
			h.step()
			h.submit("b", p100, nil, 2)
		},
		want: []string{"a:0+40/1", "a:40+1/1 b:0+63/0", "a:41+1/1 b:63+37/1", "a:42+1/1 b:100+1/1"},
	}, {
		// r1 fills 10 of 12 pages at once; r2 is admitted into the
		// headroom and takes the last pages as it grows; when neither can
		// get a page the squeeze preempts r2, the most recently admitted,
		// which is recomputed after r1 ends.
		name: "preemption of the newest admitted", pages: 12, cfg: Config{},
		script: func(h *harness) {
			h.submit("r1", p150, nil, 30) // up to 180 positions: all 12 pages
			h.step()
			h.submit("r2", p100[:10], nil, 40)
		},
		check: func(t *testing.T, h *harness) {
			if h.total.Preemptions == 0 {
				t.Error("no preemption")
			}
			if h.total.Completed != 2 {
				t.Errorf("%d completed", h.total.Completed)
			}
		},
	}, {
		name: "resumed requests go ahead of new ones", pages: 64, cfg: Config{MaxRunning: 1},
		script: func(h *harness) {
			// busy's cache (16) is longer than the resumed history (9): it
			// is not displaced.
			h.submit("busy", p40[:16], nil, 3)
			h.step()
			h.submit("new", p40[16:24], nil, 1)
			ref := reference(t, p40[24:32], 2)
			h.submit("resumed", p40[24:32], ref[:1], 2)
		},
		want: []string{"busy:0+16/1", "busy:16+1/1", "busy:17+1/1", "resumed:0+9/1", "new:0+8/1"},
		check: func(t *testing.T, h *harness) {
			if h.total.RecomputedTokens != 9 || h.total.Preemptions != 0 {
				t.Errorf("recomputed %d tokens of the resumed request, %d preemptions; want 9 and 0", h.total.RecomputedTokens, h.total.Preemptions)
			}
		},
	}, {
		name: "a resumed request displaces a young new one", pages: 64, cfg: Config{MaxRunning: 1},
		script: func(h *harness) {
			// busy's cache (8) is no longer than the resumed history (9):
			// it waits again, behind the resume, and recomputes.
			h.submit("busy", p40[:8], nil, 3)
			h.step()
			h.submit("new", p40[8:16], nil, 1)
			ref := reference(t, p40[16:24], 2)
			h.submit("resumed", p40[16:24], ref[:1], 2)
		},
		want: []string{"busy:0+8/1", "resumed:0+9/1", "busy:0+9/1", "busy:9+1/1", "new:0+8/1"},
		check: func(t *testing.T, h *harness) {
			if h.total.RecomputedTokens != 9 {
				t.Errorf("recomputed %d tokens of the resumed request, want 9", h.total.RecomputedTokens)
			}
		},
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.pages, tc.cfg, nil)
			tc.script(h)
			h.run()
			if tc.want != nil && !slices.Equal(h.batches[:min(len(tc.want), len(h.batches))], tc.want) {
				t.Fatalf("batches\n%s\nwant\n%s", strings.Join(h.batches, "\n"), strings.Join(tc.want, "\n"))
			}
			for id, err := range h.errs {
				t.Errorf("%s: %v", id, err)
			}
			if tc.check != nil {
				tc.check(t, h)
			}
			if h.eng.FreePages() != tc.pages {
				t.Errorf("%d of %d pages free at the end", h.eng.FreePages(), tc.pages)
			}
		})
	}
}

// TestCoreOutputsMatchTheReference: whatever the batching, chunking and
// preemption, every request's tokens are those it gets alone.
func TestCoreOutputsMatchTheReference(t *testing.T) {
	seed := uint64(11)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	h := newHarness(t, 24, Config{TokenBudget: 48, MaxRunning: 4}, nil)
	want := map[string][]int32{}
	for i := range 12 {
		id := fmt.Sprintf("r%d", i)
		p, n := prompt(rng, 10+rng.IntN(120)), 1+rng.IntN(40)
		want[id] = reference(t, p, n)
		h.submit(id, p, nil, n)
		h.step()
	}
	h.run()
	for id, w := range want {
		if !slices.Equal(h.out[id], w) {
			t.Errorf("%s: got %v, want %v", id, h.out[id], w)
		}
	}
	if h.total.Preemptions == 0 {
		t.Log("no preemption happened; the cache is not tight enough to test it")
	}
	if h.eng.FreePages() != 24 {
		t.Errorf("%d pages free at the end, want 24", h.eng.FreePages())
	}
}

// TestCoreRestoresACheckpointedPrefix: a resumed request whose pages the
// store holds imports them and prefills only the rest; its output is the
// reference.
func TestCoreRestoresACheckpointedPrefix(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 0))
	p := prompt(rng, 70)
	ref := reference(t, p, 12)
	// The serving worker's pages: a holder received them.
	src := newHarness(t, 64, Config{Self: "w1"}, nil)
	src.submit("x", p, nil, 12)
	src.c.Lookup("x").Holder, src.c.Lookup("x").Reserved = "w2", 1<<30
	store := memStore{}
	for range 8 {
		src.step()
	}
	r := src.c.Lookup("x")
	hashes := src.ckpt["x"]
	if len(hashes) != (70+7)/16 {
		t.Fatalf("%d pages checkpointed after 8 steps (history %d), want %d", len(hashes), len(r.History), (70+7)/16)
	}
	for i, hsh := range hashes {
		data, err := src.eng.ExportPage(r.Seq(), i)
		if err != nil {
			t.Fatal(err)
		}
		store[hsh] = data
	}
	generated := src.out["x"]
	// The worker fails; the request resumes at its holder.
	h := newHarness(t, 64, Config{Self: "w2"}, store)
	h.submit("x", p, generated, 12)
	h.run()
	if !slices.Equal(append(slices.Clone(generated), h.out["x"]...), ref) {
		t.Fatalf("resumed output %v, want %v", append(generated, h.out["x"]...), ref)
	}
	if h.total.RestoredPages != 4 || h.total.RecomputedTokens != 70+8-64 {
		t.Fatalf("restored %d pages, recomputed %d tokens; want 4 and %d", h.total.RestoredPages, h.total.RecomputedTokens, 70+8-64)
	}
	if h.batches[0] != "x:64+14/1" {
		t.Fatalf("first batch %q, want the partial prefill x:64+14/1", h.batches[0])
	}
}

// heldStore is a holder's store that knows which requests it holds, as
// the worker's and the simulator's do.
type heldStore struct {
	memStore
	ids map[string]bool
}

func (s heldStore) Holds(id string) bool { return s.ids[id] }

// TestCoreRestoresAPrefillInterrupted: a request whose worker failed while
// it prefilled a long prompt in chunks (no output token yet) resumes at
// its holder with its prompt alone, as a new call looks; the holder's
// checkpoint of it makes it a resume: its prefilled pages are imported,
// only the rest of the prompt is prefilled, and it waits ahead of the new
// requests. Before, such a request was new to the holder: 0 pages
// restored, the whole prompt prefilled again, at the back of the queue.
func TestCoreRestoresAPrefillInterrupted(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 0))
	p := prompt(rng, 200)
	ref := reference(t, p, 6)
	src := newHarness(t, 64, Config{Self: "w1", TokenBudget: 64}, nil)
	src.submit("x", p, nil, 6)
	src.c.Lookup("x").Holder, src.c.Lookup("x").Reserved = "w2", 1<<30
	src.step()
	src.step()
	r := src.c.Lookup("x")
	if len(src.out["x"]) != 0 || r.Fed() != 128 {
		t.Fatalf("after two chunks: %d tokens out, %d prefilled; the test wants the prompt half prefilled", len(src.out["x"]), r.Fed())
	}
	store := heldStore{memStore{}, map[string]bool{"x": true}}
	for i, hsh := range src.ckpt["x"] {
		data, err := src.eng.ExportPage(r.Seq(), i)
		if err != nil {
			t.Fatal(err)
		}
		store.memStore[hsh] = data
	}
	if len(store.memStore) != 8 {
		t.Fatalf("%d pages checkpointed, want the 8 prefilled", len(store.memStore))
	}
	// The worker fails. At the holder a new request is queued first; the
	// interrupted one arrives after it, with its prompt alone.
	h := newHarness(t, 64, Config{Self: "w2", TokenBudget: 64, MaxRunning: 1}, store)
	h.submit("new", prompt(rng, 30), nil, 4)
	h.submit("x", p, nil, 6)
	h.run()
	if !slices.Equal(h.out["x"], ref) {
		t.Fatalf("resumed output %v, want %v", h.out["x"], ref)
	}
	if h.total.RestoredPages != 8 {
		t.Fatalf("restored %d pages, want the 8 checkpointed", h.total.RestoredPages)
	}
	if !strings.HasPrefix(h.batches[0], "x:128+") {
		t.Fatalf("first batch %q: want the interrupted request first, prefilling from its 128 restored tokens", h.batches[0])
	}
}

// TestCoreSetHolderLate: a request the gateway started before its placement
// committed runs with no holder; SetHolder after several pages filled
// makes the next step export every full page from page 0, and each later
// one: every page reaches the holder exactly once, byte-equal to the pages
// of a run that had the holder from the start, and the output is the
// reference.
func TestCoreSetHolderLate(t *testing.T) {
	rng := rand.New(rand.NewPCG(16, 0))
	p := prompt(rng, 40)
	const n = 90
	ref := reference(t, p, n)
	run := func(setAfter int) *harness {
		h := newHarness(t, 64, Config{Self: "w1", TokenBudget: 16}, nil)
		h.pages = map[string]map[int][][]byte{}
		r := h.submit("x", p, nil, n)
		r.Epoch = 3
		if setAfter == 0 {
			r.Holder, r.Reserved = "w2", 1<<20
		}
		for i := 0; !h.c.Idle(); i++ {
			if i > 10000 {
				t.Fatal("no progress after 10000 steps")
			}
			if setAfter > 0 && i == setAfter {
				if h.c.SetHolder("x", 2, "w2", 1<<20) || h.c.SetHolder("y", 3, "w2", 1<<20) || h.c.SetHolder("x", 3, "", 1<<20) {
					t.Fatal("SetHolder applied with a stale epoch, an unknown id or no holder")
				}
				if len(h.pages["x"]) != 0 {
					t.Fatalf("%d pages exported before the holder was set", len(h.pages["x"]))
				}
				if r.fed < 3*16 {
					t.Fatalf("only %d tokens in the cache when the holder is set; the test wants several full pages", r.fed)
				}
				if !h.c.SetHolder("x", 3, "w2", 1<<20) {
					t.Fatal("SetHolder refused for the running request at its epoch")
				}
				if h.c.SetHolder("x", 3, "w3", 1<<20) {
					t.Fatal("SetHolder replaced a holder already set")
				}
			}
			h.step()
		}
		if !slices.Equal(h.out["x"], ref) {
			t.Fatalf("setAfter %d: output %v, want %v", setAfter, h.out["x"], ref)
		}
		return h
	}
	plain := run(0)
	late := run(20)
	want := plain.pages["x"]
	if len(want) < 5 {
		t.Fatalf("the plain run exported %d pages; the test wants several", len(want))
	}
	got := late.pages["x"]
	if len(got) != len(want) {
		t.Fatalf("late holder received %d pages, the plain run %d", len(got), len(want))
	}
	for i := range len(want) {
		if len(got[i]) != 1 || len(want[i]) != 1 {
			t.Fatalf("page %d exported %d times (plain run: %d), want exactly once", i, len(got[i]), len(want[i]))
		}
		if !slices.Equal(got[i][0], want[i][0]) {
			t.Fatalf("page %d differs from the plain run's", i)
		}
	}
}

// TestCoreCheckpointFallsBehindAndCatchesUp: a page the holder's queue
// refuses is queued again after the next step, in order.
func TestCoreCheckpointFallsBehindAndCatchesUp(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 0))
	h := newHarness(t, 64, Config{Self: "w1"}, nil)
	r := h.submit("x", prompt(rng, 64), nil, 40)
	r.Holder, r.Reserved = "w2", 1<<30
	refused := 0
	h.refuse = func(p CheckpointPage) bool {
		if p.Page == 2 && refused < 3 {
			refused++
			return true
		}
		return false
	}
	h.run()
	want := PageHashes(r.History[:64+39], nil)
	if !slices.Equal(h.ckpt["x"], want) {
		t.Fatalf("checkpointed %d pages, want %d in order", len(h.ckpt["x"]), len(want))
	}
}

// TestCoreStepFailure: an engine error other than out-of-pages ends the
// step's requests alone.
func TestCoreStepFailure(t *testing.T) {
	c := New(Config{TokenBudget: 16, MaxRunning: 4, MaxWaiting: 4, TotalPages: 8}, nil)
	r := &Request{ID: "a", History: []int32{1, 2, 3}, Prompt: 3, MaxTokens: 2}
	c.Submit(r)
	st := c.Next(time.Unix(0, 0), 8)
	if len(st.Batch) != 1 {
		t.Fatalf("batch %v", st.Batch)
	}
	c.Output()
	if c.StepFailed(errors.New("boom")) {
		t.Fatal("retry on a plain error")
	}
	o := c.Output()
	if len(o.Events) != 1 || o.Events[0].Err == nil || !c.Idle() {
		t.Fatalf("events %v, idle %v", o.Events, c.Idle())
	}
}

// TestCoreTooLargeAndQueueFull: the refusals. A call that cannot fit is
// refused at Submit when the Core knows the engine's pages; when it does
// not (TotalPages 0), by Next, once the head cannot start in every free
// page while the Core holds nothing.
func TestCoreTooLargeAndQueueFull(t *testing.T) {
	c := New(Config{TokenBudget: 64, MaxRunning: 4, MaxWaiting: 1, TotalPages: 2}, nil)
	c.Submit(&Request{ID: "big", History: make([]int32, 40), Prompt: 40, MaxTokens: 2})
	o := c.Output()
	if len(o.Events) != 1 || !errors.Is(o.Events[0].Err, ErrTooLarge) {
		t.Fatalf("events %+v", o.Events)
	}
	c.Submit(&Request{ID: "first", History: []int32{1}, Prompt: 1, MaxTokens: 1})
	c.Submit(&Request{ID: "second", History: []int32{1}, Prompt: 1, MaxTokens: 1})
	o = c.Output()
	if len(o.Events) != 1 || o.Events[0].Req.ID != "second" || !errors.Is(o.Events[0].Err, ErrQueueFull) {
		t.Fatalf("events %+v", o.Events)
	}
	if msg := o.Events[0].Err.Error(); !strings.Contains(msg, "limit of 1") || !strings.Contains(msg, "-max-waiting") {
		t.Fatalf("refusal %q does not name the limit", msg)
	}

	c = New(Config{TokenBudget: 64, MaxRunning: 4, MaxWaiting: 1}, nil)
	c.Submit(&Request{ID: "big", History: make([]int32, 40), Prompt: 40, MaxTokens: 2})
	if st := c.Next(time.Unix(0, 0), 2); len(st.Batch) != 0 {
		t.Fatal("a batch for a request that cannot fit")
	}
	o = c.Output()
	if len(o.Events) != 1 || !errors.Is(o.Events[0].Err, ErrTooLarge) || !c.Idle() {
		t.Fatalf("events %+v, idle %v", o.Events, c.Idle())
	}
}

func TestWaitWindow(t *testing.T) {
	var w WaitWindow
	t0 := time.Unix(100, 0)
	w.Add(Wait{At: t0, Wait: 10 * time.Millisecond}, Wait{At: t0.Add(5 * time.Second), Wait: 30 * time.Millisecond})
	if got := w.Mean(t0.Add(6*time.Second), 10*time.Second); got != 20 {
		t.Fatalf("q_w %v, want 20", got)
	}
	if got := w.Mean(t0.Add(12*time.Second), 10*time.Second); got != 30 {
		t.Fatalf("q_w %v after the first left the window, want 30", got)
	}
}
