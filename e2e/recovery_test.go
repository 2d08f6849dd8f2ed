package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/tokenizer"
	"github.com/lumen-project/lumen/worker/engine"
)

// recoveryEnv is a cluster with 4 transformer workers and a gateway.
type recoveryEnv struct {
	cl      *devcluster.Cluster
	ctl     *ctlclient.Client
	workers []*devcluster.Worker
	paused  map[*devcluster.Worker]bool // stopped with SIGSTOP: alive, but its metrics do not answer
	node    map[*devcluster.Worker]string
}

// answering reports whether w runs and can be scraped.
func (env *recoveryEnv) answering(w *devcluster.Worker) bool { return w.Running() && !env.paused[w] }

// scenario kills something while 32 streams run; every stream must still
// complete with exactly the reference output.
type scenario struct {
	name     string
	strategy string
	budget   string // -checkpoint-budget of every worker
	kill     func(t *testing.T, env *recoveryEnv) []*devcluster.Worker
	// reuse is what the survivors' restored-pages counters must show:
	// reusePages (> 0) where the strategy checkpoints and a holder of the
	// interrupted requests survives, noPages (== 0) where it does not
	// checkpoint, anyPages where the scenario decides neither.
	reuse pageReuse
	// nodes, when > 0, puts the 4 workers on that many hosts in order
	// (devcluster.DevNode: w1, w2 on node-1 of 2), each started with
	// -node; replicas is the strategy's checkpoint_replicas (0: one).
	nodes    int
	replicas uint32
}

type pageReuse int

const (
	anyPages pageReuse = iota
	reusePages
	noPages
)

// busiest returns the live worker, not in skip, with the most requests in
// flight.
func busiest(t *testing.T, ws []*devcluster.Worker, skip ...*devcluster.Worker) *devcluster.Worker {
	t.Helper()
	var best *devcluster.Worker
	most := -1
	for _, w := range ws {
		skipped := !w.Running()
		for _, s := range skip {
			skipped = skipped || s == w
		}
		if skipped {
			continue
		}
		if n := countInFlight(t, w); n > most {
			best, most = w, n
		}
	}
	if best == nil {
		t.Fatal("no live worker")
	}
	return best
}

func (env *recoveryEnv) holdingMost(t *testing.T, not *devcluster.Worker) *devcluster.Worker {
	best, most := (*devcluster.Worker)(nil), -1.0
	for _, w := range env.workers {
		if w == not || !env.answering(w) {
			continue
		}
		if b := metricValue(t, "http://"+w.HTTPAddr+"/metrics", "lumen_worker_checkpoint_bytes"); b > most {
			best, most = w, b
		}
	}
	return best
}

func waitPlanFor(t *testing.T, env *recoveryEnv, worker string, from uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s, err := env.ctl.WatchEvents(ctx, from)
	if err != nil {
		t.Fatal(err)
	}
	for {
		ev, err := s.Recv()
		if err != nil {
			t.Fatalf("waiting for %s's recovery plan: %v", worker, err)
		}
		if pc := ev.GetPhaseChanged(); pc != nil && pc.WorkerId == worker && pc.To == pb.WorkerPhase_WORKER_PHASE_FAILED {
			return
		}
	}
}

func TestRecoveryScenarios(t *testing.T) {
	modelDir := t.TempDir()
	if _, _, err := engine.InitModel(modelDir, engine.DefaultSeed); err != nil {
		t.Fatal(err)
	}
	scenarios := []scenario{
		{name: "lumen", strategy: "lumen", reuse: reusePages, kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			return []*devcluster.Worker{busiest(t, env.workers)}
		}},
		{name: "fixed-checkpoint", strategy: "fixed-checkpoint", reuse: reusePages, kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			return []*devcluster.Worker{busiest(t, env.workers)}
		}},
		{name: "stop-and-restart", strategy: "stop-and-restart", reuse: noPages, kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			return []*devcluster.Worker{busiest(t, env.workers)}
		}},
		{name: "recompute", strategy: "recompute", reuse: noPages, kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			return []*devcluster.Worker{busiest(t, env.workers)}
		}},
		{name: "holder dies with the serving worker", strategy: "lumen", kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			a := busiest(t, env.workers)
			return []*devcluster.Worker{a, env.holdingMost(t, a)}
		}},
		{name: "two workers at once", strategy: "lumen", kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			a := busiest(t, env.workers)
			return []*devcluster.Worker{a, busiest(t, env.workers, a)}
		}},
		{name: "controller leader with a worker", strategy: "lumen", reuse: reusePages, kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			leader, err := env.cl.WaitLeader(ctx)
			if err != nil {
				t.Fatal(err)
			}
			env.cl.Kill(leader)
			t.Cleanup(func() { _ = env.cl.Restart(leader) })
			return []*devcluster.Worker{busiest(t, env.workers)}
		}},
		// No page fits a 4 KiB budget: nothing is held, nothing reused.
		{name: "checkpoint budget exhausted", strategy: "lumen", budget: "4KiB", reuse: noPages, kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			return []*devcluster.Worker{busiest(t, env.workers)}
		}},
		{name: "worker hangs (SIGSTOP)", strategy: "lumen", reuse: reusePages, kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			a := busiest(t, env.workers)
			t.Logf("SIGSTOP %s", a.ID)
			if err := env.cl.PauseWorker(a); err != nil {
				t.Fatal(err)
			}
			env.paused[a] = true
			// Serf declares it failed; the streams it froze resume elsewhere.
			// It is killed at the end, when the test stops the cluster.
			t.Cleanup(func() { _ = env.cl.ResumeWorker(a) })
			return nil
		}},
		// Issue 24: the busiest worker's whole node dies at once; no
		// checkpoint was on it (F(r) leaves out the serving worker's node),
		// so the interrupted requests restore on the other node.
		{name: "node killed", strategy: "lumen", nodes: 2, reuse: reusePages, kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			return env.nodeOf(busiest(t, env.workers))
		}},
		// Two copies: the serving worker dies with the holder of the most
		// checkpoint bytes, and the interrupted requests restore from
		// their other copies.
		{name: "two copies, holder dies with the serving worker", strategy: "lumen", replicas: 2, reuse: reusePages, kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			a := busiest(t, env.workers)
			return []*devcluster.Worker{a, env.holdingMost(t, a)}
		}},
		{name: "worker killed while it restores", strategy: "lumen", kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			a := busiest(t, env.workers)
			st, _ := env.ctl.ClusterStatus(context.Background())
			env.cl.KillWorker(a)
			waitPlanFor(t, env, a.ID, st.GetAppliedIndex())
			// The survivor that took the most resumed requests dies next.
			return []*devcluster.Worker{busiest(t, env.workers, a)}
		}},
	}
	for _, sc := range scenarios {
		t.Run(strings.ReplaceAll(sc.name, " ", "_"), func(t *testing.T) { runScenario(t, modelDir, sc) })
	}
}

// nodeOf is every worker of w's node (its -node flag).
func (env *recoveryEnv) nodeOf(w *devcluster.Worker) []*devcluster.Worker {
	var out []*devcluster.Worker
	for _, x := range env.workers {
		if env.node[x] == env.node[w] {
			out = append(out, x)
		}
	}
	return out
}

func runScenario(t *testing.T, modelDir string, sc scenario) {
	cl := startQuorum(t)
	env := &recoveryEnv{cl: cl, paused: map[*devcluster.Worker]bool{}, node: map[*devcluster.Worker]string{}}
	budget := sc.budget
	if budget == "" {
		budget = "64MiB"
	}
	for i := 1; i <= 4; i++ {
		args := []string{"-model-dir", modelDir, "-kv-pages", "1024", "-profile", "qwen3-14b-h100",
			"-time-scale", "2", "-emulate-load=false", "-checkpoint-budget", budget}
		node := devcluster.DevNode(i, 4, sc.nodes)
		if node != "" {
			args = append(args, "-node", node)
		}
		w, err := cl.AddWorker(fmt.Sprintf("w%d", i), args...)
		if err != nil {
			t.Fatal(err)
		}
		env.workers = append(env.workers, w)
		env.node[w] = node
		if node == "" {
			env.node[w] = w.ID // a domain of its own
		}
	}
	var err error
	if env.ctl, err = ctlclient.New(cl.GRPCAddrs(), nil); err != nil {
		t.Fatal(err)
	}
	defer env.ctl.Close()
	s, _ := policy.ParseStrategy(sc.strategy)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	if err := env.ctl.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) error {
		_, err := op.SetStrategy(ctx, &pb.SetStrategyRequest{Strategy: pb.Strategy(s), CheckpointReplicas: sc.replicas})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	gw, err := cl.StartGateway("")
	if err != nil {
		t.Fatal(err)
	}
	if err := gw.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	ref, err := engine.NewTransformer(engine.TransformerConfig{Path: filepath.Join(modelDir, engine.TargetFile), Pages: 256})
	if err != nil {
		t.Fatal(err)
	}
	var tk tokenizer.Tokenizer
	const streams, maxTokens = 32, 64
	wants := make([]string, streams)
	prompts := make([]string, streams)
	for i := range prompts {
		prompts[i] = fmt.Sprintf("%s: stream %d carries on", sc.name, i)
		wants[i], _, _ = referenceText(t, ref, tk.Encode(prompts[i]), maxTokens, tokenizer.TokEOS)
	}
	client := openai.NewClient(option.WithBaseURL("http://"+gw.Addr+"/v1"), option.WithMaxRetries(0))
	got, errs := make([]string, streams), make([]error, streams)
	started := make(chan struct{}, streams)
	var wg sync.WaitGroup
	for i := range prompts {
		wg.Go(func() {
			st := client.Completions.NewStreaming(ctx, openai.CompletionNewParams{Model: "lumen-tiny",
				Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(prompts[i])},
				MaxTokens: openai.Int(maxTokens), Temperature: openai.Float(0)})
			var sb strings.Builder
			signalled := false
			for st.Next() {
				if ch := st.Current(); len(ch.Choices) > 0 && ch.Choices[0].Text != "" {
					sb.WriteString(ch.Choices[0].Text)
					if !signalled && sb.Len() > 32 {
						signalled = true
						started <- struct{}{}
					}
				}
			}
			if !signalled {
				started <- struct{}{}
			}
			got[i], errs[i] = sb.String(), st.Err()
		})
	}
	for range prompts {
		<-started
	}
	victims := sc.kill(t, env)
	for _, v := range victims {
		t.Logf("kill -9 %s", v.ID)
		cl.KillWorker(v)
	}
	wg.Wait()
	for i := range prompts {
		if errs[i] != nil {
			t.Errorf("stream %d ended with an error: %v", i, errs[i])
		} else if got[i] != wants[i] {
			t.Errorf("stream %d differs from the reference:\n got  %q\n want %q", i, got[i], wants[i])
		}
	}
	var restored, recomputed, maxHeld float64
	for _, w := range env.workers {
		if env.answering(w) {
			m := "http://" + w.HTTPAddr + "/metrics"
			restored += metricValue(t, m, "lumen_worker_restored_pages_total")
			recomputed += metricValue(t, m, "lumen_worker_resume_recomputed_tokens_total")
			maxHeld = max(maxHeld, metricValue(t, m, "lumen_worker_checkpoint_bytes"))
		}
	}
	t.Logf("%s: pages reused %v, tokens recomputed %v, most checkpoint bytes held %v", sc.name, restored, recomputed, maxHeld)
	switch sc.reuse {
	case noPages:
		if restored > 0 {
			t.Errorf("%s reused %v checkpointed pages; it keeps no checkpoints", sc.strategy, restored)
		}
	case reusePages:
		if restored == 0 {
			t.Errorf("%s: no interrupted request resumed from a checkpointed page (%v tokens recomputed)", sc.strategy, recomputed)
		}
	}
	// Stop-and-restart runs the interrupted requests again from their
	// prompts: the gateway checked the tokens decoded again against what
	// the clients had (the streams above are the reference, no repeat).
	gm := "http://" + gw.Addr + "/metrics"
	matched := metricValue(t, gm, `lumen_gateway_regenerated_tokens_total{result="matched"}`)
	mismatched := metricValue(t, gm, `lumen_gateway_regenerated_tokens_total{result="mismatched"}`)
	t.Logf("%s: %v tokens regenerated and suppressed, %v mismatched", sc.name, matched, mismatched)
	if regen := sc.strategy == "stop-and-restart"; regen && matched == 0 || !regen && matched > 0 || mismatched > 0 {
		t.Errorf("%s: %v regenerated tokens matched the journal, %v did not", sc.strategy, matched, mismatched)
	}
	if sc.budget == "4KiB" && maxHeld > 4096 {
		t.Errorf("a holder keeps %v bytes, over its 4 KiB budget", maxHeld)
	}
}
