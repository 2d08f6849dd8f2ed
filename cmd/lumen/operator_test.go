package main

import (
	"testing"

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
