package worker

import (
	"context"
	"fmt"
	"math/rand"
	"slices"
	"sync"
	"testing"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

func prefixOn(c *Config) { c.PrefixCache = true }

// TestPrefixCacheHitIsBitIdentical: with the cache on, a second request
// whose prompt starts with the first's 6 full pages prefills only the rest
// (the hit is counted, its tokens are not computed) and both outputs, their
// logprobs too, are those of the requests computed from scratch, bit for
// bit. The cached pages stay in the engine after both end, and each stored
// page was reported once.
func TestPrefixCacheHitIsBitIdentical(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	const pages = 64
	h := start(t, pages, prefixOn)
	shared := randomPrompt(rng, 6*engine.PageTokens)
	p1 := append(slices.Clip(shared), randomPrompt(rng, 9)...)
	p2 := append(slices.Clip(shared), randomPrompt(rng, 13)...)
	const n = 12
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for i, p := range [][]int32{p1, p2} {
		got, err := h.generateLogprobs(ctx, &pb.GenerateRequest{RequestId: fmt.Sprintf("r%d", i), Prompt: p, MaxTokens: n, Logprobs: true, TopLogprobs: 5})
		if err != nil {
			t.Fatal(err)
		}
		want := referenceLogprobs(t, p, n, 5)
		if !slices.Equal(tokens(got), tokens(want)) {
			t.Fatalf("request %d: tokens %v, from scratch %v", i, tokens(got), tokens(want))
		}
		if err := sameLogprobs(got, want); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
	queries, hits := counterValue(h.w.metrics.cacheQueries), counterValue(h.w.metrics.cacheHits)
	if want := float64(len(p1) + len(p2)); queries != want {
		t.Errorf("%v tokens queried, want %v", queries, want)
	}
	if want := float64(6 * engine.PageTokens); hits != want {
		t.Errorf("%v tokens hit, want %v (the shared 6 pages)", hits, want)
	}
	// The cache holds p1's and p2's full pages (6 shared, then each one's
	// own full pages through its last computed token).
	waitUntil(t, 10*time.Second, "the cache to settle", func() bool {
		return h.w.sched.busy() == 0
	})
	cached := len(h.w.kv.snapshot())
	want := 6 + (len(p1)+n-1)/engine.PageTokens - 6 + (len(p2)+n-1)/engine.PageTokens - 6
	if cached != want {
		t.Errorf("%d pages cached, want %d", cached, want)
	}
	if free := h.eng.FreePages(); free != pages-cached {
		t.Errorf("%d pages free with %d cached, want %d", free, cached, pages-cached)
	}
}

// snapshot is every hash cached now (for tests).
func (k *kvHub) snapshot() []uint64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.snapshotLocked()
}

// TestPrefixCacheUnderPressure: 12 requests in 3 groups sharing a prefix of
// 3 pages each, concurrently, on a KV cache too small for them (cached pages
// are evicted, requests preempted under -preemption vllm): every output is
// the request computed alone, and at the end every page the engine holds is
// one the cache reports.
func TestPrefixCacheUnderPressure(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	const pages = 20
	h := start(t, pages, func(c *Config) {
		c.PrefixCache, c.TokenBudget, c.Preemption = true, 32, core.PreemptVLLM
	})
	var prefixes [3][]int32
	for i := range prefixes {
		prefixes[i] = randomPrompt(rng, 3*engine.PageTokens)
	}
	type job struct {
		prompt []int32
		n      int
	}
	jobs := make([]job, 12)
	for i := range jobs {
		jobs[i] = job{append(slices.Clip(prefixes[i%3]), randomPrompt(rng, 1+rng.Intn(20))...), 20 + rng.Intn(20)}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	got := make([][]int32, len(jobs))
	errs := make([]error, len(jobs))
	for i, j := range jobs {
		wg.Go(func() {
			got[i], _, errs[i] = h.generate(ctx, &pb.GenerateRequest{RequestId: fmt.Sprintf("r%d", i), Prompt: j.prompt, MaxTokens: uint32(j.n)})
		})
	}
	wg.Wait()
	for i, j := range jobs {
		if errs[i] != nil {
			t.Fatalf("request %d: %v", i, errs[i])
		}
		if want := reference(t, j.prompt, j.n); !slices.Equal(got[i], want) {
			t.Fatalf("request %d: %v, alone %v", i, got[i], want)
		}
	}
	t.Logf("%v tokens of %v hit, %v preemptions", counterValue(h.w.metrics.cacheHits), counterValue(h.w.metrics.cacheQueries),
		counterValue(h.w.metrics.preemptions))
	if counterValue(h.w.metrics.cacheHits) == 0 {
		t.Error("no request hit the cache")
	}
	waitUntil(t, 10*time.Second, "the cache to settle", func() bool { return h.w.sched.busy() == 0 })
	// The engine holds exactly the cached pages (each holder keeps its one
	// page; a page two requests filled at once is kept once), and no step
	// found fewer free pages than the core had counted.
	cached, free := len(h.w.kv.snapshot()), h.eng.FreePages()
	if free != pages-cached {
		t.Errorf("%d pages free with %d cached on %d, want %d: the engine's pages drifted from the cache's", free, cached, pages, pages-cached)
	}
	if n := counterValue(h.w.metrics.stepOutOfPages); n != 0 {
		t.Errorf("%v steps refused for want of pages the core counted as free", n)
	}
}

// TestWatchKV: over real gRPC, a watcher gets a snapshot (reset, empty at
// first) and then the stored and removed deltas in order, numbered from 1;
// replaying them gives what the worker caches; a watcher that connects
// late gets the same set as its snapshot.
func TestWatchKV(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	const pages = 12
	h := start(t, pages, prefixOn)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	early, err := h.cl.WatchKV(ctx, &pb.WatchKVRequest{})
	if err != nil {
		t.Fatal(err)
	}
	first, err := early.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if !first.Reset_ || first.Seq != 1 || len(first.Stored) != 0 || first.WorkerId != "w1" || first.Incarnation != h.w.Incarnation() ||
		first.PageTokens != engine.PageTokens {
		t.Fatalf("first message %v: want an empty snapshot, seq 1, w1, incarnation %d, %d page tokens", first, h.w.Incarnation(), engine.PageTokens)
	}
	// Three requests of 4 pages each on 12 pages: the third evicts.
	for i := range 3 {
		if _, _, err := h.generate(ctx, &pb.GenerateRequest{RequestId: fmt.Sprintf("r%d", i), Prompt: randomPrompt(rng, 4*engine.PageTokens+3), MaxTokens: 4}); err != nil {
			t.Fatal(err)
		}
	}
	waitUntil(t, 10*time.Second, "the requests to end", func() bool { return h.w.sched.busy() == 0 })
	want := h.w.kv.snapshot()
	index := map[uint64]bool{}
	seq, removed := uint64(1), 0
	for {
		m, err := early.Recv()
		if err != nil {
			t.Fatal(err)
		}
		seq++
		if m.Seq != seq || m.Reset_ {
			t.Fatalf("message seq %d reset %v, want seq %d, a delta", m.Seq, m.Reset_, seq)
		}
		for _, x := range m.Stored {
			if index[x] {
				t.Fatalf("hash %x stored twice", x)
			}
			index[x] = true
		}
		for _, x := range m.Removed {
			if !index[x] {
				t.Fatalf("hash %x removed, not stored", x)
			}
			delete(index, x)
			removed++
		}
		if len(index) == len(want) && !slices.ContainsFunc(want, func(x uint64) bool { return !index[x] }) {
			break
		}
	}
	if removed == 0 {
		t.Error("nothing was evicted: the test does not exercise removal")
	}
	late, err := h.cl.WatchKV(ctx, &pb.WatchKVRequest{})
	if err != nil {
		t.Fatal(err)
	}
	snap, err := late.Recv()
	if err != nil {
		t.Fatal(err)
	}
	got := slices.Sorted(slices.Values(snap.Stored))
	if !snap.Reset_ || snap.Seq != 1 || !slices.Equal(got, want) {
		t.Fatalf("late watcher's first message: reset %v seq %d stored %d hashes; want a snapshot, seq 1, the %d cached", snap.Reset_, snap.Seq, len(got), len(want))
	}
}

// TestWatchKVSlowWatcher: a watcher that reads nothing never blocks the
// scheduler; once it falls behind it is sent a fresh snapshot, not a gap.
func TestWatchKVSlowWatcher(t *testing.T) {
	k := newKVHub()
	w := &kvWatcher{notify: make(chan struct{}, 1)}
	k.watchers[w] = struct{}{}
	for i := range kvWatchBuffer + 10 {
		k.publish([]uint64{uint64(i)}, nil)
	}
	if !w.lost || len(w.pending) != 0 {
		t.Fatalf("after %d deltas: lost %v, %d pending; want a snapshot due", kvWatchBuffer+10, w.lost, len(w.pending))
	}
	if n := len(k.snapshot()); n != kvWatchBuffer+10 {
		t.Fatalf("%d hashes cached, want %d", n, kvWatchBuffer+10)
	}
}

// TestPrefixCacheNeedsASharingEngine: the config is refused by name for an
// engine that does not share pages.
func TestPrefixCacheNeedsASharingEngine(t *testing.T) {
	cfg := DefaultConfig()
	cfg.ID, cfg.GRPCAddr, cfg.PrefixCache = "w1", "127.0.0.1:0", true
	cfg.Engine = noShare{}
	if err := cfg.Validate(); err == nil {
		t.Fatal("a prefix cache on an engine that does not share pages was accepted")
	}
}

type noShare struct{ engine.Engine }

func (noShare) Info() engine.Info { return engine.Info{Backend: "none", TotalPages: 1} }

// TestPrefixCacheMigrationOfSharedPages: with the cache on at both workers,
// a request whose first 16 pages are shared with an earlier request's
// cached ones (a hit at the source) migrates while it decodes: the source
// ships its shared pages like any others, the destination adopts them, and
// the output and its logprobs are the reference's bit for bit. At the end
// every page either worker holds is one its cache reports.
func TestPrefixCacheMigrationOfSharedPages(t *testing.T) {
	c := startCluster(t, func(wc *Config) {
		wc.PrefixCache = true
		wc.Engine = engine.NewPaced(wc.Engine, engine.Profiles["qwen3-14b-h100"], 5)
	})
	rng := rand.New(rand.NewSource(53))
	shared := randomPrompt(rng, 16*engine.PageTokens)
	warm := append(slices.Clip(shared), randomPrompt(rng, 7)...)
	prompt := append(slices.Clip(shared), randomPrompt(rng, 24)...)
	const maxTokens = 40
	wantc := make(chan []*pb.GenerateResponse, 1)
	go func() { wantc <- referenceLogprobs(t, prompt, maxTokens, 5) }()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	src := c.workers["w1"]
	if _, _, err := c.follow(ctx, c.dispatchTo("warm", "w1", len(warm), 4), warm, 4, nil, nil, nil); err != nil {
		t.Fatal(err)
	}
	pl := c.dispatchTo("m1", "w1", len(prompt), maxTokens)
	got := make(chan int32, maxTokens)
	type result struct {
		out  []int32
		used []*pb.Placement
		err  error
	}
	done := make(chan result, 1)
	var lps []*pb.GenerateResponse
	go func() {
		out, used, err := c.follow(ctx, pl, prompt, maxTokens, got, nil, &lps)
		done <- result{out, used, err}
	}()
	for range 5 {
		<-got
	}
	if _, err := c.migrate("m1", "w2"); err != nil {
		t.Fatal(err)
	}
	res := <-done
	want := <-wantc
	if res.err != nil {
		t.Fatal(res.err)
	}
	if !slices.Equal(res.out, tokens(want)) {
		t.Fatalf("output differs from the reference:\n got %v\nwant %v", res.out, tokens(want))
	}
	if err := sameLogprobs(lps, want); err != nil {
		t.Fatalf("logprobs across the migration: %v", err)
	}
	if len(res.used) != 2 || res.used[1].WorkerId != "w2" {
		t.Fatalf("served from %v; want w1, then w2", res.used)
	}
	if hits := counterValue(src.w.metrics.cacheHits); hits < 16*engine.PageTokens {
		t.Errorf("%v tokens hit at the source, want at least the 16 shared pages' %d", hits, 16*engine.PageTokens)
	}
	if n := counterValue(c.workers["w2"].w.metrics.recomputed); n != 0 {
		t.Errorf("%v tokens recomputed at the destination", n)
	}
	for id, h := range c.workers {
		waitUntil(t, 10*time.Second, id+"'s pages all free or cached", func() bool {
			return h.w.sched.busy() == 0 && h.eng.FreePages() == 256-len(h.w.kv.snapshot())
		})
	}
}

// TestPrefixCacheSyntheticEngine: the daemon's cache on the synthetic
// engine gives the outputs of the cache off, and hits.
func TestPrefixCacheSyntheticEngine(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	shared := randomPrompt(rng, 5*engine.PageTokens)
	prompts := [][]int32{append(slices.Clip(shared), randomPrompt(rng, 3)...), append(slices.Clip(shared), randomPrompt(rng, 20)...)}
	run := func(on bool) ([][]int32, *harness) {
		h := start(t, 16, func(c *Config) {
			e, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 16})
			if err != nil {
				t.Fatal(err)
			}
			c.Engine, c.PrefixCache = e, on
		})
		var outs [][]int32
		for i, p := range prompts {
			out, _, err := h.generate(context.Background(), &pb.GenerateRequest{RequestId: fmt.Sprintf("r%d", i), Prompt: p, MaxTokens: 30})
			if err != nil {
				t.Fatal(err)
			}
			outs = append(outs, out)
		}
		return outs, h
	}
	off, _ := run(false)
	on, h := run(true)
	for i := range off {
		if !slices.Equal(on[i], off[i]) {
			t.Fatalf("request %d: %v with the cache, %v without", i, on[i], off[i])
		}
	}
	if hits := counterValue(h.w.metrics.cacheHits); hits != 5*engine.PageTokens {
		t.Errorf("%v tokens hit, want %d", hits, 5*engine.PageTokens)
	}
	waitUntil(t, 10*time.Second, "the cache to settle", func() bool { return h.w.sched.busy() == 0 })
	if cached, free := len(h.w.kv.snapshot()), h.w.cfg.Engine.FreePages(); free != 16-cached {
		t.Errorf("%d pages free with %d cached, want %d", free, cached, 16-cached)
	}
}

// gatedEngine holds its first Forward until open is closed.
type gatedEngine struct {
	*engine.Transformer
	once sync.Once
	open chan struct{}
}

func (g *gatedEngine) Forward(ctx context.Context, batch []engine.Chunk) ([][]int32, error) {
	g.once.Do(func() { <-g.open })
	return g.Transformer.Forward(ctx, batch)
}

// TestPrefixCacheFilledTwice: two requests with a 3-page prefix in common
// and different fourth pages are prefilled in one step, so both fill the
// prefix's pages before either is cached. The second gives its copies up
// for the first's (core.Output.Adopts), so once both end the engine holds
// exactly the pages the cache reports (before the fix a holder of the
// second's fourth page kept its three prefix copies as well), no step ran
// out of pages, and both outputs are the requests computed alone.
func TestPrefixCacheFilledTwice(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	const pages = 64
	tr, err := engine.NewTransformer(engine.TransformerConfig{Path: modelPath, Pages: pages})
	if err != nil {
		t.Fatal(err)
	}
	gate := &gatedEngine{Transformer: tr, open: make(chan struct{})}
	h := start(t, pages, func(c *Config) { c.PrefixCache, c.Engine = true, gate })
	h.eng = gate
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// A one-token request holds the engine's first step while the two
	// others queue behind it; they are admitted, and prefilled, together.
	var wg sync.WaitGroup
	wg.Go(func() {
		if _, _, err := h.generate(ctx, &pb.GenerateRequest{RequestId: "hold", Prompt: randomPrompt(rng, 5), MaxTokens: 1}); err != nil {
			t.Error(err)
		}
	})
	waitUntil(t, 10*time.Second, "the holding request to start", func() bool { return h.w.sched.busy() == 1 })
	shared := randomPrompt(rng, 3*engine.PageTokens)
	prompts := [][]int32{
		append(slices.Clip(shared), randomPrompt(rng, engine.PageTokens+4)...),
		append(slices.Clip(shared), randomPrompt(rng, engine.PageTokens+4)...),
	}
	const n = 6
	got := make([][]int32, len(prompts))
	for i, p := range prompts {
		wg.Go(func() {
			var err error
			if got[i], _, err = h.generate(ctx, &pb.GenerateRequest{RequestId: fmt.Sprintf("r%d", i), Prompt: p, MaxTokens: n}); err != nil {
				t.Error(err)
			}
		})
	}
	waitUntil(t, 10*time.Second, "both requests to queue", func() bool { return len(h.w.sched.submit) == len(prompts) })
	close(gate.open)
	wg.Wait()
	for i, p := range prompts {
		if want := reference(t, p, n); !slices.Equal(got[i], want) {
			t.Fatalf("request %d: %v, alone %v", i, got[i], want)
		}
	}
	waitUntil(t, 10*time.Second, "the cache to settle", func() bool { return h.w.sched.busy() == 0 })
	if hits := counterValue(h.w.metrics.cacheHits); hits != 0 {
		t.Fatalf("%v tokens hit: the two requests were not prefilled together", hits)
	}
	cached, free := len(h.w.kv.snapshot()), h.eng.FreePages()
	// 3 shared pages, then each request's fourth (its prompt's) and none
	// past it (4 pages + 4 + 6 tokens).
	if cached != 5 {
		t.Errorf("%d pages cached, want 5", cached)
	}
	if free != pages-cached {
		t.Errorf("%d pages free with %d cached on %d, want %d: the engine's pages drifted from the cache's", free, cached, pages, pages-cached)
	}
	if n := counterValue(h.w.metrics.stepOutOfPages); n != 0 {
		t.Errorf("%v steps refused for want of pages the core counted as free", n)
	}
}

// TestRestoreHitsTheCache: a request resumed at a worker whose prefix cache
// holds the first pages of its history, and whose checkpoint store holds
// more of them, takes the cached pages from the cache and imports only the
// checkpoint's pages past them (lumen_worker_resume_cached_pages_total,
// lumen_worker_restored_pages_total), and its tokens are the failure-free
// reference's, bit for bit.
func TestRestoreHitsTheCache(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	const pages = 64
	h := start(t, pages, prefixOn)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	shared := randomPrompt(rng, 2*engine.PageTokens)
	// An earlier request leaves the shared prefix's 2 pages cached.
	if _, _, err := h.generate(ctx, &pb.GenerateRequest{RequestId: "earlier", Prompt: append(slices.Clip(shared), randomPrompt(rng, 5)...), MaxTokens: 3}); err != nil {
		t.Fatal(err)
	}
	prompt := append(slices.Clip(shared), randomPrompt(rng, 3*engine.PageTokens+7)...)
	const maxTokens = 40
	want := reference(t, prompt, maxTokens)
	// The request had streamed 20 tokens elsewhere before its worker
	// failed; its holder (this worker) holds the first 6 pages of that
	// history, exported from an engine that computed it.
	gen := want[:20]
	hist := append(slices.Clone(prompt), gen...)
	src, err := engine.NewTransformer(engine.TransformerConfig{Path: modelPath, Pages: 32})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := src.Forward(ctx, []engine.Chunk{{Seq: 1, Tokens: hist}}); err != nil {
		t.Fatal(err)
	}
	hashes := pageHashes(hist, nil)[:6]
	for i, hash := range hashes {
		data, err := src.ExportPage(1, i)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := h.w.store.put("r", 1<<30, hash, data); err != nil {
			t.Fatal(err)
		}
	}
	rest, _, err := h.generate(ctx, &pb.GenerateRequest{RequestId: "r", Prompt: prompt, Generated: gen, MaxTokens: maxTokens})
	if err != nil {
		t.Fatal(err)
	}
	if got := append(slices.Clone(gen), rest...); !slices.Equal(got, want) {
		t.Fatalf("resumed with the cache and the checkpoint: %v, the reference %v", got, want)
	}
	if n := counterValue(h.w.metrics.resumeCached); n != 2 {
		t.Errorf("%v pages of the resume came from the cache, want 2 (the shared prefix)", n)
	}
	if n := counterValue(h.w.metrics.restoredPages); n != 4 {
		t.Errorf("%v pages imported from the checkpoint, want 4 (its 6 past the 2 cached)", n)
	}
	if n := counterValue(h.w.metrics.restoredReqs); n != 1 {
		t.Errorf("%v restored requests, want 1", n)
	}
}
