// Package placer is a gateway's replica of the load table, from which it
// chooses the serving worker of a new request without waiting for Raft
// (issue 16): the request starts on that worker at once and its placement
// commits in parallel.
//
// The replica is the last LoadTable a controller sent (WatchLoad: the
// FSM's own views, stale by the replica's lag) plus the placements this
// gateway made that the table does not count yet: those not committed, and
// those committed after the table's applied index. The choice is
// policy.PickServing over that view — the function Apply runs — so one
// gateway with a fresh table chooses what Apply would; several gateways
// each miss the others' placements of the last interval. The package is
// pure and deterministic (no clock, no I/O): the gateway and the simulator
// run the same code.
package placer

import (
	"slices"
	"sort"
	"sync"

	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// own is a placement this gateway made that the table may not count yet.
type own struct {
	worker string
	pages  uint64
	index  uint64 // commit index; 0 while not committed
	seq    uint64 // the Take that made it, for the oldest-first cap
}

// MaxOwn is the most placements a replica counts that no table counts yet.
// While tables stop coming (the replica watched stalls, an outage of the
// controllers) every new request adds one and none leaves; past MaxOwn the
// oldest is dropped, the likeliest to be counted by the table held already
// or finished. A cap, not an age: the package has no clock (the simulator
// runs it too), and a cap bounds the memory whatever the request rate. At
// 16,384 it is far above what one gateway places between two tables
// (thousands a second at most, tables every 10 ms, commits in tens of
// milliseconds), so it drops nothing while tables come.
const MaxOwn = 1 << 14

// ownRef names an own placement in the order of Takes.
type ownRef struct {
	id  string
	seq uint64
}

// Replica is safe for concurrent use.
type Replica struct {
	mu      sync.Mutex
	views   []policy.Worker  // sorted by ID, as the FSM keeps them
	incs    []uint64         // incarnation of views[i]
	rows    []*pb.WorkerLoad // the last table's rows when in views' order (updateRows), else nil
	applied uint64
	tables  uint64
	own     map[string]own
	// ownBy sums own by worker, so a choice costs O(workers), not
	// O(own placements): with thousands of placements a second in
	// flight, iterating own on every Take was the largest CPU cost of a
	// gateway-like client in lumen bench controller.
	ownBy map[string]ownSum
	// order is own's ids in the order Take made them, oldest first, with
	// entries since dropped or taken again (seq differs) left in until
	// the cap or a compaction passes them; seq numbers the Takes.
	order []ownRef
	seq   uint64

	// The share (share.go): gateway g of G, from SetShare or from the
	// tables' sessions and this gateway's own (self).
	g, G     int
	self     string
	sessions []string

	scratch  []policy.Worker // scratchViews' buffer
	overlaps []int           // TakePrefix's buffer
	// The choice's index (tree.go): cur is viewsLocked() kept up to date
	// while curOK, trees a tournament tree per share over cur's freeness
	// (built for treeG shares), vreq and vpages a Take's virtual
	// placements by worker (zero between Takes).
	cur    []policy.Worker
	trees  []freeTree
	treeG  int
	curOK  bool
	vreq   []uint32
	vpages []uint64
}

type ownSum struct {
	requests uint32
	pages    uint64
}

func (r *Replica) addOwn(id string, o own) {
	if old, ok := r.own[id]; ok {
		r.dropOwn(id, old)
	}
	r.own[id] = o
	s := r.ownBy[o.worker]
	s.requests++
	s.pages += o.pages
	r.ownBy[o.worker] = s
	r.curOwn(o, +1)
}

func (r *Replica) dropOwn(id string, o own) {
	delete(r.own, id)
	s := r.ownBy[o.worker]
	s.requests--
	s.pages -= o.pages
	if s.requests == 0 {
		delete(r.ownBy, o.worker)
	} else {
		r.ownBy[o.worker] = s
	}
	r.curOwn(o, -1)
}

// New returns an empty replica: Choose finds no worker until the first
// table arrives.
func New() *Replica { return &Replica{own: map[string]own{}, ownBy: map[string]ownSum{}, G: 1} }

// View turns a load table row into policy's view of the worker, the fields
// PickServing reads exactly as the FSM holds them.
func View(w *pb.WorkerLoad) policy.Worker {
	l := w.GetLoad()
	return policy.Worker{
		ID:              w.WorkerId,
		Eligible:        w.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE,
		Draining:        w.Phase == pb.WorkerPhase_WORKER_PHASE_DRAINING,
		QueueWaitMs:     l.GetQueueWaitMs(),
		KVPagesTotal:    l.GetKvPagesTotal(),
		KVPagesUsed:     l.GetKvPagesUsed(),
		QueueHeadPages:  l.GetQueueHeadPages(),
		QueuedPages:     l.GetQueuedPages(),
		Running:         l.GetRunning(),
		Waiting:         l.GetWaiting(),
		HighPriority:    l.GetHighPriority(),
		PendingRequests: w.PendingRequests,
		PendingPages:    w.PendingPages,
	}
}

// Update replaces the table. A table older than the one held (a lagging
// replica after a reconnect) is ignored. Own placements the new table
// counts (committed at or below its applied index) are dropped.
func (r *Replica) Update(t *pb.LoadTable) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if t.AppliedIndex < r.applied {
		return
	}
	if !r.updateRows(t.Workers) {
		r.curOK = false
		ws := slices.Clone(t.Workers)
		sort.Slice(ws, func(i, j int) bool { return ws[i].WorkerId < ws[j].WorkerId })
		r.views = r.views[:0]
		r.incs = r.incs[:0]
		for _, w := range ws {
			r.views = append(r.views, View(w))
			r.incs = append(r.incs, w.Incarnation)
		}
		if !slices.Equal(ws, t.Workers) {
			ws = nil // rows is aligned with views, or nil
		}
		r.rows = ws
	} else {
		r.rows = t.Workers
	}
	r.applied = t.AppliedIndex
	r.tables++
	g, G := r.g, r.G
	r.sessions = slices.Clone(t.Sessions) // in the table's order: it is the shares'
	r.shareFromSessions()
	if r.g != g || r.G != G {
		r.curOK = false
	}
	for id, o := range r.own {
		if o.index != 0 && o.index <= t.AppliedIndex {
			r.dropOwn(id, o)
		}
	}
}

// updateRows takes a table whose rows name the workers the replica holds,
// in the same order (the FSM's, sorted by id), row by row: a row that is
// the last table's own (the FSM shares the rows that did not change) or
// whose view did not change is skipped, and a changed one replaces its
// view and, while the choice's trees are built, its entry in cur and its
// leaf — what ensureTree would rebuild from scratch, in O(changed rows ×
// log n) instead of O(n). At 1,000 workers a cell and four gateways a
// table differs from the last in a few dozen rows. It reports false,
// changing nothing, for a table of other workers or in another order.
func (r *Replica) updateRows(ws []*pb.WorkerLoad) bool {
	if len(ws) != len(r.views) {
		return false
	}
	same := len(r.rows) == len(ws)
	for i, w := range ws {
		if !(same && w == r.rows[i]) && w.WorkerId != r.views[i].ID {
			return false
		}
	}
	for i, w := range ws {
		if same && w == r.rows[i] {
			continue
		}
		v := View(w)
		if v == r.views[i] && w.Incarnation == r.incs[i] {
			continue
		}
		r.views[i], r.incs[i] = v, w.Incarnation
		if r.curOK {
			if s, ok := r.ownBy[v.ID]; ok {
				v.PendingRequests += s.requests
				v.PendingPages += s.pages
			}
			r.cur[i] = v
			r.setLeaf(i)
		}
	}
	return true
}

// Applied returns the applied index of the table held, and how many tables
// were taken.
func (r *Replica) Applied() (index, tables uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.applied, r.tables
}

// Views returns the view Choose decides from: the table plus this
// gateway's placements it does not count.
func (r *Replica) Views() []policy.Worker {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.viewsLocked()
}

func (r *Replica) viewsLocked() []policy.Worker {
	return r.viewsInto(nil)
}

// scratchViews is viewsLocked in a buffer the replica reuses, for a choice
// made under r.mu after ensureTree whose views do not outlive it
// (TakePrefix). At 1,024 workers a fresh clone was a 150 KB allocation,
// zeroed, per request. It copies cur, which already counts the own
// placements (tree.go; checkTrees holds cur to viewsLocked): adding them
// again from ownBy was a map lookup per worker, 1,024 of them per request.
func (r *Replica) scratchViews() []policy.Worker {
	r.scratch = append(r.scratch[:0], r.cur...)
	return r.scratch
}

func (r *Replica) viewsInto(vs []policy.Worker) []policy.Worker {
	vs = append(vs, r.views...)
	if len(r.ownBy) == 0 {
		return vs
	}
	for i := range vs {
		if s, ok := r.ownBy[vs[i].ID]; ok {
			vs[i].PendingRequests += s.requests
			vs[i].PendingPages += s.pages
		}
	}
	return vs
}

func (r *Replica) find(id string) (int, bool) {
	i := sort.Search(len(r.views), func(i int) bool { return r.views[i].ID >= id })
	return i, i < len(r.views) && r.views[i].ID == id
}

// Take chooses the serving worker of a new request — the freest eligible
// worker of the view (one of several gateways: see share.go), excluding the ones named (a worker that just refused
// or failed the request) — and counts the request there until a table
// counts it. ok is false when no worker is eligible.
func (r *Replica) Take(requestID string, promptTokens uint32, exclude ...string) (worker string, incarnation uint64, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	// What PickShared (several gateways) or policy.PickServing (one)
	// chooses over viewsLocked() with exclude made ineligible, from the
	// trees (tree.go) instead of scans.
	r.ensureTree()
	pages := policy.Pages(uint64(promptTokens))
	i := r.pickLocked(pages, exclude, ShareBias)
	if i < 0 {
		return "", 0, false
	}
	id, inc := r.cur[i].ID, r.incs[i]
	r.seq++
	r.addOwn(requestID, own{worker: id, pages: pages, seq: r.seq})
	r.order = append(r.order, ownRef{id: requestID, seq: r.seq})
	r.capOwnLocked()
	return id, inc, true
}

// TakeAt counts a new request on worker, which the caller chose (the
// gateway's samples of one request after the first go where the first
// runs, to share its prompt's cached pages), when the view holds that
// worker eligible; it returns the incarnation the view knows. ok is false
// when the view does not hold it eligible (the caller places the request
// as any other).
func (r *Replica) TakeAt(requestID, worker string, promptTokens uint32) (incarnation uint64, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	i, found := r.find(worker)
	if !found || !r.views[i].Eligible {
		return 0, false
	}
	r.seq++
	r.addOwn(requestID, own{worker: worker, pages: policy.Pages(uint64(promptTokens)), seq: r.seq})
	r.order = append(r.order, ownRef{id: requestID, seq: r.seq})
	r.capOwnLocked()
	return r.incs[i], true
}

// capOwnLocked drops the oldest own placements past MaxOwn, and compacts
// order once most of it names placements no longer counted. r.mu must be
// held.
func (r *Replica) capOwnLocked() {
	live := func(ref ownRef) bool { o, ok := r.own[ref.id]; return ok && o.seq == ref.seq }
	k := 0
	for len(r.own) > MaxOwn && k < len(r.order) {
		if ref := r.order[k]; live(ref) {
			r.dropOwn(ref.id, r.own[ref.id])
		}
		k++
	}
	r.order = r.order[k:]
	if len(r.order) > 2*len(r.own)+64 {
		kept := make([]ownRef, 0, 2*len(r.own)+1)
		for _, ref := range r.order {
			if live(ref) {
				kept = append(kept, ref)
			}
		}
		r.order = kept
	}
}

// Committed records that the request's placement committed at index (on
// its worker, which may differ from the one Take chose when Apply placed
// it): the request stays counted until a table at or past index arrives.
func (r *Replica) Committed(requestID, worker string, index uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	o, ok := r.own[requestID]
	if !ok {
		return
	}
	if index <= r.applied {
		r.dropOwn(requestID, o)
		return
	}
	o.worker, o.index = worker, index
	r.addOwn(requestID, o)
}

// Forget drops a request Take counted that will not be placed there (its
// placement was refused, or the gateway gave it up).
func (r *Replica) Forget(requestID string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if o, ok := r.own[requestID]; ok {
		r.dropOwn(requestID, o)
	}
}

// Pending returns how many of this gateway's placements the table does not
// count yet.
func (r *Replica) Pending() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.own)
}
