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

// Workers returns the workers, their load records and the checkpoint
// reservations on each, sorted by id, and the applied index they reflect.
func (f *FSM) Workers() ([]*pb.Worker, []*pb.LoadRecord, []*pb.HolderReservation, uint64) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	ws := make([]*pb.Worker, 0, len(f.st.ids))
	rs := make([]*pb.HolderReservation, 0, len(f.st.ids))
	var ls []*pb.LoadRecord
	for i, id := range f.st.ids {
		ws = append(ws, f.st.workers[id])
		if l, ok := f.st.loads[id]; ok {
			ls = append(ls, l)
		}
		v := &f.st.views[i]
		rs = append(rs, &pb.HolderReservation{WorkerId: id, ReservedBytes: v.Reserved, BudgetBytes: v.CheckpointBudget, Held: v.Held})
	}
	return ws, ls, rs, f.applied.get()
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
