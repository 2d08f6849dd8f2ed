package worker

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	dto "github.com/prometheus/client_model/go"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// recordingEngine records every batch an engine runs, and holds the first
// Forward until the test opens the gate.
type recordingEngine struct {
	engine.Engine
	entered chan struct{} // closed when the first Forward starts
	gate    chan struct{} // the first Forward waits for it

	mu      sync.Mutex // guards batches, first
	batches []string
	first   bool
}

func newRecordingEngine(e engine.Engine) *recordingEngine {
	return &recordingEngine{Engine: e, entered: make(chan struct{}), gate: make(chan struct{}), first: true}
}

func describeBatch(e engine.Engine, b []engine.Chunk) string {
	parts := make([]string, len(b))
	for i, ch := range b {
		parts[i] = fmt.Sprintf("seq%d@%d+%d/%d#%d", ch.Seq, e.Len(ch.Seq), len(ch.Tokens), ch.Sample, ch.OutIndex)
	}
	return strings.Join(parts, " ")
}

func (r *recordingEngine) Forward(ctx context.Context, b []engine.Chunk) ([][]int32, error) {
	r.mu.Lock()
	first := r.first
	r.first = false
	r.mu.Unlock()
	if first {
		close(r.entered)
		<-r.gate
	}
	desc := describeBatch(r.Engine, b)
	out, err := r.Engine.Forward(ctx, b)
	if err == nil {
		r.mu.Lock()
		r.batches = append(r.batches, desc)
		r.mu.Unlock()
	}
	return out, err
}

type equivRequest struct {
	id        string
	prompt    []int32
	generated []int32
	maxTokens int
}

type equivScenario struct {
	name  string
	pages int
	tweak func(*Config)
	// first runs alone in the first step; rest arrive during it.
	first equivRequest
	rest  []equivRequest
	// stored are checkpoint pages the worker holds before the run.
	stored map[uint64][]byte
	// check says the scenario did what it is named for.
	check func(t *testing.T, w *Worker)
}

// TestDaemonRunsTheCoresBatches: for the same calls, the daemon's engine
// runs exactly the batches a Core driven directly computes — the daemon is
// a driver of the core and adds no decision of its own (what lets the
// simulator, which drives the same core, speak for the cluster).
func TestDaemonRunsTheCoresBatches(t *testing.T) {
	seed := uint64(21)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	prompt := func(n int) []int32 {
		p := make([]int32, n)
		for i := range p {
			p[i] = 32 + int32(rng.IntN(95))
		}
		return p
	}
	// A checkpointed request: its first 80 positions' pages at a holder.
	resumedPrompt := prompt(70)
	resumedOut := syntheticGreedy(t, resumedPrompt, 20)
	stored := map[uint64][]byte{}
	{
		e, _ := engine.NewSynthetic(engine.SyntheticConfig{Pages: 64})
		hist := append(slices.Clone(resumedPrompt), resumedOut[:12]...)
		if _, err := e.Forward(context.Background(), []engine.Chunk{{Seq: 1, Tokens: hist}}); err != nil {
			t.Fatal(err)
		}
		for i, h := range core.PageHashes(hist[:80], nil) {
			data, err := e.ExportPage(1, i)
			if err != nil {
				t.Fatal(err)
			}
			stored[h] = data
		}
	}
	scenarios := []equivScenario{{
		name: "chunked prefill", pages: 256, tweak: func(c *Config) { c.TokenBudget = 64 },
		first: equivRequest{"a", prompt(150), nil, 6},
		rest:  []equivRequest{{"b", prompt(90), nil, 4}, {"c", prompt(20), nil, 9}},
	}, {
		name: "preemption", pages: 12, tweak: func(c *Config) { c.TokenBudget = 512 },
		first: equivRequest{"r1", prompt(150), nil, 30},
		rest:  []equivRequest{{"r2", prompt(10), nil, 40}, {"r3", prompt(30), nil, 5}},
		check: func(t *testing.T, w *Worker) {
			n := counterValue(w.metrics.preemptions)
			if n == 0 {
				t.Error("no preemption")
			}
			// Every preempted request ran to its end, so each loss ended:
			// one observation a preemption (fewer where a request was
			// preempted again before its cache was back).
			var m dto.Metric
			if err := w.metrics.preemptionLoss.Write(&m); err != nil {
				t.Fatal(err)
			}
			if c := float64(m.GetHistogram().GetSampleCount()); c < 1 || c > n || m.GetHistogram().GetSampleSum() <= 0 {
				t.Errorf("preemption loss: %v observations summing to %v s for %v preemptions", c, m.GetHistogram().GetSampleSum(), n)
			}
		},
	}, {
		name: "restore and resumed first", pages: 64, tweak: func(c *Config) { c.MaxRunning = 2 },
		first: equivRequest{"busy", prompt(8), nil, 12},
		rest: []equivRequest{{"new", prompt(40), nil, 5}, {"resumed", resumedPrompt, resumedOut[:12], 20},
			{"resumed-cold", prompt(30), []int32{40, 41, 42}, 6}},
		stored: stored,
		check: func(t *testing.T, w *Worker) {
			if n := counterValue(w.metrics.restoredPages); n != 5 {
				t.Errorf("%v pages restored, want 5", n)
			}
		},
	}}
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			daemon := runDaemon(t, sc)
			direct := runCoreDirectly(t, sc)
			if !slices.Equal(daemon, direct) {
				t.Fatalf("the daemon ran\n%s\nthe core computes\n%s", strings.Join(daemon, "\n"), strings.Join(direct, "\n"))
			}
			if len(daemon) < 5 {
				t.Fatalf("only %d batches", len(daemon))
			}
		})
	}
}

func syntheticGreedy(t *testing.T, p []int32, n int) []int32 {
	e, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 256})
	if err != nil {
		t.Fatal(err)
	}
	var out []int32
	toks := p
	for len(out) < n {
		o, err := e.Forward(context.Background(), []engine.Chunk{{Seq: 1, Tokens: toks, Sample: 1, OutIndex: len(out)}})
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, o[0][0])
		toks = o[0]
	}
	return out
}

func equivConfig(sc equivScenario) Config {
	cfg := DefaultConfig()
	cfg.ID, cfg.GRPCAddr = "w1", "127.0.0.1:0"
	cfg.Logger = hclog.NewNullLogger()
	if sc.tweak != nil {
		sc.tweak(&cfg)
	}
	return cfg
}

func runDaemon(t *testing.T, sc equivScenario) []string {
	eng, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: sc.pages})
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecordingEngine(eng)
	cfg := equivConfig(sc)
	cfg.Engine = rec
	w, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Shutdown(context.Background())
	for h, data := range sc.stored {
		if _, err := w.store.put("resumed", 1<<30, h, data); err != nil {
			t.Fatal(err)
		}
	}
	var reqs []*request
	submit := func(q equivRequest) {
		r, err := w.newRequest(&pb.GenerateRequest{RequestId: q.id, Prompt: q.prompt, Generated: q.generated, MaxTokens: uint32(q.maxTokens)})
		if err != nil {
			t.Fatal(err)
		}
		w.sched.submit <- r
		reqs = append(reqs, r)
	}
	submit(sc.first)
	<-rec.entered
	for _, q := range sc.rest {
		submit(q)
	}
	close(rec.gate)
	deadline := time.After(30 * time.Second)
	for _, r := range reqs {
		for done := false; !done; {
			select {
			case <-r.box.notify:
			case <-deadline:
				t.Fatalf("%s never finished", r.id)
			}
			for _, ev := range r.box.take() {
				if ev.err != nil {
					t.Fatalf("%s: %v", r.id, ev.err)
				}
				done = done || ev.resp.Done
			}
		}
	}
	if sc.check != nil {
		sc.check(t, w)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return slices.Clone(rec.batches)
}

type mapStore map[uint64][]byte

func (m mapStore) Holds(string) bool { return false }

func (m mapStore) Prefix(hashes []uint64) [][]byte {
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

// runCoreDirectly drives a Core by hand, with no goroutine, channel or
// worker around it.
func runCoreDirectly(t *testing.T, sc equivScenario) []string {
	eng, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: sc.pages})
	if err != nil {
		t.Fatal(err)
	}
	cfg := equivConfig(sc)
	c := core.New(core.Config{Self: cfg.ID, TokenBudget: cfg.TokenBudget, MaxRunning: cfg.MaxRunning, MaxWaiting: cfg.MaxWaiting,
		TotalPages: sc.pages}, mapStore(sc.stored))
	var batches []string
	now := time.Unix(0, 0)
	apply := func() {
		o := c.Output()
		for _, s := range o.Release {
			eng.Release(s)
		}
		for _, ev := range o.Events {
			if ev.Err != nil {
				t.Fatalf("%s: %v", ev.Req.ID, ev.Err)
			}
		}
	}
	step := func() {
		for {
			st := c.Next(now, eng.FreePages())
			apply()
			if len(st.Batch) == 0 {
				return
			}
			for _, rs := range st.Restores {
				if err := eng.ImportPages(rs.Seq, rs.Pages); err != nil {
					t.Fatal(err)
				}
			}
			desc := describeBatch(eng, st.Batch)
			out, err := eng.Forward(context.Background(), st.Batch)
			if err != nil {
				if c.StepFailed(err) {
					apply()
					continue
				}
				t.Fatal(err)
			}
			batches = append(batches, desc)
			c.Done(now, out)
			apply()
			return
		}
	}
	submit := func(q equivRequest) {
		c.Submit(&core.Request{ID: q.id, History: append(slices.Clone(q.prompt), q.generated...), Prompt: len(q.prompt),
			MaxTokens: q.maxTokens, Arrived: now})
		apply()
	}
	submit(sc.first)
	step()
	for _, q := range sc.rest {
		submit(q)
	}
	for i := 0; !c.Idle(); i++ {
		if i > 10000 {
			t.Fatal("no progress")
		}
		step()
	}
	return batches
}
