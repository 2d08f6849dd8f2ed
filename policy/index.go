package policy

import "math"

// holderScore is h(r)'s objective for one worker: q_w + λ·p_w(r).
//
// The explicit float64 conversion rounds the product before the sum (the Go
// spec's rule): without it a compiler may fuse the two into one FMA (arm64
// does, amd64 from GOAMD64=v3), and replicas of different architectures would
// score — and pick holders — differently for the same log entry. Every
// multiply-add in policy scoring is written this way.
func holderScore(w *Worker, lambda float64) float64 {
	score := w.QueueWaitMs
	if w.Held > 0 && lambda != 0 {
		score += float64(lambda * w.RestoreDelayMs())
	}
	return score
}

// HolderIndex answers h(r) without scanning every worker: a segment tree over
// the workers (in the order of the []Worker it mirrors) in which every node
// keeps the lowest score and the most free checkpoint bytes of the leaves
// below it. Pick walks the tree best first — the child with the lower score
// first, the left one on a tie — skipping every subtree that cannot hold the
// footprint or cannot beat the best found (a subtree that only ties it is
// entered only if it starts to its left), so with budgets to spare it visits
// O(log n) nodes; updates are O(log n).
//
// Whoever changes a worker's eligibility, q_w, budget or reservations calls
// Update for it, and Rebuild after inserting a worker or changing lambda.
// PickHolder is the reference definition: Pick returns the same worker.
type HolderIndex struct {
	lambda   float64
	n        int       // workers
	size     int       // leaves: the power of two >= n
	minScore []float64 // per node; +Inf for ineligible leaves
	maxFree  []uint64  // per node; 0 for ineligible leaves
	eligible []bool    // per worker
	count    int       // eligible workers
}

// NewHolderIndex builds the index of ws.
func NewHolderIndex(ws []Worker, lambda float64) *HolderIndex {
	x := &HolderIndex{}
	x.Rebuild(ws, lambda)
	return x
}

// Rebuild recomputes every entry.
func (x *HolderIndex) Rebuild(ws []Worker, lambda float64) {
	x.lambda, x.n, x.size, x.count = lambda, len(ws), 1, 0
	for x.size < len(ws) {
		x.size *= 2
	}
	x.minScore = make([]float64, 2*x.size)
	x.maxFree = make([]uint64, 2*x.size)
	x.eligible = make([]bool, len(ws))
	for i := range x.minScore {
		x.minScore[i] = math.Inf(1)
	}
	for i := range ws {
		x.setLeaf(i, &ws[i])
	}
	for v := x.size - 1; v >= 1; v-- {
		x.pull(v)
	}
}

func (x *HolderIndex) setLeaf(i int, w *Worker) {
	v := x.size + i
	if w.Eligible != x.eligible[i] {
		if w.Eligible {
			x.count++
		} else {
			x.count--
		}
		x.eligible[i] = w.Eligible
	}
	if w.Eligible {
		x.minScore[v], x.maxFree[v] = holderScore(w, x.lambda), w.FreeCheckpointBytes()
	} else {
		x.minScore[v], x.maxFree[v] = math.Inf(1), 0
	}
}

func (x *HolderIndex) pull(v int) {
	l, r := 2*v, 2*v+1
	x.minScore[v] = min(x.minScore[l], x.minScore[r])
	x.maxFree[v] = max(x.maxFree[l], x.maxFree[r])
}

// Update refreshes worker i's entry from w.
func (x *HolderIndex) Update(i int, w *Worker) {
	x.setLeaf(i, w)
	for v := (x.size + i) / 2; v >= 1; v /= 2 {
		x.pull(v)
	}
}

// Pick is h(r) over the index: the eligible worker other than serving whose
// free budget covers footprint with the lowest score; ties to the lower
// index (the smaller id).
func (x *HolderIndex) Pick(serving int, footprint uint64) (int, NoHolder) {
	return x.PickSkip(serving, footprint, nil)
}

// PickSkip is Pick over the workers skip (when not nil) does not exclude:
// pickHolderSkip over the index. A subtree of skipped workers with good
// scores is walked into and found empty, so excluding one node's workers
// costs at most a walk to each of them.
//
// The walk is best first: of two children it enters the one with the
// lower score first (the left on a tie), so the first worker it finds is
// usually the answer and every other subtree is cut by its bound. Left to
// right, the first found was the leftmost with room, and each better one
// further right cost another descent: a node's MarkFailed at 1,000
// workers spent a third of its time here. The answer is the same, the
// lowest score and of those the lowest index: a subtree whose best score
// only ties the best found is entered only when it begins left of it.
func (x *HolderIndex) PickSkip(serving int, footprint uint64, skip func(i int) bool) (int, NoHolder) {
	best, bestScore := -1, math.Inf(1)
	// beats says whether a subtree (v, whose leftmost leaf is lo) may hold
	// a worker better than the best so far.
	beats := func(v, lo int) bool {
		s := x.minScore[v]
		return s < bestScore || best >= 0 && s == bestScore && lo < best
	}
	var walk func(v, lo, width int)
	walk = func(v, lo, width int) {
		if x.maxFree[v] < footprint || !beats(v, lo) {
			return
		}
		if width == 1 {
			if i := lo; i != serving && (skip == nil || !skip(i)) {
				best, bestScore = i, x.minScore[v]
			}
			return
		}
		l, r, half := 2*v, 2*v+1, width/2
		if x.minScore[r] < x.minScore[l] {
			walk(r, lo+half, half)
			walk(l, lo, half)
			return
		}
		walk(l, lo, half)
		walk(r, lo+half, half)
	}
	if x.n > 0 {
		walk(1, 0, x.size)
	}
	if best >= 0 {
		return best, HolderFound
	}
	peers := x.count
	if serving >= 0 && serving < x.n && x.eligible[serving] {
		peers--
	}
	if skip != nil && peers > 0 {
		// Only when nothing was found: count the peers skip leaves.
		peers = 0
		for i := range x.n {
			if x.eligible[i] && i != serving && !skip(i) {
				peers++
			}
		}
	}
	if peers <= 0 {
		return -1, NoHolderNoPeer
	}
	return -1, NoHolderBudgetFull
}
