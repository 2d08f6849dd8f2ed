package fsm

import (
	"slices"
	"sync"

	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// The load table (issue 16): what a gateway needs to choose serving
// workers as Apply would — policy's view of each worker, as rows that
// internal/placer.View turns back into the same policy.Worker fields
// PickServing reads.

// loadCache is the last table built, and the views it was built from: a
// call that finds the views unchanged returns it as it is.
type loadCache struct {
	mu      sync.Mutex
	version uint64
	table   *pb.LoadTable
	views   []policy.Worker
	incs    []uint64
	phases  []pb.WorkerPhase
	// sessions is the table's gateway sessions (state.gatewaySessions).
	sessions []string
}

// LoadTable returns the load table as of the applied index, and its
// version: a number that grows each time the table's rows change (the
// applied index alone moving does not change it). The table is shared:
// callers must not modify it. It is cheap to call: O(workers) comparisons
// under the read lock, and a new table only when a row changed. Wait for
// the next change with WaitApplied(table.AppliedIndex+1) and call again.
func (f *FSM) LoadTable() (*pb.LoadTable, uint64) {
	c := &f.load
	c.mu.Lock()
	defer c.mu.Unlock()
	f.mu.RLock()
	applied := f.applied.get()
	if c.table != nil && c.table.AppliedIndex == applied {
		f.mu.RUnlock()
		return c.table, c.version
	}
	st := f.st
	sessions := st.gatewaySessions()
	same := len(st.ids) == len(c.views) && slices.Equal(sessions, c.sessions)
	for i := 0; same && i < len(st.ids); i++ {
		w := st.rows[i]
		same = loadFields(st.views[i]) == c.views[i] && w.Incarnation == c.incs[i] && w.Phase == c.phases[i]
	}
	if same && c.table != nil {
		f.mu.RUnlock()
		// Same rows at a later index: a new header, the rows shared.
		c.table = &pb.LoadTable{AppliedIndex: applied, Workers: c.table.Workers, Sessions: c.sessions}
		return c.table, c.version
	}
	// A new slice of rows (the last table's is its holders'), each row
	// that did not change shared with the last table: rows are
	// read-only, and at 1,000 workers a cell a table differs from the
	// last in a few dozen rows, where rebuilding all of them was 13% of
	// the simulator's CPU (four gateways a cell, a table each every
	// 10 ms) and most of its garbage.
	var prev []*pb.WorkerLoad
	if c.table != nil && len(c.table.Workers) == len(c.views) {
		prev = c.table.Workers
	}
	rows := make([]*pb.WorkerLoad, len(st.ids))
	n := len(c.views)
	for i, id := range st.ids {
		w, v := st.rows[i], loadFields(st.views[i])
		if i < n && prev != nil && v == c.views[i] && w.Incarnation == c.incs[i] && w.Phase == c.phases[i] {
			rows[i] = prev[i] // v.ID == id: the same worker's row
			continue
		}
		if i < n {
			c.views[i], c.incs[i], c.phases[i] = v, w.Incarnation, w.Phase
		} else {
			c.views = append(c.views, v)
			c.incs = append(c.incs, w.Incarnation)
			c.phases = append(c.phases, w.Phase)
		}
		rows[i] = &pb.WorkerLoad{WorkerId: id, Incarnation: w.Incarnation, Phase: w.Phase,
			Load: &pb.LoadRecord{WorkerId: id, Incarnation: w.Incarnation, QueueWaitMs: v.QueueWaitMs,
				KvPagesTotal: v.KVPagesTotal, KvPagesUsed: v.KVPagesUsed, QueueHeadPages: v.QueueHeadPages, QueuedPages: v.QueuedPages,
				Running: v.Running, Waiting: v.Waiting, HighPriority: v.HighPriority},
			PendingRequests: v.PendingRequests, PendingPages: v.PendingPages}
	}
	c.views, c.incs, c.phases = c.views[:len(st.ids)], c.incs[:len(st.ids)], c.phases[:len(st.ids)]
	c.sessions = sessions
	f.mu.RUnlock()
	c.version++
	c.table = &pb.LoadTable{AppliedIndex: applied, Workers: rows, Sessions: c.sessions}
	return c.table, c.version
}

// loadFields is the part of a view the load table carries: what
// PickServing reads (the checkpoint accounting stays Apply's, for h(r)).
func loadFields(v policy.Worker) policy.Worker {
	return policy.Worker{ID: v.ID, Eligible: v.Eligible, Draining: v.Draining, QueueWaitMs: v.QueueWaitMs,
		KVPagesTotal: v.KVPagesTotal, KVPagesUsed: v.KVPagesUsed, QueueHeadPages: v.QueueHeadPages, QueuedPages: v.QueuedPages,
		Running: v.Running, Waiting: v.Waiting, HighPriority: v.HighPriority, PendingRequests: v.PendingRequests, PendingPages: v.PendingPages}
}

// LoadViews returns the FSM's views restricted to the load table's fields,
// sorted by worker id, and the applied index: what placer.View of each row
// of LoadTable at that index must equal.
func (f *FSM) LoadViews() ([]policy.Worker, uint64) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make([]policy.Worker, len(f.st.views))
	for i, v := range f.st.views {
		out[i] = loadFields(v)
	}
	return out, f.applied.get()
}

// Placements returns the placements of ids found, in the order of ids, the
// ids with none, and the applied index, all under one read lock.
func (f *FSM) Placements(ids []string) (found []*pb.Placement, notFound []string, applied uint64) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	found = make([]*pb.Placement, 0, len(ids))
	for _, id := range ids {
		if p, ok := f.st.placements[id]; ok {
			found = append(found, p)
		} else {
			notFound = append(notFound, id)
		}
	}
	return found, notFound, f.applied.get()
}
