package placer

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// scanKeys is SharePick (G > 1) or PickServing (G = 1) over raw keys, as
// those scans compare them: the reference chooseFromTrees must match.
func scanKeys(keys []float64, g, G int, bias float64) int {
	best, bestF := -1, math.Inf(-1)
	for i, f := range keys {
		if G > 1 && i%G == g {
			f = biased(f, bias)
		}
		if f > bestF {
			best, bestF = i, f
		}
	}
	return best
}

func treesOf(keys []float64, G int) []freeTree {
	trees := make([]freeTree, G)
	for h := range G {
		trees[h].reset((len(keys) - h + G - 1) / G)
		for i := h; i < len(keys); i += G {
			trees[h].f[trees[h].size+i/G] = keys[i]
		}
		trees[h].build()
	}
	return trees
}

// TestChooseFromTreesRounding: freeness values one ulp apart that the bias
// rounds to one value, and ties across shares: the tree's choice is the
// scan's.
func TestChooseFromTreesRounding(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	collapsed := 0
	for trial := range 20000 {
		n := 1 + rng.IntN(40)
		G := 1 + rng.IntN(5)
		g := rng.IntN(G)
		base := []float64{rng.Float64() * 100, -rng.Float64() * 100, 0, 1, 3.0 / 7}[rng.IntN(5)]
		keys := make([]float64, n)
		for i := range keys {
			switch rng.IntN(4) {
			case 0:
				keys[i] = math.Inf(-1) // ineligible
			default:
				f := base
				for range rng.IntN(4) {
					f = math.Nextafter(f, math.Inf(-1))
				}
				keys[i] = f
			}
		}
		for k := range keys {
			for j := range keys {
				if keys[k] != keys[j] && keys[k] != math.Inf(-1) && keys[j] != math.Inf(-1) &&
					biased(keys[k], ShareBias) == biased(keys[j], ShareBias) {
					collapsed++
				}
			}
		}
		if got, want := chooseFromTrees(treesOf(keys, G), g, G, ShareBias), scanKeys(keys, g, G, ShareBias); got != want {
			t.Fatalf("seed %d trial %d: g %d of %d, keys %v: tree chose %d, the scan %d", seed, trial, g, G, keys, got, want)
		}
	}
	if collapsed == 0 {
		t.Fatalf("seed %d: no pair of distinct freeness values the bias rounds to one: the case is not exercised", seed)
	}
}

// refTake is Take's choice as it was made before the trees: the scans
// (PickShared with ShareBias, or PickServing) over the view with exclude
// made ineligible.
func refTake(r *Replica, promptTokens uint32, exclude []string) (string, bool) {
	vs := r.Views()
	r.mu.Lock()
	g, G, pending := r.g, r.G, len(r.own)
	for _, x := range exclude {
		if i, ok := r.find(x); ok {
			vs[i].Eligible = false
		}
	}
	r.mu.Unlock()
	var i int
	if G > 1 {
		i = PickShared(vs, g, G, pending, policy.Pages(uint64(promptTokens)), ShareBias)
	} else {
		i = policy.PickServing(vs)
	}
	if i < 0 {
		return "", false
	}
	return vs[i].ID, true
}

// refTakePrefix is TakePrefix's choice by scans: the other gateways'
// virtual placements by SharePick, one at a time, then PickPrefix.
func refTakePrefix(r *Replica, promptTokens uint32, hashes []uint64, idx *PrefixIndex, exclude []string) (string, bool) {
	vs := r.Views()
	r.mu.Lock()
	g, G, pending := r.g, r.G, min(len(r.own), len(vs))
	for _, x := range exclude {
		if i, ok := r.find(x); ok {
			vs[i].Eligible = false
		}
	}
	r.mu.Unlock()
	pages := policy.Pages(uint64(promptTokens))
	if G > 1 {
		for h := range G {
			if h == g {
				continue
			}
			for range pending {
				j := SharePick(vs, h, G, math.Inf(1))
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
		return "", false
	}
	return vs[i].ID, true
}

func refBest(r *Replica) (float64, bool) {
	best, ok := math.Inf(-1), false
	for _, v := range r.Views() {
		if f := v.Freeness(); v.Eligible && f > best {
			best, ok = f, true
		}
	}
	return best, ok
}

// checkTrees fails the test when the replica's view, cur and trees, as
// Update left them, differ from those rebuilt from scratch (ensureTree).
func checkTrees(t *pb.LoadTable, r *Replica, seed uint64, run int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, w := range t.Workers {
		if i < len(r.views) && r.views[i].ID == w.WorkerId && (r.views[i] != View(w) || r.incs[i] != w.Incarnation) {
			panic(fmt.Sprintf("seed %d run %d: view %d is %+v, its row says %+v", seed, run, i, r.views[i], View(w)))
		}
	}
	if !r.curOK || r.treeG != r.G {
		return
	}
	cur := append([]policy.Worker(nil), r.cur...)
	var trees []freeTree
	for _, tr := range r.trees {
		trees = append(trees, freeTree{size: tr.size, f: append([]float64(nil), tr.f...), at: append([]int32(nil), tr.at...)})
	}
	r.curOK = false
	r.ensureTree()
	if !slices.Equal(cur, r.cur) {
		panic(fmt.Sprintf("seed %d run %d: cur kept by updates %+v, rebuilt %+v", seed, run, cur, r.cur))
	}
	for h := range trees {
		a, b := trees[h], r.trees[h]
		if a.size != b.size || !slices.Equal(a.at, b.at) || !slices.EqualFunc(a.f, b.f, func(x, y float64) bool { return x == y || x != x && y != y }) {
			panic(fmt.Sprintf("seed %d run %d: share %d's tree kept by updates differs from the rebuilt one", seed, run, h))
		}
	}
}

// TestTreeMatchesScan: random tables, shares, Takes (with exclusions),
// commits (some on another worker), forgets and share changes; every Take
// chooses what the scans choose over the same view, and BestFreeness is
// the scan's maximum.
func TestTreeMatchesScan(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 2))
	for run := range 40 {
		r := New()
		idx := NewPrefixIndex()
		nw := 1 + rng.IntN(60)
		ids := make([]string, nw)
		for i := range ids {
			ids[i] = fmt.Sprintf("w%03d", i)
		}
		var applied uint64
		var taken []string
		var last *pb.LoadTable
		row := func(id string) *pb.WorkerLoad {
			phase := pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE
			if rng.IntN(6) == 0 {
				phase = pb.WorkerPhase_WORKER_PHASE_DRAINING
			}
			// Few distinct values: ties are common.
			total := uint64(64 * (1 + rng.IntN(3)))
			return &pb.WorkerLoad{WorkerId: id, Phase: phase, Incarnation: uint64(1 + rng.IntN(3)),
				PendingRequests: uint32(rng.IntN(3)), PendingPages: uint64(rng.IntN(3) * 4),
				Load: &pb.LoadRecord{KvPagesTotal: total, KvPagesUsed: uint64(rng.IntN(int(total))),
					Running: uint32(rng.IntN(5)), Waiting: uint32(rng.IntN(3)), QueueHeadPages: uint64(rng.IntN(2) * 8),
					HighPriority: uint32(rng.IntN(2))}}
		}
		table := func() {
			applied += uint64(rng.IntN(20))
			t := &pb.LoadTable{AppliedIndex: applied}
			inOrder := last != nil && len(last.Workers) == nw && slices.IsSortedFunc(last.Workers, func(a, b *pb.WorkerLoad) int { return strings.Compare(a.WorkerId, b.WorkerId) })
			if inOrder && rng.IntN(2) == 0 {
				// As the FSM sends them: every worker in id order, the
				// unchanged rows the last table's own (updateRows), a
				// changed one sometimes equal to what it replaces.
				t.Workers = append([]*pb.WorkerLoad(nil), last.Workers...)
				for range rng.IntN(4) {
					i := rng.IntN(nw)
					if rng.IntN(3) == 0 {
						t.Workers[i] = proto.Clone(t.Workers[i]).(*pb.WorkerLoad)
					} else {
						t.Workers[i] = row(ids[i])
					}
				}
				last = t
				r.Update(t)
				checkTrees(t, r, seed, run)
				return
			}
			full := rng.IntN(3) == 0 // every worker, in order
			for _, id := range ids {
				if full {
					t.Workers = append(t.Workers, row(id))
					continue
				}
				if rng.IntN(8) == 0 {
					continue // not in this table
				}
				t.Workers = append(t.Workers, row(id))
			}
			if !full {
				rng.Shuffle(len(t.Workers), func(i, j int) { t.Workers[i], t.Workers[j] = t.Workers[j], t.Workers[i] })
			}
			last = t
			r.Update(t)
			checkTrees(t, r, seed, run)
		}
		table()
		for op := range 400 {
			switch k := rng.IntN(20); {
			case k < 2:
				table()
			case k < 3:
				G := 1 + rng.IntN(5)
				r.SetShare(rng.IntN(G), G)
			case k < 5 && len(taken) > 0:
				id := taken[rng.IntN(len(taken))]
				w := ids[rng.IntN(nw)] // Apply may have placed it elsewhere
				r.Committed(id, w, applied+uint64(rng.IntN(10))-3)
			case k < 6 && len(taken) > 0:
				r.Forget(taken[rng.IntN(len(taken))])
			default:
				var exclude []string
				for range rng.IntN(3) {
					exclude = append(exclude, ids[rng.IntN(nw)])
				}
				prompt := uint32(rng.IntN(200))
				id := fmt.Sprintf("r%d-%d", run, op)
				var ok bool
				if k%2 == 0 {
					// TakePrefix: the same virtual placements, then the
					// prefix score over an index of random holdings.
					hashes := make([]uint64, 1+rng.IntN(6))
					for i := range hashes {
						hashes[i] = uint64(i + 1)
					}
					for _, w := range ids {
						if n := rng.IntN(len(hashes) + 1); n > 0 {
							idx.Replace(w, hashes[:n])
						} else {
							idx.Reset(w)
						}
					}
					want, wantOK := refTakePrefix(r, prompt, hashes, idx, exclude)
					var got string
					got, _, ok = r.TakePrefix(id, prompt, hashes, idx, exclude...)
					if got != want || ok != wantOK {
						g, G := r.Share()
						t.Fatalf("seed %d run %d op %d (gateway %d of %d, %d pending): TakePrefix chose %q %v, the scans %q %v",
							seed, run, op, g, G, r.Pending(), got, ok, want, wantOK)
					}
				} else {
					want, wantOK := refTake(r, prompt, exclude)
					var got string
					got, _, ok = r.Take(id, prompt, exclude...)
					if got != want || ok != wantOK {
						g, G := r.Share()
						t.Fatalf("seed %d run %d op %d (gateway %d of %d, %d pending): Take chose %q %v, the scan %q %v",
							seed, run, op, g, G, r.Pending(), got, ok, want, wantOK)
					}
				}
				if ok {
					taken = append(taken, id)
				}
			}
			gb, gok := r.BestFreeness()
			wb, wok := refBest(r)
			if gb != wb || gok != wok {
				t.Fatalf("seed %d run %d op %d: BestFreeness %v %v, the scan %v %v", seed, run, op, gb, gok, wb, wok)
			}
		}
	}
}
