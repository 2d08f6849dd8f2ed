package worker

import (
	"context"
	"fmt"
	"io"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

var modelPath string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "lumen-worker-test-")
	if err != nil {
		panic(err)
	}
	if _, _, err := engine.InitModel(dir, engine.DefaultSeed); err != nil {
		panic(err)
	}
	modelPath = filepath.Join(dir, engine.TargetFile)
	code := m.Run()
	os.RemoveAll(dir)
	if code == 0 {
		// The controller the holder tests run keeps go-metrics' process-wide
		// singletons; they are not a worker's leak.
		if err := goleak.Find(
			goleak.IgnoreTopFunction("github.com/hashicorp/go-metrics.(*InmemSignal).run"),
			goleak.IgnoreTopFunction("github.com/armon/go-metrics.(*InmemSignal).run"),
			goleak.IgnoreTopFunction("github.com/hashicorp/go-metrics.(*InmemSink).run"),
			goleak.IgnoreTopFunction("github.com/armon/go-metrics.(*InmemSink).run"),
		); err != nil {
			fmt.Fprintln(os.Stderr, "goroutine leak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

type harness struct {
	t   *testing.T
	w   *Worker
	eng engine.Engine
	cc  *grpc.ClientConn
	cl  pb.InferenceClient
}

func start(t *testing.T, pages int, tweak func(*Config)) *harness {
	t.Helper()
	eng, err := engine.NewTransformer(engine.TransformerConfig{Path: modelPath, Pages: pages})
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.ID, cfg.GRPCAddr, cfg.Engine = "w1", "127.0.0.1:0", eng
	cfg.Logger = hclog.NewNullLogger()
	if tweak != nil {
		tweak(&cfg)
	}
	w, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(w.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, w: w, eng: eng, cc: cc, cl: pb.NewInferenceClient(cc)}
	t.Cleanup(func() {
		cc.Close()
		w.Shutdown(context.Background())
	})
	return h
}

// generate runs a request to the end and checks the stream's indexes.
func (h *harness) generate(ctx context.Context, req *pb.GenerateRequest) ([]int32, pb.FinishReason, error) {
	stream, err := h.cl.Generate(ctx, req)
	if err != nil {
		return nil, 0, err
	}
	var out []int32
	next := uint32(len(req.Generated))
	for {
		r, err := stream.Recv()
		if err == io.EOF {
			return out, 0, fmt.Errorf("stream ended without done")
		}
		if err != nil {
			return out, 0, err
		}
		if r.Index != next {
			return out, 0, fmt.Errorf("token index %d, expected %d", r.Index, next)
		}
		next++
		out = append(out, r.Token)
		if r.Done {
			return out, r.FinishReason, nil
		}
	}
}

var (
	refOnce sync.Once
	refEng  *engine.Transformer
	refMu   sync.Mutex // guards refEng's single sequence
)

// reference is the engine's own output for a prompt, run alone.
func reference(t *testing.T, prompt []int32, n int) []int32 {
	t.Helper()
	refOnce.Do(func() {
		var err error
		if refEng, err = engine.NewTransformer(engine.TransformerConfig{Path: modelPath, Pages: 256}); err != nil {
			panic(err)
		}
	})
	refMu.Lock()
	defer refMu.Unlock()
	e := refEng
	defer e.Release(1)
	ctx := context.Background()
	out, err := e.Forward(ctx, []engine.Chunk{{Seq: 1, Tokens: prompt, Sample: 1}})
	if err != nil {
		t.Fatal(err)
	}
	gen := []int32{out[0][0]}
	for len(gen) < n {
		out, err = e.Forward(ctx, []engine.Chunk{{Seq: 1, Tokens: gen[len(gen)-1:], Sample: 1, OutIndex: len(gen)}})
		if err != nil {
			t.Fatal(err)
		}
		gen = append(gen, out[0][0])
	}
	return gen
}

func randomPrompt(rng *rand.Rand, n int) []int32 {
	p := make([]int32, n)
	for i := range p {
		p[i] = int32(rng.Intn(256))
	}
	return p
}

// TestContinuousBatchingMatchesReference sends 16 concurrent requests with a
// small token budget (so prefills are chunked) and a KV cache too small for
// all of them (so requests are preempted and recomputed); every output must
// equal the request run alone.
func TestContinuousBatchingMatchesReference(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	h := start(t, 14, func(c *Config) { c.TokenBudget = 32 })
	type job struct {
		prompt []int32
		n      int
	}
	jobs := make([]job, 16)
	for i := range jobs {
		// Outputs of 3+ pages each: any two running at once outgrow the
		// cache, however the calls arrive.
		jobs[i] = job{randomPrompt(rng, 5+rng.Intn(40)), 40 + rng.Intn(20)}
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(jobs))
	got := make([][]int32, len(jobs))
	for i, j := range jobs {
		wg.Go(func() {
			out, reason, err := h.generate(context.Background(), &pb.GenerateRequest{RequestId: fmt.Sprintf("r%d", i), Prompt: j.prompt, MaxTokens: uint32(j.n)})
			if err == nil && reason != pb.FinishReason_FINISH_REASON_LENGTH {
				err = fmt.Errorf("finish reason %v", reason)
			}
			if err != nil {
				errs <- fmt.Errorf("request %d: %w", i, err)
			}
			got[i] = out
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for i, j := range jobs {
		if want := reference(t, j.prompt, j.n); !slices.Equal(got[i], want) {
			t.Fatalf("seed %d request %d:\n got  %v\n want %v", seed, i, got[i], want)
		}
	}
	if h.eng.FreePages() != 14 {
		t.Fatalf("%d of 14 pages free after every request finished", h.eng.FreePages())
	}
	var m struct{ pre float64 }
	m.pre = counterValue(h.w.metrics.preemptions)
	t.Logf("preemptions: %.0f", m.pre)
	if m.pre == 0 {
		t.Fatal("a 14-page cache for 16 requests never preempted: the test does not exercise preemption")
	}
}

func TestResumeContinuesWithoutRepeat(t *testing.T) {
	h := start(t, 256, nil)
	prompt := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20}
	want := reference(t, prompt, 30)
	out, _, err := h.generate(context.Background(), &pb.GenerateRequest{RequestId: "resume", Prompt: prompt, Generated: want[:12], MaxTokens: 30})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(out, want[12:]) {
		t.Fatalf("resumed output %v, want %v", out, want[12:])
	}
}

func TestStopToken(t *testing.T) {
	h := start(t, 256, nil)
	prompt := []int32{104, 101, 108, 108, 111}
	want := reference(t, prompt, 20)
	stop := want[5]
	first := slices.Index(want, stop)
	out, reason, err := h.generate(context.Background(), &pb.GenerateRequest{RequestId: "stop", Prompt: prompt, MaxTokens: 20, StopTokens: []int32{stop}})
	if err != nil {
		t.Fatal(err)
	}
	if reason != pb.FinishReason_FINISH_REASON_STOP || !slices.Equal(out, want[:first+1]) {
		t.Fatalf("stop: %v %v, want %v", out, reason, want[:first+1])
	}
}

func TestCancelFreesPages(t *testing.T) {
	h := start(t, 64, nil)
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := h.cl.Generate(ctx, &pb.GenerateRequest{RequestId: "long", Prompt: make([]int32, 100), MaxTokens: 900})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	if h.eng.FreePages() == 64 {
		t.Fatal("a running request holds no pages")
	}
	cancel()
	deadline := time.Now().Add(5 * time.Second)
	for h.eng.FreePages() != 64 {
		if time.Now().After(deadline) {
			t.Fatalf("%d of 64 pages free after cancel", h.eng.FreePages())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestBadInputKeepsServing(t *testing.T) {
	h := start(t, 64, nil)
	long := make([]int32, 2048)
	cases := []struct {
		name string
		req  *pb.GenerateRequest
		msg  string
	}{
		{"empty prompt", &pb.GenerateRequest{RequestId: "a", MaxTokens: 1}, "prompt is empty"},
		{"no id", &pb.GenerateRequest{Prompt: []int32{1}, MaxTokens: 1}, "request_id must be 1..128 bytes"},
		{"oversized prompt", &pb.GenerateRequest{RequestId: "a", Prompt: long, MaxTokens: 1}, "prompt has 2048 tokens; the context holds 2048"},
		{"max_tokens beyond context", &pb.GenerateRequest{RequestId: "a", Prompt: []int32{1}, MaxTokens: 2048}, "exceeds the context of 2048"},
		{"zero max_tokens", &pb.GenerateRequest{RequestId: "a", Prompt: []int32{1}}, "max_tokens must be >= 1"},
		{"unknown token", &pb.GenerateRequest{RequestId: "a", Prompt: []int32{1, 999}, MaxTokens: 1}, "prompt[1] = 999 is not a token id: the vocabulary is [0, 320)"},
		{"bad temperature", &pb.GenerateRequest{RequestId: "a", Prompt: []int32{1}, MaxTokens: 1, Sampling: &pb.SamplingParams{Temperature: 5}}, "temperature 5 must be in [0, 2]"},
		{"bad top_p", &pb.GenerateRequest{RequestId: "a", Prompt: []int32{1}, MaxTokens: 1, Sampling: &pb.SamplingParams{Temperature: 1, TopP: 2}}, "top_p 2 must be in (0, 1]"},
		{"nothing left", &pb.GenerateRequest{RequestId: "a", Prompt: []int32{1}, Generated: []int32{1, 2}, MaxTokens: 2}, "nothing left to generate"},
	}
	for _, c := range cases {
		_, _, err := h.generate(context.Background(), c.req)
		if st, _ := status.FromError(err); st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), c.msg) {
			t.Errorf("%s: %v, want InvalidArgument containing %q", c.name, err, c.msg)
		}
	}
	// Still serving.
	if _, _, err := h.generate(context.Background(), &pb.GenerateRequest{RequestId: "ok", Prompt: []int32{1, 2, 3}, MaxTokens: 5}); err != nil {
		t.Fatalf("after bad input: %v", err)
	}
}

func TestGracefulShutdownFinishesInFlight(t *testing.T) {
	h := start(t, 256, nil)
	done := make(chan error, 1)
	go func() {
		out, _, err := h.generate(context.Background(), &pb.GenerateRequest{RequestId: "inflight", Prompt: []int32{1, 2, 3}, MaxTokens: 200})
		if err == nil && len(out) != 200 {
			err = fmt.Errorf("%d tokens", len(out))
		}
		done <- err
	}()
	for h.w.inFlight() == 0 {
		time.Sleep(time.Millisecond)
	}
	h.w.Shutdown(context.Background())
	if err := <-done; err != nil {
		t.Fatalf("in-flight request during graceful shutdown: %v", err)
	}
	if _, _, err := h.generate(context.Background(), &pb.GenerateRequest{RequestId: "late", Prompt: []int32{1}, MaxTokens: 1}); status.Code(err) != codes.Unavailable {
		t.Fatalf("after shutdown: %v", err)
	}
}

// TestNoPreemptionLivelock is the squeeze the recovery benchmark found: a
// running request still prefilling needs more pages than the headroom
// admission leaves it, so the step runs out of pages; the scheduler used to
// preempt the newcomer and admit it again at once, forever, without a step.
// r1 (150 tokens) prefills in chunks of 64 on a 12-page cache; r2 arrives
// while it does. Both must finish, equal to the reference, with few
// preemptions.
func TestNoPreemptionLivelock(t *testing.T) {
	rng := rand.New(rand.NewSource(3))
	h := start(t, 12, func(c *Config) {
		c.TokenBudget = 64
		// Slow steps (about 60 ms) so r2 surely arrives mid-prefill.
		c.Engine = engine.NewPaced(c.Engine, engine.Profiles["qwen3-14b-h100"], 4)
	})
	p1, p2 := randomPrompt(rng, 150), randomPrompt(rng, 100)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	var got1 []int32
	var err1 error
	wg.Go(func() {
		got1, _, err1 = h.generate(ctx, &pb.GenerateRequest{RequestId: "r1", Prompt: p1, MaxTokens: 5})
	})
	for gaugeValue(h.w.metrics.running) < 1 {
		if ctx.Err() != nil {
			t.Fatal("r1 never ran")
		}
		time.Sleep(time.Millisecond)
	}
	got2, _, err2 := h.generate(ctx, &pb.GenerateRequest{RequestId: "r2", Prompt: p2, MaxTokens: 5})
	wg.Wait()
	if err1 != nil || err2 != nil {
		t.Fatalf("r1: %v, r2: %v (preemptions %.0f)", err1, err2, counterValue(h.w.metrics.preemptions))
	}
	if !slices.Equal(got1, reference(t, p1, 5)) || !slices.Equal(got2, reference(t, p2, 5)) {
		t.Fatal("outputs differ from the reference")
	}
	if n := counterValue(h.w.metrics.preemptions); n > 10 {
		t.Fatalf("%.0f preemptions for two requests", n)
	}
}

// TestResumedRequestsGoFirst: with the one running slot taken, a resumed
// request (it arrives with generated tokens) is admitted before a new one
// that came earlier.
func TestResumedRequestsGoFirst(t *testing.T) {
	rng := rand.New(rand.NewSource(5))
	h := start(t, 256, func(c *Config) {
		c.MaxRunning = 1
		c.Engine = engine.NewPaced(c.Engine, engine.Profiles["qwen3-14b-h100"], 1)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() {
		_, _, _ = h.generate(ctx, &pb.GenerateRequest{RequestId: "busy", Prompt: randomPrompt(rng, 8), MaxTokens: 40})
	})
	waitGauge := func(g prometheus.Gauge, v float64) {
		for gaugeValue(g) < v {
			if ctx.Err() != nil {
				t.Fatal("timed out")
			}
			time.Sleep(time.Millisecond)
		}
	}
	waitGauge(h.w.metrics.running, 1)
	var order []string
	var mu sync.Mutex
	first := func(id string, req *pb.GenerateRequest) {
		st, err := h.cl.Generate(ctx, req)
		if err == nil {
			_, err = st.Recv()
		}
		if err != nil {
			t.Error(err)
		}
		mu.Lock()
		order = append(order, id)
		mu.Unlock()
	}
	newPrompt := randomPrompt(rng, 8)
	wg.Go(func() { first("new", &pb.GenerateRequest{RequestId: "new", Prompt: newPrompt, MaxTokens: 4}) })
	waitGauge(h.w.metrics.waiting, 1)
	resumed := randomPrompt(rng, 8)
	gen := reference(t, resumed, 3)
	wg.Go(func() {
		first("resumed", &pb.GenerateRequest{RequestId: "resumed", Prompt: resumed, Generated: gen[:2], MaxTokens: 4})
	})
	waitGauge(h.w.metrics.waiting, 2)
	wg.Wait()
	if len(order) != 2 || order[0] != "resumed" {
		t.Fatalf("first tokens in order %v, want the resumed request first", order)
	}
}

// TestSecondCallTakesTheRequestOver: the gateway calls again for a request
// id only when it gave up on its first call, and the first call's
// cancellation may reach the worker after the second call (the recovery
// benchmark hit this: "request id already in flight" reached two clients).
// The latest call wins, and the first call's late cancellation does not
// touch it.
func TestSecondCallTakesTheRequestOver(t *testing.T) {
	rng := rand.New(rand.NewSource(9))
	h := start(t, 256, func(c *Config) {
		c.Engine = engine.NewPaced(c.Engine, engine.Profiles["qwen3-14b-h100"], 1)
	})
	prompt := randomPrompt(rng, 20)
	want := reference(t, prompt, 30)
	ctx1, cancel1 := context.WithCancel(context.Background())
	defer cancel1()
	st1, err := h.cl.Generate(ctx1, &pb.GenerateRequest{RequestId: "x", Prompt: prompt, MaxTokens: 30})
	if err != nil {
		t.Fatal(err)
	}
	var got []int32
	for len(got) < 5 {
		r, err := st1.Recv()
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, r.Token)
	}
	// The second call, as a resume from the 5 tokens seen.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st2, err := h.cl.Generate(ctx, &pb.GenerateRequest{RequestId: "x", Prompt: prompt, Generated: got, MaxTokens: 30})
	if err != nil {
		t.Fatal(err)
	}
	first, err := st2.Recv()
	if err != nil {
		t.Fatalf("second call: %v", err)
	}
	// The first call is over; its cancellation now must not reach the
	// second.
	for {
		if _, err := st1.Recv(); err != nil {
			if status.Code(err) != codes.Aborted {
				t.Fatalf("first call ended %v, want Aborted", err)
			}
			break
		}
	}
	cancel1()
	out := append(got, first.Token)
	for !first.Done {
		if first, err = st2.Recv(); err != nil {
			t.Fatalf("second call after the first was cancelled: %v", err)
		}
		out = append(out, first.Token)
	}
	if !slices.Equal(out, want) {
		t.Fatalf("got  %v\nwant %v", out, want)
	}
}

// TestRequestBeyondTheKVCacheIsRefused: a call within the model's context
// whose prompt and max_tokens need more KV pages than the engine has is
// refused at once, InvalidArgument (the gateway answers 400), with its
// pages and the limit in the message (issue 21, defect 4). It used to run
// until its cache outgrew the engine, then be preempted and recomputed
// forever, alone.
func TestRequestBeyondTheKVCacheIsRefused(t *testing.T) {
	h := start(t, 8, nil) // 128 positions; the context holds 2048
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	prompt := make([]int32, 100)
	for i := range prompt {
		prompt[i] = int32(1 + i%300)
	}
	out, _, err := h.generate(ctx, &pb.GenerateRequest{RequestId: "big", Prompt: prompt, MaxTokens: 40})
	st, _ := status.FromError(err)
	if st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "need 9 KV pages") || !strings.Contains(st.Message(), "the engine has 8") {
		t.Fatalf("%d tokens, then %v; want InvalidArgument naming 9 KV pages and the engine's 8", len(out), err)
	}
	if len(out) != 0 {
		t.Fatalf("%d tokens streamed before the refusal", len(out))
	}
	// 100 + 29 − 1 = 128 positions fit.
	if got, _, err := h.generate(ctx, &pb.GenerateRequest{RequestId: "fits", Prompt: prompt, MaxTokens: 29}); err != nil || len(got) != 29 {
		t.Fatalf("the largest call that fits: %d tokens, %v", len(got), err)
	}
}

// TestQueueWaitsForAStoppedRequestsSlot: a call queued behind the only
// running slot, held by a request stopped for its migration's commit,
// waits for it (issue 21, defect 4). The scheduler refused it with
// ErrTooLarge — a 400 for a request that fits — as soon as nothing ran.
func TestQueueWaitsForAStoppedRequestsSlot(t *testing.T) {
	h := start(t, 64, func(c *Config) { c.MaxRunning = 1 })
	s := h.w.sched
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	on := func(f func()) {
		if !s.do(ctx, f) {
			t.Fatal("the scheduler stopped")
		}
	}
	type result struct {
		out []int32
		err error
	}
	run := func(id string, n int) chan result {
		ch := make(chan result, 1)
		go func() {
			out, _, err := h.generate(ctx, &pb.GenerateRequest{RequestId: id, Prompt: []int32{1, 2, 3, 4, 5}, MaxTokens: uint32(n)})
			ch <- result{out, err}
		}()
		return ch
	}
	a := run("a", 400)
	waitUntil(t, 10*time.Second, "a runs", func() bool {
		var fed int
		on(func() {
			if r := s.core.Lookup("a"); r != nil {
				fed = r.Fed()
			}
		})
		return fed > 0
	})
	on(func() {
		if err := s.core.MigrateOut("a", 0); err != nil {
			t.Error(err)
			return
		}
		if st, err := s.core.NextStage("a", 0); err != nil || !st.Last {
			t.Errorf("stage %+v, %v: want the last", st, err)
		}
		s.apply()
	})
	b := run("b", 10)
	waitUntil(t, 10*time.Second, "b queued", func() bool {
		var queued bool
		on(func() { queued = s.core.Lookup("b") != nil })
		select {
		case r := <-b:
			t.Fatalf("b ended while a's slot was only held: %d tokens, %v", len(r.out), r.err)
		default:
		}
		return queued
	})
	// The scheduler went round its loop since (each call runs between
	// steps): b still waits.
	for range 3 {
		on(func() {})
	}
	select {
	case r := <-b:
		t.Fatalf("b ended while a's slot was only held: %d tokens, %v", len(r.out), r.err)
	default:
	}
	on(func() {
		if !s.core.AbortOut("a", 0) {
			t.Error("no migration to abort")
		}
		s.apply()
	})
	for _, c := range []struct {
		ch chan result
		n  int
	}{{a, 400}, {b, 10}} {
		r := <-c.ch
		if r.err != nil || len(r.out) != c.n {
			t.Fatalf("%d tokens of %d, %v", len(r.out), c.n, r.err)
		}
	}
}
