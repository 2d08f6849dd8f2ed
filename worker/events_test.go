package worker

import (
	"context"
	"io"
	"math/rand"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/lumen-project/lumen/controller"
	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// cutter is a TCP proxy that can be cut — every connection closed and none
// accepted, as a network partition does — and healed towards a target.
type cutter struct {
	addr   string
	mu     sync.Mutex // guards lis, target, conns
	lis    net.Listener
	target string
	conns  []net.Conn
	wg     sync.WaitGroup
}

func newCutter(t *testing.T, target string) *cutter {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &cutter{addr: lis.Addr().String(), target: target}
	c.serve(lis)
	t.Cleanup(func() { c.cut(); c.wg.Wait() })
	return c
}

func (c *cutter) serve(lis net.Listener) {
	c.mu.Lock()
	c.lis = lis
	c.mu.Unlock()
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		for {
			down, err := lis.Accept()
			if err != nil {
				return
			}
			c.mu.Lock()
			target := c.target
			c.mu.Unlock()
			up, err := net.Dial("tcp", target)
			if err != nil {
				down.Close()
				continue
			}
			c.mu.Lock()
			c.conns = append(c.conns, down, up)
			c.mu.Unlock()
			for _, p := range [][2]net.Conn{{down, up}, {up, down}} {
				c.wg.Add(1)
				go func() {
					defer c.wg.Done()
					_, _ = io.Copy(p[0], p[1])
					p[0].Close()
					p[1].Close()
				}()
			}
		}
	}()
}

// cut closes every connection and stops accepting.
func (c *cutter) cut() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.lis != nil {
		c.lis.Close()
		c.lis = nil
	}
	for _, conn := range c.conns {
		conn.Close()
	}
	c.conns = nil
}

// heal accepts again, on the same address, towards target.
func (c *cutter) heal(t *testing.T, target string) {
	t.Helper()
	lis, err := net.Listen("tcp", c.addr)
	if err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	c.target = target
	c.mu.Unlock()
	c.serve(lis)
}

// TestWorkerDrainsAfterMissingItsDrainingEvent: a worker cut off from the
// controller while an operator drains it misses the DRAINING event for
// good — the controller, restarted from a snapshot taken since, no longer
// keeps it, and the watch starts again from now (OutOfRange). The worker
// reads its own row when its watch starts, drains and leaves (LEFT), as
// `lumen worker drain -follow` waits for.
func TestWorkerDrainsAfterMissingItsDrainingEvent(t *testing.T) {
	cfg := controller.DefaultConfig()
	cfg.NodeID, cfg.DataDir, cfg.BootstrapExpect = "c0", t.TempDir(), 1
	cfg.RaftAddr, cfg.GRPCAddr, cfg.SerfAddr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.Logger = hclog.NewNullLogger()
	n, err := controller.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = n.Shutdown() }()
	client := func(n *controller.Node) *ctlclient.Client {
		cl, err := ctlclient.New([]string{n.GRPCAddr()}, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cl.Close)
		return cl
	}
	ctl := client(n)
	link := newCutter(t, n.GRPCAddr())
	h := start(t, 256, func(wc *Config) {
		syntheticTarget(wc)
		wc.ID, wc.Controllers = "w1", []string{link.addr}
	})
	w := h.w
	waitUntil(t, 20*time.Second, "the worker registered", func() bool {
		r := row(t, ctl, "w1")
		return r != nil && r.Incarnation == w.Incarnation()
	})
	link.cut()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := ctl.SetWorkerPhase(ctx, &pb.SetWorkerPhaseRequest{WorkerId: "w1", Incarnation: w.Incarnation(),
		Phase: pb.WorkerPhase_WORKER_PHASE_DRAINING, Reason: "operator drain"}); err != nil {
		t.Fatal(err)
	}
	// The controller restarts from a snapshot past the DRAINING: its
	// events before the snapshot are gone.
	if err := n.Raft().Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	if err := n.Shutdown(); err != nil {
		t.Fatal(err)
	}
	cfg.RaftAddr = n.RaftAddr()
	if n, err = controller.New(cfg); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 20*time.Second, "the restarted controller to lead", n.IsLeader)
	ctl = client(n)
	if w.isLeaving() {
		t.Fatal("the worker drained while cut off")
	}
	link.heal(t, n.GRPCAddr())
	select {
	case <-w.Exited():
	case <-time.After(20 * time.Second):
		t.Fatal("the worker did not drain and leave: it missed its DRAINING event and never read its phase")
	}
	waitUntil(t, 10*time.Second, "w1 LEFT in the table", func() bool {
		return row(t, ctl, "w1").GetPhase() == pb.WorkerPhase_WORKER_PHASE_LEFT
	})
}

// TestDestinationFreesPagesOnAbort: the source of a migration dies after
// its first stage (its stream ends without an end message), and the
// controller aborts the migration (here the request completes, its client
// having lost the source): the destination frees the pages and the running
// slot at once, on the ABORTED event that names it as the destination —
// not after MigrationTimeout (ten minutes here).
func TestDestinationFreesPagesOnAbort(t *testing.T) {
	c := startCluster(t, func(wc *Config) {
		syntheticTarget(wc)
		wc.MigrationTimeout = 10 * time.Minute
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// The source is a worker in the table only: the test speaks for it.
	if _, err := c.ctl.RegisterWorker(ctx, &pb.RegisterWorkerRequest{Worker: &pb.Worker{Id: "w9", Incarnation: 1,
		GrpcAddr: "127.0.0.1:1", Phase: pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE,
		Capacity: &pb.Capacity{KvPagesTotal: 1000, KvBytesPerToken: 1024, MaxContextTokens: 8192}}}); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewSource(71))
	prompt := randomPrompt(rng, 3*engine.PageTokens+5)
	const id = "mig-abort"
	resp, err := c.ctl.Dispatch(ctx, &pb.DispatchRequest{RequestId: id, PromptTokens: uint32(len(prompt)), MaxTokens: 16,
		WorkerId: "w9", WorkerIncarnation: 1})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Placement.WorkerId != "w9" {
		t.Fatalf("placed on %s, want w9", resp.Placement.WorkerId)
	}
	mp, err := c.migrate(id, "w2")
	if err != nil {
		t.Fatal(err)
	}
	// The source's first stage: three full pages of the prompt.
	src, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 64})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := src.Forward(ctx, []engine.Chunk{{Seq: 1, Tokens: prompt, Sample: 1}}); err != nil {
		t.Fatal(err)
	}
	stage := &pb.MigrationStage{RequestId: id, Epoch: mp.Epoch, FromWorker: "w9", FromIncarnation: 1, Stage: 1,
		PrefixHashes: core.PageHashes(prompt[:3*engine.PageTokens], nil)}
	for i := range 3 {
		page, err := src.ExportPage(1, i)
		if err != nil {
			t.Fatal(err)
		}
		stage.Pages = append(stage.Pages, page)
	}
	dst := c.workers["w2"]
	freeBefore := dst.w.cfg.Engine.FreePages()
	sctx, scancel := context.WithCancel(ctx)
	stream, err := dst.cl.Migrate(sctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&pb.MigrateMessage{Body: &pb.MigrateMessage_Stage{Stage: stage}}); err != nil {
		t.Fatal(err)
	}
	ack, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if ack.Refusal != pb.MigrateRefusal_MIGRATE_REFUSAL_UNSPECIFIED || ack.PagesHeld != 3 {
		t.Fatalf("the destination answered %v, want 3 pages held", ack)
	}
	incoming := func() int {
		n := -1
		dst.w.sched.do(ctx, func() { n = dst.w.sched.core.Incoming() })
		return n
	}
	if incoming() != 1 || dst.w.cfg.Engine.FreePages() != freeBefore-3 {
		t.Fatalf("the destination holds %d pre-allocations and %d fewer free pages, want 1 and 3", incoming(), freeBefore-dst.w.cfg.Engine.FreePages())
	}
	scancel() // the source dies: no end message
	if _, err := c.ctl.Complete(ctx, &pb.CompleteRequest{RequestIds: []string{id}}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, "the destination to free the pre-allocation", func() bool {
		return incoming() == 0 && dst.w.cfg.Engine.FreePages() == freeBefore
	})
	if n := counterValue(dst.w.metrics.migrationsIn.WithLabelValues("aborted")); n != 1 {
		t.Errorf("%v migrations in counted aborted, want 1", n)
	}
}
