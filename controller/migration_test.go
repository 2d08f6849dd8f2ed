package controller

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// migrationCount reads lumen_controller_migrations_total{stage, cause} from
// a replica's registry.
func migrationCount(t testing.TB, n *Node, stage, cause string) float64 {
	t.Helper()
	fams, err := n.metrics.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != "lumen_controller_migrations_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			if got["stage"] == stage && got["cause"] == cause {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// migrationEvents follows one replica's events from index from and sends
// each Migration on the channel until the test ends.
func migrationEvents(t *testing.T, c *cluster, n *Node) <-chan *pb.Migration {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	stream, err := c.client(n).WatchEvents(ctx, &pb.WatchEventsRequest{FromIndex: n.fsm.Applied()})
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan *pb.Migration, 256)
	go func() {
		defer close(out)
		for {
			ev, err := stream.Recv()
			if err != nil {
				return
			}
			if m := ev.GetMigration(); m != nil {
				select {
				case out <- m:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return out
}

// next waits for the next Migration event.
func next(t *testing.T, evs <-chan *pb.Migration, what string) *pb.Migration {
	t.Helper()
	select {
	case m, ok := <-evs:
		if !ok {
			t.Fatalf("event stream ended waiting for %s", what)
		}
		return m
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
	return nil
}

func reportLoad(t *testing.T, cl pb.ControllerClient, id string, used uint64, running uint32) {
	t.Helper()
	if _, err := cl.ReportLoad(ctxT(t, 5*time.Second), &pb.ReportLoadRequest{Load: &pb.LoadRecord{
		WorkerId: id, Incarnation: 1, KvPagesTotal: 1000, KvPagesUsed: used, Running: running}}); err != nil {
		t.Fatal(err)
	}
}

func wantRefusal(t *testing.T, err error, code codes.Code, reason string, words ...string) {
	t.Helper()
	if status.Code(err) != code || ctlclient.Reason(err) != reason {
		t.Fatalf("error %v (reason %q), want %s with reason %q", err, ctlclient.Reason(err), code, reason)
	}
	for _, w := range words {
		if !strings.Contains(status.Convert(err).Message(), w) {
			t.Fatalf("error %q does not say %q", status.Convert(err).Message(), w)
		}
	}
}

// TestMigrateAndFinishMigrationRPCs: an operator's migration and a
// worker's commit and abort, through followers (forwarded) and the leader,
// with every refusal the data path relies on.
func TestMigrateAndFinishMigrationRPCs(t *testing.T) {
	c := newCluster(t, 3, nil)
	for _, id := range []string{"w1", "w2", "w3"} {
		c.addWorker(id, 1, 1<<30)
	}
	f, leader := c.follower(), c.waitLeader()
	cl := c.client(f)
	op := pb.NewOperatorClient(c.conn(f))
	evs := migrationEvents(t, c, leader)
	// w1 is the freest: r1 runs there; w2 is the freest after it.
	reportLoad(t, cl, "w1", 100, 1)
	reportLoad(t, cl, "w2", 300, 1)
	reportLoad(t, cl, "w3", 900, 1)
	d, err := cl.Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "r1", PromptTokens: 100, MaxTokens: 50})
	if err != nil || d.Placement.WorkerId != "w1" {
		t.Fatalf("dispatch: %v %v", d, err)
	}

	st, err := op.ClusterStatus(ctxT(t, 5*time.Second), &pb.ClusterStatusRequest{})
	if err != nil || st.Migration != pb.MigrationMode_MIGRATION_MODE_OFF {
		t.Fatalf("status: %v %v", st, err)
	}

	// No destination named: the freest other worker.
	m, err := op.Migrate(ctxT(t, 5*time.Second), &pb.MigrateRequest{RequestId: "r1"})
	if err != nil {
		t.Fatal(err)
	}
	p := m.Placement
	if p.State != pb.PlacementState_PLACEMENT_STATE_MIGRATING || p.WorkerId != "w1" || p.MigrationTarget != "w2" || p.MigrationTargetIncarnation != 1 || p.Epoch != 0 {
		t.Fatalf("after Migrate: %v", p)
	}
	if ev := next(t, evs, "STARTED"); ev.Stage != pb.Migration_STAGE_STARTED || ev.FromWorker != "w1" || ev.ToWorker != "w2" || ev.Reason != "operator" {
		t.Fatalf("event %v", ev)
	}
	ws, err := cl.ListWorkers(ctxT(t, 5*time.Second), &pb.ListWorkersRequest{})
	if err != nil || len(ws.Migrations) != 2 || ws.Migrations[0].Out != 1 || ws.Migrations[1].In != 1 {
		t.Fatalf("migrations in flight: %v %v", ws.GetMigrations(), err)
	}

	// Refusals.
	_, err = op.Migrate(ctxT(t, 5*time.Second), &pb.MigrateRequest{RequestId: "r1", ToWorker: "w3"})
	wantRefusal(t, err, codes.FailedPrecondition, ctlclient.ReasonPlacementState, "MIGRATING to w2")
	_, err = op.Migrate(ctxT(t, 5*time.Second), &pb.MigrateRequest{RequestId: "nope"})
	wantRefusal(t, err, codes.NotFound, "", "nope")
	_, err = op.Migrate(ctxT(t, 5*time.Second), &pb.MigrateRequest{RequestId: "r1", ToWorker: "bad id"})
	wantRefusal(t, err, codes.InvalidArgument, "", "to_worker")
	finish := func(epoch uint64, to string, inc uint64, commit bool, reason string) (*pb.FinishMigrationResponse, error) {
		return cl.FinishMigration(ctxT(t, 5*time.Second), &pb.FinishMigrationRequest{RequestId: "r1", Epoch: epoch,
			ToWorker: to, ToIncarnation: inc, Commit: commit, Reason: reason})
	}
	_, err = finish(0, "", 1, true, "")
	wantRefusal(t, err, codes.InvalidArgument, "", "to_worker")
	_, err = finish(0, "w2", 0, true, "")
	wantRefusal(t, err, codes.InvalidArgument, "", "to_incarnation")
	_, err = finish(0, "w2", 1, true, strings.Repeat("x", MaxReasonBytes+1))
	wantRefusal(t, err, codes.InvalidArgument, "", "reason")
	_, err = finish(1, "w2", 1, true, "")
	wantRefusal(t, err, codes.FailedPrecondition, ctlclient.ReasonStaleEpoch, "epoch 0", "epoch 1")
	if !ctlclient.MigrationOver(err) {
		t.Fatal("a stale epoch does not say the migration is over")
	}
	_, err = finish(0, "w3", 1, true, "")
	wantRefusal(t, err, codes.FailedPrecondition, ctlclient.ReasonStaleMigration, "not to w3")

	// The commit, and its retry.
	r, err := finish(0, "w2", 1, true, "copied")
	if err != nil {
		t.Fatal(err)
	}
	if q := r.Placement; q.WorkerId != "w2" || q.Epoch != 1 || q.State != pb.PlacementState_PLACEMENT_STATE_RUNNING || q.MigrationTarget != "" {
		t.Fatalf("after the commit: %v", q)
	}
	if ev := next(t, evs, "COMMITTED"); ev.Stage != pb.Migration_STAGE_COMMITTED || ev.Placement.Epoch != 1 || ev.Reason != "copied" {
		t.Fatalf("event %v", ev)
	}
	if again, err := finish(0, "w2", 1, true, "copied"); err != nil || again.Placement.Epoch != 1 {
		t.Fatalf("retried commit: %v %v", again, err)
	}
	g, err := cl.GetPlacement(ctxT(t, 5*time.Second), &pb.GetPlacementRequest{RequestId: "r1"})
	if err != nil || g.Placement.WorkerId != "w2" || g.Placement.Epoch != 1 {
		t.Fatalf("read after the commit: %v %v", g, err)
	}

	// A second migration, aborted by its destination.
	if _, err := op.Migrate(ctxT(t, 5*time.Second), &pb.MigrateRequest{RequestId: "r1", ToWorker: "w3"}); err != nil {
		t.Fatal(err)
	}
	next(t, evs, "STARTED")
	r, err = finish(1, "w3", 1, false, "destination out of KV pages")
	if err != nil || r.Placement.WorkerId != "w2" || r.Placement.State != pb.PlacementState_PLACEMENT_STATE_RUNNING || r.Placement.Epoch != 1 {
		t.Fatalf("abort: %v %v", r, err)
	}
	if ev := next(t, evs, "ABORTED"); ev.Stage != pb.Migration_STAGE_ABORTED || ev.Reason != "destination out of KV pages" {
		t.Fatalf("event %v", ev)
	}
	_, err = finish(1, "w3", 1, true, "")
	wantRefusal(t, err, codes.FailedPrecondition, ctlclient.ReasonPlacementState, "not MIGRATING")
	_, err = op.Migrate(ctxT(t, 5*time.Second), &pb.MigrateRequest{RequestId: "r1", ToWorker: "w2"})
	wantRefusal(t, err, codes.InvalidArgument, "", "already runs on w2")
	if _, err := cl.Complete(ctxT(t, 5*time.Second), &pb.CompleteRequest{RequestIds: []string{"r1"}}); err != nil {
		t.Fatal(err)
	}
	_, err = op.Migrate(ctxT(t, 5*time.Second), &pb.MigrateRequest{RequestId: "r1"})
	wantRefusal(t, err, codes.FailedPrecondition, ctlclient.ReasonCompleted)

	// Every replica counted them from its own log.
	for _, n := range c.nodes {
		waitFor(t, 5*time.Second, "migration metrics on "+n.ID(), func() bool {
			return migrationCount(t, n, "started", "operator") == 2 && migrationCount(t, n, "committed", "committed") == 1 &&
				migrationCount(t, n, "aborted", "worker") == 1
		})
	}

	// The switch.
	if _, err := op.SetStrategy(ctxT(t, 5*time.Second), &pb.SetStrategyRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("an empty SetStrategy: %v", err)
	}
	if _, err := op.SetStrategy(ctxT(t, 5*time.Second), &pb.SetStrategyRequest{Migration: pb.MigrationMode_MIGRATION_MODE_ON}); err != nil {
		t.Fatal(err)
	}
	st, err = pb.NewOperatorClient(c.conn(leader)).ClusterStatus(ctxT(t, 5*time.Second), &pb.ClusterStatusRequest{})
	if err != nil || st.Migration != pb.MigrationMode_MIGRATION_MODE_ON || st.Strategy != pb.Strategy_STRATEGY_LUMEN {
		t.Fatalf("status after migration on: %v %v", st, err)
	}
}

// fastMigrations runs the leader's migration round every 20 ms.
func fastMigrations(timeout time.Duration) func(*Config) {
	return func(cfg *Config) {
		cfg.MigrationInterval = 20 * time.Millisecond
		cfg.MigrationTimeout = timeout
	}
}

// TestLeaderMigratesUnderImbalance: with migration on, the leader moves a
// request off the least free worker to the freest, one at a time, and a
// worker's commit lands it there.
func TestLeaderMigratesUnderImbalance(t *testing.T) {
	c := newCluster(t, 3, fastMigrations(10*time.Second))
	c.addWorker("w1", 1, 1<<30)
	c.addWorker("w2", 1, 1<<30)
	leader := c.waitLeader()
	cl := c.client(leader)
	evs := migrationEvents(t, c, leader)
	reportLoad(t, cl, "w1", 100, 1)
	reportLoad(t, cl, "w2", 900, 1)
	for i := 0; i < 4; i++ {
		d, err := cl.Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: fmt.Sprintf("r%d", i), PromptTokens: uint32(100 + 10*i), MaxTokens: 50})
		if err != nil || d.Placement.WorkerId != "w1" {
			t.Fatalf("dispatch: %v %v", d, err)
		}
	}
	// w1 fills up; w2 empties. Nothing moves while migration is off.
	reportLoad(t, cl, "w1", 950, 40)
	reportLoad(t, cl, "w2", 50, 1)
	op := pb.NewOperatorClient(c.conn(c.follower()))
	if _, err := op.SetStrategy(ctxT(t, 5*time.Second), &pb.SetStrategyRequest{Migration: pb.MigrationMode_MIGRATION_MODE_ON}); err != nil {
		t.Fatal(err)
	}
	ev := next(t, evs, "the leader's migration")
	if ev.Stage != pb.Migration_STAGE_STARTED || ev.FromWorker != "w1" || ev.ToWorker != "w2" || ev.Placement.RequestId != "r0" ||
		!strings.HasPrefix(ev.Reason, "balance: ") {
		t.Fatalf("event %v", ev)
	}
	// One out of w1 at a time: while r0 is in flight the round plans
	// nothing.
	if plan, _ := leader.fsm.PlanMigrations(nil); len(plan) != 0 {
		t.Fatalf("planned %v with r0 in flight", plan)
	}
	if _, err := cl.FinishMigration(ctxT(t, 5*time.Second), &pb.FinishMigrationRequest{RequestId: "r0", Epoch: ev.Placement.Epoch,
		ToWorker: ev.ToWorker, ToIncarnation: ev.ToIncarnation, Commit: true, Reason: "copied"}); err != nil {
		t.Fatal(err)
	}
	if m := next(t, evs, "COMMITTED"); m.Stage != pb.Migration_STAGE_COMMITTED || m.Placement.WorkerId != "w2" {
		t.Fatalf("event %v", m)
	}
	// The next shortest follows (w2's pending request keeps it freer).
	if m := next(t, evs, "the second migration"); m.Stage != pb.Migration_STAGE_STARTED || m.Placement.RequestId != "r1" {
		t.Fatalf("event %v", m)
	}
	waitFor(t, 5*time.Second, "balance metrics", func() bool { return migrationCount(t, leader, "started", "balance") >= 2 })
}

// TestLeaderAbortsStuckMigration: a migration that does not commit within
// MigrationTimeout is aborted by the leader; the request stays on its
// source.
func TestLeaderAbortsStuckMigration(t *testing.T) {
	c := newCluster(t, 1, func(cfg *Config) {
		cfg.BootstrapExpect = 1
		fastMigrations(300 * time.Millisecond)(cfg)
	})
	c.addWorker("w1", 1, 1<<30)
	c.addWorker("w2", 1, 1<<30)
	n := c.nodes[0]
	cl := c.client(n)
	evs := migrationEvents(t, c, n)
	d, err := cl.Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "r1", PromptTokens: 100, MaxTokens: 50})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := pb.NewOperatorClient(c.conn(n)).Migrate(ctxT(t, 5*time.Second), &pb.MigrateRequest{RequestId: "r1"}); err != nil {
		t.Fatal(err)
	}
	next(t, evs, "STARTED")
	ev := next(t, evs, "the timeout's abort")
	if ev.Stage != pb.Migration_STAGE_ABORTED || !strings.HasPrefix(ev.Reason, "stage timeout: not committed within 300ms") {
		t.Fatalf("event %v", ev)
	}
	if waited := time.Since(start); waited < 300*time.Millisecond {
		t.Fatalf("aborted after %s, before the timeout", waited)
	}
	g, err := cl.GetPlacement(ctxT(t, 5*time.Second), &pb.GetPlacementRequest{RequestId: "r1"})
	if err != nil || g.Placement.WorkerId != d.Placement.WorkerId || g.Placement.State != pb.PlacementState_PLACEMENT_STATE_RUNNING || g.Placement.Epoch != 0 {
		t.Fatalf("after the abort: %v %v", g, err)
	}
	waitFor(t, 5*time.Second, "aborted/timeout counted", func() bool { return migrationCount(t, n, "aborted", "timeout") == 1 })
	// The destination's late commit is refused: the migration is over.
	_, err = cl.FinishMigration(ctxT(t, 5*time.Second), &pb.FinishMigrationRequest{RequestId: "r1", Epoch: 0,
		ToWorker: ev.ToWorker, ToIncarnation: ev.ToIncarnation, Commit: true})
	if !ctlclient.MigrationOver(err) {
		t.Fatalf("late commit: %v", err)
	}
}

// TestDrainMigratesEverything: a DRAINING worker's requests all migrate
// away with migration off, and the worker ends with none.
func TestDrainMigratesEverything(t *testing.T) {
	c := newCluster(t, 1, func(cfg *Config) {
		cfg.BootstrapExpect = 1
		fastMigrations(10 * time.Second)(cfg)
	})
	for _, id := range []string{"w1", "w2", "w3"} {
		c.addWorker(id, 1, 1<<30)
	}
	n := c.nodes[0]
	cl := c.client(n)
	evs := migrationEvents(t, c, n)
	reportLoad(t, cl, "w2", 900, 1)
	reportLoad(t, cl, "w3", 900, 1)
	const reqs = 5
	for i := 0; i < reqs; i++ {
		if d, err := cl.Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: fmt.Sprintf("r%d", i), PromptTokens: 100, MaxTokens: 50}); err != nil || d.Placement.WorkerId != "w1" {
			t.Fatalf("dispatch: %v %v", d, err)
		}
	}
	reportLoad(t, cl, "w2", 100, 1)
	reportLoad(t, cl, "w3", 200, 1)
	if _, err := cl.SetWorkerPhase(ctxT(t, 5*time.Second), &pb.SetWorkerPhaseRequest{WorkerId: "w1", Incarnation: 1,
		Phase: pb.WorkerPhase_WORKER_PHASE_DRAINING, Reason: "test drain"}); err != nil {
		t.Fatal(err)
	}
	// Commit each migration as it starts, as the data path would.
	moved := map[string]string{}
	for len(moved) < reqs {
		ev := next(t, evs, fmt.Sprintf("migration %d of the drain", len(moved)+1))
		if ev.Stage != pb.Migration_STAGE_STARTED {
			continue
		}
		if ev.FromWorker != "w1" || ev.ToWorker == "w1" || !strings.HasPrefix(ev.Reason, "drain: ") {
			t.Fatalf("event %v", ev)
		}
		if _, err := cl.FinishMigration(ctxT(t, 5*time.Second), &pb.FinishMigrationRequest{RequestId: ev.Placement.RequestId,
			Epoch: ev.Placement.Epoch, ToWorker: ev.ToWorker, ToIncarnation: ev.ToIncarnation, Commit: true}); err != nil {
			t.Fatal(err)
		}
		moved[ev.Placement.RequestId] = ev.ToWorker
	}
	for id, to := range moved {
		g, err := cl.GetPlacement(ctxT(t, 5*time.Second), &pb.GetPlacementRequest{RequestId: id})
		if err != nil || g.Placement.WorkerId != to || g.Placement.Epoch != 1 {
			t.Fatalf("%s after the drain: %v %v", id, g, err)
		}
	}
	waitFor(t, 5*time.Second, "started/drain counted", func() bool { return migrationCount(t, n, "started", "drain") == reqs })
}

// TestDrainStartsBeforeTheRound: the leader plans a drain as soon as it
// sees the worker DRAINING (DrainInterval), not at its next migration
// round: with rounds an hour apart, every request of the drained worker
// starts migrating at once, all in one plan (several into one
// destination).
func TestDrainStartsBeforeTheRound(t *testing.T) {
	c := newCluster(t, 1, func(cfg *Config) {
		cfg.BootstrapExpect = 1
		cfg.MigrationInterval, cfg.MigrationTimeout = time.Hour, 2*time.Hour
	})
	for _, id := range []string{"w1", "w2", "w3"} {
		c.addWorker(id, 1, 1<<30)
	}
	n := c.nodes[0]
	cl := c.client(n)
	evs := migrationEvents(t, c, n)
	reportLoad(t, cl, "w2", 900, 1)
	reportLoad(t, cl, "w3", 900, 1)
	const reqs = 5
	for i := 0; i < reqs; i++ {
		if d, err := cl.Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: fmt.Sprintf("r%d", i), PromptTokens: 100, MaxTokens: 50}); err != nil || d.Placement.WorkerId != "w1" {
			t.Fatalf("dispatch: %v %v", d, err)
		}
	}
	reportLoad(t, cl, "w1", 100, reqs) // they run: copies, not re-dispatches
	reportLoad(t, cl, "w2", 100, 1)
	reportLoad(t, cl, "w3", 200, 1)
	if _, err := cl.SetWorkerPhase(ctxT(t, 5*time.Second), &pb.SetWorkerPhaseRequest{WorkerId: "w1", Incarnation: 1,
		Phase: pb.WorkerPhase_WORKER_PHASE_DRAINING, Reason: "test drain"}); err != nil {
		t.Fatal(err)
	}
	started := map[string]bool{}
	for len(started) < reqs {
		ev := next(t, evs, fmt.Sprintf("migration %d of the drain", len(started)+1))
		if ev.Stage != pb.Migration_STAGE_STARTED || ev.FromWorker != "w1" || !strings.HasPrefix(ev.Reason, "drain: ") ||
			strings.Contains(ev.Reason, "re-dispatched") {
			t.Fatalf("event %v", ev)
		}
		started[ev.Placement.RequestId] = true
	}
}
