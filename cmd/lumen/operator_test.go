package main

import (
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func TestFormatEvent(t *testing.T) {
	at := int64(1_700_000_000_123_000_000) // 2023-11-14T22:13:20.123Z
	cases := []struct {
		ev   *pb.Event
		want string
	}{
		{&pb.Event{Index: 7, Seq: 1, UnixNano: at, Body: &pb.Event_Paired{Paired: &pb.WorkerPaired{
			DrafterId: "d", DrafterIncarnation: 2, TargetId: "b", TargetIncarnation: 1, Paired: true, Reason: "highest q_w"}}},
			"7.1  2023-11-14T22:13:20.123Z  paired   drafter d/2 drafts for b/1 (highest q_w)"},
		{&pb.Event{Index: 9, UnixNano: at, Body: &pb.Event_Paired{Paired: &pb.WorkerPaired{
			DrafterId: "d", DrafterIncarnation: 2, TargetId: "b", TargetIncarnation: 1, Reason: "target b went FAILED"}}},
			"9.0  2023-11-14T22:13:20.123Z  unpaired drafter d/2 no longer drafts for b/1 (target b went FAILED)"},
		{&pb.Event{Index: 9, UnixNano: at, Body: &pb.Event_PhaseChanged{PhaseChanged: &pb.WorkerPhaseChanged{
			WorkerId: "d", Incarnation: 2, From: pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT, To: pb.WorkerPhase_WORKER_PHASE_ASSIST}}},
			"9.0  2023-11-14T22:13:20.123Z  phase    d/2 LOADING_DRAFT -> ASSIST"},
		{&pb.Event{Index: 3, UnixNano: at, Body: &pb.Event_RecoveryPlan{RecoveryPlan: &pb.RecoveryPlan{Id: 1, FailedWorker: "a", FailedIncarnation: 1,
			Assignments: []*pb.RecoveryAssignment{{Mode: pb.RecoveryMode_RECOVERY_MODE_REUSE}, {Mode: pb.RecoveryMode_RECOVERY_MODE_RECOMPUTE}}}}},
			"3.0  2023-11-14T22:13:20.123Z  recovery plan 1 for a/1: 2 requests, 1 reuse a checkpoint, 1 recompute"},
		{&pb.Event{Index: 3, Seq: 2, UnixNano: at, Body: &pb.Event_PlacementMoved{PlacementMoved: &pb.PlacementMoved{
			Placement: &pb.Placement{RequestId: "r1", WorkerId: "b", WorkerIncarnation: 1}, FromWorker: "a", Reason: "recovery"}}},
			"3.2  2023-11-14T22:13:20.123Z  moved    r1 a -> b/1, holder none (recovery)"},
		{&pb.Event{Index: 4, UnixNano: at, Body: &pb.Event_StrategyChanged{StrategyChanged: &pb.StrategyChanged{
			From: pb.Strategy_STRATEGY_LUMEN, To: pb.Strategy_STRATEGY_STOP_AND_RESTART}}},
			"4.0  2023-11-14T22:13:20.123Z  strategy lumen -> stop-and-restart"},
		{&pb.Event{Index: 5, UnixNano: at, Body: &pb.Event_Migration{Migration: &pb.Migration{Stage: pb.Migration_STAGE_STARTED,
			Placement: &pb.Placement{RequestId: "r1", WorkerId: "a"}, FromWorker: "a", FromIncarnation: 1, ToWorker: "b", ToIncarnation: 2,
			Reason: "balance: freeness 1.0 at a, 90.0 at b"}}},
			"5.0  2023-11-14T22:13:20.123Z  migrate  r1 a/1 -> b/2 started (balance: freeness 1.0 at a, 90.0 at b)"},
		{&pb.Event{Index: 6, UnixNano: at, Body: &pb.Event_Migration{Migration: &pb.Migration{Stage: pb.Migration_STAGE_COMMITTED,
			Placement: &pb.Placement{RequestId: "r1", WorkerId: "b", Epoch: 1, HolderId: "c"}, FromWorker: "a", FromIncarnation: 1, ToWorker: "b", ToIncarnation: 2}}},
			"6.0  2023-11-14T22:13:20.123Z  migrate  r1 a/1 -> b/2 committed, epoch 1, holder c"},
		{&pb.Event{Index: 7, UnixNano: at, Body: &pb.Event_Migration{Migration: &pb.Migration{Stage: pb.Migration_STAGE_ABORTED,
			Placement: &pb.Placement{RequestId: "r1", WorkerId: "a"}, FromWorker: "a", FromIncarnation: 1, ToWorker: "b", ToIncarnation: 2,
			Reason: "destination left: b went FAILED"}}},
			"7.0  2023-11-14T22:13:20.123Z  migrate  r1 a/1 -> b/2 aborted (destination left: b went FAILED)"},
		{&pb.Event{Index: 8, UnixNano: at, Body: &pb.Event_RecoveryPlan{RecoveryPlan: &pb.RecoveryPlan{Id: 2, FailedWorker: "a", FailedIncarnation: 1,
			Assignments: []*pb.RecoveryAssignment{{Mode: pb.RecoveryMode_RECOVERY_MODE_REUSE, MigrationCopy: true}, {Mode: pb.RecoveryMode_RECOVERY_MODE_REUSE}}}}},
			"8.0  2023-11-14T22:13:20.123Z  recovery plan 2 for a/1: 2 requests, 2 reuse a checkpoint, 0 recompute (1 of the reuses a migration's copy)"},
	}
	for _, c := range cases {
		if got := formatEvent(c.ev); got != c.want {
			t.Errorf("got\n  %q\nwant\n  %q", got, c.want)
		}
	}
}

func TestPairedColumn(t *testing.T) {
	for _, c := range []struct {
		w    *pb.Worker
		want string
	}{
		{&pb.Worker{Phase: pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE}, "-"},
		{&pb.Worker{Phase: pb.WorkerPhase_WORKER_PHASE_ASSIST, PairedWorker: "b"}, "drafts for b"},
		{&pb.Worker{Phase: pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, PairedWorker: "d"}, "drafter d"},
	} {
		if got := pairedColumn(c.w); got != c.want {
			t.Errorf("%v: %q, want %q", c.w, got, c.want)
		}
	}
}

func TestStrategyRequest(t *testing.T) {
	for _, c := range []struct {
		name, migration string
		lambda          float64
		want            *pb.SetStrategyRequest
		err             string
	}{
		{"lumen", "", 0, &pb.SetStrategyRequest{Strategy: pb.Strategy_STRATEGY_LUMEN}, ""},
		{"", "on", 0, &pb.SetStrategyRequest{Migration: pb.MigrationMode_MIGRATION_MODE_ON}, ""},
		{"fixed-checkpoint", "off", 2, &pb.SetStrategyRequest{Strategy: pb.Strategy_STRATEGY_FIXED_CHECKPOINT, Lambda: 2, Migration: pb.MigrationMode_MIGRATION_MODE_OFF}, ""},
		{"stop-and-restart", "", 0, &pb.SetStrategyRequest{Strategy: pb.Strategy_STRATEGY_STOP_AND_RESTART}, ""},
		{"recompute", "", 0, &pb.SetStrategyRequest{Strategy: pb.Strategy_STRATEGY_RECOMPUTE}, ""},
		{"", "", 0.5, &pb.SetStrategyRequest{Lambda: 0.5}, ""},
		{"", "", 0, nil, "nothing to set"},
		{"", "yes", 0, nil, `-migration "yes": use on or off`},
		{"fast", "", 0, nil, `unknown strategy "fast": use lumen, fixed-checkpoint, stop-and-restart or recompute`},
	} {
		got, err := strategyRequest(c.name, c.lambda, c.migration, 0)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%q %q %v: error %v, want %q", c.name, c.migration, c.lambda, err, c.err)
			}
			continue
		}
		if err != nil || !proto.Equal(got, c.want) {
			t.Errorf("%q %q %v: %v %v, want %v", c.name, c.migration, c.lambda, got, err, c.want)
		}
	}
}

// TestStrategyRequestReplicas: -checkpoint-replicas alone is something to
// set, and goes in the request.
func TestStrategyRequestReplicas(t *testing.T) {
	got, err := strategyRequest("", 0, "", 2)
	if want := (&pb.SetStrategyRequest{CheckpointReplicas: 2}); err != nil || !proto.Equal(got, want) {
		t.Fatalf("%v %v, want %v", got, err, want)
	}
}

func TestResolveTwoWordCommands(t *testing.T) {
	for _, c := range []struct {
		args []string
		name string
		rest int
	}{
		{[]string{"worker", "drain", "w1"}, "worker drain", 1},
		{[]string{"worker", "-id", "w1"}, "worker", 2},
		{[]string{"strategy", "set", "lumen"}, "strategy set", 1},
		{[]string{"migrate", "r1", "-to", "w2"}, "migrate", 3},
	} {
		if name, rest := resolve(c.args[0], c.args[1:]); name != c.name || len(rest) != c.rest {
			t.Errorf("%v: %q %v", c.args, name, rest)
		}
	}
}

func TestDrainSummaryAndMigrationsColumn(t *testing.T) {
	before := &pb.Worker{Id: "w1", Incarnation: 3, Phase: pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE}
	after := &pb.Worker{Id: "w1", Incarnation: 3, Phase: pb.WorkerPhase_WORKER_PHASE_DRAINING}
	if s := drainSummary(before, after, 32, 9); !strings.HasPrefix(s, "worker w1 (incarnation 3): FULL_SERVICE -> DRAINING at index 9") ||
		!strings.Contains(s, "migrates the 32 it runs") {
		t.Errorf("summary %q", s)
	}
	if s := drainSummary(after, after, 32, 9); s != "worker w1 (incarnation 3) was already draining\n" {
		t.Errorf("summary %q", s)
	}
	if migrationsColumn(nil) != "-" || migrationsColumn(&pb.WorkerMigrations{Out: 1, In: 2}) != "1/2" {
		t.Error("migrations column")
	}
}
