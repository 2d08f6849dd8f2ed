// Package demo is `lumen demo`, the README's first command: a local cluster
// of real processes, 24 client streams through the gateway, kill -9 of the
// controller leader and of the busiest worker mid-stream, the killed
// worker's progressive recovery (its draft assisting a survivor while more
// clients stream), and a check that every client got exactly the
// failure-free reference output.
package demo

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/lumen-project/lumen/internal/completions"
	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/tokenizer"
	"github.com/lumen-project/lumen/worker/engine"
)

// Config is one run of the demo.
type Config struct {
	// Dir holds the data and logs; empty means a temporary directory,
	// removed afterwards.
	Dir string
	// Workers is the number of workers (default 3).
	Workers int
	// Streams is the number of client streams (default 24).
	Streams int
	// MaxTokens is each stream's output length (default 80).
	MaxTokens int
	// Out receives the story; nil means standard output.
	Out io.Writer
}

// DefaultConfig is `lumen demo` without flags.
func DefaultConfig() Config { return Config{Workers: 3, Streams: 24, MaxTokens: 80} }

// stream is one client stream through the gateway.
type stream struct {
	prompt string
	text   strings.Builder
	err    error
	lastAt time.Time
	maxGap time.Duration
}

// observe records a chunk of text that arrived at now, and the longest
// pause between two chunks so far.
func (s *stream) observe(now time.Time, text string) {
	if !s.lastAt.IsZero() {
		s.maxGap = max(s.maxGap, now.Sub(s.lastAt))
	}
	s.lastAt = now
	s.text.WriteString(text)
}

// Run runs the demo; it fails when any stream's output differs from the
// reference.
func Run(cfg Config) error {
	if cfg.Workers < 1 || cfg.Streams < 1 || cfg.MaxTokens < 1 {
		return fmt.Errorf("demo: workers (%d), streams (%d) and max tokens (%d) must be at least 1", cfg.Workers, cfg.Streams, cfg.MaxTokens)
	}
	out := cfg.Out
	if out == nil {
		out = os.Stdout
	}
	keep := cfg.Dir != ""
	if !keep {
		d, err := os.MkdirTemp("", "lumen-demo-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(d)
		cfg.Dir = d
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	modelDir := filepath.Join(cfg.Dir, "model")
	if _, _, err := engine.InitModel(modelDir, engine.DefaultSeed); err != nil {
		return err
	}

	step(out, "1. a local cluster, every part its own process")
	cl, err := devcluster.Start(ctx, devcluster.Options{Dir: cfg.Dir, Controllers: 3, Args: []string{"-log-level", "warn"}})
	if err != nil {
		return err
	}
	defer cl.Stop()
	for i := 1; i <= cfg.Workers; i++ {
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
		fmt.Fprintf(out, "   controller %s  pid %-7d %-8s  dashboard %s\n", c.ID, c.Pid(), role, cl.DashboardURL(i))
	}
	for _, w := range cl.Workers {
		fmt.Fprintf(out, "   %-12s transformer (%s), paced as Qwen3-14B/H100\n", w.ID, w.GRPCAddr)
	}
	fmt.Fprintf(out, "   gateway      http://%s/v1 (OpenAI API)\n", gw.Addr)
	client, err := ctlclient.New(cl.GRPCAddrs(), nil)
	if err != nil {
		return err
	}
	defer client.Close()

	step(out, "2. the failure-free reference: each prompt decoded alone by the engine")
	ref, err := engine.NewTransformer(engine.TransformerConfig{Path: filepath.Join(modelDir, engine.TargetFile), Pages: 256})
	if err != nil {
		return err
	}
	var tk tokenizer.Tokenizer
	streams := make([]*stream, cfg.Streams)
	wants := make([]string, cfg.Streams)
	for i := range streams {
		streams[i] = &stream{prompt: fmt.Sprintf("Request %d: keep serving through failures.", i)}
		wants[i] = engine.GreedyText(ref, tk.Encode(streams[i].prompt), cfg.MaxTokens)
	}
	fmt.Fprintf(out, "   %d prompts, %d greedy tokens each\n", len(streams), cfg.MaxTokens)

	step(out, fmt.Sprintf("3. %d clients stream completions through the gateway", len(streams)))
	var wg sync.WaitGroup
	firstToken := make(chan struct{}, len(streams))
	for _, s := range streams {
		wg.Go(func() { s.run(ctx, gw.Addr, cfg.MaxTokens, firstToken) })
	}
	for range streams {
		<-firstToken
	}
	fmt.Fprintf(out, "   every stream has its first token\n")

	step(out, "4. kill -9 the controller leader")
	t0 := time.Now()
	cl.Kill(leader)
	var firstWrite time.Duration
	// A probe that timed out may still have committed: complete them all,
	// so no probe placement outlives the demo's story.
	var probes []string
	for i := 0; ; i++ {
		wctx, wcancel := context.WithTimeout(ctx, 2*time.Second)
		probes = append(probes, fmt.Sprintf("probe-%d", i))
		_, err := client.Dispatch(wctx, &pb.DispatchRequest{RequestId: probes[i], PromptTokens: 8, MaxTokens: 1})
		wcancel()
		if err == nil {
			firstWrite = time.Since(t0)
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("no write after the leader died: %w", err)
		}
	}
	_, _ = client.Complete(ctx, &pb.CompleteRequest{RequestIds: probes})
	newLeader, err := cl.WaitLeader(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "   %s killed; %s leads; the next placement committed %d ms after the kill\n",
		cl.Controllers[leader].ID, cl.Controllers[newLeader].ID, firstWrite.Milliseconds())
	if err := cl.Restart(leader); err != nil {
		return err
	}
	fmt.Fprintf(out, "   %s restarted from its data directory\n", cl.Controllers[leader].ID)

	step(out, "5. kill -9 the worker with the most streams in flight")
	busiest, most := cl.Workers[0], -1
	for try := 0; ; try++ {
		busiest, most = cl.Workers[0], -1
		for _, w := range cl.Workers {
			n, err := workerInFlight(ctx, w)
			if err != nil {
				return err
			}
			if n > most {
				busiest, most = w, n
			}
		}
		if most > 0 {
			break
		}
		if try == 3 {
			return fmt.Errorf("no worker has a request in flight after %d waves of clients", try+1)
		}
		// The clients finished during the failover (no stream waits for
		// the controllers): new ones, so that the kill interrupts requests.
		n := cfg.Streams
		first := make(chan struct{}, n)
		for i := range n {
			s := &stream{prompt: streams[i].prompt}
			streams, wants = append(streams, s), append(wants, wants[i])
			wg.Go(func() { s.run(ctx, gw.Addr, cfg.MaxTokens, first) })
		}
		for range n {
			<-first
		}
		fmt.Fprintf(out, "   the clients finished during the failover; %d more stream completions\n", n)
	}
	st, err := client.ClusterStatus(ctx)
	if err != nil {
		return err
	}
	events, err := client.WatchEvents(ctx, st.AppliedIndex)
	if err != nil {
		return err
	}
	killedAt := time.Now()
	cl.KillWorker(busiest)
	fmt.Fprintf(out, "   %s killed with %d requests in flight\n", busiest.ID, most)
	var plan *pb.RecoveryPlan
	reason := ""
	for plan == nil {
		ev, err := events.Recv()
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
	fmt.Fprintf(out, "   marked FAILED and recovery plan %d committed %d ms after the kill\n   (%s)\n",
		plan.Id, time.Since(killedAt).Milliseconds(), reason)
	reuse := printPlan(out, plan)
	wg.Wait()

	step(out, fmt.Sprintf("6. restart %s: it recovers progressively, drafting for a survivor while its model loads", busiest.ID))
	// Its load now takes the profiles' times, scaled to a few seconds:
	// the draft (Qwen3-0.6B), the 14B weights into host memory (ASSIST),
	// their copy to the GPU (HOTSWAP).
	busiest.Args = append(busiest.Args, "-emulate-load=true", "-load-scale", "0.2")
	wave := make([]*stream, cfg.Streams)
	waveWants := make([]string, cfg.Streams)
	for i := range wave {
		wave[i] = &stream{prompt: fmt.Sprintf("Request %d arrives while a worker recovers.", i)}
		waveWants[i] = engine.GreedyText(ref, tk.Encode(wave[i].prompt), cfg.MaxTokens)
	}
	var waveWG sync.WaitGroup
	as, err := recoverProgressively(ctx, out, cl, busiest, events, func() {
		// New clients arrive while it assists: the survivor it drafts
		// for verifies its drafts in their decode steps.
		waveFirst := make(chan struct{}, len(wave))
		for _, s := range wave {
			waveWG.Go(func() { s.run(ctx, gw.Addr, cfg.MaxTokens, waveFirst) })
		}
		fmt.Fprintf(out, "           %d more clients stream completions while it assists\n", len(wave))
	})
	if err != nil {
		return err
	}
	waveWG.Wait()
	fmt.Fprintf(out, "   %s verified %.0f draft tokens of %s in %.0f fused steps and accepted %.0f (%.0f%%; %.2f tokens per step beyond its own);\n"+
		"   %s's draft model proposed %.0f tokens\n", as.target, as.verified, busiest.ID, as.verifications, as.accepted,
		100*as.accepted/max(as.verified, 1), as.accepted/max(as.verifications, 1), busiest.ID, as.proposed)

	step(out, "7. check every client's output against the reference")
	ok := checkStreams(out, append(streams, wave...), append(wants, waveWants...))
	var restored, recomputed, sent float64
	for _, w := range cl.Workers {
		if w == busiest {
			continue
		}
		for _, m := range []struct {
			sum  *float64
			name string
		}{{&restored, "lumen_worker_restored_pages_total"}, {&recomputed, "lumen_worker_resume_recomputed_tokens_total"},
			{&sent, "lumen_worker_checkpoint_pages_sent_total"}} {
			v, err := w.Metric(ctx, m.name)
			if err != nil {
				return err
			}
			*m.sum += v
		}
	}
	fmt.Fprintf(out, "   %d of %d interrupted requests resumed at their checkpoint holders: %.0f KV pages (%.0f tokens)\n"+
		"   imported from checkpoints, %.0f tokens recomputed by partial prefill (survivors streamed %.0f pages)\n",
		reuse, len(plan.Assignments), restored, restored*engine.PageTokens, recomputed, sent)
	fmt.Fprintf(out, "\ndone in %.1f s", time.Since(start).Seconds())
	if keep {
		fmt.Fprintf(out, "; logs in %s", cfg.Dir)
	}
	fmt.Fprintln(out)
	if total := len(streams) + len(wave); ok != total {
		return fmt.Errorf("%d streams did not match the reference", total-ok)
	}
	return nil
}

// assistFigures are what a drafter's partner verified and accepted.
type assistFigures struct {
	target                                      string
	verified, accepted, verifications, proposed float64
}

// recoverProgressively restarts w, a worker killed with SIGKILL, and
// prints its phases and pairings from the event stream as the controller
// commits them; onAssist runs when it is first paired (it drafts from
// then on). It returns when w is in FULL_SERVICE.
func recoverProgressively(ctx context.Context, out io.Writer, cl *devcluster.Cluster, w *devcluster.Worker,
	events grpc.ServerStreamingClient[pb.Event], onAssist func()) (assistFigures, error) {
	var as assistFigures
	restarted := time.Now()
	if err := cl.StartWorker(w); err != nil {
		return as, err
	}
	fmt.Fprintf(out, "   %s restarted; its data directory says the last run did not shut down cleanly\n", w.ID)
	var inc uint64
	for {
		ev, err := events.Recv()
		if err != nil {
			return as, fmt.Errorf("watch events: %w", err)
		}
		at := time.Since(restarted).Seconds()
		if p := ev.GetPaired(); p != nil && p.DrafterId == w.ID && p.DrafterIncarnation == inc {
			if p.Paired {
				as.target = p.TargetId
				fmt.Fprintf(out, "   %5.1f s  paired with %s (%s)\n", at, p.TargetId, p.Reason)
				if onAssist != nil {
					onAssist()
					onAssist = nil
				}
			} else {
				fmt.Fprintf(out, "   %5.1f s  pairing with %s ended (%s)\n", at, p.TargetId, p.Reason)
			}
			continue
		}
		pc := ev.GetPhaseChanged()
		if pc == nil || pc.WorkerId != w.ID || pc.To == pb.WorkerPhase_WORKER_PHASE_FAILED {
			continue
		}
		inc = pc.Incarnation
		fmt.Fprintf(out, "   %5.1f s  %-13s %s\n", at, strings.TrimPrefix(pc.To.String(), "WORKER_PHASE_"), phaseStory[pc.To])
		switch pc.To {
		case pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE:
			if as.target == "" {
				return as, fmt.Errorf("%s was never paired with a survivor", w.ID)
			}
			for _, t := range cl.Workers {
				if t.ID != as.target {
					continue
				}
				for _, m := range []struct {
					v    *float64
					name string
				}{{&as.verified, "lumen_worker_spec_draft_tokens_total"}, {&as.accepted, "lumen_worker_spec_accepted_tokens_total"},
					{&as.verifications, "lumen_worker_spec_verifications_total"}} {
					if *m.v, err = t.Metric(ctx, m.name); err != nil {
						return as, err
					}
				}
			}
			as.proposed, err = w.Metric(ctx, "lumen_worker_drafted_tokens_total")
			return as, err
		}
	}
}

// phaseStory says what a worker does in each phase of progressive recovery.
var phaseStory = map[pb.WorkerPhase]string{
	pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT: "registered; loading its draft model (the real early-exit draft)",
	pb.WorkerPhase_WORKER_PHASE_ASSIST:        "draft loaded; drafting tokens for a survivor while its own weights load into host memory",
	pb.WorkerPhase_WORKER_PHASE_HOTSWAP:       "weights in host memory; copying them to the GPU",
	pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE:  "serving again: placements and checkpoints come to it",
}

// run streams one completion, signalling first when the first token came
// (or the stream ended without one).
func (s *stream) run(ctx context.Context, addr string, maxTokens int, first chan<- struct{}) {
	signalled := false
	defer func() {
		if !signalled {
			first <- struct{}{}
		}
	}()
	_, s.err = completions.Stream(ctx, http.DefaultClient, addr, completions.Body(s.prompt, maxTokens, false), func(c completions.Chunk) {
		if c.Text == "" {
			return
		}
		s.observe(time.Now(), c.Text)
		if !signalled {
			signalled = true
			first <- struct{}{}
		}
	})
}

// printPlan lists a recovery plan's assignments by request id and returns
// how many resume from a checkpoint.
func printPlan(out io.Writer, plan *pb.RecoveryPlan) (reuse int) {
	as := append([]*pb.RecoveryAssignment(nil), plan.Assignments...)
	sort.Slice(as, func(i, j int) bool { return as[i].RequestId < as[j].RequestId })
	for _, a := range as {
		how := "recompute (its holder is gone or it had none)"
		if a.Mode == pb.RecoveryMode_RECOVERY_MODE_REUSE {
			how, reuse = "resume at its checkpoint holder, reusing its KV pages", reuse+1
		}
		fmt.Fprintf(out, "   %s -> %-9s %s\n", a.RequestId, a.TargetWorker, how)
	}
	return reuse
}

// checkStreams compares every stream with its reference, says which
// failed or differ, and returns how many are identical.
func checkStreams(out io.Writer, streams []*stream, wants []string) (ok int) {
	var maxGap time.Duration
	for i, s := range streams {
		switch {
		case s.err != nil:
			fmt.Fprintf(out, "   stream %d FAILED: %v\n", i, s.err)
		case s.text.String() != wants[i]:
			fmt.Fprintf(out, "   stream %d DIFFERS from the reference:\n     got  %q\n     want %q\n", i, s.text.String(), wants[i])
		default:
			ok++
		}
		maxGap = max(maxGap, s.maxGap)
	}
	fmt.Fprintf(out, "   %d of %d streams complete and identical to the failure-free reference: no error, no gap, no repeat\n", ok, len(streams))
	fmt.Fprintf(out, "   the longest pause any client saw between two tokens: %d ms (the failures' cost: a delay)\n", maxGap.Milliseconds())
	return ok
}

// workerInFlight is a worker's running plus waiting requests.
func workerInFlight(ctx context.Context, w *devcluster.Worker) (int, error) {
	running, err := w.Metric(ctx, "lumen_worker_num_requests_running")
	if err != nil {
		return 0, err
	}
	waiting, err := w.Metric(ctx, "lumen_worker_num_requests_waiting")
	return int(running + waiting), err
}

func step(out io.Writer, s string) { fmt.Fprintf(out, "\n%s\n", s) }
