package placer

import (
	"math"

	"github.com/lumen-project/lumen/policy"
)

// The choice without a scan (issue 26). At 1,000 workers a cell and 4
// gateways, PickShared's scans — (G−1) × pending × workers per Take for
// the other gateways' virtual placements, then one more — were the
// simulator's largest cost at 10,000 workers (docs/benchmarks.md). The
// replica therefore keeps its view (the table plus its own placements
// the table does not count) as cur, and over it one tournament tree per
// share (the workers at positions ≡ h mod G) of their freeness, updated
// in O(log n) when an own placement is added or dropped and rebuilt when
// a table arrives or the share changes. A Take then costs O(G × pending
// × log n): each virtual placement reads its share's root and updates
// one leaf, undone after the choice; the freest worker with the bias is
// read from the roots. The choice is PickShared's (PickServing's with
// one gateway) exactly, ties and floating point included
// (TestTreeMatchesScan): see pickLocked.

// freeTree is a tournament tree over n leaves: each node holds the
// greatest key below it and its leaf, ties to the leftmost. An absent
// leaf (an ineligible worker, or padding) has key −Inf, which the scans
// never choose either (their first candidate must beat −Inf).
type freeTree struct {
	size int       // leaves: a power of two, at least 1
	f    []float64 // f[size+k] is leaf k's key; f[node] the max below node
	at   []int32   // the leaf of f[node]
}

func (t *freeTree) reset(n int) {
	size := 1
	for size < n {
		size <<= 1
	}
	t.size = size
	if cap(t.f) < 2*size {
		t.f, t.at = make([]float64, 2*size), make([]int32, 2*size)
	}
	t.f, t.at = t.f[:2*size], t.at[:2*size]
	for k := range size {
		t.f[size+k], t.at[size+k] = math.Inf(-1), int32(k)
	}
}

func (t *freeTree) pull(node int) {
	l, r := 2*node, 2*node+1
	if t.f[r] > t.f[l] {
		t.f[node], t.at[node] = t.f[r], t.at[r]
	} else {
		t.f[node], t.at[node] = t.f[l], t.at[l]
	}
}

// build computes the inner nodes from the leaves.
func (t *freeTree) build() {
	for node := t.size - 1; node >= 1; node-- {
		t.pull(node)
	}
}

// set changes leaf k's key.
func (t *freeTree) set(k int, f float64) {
	node := t.size + k
	t.f[node] = f
	for node >>= 1; node >= 1; node >>= 1 {
		t.pull(node)
	}
}

// max is the greatest key and its leftmost leaf (key −Inf: none).
func (t *freeTree) max() (float64, int) { return t.f[1], int(t.at[1]) }

// leftmost is the first leaf whose key is at least lo, or -1.
func (t *freeTree) leftmost(lo float64) int {
	if !(t.f[1] >= lo) {
		return -1
	}
	node := 1
	for node < t.size {
		if t.f[2*node] >= lo {
			node = 2 * node
		} else {
			node = 2*node + 1
		}
	}
	return node - t.size
}

// leafKey is a worker's key: its freeness if eligible, else −Inf (and
// −Inf for a NaN freeness, which no scan chooses either).
func leafKey(w *policy.Worker) float64 {
	if !w.Eligible {
		return math.Inf(-1)
	}
	f := w.Freeness()
	if f != f {
		return math.Inf(-1)
	}
	return f
}

// biased is SharePick's weighting of a freeness of the gateway's own
// share, in the same floating-point operations.
func biased(f, bias float64) float64 {
	if f > 0 {
		return f * (1 + bias)
	}
	return f / (1 + bias)
}

// ensureTree builds cur and the share trees if a table, a share change
// or the first Take made them stale. r.mu must be held.
func (r *Replica) ensureTree() {
	if r.curOK && r.treeG == r.G {
		return
	}
	r.cur = r.viewsLocked()
	n, G := len(r.cur), r.G
	if len(r.trees) < G {
		r.trees = append(r.trees, make([]freeTree, G-len(r.trees))...)
	}
	r.trees = r.trees[:G]
	for h := range G {
		t := &r.trees[h]
		t.reset((n - h + G - 1) / G)
		for i := h; i < n; i += G {
			t.f[t.size+i/G] = leafKey(&r.cur[i])
		}
		t.build()
	}
	if cap(r.vreq) < n {
		r.vreq, r.vpages = make([]uint32, n), make([]uint64, n)
	}
	r.vreq, r.vpages = r.vreq[:n], r.vpages[:n]
	r.treeG, r.curOK = G, true
}

// setLeaf puts worker i's current key (cur plus its virtual placements)
// in its share's tree.
func (r *Replica) setLeaf(i int) {
	w := r.cur[i]
	w.PendingRequests += r.vreq[i]
	w.PendingPages += r.vpages[i]
	r.trees[i%r.G].set(i/r.G, leafKey(&w))
}

// curOwn adds (sign +1) or removes (−1) an own placement in cur, if the
// tree is built and the worker is in the table.
func (r *Replica) curOwn(o own, sign int) {
	if !r.curOK {
		return
	}
	i, ok := r.find(o.worker)
	if !ok {
		return
	}
	if sign > 0 {
		r.cur[i].PendingRequests++
		r.cur[i].PendingPages += o.pages
	} else {
		r.cur[i].PendingRequests--
		r.cur[i].PendingPages -= o.pages
	}
	r.setLeaf(i)
}

// pickLocked is Take's choice from the trees, what PickShared (G > 1,
// with ShareBias) or PickServing (G = 1) chooses over viewsLocked() with
// exclude made ineligible, or -1. It leaves the trees as it found them.
// r.mu must be held and ensureTree called.
func (r *Replica) pickLocked(pages uint64, exclude []string, bias float64) int {
	excl, touched := r.virtualLocked(pages, exclude)
	best := chooseFromTrees(r.trees, r.g, r.G, bias)
	r.undoVirtualLocked(excl, touched)
	return best
}

// virtualLocked makes exclude's workers ineligible in the trees and, with
// several gateways, places the other gateways' virtual requests (pending
// of them each, of pages pages), each on the freest worker of its share,
// as PickShared places them: vreq and vpages hold them by worker. It
// returns the excluded workers and those given virtual placements, for
// undoVirtualLocked. r.mu must be held and ensureTree called.
func (r *Replica) virtualLocked(pages uint64, exclude []string) (excl, touched []int) {
	G, g := r.G, r.g
	inf := math.Inf(-1)
	for _, x := range exclude {
		if i, ok := r.find(x); ok {
			excl = append(excl, i)
			r.trees[i%G].set(i/G, inf)
		}
	}
	if G > 1 {
		pending := min(len(r.own), len(r.cur))
		for h := range G {
			if h == g {
				continue
			}
			t := &r.trees[h]
			for range pending {
				f, k := t.max()
				if f == inf {
					break
				}
				j := h + k*G
				if r.vreq[j] == 0 {
					touched = append(touched, j)
				}
				r.vreq[j]++
				r.vpages[j] += pages
				r.setLeaf(j)
			}
		}
	}
	return excl, touched
}

// undoVirtualLocked leaves the trees as they were before virtualLocked.
func (r *Replica) undoVirtualLocked(excl, touched []int) {
	for _, j := range touched {
		r.vreq[j], r.vpages[j] = 0, 0
		r.setLeaf(j)
	}
	for _, i := range excl {
		r.setLeaf(i)
	}
}

// chooseFromTrees is SharePick(vs, g, G, bias) (G > 1) or PickServing
// (G = 1) over the keys in the share trees (worker i = h + k·G is leaf k
// of trees[h]), or -1.
func chooseFromTrees(trees []freeTree, g, G int, bias float64) int {
	inf := math.Inf(-1)
	if G == 1 {
		if f, k := trees[0].max(); f != inf {
			return k
		}
		return -1
	}
	// The other shares' freest, ties to the lower position.
	bo, bf := -1, inf
	for h := range G {
		if h == g {
			continue
		}
		f, k := trees[h].max()
		if f == inf {
			continue
		}
		if i := h + k*G; bo < 0 || f > bf || f == bf && i < bo {
			bo, bf = i, f
		}
	}
	// This share's, by the biased freeness: the bias may round
	// neighbouring freeness values to one, so the scan's choice is the
	// first of the share whose biased value is the greatest — the first
	// whose freeness is at least the least value that rounds there.
	bg, bm := -1, inf
	if f, _ := trees[g].max(); f != inf {
		bm = biased(f, bias)
		lo := f
		if math.IsInf(bm, 1) {
			// A freeness near the largest float64 (no real worker's):
			// the first leaf that rounds to +Inf, by a scan.
			t := &trees[g]
			for k := range t.size {
				if biased(t.f[t.size+k], bias) == bm {
					return g + k*G // nothing beats +Inf; the first is first
				}
			}
		}
		for {
			next := math.Nextafter(lo, inf)
			if biased(next, bias) != bm {
				break
			}
			lo = next
		}
		bg = g + trees[g].leftmost(lo)*G
	}
	switch {
	case bg < 0:
		return bo
	case bo < 0 || bm > bf:
		return bg
	case bf > bm:
		return bo
	default:
		return min(bg, bo)
	}
}
