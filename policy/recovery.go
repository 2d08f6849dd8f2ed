package policy

import (
	"math"
	"sort"
	"sync"
)

// Interrupted is a request that was running on a failed worker.
type Interrupted struct {
	RequestID string
	Holder    string // its checkpoint holder, "" for none
	// Replicas are its further checkpoint copies' holders
	// (Placement.replica_holders).
	Replicas     []string
	PromptTokens uint32
	MaxTokens    uint32
	// Checkpointed is the prefix, in tokens, each copy holds: [0] at
	// Holder, [1+k] at Replicas[k] (a copy without an entry holds none).
	// nil when not known: every copy then counts as holding the same
	// prefix. The fsm fills it from what the MarkFailed's leader asked the
	// live holders (MarkFailedCmd.checkpointed); other recoveries (a new
	// incarnation registering, a phase set FAILED) pass nil.
	Checkpointed []uint32
	// MigrationTarget is the destination of a live migration that was in
	// flight when the worker failed, "" for none: it holds a copy of the
	// request's prefix, the pages copied so far.
	MigrationTarget string
}

// copyPrefix is the checkpointed prefix of copy c (0: Holder, 1+k:
// Replicas[k]) for the plan's comparisons: 0 for every copy when
// Checkpointed is not known.
func (r *Interrupted) copyPrefix(c int) uint32 {
	if c < len(r.Checkpointed) {
		return r.Checkpointed[c]
	}
	return 0
}

// Mode says how a recovered request resumes.
type Mode int

// Recovery modes. Their values match lumenpb.RecoveryMode.
const (
	Reuse     Mode = 1 // import the checkpointed pages, prefill the rest
	Recompute Mode = 2 // prefill the whole token history
)

// Assignment is one request's place in a recovery plan.
type Assignment struct {
	RequestID  string
	Target     int // index into the workers slice
	Mode       Mode
	Holder     string // the checkpoint holder it had, or the migration target whose copy it reuses
	Rebalanced bool   // moved off its holder by rebalancing
	// MigrationCopy: it resumes at its migration target, reusing the pages
	// the migration had copied there (Holder is that target).
	MigrationCopy bool
}

// PlanRecovery decides where each interrupted request resumes:
//
//  0. under lumen, a request that was migrating to an eligible worker
//     resumes at that destination, reusing the pages the migration copied
//     (Llumnix restarts it instead): they are already in the destination's
//     KV cache, so no room check, and rebalancing leaves it there;
//  1. a request with an eligible holder resumes there, reusing its pages
//     (of its copies' holders, the one with the longest checkpointed
//     prefix, then the KV room and then the freest: live, below)
//     (not under stop-and-restart or recompute, which keep no
//     checkpoints) — under
//     lumen, only when the holder has the KV pages for it, or no worker
//     has more: otherwise it is recomputed on the freest worker;
//  2. any other request is recomputed on the least-loaded eligible worker
//     (Recompute mode: no pages to reuse). What history the call there
//     carries is the strategy's, not the plan's: the whole history, or
//     under stop-and-restart the prompt alone, its output decoded again
//     (Strategy.Regenerates; the gateway sends the call);
//  3. under lumen only, rebalance: while a holder has more recovered requests
//     than the cluster average (rounded up) and more requests on their way
//     to it than it runs, its request with the smallest checkpointed prefix
//     moves to another live copy's holder below the average (issue 24's
//     replicas), reusing its pages there, or else is recomputed on the
//     least-loaded worker instead. fixed-checkpoint is
//     DéjàVu's: every request restores at its ring successor however many
//     there are, the baseline lumen is measured against.
//
// Why "more than it runs": a holder with the KV room (rule 1) starts a
// resumed request at once when its batch has a free slot, or else by
// displacing a running new request (worker/core: Core.makeRoom), so it can
// start about as many restores as it runs requests whatever its batch cap,
// which the plan does not know. The requests on their way to it are its
// PendingRequests: this plan's, those of earlier plans of the same log
// entry (workers failing together) and the dispatches since its last
// report. Below that bound rebalancing only adds prefill: in the
// simulator's w4 (one of four Qwen3-32B workers fails) it recomputed 2–5
// histories per failure on survivors at 93% of their capacity, and the
// requests it moved resumed no sooner than those that stayed. Above it,
// restores wait for the holder's running requests to end (w8_f4: four
// failed workers' restores on four survivors whose batches are capped).
//
// The checkpointed prefix of a request is not replicated; its prompt length,
// which is checkpointed once prefill is done, stands for it. Load is the
// freeness of Llumnix, updated as the plan assigns requests. The workers
// slice is updated in place (PendingRequests, PendingPages) so the caller can
// account for the plan. Requests are taken in the order given; callers sort
// them by id. It returns nil when no worker is eligible: the requests wait
// for one.
func PlanRecovery(s Strategy, ws []Worker, reqs []Interrupted) []Assignment {
	eligible := 0
	sorted := true
	for i := range ws {
		if ws[i].Eligible {
			eligible++
		}
		sorted = sorted && (i == 0 || ws[i-1].ID < ws[i].ID)
	}
	if eligible == 0 || len(reqs) == 0 {
		return nil
	}
	// byID finds a worker: by binary search in the fsm's slice, sorted by
	// id (a map of 1,024 workers per plan was a tenth of a node's
	// MarkFailed), by a map otherwise.
	var byIDMap map[string]int
	if !sorted {
		byIDMap = make(map[string]int, len(ws))
		for i := range ws {
			byIDMap[ws[i].ID] = i
		}
	}
	byID := func(id string) (int, bool) {
		if byIDMap != nil {
			i, ok := byIDMap[id]
			return i, ok
		}
		i := sort.Search(len(ws), func(i int) bool { return ws[i].ID >= id })
		return i, i < len(ws) && ws[i].ID == id
	}
	// free answers PickServing as the plan changes the freeness. It is
	// built when first asked (best), from the workers as the plan has
	// changed them by then, which is the tree built at the start and
	// updated since: a node's plan that restores every request at its
	// holder never builds one (two trees of 1,024 workers were half of
	// PlanRecovery's time in a node's MarkFailed). freeOK is what it
	// admits.
	var free *freeTree
	var freeOK func(i int) bool
	sc := scratchPool.Get().(*planScratch) // the tree's and counts' arrays
	defer func() {
		sc.tree.ws, sc.tree.ok = nil, nil // keep no caller's workers alive
		scratchPool.Put(sc)
	}()
	best := func() int {
		if free == nil {
			free = sc.tree.reset(ws, freeOK)
		}
		return free.best()
	}
	freeOK = func(i int) bool { return ws[i].Eligible }
	assign := func(i int, r Interrupted) {
		ws[i].PendingRequests++
		ws[i].PendingPages += Pages(uint64(r.PromptTokens) + 1)
		if free != nil {
			free.update(i)
		}
	}
	unassign := func(i int, r Interrupted) {
		ws[i].PendingRequests--
		ws[i].PendingPages -= Pages(uint64(r.PromptTokens) + 1)
		if free != nil {
			free.update(i)
		}
	}

	// room is the KV pages a worker can give a resumed request now.
	room := func(i int) int64 {
		w := &ws[i]
		return int64(w.KVPagesTotal) - int64(w.KVPagesUsed) - int64(w.QueueHeadPages) - int64(w.PendingPages)
	}
	// live is the eligible copy a request restores from: of its holder
	// and replicas, the one with the longest checkpointed prefix
	// (Interrupted.Checkpointed: the least to recompute), then the KV room
	// for the prefix and then the highest freeness (the lowest cost of a
	// restore there); -1 for none. Where the prefixes are not known
	// every copy has the same prefix up to what the serving worker's
	// queues to each had sent, so the fastest restore is the choice.
	live := func(r Interrupted) int {
		best, bestRoom, bestF, bestP := -1, false, 0.0, uint32(0)
		need := int64(Pages(uint64(r.PromptTokens) + 1))
		consider := func(id string, p uint32) {
			h, ok := byID(id)
			if !ok || id == "" || !ws[h].Eligible {
				return
			}
			hasRoom, f := room(h) >= need, ws[h].Freeness()
			if best < 0 || p > bestP || p == bestP && (hasRoom && !bestRoom || hasRoom == bestRoom && f > bestF) {
				best, bestRoom, bestF, bestP = h, hasRoom, f, p
			}
		}
		consider(r.Holder, r.copyPrefix(0))
		for k, id := range r.Replicas {
			consider(id, r.copyPrefix(1+k))
		}
		return best
	}
	plan := make([]Assignment, len(reqs))
	count := sc.ints(&sc.count, len(ws))
	for k, r := range reqs {
		a := Assignment{RequestID: r.RequestID, Holder: r.Holder, Target: -1}
		if m, ok := byID(r.MigrationTarget); ok && s == Lumen && r.MigrationTarget != "" && ws[m].Eligible {
			a.Target, a.Mode, a.Holder, a.MigrationCopy = m, Reuse, r.MigrationTarget, true
		} else if h := live(r); h >= 0 && s.KeepsCheckpoints() {
			a.Target, a.Mode, a.Holder = h, Reuse, ws[h].ID
			// A restore needs the whole prefix in KV at once: at a holder
			// without the room it waits for running requests to finish
			// (seconds on a KV-bound worker). lumen recomputes it on the
			// freest worker instead when that one has the room.
			need := int64(Pages(uint64(r.PromptTokens) + 1))
			if s == Lumen && room(h) < need {
				if alt := best(); alt >= 0 && alt != h && room(alt) >= need {
					a.Target, a.Mode, a.Rebalanced = alt, Recompute, true
				}
			}
		} else {
			a.Target, a.Mode = best(), Recompute
		}
		assign(a.Target, r)
		count[a.Target]++
		plan[k] = a
	}

	if s != Lumen {
		return plan
	}
	// Rebalance the holders that took more than their share and more
	// than they can start at once.
	avg := (len(reqs) + eligible - 1) / eligible
	// From here free answers "the least-loaded worker below the average"
	// (built when first asked, as above).
	free, freeOK = nil, func(i int) bool { return ws[i].Eligible && count[i] < avg }
	order := sc.ints(&sc.order, len(reqs)) // reuse assignments, smallest prefix first
	for k := range order {
		order[k] = k
	}
	sort.SliceStable(order, func(a, b int) bool {
		return reqs[order[a]].PromptTokens < reqs[order[b]].PromptTokens
	})
	for _, k := range order {
		a := &plan[k]
		if a.Mode != Reuse || a.MigrationCopy || count[a.Target] <= avg || ws[a.Target].PendingRequests <= ws[a.Target].Running {
			continue
		}
		src := a.Target
		unassign(src, reqs[k])
		// Another live copy's holder below the average takes it, reusing
		// its pages there (issue 24: R > 1): of them the longest prefix,
		// then the freest.
		dst, dstF, dstP := -1, 0.0, uint32(0)
		for c, id := range append([]string{reqs[k].Holder}, reqs[k].Replicas...) {
			i, ok := byID(id)
			if !ok || id == "" || i == src || !ws[i].Eligible || count[i] >= avg {
				continue
			}
			if f, p := ws[i].Freeness(), reqs[k].copyPrefix(c); dst < 0 || p > dstP || p == dstP && f > dstF {
				dst, dstF, dstP = i, f, p
			}
		}
		if dst >= 0 {
			count[src]--
			count[dst]++
			assign(dst, reqs[k])
			a.Target, a.Holder, a.Rebalanced = dst, ws[dst].ID, true
			continue
		}
		// The least-loaded worker still below the average (src is not:
		// it had more than the average).
		if dst = best(); dst < 0 {
			assign(src, reqs[k])
			continue
		}
		count[src]--
		count[dst]++
		assign(dst, reqs[k])
		a.Target, a.Mode, a.Rebalanced = dst, Recompute, true
	}
	return plan
}

// planScratch is what a PlanRecovery call needs only while it runs, kept
// in scratchPool between calls: a node's MarkFailed plans 8 times over
// 1,024 workers, and allocating these anew each time was a quarter of its
// garbage.
type planScratch struct {
	tree         freeTree
	count, order []int
}

var scratchPool = sync.Pool{New: func() any { return new(planScratch) }}

// ints returns *buf resized to n and zeroed, growing it when short.
func (*planScratch) ints(buf *[]int, n int) []int {
	if cap(*buf) < n {
		*buf = make([]int, n)
	}
	*buf = (*buf)[:n]
	clear(*buf)
	return *buf
}

// freeTree is a max segment tree of the workers' freeness over those ok
// admits: best is PickServing over them (the highest, ties to the smaller
// index) in O(1), update after a worker's freeness or admission changed in
// O(log n). A plan recomputes hundreds of requests when a node fails;
// scanning 1,024 workers for each was most of Apply's time.
type freeTree struct {
	ws   []Worker
	ok   func(i int) bool
	size int
	val  []float64 // per node: the best freeness below; -Inf for none
	arg  []int     // per node: its index, -1 for none
}

// reset builds t over ws and ok anew, reusing its arrays, and returns t.
func (t *freeTree) reset(ws []Worker, ok func(i int) bool) *freeTree {
	t.ws, t.ok, t.size = ws, ok, 1
	for t.size < len(ws) {
		t.size *= 2
	}
	if cap(t.val) < 2*t.size {
		t.val = make([]float64, 2*t.size)
		t.arg = make([]int, 2*t.size)
	}
	t.val, t.arg = t.val[:2*t.size], t.arg[:2*t.size]
	for v := t.size; v < 2*t.size; v++ {
		t.val[v], t.arg[v] = math.Inf(-1), -1
	}
	for i := range ws {
		t.leaf(i)
	}
	for v := t.size - 1; v >= 1; v-- {
		t.pull(v)
	}
	return t
}

func (t *freeTree) leaf(i int) {
	v := t.size + i
	if t.ok(i) {
		t.val[v], t.arg[v] = t.ws[i].Freeness(), i
	} else {
		t.val[v], t.arg[v] = math.Inf(-1), -1
	}
}

func (t *freeTree) pull(v int) {
	l, r := 2*v, 2*v+1
	// The left wins ties: it holds the smaller indices.
	if t.arg[r] >= 0 && (t.arg[l] < 0 || t.val[r] > t.val[l]) {
		t.val[v], t.arg[v] = t.val[r], t.arg[r]
	} else {
		t.val[v], t.arg[v] = t.val[l], t.arg[l]
	}
}

func (t *freeTree) update(i int) {
	t.leaf(i)
	for v := (t.size + i) / 2; v >= 1; v /= 2 {
		t.pull(v)
	}
}

// best is the admitted worker with the highest freeness, -1 for none.
func (t *freeTree) best() int {
	if len(t.ws) == 0 {
		return -1
	}
	return t.arg[1]
}
