package worker

import (
	"context"
	"fmt"
	"math/rand"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/tlsconf"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// synthReference is a request's output run alone on a fresh synthetic
// engine, without speculation.
func synthReference(t *testing.T, prompt []int32, n int, p engine.Sampling) []int32 {
	t.Helper()
	e, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 64})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var gen []int32
	toks := prompt
	for len(gen) < n {
		out, err := e.Forward(ctx, []engine.Chunk{{Seq: 1, Tokens: toks, Sample: 1, Params: p, OutIndex: len(gen)}})
		if err != nil {
			t.Fatal(err)
		}
		gen = append(gen, out[0][0])
		toks = out[0]
	}
	return gen
}

// syntheticTarget makes a worker's engine the synthetic one, paced as
// Qwen3-14B on an H100 (steps of about 12 ms), so that the draft, nearly
// free, is ahead of it. (No Profile in the Config: K stays fixed at
// SpecK.) The transformer and its real draft are exercised over real
// processes (e2e); under the race detector they are too slow for a draft
// to keep ahead of its target.
func syntheticTarget(c *Config) {
	e, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 1024})
	if err != nil {
		panic(err)
	}
	c.Engine = engine.NewPaced(e, engine.Profiles["qwen3-14b-h100"], 1)
}

// testAlpha is the synthetic draft's agreement in these tests.
const testAlpha = 0.7

func syntheticDraft(t *testing.T) *engine.Synthetic {
	t.Helper()
	d, err := engine.NewSyntheticDraft(engine.SyntheticConfig{Pages: 1024}, testAlpha, 1)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// drafterFor returns a drafter worker: the drafting half of a Worker, with
// no controller.
func drafterFor(id string) *Worker {
	w := &Worker{cfg: Config{ID: id}, log: hclog.NewNullLogger(), metrics: newMetrics(""), dialCreds: tlsconf.DialOption(nil)}
	w.incarnation.Store(1)
	return w
}

// TestAssistedOutputsEqualTheReference: a drafter with the synthetic draft
// assists a synthetic worker over the Assist stream while 12 requests
// (greedy and seeded sampling, chunked prefills) run; every output equals
// the request run alone without speculation, drafts are accepted, and a
// second drafter is refused while the first is attached. After the stream
// ends the worker runs without drafts.
func TestAssistedOutputsEqualTheReference(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	h := start(t, 64, func(c *Config) {
		c.TokenBudget = 96
		syntheticTarget(c)
	})
	dw, draft := drafterFor("d1"), syntheticDraft(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sessDone := make(chan error, 1)
	go func() {
		sessDone <- dw.assistSession(ctx, partner{id: "w1", incarnation: h.w.Incarnation(), addr: h.w.GRPCAddr()}, core.NewDrafter(0), draft)
	}()
	waitUntil(t, 10*time.Second, "the Assist stream", func() bool { return gaugeValue(h.w.metrics.assistStreams) == 1 })

	// A second drafter is refused with a message that says why.
	st, err := h.cl.Assist(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&pb.DraftBatch{DrafterId: "d2", DrafterIncarnation: 1}); err != nil {
		t.Fatal(err)
	}
	_, err = st.Recv()
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("a second Assist stream: %v, want FailedPrecondition", err)
	}
	t.Logf("second drafter: %v", status.Convert(err).Message())

	type req struct {
		prompt []int32
		n      int
		p      engine.Sampling
	}
	reqs := make([]req, 12)
	for i := range reqs {
		reqs[i] = req{prompt: randomPrompt(rng, 8+rng.Intn(150)), n: 24 + rng.Intn(40)}
		if i%3 == 2 {
			reqs[i].p = engine.Sampling{Temperature: 0.8, TopP: 0.95, Seed: rng.Uint64()}
		}
	}
	var wg sync.WaitGroup
	got := make([][]int32, len(reqs))
	errs := make([]error, len(reqs))
	for i, r := range reqs {
		wg.Go(func() {
			got[i], _, errs[i] = h.generate(ctx, &pb.GenerateRequest{RequestId: fmt.Sprintf("r%d", i), Prompt: r.prompt, MaxTokens: uint32(r.n),
				Sampling: &pb.SamplingParams{Temperature: r.p.Temperature, TopP: r.p.TopP, Seed: r.p.Seed}})
		})
	}
	wg.Wait()
	for i, r := range reqs {
		if errs[i] != nil {
			t.Fatalf("request %d: %v", i, errs[i])
		}
		if want := synthReference(t, r.prompt, r.n, r.p); !slices.Equal(got[i], want) {
			t.Errorf("request %d (%+v) differs from the reference:\n got  %v\n want %v", i, r.p, got[i], want)
		}
	}
	drafted, accepted := counterValue(h.w.metrics.specDrafts), counterValue(h.w.metrics.specAccepted)
	t.Logf("verified %v drafts, accepted %v (%.2f); %v verifications; the drafter proposed %v tokens in %v steps",
		drafted, accepted, accepted/drafted, counterValue(h.w.metrics.specVerifies), counterValue(dw.metrics.drafted), counterValue(dw.metrics.draftSteps))
	if accepted == 0 {
		t.Errorf("no draft accepted (%v verified)", drafted)
	}

	// The drafter stops: the worker verifies nothing more.
	cancel()
	if err := <-sessDone; err == nil {
		t.Error("the session ended without an error")
	}
	waitUntil(t, 10*time.Second, "the stream's end", func() bool { return gaugeValue(h.w.metrics.assistStreams) == 0 })
	before := counterValue(h.w.metrics.specVerifies)
	prompt := randomPrompt(rng, 20)
	out, _, err := h.generate(context.Background(), &pb.GenerateRequest{RequestId: "after", Prompt: prompt, MaxTokens: 30})
	if err != nil {
		t.Fatal(err)
	}
	if want := synthReference(t, prompt, 30, engine.Sampling{}); !slices.Equal(out, want) {
		t.Errorf("after the assist:\n got  %v\n want %v", out, want)
	}
	if after := counterValue(h.w.metrics.specVerifies); after != before {
		t.Errorf("%v verifications after the drafter left", after-before)
	}
}

// TestAssistAtTheLargestK is defect 9 of issue 21: at -spec-k 32 and above
// the drafter's lines (2K+1 drafts) were longer than the 64 tokens the
// target took, so every DraftBatch ended the Assist stream InvalidArgument
// and the drafter reconnected every 100 ms, forever. The largest K the
// configuration accepts (core.MaxSpecK) now assists, and one more is
// refused with the value and the limit.
func TestAssistAtTheLargestK(t *testing.T) {
	cfg := DefaultConfig()
	cfg.ID, cfg.GRPCAddr, cfg.Engine = "w1", "127.0.0.1:0", syntheticDraft(t)
	cfg.SpecK = core.MaxSpecK + 1
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%d is outside [0, %d]", core.MaxSpecK+1, core.MaxSpecK)) {
		t.Fatalf("SpecK %d: %v, want a refusal naming it and the limit", cfg.SpecK, err)
	}

	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	h := start(t, 64, func(c *Config) {
		c.SpecK = core.MaxSpecK
		syntheticTarget(c)
	})
	dw, draft := drafterFor("d1"), syntheticDraft(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sessDone := make(chan error, 1)
	go func() {
		sessDone <- dw.assistSession(ctx, partner{id: "w1", incarnation: h.w.Incarnation(), addr: h.w.GRPCAddr()}, core.NewDrafter(0), draft)
	}()
	waitUntil(t, 10*time.Second, "the Assist stream", func() bool { return gaugeValue(h.w.metrics.assistStreams) == 1 })
	prompt := randomPrompt(rng, 30)
	out, _, err := h.generate(ctx, &pb.GenerateRequest{RequestId: "a", Prompt: prompt, MaxTokens: 300})
	if err != nil {
		t.Fatal(err)
	}
	if want := synthReference(t, prompt, 300, engine.Sampling{}); !slices.Equal(out, want) {
		t.Fatalf("output differs from the reference:\n got  %v\n want %v", out, want)
	}
	select {
	case err := <-sessDone:
		t.Fatalf("the Assist stream ended at K = %d: %v", core.MaxSpecK, err)
	default:
	}
	if counterValue(h.w.metrics.specVerifies) == 0 {
		t.Fatalf("no verification at K = %d", core.MaxSpecK)
	}
	cancel()
	<-sessDone
}
