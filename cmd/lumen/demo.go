package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/tokenizer"
	"github.com/lumen-project/lumen/worker/engine"
)

func init() {
	register("demo", "start a local cluster, kill -9 a controller leader and a worker mid-stream, show the recovery", runDemo)
}

// demoStream is one client stream through the gateway.
type demoStream struct {
	prompt string
	text   strings.Builder
	err    error
	lastAt time.Time
	maxGap time.Duration
}

func runDemo(args []string) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	dir := fs.String("dir", "", "data and log directory (default: a temporary one, removed afterwards)")
	nWorkers := fs.Int("workers", 3, "workers")
	nStreams := fs.Int("streams", 24, "client streams")
	maxTokens := fs.Int("max-tokens", 80, "output tokens per stream")
	if err := fs.Parse(args); err != nil {
		return err
	}
	keep := *dir != ""
	if !keep {
		d, err := os.MkdirTemp("", "lumen-demo-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(d)
		*dir = d
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	modelDir := filepath.Join(*dir, "model")
	if _, _, err := engine.InitModel(modelDir, engine.DefaultSeed); err != nil {
		return err
	}

	step("1. a local cluster, every part its own process")
	cl, err := devcluster.Start(ctx, devcluster.Options{Dir: *dir, Controllers: 3, Args: []string{"-log-level", "warn"}})
	if err != nil {
		return err
	}
	defer cl.Stop()
	for i := 1; i <= *nWorkers; i++ {
		// A real transformer on the CPU, paced like Qwen3-14B on an H100 at
		// half speed, so streams are still running when things die.
		if _, err := cl.AddWorker(fmt.Sprintf("worker-%d", i), "-model-dir", modelDir, "-kv-pages", "2048",
			"-profile", "qwen3-14b-h100", "-time-scale", "2", "-emulate-load=false"); err != nil {
			return err
		}
	}
	gw, err := cl.StartGateway("")
	if err != nil {
		return err
	}
	if err := gw.WaitReady(ctx); err != nil {
		return err
	}
	leader, err := cl.WaitLeader(ctx)
	if err != nil {
		return err
	}
	for i, c := range cl.Controllers {
		role := "follower"
		if i == leader {
			role = "leader"
		}
		fmt.Printf("   controller %s  pid %-7d %s\n", c.ID, c.Pid(), role)
	}
	for _, w := range cl.Workers {
		fmt.Printf("   %-12s transformer (%s), paced as Qwen3-14B/H100\n", w.ID, w.GRPCAddr)
	}
	fmt.Printf("   gateway      http://%s/v1 (OpenAI API)\n", gw.Addr)
	client, err := ctlclient.New(cl.GRPCAddrs(), nil)
	if err != nil {
		return err
	}
	defer client.Close()

	step("2. the failure-free reference: each prompt decoded alone by the engine")
	ref, err := engine.NewTransformer(engine.TransformerConfig{Path: filepath.Join(modelDir, engine.TargetFile), Pages: 256})
	if err != nil {
		return err
	}
	var tk tokenizer.Tokenizer
	streams := make([]*demoStream, *nStreams)
	wants := make([]string, *nStreams)
	for i := range streams {
		streams[i] = &demoStream{prompt: fmt.Sprintf("Request %d: keep serving through failures.", i)}
		wants[i] = engine.GreedyText(ref, tk.Encode(streams[i].prompt), *maxTokens)
	}
	fmt.Printf("   %d prompts, %d greedy tokens each\n", len(streams), *maxTokens)

	step(fmt.Sprintf("3. %d clients stream completions through the gateway", len(streams)))
	var wg sync.WaitGroup
	firstToken := make(chan struct{}, len(streams))
	for i, s := range streams {
		wg.Go(func() { s.run(ctx, gw.Addr, *maxTokens, firstToken, i) })
	}
	for range streams {
		<-firstToken
	}
	fmt.Printf("   every stream has its first token\n")

	step("4. kill -9 the controller leader")
	t0 := time.Now()
	cl.Kill(leader)
	var firstWrite time.Duration
	for i := 0; ; i++ {
		wctx, wcancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := client.Dispatch(wctx, &pb.DispatchRequest{RequestId: fmt.Sprintf("probe-%d", i), PromptTokens: 8, MaxTokens: 1})
		wcancel()
		if err == nil {
			firstWrite = time.Since(t0)
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("no write after the leader died: %w", err)
		}
	}
	_, _ = client.Complete(ctx, &pb.CompleteRequest{RequestIds: []string{"probe-0"}})
	newLeader, err := cl.WaitLeader(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("   %s killed; %s leads; the next placement committed %d ms after the kill\n",
		cl.Controllers[leader].ID, cl.Controllers[newLeader].ID, firstWrite.Milliseconds())
	if err := cl.Restart(leader); err != nil {
		return err
	}
	fmt.Printf("   %s restarted from its data directory\n", cl.Controllers[leader].ID)

	step("5. kill -9 the worker with the most streams in flight")
	busiest, most := cl.Workers[0], -1
	for _, w := range cl.Workers {
		if n := workerInFlight(w); n > most {
			busiest, most = w, n
		}
	}
	st, err := client.ClusterStatus(ctx)
	if err != nil {
		return err
	}
	stream, err := client.WatchEvents(ctx, st.AppliedIndex)
	if err != nil {
		return err
	}
	killedAt := time.Now()
	cl.KillWorker(busiest)
	fmt.Printf("   %s killed with %d requests in flight\n", busiest.ID, most)
	var plan *pb.RecoveryPlan
	reason := ""
	for plan == nil {
		ev, err := stream.Recv()
		if err != nil {
			return fmt.Errorf("watch events: %w", err)
		}
		if pc := ev.GetPhaseChanged(); pc != nil && pc.WorkerId == busiest.ID && pc.To == pb.WorkerPhase_WORKER_PHASE_FAILED {
			reason = pc.Reason
		}
		if rp := ev.GetRecoveryPlan(); rp != nil && rp.FailedWorker == busiest.ID {
			plan = rp
		}
	}
	fmt.Printf("   marked FAILED and recovery plan %d committed %d ms after the kill\n   (%s)\n",
		plan.Id, time.Since(killedAt).Milliseconds(), reason)
	sort.Slice(plan.Assignments, func(i, j int) bool { return plan.Assignments[i].RequestId < plan.Assignments[j].RequestId })
	reuse := 0
	for _, a := range plan.Assignments {
		how := "recompute (its holder is gone or it had none)"
		if a.Mode == pb.RecoveryMode_RECOVERY_MODE_REUSE {
			how, reuse = "resume at its checkpoint holder, reusing its KV pages", reuse+1
		}
		fmt.Printf("   %s -> %-9s %s\n", a.RequestId, a.TargetWorker, how)
	}
	wg.Wait()

	step("6. check every client's output against the reference")
	ok := 0
	var maxGap time.Duration
	for i, s := range streams {
		switch {
		case s.err != nil:
			fmt.Printf("   stream %d FAILED: %v\n", i, s.err)
		case s.text.String() != wants[i]:
			fmt.Printf("   stream %d DIFFERS from the reference:\n     got  %q\n     want %q\n", i, s.text.String(), wants[i])
		default:
			ok++
		}
		maxGap = max(maxGap, s.maxGap)
	}
	fmt.Printf("   %d of %d streams complete and identical to the failure-free reference: no error, no gap, no repeat\n", ok, len(streams))
	fmt.Printf("   the longest pause any client saw between two tokens: %d ms (the failures' cost: a delay)\n", maxGap.Milliseconds())
	var restored, recomputed, sent float64
	for _, w := range cl.Workers {
		if w != busiest {
			restored += workerMetric(w, "lumen_worker_restored_pages_total")
			recomputed += workerMetric(w, "lumen_worker_resume_recomputed_tokens_total")
			sent += workerMetric(w, "lumen_worker_checkpoint_pages_sent_total")
		}
	}
	fmt.Printf("   %d of %d interrupted requests resumed at their checkpoint holders: %.0f KV pages (%.0f tokens)\n"+
		"   imported from checkpoints, %.0f tokens recomputed by partial prefill (survivors streamed %.0f pages)\n",
		reuse, len(plan.Assignments), restored, restored*16, recomputed, sent)
	fmt.Printf("\ndone in %.1f s", time.Since(start).Seconds())
	if keep {
		fmt.Printf("; logs in %s", *dir)
	}
	fmt.Println()
	if ok != len(streams) {
		return fmt.Errorf("%d streams did not match the reference", len(streams)-ok)
	}
	return nil
}

func (s *demoStream) run(ctx context.Context, addr string, maxTokens int, first chan<- struct{}, i int) {
	body, _ := json.Marshal(map[string]any{"model": "lumen-tiny", "prompt": s.prompt, "max_tokens": maxTokens,
		"temperature": 0, "stream": true})
	req, _ := http.NewRequestWithContext(ctx, "POST", "http://"+addr+"/v1/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	signalled := false
	defer func() {
		if !signalled {
			first <- struct{}{}
		}
	}()
	if err != nil {
		s.err = err
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		s.err = fmt.Errorf("HTTP %d", resp.StatusCode)
		return
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Bytes()
		if !bytes.HasPrefix(line, []byte("data: ")) {
			continue
		}
		data := line[6:]
		if bytes.Equal(data, []byte("[DONE]")) {
			return
		}
		var ch struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal(data, &ch); err != nil {
			s.err = err
			return
		}
		if ch.Error != nil {
			s.err = fmt.Errorf("error event: %s", ch.Error.Message)
			return
		}
		if len(ch.Choices) > 0 && ch.Choices[0].Text != "" {
			now := time.Now()
			if !s.lastAt.IsZero() {
				s.maxGap = max(s.maxGap, now.Sub(s.lastAt))
			}
			s.lastAt = now
			s.text.WriteString(ch.Choices[0].Text)
			if !signalled {
				signalled = true
				first <- struct{}{}
			}
		}
	}
	s.err = fmt.Errorf("stream ended without [DONE]: %v", sc.Err())
}

func workerInFlight(w *devcluster.Worker) int {
	return int(workerMetric(w, "lumen_worker_running") + workerMetric(w, "lumen_worker_waiting"))
}

// workerMetric reads one unlabelled metric from a worker.
func workerMetric(w *devcluster.Worker, name string) float64 {
	resp, err := http.Get("http://" + w.HTTPAddr + "/metrics")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, name+" ") {
			var v float64
			fmt.Sscan(strings.TrimPrefix(line, name+" "), &v)
			return v
		}
	}
	return 0
}

func step(s string) { fmt.Printf("\n%s\n", s) }
