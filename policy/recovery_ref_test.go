package policy

import (
	"fmt"
	"math/rand"
	"sort"
	"testing"
	"time"
)

// planRecoveryScan is PlanRecovery as it was before the freeness tree and
// the binary search: every choice a scan of the workers. The reference
// TestPlanRecoveryMatchesScan holds the tree to.
func planRecoveryScan(s Strategy, ws []Worker, reqs []Interrupted) []Assignment {
	eligible := 0
	byID := make(map[string]int, len(ws))
	for i := range ws {
		byID[ws[i].ID] = i
		if ws[i].Eligible {
			eligible++
		}
	}
	if eligible == 0 || len(reqs) == 0 {
		return nil
	}
	assign := func(i int, r Interrupted) {
		ws[i].PendingRequests++
		ws[i].PendingPages += Pages(uint64(r.PromptTokens) + 1)
	}
	unassign := func(i int, r Interrupted) {
		ws[i].PendingRequests--
		ws[i].PendingPages -= Pages(uint64(r.PromptTokens) + 1)
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
	// (the fsm: what each holder stored is not replicated) every copy
	// has the same prefix up to what the serving worker's queues to each
	// had sent, so the fastest restore is the choice.
	live := func(r Interrupted) int {
		best, bestRoom, bestF, bestP := -1, false, 0.0, uint32(0)
		need := int64(Pages(uint64(r.PromptTokens) + 1))
		consider := func(id string, p uint32) {
			h, ok := byID[id]
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
	count := make([]int, len(ws))
	for k, r := range reqs {
		a := Assignment{RequestID: r.RequestID, Holder: r.Holder, Target: -1}
		if m, ok := byID[r.MigrationTarget]; ok && s == Lumen && r.MigrationTarget != "" && ws[m].Eligible {
			a.Target, a.Mode, a.Holder, a.MigrationCopy = m, Reuse, r.MigrationTarget, true
		} else if h := live(r); h >= 0 && s.KeepsCheckpoints() {
			a.Target, a.Mode, a.Holder = h, Reuse, ws[h].ID
			// A restore needs the whole prefix in KV at once: at a holder
			// without the room it waits for running requests to finish
			// (seconds on a KV-bound worker). lumen recomputes it on the
			// freest worker instead when that one has the room.
			need := int64(Pages(uint64(r.PromptTokens) + 1))
			if s == Lumen && room(h) < need {
				if alt := PickServing(ws); alt >= 0 && alt != h && room(alt) >= need {
					a.Target, a.Mode, a.Rebalanced = alt, Recompute, true
				}
			}
		} else {
			a.Target, a.Mode = PickServing(ws), Recompute
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
	order := make([]int, len(reqs)) // reuse assignments, smallest prefix first
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
			i, ok := byID[id]
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
		// The least-loaded worker still below the average, other than src.
		for i := range ws {
			if i == src || !ws[i].Eligible || count[i] >= avg {
				continue
			}
			if f := ws[i].Freeness(); dst < 0 || f > dstF {
				dst, dstF = i, f
			}
		}
		if dst < 0 {
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

// TestPlanRecoveryMatchesScan: on random clusters and interrupted
// requests (copies, migrations, holders dead or alive), PlanRecovery's plan
// and its accounting are the scan's.
func TestPlanRecoveryMatchesScan(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	for round := 0; round < 300; round++ {
		n := 1 + rng.Intn(40)
		ws := make([]Worker, n)
		for i := range ws {
			ws[i] = onNode(fmt.Sprintf("w%02d", i), fmt.Sprintf("n%d", i/4), float64(rng.Intn(5)))
			ws[i].Eligible = rng.Intn(5) != 0
			ws[i].KVPagesUsed = uint64(rng.Intn(1000))
			ws[i].Running = uint32(rng.Intn(8))
			ws[i].Waiting = uint32(rng.Intn(3))
			ws[i].PendingRequests = uint32(rng.Intn(3))
		}
		id := func() string {
			if rng.Intn(6) == 0 {
				return ""
			}
			return fmt.Sprintf("w%02d", rng.Intn(n+2)) // some unknown
		}
		reqs := make([]Interrupted, rng.Intn(60))
		for k := range reqs {
			reqs[k] = Interrupted{RequestID: fmt.Sprintf("r%03d", k), Holder: id(), PromptTokens: uint32(1 + rng.Intn(3000))}
			for range rng.Intn(3) {
				reqs[k].Replicas = append(reqs[k].Replicas, id())
			}
			if rng.Intn(8) == 0 {
				reqs[k].MigrationTarget = id()
			}
			if rng.Intn(2) == 0 { // the copies' prefixes known, some ties
				reqs[k].Checkpointed = make([]uint32, rng.Intn(len(reqs[k].Replicas)+2))
				for c := range reqs[k].Checkpointed {
					reqs[k].Checkpointed[c] = uint32(16 * rng.Intn(4))
				}
			}
		}
		for _, s := range Strategies {
			a, b := append([]Worker(nil), ws...), append([]Worker(nil), ws...)
			p1, p2 := PlanRecovery(s, a, reqs), planRecoveryScan(s, b, reqs)
			if fmt.Sprint(p1) != fmt.Sprint(p2) || fmt.Sprint(a) != fmt.Sprint(b) {
				t.Fatalf("seed %d round %d %s:\n tree %v\n scan %v", seed, round, s, p1, p2)
			}
		}
	}
}
