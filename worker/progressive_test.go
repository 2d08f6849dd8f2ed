package worker

import (
	"context"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/controller"
	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// startController runs one controller replica and returns its address and
// a client.
func startController(t *testing.T) (string, *ctlclient.Client) {
	t.Helper()
	cfg := controller.DefaultConfig()
	cfg.NodeID, cfg.DataDir, cfg.BootstrapExpect = "c0", t.TempDir(), 1
	cfg.RaftAddr, cfg.GRPCAddr, cfg.SerfAddr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.Logger = hclog.NewNullLogger()
	n, err := controller.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Shutdown() })
	ctl, err := ctlclient.New([]string{n.GRPCAddr()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ctl.Close)
	return n.GRPCAddr(), ctl
}

// row is a worker's row in the controller's table (nil when absent).
func row(t *testing.T, ctl *ctlclient.Client, id string) *pb.Worker {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	resp, err := ctl.ListWorkers(ctx, &pb.ListWorkersRequest{})
	if err != nil {
		return nil
	}
	for _, w := range resp.Workers {
		if w.Id == id {
			return w
		}
	}
	return nil
}

// recoveryOf is a Recovery for the synthetic engine whose target's host
// load waits for hostGo to close (the test decides how long ASSIST lasts).
func recoveryOf(t *testing.T, hostGo <-chan struct{}) (engine.Engine, *Recovery) {
	t.Helper()
	target, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 1024})
	if err != nil {
		t.Fatal(err)
	}
	target.Unload()
	draft := syntheticDraft(t)
	draft.Unload()
	st := engine.LoadStages(target) // not the Paced engine's Load: it takes the profile's load time
	st.ToHost = func(ctx context.Context) error {
		select {
		case <-hostGo:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return engine.NewPaced(target, engine.Profiles["qwen3-14b-h100"], 1), &Recovery{Draft: draft, LoadDraft: draft.Load, Target: st}
}

// TestProgressiveRecovery: a worker whose data directory holds the marker
// of a run that did not shut down cleanly registers in LOADING_DRAFT, loads
// its draft, enters ASSIST, is paired with the full-service worker and
// drafts for it — whose outputs stay those of the reference — until its
// target is in host memory; then HOTSWAP and FULL_SERVICE, where it serves,
// and its partner runs without drafts. A clean shutdown removes the marker,
// so the next start is a fresh one, straight to FULL_SERVICE.
func TestProgressiveRecovery(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	addr, ctl := startController(t)
	h := start(t, 64, func(c *Config) {
		c.ID, c.Controllers, c.TokenBudget = "w1", []string{addr}, 96
		syntheticTarget(c)
	})
	waitUntil(t, 20*time.Second, "w1 in full service", func() bool {
		r := row(t, ctl, "w1")
		return r != nil && r.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE
	})

	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, runMarker), []byte("a run killed with SIGKILL\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	hostGo := make(chan struct{})
	eng, rc := recoveryOf(t, hostGo)
	cfg := DefaultConfig()
	cfg.ID, cfg.DataDir, cfg.GRPCAddr, cfg.Controllers, cfg.Engine, cfg.Recovery = "w2", dir, "127.0.0.1:0", []string{addr}, eng, rc
	cfg.Logger = hclog.NewNullLogger()
	w2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer w2.Shutdown(context.Background())
	waitUntil(t, 20*time.Second, "w2 paired with w1 in ASSIST", func() bool {
		r := row(t, ctl, "w2")
		return r != nil && r.Phase == pb.WorkerPhase_WORKER_PHASE_ASSIST && r.PairedWorker == "w1"
	})
	waitUntil(t, 20*time.Second, "w2's Assist stream to w1", func() bool { return gaugeValue(h.w.metrics.assistStreams) == 1 })
	if w2.cfg.Engine.Loaded() {
		t.Fatal("w2's target is loaded in ASSIST")
	}
	cc, err := grpc.NewClient(w2.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	h2 := &harness{t: t, w: w2, cc: cc, cl: pb.NewInferenceClient(cc)}
	if _, _, err := h2.generate(context.Background(), &pb.GenerateRequest{RequestId: "early", Prompt: []int32{1, 2}, MaxTokens: 2}); status.Code(err) != codes.Unavailable {
		t.Fatalf("Generate on w2 in ASSIST: %v, want Unavailable", err)
	}
	// A drafter the controller did not pair with w1 is refused.
	st, err := h.cl.Assist(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&pb.DraftBatch{DrafterId: "w9", DrafterIncarnation: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "has not paired") {
		t.Fatalf("an unpaired drafter: %v, want FailedPrecondition", err)
	}

	var wg sync.WaitGroup
	prompts := make([][]int32, 8)
	got, errs := make([][]int32, len(prompts)), make([]error, len(prompts))
	for i := range prompts {
		prompts[i] = randomPrompt(rng, 8+rng.Intn(100))
		wg.Go(func() {
			got[i], _, errs[i] = h.generate(context.Background(), &pb.GenerateRequest{RequestId: fmt.Sprintf("p%d", i), Prompt: prompts[i], MaxTokens: 48})
		})
	}
	wg.Wait()
	for i := range prompts {
		if errs[i] != nil {
			t.Fatalf("request %d: %v", i, errs[i])
		}
		if want := synthReference(t, prompts[i], 48, engine.Sampling{}); !slices.Equal(got[i], want) {
			t.Errorf("request %d differs from the reference:\n got  %v\n want %v", i, got[i], want)
		}
	}
	accepted := counterValue(h.w.metrics.specAccepted)
	t.Logf("w1 verified %v drafts, accepted %v; w2 drafted %v", counterValue(h.w.metrics.specDrafts), accepted, counterValue(w2.metrics.drafted))
	if accepted == 0 {
		t.Error("no draft accepted during ASSIST")
	}

	close(hostGo)
	waitUntil(t, 20*time.Second, "w2 in full service", func() bool {
		r := row(t, ctl, "w2")
		return r != nil && r.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE && r.PairedWorker == ""
	})
	waitUntil(t, 10*time.Second, "the end of w2's Assist stream", func() bool { return gaugeValue(h.w.metrics.assistStreams) == 0 })
	if r := row(t, ctl, "w1"); r.PairedWorker != "" {
		t.Errorf("w1 is still paired with %q", r.PairedWorker)
	}
	for _, p := range []pb.WorkerPhase{pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT, pb.WorkerPhase_WORKER_PHASE_ASSIST, pb.WorkerPhase_WORKER_PHASE_HOTSWAP} {
		t.Logf("w2 spent %.3f s in %s", gaugeVecValue(w2.metrics.phaseSeconds, phaseName(p)), phaseName(p))
	}
	prompt := randomPrompt(rng, 30)
	out, _, err := h2.generate(context.Background(), &pb.GenerateRequest{RequestId: "on-w2", Prompt: prompt, MaxTokens: 20})
	if err != nil {
		t.Fatal(err)
	}
	if want := synthReference(t, prompt, 20, engine.Sampling{}); !slices.Equal(out, want) {
		t.Errorf("w2 after recovery:\n got  %v\n want %v", out, want)
	}

	// A clean shutdown: the next start is fresh.
	w2.Shutdown(context.Background())
	if _, err := os.Stat(filepath.Join(dir, runMarker)); !os.IsNotExist(err) {
		t.Fatalf("the run marker survived a clean shutdown: %v", err)
	}
	if restarted, err := markRunning(dir); err != nil || restarted {
		t.Fatalf("after a clean shutdown: restarted %v, %v", restarted, err)
	}
}

// TestRunMarker: a start finds the marker of a run that did not shut down
// cleanly; a clean shutdown removes it; no data directory, no marker.
func TestRunMarker(t *testing.T) {
	dir := t.TempDir()
	for i, want := range []bool{false, true, true} {
		if got, err := markRunning(dir); err != nil || got != want {
			t.Fatalf("start %d: restarted %v (%v), want %v", i, got, err, want)
		}
	}
	if err := clearRunning(dir); err != nil {
		t.Fatal(err)
	}
	if got, _ := markRunning(dir); got {
		t.Fatal("restarted after a clean shutdown")
	}
	if got, err := markRunning(""); got || err != nil {
		t.Fatalf("no data directory: restarted %v, %v", got, err)
	}
}
