package controller

import (
	"math"
	"net"
	"testing"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// gauge is the value of name's series with label=value in n's registry
// (any series when label is empty), and whether there is one.
func gauge(t *testing.T, n *Node, name, label, value string) (float64, bool) {
	t.Helper()
	fams, err := n.metrics.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			ok := label == ""
			for _, l := range m.GetLabel() {
				ok = ok || (l.GetName() == label && l.GetValue() == value)
			}
			if !ok {
				continue
			}
			switch {
			case m.GetGauge() != nil:
				return m.GetGauge().GetValue(), true
			case m.GetCounter() != nil:
				return m.GetCounter().GetValue(), true
			}
		}
	}
	return 0, false
}

// TestTableAndRecoveryMetrics: a replica exports each worker's checkpoint
// budget and the bytes reserved on it as the table has them, its Raft
// term, and counts a committed recovery plan and its requests by mode.
func TestTableAndRecoveryMetrics(t *testing.T) {
	c := newCluster(t, 1, nil)
	n := c.waitLeader()
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadAddr := dead.Addr().String()
	dead.Close()
	budgets := map[string]uint64{"w-a": 64 << 20, "w-b": 128 << 20}
	for id, b := range budgets {
		if _, err := c.client(n).RegisterWorker(ctxT(t, 5*time.Second), &pb.RegisterWorkerRequest{Worker: &pb.Worker{
			Id: id, Incarnation: 1, GrpcAddr: deadAddr, Node: "node-1", Capacity: &pb.Capacity{KvPagesTotal: 1000, KvBytesPerToken: 1024, CheckpointBudgetBytes: b,
				MaxContextTokens: 8192, H2DBytesPerSec: 25e9}}}); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := c.client(n).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "r", PromptTokens: 100, MaxTokens: 100})
	if err != nil {
		t.Fatal(err)
	}
	pl := resp.Placement
	for id, b := range budgets {
		if v, ok := gauge(t, n, "lumen_controller_worker_checkpoint_budget_bytes", "worker", id); !ok || v != float64(b) {
			t.Errorf("%s: budget gauge %v (exported %v), want %d", id, v, ok, b)
		}
	}
	if pl.HolderId == "" {
		t.Fatalf("no holder: %v", resp)
	}
	if v, _ := gauge(t, n, "lumen_controller_worker_checkpoint_reserved_bytes", "worker", pl.HolderId); v != float64(pl.ReservedBytes) {
		t.Errorf("reserved on the holder %s: gauge %v, placement %d", pl.HolderId, v, pl.ReservedBytes)
	}
	// Both workers are on node-1: the only holder shares the serving
	// worker's node, and the counter says so.
	if v, ok := gauge(t, n, "lumen_controller_checkpoint_same_domain_total", "", ""); !ok || v != 1 {
		t.Errorf("same-domain placements: %v (exported %v), want 1", v, ok)
	}
	waitFor(t, 5*time.Second, "the Raft term gauge", func() bool {
		v, _ := gauge(t, n, "lumen_controller_raft_term", "", "")
		return v >= 1
	})
	r, err := c.client(n).ReportUnreachable(ctxT(t, 5*time.Second), &pb.ReportUnreachableRequest{WorkerId: pl.WorkerId, Reporter: "test"})
	if err != nil || !r.MarkedFailed {
		t.Fatalf("%s was not marked failed: %v %v", pl.WorkerId, r, err)
	}
	waitFor(t, 5*time.Second, "one recovery plan counted", func() bool {
		v, _ := gauge(t, n, "lumen_controller_recovery_plans_total", "", "")
		return v == 1
	})
	reuse, _ := gauge(t, n, "lumen_controller_recovery_requests_total", "mode", "REUSE")
	recompute, _ := gauge(t, n, "lumen_controller_recovery_requests_total", "mode", "RECOMPUTE")
	if reuse+recompute != 1 {
		t.Fatalf("recovered requests by mode: REUSE %v, RECOMPUTE %v; want one in all", reuse, recompute)
	}
}

// TestFreenessMetrics: a replica exports Llumnix's autoscaling signal —
// the mean freeness of the workers in full service and their number —
// from the load reports it applied: a loading worker and, once its drain
// starts, a draining one are left out, and with none in full service the
// mean is absent (no value an autoscaler could act on).
func TestFreenessMetrics(t *testing.T) {
	c := newCluster(t, 1, func(cfg *Config) { cfg.BootstrapExpect = 1 })
	n := c.waitLeader()
	cl := c.client(n)
	if _, ok := gauge(t, n, "lumen_cluster_freeness_mean", "", ""); ok {
		t.Error("lumen_cluster_freeness_mean exported without a worker")
	}
	if v, ok := gauge(t, n, "lumen_cluster_freeness_workers", "", ""); !ok || v != 0 {
		t.Errorf("lumen_cluster_freeness_workers %v (exported %v) without a worker, want 0", v, ok)
	}
	for id, phase := range map[string]pb.WorkerPhase{"w1": pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, "w2": pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE,
		"w3": pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT} {
		if _, err := cl.RegisterWorker(ctxT(t, 5*time.Second), &pb.RegisterWorkerRequest{Worker: &pb.Worker{Id: id, Incarnation: 1,
			GrpcAddr: "127.0.0.1:1", Phase: phase, Capacity: &pb.Capacity{KvPagesTotal: 1000, KvBytesPerToken: 1024}}}); err != nil {
			t.Fatal(err)
		}
	}
	for _, l := range []*pb.LoadRecord{
		// (1000 - 400) / 2 running = 300.
		{WorkerId: "w1", Incarnation: 1, KvPagesTotal: 1000, KvPagesUsed: 400, Running: 2},
		// (1000 - 100 - the head's 50) / (1 running + 2 waiting) = 283.3.
		{WorkerId: "w2", Incarnation: 1, KvPagesTotal: 1000, KvPagesUsed: 100, Running: 1, Waiting: 2, QueueHeadPages: 50},
		// Loading: not counted, however free.
		{WorkerId: "w3", Incarnation: 1, KvPagesTotal: 1000},
	} {
		if _, err := cl.ReportLoad(ctxT(t, 5*time.Second), &pb.ReportLoadRequest{Load: l}); err != nil {
			t.Fatal(err)
		}
	}
	want := (300 + 850.0/3) / 2
	if v, ok := gauge(t, n, "lumen_cluster_freeness_mean", "", ""); !ok || math.Abs(v-want) > 1e-9 {
		t.Errorf("lumen_cluster_freeness_mean %v (exported %v), want %v", v, ok, want)
	}
	if v, _ := gauge(t, n, "lumen_cluster_freeness_workers", "", ""); v != 2 {
		t.Errorf("lumen_cluster_freeness_workers %v, want 2 (w3 is loading)", v)
	}
	if v, ok := gauge(t, n, "lumen_controller_worker_freeness", "worker", "w1"); !ok || v != 300 {
		t.Errorf("w1's freeness %v (exported %v), want 300", v, ok)
	}
	if _, err := cl.SetWorkerPhase(ctxT(t, 5*time.Second), &pb.SetWorkerPhaseRequest{WorkerId: "w2", Incarnation: 1,
		Phase: pb.WorkerPhase_WORKER_PHASE_DRAINING, Reason: "scale-down"}); err != nil {
		t.Fatal(err)
	}
	if v, _ := gauge(t, n, "lumen_cluster_freeness_mean", "", ""); v != 300 {
		t.Errorf("lumen_cluster_freeness_mean %v with w2 draining, want w1's 300", v)
	}
	if v, _ := gauge(t, n, "lumen_cluster_freeness_workers", "", ""); v != 1 {
		t.Errorf("lumen_cluster_freeness_workers %v with w2 draining, want 1", v)
	}
}
