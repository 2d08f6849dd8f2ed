package worker

import (
	"context"
	"fmt"
	"math/rand"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// startReplicaCluster runs one controller and four paced workers, each on
// a node of its own, with checkpoint_replicas 2: a request placed on one
// has its checkpoint on two of the others.
func startReplicaCluster(t *testing.T) *cluster {
	t.Helper()
	addr, ctl := startController(t)
	c := &cluster{t: t, ctl: ctl, workers: map[string]*harness{}}
	for i, id := range []string{"w1", "w2", "w3", "w4"} {
		c.workers[id] = start(t, 256, func(wc *Config) {
			wc.ID, wc.Controllers, wc.Node = id, []string{addr}, fmt.Sprintf("node-%d", i+1)
			wc.ReconcileInterval = 20 * time.Millisecond
			wc.Engine = engine.NewPaced(wc.Engine, engine.Profiles["qwen3-14b-h100"], 1)
		})
	}
	waitUntil(t, 20*time.Second, "four workers registered", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		resp, err := ctl.ListWorkers(ctx, &pb.ListWorkersRequest{})
		return err == nil && len(resp.Workers) == 4
	})
	waitUntil(t, 20*time.Second, "checkpoint replicas set to 2", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		return ctl.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) error {
			_, err := op.SetStrategy(ctx, &pb.SetStrategyRequest{CheckpointReplicas: 2})
			return err
		}) == nil
	})
	return c
}

// dispatchReplicated places a request and checks it got two copies, on two
// workers other than its own.
func (c *cluster) dispatchReplicated(id string, prompt, maxTokens uint32) *pb.Placement {
	c.t.Helper()
	p := c.dispatch(id, prompt, maxTokens)
	if len(p.ReplicaHolders) != 1 || p.ReplicaHolders[0] == p.HolderId || p.ReplicaHolders[0] == p.WorkerId {
		c.t.Fatalf("placement %v: want one replica beside the holder, on a third worker", p)
	}
	return p
}

// crash stops a worker as a SIGKILL would, as far as the others can tell:
// it can no longer reach the controller (no report, no rejoin) nor any
// other worker (no page, no release), and then its gRPC server goes (every
// stream to it breaks, no call is answered). The order matters: stopping
// the server cancels the worker's Generate calls, and a cancelled call
// releases its checkpoint at every copy, which a killed process never
// gets to send.
func (h *harness) crash() {
	h.w.ctl.Close()
	h.w.peers.Close()
	h.w.grpc.Stop()
}

// markFailed reports a crashed worker unreachable: the controller probes it
// and commits its failure.
func markFailed(t *testing.T, ctl *ctlclient.Client, id string) {
	t.Helper()
	waitUntil(t, 20*time.Second, id+" marked failed", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		resp, err := ctl.ReportUnreachable(ctx, &pb.ReportUnreachableRequest{WorkerId: id, Reporter: "test"})
		return err == nil && resp.MarkedFailed
	})
}

// TestReplicaRestoresWhenPrimaryAndHolderDie: with two copies, the serving
// worker streams every full page to both holders, in step. Kill the first
// copy's holder and then the serving worker: the recovery plan sends the
// request to the other copy, which restores its pages (restored pages > 0)
// and finishes it with the outputs of a failure-free reference, bit for bit.
func TestReplicaRestoresWhenPrimaryAndHolderDie(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	c := startReplicaCluster(t)
	prompt := randomPrompt(rng, 40)
	const maxTokens = 150
	p := c.dispatchReplicated("r", uint32(len(prompt)), maxTokens)
	serving, first, other := c.workers[p.WorkerId], c.workers[p.HolderId], c.workers[p.ReplicaHolders[0]]
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	st, err := serving.cl.Generate(ctx, &pb.GenerateRequest{RequestId: "r", Prompt: prompt, MaxTokens: maxTokens,
		Holder: p.HolderId, ReplicaHolders: p.ReplicaHolders, Epoch: p.Epoch})
	if err != nil {
		t.Fatal(err)
	}
	var out []int32
	for len(out) < 60 {
		r, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, r.Token)
	}
	// 100 tokens in the cache: 6 full pages, at both copies.
	hashes := pageHashes(append(slices.Clone(prompt), out[:56]...), nil)[:6]
	waitUntil(t, 20*time.Second, "six pages at both copies", func() bool {
		return len(first.w.store.prefix(hashes)) == 6 && len(other.w.store.prefix(hashes)) == 6
	})
	_, r1, _ := first.w.store.stored("r")
	_, r2, _ := other.w.store.stored("r")
	if r1 != p.ReservedBytes || r2 != p.ReservedBytes {
		t.Fatalf("the copies' pages carried reservations %d and %d; the placement reserved %d on each", r1, r2, p.ReservedBytes)
	}

	first.crash()
	serving.crash()
	for {
		r, err := st.Recv()
		if err != nil {
			break // the stream broke with its worker
		}
		out = append(out, r.Token)
	}
	markFailed(t, c.ctl, first.w.cfg.ID)
	markFailed(t, c.ctl, serving.w.cfg.ID)
	var pl *pb.Placement
	waitUntil(t, 20*time.Second, "the request placed at its live copy", func() bool {
		cctx, ccancel := context.WithTimeout(ctx, time.Second)
		defer ccancel()
		resp, err := c.ctl.GetPlacement(cctx, &pb.GetPlacementRequest{RequestId: "r"})
		if err != nil || resp.Placement.Epoch == p.Epoch {
			return false
		}
		pl = resp.Placement
		return true
	})
	if pl.WorkerId != other.w.cfg.ID {
		t.Fatalf("the request resumes at %s, not at its live copy %s (placement %v)", pl.WorkerId, other.w.cfg.ID, pl)
	}
	if pl.HolderId == first.w.cfg.ID || pl.HolderId == serving.w.cfg.ID || slices.Contains(pl.ReplicaHolders, first.w.cfg.ID) {
		t.Fatalf("the resumed request's copies %q %v include a failed worker", pl.HolderId, pl.ReplicaHolders)
	}
	rest, _, err := other.generate(ctx, &pb.GenerateRequest{RequestId: "r", Prompt: prompt, Generated: out, MaxTokens: maxTokens,
		Holder: pl.HolderId, ReplicaHolders: pl.ReplicaHolders, Epoch: pl.Epoch})
	if err != nil {
		t.Fatal(err)
	}
	got := append(slices.Clone(out), rest...)
	if want := reference(t, prompt, maxTokens); !slices.Equal(got, want) {
		t.Fatalf("outputs after the failures differ from the reference\n got %v\nwant %v", got, want)
	}
	if n := counterValue(other.w.metrics.restoredPages); n < 6 {
		t.Fatalf("the live copy restored %v pages, want at least the 6 it held", n)
	}
	if n := counterValue(other.w.metrics.restoredReqs); n != 1 {
		t.Fatalf("the live copy counts %v restored requests, want 1", n)
	}
}

// TestReplicasReleasedOnComplete: a request that ends frees its pages at
// every copy — its serving worker releases each — and a copy whose request
// completed without that release (or never existed) frees it when it
// reconciles with the placement table; a copy still named keeps its pages.
func TestReplicasReleasedOnComplete(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	c := startReplicaCluster(t)
	prompt := randomPrompt(rng, 40)
	p := c.dispatchReplicated("r", uint32(len(prompt)), 60)
	serving := c.workers[p.WorkerId]
	copies := []*harness{c.workers[p.HolderId], c.workers[p.ReplicaHolders[0]]}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	st, err := serving.cl.Generate(ctx, &pb.GenerateRequest{RequestId: "r", Prompt: prompt, MaxTokens: 60,
		Holder: p.HolderId, ReplicaHolders: p.ReplicaHolders, Epoch: p.Epoch})
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 20*time.Second, "pages at both copies", func() bool {
		return copies[0].holdsPagesOf("r") && copies[1].holdsPagesOf("r")
	})
	for {
		r, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if r.Done {
			break
		}
	}
	// The placement still runs (nobody completed it): only the serving
	// worker's releases free the copies.
	waitUntil(t, 20*time.Second, "both copies released", func() bool {
		return !copies[0].holdsPagesOf("r") && !copies[1].holdsPagesOf("r")
	})

	// Reconciliation: pages at both copies, then Complete, with no release.
	q := c.dispatchReplicated("q", 40, 8)
	for _, h := range []*harness{c.workers[q.HolderId], c.workers[q.ReplicaHolders[0]]} {
		if n := sendPages(t, h, "q", q.ReservedBytes, 51, 52); n != 2 {
			t.Fatalf("%s stored %d of q's 2 pages", h.w.cfg.ID, n)
		}
	}
	if _, err := c.ctl.Complete(ctx, &pb.CompleteRequest{RequestIds: []string{"q"}}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 20*time.Second, "both copies of a completed request freed", func() bool {
		return !c.workers[q.HolderId].holdsPagesOf("q") && !c.workers[q.ReplicaHolders[0]].holdsPagesOf("q")
	})
}

// TestReplicaHoldersValidated: a call's further copies need a holder, and
// name distinct workers other than it.
func TestReplicaHoldersValidated(t *testing.T) {
	h := start(t, 64, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, req := range []*pb.GenerateRequest{
		{RequestId: "a", Prompt: []int32{1, 2}, MaxTokens: 2, ReplicaHolders: []string{"w2"}},
		{RequestId: "b", Prompt: []int32{1, 2}, MaxTokens: 2, Holder: "w2", ReplicaHolders: []string{"w2"}},
		{RequestId: "c", Prompt: []int32{1, 2}, MaxTokens: 2, Holder: "w2", ReplicaHolders: []string{"w3", "w3"}},
		{RequestId: "d", Prompt: []int32{1, 2}, MaxTokens: 2, Holder: "w2", ReplicaHolders: []string{"w3", "w4", "w5", "w6"}},
	} {
		if _, _, err := h.generate(ctx, req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: %v, want InvalidArgument", req.RequestId, err)
		}
	}
	if _, err := h.cl.SetHolder(ctx, &pb.SetHolderRequest{RequestId: "x", Epoch: 1, Holder: "w2", ReplicaHolders: []string{"w2"}}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("SetHolder naming the holder twice: %v, want InvalidArgument", err)
	}
}
