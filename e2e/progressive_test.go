package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/completions"
	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/tokenizer"
	"github.com/lumen-project/lumen/worker/engine"
)

// Progressive recovery over real processes: a worker killed with SIGKILL
// restarts (its data directory's run marker says the last run did not shut
// down cleanly) and walks LOADING_DRAFT → ASSIST → HOTSWAP → FULL_SERVICE,
// drafting for the survivor the controller pairs it with, while clients
// stream through the gateway; every output must equal the failure-free,
// speculation-free reference whatever else fails meanwhile.
//
// The workers are paced as Qwen3-14B on an H100 (-profile); they start
// with -emulate-load=false, so the cluster comes up at once, and the
// restarted worker takes the profiles' load times scaled by restartScale:
// the draft (Qwen3-0.6B) about 1 s, the target's weights into host memory
// (ASSIST) about 4.5 s, the copy to the GPU (HOTSWAP) 0.17 s.

// restartScale scales the restarted worker's load times.
const restartScale = "0.2"

// progEnv is a quorum, workers of one engine and a gateway.
type progEnv struct {
	cl       *devcluster.Cluster
	ctl      *ctlclient.Client
	workers  []*devcluster.Worker
	gw       *devcluster.Gateway
	engine   string // "synthetic" or "transformer"
	modelDir string
	events   *eventLog
}

func startProgressive(t *testing.T, backend string, workers int) *progEnv {
	t.Helper()
	env := &progEnv{cl: startQuorum(t), engine: backend}
	args := []string{"-engine", backend, "-profile", "qwen3-14b-h100", "-time-scale", "1", "-emulate-load=false", "-kv-pages", "2048"}
	if backend == "transformer" {
		env.modelDir = t.TempDir()
		if _, _, err := engine.InitModel(env.modelDir, engine.DefaultSeed); err != nil {
			t.Fatal(err)
		}
		args = append(args, "-model-dir", env.modelDir)
	}
	for i := 1; i <= workers; i++ {
		w, err := env.cl.AddWorker(fmt.Sprintf("w%d", i), args...)
		if err != nil {
			t.Fatal(err)
		}
		env.workers = append(env.workers, w)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, w := range env.workers {
				if b, err := os.ReadFile(w.LogPath); err == nil {
					t.Logf("--- %s log (tail) ---\n%s", w.ID, tail(string(b), 3000))
				}
			}
		}
	})
	var err error
	if env.ctl, err = ctlclient.New(env.cl.GRPCAddrs(), nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(env.ctl.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if env.gw, err = env.cl.StartGateway(""); err != nil {
		t.Fatal(err)
	}
	if err := env.gw.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	st, err := env.ctl.ClusterStatus(ctx)
	if err != nil {
		t.Fatal(err)
	}
	env.events = watchEvents(t, env.ctl, st.AppliedIndex)
	return env
}

// restart starts a killed worker again, with the profiles' load times
// (scaled): it is a restart after a failure, so it recovers progressively.
func (env *progEnv) restart(t *testing.T, w *devcluster.Worker) {
	t.Helper()
	if !strings.Contains(strings.Join(w.Args, " "), "-emulate-load=true") {
		w.Args = append(w.Args, "-emulate-load=true", "-load-scale", restartScale)
	}
	if err := env.cl.StartWorker(w); err != nil {
		t.Fatal(err)
	}
}

// reference is the failure-free, speculation-free output of a prompt, as
// the gateway renders it.
func (env *progEnv) reference(t *testing.T, prompts []string, maxTokens int) []string {
	t.Helper()
	var tk tokenizer.Tokenizer
	wants := make([]string, len(prompts))
	if env.engine == "transformer" {
		ref, err := engine.NewTransformer(engine.TransformerConfig{Path: filepath.Join(env.modelDir, engine.TargetFile), Pages: 256})
		if err != nil {
			t.Fatal(err)
		}
		for i, p := range prompts {
			wants[i], _, _ = referenceText(t, ref, tk.Encode(p), maxTokens, tokenizer.TokEOS)
		}
		return wants
	}
	p := engine.Profiles["qwen3-14b-h100"]
	for i, pr := range prompts {
		ref, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 256, MaxContext: p.MaxContext})
		if err != nil {
			t.Fatal(err)
		}
		var text []byte
		toks := tk.Encode(pr)
		for n := 0; n < maxTokens; n++ {
			out, err := ref.Forward(context.Background(), []engine.Chunk{{Seq: 1, Tokens: toks, Sample: 1, OutIndex: n}})
			if err != nil {
				t.Fatal(err)
			}
			text = append(text, tk.DecodeToken(out[0][0])...)
			toks = out[0]
		}
		wants[i] = jsonText(text)
	}
	return wants
}

// clients are streams through the gateway.
type clients struct {
	prompts []string
	wants   []string
	got     []string
	errs    []error
	wg      sync.WaitGroup
}

// stream starts n greedy streams of maxTokens each and returns once every
// one has its first token.
func (env *progEnv) stream(t *testing.T, name string, n, maxTokens int) *clients {
	t.Helper()
	c := &clients{prompts: make([]string, n), got: make([]string, n), errs: make([]error, n)}
	for i := range c.prompts {
		c.prompts[i] = fmt.Sprintf("%s: stream %d goes on", name, i)
	}
	c.wants = env.reference(t, c.prompts, maxTokens)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	started := make(chan struct{}, n)
	for i := range c.prompts {
		c.wg.Go(func() {
			signalled := false
			res, err := completions.Stream(ctx, http.DefaultClient, env.gw.Addr, completions.Body(c.prompts[i], maxTokens, false), func(ch completions.Chunk) {
				if !signalled && ch.Text != "" {
					signalled = true
					started <- struct{}{}
				}
			})
			if !signalled {
				started <- struct{}{}
			}
			c.got[i], c.errs[i] = res.Text, err
		})
	}
	for range c.prompts {
		<-started
	}
	return c
}

// check waits for every stream and compares it with the reference.
func (c *clients) check(t *testing.T) {
	t.Helper()
	c.wg.Wait()
	for i := range c.prompts {
		if c.errs[i] != nil {
			t.Errorf("stream %d ended with an error: %v", i, c.errs[i])
		} else if c.got[i] != c.wants[i] {
			t.Errorf("stream %d differs from the reference:\n got  %q\n want %q", i, c.got[i], c.wants[i])
		}
	}
}

// eventLog collects the controller's events from an index on, across
// leader changes (a broken stream reopens after the last event it got).
type eventLog struct {
	mu      sync.Mutex
	evs     []*pb.Event
	changed chan struct{} // closed and replaced at each event
}

func watchEvents(t *testing.T, ctl *ctlclient.Client, from uint64) *eventLog {
	l := &eventLog{changed: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		next := from
		for ctx.Err() == nil {
			s, err := ctl.WatchEvents(ctx, next)
			if err != nil {
				select {
				case <-ctx.Done():
				case <-time.After(50 * time.Millisecond):
				}
				continue
			}
			for {
				ev, err := s.Recv()
				if err != nil {
					break
				}
				if ev.Index < next {
					continue // replayed from the index we reopened at
				}
				l.mu.Lock()
				// Events of one index come together; reopening at it
				// replays those already seen.
				dup := false
				for i := len(l.evs) - 1; i >= 0 && l.evs[i].Index == ev.Index; i-- {
					dup = dup || l.evs[i].Seq == ev.Seq
				}
				if !dup {
					l.evs = append(l.evs, ev)
					close(l.changed)
					l.changed = make(chan struct{})
				}
				l.mu.Unlock()
				next = ev.Index
			}
		}
	}()
	return l
}

// waitFor returns the first event, after position after in the log, that
// match accepts, and its position; it fails the test after timeout.
func (l *eventLog) waitFor(t *testing.T, timeout time.Duration, what string, after int, match func(*pb.Event) bool) (*pb.Event, int) {
	t.Helper()
	deadline := time.After(timeout)
	for i := after + 1; ; {
		l.mu.Lock()
		for ; i < len(l.evs); i++ {
			if match(l.evs[i]) {
				ev := l.evs[i]
				l.mu.Unlock()
				return ev, i
			}
		}
		changed := l.changed
		l.mu.Unlock()
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
	}
}

// phase matches a phase change of worker id to phase, in an incarnation
// other than notInc.
func phase(id string, notInc uint64, to pb.WorkerPhase) func(*pb.Event) bool {
	return func(ev *pb.Event) bool {
		pc := ev.GetPhaseChanged()
		return pc != nil && pc.WorkerId == id && pc.Incarnation != notInc && pc.To == to
	}
}

// pairedEvent matches the pairing (or its end, paired false) of drafter id.
func pairedEvent(id string, paired bool) func(*pb.Event) bool {
	return func(ev *pb.Event) bool {
		p := ev.GetPaired()
		return p != nil && p.DrafterId == id && p.Paired == paired
	}
}

func (env *progEnv) byID(id string) *devcluster.Worker {
	for _, w := range env.workers {
		if w.ID == id {
			return w
		}
	}
	return nil
}

// metric reads a worker's metric.
func metric(t *testing.T, w *devcluster.Worker, name string) float64 {
	t.Helper()
	return metricValue(t, "http://"+w.HTTPAddr+"/metrics", name)
}

// killBusiest kills the worker with the most requests in flight and
// returns it and its incarnation.
func (env *progEnv) killBusiest(t *testing.T, skip ...*devcluster.Worker) (*devcluster.Worker, uint64) {
	t.Helper()
	v := busiest(t, env.workers, skip...)
	_, inc := workerPhase(t, env.ctl, v.ID)
	t.Logf("kill -9 %s (incarnation %d) with %d requests in flight", v.ID, inc, countInFlight(t, v))
	env.cl.KillWorker(v)
	return v, inc
}

// walk waits for worker id's new incarnation (not notInc) to commit the
// phases of progressive recovery in order, from event position after, and
// returns the positions of its ASSIST, HOTSWAP and FULL_SERVICE events.
func (env *progEnv) walk(t *testing.T, id string, notInc uint64, after int) (assist, hotswap, full int) {
	t.Helper()
	_, i := env.events.waitFor(t, 30*time.Second, id+" registered in LOADING_DRAFT", after, phase(id, notInc, pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT))
	_, assist = env.events.waitFor(t, 30*time.Second, id+" in ASSIST", i, phase(id, notInc, pb.WorkerPhase_WORKER_PHASE_ASSIST))
	_, hotswap = env.events.waitFor(t, 30*time.Second, id+" in HOTSWAP", assist, phase(id, notInc, pb.WorkerPhase_WORKER_PHASE_HOTSWAP))
	_, full = env.events.waitFor(t, 30*time.Second, id+" in FULL_SERVICE", hotswap, phase(id, notInc, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE))
	return assist, hotswap, full
}

// assistFigures logs and returns the drafts a target verified and
// accepted, and what the drafter proposed.
func assistFigures(t *testing.T, target, drafter *devcluster.Worker) (verified, accepted float64) {
	t.Helper()
	verified = metric(t, target, "lumen_worker_spec_draft_tokens_total")
	accepted = metric(t, target, "lumen_worker_spec_accepted_tokens_total")
	verifications := metric(t, target, "lumen_worker_spec_verifications_total")
	proposed := -1.0
	if drafter.Running() {
		proposed = metric(t, drafter, "lumen_worker_drafted_tokens_total")
	}
	rate := 0.0
	if verified > 0 {
		rate = accepted / verified
	}
	t.Logf("%s verified %v drafts of %s in %v verifications and accepted %v (%.2f of the drafts verified; %.2f tokens per verification beyond its own; estimated acceptance %.2f); %s proposed %v",
		target.ID, verified, drafter.ID, verifications, accepted, rate, accepted/max(verifications, 1),
		metric(t, target, "lumen_worker_spec_acceptance"), drafter.ID, proposed)
	return verified, accepted
}

// TestProgressiveRecoveryAssists: the killed worker restarts and walks the
// phases; in ASSIST it is paired with the survivor of highest q_w and
// drafts for it, drafts are accepted, and every stream equals the
// reference.
func TestProgressiveRecoveryAssists(t *testing.T) {
	for _, backend := range []string{"synthetic", "transformer"} {
		t.Run(backend, func(t *testing.T) {
			env := startProgressive(t, backend, 3)
			c := env.stream(t, "assist", 24, 640)
			v, inc := env.killBusiest(t)
			env.restart(t, v)
			assist, _, _ := env.walk(t, v.ID, inc, -1)
			ev, _ := env.events.waitFor(t, 30*time.Second, v.ID+" paired", assist, pairedEvent(v.ID, true))
			p := ev.GetPaired()
			t.Logf("%s paired with %s: %s", v.ID, p.TargetId, p.Reason)
			c.check(t)
			target := env.byID(p.TargetId)
			if _, accepted := assistFigures(t, target, v); accepted == 0 {
				t.Errorf("%s accepted no draft of %s", target.ID, v.ID)
			}
			if got := metric(t, v, "lumen_worker_drafted_tokens_total"); got == 0 {
				t.Errorf("%s proposed no draft", v.ID)
			}
			for _, ph := range []string{"LOADING_DRAFT", "ASSIST", "HOTSWAP"} {
				s, err := devcluster.ScrapeMetric(context.Background(), "http://"+v.HTTPAddr+"/metrics",
					`lumen_worker_recovery_phase_seconds{phase="`+ph+`"}`)
				if err != nil {
					t.Fatal(err)
				}
				t.Logf("%s: %.2f s in %s", v.ID, s, ph)
			}
		})
	}
}
