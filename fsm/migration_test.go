package fsm

import (
	"bytes"
	"errors"
	"github.com/lumen-project/lumen/policy"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Live migration: MigrateCmd, FinishMigrationCmd, and what failures,
// completion and phase changes do to a migration in flight.

func migrateCmd(id string, epoch uint64, to string, inc uint64) *pb.Command {
	return &pb.Command{Body: &pb.Command_Migrate{Migrate: &pb.MigrateCmd{RequestId: id, Epoch: epoch, ToWorker: to, ToIncarnation: inc, Reason: "test"}}}
}

func finishCmd(id string, epoch uint64, to string, inc uint64, commit bool) *pb.Command {
	reason := "test abort"
	if commit {
		reason = "test commit"
	}
	return &pb.Command{Body: &pb.Command_FinishMigration{FinishMigration: &pb.FinishMigrationCmd{
		RequestId: id, Epoch: epoch, ToWorker: to, ToIncarnation: inc, Commit: commit, Reason: reason}}}
}

func migrationMode(m pb.MigrationMode) *pb.Command {
	return &pb.Command{Body: &pb.Command_SetStrategy{SetStrategy: &pb.SetStrategyCmd{Migration: m}}}
}

const (
	running     = pb.PlacementState_PLACEMENT_STATE_RUNNING
	migratingS  = pb.PlacementState_PLACEMENT_STATE_MIGRATING
	recoveringS = pb.PlacementState_PLACEMENT_STATE_RECOVERING
)

// migrationCluster is w1, w2, w3 with r1 on w1, its checkpoint held by w2.
func migrationCluster(t *testing.T) *harness {
	t.Helper()
	h := newHarness(t)
	for _, id := range []string{"w1", "w2", "w3"} {
		if r := h.one(worker(id, 1<<20)); r.Err != nil {
			t.Fatal(r.Err)
		}
	}
	h.apply(load("w1", 1, 5, 100), load("w2", 1, 1, 500), load("w3", 1, 3, 900))
	p := h.one(dispatch("r1", 100, 28)).Dispatch.Placement
	if p.WorkerId != "w1" || p.HolderId != "w2" {
		t.Fatalf("r1 placed %v", p)
	}
	return h
}

func (h *harness) placement(id string) *pb.Placement {
	p, _ := h.f.Placement(id)
	return p
}

// wantErr applies c and requires it to fail with target, its message
// naming each of words.
func (h *harness) wantErr(c *pb.Command, target error, words ...string) {
	h.t.Helper()
	r, evs := h.step(c)
	if !errors.Is(r.Err, target) {
		h.t.Fatalf("%v: error %v, want %v", c, r.Err, target)
	}
	for _, w := range words {
		if !strings.Contains(r.Err.Error(), w) {
			h.t.Fatalf("%v: error %q does not say %q", c, r.Err, w)
		}
	}
	if len(evs) > 0 {
		h.t.Fatalf("%v was refused but emitted %v", c, evs)
	}
	checkMigrations(h.t, h.f.st)
}

// checkMigrations checks the migration invariants: the incoming index is
// the MIGRATING placements by destination; a migration's destination is
// another worker, in full service at the incarnation it names; only a
// MIGRATING placement names one.
func checkMigrations(t testing.TB, s *state) {
	t.Helper()
	n := 0
	for _, p := range s.placements {
		if !migrating(p) {
			if p.MigrationTarget != "" || p.MigrationTargetIncarnation != 0 || p.MigrationStartedUnixNano != 0 {
				t.Fatalf("%s is %s with migration fields %v", p.RequestId, phaseOf(p), p)
			}
			continue
		}
		n++
		if _, ok := s.incoming[p.MigrationTarget][p.RequestId]; !ok {
			t.Fatalf("%s migrates to %s, not in its incoming set", p.RequestId, p.MigrationTarget)
		}
		w := s.workers[p.MigrationTarget]
		if p.MigrationTarget == p.WorkerId || w == nil || !eligible(w) || w.Incarnation != p.MigrationTargetIncarnation {
			t.Fatalf("%s on %s migrates to %s/%d, whose row is %v", p.RequestId, p.WorkerId, p.MigrationTarget, p.MigrationTargetIncarnation, w)
		}
	}
	m := 0
	for dest, reqs := range s.incoming {
		for id := range reqs {
			if p := s.placements[id]; p == nil || !migrating(p) || p.MigrationTarget != dest {
				t.Fatalf("incoming[%s] has %s, whose placement is %v", dest, id, p)
			}
			m++
		}
	}
	if n != m {
		t.Fatalf("%d MIGRATING placements, %d in the incoming sets", n, m)
	}
}

// checkReservations recomputes every holder's reservation from the
// placements.
func checkReservations(t testing.TB, s *state) {
	t.Helper()
	bytes, held := map[string]uint64{}, map[string]uint32{}
	for _, p := range s.placements {
		if p.HolderId == "" {
			if len(p.ReplicaHolders) > 0 {
				t.Fatalf("%s has replicas %v and no first copy", p.RequestId, p.ReplicaHolders)
			}
			continue
		}
		copies := append([]string{p.HolderId}, p.ReplicaHolders...)
		for k, h := range copies {
			if h == p.WorkerId {
				t.Fatalf("%s is served and held by %s", p.RequestId, p.WorkerId)
			}
			if _, ok := s.holding[h][p.RequestId]; !ok {
				t.Fatalf("%s held by %s, not in its holding set", p.RequestId, h)
			}
			bytes[h] += p.ReservedBytes
			held[h]++
			// Issue 24: the copies are in distinct domains, and when there
			// are several none is on the serving worker's node (only a
			// lone first copy falls back there).
			hv := s.view(h)
			for _, o := range copies[:k] {
				if ov := s.view(o); hv != nil && ov != nil && policy.SameDomain(hv, ov) {
					t.Fatalf("%s: copies on %s and %s, one domain", p.RequestId, o, h)
				}
			}
			if sv := s.view(p.WorkerId); len(copies) > 1 && hv != nil && sv != nil && policy.SameDomain(hv, sv) {
				t.Fatalf("%s: a copy on %s, the node of its serving worker %s", p.RequestId, h, p.WorkerId)
			}
		}
	}
	for i, id := range s.ids {
		if v := s.views[i]; v.Reserved != bytes[id] || v.Held != held[id] {
			t.Fatalf("%s reserves %d bytes for %d checkpoints; the placements say %d for %d", id, v.Reserved, v.Held, bytes[id], held[id])
		}
	}
}

func TestMigrateAndCommit(t *testing.T) {
	h := migrationCluster(t)
	r := h.expect(migrateCmd("r1", 0, "w3", 1), "STARTED r1 w1/1>w3/1")
	p := r.Placement
	if p.State != migratingS || p.WorkerId != "w1" || p.Epoch != 0 || p.MigrationTarget != "w3" ||
		p.MigrationTargetIncarnation != 1 || p.MigrationStartedUnixNano != h.stamp {
		t.Fatalf("after Migrate: %v (stamp %d)", p, h.stamp)
	}
	if !proto.Equal(h.placement("r1"), p) {
		t.Fatalf("table has %v, result %v", h.placement("r1"), p)
	}
	// The event carries the placement and both ends.
	evs, _, _ := h.f.Events().Since(h.index - 1)
	m := evs[0].GetMigration()
	if !proto.Equal(m.Placement, p) || m.Reason != "test" {
		t.Fatalf("STARTED event %v", m)
	}
	// A retried Migrate answers the same, with no event.
	if r := h.expect(migrateCmd("r1", 0, "w3", 1)); !proto.Equal(r.Placement, p) {
		t.Fatalf("retried Migrate: %v", r.Placement)
	}
	if got := h.f.Workers().Migrations; len(got) != 2 || got[0].WorkerId != "w1" || got[0].Out != 1 || got[1].WorkerId != "w3" || got[1].In != 1 {
		t.Fatalf("migrations in flight %v", got)
	}
	pending := h.f.st.view("w3").PendingRequests

	r = h.expect(finishCmd("r1", 0, "w3", 1, true), "COMMITTED r1 w1/1>w3/1", "move r1>w3")
	c := r.Placement
	if c.State != running || c.WorkerId != "w3" || c.WorkerIncarnation != 1 || c.Epoch != 1 || c.HolderId != "w2" ||
		c.ReservedBytes != p.ReservedBytes || c.MigrationTarget != "" || c.MigrationStartedUnixNano != 0 {
		t.Fatalf("after commit: %v", c)
	}
	if got := h.f.st.view("w3").PendingRequests; got != pending+1 {
		t.Fatalf("w3 pending %d, want %d", got, pending+1)
	}
	if _, ok := h.f.st.serving["w1"]["r1"]; ok {
		t.Fatal("r1 still served by w1")
	}
	if _, ok := h.f.st.serving["w3"]["r1"]; !ok {
		t.Fatal("r1 not served by w3")
	}
	evs, _, _ = h.f.Events().Since(h.index - 1)
	if mv := evs[1].GetPlacementMoved(); !proto.Equal(mv.Placement, c) || mv.FromWorker != "w1" || mv.Reason != "migration" {
		t.Fatalf("PlacementMoved %v", mv)
	}
	// A retried commit answers the committed row; an abort at the old
	// epoch is stale.
	if r := h.expect(finishCmd("r1", 0, "w3", 1, true)); !proto.Equal(r.Placement, c) {
		t.Fatalf("retried commit: %v", r.Placement)
	}
	h.wantErr(finishCmd("r1", 0, "w3", 1, false), ErrStaleEpoch, "epoch 1", "epoch 0")
	checkReservations(t, h.f.st)
	if len(h.f.Workers().Migrations) != 0 {
		t.Fatalf("migrations in flight after the commit: %v", h.f.Workers().Migrations)
	}
	// It may migrate again from its new worker, at its new epoch.
	h.expect(migrateCmd("r1", 1, "w1", 1), "STARTED r1 w3/1>w1/1")
}

func TestMigrateRefusals(t *testing.T) {
	h := migrationCluster(t)
	h.one(complete(h.one(dispatch("done", 10, 10)).Dispatch.Placement.RequestId))
	h.one(registerIn("w4", 1, fullService))
	h.expect(setPhase("w4", 1, draining), "phase w4 FULL_SERVICE>DRAINING")

	h.wantErr(migrateCmd("", 0, "w3", 1), ErrInvalid, "request id")
	h.wantErr(migrateCmd("r1", 0, "", 0), ErrInvalid, "destination")
	h.wantErr(migrateCmd("nope", 0, "w3", 1), ErrUnknownPlacement, "nope")
	h.wantErr(migrateCmd("done", 0, "w3", 1), ErrCompleted, "done")
	h.wantErr(migrateCmd("r1", 1, "w3", 1), ErrStaleEpoch, "epoch 0", "epoch 1")
	h.wantErr(migrateCmd("r1", 0, "w1", 1), ErrInvalid, "already runs on w1")
	h.wantErr(migrateCmd("r1", 0, "w9", 1), ErrUnknownWorker, "w9")
	h.wantErr(migrateCmd("r1", 0, "w3", 2), ErrStaleIncarnation, "incarnation 2")
	h.wantErr(migrateCmd("r1", 0, "w4", 1), ErrNotEligible, "w4 is DRAINING")

	h.expect(migrateCmd("r1", 0, "w3", 1), "STARTED r1 w1/1>w3/1")
	h.wantErr(migrateCmd("r1", 0, "w2", 1), ErrPlacementState, "MIGRATING to w3")

	// A recovering placement does not migrate.
	h.expect(markFailed("w1", 1), "phase w1 FULL_SERVICE>FAILED", "plan w1", "move r1>w3")
	if p := h.placement("r1"); p.State != recoveringS {
		t.Fatalf("r1 after its source failed: %v", p)
	}
	h.wantErr(migrateCmd("r1", 1, "w2", 1), ErrPlacementState, "RECOVERING")
}

func TestFinishMigrationRefusals(t *testing.T) {
	h := migrationCluster(t)
	h.wantErr(finishCmd("r1", 0, "", 0, true), ErrInvalid, "destination")
	h.wantErr(finishCmd("r1", 0, "w3", 1, true), ErrPlacementState, "RUNNING, not MIGRATING")
	// An abort of a migration that is not there is a no-op: a retry.
	if r := h.expect(finishCmd("r1", 0, "w3", 1, false)); r.Placement.State != running {
		t.Fatalf("no-op abort: %v", r.Placement)
	}
	h.expect(migrateCmd("r1", 0, "w3", 1), "STARTED r1 w1/1>w3/1")
	h.wantErr(finishCmd("r1", 1, "w3", 1, true), ErrStaleEpoch)
	h.wantErr(finishCmd("r1", 0, "w2", 1, true), ErrStaleMigration, "migrates to w3 incarnation 1", "not to w2")
	h.wantErr(finishCmd("r1", 0, "w3", 7, true), ErrStaleMigration, "not to w3 incarnation 7")
	h.wantErr(finishCmd("nope", 0, "w3", 1, true), ErrUnknownPlacement)

	// The first migration aborts and a second starts at the same epoch: a
	// late commit from the first destination must not commit the second.
	h.expect(finishCmd("r1", 0, "w3", 1, false), "ABORTED r1 w1/1>w3/1: test abort")
	h.expect(migrateCmd("r1", 0, "w2", 1), "STARTED r1 w1/1>w2/1")
	h.wantErr(finishCmd("r1", 0, "w3", 1, true), ErrStaleMigration)
	if p := h.placement("r1"); p.State != migratingS || p.MigrationTarget != "w2" {
		t.Fatalf("r1 after the late commit: %v", p)
	}
}

func TestAbortLeavesRequestOnSource(t *testing.T) {
	h := migrationCluster(t)
	before := h.placement("r1")
	h.expect(migrateCmd("r1", 0, "w3", 1), "STARTED r1 w1/1>w3/1")
	r := h.expect(finishCmd("r1", 0, "w3", 1, false), "ABORTED r1 w1/1>w3/1: test abort")
	if !proto.Equal(r.Placement, before) {
		t.Fatalf("after the abort %v, before the migration %v", r.Placement, before)
	}
	checkMigrations(t, h.f.st)
	checkReservations(t, h.f.st)
}

// The holder of a request cannot be its serving worker: a migration to the
// holder re-chooses it by h(r), and the reservation moves with it.
func TestCommitToHolderRechoosesHolder(t *testing.T) {
	h := migrationCluster(t)
	fp := h.placement("r1").ReservedBytes
	h.expect(migrateCmd("r1", 0, "w2", 1), "STARTED r1 w1/1>w2/1")
	c := h.expect(finishCmd("r1", 0, "w2", 1, true), "COMMITTED r1 w1/1>w2/1", "move r1>w2").Placement
	// w1 (q_w 5) and w3 (q_w 3) are left: h(r) takes w3.
	if c.WorkerId != "w2" || c.HolderId != "w3" || c.ReservedBytes != fp {
		t.Fatalf("after the commit to the holder: %v", c)
	}
	if v := h.f.st.view("w2"); v.Reserved != 0 || v.Held != 0 {
		t.Fatalf("w2 still reserves %d bytes for %d checkpoints", v.Reserved, v.Held)
	}
	checkReservations(t, h.f.st)
}

// A placement without a holder gets one at its new worker.
func TestCommitGivesHolderlessRequestAHolder(t *testing.T) {
	h := migrationCluster(t)
	h.one(strategy(pb.Strategy_STRATEGY_STOP_AND_RESTART))
	p := h.one(dispatch("r2", 100, 28)).Dispatch.Placement
	if p.HolderId != "" {
		t.Fatalf("stop-and-restart placed a holder: %v", p)
	}
	h.one(strategy(pb.Strategy_STRATEGY_LUMEN))
	to := "w2"
	if p.WorkerId == "w2" {
		to = "w3"
	}
	h.expect(migrateCmd("r2", 0, to, 1), "STARTED r2 "+p.WorkerId+"/1>"+to+"/1")
	c := h.expect(finishCmd("r2", 0, to, 1, true), "COMMITTED r2 "+p.WorkerId+"/1>"+to+"/1", "move r2>"+to).Placement
	if c.HolderId == "" || c.HolderId == to || c.ReservedBytes == 0 {
		t.Fatalf("after the commit: %v", c)
	}
	checkReservations(t, h.f.st)
}

// The destination fails, drains or restarts: the request stays on its
// source, untouched.
func TestDestinationLeavingAborts(t *testing.T) {
	for _, c := range []struct {
		name string
		cmd  *pb.Command
		want []string
	}{
		{"fails", markFailed("w3", 1), []string{"phase w3 FULL_SERVICE>FAILED", "ABORTED r1 w1/1>w3/1: destination left: w3 went FAILED: marked failed"}},
		{"drains", setPhase("w3", 1, draining), []string{"phase w3 FULL_SERVICE>DRAINING", "ABORTED r1 w1/1>w3/1: destination left: w3 went DRAINING: test"}},
		{"restarts", registerIn("w3", 2, fullService), []string{"phase w3 FULL_SERVICE>FAILED",
			"ABORTED r1 w1/1>w3/1: destination left: w3 went FAILED: restarted with a new incarnation", "phase w3 FAILED>FULL_SERVICE"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := migrationCluster(t)
			before := h.placement("r1")
			h.expect(migrateCmd("r1", 0, "w3", 1), "STARTED r1 w1/1>w3/1")
			h.expect(c.cmd, c.want...)
			if p := h.placement("r1"); !proto.Equal(p, before) {
				t.Fatalf("r1 %v, before the migration %v", p, before)
			}
			checkMigrations(t, h.f.st)
			checkReservations(t, h.f.st)
			h.wantErr(finishCmd("r1", 0, "w3", 1, true), ErrPlacementState, "RUNNING, not MIGRATING")
		})
	}
}

// The source fails mid-copy: under lumen the destination resumes the
// request from the pages it copied; under the baselines recovery is what it
// always was, and the destination is told to free its copy.
func TestSourceFailsMidMigration(t *testing.T) {
	t.Run("lumen reuses the copy", func(t *testing.T) {
		h := migrationCluster(t)
		h.expect(migrateCmd("r1", 0, "w3", 1), "STARTED r1 w1/1>w3/1")
		h.expect(markFailed("w1", 1), "phase w1 FULL_SERVICE>FAILED", "plan w1", "move r1>w3")
		p := h.placement("r1")
		if p.WorkerId != "w3" || p.State != recoveringS || p.Epoch != 1 || p.HolderId == "w3" || p.HolderId == "" || p.MigrationTarget != "" {
			t.Fatalf("r1 after its source failed: %v", p)
		}
		rp := h.f.Recoveries()[0]
		a := rp.Assignments[0]
		if a.TargetWorker != "w3" || a.Mode != pb.RecoveryMode_RECOVERY_MODE_REUSE || !a.MigrationCopy || a.CheckpointHolder != "w3" || a.NewHolder != p.HolderId {
			t.Fatalf("assignment %v", a)
		}
		checkMigrations(t, h.f.st)
		checkReservations(t, h.f.st)
		h.wantErr(finishCmd("r1", 0, "w3", 1, true), ErrStaleEpoch)
	})
	t.Run("fixed-checkpoint restores at the holder", func(t *testing.T) {
		h := migrationCluster(t)
		h.one(strategy(pb.Strategy_STRATEGY_FIXED_CHECKPOINT))
		h.expect(migrateCmd("r1", 0, "w3", 1), "STARTED r1 w1/1>w3/1")
		h.expect(markFailed("w1", 1), "phase w1 FULL_SERVICE>FAILED", "plan w1", "move r1>w2",
			"ABORTED r1 w1/1>w3/1: source failed: w1; the request recovers on w2")
		a := h.f.Recoveries()[0].Assignments[0]
		if a.TargetWorker != "w2" || a.Mode != pb.RecoveryMode_RECOVERY_MODE_REUSE || a.MigrationCopy || a.CheckpointHolder != "w2" {
			t.Fatalf("assignment %v", a)
		}
		checkMigrations(t, h.f.st)
		checkReservations(t, h.f.st)
	})
}

func TestCompletedWhileMigrating(t *testing.T) {
	h := migrationCluster(t)
	h.expect(migrateCmd("r1", 0, "w3", 1), "STARTED r1 w1/1>w3/1")
	h.expect(complete("r1"), "ABORTED r1 w1/1>w3/1: request completed")
	checkMigrations(t, h.f.st)
	checkReservations(t, h.f.st)
	h.wantErr(finishCmd("r1", 0, "w3", 1, true), ErrCompleted)

	// A session that expires ends its migrations the same way.
	h.one(createSession("s1", time.Second))
	p := h.one(dispatchIn("s1", "r2", 100, 28)).Dispatch.Placement
	to := "w2"
	if p.WorkerId == "w2" {
		to = "w3"
	}
	h.expect(migrateCmd("r2", 0, to, 1), "STARTED r2 "+p.WorkerId+"/1>"+to+"/1")
	h.advance(2 * time.Second)
	h.expect(noop(), "ABORTED r2 "+p.WorkerId+"/1>"+to+"/1: session expired")
	if h.placement("r2") != nil {
		t.Fatal("r2 outlived its session")
	}
	checkMigrations(t, h.f.st)
}

func TestMigrationSwitch(t *testing.T) {
	h := migrationCluster(t)
	if h.f.Migration() {
		t.Fatal("migration on by default")
	}
	h.expect(migrationMode(pb.MigrationMode_MIGRATION_MODE_ON))
	if s, _ := h.f.Strategy(); !h.f.Migration() || s != pb.Strategy_STRATEGY_LUMEN {
		t.Fatalf("after ON: migration %v, strategy %v", h.f.Migration(), s)
	}
	// A strategy change leaves the switch; UNCHANGED keeps it.
	h.expect(strategy(pb.Strategy_STRATEGY_FIXED_CHECKPOINT), "*lumenpb.Event_StrategyChanged")
	if !h.f.Migration() {
		t.Fatal("a strategy change turned migration off")
	}
	h.expect(migrationMode(pb.MigrationMode_MIGRATION_MODE_OFF))
	if s, _ := h.f.Strategy(); h.f.Migration() || s != pb.Strategy_STRATEGY_FIXED_CHECKPOINT {
		t.Fatalf("after OFF: migration %v, strategy %v", h.f.Migration(), s)
	}
	h.wantErr(migrationMode(7), ErrInvalid, "migration mode 7")
}

// A snapshot keeps the switch and the migrations in flight, and the
// restored replica finishes them as the original does.
func TestMigrationSnapshotRoundTrip(t *testing.T) {
	h := migrationCluster(t)
	h.one(migrationMode(pb.MigrationMode_MIGRATION_MODE_ON))
	h.expect(migrateCmd("r1", 0, "w3", 1), "STARTED r1 w1/1>w3/1")
	snap, _ := h.f.Snapshot()
	var s sink
	if err := snap.Persist(&s); err != nil {
		t.Fatal(err)
	}
	r := newHarness(t)
	r.index, r.stamp = h.index, h.stamp
	if err := r.f.Restore(io.NopCloser(bytes.NewReader(s.Bytes()))); err != nil {
		t.Fatal(err)
	}
	if !r.f.Migration() {
		t.Fatal("the switch did not survive the snapshot")
	}
	checkMigrations(t, r.f.st)
	for _, c := range []*pb.Command{finishCmd("r1", 0, "w3", 1, true), markFailed("w2", 1)} {
		a, b := h.one(c), r.one(proto.Clone(c).(*pb.Command))
		if !proto.Equal(a.Placement, b.Placement) || (a.Err == nil) != (b.Err == nil) {
			t.Fatalf("%v: %v %v, restored %v %v", c, a.Placement, a.Err, b.Placement, b.Err)
		}
	}
	s1, _ := h.f.MarshalSnapshot()
	s2, _ := r.f.MarshalSnapshot()
	if !bytes.Equal(s1, s2) {
		t.Fatal("snapshots differ after the same commands")
	}
}

func TestPlanMigrationsFromTables(t *testing.T) {
	h := migrationCluster(t)
	for i := 0; i < 6; i++ {
		if p := h.one(dispatch("q"+string(rune('a'+i)), 100, 28)).Dispatch.Placement; p.WorkerId != "w1" {
			t.Fatalf("dispatched to %s", p.WorkerId)
		}
	}
	// Off and nothing draining: nothing to plan.
	if plan, _ := h.f.PlanMigrations(nil); plan != nil {
		t.Fatalf("planned %v with migration off", plan)
	}
	// Now w1 is much less free than w3 (900 of 1000 pages used against 100).
	h.apply(load("w1", 1, 5, 900), load("w3", 1, 3, 100))
	h.one(migrationMode(pb.MigrationMode_MIGRATION_MODE_ON))
	plan, _ := h.f.PlanMigrations(nil)
	if len(plan) != 1 || plan[0].Drain || plan[0].Cmd.ToWorker != "w3" || !strings.HasPrefix(plan[0].Cmd.Reason, "balance: ") {
		t.Fatalf("balance plan %v", plan)
	}
	first := plan[0].Cmd.RequestId
	h.expect(&pb.Command{Body: &pb.Command_Migrate{Migrate: plan[0].Cmd}}, "STARTED "+first+" w1/1>w3/1")
	// One migration out of w1 (and into w3) at a time, and no other worker
	// has requests to move.
	if plan, _ := h.f.PlanMigrations(nil); len(plan) != 0 {
		t.Fatalf("planned %v with w1→w3 in flight", plan)
	}
	// w1's report lists qb as queued (no KV cache there): balance leaves it.
	ql := load("w1", 1, 5, 900)
	ql.GetReportLoad().Load.Queued = []string{"qb"}
	h.apply(ql)
	// Drain w1 with migration off: its running requests go, several into
	// one destination in a round (the freest, w3, has room for them all),
	// the one in flight into w3 notwithstanding; qb by re-dispatch.
	h.one(migrationMode(pb.MigrationMode_MIGRATION_MODE_OFF))
	h.expect(setPhase("w1", 1, draining), "phase w1 FULL_SERVICE>DRAINING")
	plan, _ = h.f.PlanMigrations(nil)
	if len(plan) != 6 || plan[0].Cmd.RequestId != "qb" || !plan[0].Redispatch || !strings.Contains(plan[0].Cmd.Reason, "re-dispatched") {
		t.Fatalf("drain plan %v", plan)
	}
	for _, m := range plan {
		if !m.Drain || h.placement(m.Cmd.RequestId).WorkerId != "w1" || m.Cmd.RequestId == first || m.Cmd.ToWorker != "w3" ||
			m.Redispatch != (m.Cmd.RequestId == "qb") {
			t.Fatalf("drain plan %v", m)
		}
		if r := h.one(&pb.Command{Body: &pb.Command_Migrate{Migrate: m.Cmd}}); r.Err != nil {
			t.Fatal(r.Err)
		}
	}
	// The stage timeout finds them by their start.
	if due := h.f.MigrationsStartedBefore(h.stamp-int64(time.Hour), "timeout"); len(due) != 0 {
		t.Fatalf("due an hour ago: %v", due)
	}
	due := h.f.MigrationsStartedBefore(h.stamp+1, "timeout")
	if len(due) != 7 || !slices.IsSortedFunc(due, func(a, b *pb.FinishMigrationCmd) int { return strings.Compare(a.RequestId, b.RequestId) }) {
		t.Fatalf("due now: %v", due)
	}
	for _, c := range due {
		if r := h.one(&pb.Command{Body: &pb.Command_FinishMigration{FinishMigration: c}}); r.Err != nil || r.Placement.State != running {
			t.Fatalf("timeout abort %v: %v %v", c, r.Placement, r.Err)
		}
	}
	checkMigrations(t, h.f.st)
}

// TestNewLeaderKeepsMigrationClock (issue 21, defect 11): the stage timeout
// compares the leader's clock with the migration's start stamp, which the
// leader that started it wrote. A new leader whose clock is 30 s ahead used
// to find every migration 30 s old and abort them all at once; its first
// command (NewLeaderCmd) moves the starts forward by the time no leader
// stamped, so what elapsed under the old leader still counts and nothing
// more.
func TestNewLeaderKeepsMigrationClock(t *testing.T) {
	const timeout = 10 * time.Second
	h := migrationCluster(t)
	h.one(migrateCmd("r1", 0, "w3", 1))
	h.advance(4 * time.Second) // the copy runs 4 s under the old leader
	h.one(noop())
	// The old leader goes; the new one's clock is 30 s ahead.
	h.advance(30 * time.Second)
	h.one(NewLeaderCmd())
	now := h.stamp // the new leader's clock
	if aborts := h.f.MigrationsStartedBefore(now-int64(timeout), ReasonTimeout); len(aborts) != 0 {
		t.Fatalf("the new leader's first round aborts %v: a clock ahead is not a stage timeout", aborts)
	}
	// 4 s counted already: 6 s more by the new leader's clock is the timeout.
	if p := h.placement("r1"); now-p.MigrationStartedUnixNano != int64(4*time.Second)+1000 {
		t.Fatalf("the migration counts %s on the new leader, want the 4 s it ran under the old one",
			time.Duration(now-p.MigrationStartedUnixNano))
	}
	later := now + int64(6*time.Second) + 2000
	if aborts := h.f.MigrationsStartedBefore(later-int64(timeout), ReasonTimeout); len(aborts) != 1 || aborts[0].RequestId != "r1" {
		t.Fatalf("6 s later on the new leader: aborts %v, want r1's", aborts)
	}
	checkMigrations(t, h.f.st)
}
