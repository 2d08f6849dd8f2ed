package placer

import (
	"math"
	"slices"

	"github.com/lumen-project/lumen/policy"
)

// Several gateways (issue 16). Each chooses from its own table, which
// counts the others' placements only some milliseconds after they commit;
// with PickServing alone every gateway picks the same freest worker in
// that window and they herd: in the simulator at 64 workers and 70% load,
// 4 gateways so placed raised TTFT mean by 50% and the spread of running
// requests across workers by 46% against Apply's dispatch
// (docs/benchmarks.md, `lumen sim -figure gateways`). Gateway g of G
// therefore (1) assumes each other gateway placed as many requests as it
// did itself since the table — each on the freest worker of that
// gateway's share — and (2) prefers the workers of its own share (the
// workers at positions ≡ g mod G in the id-sorted table), their freeness
// counting ShareBias more. That measured +4.6% spread and −4.8% TTFT
// against Apply's (seeds 1–4, 300 s; the simulator's prototypes of other
// choices and biases are in sim/gateways.go). With one gateway it is
// PickServing exactly.

// ShareBias is how much more a gateway counts the freeness of the workers
// of its own share (0.15 was the best of 0.05–0.5 in the simulator).
const ShareBias = 0.15

// SetShare makes this replica gateway g of G (0 ≤ g < G): Take then
// chooses as described above. G ≤ 1 (or g out of range) is a lone
// gateway: PickServing. A gateway that sets its session with SetSelf
// instead gets its share from each table's session list.
func (r *Replica) SetShare(g, G int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if G <= 1 || g < 0 || g >= G {
		g, G = 0, 1
	}
	r.g, r.G = g, G
	r.curOK = false
}

// SetSelf names this gateway's controller session: each table's gateway
// session list (LoadTable.sessions, in the order of the gateways' names)
// then gives its share: its position among them, their number. A session
// not in the table (just created, expired, or not a gateway's) makes it a
// lone gateway until one lists it.
func (r *Replica) SetSelf(session string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.self = session
	r.shareFromSessions()
	r.curOK = false
}

// Share returns the replica's share: gateway g of G.
func (r *Replica) Share() (g, G int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.g, r.G
}

func (r *Replica) shareFromSessions() {
	if r.self == "" {
		return
	}
	r.g, r.G = 0, 1
	if i := slices.Index(r.sessions, r.self); i >= 0 && len(r.sessions) > 1 {
		r.g, r.G = i, len(r.sessions)
	}
}

// PickShared is gateway g of G's choice over vs (sorted by id; modified
// in place): each other gateway's virtual placements — as many as
// pending, this gateway's own the table does not count, at most one per
// worker — of pages each go to the freest workers of that gateway's
// share; then the freest worker with this gateway's share preferred by
// bias (Take uses ShareBias). It returns the index in vs, or -1.
func PickShared(vs []policy.Worker, g, G, pending int, pages uint64, bias float64) int {
	pending = min(pending, len(vs))
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
	return SharePick(vs, g, G, bias)
}

// SharePick returns the eligible worker of greatest freeness, the
// freeness of those at positions ≡ g (mod G) counting 1 + bias times
// (divided by it when negative); an infinite bias picks only among those.
// Ties go to the smaller id.
func SharePick(vs []policy.Worker, g, G int, bias float64) int {
	only := math.IsInf(bias, 1)
	best, bestF := -1, math.Inf(-1)
	for i := range vs {
		mine := i%G == g
		if !vs[i].Eligible || only && !mine {
			continue
		}
		f := vs[i].Freeness()
		if mine && !only {
			f = biased(f, bias)
		}
		if f > bestF {
			best, bestF = i, f
		}
	}
	return best
}
