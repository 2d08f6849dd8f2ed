package fsm

import (
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Placement returns the placement of a request, or nil, and the applied index
// the answer reflects.
func (f *FSM) Placement(id string) (*pb.Placement, uint64) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.placements[id], f.applied.get()
}

// WorkerTable is the worker table as one read saw it.
type WorkerTable struct {
	// Workers, their load records and the checkpoint reservations on
	// each, sorted by id.
	Workers      []*pb.Worker
	Loads        []*pb.LoadRecord
	Reservations []*pb.HolderReservation
	// Migrations in flight out of and into each worker that has any.
	Migrations []*pb.WorkerMigrations
	// AppliedIndex is the index the table reflects.
	AppliedIndex uint64
}

// Workers returns the worker table.
func (f *FSM) Workers() WorkerTable {
	f.mu.RLock()
	defer f.mu.RUnlock()
	t := WorkerTable{Workers: make([]*pb.Worker, 0, len(f.st.ids)),
		Reservations: make([]*pb.HolderReservation, 0, len(f.st.ids)), AppliedIndex: f.applied.get()}
	for i, id := range f.st.ids {
		t.Workers = append(t.Workers, f.st.workers[id])
		if l, ok := f.st.loads[id]; ok {
			t.Loads = append(t.Loads, l)
		}
		v := &f.st.views[i]
		t.Reservations = append(t.Reservations, &pb.HolderReservation{WorkerId: id, ReservedBytes: v.Reserved, BudgetBytes: v.CheckpointBudget, Held: v.Held})
		var out uint32
		for rid := range f.st.serving[id] {
			if migrating(f.st.placements[rid]) {
				out++
			}
		}
		if in := uint32(len(f.st.incoming[id])); in > 0 || out > 0 {
			t.Migrations = append(t.Migrations, &pb.WorkerMigrations{WorkerId: id, Out: out, In: in})
		}
	}
	return t
}

// Worker returns one worker's row, or nil.
func (f *FSM) Worker(id string) *pb.Worker {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.workers[id]
}

// Strategy returns the cluster's strategy and h(r)'s lambda.
func (f *FSM) Strategy() (pb.Strategy, float64) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.strategy, f.st.lambda
}

// Counts returns the number of workers and of placements.
func (f *FSM) Counts() (workers, placements int) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return len(f.st.workers), len(f.st.placements)
}

// Recoveries returns the recovery table, oldest plan first.
func (f *FSM) Recoveries() []*pb.RecoveryPlan {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return append([]*pb.RecoveryPlan(nil), f.st.recoveries...)
}

// HolderUsage returns, per worker id, the checkpoint bytes reserved on it and
// its budget.
func (f *FSM) HolderUsage() map[string][2]uint64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make(map[string][2]uint64, len(f.st.ids))
	for i, id := range f.st.ids {
		out[id] = [2]uint64{f.st.views[i].Reserved, f.st.views[i].CheckpointBudget}
	}
	return out
}

// CheckpointReplicas returns the copies of each new placement's checkpoint
// (SetStrategyCmd.checkpoint_replicas; 1 by default).
func (f *FSM) CheckpointReplicas() uint32 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.replicas
}

// DomainCounts returns, over this replica's applies since it started or
// last restored a snapshot, the placements whose first checkpoint copy
// had to go to a worker of the serving worker's own node (no worker
// outside it had the budget: policy.HolderChoice.SameDomain), and those
// that got fewer copies than CheckpointReplicas (Short).
func (f *FSM) DomainCounts() (sameDomain, shortReplicas uint64) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.sameDomain, f.st.shortReplicas
}

// ReplicatedCopies returns, of the requests worker id serves, those with
// more than one checkpoint copy, grouped by the holders of their copies:
// holder → request ids. The leader asks each holder what it holds of
// them before it proposes the worker's MarkFailed (issue 24); with one
// copy a request has nothing to choose between.
func (f *FSM) ReplicatedCopies(id string) map[string][]string {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out map[string][]string
	for _, rid := range sortedKeys(f.st.serving[id]) {
		p := f.st.placements[rid]
		if p == nil || p.HolderId == "" || len(p.ReplicaHolders) == 0 {
			continue
		}
		if out == nil {
			out = make(map[string][]string)
		}
		out[p.HolderId] = append(out[p.HolderId], rid)
		for _, h := range p.ReplicaHolders {
			out[h] = append(out[h], rid)
		}
	}
	return out
}
