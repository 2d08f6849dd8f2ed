package controller

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	"github.com/hashicorp/serf/serf"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/gossip"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// glog/klog-free, but these long-lived library goroutines are
		// process-wide singletons, not per-node leaks.
		goleak.IgnoreTopFunction("github.com/hashicorp/go-metrics.(*InmemSignal).run"),
		goleak.IgnoreTopFunction("github.com/armon/go-metrics.(*InmemSignal).run"),
		goleak.IgnoreTopFunction("github.com/hashicorp/go-metrics.(*InmemSink).run"),
		goleak.IgnoreTopFunction("github.com/armon/go-metrics.(*InmemSink).run"),
	)
}

// testLogWriter routes logs to t.Log until the test ends.
type testLogWriter struct {
	t    testing.TB
	done atomic.Bool
}

func (w *testLogWriter) Write(p []byte) (int, error) {
	if !w.done.Load() {
		w.t.Log(string(p))
	}
	return len(p), nil
}

type cluster struct {
	t      testing.TB
	cfgs   []Config
	nodes  []*Node
	connMu sync.Mutex // guards conns
	conns  map[string]*grpc.ClientConn
	logw   *testLogWriter
}

// newCluster starts n replicas on loopback that bootstrap together.
func newCluster(t testing.TB, n int, tweak func(*Config)) *cluster {
	t.Helper()
	c := &cluster{t: t, conns: map[string]*grpc.ClientConn{}, logw: &testLogWriter{t: t}}
	var seed string
	for i := 0; i < n; i++ {
		cfg := DefaultConfig()
		cfg.NodeID = fmt.Sprintf("c%d", i)
		cfg.DataDir = t.TempDir()
		cfg.RaftAddr, cfg.GRPCAddr, cfg.SerfAddr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
		cfg.BootstrapExpect = n
		cfg.RequestTimeout = 3 * time.Second
		cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: "controller", Level: hclog.Warn, Output: c.logw})
		if seed != "" {
			cfg.Join = []string{seed}
		}
		if tweak != nil {
			tweak(&cfg)
		}
		node, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if seed == "" {
			seed = node.SerfAddr()
		}
		c.cfgs = append(c.cfgs, node.cfg)
		c.nodes = append(c.nodes, node)
	}
	t.Cleanup(c.close)
	c.waitLeader()
	return c
}

func (c *cluster) close() {
	for _, cc := range c.conns {
		cc.Close()
	}
	for _, n := range c.nodes {
		if n != nil {
			n.Shutdown()
		}
	}
	c.logw.done.Store(true)
}

// waitFor polls cond until it holds, failing the test after timeout.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (c *cluster) waitLeader() *Node {
	c.t.Helper()
	var leader *Node
	waitFor(c.t, 15*time.Second, "a ready leader", func() bool {
		for _, n := range c.nodes {
			if n != nil && n.IsLeader() {
				leader = n
				return true
			}
		}
		return false
	})
	return leader
}

func (c *cluster) index(n *Node) int {
	for i, m := range c.nodes {
		if m == n {
			return i
		}
	}
	return -1
}

func (c *cluster) follower() *Node {
	for _, n := range c.nodes {
		if n != nil && !n.IsLeader() {
			return n
		}
	}
	c.t.Fatal("no follower")
	return nil
}

func (c *cluster) conn(n *Node) *grpc.ClientConn {
	c.connMu.Lock()
	defer c.connMu.Unlock()
	addr := n.GRPCAddr()
	if cc, ok := c.conns[addr]; ok {
		return cc
	}
	cc, err := grpc.NewClient(addr, DialOptions(nil)...)
	if err != nil {
		c.t.Fatal(err)
	}
	c.conns[addr] = cc
	return cc
}

func (c *cluster) client(n *Node) pb.ControllerClient { return pb.NewControllerClient(c.conn(n)) }

func (c *cluster) stop(i int) {
	if err := c.nodes[i].Shutdown(); err != nil {
		c.t.Logf("shutdown %d: %v", i, err)
	}
	c.nodes[i] = nil
}

func (c *cluster) restart(i int) {
	cfg := c.cfgs[i]
	cfg.Join = nil
	for _, n := range c.nodes {
		if n != nil {
			cfg.Join = []string{n.SerfAddr()}
			break
		}
	}
	n, err := New(cfg)
	if err != nil {
		c.t.Fatal(err)
	}
	c.nodes[i] = n
}

// fakeWorker joins Serf as a worker and registers with the controller: the
// test double the real worker (a later issue) replaces.
type fakeWorker struct {
	id   string
	inc  uint64
	serf *serf.Serf
}

func (c *cluster) addWorker(id string, inc uint64, budget uint64) *fakeWorker {
	c.t.Helper()
	s, err := gossip.Start(gossip.Config{NodeName: id, BindAddr: "127.0.0.1:0",
		Tags: map[string]string{gossip.TagRole: gossip.RoleWorker, gossip.TagIncarnation: strconv.FormatUint(inc, 10)}})
	if err != nil {
		c.t.Fatal(err)
	}
	w := &fakeWorker{id: id, inc: inc, serf: s}
	c.t.Cleanup(func() { s.Shutdown() })
	for _, n := range c.nodes {
		if n != nil {
			if _, err := s.Join([]string{n.SerfAddr()}, true); err != nil {
				c.t.Fatal(err)
			}
			break
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = c.client(c.anyNode()).RegisterWorker(ctx, &pb.RegisterWorkerRequest{Worker: &pb.Worker{
		Id: id, Incarnation: inc, GrpcAddr: "127.0.0.1:1",
		Capacity: &pb.Capacity{KvPagesTotal: 1000, CheckpointBudgetBytes: budget, KvBytesPerToken: 1024,
			MaxContextTokens: 8192, H2DBytesPerSec: 25e9}}})
	if err != nil {
		c.t.Fatal(err)
	}
	return w
}

func (c *cluster) anyNode() *Node {
	for _, n := range c.nodes {
		if n != nil {
			return n
		}
	}
	return nil
}

func ctxT(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestWritesAndLinearizableReadsOnEveryReplica(t *testing.T) {
	c := newCluster(t, 3, nil)
	c.addWorker("w1", 1, 1<<30)
	c.addWorker("w2", 1, 1<<30)
	for i, n := range c.nodes {
		id := fmt.Sprintf("req-%d", i)
		resp, err := c.client(n).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: id, PromptTokens: 100, MaxTokens: 50})
		if err != nil {
			t.Fatalf("dispatch on %s (leader=%v): %v", n.ID(), n.IsLeader(), err)
		}
		if resp.Placement.WorkerId == "" || resp.Placement.HolderId == "" || resp.Placement.HolderId == resp.Placement.WorkerId {
			t.Fatalf("placement %v", resp.Placement)
		}
		// A linearizable read right after the write, on every replica.
		for _, m := range c.nodes {
			got, err := c.client(m).GetPlacement(ctxT(t, 5*time.Second), &pb.GetPlacementRequest{RequestId: id})
			if err != nil {
				t.Fatalf("read %s on %s: %v", id, m.ID(), err)
			}
			if got.Placement.WorkerId != resp.Placement.WorkerId {
				t.Fatalf("read %v, wrote %v", got.Placement, resp.Placement)
			}
		}
	}
	// A retried Dispatch on another replica returns the first answer.
	first, _ := c.client(c.nodes[0]).GetPlacement(ctxT(t, 5*time.Second), &pb.GetPlacementRequest{RequestId: "req-0"})
	again, err := c.client(c.nodes[2]).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "req-0", PromptTokens: 100, MaxTokens: 50})
	if err != nil || again.Placement.WorkerId != first.Placement.WorkerId || again.Placement.CreatedIndex != first.Placement.CreatedIndex {
		t.Fatalf("retried dispatch: %v %v", again, err)
	}
	// Stale reads on a follower converge.
	f := c.follower()
	waitFor(t, 5*time.Second, "stale read on a follower", func() bool {
		r, err := c.client(f).GetPlacement(ctxT(t, time.Second), &pb.GetPlacementRequest{RequestId: "req-2", Consistency: pb.Consistency_CONSISTENCY_STALE})
		return err == nil && r.AppliedIndex > 0
	})
	// Complete, then NotFound.
	cr, err := c.client(f).Complete(ctxT(t, 5*time.Second), &pb.CompleteRequest{RequestIds: []string{"req-0", "req-1", "never"}})
	if err != nil || cr.Completed != 2 || len(cr.NotFound) != 1 {
		t.Fatalf("complete: %v %v", cr, err)
	}
	_, err = c.client(f).GetPlacement(ctxT(t, 5*time.Second), &pb.GetPlacementRequest{RequestId: "req-0"})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("completed request read: %v", err)
	}
	ws, err := c.client(f).ListWorkers(ctxT(t, 5*time.Second), &pb.ListWorkersRequest{})
	if err != nil || len(ws.Workers) != 2 {
		t.Fatalf("list workers: %v %v", ws, err)
	}
}

func TestBadInput(t *testing.T) {
	c := newCluster(t, 1, func(cfg *Config) { cfg.BootstrapExpect = 1 })
	cl := c.client(c.nodes[0])
	// A restarted worker on its way back: not in full service, so "no
	// worker" below holds with it registered.
	reg := func(phase pb.WorkerPhase) error {
		_, err := cl.RegisterWorker(ctxT(t, 5*time.Second), &pb.RegisterWorkerRequest{Worker: &pb.Worker{
			Id: "d", Incarnation: 1, GrpcAddr: "127.0.0.1:1", Phase: phase,
			Capacity: &pb.Capacity{KvPagesTotal: 1000, KvBytesPerToken: 1024}}})
		return err
	}
	if err := reg(pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT); err != nil {
		t.Fatal(err)
	}
	setPhase := func(phase pb.WorkerPhase) (*pb.SetWorkerPhaseResponse, error) {
		return cl.SetWorkerPhase(ctxT(t, 5*time.Second), &pb.SetWorkerPhaseRequest{WorkerId: "d", Incarnation: 1, Phase: phase})
	}
	if r, err := setPhase(pb.WorkerPhase_WORKER_PHASE_ASSIST); err != nil || r.Worker.Phase != pb.WorkerPhase_WORKER_PHASE_ASSIST {
		t.Fatalf("SetWorkerPhase ASSIST: %v %v", r, err)
	}
	long := make([]byte, MaxRequestIDBytes+1)
	for i := range long {
		long[i] = 'x'
	}
	cases := []struct {
		name string
		call func() error
		code codes.Code
		msg  string
	}{
		{"empty id", func() error {
			_, err := cl.Dispatch(ctxT(t, time.Second), &pb.DispatchRequest{PromptTokens: 1, MaxTokens: 1})
			return err
		}, codes.InvalidArgument, "request_id must be 1..128 bytes"},
		{"long id", func() error {
			_, err := cl.Dispatch(ctxT(t, time.Second), &pb.DispatchRequest{RequestId: string(long), PromptTokens: 1, MaxTokens: 1})
			return err
		}, codes.InvalidArgument, "request_id must be 1..128 bytes, got 129"},
		{"id with space", func() error {
			_, err := cl.Dispatch(ctxT(t, time.Second), &pb.DispatchRequest{RequestId: "a b", PromptTokens: 1, MaxTokens: 1})
			return err
		}, codes.InvalidArgument, "byte 0x20"},
		{"zero prompt", func() error {
			_, err := cl.Dispatch(ctxT(t, time.Second), &pb.DispatchRequest{RequestId: "r", MaxTokens: 1})
			return err
		}, codes.InvalidArgument, "prompt_tokens 0 out of range"},
		{"huge max_tokens", func() error {
			_, err := cl.Dispatch(ctxT(t, time.Second), &pb.DispatchRequest{RequestId: "r", PromptTokens: 1, MaxTokens: MaxOutputTokens + 1})
			return err
		}, codes.InvalidArgument, "max_tokens 1048577 out of range"},
		{"no worker", func() error {
			_, err := cl.Dispatch(ctxT(t, time.Second), &pb.DispatchRequest{RequestId: "r", PromptTokens: 1, MaxTokens: 1})
			return err
		}, codes.FailedPrecondition, "no worker in full service"},
		{"unknown request", func() error {
			_, err := cl.GetPlacement(ctxT(t, time.Second), &pb.GetPlacementRequest{RequestId: "nope"})
			return err
		}, codes.NotFound, `no placement for request "nope"`},
		{"empty complete", func() error {
			_, err := cl.Complete(ctxT(t, time.Second), &pb.CompleteRequest{})
			return err
		}, codes.InvalidArgument, "request_ids has 0 ids"},
		{"unknown worker load", func() error {
			_, err := cl.ReportLoad(ctxT(t, time.Second), &pb.ReportLoadRequest{Load: &pb.LoadRecord{WorkerId: "ghost"}})
			return err
		}, codes.NotFound, "unknown worker"},
		{"bad worker id", func() error {
			_, err := cl.RegisterWorker(ctxT(t, time.Second), &pb.RegisterWorkerRequest{Worker: &pb.Worker{Id: "a/b", Incarnation: 1}})
			return err
		}, codes.InvalidArgument, "worker id \"a/b\""},
		{"register in ASSIST", func() error {
			return reg(pb.WorkerPhase_WORKER_PHASE_ASSIST)
		}, codes.InvalidArgument, "worker.phase WORKER_PHASE_ASSIST"},
		{"recovery phase backward", func() error {
			_, err := setPhase(pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT)
			return err
		}, codes.InvalidArgument, "cannot go back from ASSIST to LOADING_DRAFT"},
		{"bad strategy", func() error {
			_, err := pb.NewOperatorClient(c.conn(c.nodes[0])).SetStrategy(ctxT(t, time.Second), &pb.SetStrategyRequest{Strategy: 7})
			return err
		}, codes.InvalidArgument, "strategy 7 unknown"},
		{"too many checkpoint replicas", func() error {
			_, err := pb.NewOperatorClient(c.conn(c.nodes[0])).SetStrategy(ctxT(t, time.Second), &pb.SetStrategyRequest{CheckpointReplicas: 5})
			return err
		}, codes.InvalidArgument, "checkpoint_replicas 5: at most 4"},
	}
	for _, tc := range cases {
		err := tc.call()
		st, _ := status.FromError(err)
		if st.Code() != tc.code || !contains(st.Message(), tc.msg) {
			t.Errorf("%s: got %v %q, want %v containing %q", tc.name, st.Code(), st.Message(), tc.code, tc.msg)
		}
	}
}

func contains(s, sub string) bool {
	return len(sub) == 0 || (len(s) >= len(sub) && (s == sub || indexOf(s, sub) >= 0))
}

func indexOf(s, sub string) int {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return i
		}
	}
	return -1
}

func TestLeaderFailoverAndRestartFromDisk(t *testing.T) {
	c := newCluster(t, 3, nil)
	c.addWorker("w1", 1, 1<<30)
	c.addWorker("w2", 1, 1<<30)
	var acked []string
	write := func(n *Node, id string) error {
		_, err := c.client(n).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: id, PromptTokens: 10, MaxTokens: 10})
		if err == nil {
			acked = append(acked, id)
		}
		return err
	}
	for i := 0; i < 50; i++ {
		if err := write(c.nodes[i%3], fmt.Sprintf("a%03d", i)); err != nil {
			t.Fatal(err)
		}
	}
	old := c.waitLeader()
	oldTerm := old.term()
	killed := time.Now()
	c.stop(c.index(old))
	// A survivor serves writes once a new leader is elected.
	survivor := c.anyNode()
	waitFor(t, 10*time.Second, "a write after the leader died", func() bool {
		return write(survivor, fmt.Sprintf("b%03d", len(acked))) == nil
	})
	t.Logf("leader %s killed; next write after %s", old.ID(), time.Since(killed))
	nl := c.waitLeader()
	if nl.term() <= oldTerm {
		t.Fatalf("new leader term %d, old %d", nl.term(), oldTerm)
	}
	// Restart everything from disk: every acknowledged write is there.
	for i := range c.nodes {
		if c.nodes[i] != nil {
			c.stop(i)
		}
	}
	for i := range c.nodes {
		c.restart(i)
	}
	c.waitLeader()
	for _, id := range acked {
		if _, err := c.client(c.nodes[0]).GetPlacement(ctxT(t, 5*time.Second), &pb.GetPlacementRequest{RequestId: id}); err != nil {
			t.Fatalf("acknowledged %s lost after restart: %v", id, err)
		}
	}
}

func TestFiveReplicasSurviveTwoFailures(t *testing.T) {
	c := newCluster(t, 5, nil)
	c.addWorker("w1", 1, 1<<30)
	leader := c.waitLeader()
	c.stop(c.index(leader))
	c.stop(c.index(c.follower()))
	n := c.anyNode()
	waitFor(t, 10*time.Second, "a write with 3 of 5", func() bool {
		_, err := c.client(n).Dispatch(ctxT(t, 2*time.Second), &pb.DispatchRequest{RequestId: "x", PromptTokens: 1, MaxTokens: 1})
		return err == nil
	})
	for _, m := range c.nodes {
		if m == nil {
			continue
		}
		if _, err := c.client(m).GetPlacement(ctxT(t, 5*time.Second), &pb.GetPlacementRequest{RequestId: "x"}); err != nil {
			t.Fatalf("read on %s: %v", m.ID(), err)
		}
	}
}

func TestNoQuorumIsUnavailableBeforeDeadline(t *testing.T) {
	c := newCluster(t, 3, nil)
	c.addWorker("w1", 1, 1<<30)
	f := c.follower()
	for i := range c.nodes {
		if c.nodes[i] != f {
			c.stop(i)
		}
	}
	for _, call := range []func(ctx context.Context) error{
		func(ctx context.Context) error {
			_, err := c.client(f).Dispatch(ctx, &pb.DispatchRequest{RequestId: "q", PromptTokens: 1, MaxTokens: 1})
			return err
		},
		func(ctx context.Context) error {
			_, err := c.client(f).GetPlacement(ctx, &pb.GetPlacementRequest{RequestId: "q"})
			return err
		},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := call(ctx)
		cancel()
		if status.Code(err) != codes.Unavailable {
			t.Fatalf("without quorum: %v, want Unavailable", err)
		}
	}
	// Stale reads still work from the survivor.
	if _, err := c.client(f).ListWorkers(ctxT(t, time.Second), &pb.ListWorkersRequest{Consistency: pb.Consistency_CONSISTENCY_STALE}); err != nil {
		t.Fatalf("stale read without quorum: %v", err)
	}
}

func TestSnapshotInstallOnLaggingFollower(t *testing.T) {
	c := newCluster(t, 3, func(cfg *Config) {
		cfg.SnapshotThreshold, cfg.TrailingLogs, cfg.SnapshotInterval = 64, 16, 50*time.Millisecond
	})
	c.addWorker("w1", 1, 1<<30)
	leader := c.waitLeader()
	lag := c.index(c.follower())
	c.stop(lag)
	for i := 0; i < 300; i++ {
		if _, err := c.client(leader).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: fmt.Sprintf("s%03d", i), PromptTokens: 1, MaxTokens: 1}); err != nil {
			t.Fatal(err)
		}
	}
	if err := leader.Raft().Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	first, _ := leader.store.FirstIndex()
	if first <= 1 {
		t.Fatalf("leader log not compacted (first index %d)", first)
	}
	c.restart(lag)
	f := c.nodes[lag]
	want := leader.FSM().Applied()
	waitFor(t, 15*time.Second, "the lagging follower to catch up", func() bool { return f.FSM().Applied() >= want })
	if p, _ := f.FSM().Placement("s000"); p == nil {
		t.Fatal("snapshot did not carry early placements")
	}
	// Raft records the installed snapshot just after the FSM restores it.
	waitFor(t, 5*time.Second, "the follower to record an installed snapshot", func() bool {
		return f.raft.Stats()["last_snapshot_index"] != "0"
	})
}

func TestSerfFailureMarksWorkerAndPlansRecovery(t *testing.T) {
	c := newCluster(t, 3, nil)
	w1 := c.addWorker("w1", 1, 1<<30)
	c.addWorker("w2", 1, 1<<30)
	c.addWorker("w3", 1, 1<<30)
	leader := c.waitLeader()
	var onW1 []string
	for i := 0; i < 30; i++ {
		r, err := c.client(leader).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: fmt.Sprintf("r%02d", i), PromptTokens: 64, MaxTokens: 64})
		if err != nil {
			t.Fatal(err)
		}
		if r.Placement.WorkerId == "w1" {
			onW1 = append(onW1, r.Placement.RequestId)
		}
	}
	if len(onW1) == 0 {
		t.Fatal("nothing placed on w1")
	}
	// Watch from a follower, from the current index.
	f := c.follower()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	stream, err := c.client(f).WatchEvents(ctx, &pb.WatchEventsRequest{FromIndex: f.FSM().Applied()})
	if err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	w1.serf.Shutdown() // no leave: memberlist declares it failed
	var plan *pb.RecoveryPlan
	for plan == nil {
		ev, err := stream.Recv()
		if err != nil {
			t.Fatalf("watch: %v", err)
		}
		if rp := ev.GetRecoveryPlan(); rp != nil {
			plan = rp
		}
	}
	t.Logf("recovery plan %d for w1 after %s: %d assignments", plan.Id, time.Since(killed), len(plan.Assignments))
	if plan.FailedWorker != "w1" || len(plan.Assignments) != len(onW1) {
		t.Fatalf("plan %v, %d requests were on w1", plan, len(onW1))
	}
	for _, a := range plan.Assignments {
		p, err := c.client(f).GetPlacement(ctxT(t, 5*time.Second), &pb.GetPlacementRequest{RequestId: a.RequestId})
		if err != nil || p.Placement.WorkerId == "w1" || p.Placement.WorkerId != a.TargetWorker {
			t.Fatalf("placement after recovery %v %v", p, err)
		}
	}
	// w1's process, if it still ran, would learn from its next load report
	// that this incarnation is out of service (and rejoin).
	_, err = c.client(f).ReportLoad(ctxT(t, 5*time.Second), &pb.ReportLoadRequest{Load: &pb.LoadRecord{WorkerId: "w1", Incarnation: 1, KvPagesTotal: 100}})
	if status.Code(err) != codes.FailedPrecondition || ctlclient.Reason(err) != ctlclient.ReasonIncarnationFailed {
		t.Fatalf("load of the failed incarnation: %v (reason %q), want FailedPrecondition with %s", err, ctlclient.Reason(err), ctlclient.ReasonIncarnationFailed)
	}
	_, err = c.client(f).ReportLoad(ctxT(t, 5*time.Second), &pb.ReportLoadRequest{Load: &pb.LoadRecord{WorkerId: "w2", Incarnation: 0, KvPagesTotal: 100}})
	if status.Code(err) != codes.FailedPrecondition || ctlclient.Reason(err) != "" {
		t.Fatalf("load of a stale incarnation: %v (reason %q), want FailedPrecondition without a reason", err, ctlclient.Reason(err))
	}
}

func TestConcurrentWritesCoalesce(t *testing.T) {
	c := newCluster(t, 3, nil)
	c.addWorker("w1", 1, 1<<30)
	c.addWorker("w2", 1, 1<<30)
	f := c.follower()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := 0; g < 64; g++ {
		wg.Go(func() {
			for i := 0; i < 20; i++ {
				node := c.nodes[(g+i)%3]
				if _, err := c.client(node).Dispatch(ctxT(t, 10*time.Second), &pb.DispatchRequest{RequestId: fmt.Sprintf("g%d-%d", g, i), PromptTokens: 8, MaxTokens: 8}); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	leader := c.waitLeader()
	_, placements := leader.FSM().Counts()
	if placements != 64*20 {
		t.Fatalf("%d placements, want %d", placements, 64*20)
	}
	// raft.db's commits: at least one, at most one per entry written, and
	// every dispatch counted among the commands proposed.
	fsyncs := counterValue(t, leader.metrics.raftFsyncs.WithLabelValues("logs"))
	entries := counterValue(t, leader.metrics.raftLogEntries)
	var dispatched float64 // by whichever replica led (a lost proposal is retried: at least)
	for _, n := range c.nodes {
		dispatched += counterValue(t, n.metrics.proposedCommands.WithLabelValues("dispatch"))
	}
	if fsyncs < 1 || fsyncs > entries || dispatched < 64*20 {
		t.Fatalf("leader: %v log fsyncs for %v entries, %v dispatches proposed (want %d)", fsyncs, entries, dispatched, 64*20)
	}
	t.Logf("leader: %v log fsyncs, %v entries, %v dispatches", fsyncs, entries, dispatched)
	waitFor(t, 5*time.Second, "the follower to apply everything", func() bool {
		_, p := f.FSM().Counts()
		return p == 64*20
	})
	// Replicas converge to byte-identical state.
	waitFor(t, 5*time.Second, "identical replica state", func() bool {
		a, _ := c.nodes[0].FSM().MarshalSnapshot()
		for _, n := range c.nodes[1:] {
			if b, _ := n.FSM().MarshalSnapshot(); !bytes.Equal(a, b) {
				return false
			}
		}
		return true
	})
}

func TestGracefulLeave(t *testing.T) {
	c := newCluster(t, 3, nil)
	leader := c.waitLeader()
	i := c.index(leader)
	if err := leader.Leave(ctxT(t, 10*time.Second)); err != nil {
		t.Fatalf("leave: %v", err)
	}
	c.nodes[i] = nil
	n := c.waitLeader()
	waitFor(t, 10*time.Second, "a 2-voter configuration", func() bool {
		f := n.Raft().GetConfiguration()
		return f.Error() == nil && len(f.Configuration().Servers) == 2
	})
	// The two left still commit: a quorum of 2.
	c.addWorker("w1", 1, 1<<30)
}

func TestReportUnreachableProbesAndMarksFailed(t *testing.T) {
	c := newCluster(t, 3, nil)
	// w-live answers health checks; w-dead's address refuses connections.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	go srv.Serve(lis)
	defer srv.Stop()
	dead, _ := net.Listen("tcp", "127.0.0.1:0")
	deadAddr := dead.Addr().String()
	dead.Close()
	f := c.follower()
	for id, addr := range map[string]string{"w-live": lis.Addr().String(), "w-dead": deadAddr} {
		if _, err := c.client(f).RegisterWorker(ctxT(t, 5*time.Second), &pb.RegisterWorkerRequest{Worker: &pb.Worker{
			Id: id, Incarnation: 1, GrpcAddr: addr, Capacity: &pb.Capacity{KvPagesTotal: 100, KvBytesPerToken: 1, CheckpointBudgetBytes: 1 << 20}}}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.client(f).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "r", PromptTokens: 1, MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	r, err := c.client(f).ReportUnreachable(ctxT(t, 5*time.Second), &pb.ReportUnreachableRequest{WorkerId: "w-live", Reporter: "test"})
	if err != nil || r.MarkedFailed {
		t.Fatalf("a live worker was marked failed: %v %v", r, err)
	}
	start := time.Now()
	r, err = c.client(f).ReportUnreachable(ctxT(t, 5*time.Second), &pb.ReportUnreachableRequest{WorkerId: "w-dead", Reporter: "test"})
	if err != nil || !r.MarkedFailed || r.ProbeError == "" {
		t.Fatalf("a dead worker was not marked failed: %v %v", r, err)
	}
	t.Logf("dead worker marked failed %s after the report (probe: %s)", time.Since(start), r.ProbeError)
	if w := c.waitLeader().FSM().Worker("w-dead"); w.Phase != pb.WorkerPhase_WORKER_PHASE_FAILED {
		t.Fatalf("w-dead is %v", w.Phase)
	}
	if w := c.waitLeader().FSM().Worker("w-live"); w.Phase != pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
		t.Fatalf("w-live is %v", w.Phase)
	}
}

// TestRemovedVoterCanBeAddedBack: the leader is removed from the
// configuration and added back; then another replica stops, and the quorum
// (which needs the re-added one) still commits. With raft's default
// ShutdownOnRemove the removed replica stopped Raft, came back as a dead
// voter, and this lost the quorum (jepsen's membership nemesis found it).
func TestRemovedVoterCanBeAddedBack(t *testing.T) {
	c := newCluster(t, 3, nil)
	c.addWorker("w1", 1, 1<<30)
	leader := c.waitLeader()
	op := pb.NewOperatorClient(c.conn(leader))
	if _, err := op.RemovePeer(ctxT(t, 5*time.Second), &pb.RemovePeerRequest{Id: leader.ID()}); err != nil {
		t.Fatal(err)
	}
	next := c.waitLeader()
	for next == leader {
		next = c.waitLeader()
	}
	if _, err := pb.NewOperatorClient(c.conn(next)).AddVoter(ctxT(t, 5*time.Second),
		&pb.AddVoterRequest{Id: leader.ID(), RaftAddr: leader.RaftAddr()}); err != nil {
		t.Fatal(err)
	}
	// Let the re-added replica catch up, then stop the third one.
	waitFor(t, 10*time.Second, "the re-added replica to catch up", func() bool {
		return leader.FSM().Applied() >= next.FSM().Applied()
	})
	for i, n := range c.nodes {
		if n != leader && n != next {
			c.stop(i)
		}
	}
	if _, err := c.client(next).Dispatch(ctxT(t, 10*time.Second), &pb.DispatchRequest{RequestId: "after", PromptTokens: 8, MaxTokens: 8}); err != nil {
		t.Fatalf("no commit with the re-added voter and the leader: %v", err)
	}
}

// A replica replaced by one with an empty data directory, started with the
// same flags (-bootstrap-expect included), joins the running cluster as a
// voter instead of bootstrapping a configuration of its own: its log agrees
// with the leader's from index 1 (Raft's log matching), and it serves the
// cluster's state.
func TestReplacementReplicaDoesNotBootstrap(t *testing.T) {
	c := newCluster(t, 3, nil)
	c.addWorker("w1", 1, 1<<30)
	leader := c.waitLeader()
	if _, err := c.client(leader).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "before", PromptTokens: 8, MaxTokens: 8}); err != nil {
		t.Fatal(err)
	}
	// The machine of a follower is decommissioned (it leaves the quorum and
	// Serf) and replaced: same id and flags, new addresses, no state.
	victim := c.index(c.follower())
	if err := c.nodes[victim].Leave(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	c.nodes[victim] = nil
	cfg := c.cfgs[victim]
	cfg.DataDir = t.TempDir()
	cfg.RaftAddr, cfg.GRPCAddr, cfg.SerfAddr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.Join = []string{leader.SerfAddr()}
	n, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	c.nodes[victim] = n
	waitFor(t, 15*time.Second, "the replacement to be a voter holding the cluster's state", func() bool {
		p, _ := n.FSM().Placement("before")
		return p != nil && n.FSM().Applied() >= leader.FSM().Applied()
	})
	n.mu.Lock()
	bootstrapped := n.bootstrapped
	n.mu.Unlock()
	if bootstrapped {
		t.Fatal("the replacement bootstrapped a cluster of its own beside the running one")
	}
	var mine, theirs raft.Log
	if err := n.store.GetLog(1, &mine); err != nil {
		t.Fatal(err)
	}
	if err := leader.store.GetLog(1, &theirs); err != nil {
		t.Fatal(err)
	}
	if mine.Term != theirs.Term || !bytes.Equal(mine.Data, theirs.Data) {
		t.Fatalf("the replacement's log entry 1 (term %d) is not the leader's (term %d): it bootstrapped a configuration of its own", mine.Term, theirs.Term)
	}
}

// TestFailedStartReturnsError: a replica that cannot start (its gRPC port is
// taken, as when a restarted controller's port went to another process)
// returns an error and releases what it opened, instead of panicking in its
// own cleanup.
func TestFailedStartReturnsError(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	cfg := DefaultConfig()
	cfg.NodeID = "c0"
	cfg.DataDir = t.TempDir()
	cfg.RaftAddr, cfg.GRPCAddr, cfg.SerfAddr = "127.0.0.1:0", taken.Addr().String(), "127.0.0.1:0"
	cfg.BootstrapExpect = 1
	cfg.Logger = hclog.NewNullLogger()
	n, err := New(cfg)
	if err == nil {
		n.Shutdown()
		t.Fatal("New succeeded on a taken gRPC port")
	}
	if n != nil || !strings.Contains(err.Error(), taken.Addr().String()) {
		t.Fatalf("New = %v, %v; want nil and an error naming %s", n, err, taken.Addr())
	}
}
