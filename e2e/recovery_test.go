package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"sort"
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
}

// scenario kills something while 32 streams run; every stream must still
// complete with exactly the reference output.
type scenario struct {
	name     string
	strategy string
	budget   string // -checkpoint-budget of every worker
	kill     func(t *testing.T, env *recoveryEnv) []*devcluster.Worker
}

func busiest(t *testing.T, ws []*devcluster.Worker, skip ...*devcluster.Worker) *devcluster.Worker {
	t.Helper()
	sort.SliceStable(ws, func(i, j int) bool { return countInFlight(t, ws[i]) > countInFlight(t, ws[j]) })
	for _, w := range ws {
		skipped := false
		for _, s := range skip {
			skipped = skipped || s == w
		}
		if !skipped && w.Running() {
			return w
		}
	}
	t.Fatal("no live worker")
	return nil
}

func (env *recoveryEnv) holdingMost(t *testing.T, not *devcluster.Worker) *devcluster.Worker {
	best, most := (*devcluster.Worker)(nil), -1.0
	for _, w := range env.workers {
		if w == not || !w.Running() {
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
		{name: "lumen", strategy: "lumen", kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			return []*devcluster.Worker{busiest(t, env.workers)}
		}},
		{name: "fixed-checkpoint", strategy: "fixed-checkpoint", kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			return []*devcluster.Worker{busiest(t, env.workers)}
		}},
		{name: "stop-and-restart", strategy: "stop-and-restart", kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
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
		{name: "controller leader with a worker", strategy: "lumen", kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
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
		{name: "checkpoint budget exhausted", strategy: "lumen", budget: "4KiB", kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			return []*devcluster.Worker{busiest(t, env.workers)}
		}},
		{name: "worker hangs (SIGSTOP)", strategy: "lumen", kill: func(t *testing.T, env *recoveryEnv) []*devcluster.Worker {
			a := busiest(t, env.workers)
			t.Logf("SIGSTOP %s", a.ID)
			if err := env.cl.PauseWorker(a); err != nil {
				t.Fatal(err)
			}
			// Serf declares it failed; the streams it froze resume elsewhere.
			// It is killed at the end, when the test stops the cluster.
			t.Cleanup(func() { _ = env.cl.ResumeWorker(a) })
			return nil
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

func runScenario(t *testing.T, modelDir string, sc scenario) {
	cl := startQuorum(t)
	env := &recoveryEnv{cl: cl}
	budget := sc.budget
	if budget == "" {
		budget = "64MiB"
	}
	for i := 1; i <= 4; i++ {
		w, err := cl.AddWorker(fmt.Sprintf("w%d", i), "-model-dir", modelDir, "-kv-pages", "1024", "-profile", "qwen3-14b-h100",
			"-time-scale", "2", "-emulate-load=false", "-checkpoint-budget", budget)
		if err != nil {
			t.Fatal(err)
		}
		env.workers = append(env.workers, w)
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
		_, err := op.SetStrategy(ctx, &pb.SetStrategyRequest{Strategy: pb.Strategy(s)})
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
		if w.Running() {
			m := "http://" + w.HTTPAddr + "/metrics"
			restored += metricValue(t, m, "lumen_worker_restored_pages_total")
			recomputed += metricValue(t, m, "lumen_worker_resume_recomputed_tokens_total")
			maxHeld = max(maxHeld, metricValue(t, m, "lumen_worker_checkpoint_bytes"))
		}
	}
	t.Logf("%s: pages reused %v, tokens recomputed %v, most checkpoint bytes held %v", sc.name, restored, recomputed, maxHeld)
	if sc.strategy == "stop-and-restart" && restored > 0 {
		t.Errorf("stop-and-restart reused %v checkpointed pages", restored)
	}
	if sc.budget == "4KiB" && maxHeld > 4096 {
		t.Errorf("a holder keeps %v bytes, over its 4 KiB budget", maxHeld)
	}
}
