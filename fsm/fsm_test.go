package fsm

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// harness feeds commands to an FSM as raft log entries.
type harness struct {
	t     testing.TB
	f     *FSM
	index uint64
	stamp int64
}

func newHarness(t testing.TB) *harness {
	return &harness{t: t, f: New(), stamp: 1_700_000_000_000_000_000}
}

// entry stamps commands 1 µs apart, like a leader would; a command that
// carries a stamp already (randomLog's, which jump ahead to expire sessions)
// keeps it and moves the harness's clock.
func (h *harness) entry(cmds ...*pb.Command) *raft.Log {
	h.index++
	for _, c := range cmds {
		if c.StampedUnixNano == 0 {
			h.stamp += 1000
			c.StampedUnixNano = h.stamp
		} else if c.StampedUnixNano > h.stamp {
			h.stamp = c.StampedUnixNano
		}
	}
	data, err := proto.Marshal(&pb.LogEntry{Commands: cmds})
	if err != nil {
		h.t.Fatal(err)
	}
	return &raft.Log{Index: h.index, Term: 1, Type: raft.LogCommand, Data: data}
}

func (h *harness) apply(cmds ...*pb.Command) []Result {
	return h.f.Apply(h.entry(cmds...)).([]Result)
}

func (h *harness) one(c *pb.Command) Result { return h.apply(c)[0] }

func worker(id string, budget uint64) *pb.Command {
	return &pb.Command{Body: &pb.Command_RegisterWorker{RegisterWorker: &pb.RegisterWorkerCmd{Worker: &pb.Worker{
		Id: id, Incarnation: 1, GrpcAddr: id + ":1",
		Capacity: &pb.Capacity{KvPagesTotal: 1000, CheckpointBudgetBytes: budget, KvBytesPerToken: 100,
			MaxContextTokens: 4096, H2DBytesPerSec: 1e9}}}}}
}

func dispatch(id string, prompt, max uint32) *pb.Command {
	return &pb.Command{Body: &pb.Command_Dispatch{Dispatch: &pb.DispatchCmd{RequestId: id, PromptTokens: prompt, MaxTokens: max}}}
}

func complete(ids ...string) *pb.Command {
	return &pb.Command{Body: &pb.Command_Complete{Complete: &pb.CompleteCmd{RequestIds: ids}}}
}

func load(id string, inc uint64, q float64, used uint64) *pb.Command {
	return &pb.Command{Body: &pb.Command_ReportLoad{ReportLoad: &pb.ReportLoadCmd{Load: &pb.LoadRecord{
		WorkerId: id, Incarnation: inc, QueueWaitMs: q, KvPagesUsed: used, KvPagesTotal: 1000, Running: uint32(used / 10)}}}}
}

func markFailed(id string, inc uint64) *pb.Command {
	return &pb.Command{Body: &pb.Command_MarkFailed{MarkFailed: &pb.MarkFailedCmd{WorkerId: id, Incarnation: inc}}}
}

func createSession(id string, ttl time.Duration) *pb.Command {
	return &pb.Command{Body: &pb.Command_CreateSession{CreateSession: &pb.CreateSessionCmd{Id: id, Owner: "gw-" + id, TtlNanos: int64(ttl)}}}
}

func renewSession(id string) *pb.Command {
	return &pb.Command{Body: &pb.Command_RenewSession{RenewSession: &pb.RenewSessionCmd{Id: id}}}
}

func destroySession(id string) *pb.Command {
	return &pb.Command{Body: &pb.Command_DestroySession{DestroySession: &pb.DestroySessionCmd{Id: id}}}
}

func dispatchIn(session, id string, prompt, max uint32) *pb.Command {
	c := dispatch(id, prompt, max)
	c.GetDispatch().SessionId = session
	return c
}

func noop() *pb.Command { return &pb.Command{Body: &pb.Command_Noop{Noop: &pb.NoopCmd{}}} }

func strategy(s pb.Strategy) *pb.Command {
	return &pb.Command{Body: &pb.Command_SetStrategy{SetStrategy: &pb.SetStrategyCmd{Strategy: s}}}
}

func TestDispatchAndComplete(t *testing.T) {
	h := newHarness(t)
	for _, id := range []string{"w1", "w2", "w3"} {
		if r := h.one(worker(id, 1<<20)); r.Err != nil {
			t.Fatal(r.Err)
		}
	}
	h.apply(load("w1", 1, 5, 100), load("w2", 1, 1, 500), load("w3", 1, 3, 900))

	r := h.one(dispatch("r1", 100, 28))
	if r.Err != nil {
		t.Fatal(r.Err)
	}
	p := r.Dispatch.Placement
	// w1 is the freest; among w2 and w3, w2 has the lower q_w.
	if p.WorkerId != "w1" || p.HolderId != "w2" || p.ReservedBytes != 128*100 {
		t.Fatalf("placement %v", p)
	}
	if got := h.f.HolderUsage()["w2"][0]; got != 12800 {
		t.Fatalf("w2 reserved %d", got)
	}
	// A retried Dispatch returns the first answer.
	again := h.one(dispatch("r1", 100, 28))
	if !proto.Equal(again.Dispatch.Placement, p) {
		t.Fatalf("retry changed placement: %v vs %v", again.Dispatch.Placement, p)
	}
	// Complete releases the reservation; a second Complete finds nothing.
	c := h.one(complete("r1", "nope"))
	if c.Complete.Completed != 1 || len(c.Complete.NotFound) != 1 || c.Complete.NotFound[0] != "nope" {
		t.Fatalf("complete %v", c.Complete)
	}
	if got := h.f.HolderUsage()["w2"][0]; got != 0 {
		t.Fatalf("w2 reserved %d after complete", got)
	}
	if pl, _ := h.f.Placement("r1"); pl != nil {
		t.Fatalf("placement survives complete: %v", pl)
	}
	// A retried Complete (its first reply lost) says it took effect
	// already, not that the request is unknown (jepsen found this).
	c = h.one(complete("r1"))
	if c.Complete.Completed != 0 || len(c.Complete.NotFound) != 0 || len(c.Complete.AlreadyCompleted) != 1 {
		t.Fatalf("retried complete %v", c.Complete)
	}
	if r := h.one(dispatch("r1", 100, 28)); !errors.Is(r.Err, ErrCompleted) {
		t.Fatalf("dispatch of completed id: %v", r.Err)
	}
}

func TestDispatchSpreadsBetweenReports(t *testing.T) {
	h := newHarness(t)
	h.apply(worker("a", 1<<30), worker("b", 1<<30))
	h.apply(load("a", 1, 0, 0), load("b", 1, 0, 0))
	count := map[string]int{}
	for i := 0; i < 10; i++ {
		r := h.one(dispatch(fmt.Sprintf("r%d", i), 160, 16))
		count[r.Dispatch.Placement.WorkerId]++
	}
	if count["a"] != 5 || count["b"] != 5 {
		t.Fatalf("dispatches between load reports herd: %v", count)
	}
}

func TestNoWorkerAndNoHolder(t *testing.T) {
	h := newHarness(t)
	if r := h.one(dispatch("r1", 10, 10)); !errors.Is(r.Err, ErrNoWorker) {
		t.Fatalf("empty cluster: %v", r.Err)
	}
	h.one(worker("solo", 1<<30))
	r := h.one(dispatch("r1", 10, 10))
	if r.Err != nil || !r.Dispatch.NoHolder || r.Dispatch.NoHolderReason == "" || r.Dispatch.Placement.HolderId != "" {
		t.Fatalf("single worker: %+v", r)
	}
}

func TestBudgetNeverExceeded(t *testing.T) {
	h := newHarness(t)
	// Each request reserves (100+28)*100 = 12,800 bytes; budgets hold 3 and 2.
	h.apply(worker("a", 3*12800+5), worker("b", 2*12800), worker("c", 0))
	holders, none := 0, 0
	for i := 0; i < 20; i++ {
		r := h.one(dispatch(fmt.Sprintf("r%02d", i), 100, 28))
		if r.Err != nil {
			t.Fatal(r.Err)
		}
		if r.Dispatch.NoHolder {
			none++
		} else {
			holders++
		}
		for id, u := range h.f.HolderUsage() {
			if u[0] > u[1] {
				t.Fatalf("holder %s over budget: %d > %d", id, u[0], u[1])
			}
		}
	}
	if holders == 0 || none == 0 {
		t.Fatalf("holders %d, without %d", holders, none)
	}
	// Completing frees budget for the next placement.
	h.one(complete("r00", "r01", "r02", "r03", "r04", "r05"))
	if r := h.one(dispatch("late", 100, 28)); r.Dispatch.NoHolder {
		t.Fatalf("no holder after completes freed budget: %s", r.Dispatch.NoHolderReason)
	}
}

func TestMarkFailedPlansRecovery(t *testing.T) {
	h := newHarness(t)
	h.apply(worker("a", 1<<30), worker("b", 1<<30), worker("c", 1<<30))
	// Make a the freest so it serves everything; b and c hold.
	h.apply(load("a", 1, 0, 0), load("b", 1, 1, 800), load("c", 1, 2, 800))
	var placed []*pb.Placement
	for i := 0; i < 4; i++ {
		r := h.one(dispatch(fmt.Sprintf("r%d", i), uint32(100*(i+1)), 32))
		placed = append(placed, r.Dispatch.Placement)
	}
	for _, p := range placed {
		if p.WorkerId != "a" {
			t.Fatalf("expected a to serve, got %v", p)
		}
	}
	before, _, _ := h.f.Events().Since(0)
	r := h.one(markFailed("a", 1))
	if r.Err != nil || r.Worker.Phase != pb.WorkerPhase_WORKER_PHASE_FAILED {
		t.Fatalf("mark failed: %+v", r)
	}
	recs := h.f.Recoveries()
	if len(recs) != 1 || len(recs[0].Assignments) != 4 {
		t.Fatalf("recoveries %v", recs)
	}
	for _, a := range recs[0].Assignments {
		p, _ := h.f.Placement(a.RequestId)
		if p.WorkerId != a.TargetWorker || p.State != pb.PlacementState_PLACEMENT_STATE_RECOVERING || p.Epoch != 1 {
			t.Fatalf("placement %v vs assignment %v", p, a)
		}
		if a.Mode == pb.RecoveryMode_RECOVERY_MODE_REUSE && a.TargetWorker != a.CheckpointHolder {
			t.Fatalf("reuse away from holder: %v", a)
		}
		if p.HolderId == p.WorkerId {
			t.Fatalf("request holds its own checkpoint: %v", p)
		}
	}
	after, _, _ := h.f.Events().Since(0)
	var plans, moves, phases int
	for _, ev := range after[len(before):] {
		switch ev.Body.(type) {
		case *pb.Event_RecoveryPlan:
			plans++
		case *pb.Event_PlacementMoved:
			moves++
		case *pb.Event_PhaseChanged:
			phases++
		}
	}
	if plans != 1 || moves != 4 || phases != 1 {
		t.Fatalf("events: plans %d moves %d phases %d", plans, moves, phases)
	}
	// Idempotent, and a stale incarnation is refused.
	if r := h.one(markFailed("a", 1)); r.Err != nil || len(h.f.Recoveries()) != 1 {
		t.Fatalf("second mark failed: %v, %d plans", r.Err, len(h.f.Recoveries()))
	}
	if r := h.one(markFailed("a", 0)); !errors.Is(r.Err, ErrStaleIncarnation) {
		t.Fatalf("stale incarnation: %v", r.Err)
	}
}

func TestHolderFailureDropsCheckpoints(t *testing.T) {
	h := newHarness(t)
	h.apply(worker("a", 1<<30), worker("b", 1<<30))
	p := h.one(dispatch("r", 10, 10)).Dispatch.Placement
	h.one(markFailed(p.HolderId, 1))
	np, _ := h.f.Placement("r")
	if np.HolderId != "" || np.WorkerId != p.WorkerId {
		t.Fatalf("after holder failure: %v", np)
	}
	if u := h.f.HolderUsage()[p.HolderId]; u[0] != 0 {
		t.Fatalf("failed holder keeps %d reserved", u[0])
	}
}

func TestOrphansRecoveredWhenWorkerJoins(t *testing.T) {
	h := newHarness(t)
	h.one(worker("a", 1<<30))
	h.one(dispatch("r", 10, 10))
	h.one(markFailed("a", 1))
	p, _ := h.f.Placement("r")
	if p.WorkerId != "a" || p.State != pb.PlacementState_PLACEMENT_STATE_RECOVERING {
		t.Fatalf("orphan %v", p)
	}
	h.one(worker("b", 1<<30))
	p, _ = h.f.Placement("r")
	if p.WorkerId != "b" || p.Epoch != 1 {
		t.Fatalf("orphan not recovered on join: %v", p)
	}
}

func TestNewIncarnationReplacesOld(t *testing.T) {
	h := newHarness(t)
	h.apply(worker("a", 1<<30), worker("b", 1<<30))
	h.apply(load("a", 1, 0, 0), load("b", 1, 0, 900))
	h.one(dispatch("r", 10, 10)) // on a, held by b
	reg := worker("a", 1<<30)
	reg.GetRegisterWorker().Worker.Incarnation = 2
	if r := h.one(reg); r.Err != nil || r.Worker.Incarnation != 2 {
		t.Fatalf("re-register: %+v", r)
	}
	p, _ := h.f.Placement("r")
	if p.WorkerId != "b" || p.Epoch != 1 {
		t.Fatalf("request of the old incarnation not recovered: %v", p)
	}
	if r := h.one(load("a", 1, 0, 0)); !errors.Is(r.Err, ErrStaleIncarnation) {
		t.Fatalf("stale load accepted: %v", r.Err)
	}
	stale := worker("a", 1<<30)
	if r := h.one(stale); !errors.Is(r.Err, ErrStaleIncarnation) {
		t.Fatalf("stale registration accepted: %v", r.Err)
	}
}

// A worker marked failed while it still runs (paused, cut off) has its
// load refused, so it registers a new incarnation; the requests no worker
// could take when it failed are planned onto the cluster it rejoins.
func TestFailedIncarnationRejoins(t *testing.T) {
	h := newHarness(t)
	h.one(worker("a", 1<<30))
	h.one(dispatch("r", 10, 10))
	h.one(markFailed("a", 1))
	if r := h.one(load("a", 1, 0, 0)); !errors.Is(r.Err, ErrIncarnationFailed) || !strings.Contains(r.Err.Error(), "FAILED") {
		t.Fatalf("load of a failed incarnation: %v, want refused as FAILED", r.Err)
	}
	if p, _ := h.f.Placement("r"); p.State != pb.PlacementState_PLACEMENT_STATE_RECOVERING || p.WorkerIncarnation != 1 {
		t.Fatalf("orphan %v", p)
	}
	reg := worker("a", 1<<30)
	reg.GetRegisterWorker().Worker.Incarnation = 2
	if r := h.one(reg); r.Err != nil || r.Worker.Phase != pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
		t.Fatalf("re-register: %+v", r)
	}
	p, _ := h.f.Placement("r")
	if p.WorkerId != "a" || p.WorkerIncarnation != 2 || p.Epoch != 1 {
		t.Fatalf("the failed incarnation's request was not planned onto the new one: %v", p)
	}
	if r := h.one(load("a", 2, 0, 0)); r.Err != nil {
		t.Fatalf("load of the new incarnation: %v", r.Err)
	}
}

func TestStrategies(t *testing.T) {
	for _, s := range []pb.Strategy{pb.Strategy_STRATEGY_LUMEN, pb.Strategy_STRATEGY_FIXED_CHECKPOINT, pb.Strategy_STRATEGY_STOP_AND_RESTART, pb.Strategy_STRATEGY_RECOMPUTE} {
		h := newHarness(t)
		h.apply(worker("a", 1<<30), worker("b", 1<<30), worker("c", 1<<30))
		h.apply(load("a", 1, 0, 0), load("b", 1, 50, 800), load("c", 1, 1, 800))
		if r := h.one(strategy(s)); r.Err != nil {
			t.Fatal(r.Err)
		}
		p := h.one(dispatch("r", 10, 10)).Dispatch.Placement
		want := map[pb.Strategy]string{
			pb.Strategy_STRATEGY_LUMEN:            "c", // lowest q_w
			pb.Strategy_STRATEGY_FIXED_CHECKPOINT: "b", // next on the ring after a
			pb.Strategy_STRATEGY_STOP_AND_RESTART: "",
			pb.Strategy_STRATEGY_RECOMPUTE:        "",
		}[s]
		if p.WorkerId != "a" || p.HolderId != want {
			t.Errorf("%v: placement %v, want holder %q", s, p, want)
		}
	}
	h := newHarness(t)
	for _, s := range []pb.Strategy{5, 9, -1} {
		if r := h.one(strategy(s)); !errors.Is(r.Err, ErrInvalid) {
			t.Fatalf("unknown strategy %d accepted: %v", s, r.Err)
		}
	}
}

// Under recompute (Dynamo's baseline) a failed worker's requests are
// recomputed on the least-loaded survivors, none reusing a checkpoint, and
// the strategy is part of the snapshot.
func TestRecomputeStrategy(t *testing.T) {
	h := newHarness(t)
	h.apply(worker("a", 1<<30), worker("b", 1<<30), worker("c", 1<<30))
	h.apply(load("a", 1, 0, 0), load("b", 1, 1, 800), load("c", 1, 2, 800))
	if r := h.one(strategy(pb.Strategy_STRATEGY_RECOMPUTE)); r.Err != nil || r.Previous != pb.Strategy_STRATEGY_LUMEN {
		t.Fatalf("set recompute: %+v", r)
	}
	for i := 0; i < 4; i++ {
		if p := h.one(dispatch(fmt.Sprintf("r%d", i), 100, 32)).Dispatch.Placement; p.HolderId != "" || p.ReservedBytes != 0 {
			t.Fatalf("recompute placed a checkpoint: %v", p)
		}
	}
	h.one(markFailed("a", 1))
	recs := h.f.Recoveries()
	if len(recs) != 1 || len(recs[0].Assignments) != 4 {
		t.Fatalf("recoveries %v", recs)
	}
	for _, a := range recs[0].Assignments {
		if a.Mode != pb.RecoveryMode_RECOVERY_MODE_RECOMPUTE || a.TargetWorker == "a" || a.NewHolder != "" {
			t.Fatalf("assignment %v: want a recompute on a survivor, no holder", a)
		}
	}
	snap, err := h.f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	var buf sink
	if err := snap.Persist(&buf); err != nil {
		t.Fatal(err)
	}
	restored := newHarness(t)
	if err := restored.f.Restore(io.NopCloser(bytes.NewReader(buf.Bytes()))); err != nil {
		t.Fatal(err)
	}
	if s, _ := restored.f.Strategy(); s != pb.Strategy_STRATEGY_RECOMPUTE {
		t.Fatalf("restored strategy %v, want recompute", s)
	}
}

func TestUndecodableEntryPanics(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("a corrupt log entry did not panic")
		}
	}()
	New().Apply(&raft.Log{Index: 1, Type: raft.LogCommand, Data: []byte{0xff, 0xff, 0xff}})
}

// randomLog returns a seeded random sequence of log entries exercising every
// command type. It stamps the commands itself, now and then jumping seconds
// ahead so sessions expire.
func randomLog(rng *rand.Rand, n int) [][]*pb.Command {
	var log [][]*pb.Command
	inc := map[string]uint64{}
	phase := map[string]pb.WorkerPhase{} // as the log last asked; lookups only
	var live []string
	nextReq, nextSession := 0, 0
	// The destination each request was last sent to migrate to, so that
	// FinishMigration often names the migration in flight.
	type dest struct {
		id  string
		inc uint64
	}
	migratingTo := map[string]dest{}
	session := func() string { return fmt.Sprintf("s%03d", rng.Intn(nextSession)) }
	stamp := int64(1_700_000_000_000_000_000)
	for len(log) < n {
		var batch []*pb.Command
		for k := 0; k < 1+rng.Intn(8); k++ {
			switch op := rng.Intn(136); {
			case op >= 124 && op < 130 && nextReq > 0 && len(live) > 0:
				rid := fmt.Sprintf("r%05d", nextReq-1-rng.Intn(min(nextReq, 40)))
				to := live[rng.Intn(len(live))]
				migratingTo[rid] = dest{to, inc[to]}
				batch = append(batch, migrateCmd(rid, uint64(rng.Intn(3)/2), to, inc[to]))
			case op >= 130 && nextReq > 0:
				rid := fmt.Sprintf("r%05d", nextReq-1-rng.Intn(min(nextReq, 40)))
				d, ok := migratingTo[rid]
				if !ok || rng.Intn(8) == 0 {
					id := fmt.Sprintf("w%02d", rng.Intn(12))
					d = dest{id, inc[id]}
				}
				batch = append(batch, finishCmd(rid, uint64(rng.Intn(3)/2), d.id, d.inc, rng.Intn(3) != 0))
			case op >= 124:
				batch = append(batch, migrationMode(pb.MigrationMode(rng.Intn(3))))
			case op >= 112 && len(live) > 0:
				// Progressive recovery. Mostly a restarted worker's next
				// step (the phase the log last asked of it says which), so
				// that pairings form and break; else any phase: backward
				// (refused), skipping ahead, draining, leaving.
				var restarted []string
				for w := 0; w < 12; w++ {
					if id := fmt.Sprintf("w%02d", w); phase[id] == loadingDraft || phase[id] == assist || phase[id] == hotswap {
						restarted = append(restarted, id)
					}
				}
				id, to := live[rng.Intn(len(live))], pb.WorkerPhase(1+rng.Intn(8))
				if len(restarted) > 0 && rng.Intn(4) != 0 {
					id = restarted[rng.Intn(len(restarted))]
					to = map[pb.WorkerPhase]pb.WorkerPhase{loadingDraft: assist, assist: hotswap, hotswap: fullService}[phase[id]]
					if rng.Intn(4) == 0 {
						to = fullService
					}
				}
				if to == left {
					batch = append(batch, leave(id, inc[id]))
				} else {
					batch = append(batch, setPhase(id, inc[id], to))
				}
				if checkStep(&pb.Worker{Phase: phase[id]}, to) == nil {
					phase[id] = to
				}
			case op >= 100 && op < 104:
				c := createSession(fmt.Sprintf("s%03d", nextSession), time.Duration(1+rng.Intn(3))*time.Second)
				if rng.Intn(2) == 0 {
					// A gateway's, of a few names: restarts replace.
					c.GetCreateSession().Gateway = true
					c.GetCreateSession().Owner = fmt.Sprintf("gw-%d", rng.Intn(3))
				}
				batch = append(batch, c)
				nextSession++
			case op >= 104 && op < 108 && nextSession > 0:
				batch = append(batch, renewSession(session()))
			case op == 108 && nextSession > 0:
				batch = append(batch, destroySession(session()))
			case op >= 109:
				stamp += rng.Int63n(int64(2 * time.Second))
				c := noop()
				switch rng.Intn(8) {
				case 0:
					c.GetNoop().RenewSessions = true // an older leader's first command
				case 1:
					c = NewLeaderCmd()
				}
				batch = append(batch, c)
			case op >= 8 && op < 30 && nextSession > 0:
				batch = append(batch, dispatchIn(session(), fmt.Sprintf("r%05d", nextReq), uint32(1+rng.Intn(2000)), uint32(1+rng.Intn(500))))
				nextReq++
			case op < 8:
				id := fmt.Sprintf("w%02d", rng.Intn(12))
				inc[id]++
				c := worker(id, uint64(rng.Intn(1<<20)))
				c.GetRegisterWorker().Worker.Incarnation = inc[id]
				if w := c.GetRegisterWorker().Worker; id < "w09" {
					// Failure domains: w00–w08 on three nodes, the rest
					// unlabelled (each its own domain).
					w.Node = fmt.Sprintf("n%d", (id[2]-'0')/3)
				}
				phase[id] = fullService
				if rng.Intn(3) == 0 {
					c.GetRegisterWorker().Worker.Phase = loadingDraft
					phase[id] = loadingDraft
				}
				batch = append(batch, c)
				live = append(live, id)
			case op < 50:
				batch = append(batch, dispatch(fmt.Sprintf("r%05d", nextReq), uint32(1+rng.Intn(2000)), uint32(1+rng.Intn(500))))
				nextReq++
			case op < 70 && nextReq > 0:
				var ids []string
				for j := 0; j < 1+rng.Intn(4); j++ {
					ids = append(ids, fmt.Sprintf("r%05d", rng.Intn(nextReq)))
				}
				batch = append(batch, complete(ids...))
			case op < 90 && len(live) > 0:
				id := live[rng.Intn(len(live))]
				batch = append(batch, load(id, inc[id], rng.Float64()*100, uint64(rng.Intn(1000))))
			case op < 96 && len(live) > 0:
				id := live[rng.Intn(len(live))]
				batch = append(batch, markFailed(id, inc[id]))
				phase[id] = failed
			case op < 100:
				c := strategy(pb.Strategy(1 + rng.Intn(4)))
				c.GetSetStrategy().CheckpointReplicas = uint32(rng.Intn(4)) // 0: unchanged
				batch = append(batch, c)
			default:
				batch = append(batch, noop())
			}
		}
		for _, c := range batch {
			stamp += 1000
			c.StampedUnixNano = stamp
		}
		log = append(log, batch)
	}
	return log
}

// TestDeterminism feeds two FSMs the same random log and requires
// byte-identical snapshots after every entry.
func TestDeterminism(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	a, b := newHarness(t), newHarness(t)
	var prevHash uint64
	endedWithPlacements := 0 // sessions that expired or were destroyed holding placements
	for i, batch := range randomLog(rng, 400) {
		held := map[string]int{}
		for sid, reqs := range a.f.st.sessionReqs {
			held[sid] = len(reqs)
		}
		// Migrations of placements that exist, at their epochs, and
		// finishes of those in flight: the blind ones of randomLog are
		// mostly refused.
		batch = append(batch, liveMigrations(rng, a.f.st)...)
		a.apply(batch...)
		for sid, n := range held {
			if _, ok := a.f.st.sessions[sid]; !ok && n > 0 {
				endedWithPlacements++
			}
		}
		checkSessions(t, a.f.st)
		b.apply(proto.Clone(&pb.LogEntry{Commands: batch}).(*pb.LogEntry).Commands...)
		sa, err := a.f.MarshalSnapshot()
		if err != nil {
			t.Fatal(err)
		}
		sb, _ := b.f.MarshalSnapshot()
		if !bytes.Equal(sa, sb) {
			t.Fatalf("seed %d: snapshots differ after entry %d", seed, i)
		}
		ha, ia, _ := a.f.StateHash()
		hb, ib, _ := b.f.StateHash()
		if ha != hb || ia != ib {
			t.Fatalf("seed %d: state hashes %x@%d and %x@%d after entry %d", seed, ha, ia, hb, ib, i)
		}
		if i > 0 && ha == prevHash {
			t.Fatalf("seed %d: entry %d left the state hash unchanged", seed, i)
		}
		prevHash = ha
		checkHolderIndex(t, a.f.st, rng)
		checkPairing(t, a.f.st)
		checkMigrations(t, a.f.st)
		checkReservations(t, a.f.st)
	}
	if w, p := a.f.Counts(); w == 0 || p == 0 {
		t.Fatalf("random log left %d workers, %d placements: not exercising the tables", w, p)
	}
	// The replicas derived the same events, pairings among them.
	ea, _, _ := a.f.Events().Since(0)
	eb, _, _ := b.f.Events().Since(0)
	if len(ea) != len(eb) {
		t.Fatalf("seed %d: %d events vs %d", seed, len(ea), len(eb))
	}
	pairs, unpairs := 0, 0
	stages := map[pb.Migration_Stage]int{}
	copies := 0
	for i := range ea {
		if !proto.Equal(ea[i], eb[i]) {
			t.Fatalf("seed %d: event %d: %v vs %v", seed, i, ea[i], eb[i])
		}
		if m := ea[i].GetMigration(); m != nil {
			stages[m.Stage]++
		}
		for _, a := range ea[i].GetRecoveryPlan().GetAssignments() {
			if a.MigrationCopy {
				copies++
			}
		}
		if p := ea[i].GetPaired(); p != nil && p.Paired {
			pairs++
		} else if p != nil {
			unpairs++
		}
	}
	if pairs == 0 || unpairs == 0 {
		t.Fatalf("seed %d: %d pairings, %d ended: not exercising the pairing", seed, pairs, unpairs)
	}
	t.Logf("%d pairings, %d ended", pairs, unpairs)
	if stages[pb.Migration_STAGE_STARTED] == 0 || stages[pb.Migration_STAGE_COMMITTED] == 0 || stages[pb.Migration_STAGE_ABORTED] == 0 {
		t.Fatalf("seed %d: migrations %v: not exercising every stage", seed, stages)
	}
	t.Logf("migrations: %v; %d recoveries reused a migration's copy", stages, copies)
	if endedWithPlacements == 0 {
		t.Fatalf("seed %d: no session ended holding placements: not exercising the sessions table", seed)
	}
	t.Logf("%d sessions ended holding placements", endedWithPlacements)
}

// liveMigrations returns, now and then, a Migrate of a placement in the
// table to a worker in full service, and a FinishMigration of a migration
// in flight, both stamped 1 µs after the last command.
func liveMigrations(rng *rand.Rand, s *state) []*pb.Command {
	var ids, moving, targets []string
	for id, p := range s.placements {
		ids = append(ids, id)
		if migrating(p) {
			moving = append(moving, id)
		}
	}
	for _, id := range s.ids {
		if eligible(s.workers[id]) {
			targets = append(targets, id)
		}
	}
	sort.Strings(ids)
	sort.Strings(moving)
	var out []*pb.Command
	if len(ids) > 0 && len(targets) > 0 && rng.Intn(2) == 0 {
		p := s.placements[ids[rng.Intn(len(ids))]]
		to := s.workers[targets[rng.Intn(len(targets))]]
		out = append(out, migrateCmd(p.RequestId, p.Epoch, to.Id, to.Incarnation))
	}
	if len(moving) > 0 && rng.Intn(2) == 0 {
		p := s.placements[moving[rng.Intn(len(moving))]]
		out = append(out, finishCmd(p.RequestId, p.Epoch, p.MigrationTarget, p.MigrationTargetIncarnation, rng.Intn(3) != 0))
	}
	stamp := s.lastStamp
	for _, c := range out {
		stamp += 1000
		c.StampedUnixNano = stamp
	}
	return out
}

// checkSessions checks the sessions table's indexes against each other and
// the placement table.
func checkSessions(t *testing.T, s *state) {
	t.Helper()
	n := 0
	for sid, reqs := range s.sessionReqs {
		if _, ok := s.sessions[sid]; !ok {
			t.Fatalf("placements %v in ended session %s", reqs, sid)
		}
		for rid := range reqs {
			if s.sessionOf[rid] != sid {
				t.Fatalf("request %s: in session %s's set, sessionOf says %q", rid, sid, s.sessionOf[rid])
			}
			if _, ok := s.placements[rid]; !ok {
				t.Fatalf("session %s holds %s, which has no placement", sid, rid)
			}
			n++
		}
	}
	if n != len(s.sessionOf) {
		t.Fatalf("sessionOf has %d entries, the sets %d", len(s.sessionOf), n)
	}
	if len(s.sessions) > 0 && s.nextExpiry == 0 {
		t.Fatalf("%d sessions and no nextExpiry", len(s.sessions))
	}
	for _, ss := range s.sessions {
		if d := sessionDeadline(ss); d < s.nextExpiry {
			t.Fatalf("session %s's deadline %d is before nextExpiry %d", ss.Id, d, s.nextExpiry)
		}
	}
}

type sink struct {
	bytes.Buffer
	cancelled bool
}

func (s *sink) ID() string    { return "test" }
func (s *sink) Cancel() error { s.cancelled = true; return nil }
func (s *sink) Close() error  { return nil }

// TestSnapshotRoundTrip persists a snapshot, restores it into a fresh FSM and
// checks every table, then that both FSMs go on to make the same decisions.
func TestSnapshotRoundTrip(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	h := newHarness(t)
	log := randomLog(rng, 300)
	for _, batch := range log[:200] {
		h.apply(batch...)
	}
	snap, err := h.f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	var s sink
	if err := snap.Persist(&s); err != nil {
		t.Fatal(err)
	}
	restored := newHarness(t)
	restored.index, restored.stamp = h.index, h.stamp
	if err := restored.f.Restore(io.NopCloser(bytes.NewReader(s.Bytes()))); err != nil {
		t.Fatal(err)
	}
	if restored.f.Applied() != h.f.Applied() {
		t.Fatalf("applied %d vs %d", restored.f.Applied(), h.f.Applied())
	}
	// Table by table.
	t1, t2 := h.f.Workers(), restored.f.Workers()
	w1, l1, res1 := t1.Workers, t1.Loads, t1.Reservations
	w2, l2, res2 := t2.Workers, t2.Loads, t2.Reservations
	if len(w1) != len(w2) || len(l1) != len(l2) {
		t.Fatalf("workers %d/%d loads %d/%d", len(w1), len(w2), len(l1), len(l2))
	}
	for i := range w1 {
		if !proto.Equal(w1[i], w2[i]) {
			t.Fatalf("worker %d: %v vs %v", i, w1[i], w2[i])
		}
	}
	for i := range l1 {
		if !proto.Equal(l1[i], l2[i]) {
			t.Fatalf("load %d: %v vs %v", i, l1[i], l2[i])
		}
	}
	for i := range res1 {
		if !proto.Equal(res1[i], res2[i]) {
			t.Fatalf("reservations %d: %v vs %v", i, res1[i], res2[i])
		}
	}
	_, np := h.f.Counts()
	for i := 0; i < 100000 && np > 0; i++ {
		id := fmt.Sprintf("r%05d", i)
		p1, _ := h.f.Placement(id)
		p2, _ := restored.f.Placement(id)
		if !proto.Equal(p1, p2) {
			t.Fatalf("placement %s: %v vs %v", id, p1, p2)
		}
	}
	r1, r2 := h.f.Recoveries(), restored.f.Recoveries()
	if len(r1) != len(r2) {
		t.Fatalf("recoveries %d vs %d", len(r1), len(r2))
	}
	for i := range r1 {
		if !proto.Equal(r1[i], r2[i]) {
			t.Fatalf("recovery %d differs", i)
		}
	}
	compareSessions(t, h.f, restored.f)
	u1, u2 := h.f.HolderUsage(), restored.f.HolderUsage()
	for id := range u1 {
		if u1[id] != u2[id] {
			t.Fatalf("holder usage %s: %v vs %v", id, u1[id], u2[id])
		}
	}
	s1, _ := h.f.MarshalSnapshot()
	s2, _ := restored.f.MarshalSnapshot()
	if !bytes.Equal(s1, s2) {
		t.Fatal("snapshot bytes differ after restore")
	}
	// The restored replica makes the same decisions from here on, including
	// answering retried Dispatches of completed requests.
	for _, batch := range log[200:] {
		a := h.apply(batch...)
		b := restored.apply(proto.Clone(&pb.LogEntry{Commands: batch}).(*pb.LogEntry).Commands...)
		for k := range a {
			if fmt.Sprint(a[k].Err) != fmt.Sprint(b[k].Err) || !proto.Equal(a[k].Dispatch, b[k].Dispatch) {
				t.Fatalf("seed %d: diverged after restore: %+v vs %+v", seed, a[k], b[k])
			}
		}
	}
	s1, _ = h.f.MarshalSnapshot()
	s2, _ = restored.f.MarshalSnapshot()
	if !bytes.Equal(s1, s2) {
		t.Fatal("snapshots differ after applying the same entries")
	}
}

func TestEventsSinceAndCompaction(t *testing.T) {
	e := NewEventLog(3)
	for i := uint64(1); i <= 5; i++ {
		e.append([]*pb.Event{{Index: i}})
	}
	evs, _, err := e.Since(2)
	if err != nil || len(evs) != 3 || evs[0].Index != 3 {
		t.Fatalf("since 2: %v %v", evs, err)
	}
	if _, _, err := e.Since(1); !errors.Is(err, ErrCompacted) {
		t.Fatalf("since 1 after compaction: %v", err)
	}
	_, ch, _ := e.Since(5)
	e.append([]*pb.Event{{Index: 6}})
	select {
	case <-ch:
	default:
		t.Fatal("watcher not woken")
	}
}

// checkHolderIndex fails when the incrementally kept holder index answers
// anything but what the reference scan over the views answers.
func checkHolderIndex(t *testing.T, s *state, rng *rand.Rand) {
	t.Helper()
	for k := 0; k < 8; k++ {
		serving := rng.Intn(len(s.views)+1) - 1
		fp := uint64(rng.Intn(1 << 20))
		g1, r1 := s.holders.Pick(serving, fp)
		g2, r2 := policy.PickHolder(s.views, serving, fp, s.lambda)
		if g1 != g2 || r1 != r2 {
			t.Fatalf("holder index %d %q, reference %d %q (serving %d, footprint %d)", g1, r1, g2, r2, serving, fp)
		}
	}
}
