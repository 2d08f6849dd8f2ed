package core

import pb "github.com/lumen-project/lumen/proto/lumenpb"

// Paired reports whether the worker table's rows pair drafter with target
// for progressive recovery: each names the other, the drafter is in ASSIST
// and the target in full service. Apply pairs only such workers and ends a
// pairing at any phase change or registration of either (package fsm), so
// rows that agree are a pairing, and a stale row is not. It is the one
// check of a pairing: the target's before it takes a drafter's Assist
// stream, the drafter's before it opens one and while it assists, and the
// simulator's. Each side also checks the incarnation it knows (the drafter
// its own; the target the one the drafter claims).
func Paired(drafter, target *pb.Worker) bool {
	return drafter != nil && target != nil && drafter.Id != "" && target.Id != "" &&
		drafter.PairedWorker == target.Id && target.PairedWorker == drafter.Id &&
		drafter.Phase == pb.WorkerPhase_WORKER_PHASE_ASSIST && target.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE
}
