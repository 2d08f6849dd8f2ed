package policy

import (
	"math"
	"sort"
)

// Pair is one drafter paired with the full-service worker it drafts for.
type Pair struct {
	Drafter string
	Target  string
	// TargetQueueWaitMs is the target's q_w when it was chosen.
	TargetQueueWaitMs float64
}

// PairDrafters pairs restarted workers in ASSIST (drafters) with full-service
// workers for speculation assist (progressive recovery), one to one: each
// drafter, in the order given (callers pass them sorted by id), takes the
// eligible worker with the highest q_w that is not in paired and not taken by
// an earlier drafter; ties go to the smaller id. A drafter for whom no worker
// is left gets no pair (it waits for one).
//
// drafters must be unpaired; candidates is the fsm's view of every worker
// (only Eligible ones, those in FULL_SERVICE, are taken); paired holds the
// ids of workers that already have a drafter. paired is only looked up,
// never iterated, so the result depends on the inputs alone.
func PairDrafters(drafters []string, candidates []Worker, paired map[string]bool) []Pair {
	if len(drafters) == 0 {
		return nil
	}
	free := make([]int, 0, len(candidates))
	for i := range candidates {
		if candidates[i].Eligible && !paired[candidates[i].ID] {
			free = append(free, i)
		}
	}
	// q_w is validated finite by the controller; a NaN that slipped into
	// the log anyway sorts last rather than making the order depend on the
	// sort's internals.
	qw := func(i int) float64 {
		if q := candidates[i].QueueWaitMs; !math.IsNaN(q) {
			return q
		}
		return math.Inf(-1)
	}
	sort.Slice(free, func(a, b int) bool {
		if qa, qb := qw(free[a]), qw(free[b]); qa != qb {
			return qa > qb
		}
		return candidates[free[a]].ID < candidates[free[b]].ID
	})
	n := min(len(drafters), len(free))
	out := make([]Pair, n)
	for k := 0; k < n; k++ {
		t := &candidates[free[k]]
		out[k] = Pair{Drafter: drafters[k], Target: t.ID, TargetQueueWaitMs: t.QueueWaitMs}
	}
	return out
}
