package placer

import (
	"math"
	"sync"

	"github.com/lumen-project/lumen/policy"
)

// Prefix-aware placement (issue 25). Each worker's prefix cache names its
// full KV pages by their prefix hash (worker/core.PageHashes) and reports
// the pages entering and leaving it (core.Output.KVStored, KVRemoved); a
// PrefixIndex keeps, per worker, the hashes it holds, and the overlap of a
// prompt with a worker is how many of the prompt's pages, from the first,
// that worker holds. PickPrefix weighs that overlap against the worker's
// load in one continuous score.

// PrefixIndex is the page hashes each worker's cache holds, as its KV
// events reported them. It is safe for concurrent use.
type PrefixIndex struct {
	mu sync.Mutex
	by map[string]map[uint64]struct{}
}

// NewPrefixIndex returns an empty index.
func NewPrefixIndex() *PrefixIndex { return &PrefixIndex{by: map[string]map[uint64]struct{}{}} }

// Apply records a worker's KV events: the hashes stored, then those
// removed.
func (x *PrefixIndex) Apply(worker string, stored, removed []uint64) {
	if len(stored) == 0 && len(removed) == 0 {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	m := x.by[worker]
	if m == nil {
		m = map[uint64]struct{}{}
		x.by[worker] = m
	}
	for _, h := range stored {
		m[h] = struct{}{}
	}
	for _, h := range removed {
		delete(m, h)
	}
}

// Reset forgets everything a worker held: it restarted, or its cache was
// reset.
func (x *PrefixIndex) Reset(worker string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	delete(x.by, worker)
}

// Len is how many hashes the index holds for worker.
func (x *PrefixIndex) Len(worker string) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return len(x.by[worker])
}

// Overlaps fills dst[i] with how many of hashes, from the first, ws[i]'s
// cache holds, and returns it.
func (x *PrefixIndex) Overlaps(ws []policy.Worker, hashes []uint64, dst []int) []int {
	x.mu.Lock()
	defer x.mu.Unlock()
	dst = append(dst[:0], make([]int, len(ws))...)
	for i := range ws {
		m := x.by[ws[i].ID]
		if m == nil {
			continue
		}
		n := 0
		for _, h := range hashes {
			if _, ok := m[h]; !ok {
				break
			}
			n++
		}
		dst[i] = n
	}
	return dst
}

// PrefixScore is the score PickPrefix maximises for a worker w whose cache
// holds overlap pages of the prompt:
//
//	Freeness(w) + overlap / (1 + Waiting(w))
//
// Freeness is the placement without prefixes (policy.PickServing's
// Llumnix freeness: free KV pages, less the queue head's and those of the
// requests dispatched since the last report, per request the worker
// serves): the worker's load. The overlap is the prefill the worker would
// skip, in pages, so a cached prefix is worth as many free pages per
// request; it is divided by the requests waiting there, because a request
// queued behind them gains its prefill only after their wait (Dynamo's KV
// router charges the prefill left after the overlap plus the decode
// blocks already on the worker; llm-d's precise scheduler adds weighted
// prefix, queue and KV-utilisation scores). There is no threshold: the
// affinity a hit buys shrinks continuously as the worker's queue grows,
// and a freer worker wins once its freeness exceeds the hit's worth. With
// no overlap anywhere the choice is PickServing's.
func PrefixScore(w *policy.Worker, overlap int) float64 {
	return w.Freeness() + float64(overlap)/(1+float64(w.Waiting))
}

// PickPrefix returns the index of the eligible worker with the highest
// PrefixScore (overlaps[i] is ws[i]'s), the first of equals, or -1 when
// none is eligible.
func PickPrefix(ws []policy.Worker, overlaps []int) int {
	best, bestS := -1, 0.0
	for i := range ws {
		if !ws[i].Eligible {
			continue
		}
		if s := PrefixScore(&ws[i], overlaps[i]); best < 0 || s > bestS {
			best, bestS = i, s
		}
	}
	return best
}

// TakePrefix is Take for a request whose prompt has the page hashes given,
// choosing by PickPrefix over the view with idx's overlaps (the gateway's
// index of the workers' KV events). With several gateways the others'
// virtual placements are counted as PickShared counts them, and the prefix
// replaces the preference for this gateway's share (unmeasured: the
// simulator's prefix figure runs the dispatch inside Apply). With no
// overlap anywhere and one gateway it chooses what Take does.
func (r *Replica) TakePrefix(requestID string, promptTokens uint32, hashes []uint64, idx *PrefixIndex, exclude ...string) (worker string, incarnation uint64, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	vs := r.viewsLocked()
	for _, x := range exclude {
		if i, found := r.find(x); found {
			vs[i].Eligible = false
		}
	}
	pages := policy.Pages(uint64(promptTokens))
	if r.G > 1 {
		pending := min(len(r.own), len(vs))
		for h := range r.G {
			if h == r.g {
				continue
			}
			for range pending {
				j := SharePick(vs, h, r.G, math.Inf(1))
				if j < 0 {
					break
				}
				vs[j].PendingRequests++
				vs[j].PendingPages += pages
			}
		}
	}
	i := PickPrefix(vs, idx.Overlaps(vs, hashes, nil))
	if i < 0 {
		return "", 0, false
	}
	r.seq++
	r.addOwn(requestID, own{worker: vs[i].ID, pages: pages, seq: r.seq})
	r.order = append(r.order, ownRef{id: requestID, seq: r.seq})
	r.capOwnLocked()
	return vs[i].ID, r.incs[i], true
}
