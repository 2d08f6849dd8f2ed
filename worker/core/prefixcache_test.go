package core

import (
	"slices"
	"testing"
	"time"
)

// cacheRig drives a Core with the prefix cache over an engine of total KV
// pages: each step's free pages are those neither requests nor the cache
// hold, and every sampled token is 7. It sums the Outputs.
type cacheRig struct {
	t      *testing.T
	c      *Core
	total  int
	now    time.Time
	stored []uint64
	evict  []uint64
	sum    Output
}

func newCacheRig(t *testing.T, total int, cfg Config) *cacheRig {
	cfg.TotalPages, cfg.PrefixCache = total, true
	if cfg.MaxRunning == 0 {
		cfg.MaxRunning = 16
	}
	if cfg.MaxWaiting == 0 {
		cfg.MaxWaiting = 64
	}
	if cfg.TokenBudget == 0 {
		cfg.TokenBudget = 512
	}
	return &cacheRig{t: t, c: New(cfg, nil), total: total, now: time.Unix(1000, 0)}
}

func (g *cacheRig) collect() Output {
	o := g.c.Output()
	for _, e := range o.Events {
		if e.Err != nil {
			g.t.Fatalf("%s: %v", e.Req.ID, e.Err)
		}
	}
	g.stored = append(g.stored, o.KVStored...)
	g.evict = append(g.evict, o.KVRemoved...)
	g.sum.CacheHitTokens += o.CacheHitTokens
	g.sum.CacheQueryTokens += o.CacheQueryTokens
	g.sum.Preemptions += o.Preemptions
	g.sum.Completed += o.Completed
	return o
}

// step runs one step and returns its batch as text.
func (g *cacheRig) step() string {
	g.t.Helper()
	free := g.total - g.c.CachedPages() - g.c.EvictablePages()
	if free < 0 {
		g.t.Fatalf("%d pages in use and %d cached of %d", g.c.CachedPages(), g.c.EvictablePages(), g.total)
	}
	st := g.c.Next(g.now, free)
	g.collect()
	if used := g.c.CachedPages() + g.c.EvictablePages() + stepDemand(st); used > g.total {
		g.t.Fatalf("step %q needs %d pages of %d", batchText(st), used, g.total)
	}
	text := batchText(st)
	out := make([][]int32, len(st.Batch))
	for i, ch := range st.Batch {
		for range ch.Sample {
			out[i] = append(out[i], 7)
		}
	}
	g.now = g.now.Add(10 * time.Millisecond)
	g.c.Done(g.now, out)
	g.collect()
	return text
}

func (g *cacheRig) run() {
	for i := 0; !g.c.Idle(); i++ {
		if i > 10000 {
			g.t.Fatal("no end")
		}
		g.step()
	}
}

// history is n tokens: the first shared of them from the shared stream,
// the rest the request's own.
func history(shared, n int, own int32) []int32 {
	h := make([]int32, n)
	for i := range h {
		if i < shared {
			h[i] = int32(40 + i%61)
		} else {
			h[i] = 200 + own*7 + int32(i%13)
		}
	}
	return h
}

func (g *cacheRig) submit(id string, hist []int32, maxTokens int) *Request {
	r := &Request{ID: id, History: hist, Prompt: len(hist), MaxTokens: maxTokens, Arrived: g.now}
	g.c.Submit(r)
	g.collect()
	return r
}

// TestPrefixCacheHitSkipsPrefill: a request whose prompt starts with a
// finished request's full pages references them and prefills only the
// rest; the pages entered the cache once (KVStored) and count once.
func TestPrefixCacheHitSkipsPrefill(t *testing.T) {
	g := newCacheRig(t, 64, Config{})
	g.submit("a", history(64, 70, 1), 3)
	g.run()
	// a's history: 70 prompt tokens and 2 fed outputs: 4 full pages.
	if len(g.stored) != 4 || g.c.EvictablePages() != 4 || g.c.CachedPages() != 0 {
		t.Fatalf("after a: stored %d, evictable %d, in use %d; want 4, 4, 0", len(g.stored), g.c.EvictablePages(), g.c.CachedPages())
	}
	want := PageHashes(history(64, 70, 1), nil)
	if !slices.Equal(g.stored, want) {
		t.Fatalf("KVStored %x, want a's page hashes %x", g.stored, want)
	}
	g.submit("b", history(64, 90, 2), 2)
	if got := g.step(); got != "b:64+26/1" {
		t.Fatalf("b's first step %q, want b:64+26/1 (its 64 shared tokens cached)", got)
	}
	if g.sum.CacheHitTokens != 64 || g.sum.CacheQueryTokens != 70+90 {
		t.Fatalf("hits %d of %d tokens, want 64 of 160", g.sum.CacheHitTokens, g.sum.CacheQueryTokens)
	}
	// b holds the 4 shared pages (referenced, no longer evictable) and 2
	// of its own.
	if g.c.CachedPages() != 6 || g.c.EvictablePages() != 0 {
		t.Fatalf("b running: %d in use, %d evictable; want 6, 0", g.c.CachedPages(), g.c.EvictablePages())
	}
}

// TestPrefixCacheSharedPagesCountOnce: two requests running on the same
// prefix hold its pages once; when one ends they stay referenced by the
// other (none evictable), and only when both ended do they become
// evictable.
func TestPrefixCacheSharedPagesCountOnce(t *testing.T) {
	g := newCacheRig(t, 64, Config{})
	g.submit("a", history(64, 66, 1), 40)
	g.step() // a prefills; its 4 full pages enter the cache
	g.submit("b", history(64, 66, 2), 2)
	if got := g.step(); got != "a:66+1/1 b:64+2/1" {
		t.Fatalf("step %q, want a decoding and b hitting 64 tokens", got)
	}
	// a: 4 shared + 1 own (66+1 positions); b: 4 shared + 1 own.
	if got := g.c.CachedPages(); got != 6 {
		t.Fatalf("%d pages in use, want 6 (4 shared once, 1 each)", got)
	}
	for g.c.Running() == 2 {
		g.step()
	}
	// b ended: its own page is free, the shared ones a still holds; b's
	// own first page's tokens 64..67 fill no page, so nothing of b's is
	// cached.
	if g.c.EvictablePages() != 0 {
		t.Fatalf("b ended, a runs: %d evictable, want 0", g.c.EvictablePages())
	}
	g.run()
	if g.c.EvictablePages() != len(g.stored) || g.c.CachedPages() != 0 {
		t.Fatalf("all ended: %d evictable, %d stored, %d in use", g.c.EvictablePages(), len(g.stored), g.c.CachedPages())
	}
}

// TestPrefixCacheEvictsLRUTailFirst: a request that needs more pages than
// are free evicts unreferenced pages, the least recently released first,
// and of one request's pages its tail first; the evictions are KVRemoved
// and what was evicted no longer hits.
func TestPrefixCacheEvictsLRUTailFirst(t *testing.T) {
	g := newCacheRig(t, 16, Config{TokenBudget: 256})
	g.submit("a", history(0, 64, 1), 1) // 4 pages, released first
	g.run()
	g.submit("b", history(0, 64, 2), 1) // 4 pages, released second
	g.run()
	ha, hb := PageHashes(history(0, 64, 1), nil), PageHashes(history(0, 64, 2), nil)
	if g.c.EvictablePages() != 8 {
		t.Fatalf("%d evictable, want 8", g.c.EvictablePages())
	}
	// c needs 14 pages: 8 are free, 6 must be evicted: a's 4 (tail
	// first), then b's tail two.
	g.submit("c", history(0, 14*16, 3), 1)
	g.step()
	want := []uint64{ha[3], ha[2], ha[1], ha[0], hb[3], hb[2]}
	if !slices.Equal(g.evict, want) {
		t.Fatalf("evicted %x, want %x (a's pages tail first, then b's tail)", g.evict, want)
	}
	g.run()
	// b's first two pages survive: a request on b's prompt hits 32 tokens.
	g.sum.CacheHitTokens = 0
	g.submit("d", history(0, 64, 2), 1)
	g.step()
	if g.sum.CacheHitTokens != 32 {
		t.Fatalf("d hit %d tokens, want 32 (b's first two pages)", g.sum.CacheHitTokens)
	}
}

// TestPrefixCachePreemptionOnSharedPages: preempting a request that shares
// pages with another frees only its own pages, keeps the shared ones for
// the other, and the victim, admitted again, hits its own history; every
// output matches a run with the cache off.
func TestPrefixCachePreemptionOnSharedPages(t *testing.T) {
	run := func(cache bool) (map[string][]int32, int, int) {
		cfg := Config{TokenBudget: 128, Preemption: PreemptVLLM, MaxRunning: 4}
		g := newCacheRig(t, 12, cfg)
		if !cache {
			off := g.c.cfg
			off.PrefixCache = false
			g.c = New(off, nil)
		}
		out := map[string][]int32{}
		reqs := []*Request{g.submit("a", history(64, 72, 1), 60), g.submit("b", history(64, 72, 2), 60)}
		for i := 0; !g.c.Idle(); i++ {
			if i > 10000 {
				t.Fatal("no end")
			}
			g.step()
		}
		for _, r := range reqs {
			out[r.ID] = r.History[r.Prompt:]
		}
		return out, g.sum.Preemptions, g.sum.CacheHitTokens
	}
	on, preOn, hits := run(true)
	off, preOff, _ := run(false)
	if preOff == 0 || preOn == 0 {
		t.Fatalf("preemptions: %d with the cache, %d without: the setup must preempt", preOn, preOff)
	}
	for id := range off {
		if !slices.Equal(on[id], off[id]) || len(on[id]) != 60 {
			t.Fatalf("%s: %d tokens with the cache, %d without, or they differ", id, len(on[id]), len(off[id]))
		}
	}
	// Both were admitted in the first step (nothing cached yet); the
	// victim, admitted again, hits the shared prefix a still holds and
	// the pages of its own history eviction left.
	if hits <= 64 {
		t.Fatalf("%d tokens hit, want more than 64 (the shared prefix and the victim's own pages)", hits)
	}
}

// TestQueuedPagesLessTheCachedPrefix: a waiting request's demand in the
// load report (QueuedPages) is its history's pages less those the cache
// holds as it enters the queue: the pages an admission would reference
// instead of allocating. Counted whole, a queue sharing a long cached
// context read as several times its demand, and prefix-aware dispatch
// turned away from the worker caching it (docs/benchmarks.md, "Issue 25").
func TestQueuedPagesLessTheCachedPrefix(t *testing.T) {
	g := newCacheRig(t, 64, Config{MaxRunning: 1})
	g.submit("a", history(64, 70, 1), 3)
	g.run() // a's 4 full pages cached, unreferenced
	g.submit("run", history(0, 20, 9), 50)
	g.step() // run takes the one slot
	// b shares a's 64 tokens (4 pages) of its 90: 6 pages, 4 cached; c
	// shares nothing: 3 pages.
	g.submit("b", history(64, 90, 2), 2)
	g.submit("c", history(0, 40, 3), 2)
	if got := g.c.QueuedPages(); got != (6-4)+3 {
		t.Fatalf("queued %d pages, want 5 (b's 6 less its 4 cached, c's 3)", got)
	}
	// Without the cache a queue counts whole: TestQueuedPages.
}
