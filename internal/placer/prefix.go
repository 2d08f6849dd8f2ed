package placer

import (
	"math/bits"
	"slices"
	"sort"
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
//
// Besides each worker's set of hashes it keeps the inverted index, hash →
// the workers holding it, so that Overlaps costs O(pages × holders), not
// O(workers × pages): with a prompt's 375 pages against 1,024 workers, the
// per-worker walk was 41% of a gateway's placement time in map probes
// (BenchmarkPrefixRouting1024, docs/benchmarks.md). Workers are numbered
// by slot; the inverted index maps a hash to one slot, or, for a hash
// held by several workers, to a list of slots (multi), so the large map
// holds no pointers for the collector to scan.
type PrefixIndex struct {
	mu   sync.Mutex
	slot map[string]int32 // worker → slot
	ids  []string         // slot → worker ("" when free)
	by   []hashTab        // slot → its hashes (values unused)
	free []int32
	// holders: hash → slot, or multiFlag|i for the slots in multi[i].
	holders   hashTab
	multi     [][]int32
	multiFree []uint32
	// Overlaps' scratch bitsets over slots.
	alive, next []uint64
	sink        uint64 // what the prefetch loaded, kept so it is not left out
}

const multiFlag = 1 << 31

// prefetchRun is how many of a prompt's hashes Overlaps touches ahead.
const prefetchRun = 32

// NewPrefixIndex returns an empty index.
func NewPrefixIndex() *PrefixIndex {
	return &PrefixIndex{slot: map[string]int32{}}
}

func (x *PrefixIndex) slotOf(worker string) int32 {
	if s, ok := x.slot[worker]; ok {
		return s
	}
	var s int32
	if n := len(x.free); n > 0 {
		s = x.free[n-1]
		x.free = x.free[:n-1]
	} else {
		s = int32(len(x.ids))
		x.ids = append(x.ids, "")
		x.by = append(x.by, hashTab{})
	}
	x.ids[s], x.by[s] = worker, hashTab{}
	x.slot[worker] = s
	return s
}

func (x *PrefixIndex) addHolder(h uint64, s int32) {
	v, ok := x.holders.get(h)
	switch {
	case !ok:
		x.holders.put(h, uint32(s))
	case v&multiFlag == 0:
		var i uint32
		if n := len(x.multiFree); n > 0 {
			i = x.multiFree[n-1]
			x.multiFree = x.multiFree[:n-1]
			x.multi[i] = append(x.multi[i][:0], int32(v), s)
		} else {
			i = uint32(len(x.multi))
			x.multi = append(x.multi, []int32{int32(v), s})
		}
		x.holders.put(h, multiFlag|i)
	default:
		i := v &^ multiFlag
		x.multi[i] = append(x.multi[i], s)
	}
}

func (x *PrefixIndex) removeHolder(h uint64, s int32) {
	v, ok := x.holders.get(h)
	if !ok {
		return
	}
	if v&multiFlag == 0 {
		if int32(v) == s {
			x.holders.del(h)
		}
		return
	}
	i := v &^ multiFlag
	l := x.multi[i]
	for k, t := range l {
		if t == s {
			l[k] = l[len(l)-1]
			l = l[:len(l)-1]
			break
		}
	}
	x.multi[i] = l
	if len(l) == 1 {
		x.holders.put(h, uint32(l[0]))
		x.multiFree = append(x.multiFree, i)
	}
}

// Apply records a worker's KV events: the hashes stored, then those
// removed.
func (x *PrefixIndex) Apply(worker string, stored, removed []uint64) {
	if len(stored) == 0 && len(removed) == 0 {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	x.applyLocked(worker, stored, removed)
}

func (x *PrefixIndex) applyLocked(worker string, stored, removed []uint64) {
	s := x.slotOf(worker)
	m := &x.by[s]
	for _, h := range stored {
		if !x.holds(h, s) {
			m.put(h, 0)
			x.addHolder(h, s)
		}
	}
	for _, h := range removed {
		if x.holds(h, s) {
			m.del(h)
			x.removeHolder(h, s)
		}
	}
}

// Reset forgets everything a worker held: it restarted, or its cache was
// reset.
func (x *PrefixIndex) Reset(worker string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.resetLocked(worker)
}

func (x *PrefixIndex) resetLocked(worker string) {
	s, ok := x.slot[worker]
	if !ok {
		return
	}
	x.by[s].each(func(h uint64, _ uint32) { x.removeHolder(h, s) })
	delete(x.slot, worker)
	x.ids[s], x.by[s] = "", hashTab{}
	x.free = append(x.free, s)
}

// Replace makes stored the whole of what a worker holds (its snapshot),
// in one step: a concurrent Overlaps sees the old set or the new one.
func (x *PrefixIndex) Replace(worker string, stored []uint64) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.resetLocked(worker)
	if len(stored) > 0 {
		x.applyLocked(worker, stored, nil)
	}
}

// Len is how many hashes the index holds for worker.
func (x *PrefixIndex) Len(worker string) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	if s, ok := x.slot[worker]; ok {
		return x.by[s].len()
	}
	return 0
}

// Workers is how many workers the index holds hashes for (or held, until
// their Reset).
func (x *PrefixIndex) Workers() int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return len(x.slot)
}

// Overlaps fills dst[i] with how many of hashes, from the first, ws[i]'s
// cache holds, and returns it. It walks the prompt's hashes through the
// inverted index, keeping the set of workers that held every hash so far
// (a bitset over slots), and stops when the set is empty: the cost is the
// holders of the pages up to the longest overlap, whatever the number of
// workers. ws sorted by ID (as a Replica's and the FSM's views are) finds
// each holder by binary search; in any other order, by a scan.
func (x *PrefixIndex) Overlaps(ws []policy.Worker, hashes []uint64, dst []int) []int {
	x.mu.Lock()
	defer x.mu.Unlock()
	dst = slices.Grow(dst[:0], len(ws))[:len(ws)]
	clear(dst)
	if len(hashes) == 0 || len(ws) == 0 {
		return dst
	}
	v, ok := x.holders.get(hashes[0])
	if !ok {
		return dst
	}
	words := (len(x.ids) + 63) / 64
	if cap(x.alive) < words {
		x.alive, x.next = make([]uint64, words), make([]uint64, words)
	}
	alive, next := x.alive[:words], x.next[:words]
	clear(alive)
	n := x.mark(alive, nil, v)
	for i := 1; i < len(hashes) && n > 0; i++ {
		if i%prefetchRun == 1 {
			// The probes are cache misses (millions of hashes): touch
			// the next run's slots in one loop of independent loads,
			// which the processor overlaps, before probing them.
			x.sink += x.holders.touch(hashes[i:min(i+prefetchRun, len(hashes))])
		}
		clear(next)
		n = 0
		if v, ok := x.holders.get(hashes[i]); ok {
			n = x.mark(next, alive, v)
		}
		// The workers that held hashes[:i] and not hashes[i]: overlap i.
		for w := range alive {
			for d := alive[w] &^ next[w]; d != 0; d &= d - 1 {
				x.record(ws, dst, int32(w*64+bits.TrailingZeros64(d)), i)
			}
		}
		alive, next = next, alive
	}
	for w := range alive {
		for d := alive[w]; d != 0; d &= d - 1 {
			x.record(ws, dst, int32(w*64+bits.TrailingZeros64(d)), len(hashes))
		}
	}
	return dst
}

// holds reports whether slot s holds h.
func (x *PrefixIndex) holds(h uint64, s int32) bool {
	v, ok := x.holders.get(h)
	if !ok {
		return false
	}
	if v&multiFlag == 0 {
		return int32(v) == s
	}
	for _, t := range x.multi[v&^multiFlag] {
		if t == s {
			return true
		}
	}
	return false
}

// mark sets in set the slots of holders value v (those also in within,
// when within is not nil) and returns how many it set.
func (x *PrefixIndex) mark(set, within []uint64, v uint32) int {
	one := func(s int32) int {
		w, b := s/64, uint64(1)<<(s%64)
		if within != nil && within[w]&b == 0 {
			return 0
		}
		set[w] |= b
		return 1
	}
	if v&multiFlag == 0 {
		return one(int32(v))
	}
	n := 0
	for _, s := range x.multi[v&^multiFlag] {
		n += one(s)
	}
	return n
}

// record sets the overlap of the worker in slot s, when ws has it.
func (x *PrefixIndex) record(ws []policy.Worker, dst []int, s int32, overlap int) {
	id := x.ids[s]
	j := sort.Search(len(ws), func(j int) bool { return ws[j].ID >= id })
	if j < len(ws) && ws[j].ID == id {
		dst[j] = overlap
		return
	}
	for j := range ws {
		if ws[j].ID == id {
			dst[j] = overlap
		}
	}
}

// PrefixScore is the score PickPrefix maximises for a worker w whose cache
// holds overlap pages of the prompt: while w has pages to spare,
//
//	Freeness(w) + overlap / (1 + Waiting(w))
//
// and in general Freeness's own form (policy.FreenessOf) of the free pages
// with the hit's worth added in pages, free + overlap × batch / (1 +
// Waiting), which is the line above wherever that sum is positive. An
// over-committed worker's freeness is the pages it is short, not a share
// per request; the hit then counts in pages too, else a worker short of
// any page outweighed every hit (at llm-d's load ladder, past 25 requests
// a second, each group's requests scattered, the hit rate fell from 90% to
// 30% and the caches thrashed: docs/benchmarks.md, "Issue 25"). The score
// is continuous and rises with the free pages and with the overlap.
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
	free, batch := w.FreePages()
	return policy.FreenessOf(free+float64(overlap)*batch/(1+float64(w.Waiting)), batch)
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
	// The other gateways' virtual placements come from the share trees
	// (tree.go), as Take's do, not from a scan per placement.
	pages := policy.Pages(uint64(promptTokens))
	r.ensureTree()
	excl, touched := r.virtualLocked(pages, exclude)
	vs := r.scratchViews()
	for _, i := range excl {
		vs[i].Eligible = false
	}
	for _, j := range touched {
		vs[j].PendingRequests += r.vreq[j]
		vs[j].PendingPages += r.vpages[j]
	}
	r.undoVirtualLocked(excl, touched)
	r.overlaps = idx.Overlaps(vs, hashes, r.overlaps)
	i := PickPrefix(vs, r.overlaps)
	if i < 0 {
		return "", 0, false
	}
	r.seq++
	r.addOwn(requestID, own{worker: vs[i].ID, pages: pages, seq: r.seq})
	r.order = append(r.order, ownRef{id: requestID, seq: r.seq})
	r.capOwnLocked()
	return vs[i].ID, r.incs[i], true
}

// Hashes is how many (worker, hash) pairs the index holds.
func (x *PrefixIndex) Hashes() int {
	x.mu.Lock()
	defer x.mu.Unlock()
	n := 0
	for i := range x.by {
		n += x.by[i].len()
	}
	return n
}
