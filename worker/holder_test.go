package worker

import (
	"context"
	"math/rand"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/hashicorp/go-hclog"

	"github.com/lumen-project/lumen/controller"
	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// cluster is one controller replica and two workers registered with it: a
// request placed on one has the other as its checkpoint holder.
type cluster struct {
	t       *testing.T
	ctl     *ctlclient.Client
	workers map[string]*harness
	// sampling, when set, goes with every call follow makes.
	sampling *pb.SamplingParams
}

func startCluster(t *testing.T, tweak func(*Config)) *cluster {
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
	c := &cluster{t: t, ctl: ctl, workers: map[string]*harness{}}
	for _, id := range []string{"w1", "w2"} {
		c.workers[id] = start(t, 256, func(wc *Config) {
			wc.ID, wc.Controllers = id, []string{n.GRPCAddr()}
			wc.ReconcileInterval = 20 * time.Millisecond
			if tweak != nil {
				tweak(wc)
			}
		})
	}
	waitUntil(t, 20*time.Second, "both workers registered", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		resp, err := ctl.ListWorkers(ctx, &pb.ListWorkersRequest{})
		return err == nil && len(resp.Workers) == 2
	})
	return c
}

// dispatch places a request, retrying while the new leader gets ready.
func (c *cluster) dispatch(id string, prompt, maxTokens uint32) *pb.Placement {
	c.t.Helper()
	var p *pb.Placement
	waitUntil(c.t, 20*time.Second, "a dispatch", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		resp, err := c.ctl.Dispatch(ctx, &pb.DispatchRequest{RequestId: id, PromptTokens: prompt, MaxTokens: maxTokens})
		if err != nil {
			return false
		}
		p = resp.Placement
		return true
	})
	if p.HolderId == "" || p.HolderId == p.WorkerId {
		c.t.Fatalf("placement %v has no holder apart from its worker", p)
	}
	return p
}

// waitUntil polls cond until it holds, failing the test after timeout.
func waitUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// sendPages streams pages of a request to a worker's checkpoint store, as a
// serving worker's sender does, and returns how many it stored.
func sendPages(t *testing.T, to *harness, req string, reserved uint64, hashes ...uint64) uint32 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := to.cl.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i, h := range hashes {
		if err := st.Send(&pb.CheckpointMessage{RequestId: req, PageIndex: uint32(i), PrefixHash: h, Data: make([]byte, 64), ReservedBytes: reserved}); err != nil {
			t.Fatal(err)
		}
	}
	ack, err := st.CloseAndRecv()
	if err != nil {
		t.Fatal(err)
	}
	return ack.Stored
}

func (h *harness) holdsPagesOf(req string) bool {
	_, _, ok := h.w.store.stored(req)
	return ok
}

// TestHolderFreesPagesItNoLongerHolds: a holder is told to drop a request's
// pages only by the worker that serves it; when the request completes
// without that release (its worker failed, rejoined, or the request moved),
// or the placement names another holder, or the request was never placed,
// the controller has freed (or never made) the reservation, and the holder
// must free the pages itself. Pages of a request it still holds stay.
func TestHolderFreesPagesItNoLongerHolds(t *testing.T) {
	c := startCluster(t, nil)
	live := c.dispatch("live", 40, 8)
	done := c.dispatch("done", 40, 8)
	holder, serving := c.workers[live.HolderId], c.workers[live.WorkerId]

	if n := sendPages(t, holder, "live", live.ReservedBytes, 11, 12); n != 2 {
		t.Fatalf("the holder stored %d of live's 2 pages", n)
	}
	if n := sendPages(t, c.workers[done.HolderId], "done", done.ReservedBytes, 21, 22); n != 2 {
		t.Fatalf("the holder stored %d of done's 2 pages", n)
	}
	// Pages at a worker the placement does not name as holder (live runs
	// there), and pages of a request that was never placed.
	if n := sendPages(t, serving, "live", live.ReservedBytes, 31); n != 1 {
		t.Fatalf("the serving worker stored %d pages", n)
	}
	if n := sendPages(t, holder, "ghost", 1<<20, 41); n != 1 {
		t.Fatalf("ghost: %d pages stored", n)
	}
	// done completes, and nobody tells its holder.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.ctl.Complete(ctx, &pb.CompleteRequest{RequestIds: []string{"done"}}); err != nil {
		t.Fatal(err)
	}

	waitUntil(t, 20*time.Second, "the pages of requests not held freed", func() bool {
		return !holder.holdsPagesOf("ghost") && !c.workers[done.HolderId].holdsPagesOf("done") && !serving.holdsPagesOf("live")
	})
	// Two full passes later the holder still has live's pages.
	passes := counterValue(holder.w.metrics.ckptPasses)
	waitUntil(t, 20*time.Second, "two more reconcile passes", func() bool {
		return counterValue(holder.w.metrics.ckptPasses) >= passes+2
	})
	if charged, _, ok := holder.w.store.stored("live"); !ok || charged != 2*64 {
		t.Fatalf("the holder keeps %d bytes of live (held: %v), want %d", charged, ok, 2*64)
	}
	if used, _, _ := holder.w.store.usage(); used != 2*64 {
		t.Fatalf("the holder stores %d bytes, want only live's %d", used, 2*64)
	}
	if got := counterValue(holder.w.metrics.ckptFreed); got < 1 {
		t.Fatalf("reclaimed counter %v", got)
	}
}

// TestSenderCarriesTheReservation: the pages a serving worker streams to a
// request's holder carry the footprint the controller reserved there, and
// the holder stores them under it (before, the field was left 0 and the cap
// never applied; now a page without a reservation is refused).
func TestSenderCarriesTheReservation(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	c := startCluster(t, func(wc *Config) {
		wc.Engine = engine.NewPaced(wc.Engine, engine.Profiles["qwen3-14b-h100"], 1)
	})
	prompt := randomPrompt(rng, 40)
	p := c.dispatch("r", uint32(len(prompt)), 150)
	serving, holder := c.workers[p.WorkerId], c.workers[p.HolderId]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := serving.cl.Generate(ctx, &pb.GenerateRequest{RequestId: "r", Prompt: prompt, MaxTokens: 150,
		Holder: p.HolderId, Epoch: p.Epoch})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 10; i++ {
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	waitUntil(t, 20*time.Second, "checkpoint pages at the holder", func() bool {
		charged, _, _ := holder.w.store.stored("r")
		return charged > 0
	})
	charged, reserved, _ := holder.w.store.stored("r")
	if reserved != p.ReservedBytes {
		t.Fatalf("the pages carried a reservation of %d bytes; the placement reserved %d", reserved, p.ReservedBytes)
	}
	if charged > reserved {
		t.Fatalf("the holder stores %d bytes of r, over its reservation of %d", charged, reserved)
	}
	if refused := counterValue(holder.w.metrics.ckptRefused); refused != 0 {
		t.Fatalf("the holder refused %v pages", refused)
	}
	cancel()
}

// TestSetHolderAfterStart: a request started with no holder (the gateway
// starts it before its placement commits) gets its holder over SetHolder
// after several pages filled; from then the holder receives every full
// page from page 0, under the placement's reservation, while decoding goes
// on. SetHolder for another epoch, an unknown request or a second time is
// not applied.
func TestSetHolderAfterStart(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	c := startCluster(t, func(wc *Config) {
		wc.Engine = engine.NewPaced(wc.Engine, engine.Profiles["qwen3-14b-h100"], 1)
	})
	prompt := randomPrompt(rng, 40)
	p := c.dispatch("r", uint32(len(prompt)), 150)
	serving, holder := c.workers[p.WorkerId], c.workers[p.HolderId]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := serving.cl.Generate(ctx, &pb.GenerateRequest{RequestId: "r", Prompt: prompt, MaxTokens: 150, Epoch: p.Epoch})
	if err != nil {
		t.Fatal(err)
	}
	var out []int32
	recv := func(n int) {
		t.Helper()
		for len(out) < n {
			r, err := st.Recv()
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, r.Token)
		}
	}
	recv(60) // 100 tokens in the cache: 6 full pages
	if _, _, ok := holder.w.store.stored("r"); ok {
		t.Fatal("the holder has pages of r before SetHolder")
	}
	set := func(id string, epoch uint64, h string) bool {
		t.Helper()
		resp, err := serving.cl.SetHolder(ctx, &pb.SetHolderRequest{RequestId: id, Epoch: epoch, Holder: h})
		if err != nil {
			t.Fatal(err)
		}
		return resp.Applied
	}
	if set("r", p.Epoch+1, p.HolderId) || set("nope", p.Epoch, p.HolderId) {
		t.Fatal("SetHolder applied for another epoch or an unknown request")
	}
	if !set("r", p.Epoch, p.HolderId) {
		t.Fatal("SetHolder not applied to the running request")
	}
	if set("r", p.Epoch, p.WorkerId) {
		t.Fatal("SetHolder replaced the holder already set")
	}
	if _, err := serving.cl.SetHolder(ctx, &pb.SetHolderRequest{RequestId: "r", Epoch: p.Epoch}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("SetHolder without a holder: %v, want InvalidArgument", err)
	}
	recv(100)
	full := (len(prompt) + 96) / 16
	hashes := pageHashes(append(slices.Clone(prompt), out[:96]...), nil)[:full]
	waitUntil(t, 20*time.Second, "the holder holding every page from page 0", func() bool {
		return len(holder.w.store.prefix(hashes)) == full
	})
	_, reserved, _ := holder.w.store.stored("r")
	if reserved != p.ReservedBytes {
		t.Fatalf("the pages carried a reservation of %d bytes; the placement reserved %d", reserved, p.ReservedBytes)
	}
	if refused := counterValue(holder.w.metrics.ckptRefused); refused != 0 {
		t.Fatalf("the holder refused %v pages", refused)
	}
	recv(150)
}

// TestKeepsPagesReplica: a worker named among a placement's further
// checkpoint copies keeps its pages; one named nowhere frees them.
func TestKeepsPagesReplica(t *testing.T) {
	p := &pb.Placement{WorkerId: "w1", HolderId: "w2", ReplicaHolders: []string{"w3"}, State: pb.PlacementState_PLACEMENT_STATE_RUNNING}
	for self, want := range map[string]bool{"w2": true, "w3": true, "w4": false} {
		if got := keepsPages(p, self); got != want {
			t.Errorf("%s keeps pages: %v, want %v", self, got, want)
		}
	}
}
