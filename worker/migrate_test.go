package worker

import (
	"context"
	"fmt"
	"io"
	"math/rand"
	"slices"
	"testing"
	"time"

	"github.com/lumen-project/lumen/gpu"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// follow is the gateway's part in a test: it streams a request from its
// placement's worker, and when the stream ends with a move it calls the
// destination with the tokens so far, as the gateway does. It returns the
// tokens and the placements it was served from; gaps are the times from
// the last token before each move to the first after it. With lps not nil
// it asks for logprobs (5 alternatives) and collects the responses there.
func (c *cluster) follow(ctx context.Context, pl *pb.Placement, prompt []int32, maxTokens int, got chan<- int32,
	gaps *[]time.Duration, lps *[]*pb.GenerateResponse) ([]int32, []*pb.Placement, error) {
	var out []int32
	used := []*pb.Placement{pl}
	var last time.Time
	moved := false
	for {
		h := c.workers[pl.WorkerId]
		stream, err := h.cl.Generate(ctx, &pb.GenerateRequest{RequestId: pl.RequestId, Prompt: prompt, Generated: out,
			MaxTokens: uint32(maxTokens), Epoch: pl.Epoch, Holder: pl.HolderId, Logprobs: lps != nil, TopLogprobs: 5 * uint32(btoi(lps != nil)),
			Sampling: c.sampling})
		if err != nil {
			return out, used, err
		}
		for {
			r, err := stream.Recv()
			if err == io.EOF {
				return out, used, fmt.Errorf("%s's stream ended without a last token", pl.WorkerId)
			}
			if err != nil {
				return out, used, fmt.Errorf("%s: %w", pl.WorkerId, err)
			}
			if r.Moved != nil {
				pl = r.Moved
				used = append(used, pl)
				moved = true
				break
			}
			if moved && gaps != nil {
				*gaps = append(*gaps, time.Since(last))
			}
			moved, last = false, time.Now()
			if int(r.Index) != len(out) {
				return out, used, fmt.Errorf("%s sent index %d after %d tokens", pl.WorkerId, r.Index, len(out))
			}
			out = append(out, r.Token)
			if lps != nil {
				*lps = append(*lps, r)
			}
			if got != nil {
				got <- r.Token
			}
			if r.Done {
				return out, used, nil
			}
		}
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func (c *cluster) migrate(id, to string) (*pb.Placement, error) {
	var resp *pb.MigrateResponse
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := c.ctl.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) (e error) {
		resp, e = op.Migrate(ctx, &pb.MigrateRequest{RequestId: id, ToWorker: to})
		return e
	})
	return resp.GetPlacement(), err
}

// TestMigrationMovesARunningRequest: an operator migrates a request while it
// decodes; the source copies its pages in stages, stops it, commits, and
// ends its stream with the destination's placement; the call there adopts
// the copied pages (nothing recomputed) and the output is the reference,
// its logprobs too, bit for bit. Every page is free on both workers at the
// end.
func TestMigrationMovesARunningRequest(t *testing.T) {
	// Paced as Qwen3-14B on an H100 slowed fivefold: steps of at least
	// 60 ms, so the request still decodes (35 steps, 2 s) when the
	// migration runs even on a loaded machine under the race detector;
	// at 12 ms steps CI once saw the request finish first.
	c := startCluster(t, func(wc *Config) { wc.Engine = engine.NewPaced(wc.Engine, engine.Profiles["qwen3-14b-h100"], 5) })
	rng := rand.New(rand.NewSource(51))
	prompt := randomPrompt(rng, 280) // 18 pages: more than 16, two stages
	const maxTokens = 40
	wantc := make(chan []*pb.GenerateResponse, 1)
	go func() { wantc <- referenceLogprobs(t, prompt, maxTokens, 5) }() // beside the run: the race detector slows the transformer tenfold
	pl := c.dispatch("m1", uint32(len(prompt)), maxTokens)
	src, dst := c.workers[pl.WorkerId], c.workers[pl.HolderId]
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	got := make(chan int32, maxTokens)
	type result struct {
		out  []int32
		used []*pb.Placement
		err  error
	}
	done := make(chan result, 1)
	var gaps []time.Duration
	var lps []*pb.GenerateResponse
	go func() {
		out, used, err := c.follow(ctx, pl, prompt, maxTokens, got, &gaps, &lps)
		done <- result{out, used, err}
	}()
	for range 5 {
		<-got
	}
	to := pl.HolderId
	if _, err := c.migrate("m1", to); err != nil {
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
	t.Logf("the client waited %v between the source's last token and the destination's first", gaps)
	if len(res.used) != 2 || res.used[1].WorkerId != to || res.used[1].Epoch != pl.Epoch+1 {
		t.Fatalf("served from %v; want %s, then %s at epoch %d", res.used, pl.WorkerId, to, pl.Epoch+1)
	}
	if n := counterValue(src.w.metrics.migrationsOut.WithLabelValues("committed")); n != 1 {
		t.Errorf("%v migrations out committed at the source", n)
	}
	if n := counterValue(dst.w.metrics.migrationsIn.WithLabelValues("adopted")); n != 1 {
		t.Errorf("%v migrations in adopted at the destination", n)
	}
	if n := counterValue(dst.w.metrics.recomputed); n != 0 {
		t.Errorf("%v tokens recomputed at the destination", n)
	}
	if n := counterValue(src.w.metrics.migrationStages); n < 2 {
		t.Errorf("%v stages for 18 pages, want at least 2", n)
	}
	for id, h := range c.workers {
		waitUntil(t, 10*time.Second, id+"'s pages all free", func() bool { return h.eng.FreePages() == 256 })
	}
}

// TestGPUFaultDrainsTheWorker: the health source reports a fault the GPU
// does not survive (a benign XID and a corrected ECC error before it change
// nothing): the worker marks its GPU unhealthy, commits DRAINING, the
// control plane migrates its request away, and once empty it leaves
// (Exited closes) with nothing recomputed; the output is the reference.
func TestGPUFaultDrainsTheWorker(t *testing.T) {
	faults := gpu.NewInjected()
	c := startCluster(t, func(wc *Config) {
		syntheticTarget(wc) // paced: the request is still decoding when the fault comes
		if wc.ID == "w1" {
			wc.GPUHealth = faults
		}
	})
	rng := rand.New(rand.NewSource(53))
	prompt := randomPrompt(rng, 200)
	const maxTokens = 200
	want := synthReference(t, prompt, maxTokens, engine.Sampling{})
	var pl *pb.Placement
	for i := 0; pl == nil || pl.WorkerId != "w1"; i++ {
		pl = c.dispatch(fmt.Sprintf("g%d", i), uint32(len(prompt)), maxTokens)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	got := make(chan int32, maxTokens)
	type result struct {
		out  []int32
		used []*pb.Placement
		err  error
	}
	done := make(chan result, 1)
	go func() {
		out, used, err := c.follow(ctx, pl, prompt, maxTokens, got, nil, nil)
		done <- result{out, used, err}
	}()
	for range 5 {
		<-got
	}
	w1 := c.workers["w1"].w
	faults.Inject(gpu.HealthEvent{Kind: "xid", Code: 13, UUID: "GPU-test"})
	faults.Inject(gpu.HealthEvent{Kind: "ecc-single-bit", UUID: "GPU-test"})
	waitUntil(t, 5*time.Second, "both faults counted", func() bool {
		return counterValue(w1.metrics.gpuFaults.WithLabelValues("xid"))+counterValue(w1.metrics.gpuFaults.WithLabelValues("ecc-single-bit")) == 2
	})
	if gaugeValue(w1.metrics.gpuHealthy) != 1 || w1.isLeaving() {
		t.Fatal("a benign XID or a corrected ECC error drained the worker")
	}
	faults.Inject(gpu.HealthEvent{Kind: "ecc-double-bit", UUID: "GPU-test"})
	select {
	case <-w1.Exited():
	case <-time.After(30 * time.Second):
		t.Fatal("the worker did not leave after its GPU fault")
	}
	res := <-done
	if res.err != nil {
		t.Fatal(res.err)
	}
	if !slices.Equal(res.out, want) {
		t.Fatalf("output differs from the reference:\n got %v\nwant %v", res.out, want)
	}
	if len(res.used) != 2 || res.used[1].WorkerId != "w2" {
		t.Fatalf("served from %v; want w1, then w2 by migration", res.used)
	}
	if gaugeValue(w1.metrics.gpuHealthy) != 0 {
		t.Error("the GPU is still marked healthy")
	}
	if n := counterValue(c.workers["w2"].w.metrics.recomputed); n != 0 {
		t.Errorf("%v tokens recomputed", n)
	}
	if ph := row(t, c.ctl, "w1").GetPhase(); ph != pb.WorkerPhase_WORKER_PHASE_LEFT {
		t.Errorf("w1 is %s, want LEFT", ph)
	}
}

// dispatchTo places a request on worker id (DispatchRequest.worker_id, as
// a gateway that chose it does).
func (c *cluster) dispatchTo(rid, id string, prompt, maxTokens int) *pb.Placement {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := c.ctl.Dispatch(ctx, &pb.DispatchRequest{RequestId: rid, PromptTokens: uint32(prompt), MaxTokens: uint32(maxTokens),
		WorkerId: id, WorkerIncarnation: c.workers[id].w.incarnation.Load()})
	if err != nil {
		c.t.Fatal(err)
	}
	return resp.Placement
}

// TestMigrationMovesAQueuedRequest: a request still queued at its worker
// (behind a running one; the worker runs one at a time) is listed as queued
// in the worker's load report, and its migration is a re-dispatch: the
// source's one stage carries its history and no pages — there is no
// sequence in the engine to export from, which aborted such migrations
// with "unknown sequence" — the commit moves it, the destination queues and
// prefills it as a dispatch, and both outputs are the reference's.
func TestMigrationMovesAQueuedRequest(t *testing.T) { testMovesAQueuedRequest(t, false) }

// TestMigrationBalanceRedispatch: the same request, moved by the leader's
// balance round instead of an operator: w1's queue is blocked (its one
// running slot is taken), w2 can start the request, so the policy
// re-dispatches it (policy.PlanMigrations, "Re-dispatch away from a
// blocked worker") through the same path.
func TestMigrationBalanceRedispatch(t *testing.T) { testMovesAQueuedRequest(t, true) }

func testMovesAQueuedRequest(t *testing.T, byBalance bool) {
	c := startCluster(t, func(wc *Config) { syntheticTarget(wc); wc.MaxRunning = 1 })
	rng := rand.New(rand.NewSource(57))
	long, queued := randomPrompt(rng, 64), randomPrompt(rng, 100)
	const longTokens, maxTokens = 300, 20
	src, dst := c.workers["w1"], c.workers["w2"]
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	type result struct {
		out  []int32
		used []*pb.Placement
		err  error
	}
	follow := func(pl *pb.Placement, prompt []int32, n int) chan result {
		done := make(chan result, 1)
		go func() {
			out, used, err := c.follow(ctx, pl, prompt, n, nil, nil, nil)
			done <- result{out, used, err}
		}()
		return done
	}
	running := func() (r, w int) { r, w, _, _, _ = src.w.sched.snapshot(time.Hour); return r, w }
	longDone := follow(c.dispatchTo("long", "w1", len(long), longTokens), long, longTokens)
	waitUntil(t, 10*time.Second, "the long request running on w1", func() bool { r, _ := running(); return r == 1 })
	pl := c.dispatchTo("q", "w1", len(queued), maxTokens)
	qDone := follow(pl, queued, maxTokens)
	waitUntil(t, 10*time.Second, "q queued on w1", func() bool { _, w := running(); return w == 1 })
	if l := src.w.Load(); !slices.Contains(l.Queued, "q") || slices.Contains(l.Queued, "long") {
		t.Fatalf("w1's load report lists %v as queued; want q, not the running request", l.Queued)
	}
	if byBalance {
		waitUntil(t, 10*time.Second, "migration on", func() bool {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			return c.ctl.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) error {
				_, err := op.SetStrategy(ctx, &pb.SetStrategyRequest{Migration: pb.MigrationMode_MIGRATION_MODE_ON})
				return err
			}) == nil
		})
	} else if _, err := c.migrate("q", "w2"); err != nil {
		t.Fatal(err)
	}
	res := <-qDone
	if res.err != nil {
		t.Fatal(res.err)
	}
	if want := synthReference(t, queued, maxTokens, engine.Sampling{}); !slices.Equal(res.out, want) {
		t.Fatalf("the queued request's output differs from the reference:\n got %v\nwant %v", res.out, want)
	}
	if len(res.used) != 2 || res.used[1].WorkerId != "w2" || res.used[1].Epoch != pl.Epoch+1 {
		t.Fatalf("served from %v; want w1, then w2 at epoch %d", res.used, pl.Epoch+1)
	}
	if n := counterValue(src.w.metrics.migrationsOut.WithLabelValues("committed")); n != 1 {
		t.Errorf("%v migrations out committed at the source", n)
	}
	if n := counterValue(src.w.metrics.migrationsOut.WithLabelValues("aborted")); n != 0 {
		t.Errorf("%v migrations out aborted at the source", n)
	}
	if n := counterValue(dst.w.metrics.migrationsIn.WithLabelValues("aborted")); n != 0 {
		t.Errorf("%v migrations in aborted at the destination", n)
	}
	if n := counterValue(src.w.metrics.migrationPages.WithLabelValues("out")); n != 0 {
		t.Errorf("%v pages copied for a request that had none", n)
	}
	lres := <-longDone
	if lres.err != nil {
		t.Fatal(lres.err)
	}
	if want := synthReference(t, long, longTokens, engine.Sampling{}); !slices.Equal(lres.out, want) {
		t.Fatal("the long request's output differs from the reference")
	}
	for id, h := range c.workers {
		waitUntil(t, 10*time.Second, id+"'s pages all free", func() bool { return h.w.cfg.Engine.FreePages() == 1024 })
	}
}

// referenceSampled is the transformer's output for prompt under p, one
// sequence decoded alone, as reference is for greedy decoding.
func referenceSampled(t *testing.T, prompt []int32, n int, p engine.Sampling) []int32 {
	t.Helper()
	reference(t, prompt[:1], 1) // builds refEng
	refMu.Lock()
	defer refMu.Unlock()
	e := refEng
	defer e.Release(1)
	var gen []int32
	in := prompt
	for len(gen) < n {
		out, err := e.Forward(context.Background(), []engine.Chunk{{Seq: 1, Tokens: in, Sample: 1, Params: p, OutIndex: len(gen)}})
		if err != nil {
			t.Fatal(err)
		}
		gen = append(gen, out[0][0])
		in = gen[len(gen)-1:]
	}
	return gen
}

// TestMigrationHeldPreStep: the destination decodes a migrated request from
// its last stage on, before the request's call arrives (the held
// pre-step), and the call's adoption delivers those tokens at once: the
// output is the reference's bit for bit, greedy and sampled (a token is a
// function of the history and its output index), nothing is recomputed,
// and the destination counts the tokens it held.
func TestMigrationHeldPreStep(t *testing.T) {
	// Paced fivefold, as TestMigrationMovesARunningRequest: the request
	// still decodes when the migration runs.
	c := startCluster(t, func(wc *Config) { wc.Engine = engine.NewPaced(wc.Engine, engine.Profiles["qwen3-14b-h100"], 5) })
	for i, tc := range []struct {
		name     string
		sampling *pb.SamplingParams
	}{{"greedy", nil}, {"sampled", &pb.SamplingParams{Temperature: 0.9, TopP: 0.95, Seed: 7}}} {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewSource(int64(61 + i)))
			prompt := randomPrompt(rng, 280)
			const maxTokens = 40
			params := engine.Sampling{Temperature: tc.sampling.GetTemperature(), TopP: tc.sampling.GetTopP(), Seed: tc.sampling.GetSeed()}
			wantc := make(chan []int32, 1)
			go func() { wantc <- referenceSampled(t, prompt, maxTokens, params) }()
			id := "h-" + tc.name
			pl := c.dispatch(id, uint32(len(prompt)), maxTokens)
			dst := c.workers[pl.HolderId]
			held0, adopted0 := counterValue(dst.w.metrics.migrationHeld), counterValue(dst.w.metrics.migrationsIn.WithLabelValues("adopted"))
			recomputed0 := counterValue(dst.w.metrics.recomputed)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			c.sampling = tc.sampling
			got := make(chan int32, maxTokens)
			type result struct {
				out  []int32
				used []*pb.Placement
				err  error
			}
			done := make(chan result, 1)
			var gaps []time.Duration
			go func() {
				out, used, err := c.follow(ctx, pl, prompt, maxTokens, got, &gaps, nil)
				done <- result{out, used, err}
			}()
			for range 5 {
				<-got
			}
			if _, err := c.migrate(id, pl.HolderId); err != nil {
				t.Fatal(err)
			}
			res := <-done
			want := <-wantc
			if res.err != nil {
				t.Fatal(res.err)
			}
			if !slices.Equal(res.out, want) {
				t.Fatalf("output differs from the reference:\n got %v\nwant %v", res.out, want)
			}
			if len(res.used) != 2 || res.used[1].WorkerId != pl.HolderId {
				t.Fatalf("served from %v; want %s, then %s", res.used, pl.WorkerId, pl.HolderId)
			}
			held := counterValue(dst.w.metrics.migrationHeld) - held0
			t.Logf("the client waited %v across the switch; the destination held %v tokens for the call", gaps, held)
			if held < 1 {
				t.Errorf("the destination computed no token before the call arrived")
			}
			if n := counterValue(dst.w.metrics.migrationsIn.WithLabelValues("adopted")) - adopted0; n != 1 {
				t.Errorf("%v migrations in adopted", n)
			}
			if n := counterValue(dst.w.metrics.recomputed) - recomputed0; n != 0 {
				t.Errorf("%v tokens recomputed at the destination", n)
			}
		})
	}
	for id, h := range c.workers {
		waitUntil(t, 10*time.Second, id+"'s pages all free", func() bool { return h.eng.FreePages() == 256 })
	}
}
