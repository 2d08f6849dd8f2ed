package policy

import (
	"fmt"
	"math/rand"
	"testing"
	"time"
)

// onNode is w on a node.
func onNode(id, node string, q float64) Worker {
	x := w(id, q)
	x.Node = node
	return x
}

func holderIDs(ws []Worker, c HolderChoice) string {
	out := ""
	for k, h := range c.Holders {
		if k > 0 {
			out += ","
		}
		out += ws[h].ID
	}
	if out == "" {
		return "-"
	}
	return out
}

// TestChooseHoldersDomains: F(r) leaves out the serving worker's node, each
// further copy every node already holding one; the first copy falls back
// to the serving node only when nothing outside it has the budget, and says
// so.
func TestChooseHoldersDomains(t *testing.T) {
	full := func(x Worker) Worker { x.CheckpointBudget = 0; return x }
	// a1 serves; a2 is the least loaded but shares its node.
	cluster := []Worker{onNode("a1", "A", 5), onNode("a2", "A", 0), onNode("b1", "B", 3), onNode("b2", "B", 1),
		onNode("c1", "C", 2), onNode("d1", "D", 4)}
	cases := []struct {
		name       string
		ws         []Worker
		replicas   int
		want       string
		sameDomain bool
		short      bool
		why        NoHolder
	}{
		{"h(r) outside the node", cluster, 1, "b2", false, false, HolderFound},
		{"two copies, two other nodes", cluster, 2, "b2,c1", false, false, HolderFound},
		{"three copies", cluster, 3, "b2,c1,d1", false, false, HolderFound},
		{"more copies than nodes: short", cluster, 4, "b2,c1,d1", false, true, HolderFound},
		{"no budget outside: the node's own, counted",
			[]Worker{onNode("a1", "A", 5), onNode("a2", "A", 0), full(onNode("b1", "B", 0))}, 2, "a2", true, true, HolderFound},
		{"no budget anywhere",
			[]Worker{onNode("a1", "A", 5), full(onNode("a2", "A", 0)), full(onNode("b1", "B", 0))}, 1, "-", false, false, NoHolderBudgetFull},
		{"alone", []Worker{onNode("a1", "A", 0)}, 1, "-", false, false, NoHolderNoPeer},
		// Without labels every worker is its own domain: the domain-blind
		// h(r) of before.
		{"unlabelled: blind", []Worker{w("a1", 5), w("a2", 0), w("b1", 3)}, 2, "a2,b1", false, false, HolderFound},
	}
	for _, c := range cases {
		for _, indexed := range []bool{false, true} {
			var idx *HolderIndex
			if indexed {
				idx = NewHolderIndex(c.ws, 1)
			}
			got := ChooseHolders(Lumen, c.ws, idx, 0, 100, 1, c.replicas, nil)
			if g := holderIDs(c.ws, got); g != c.want || got.SameDomain != c.sameDomain || got.Short != c.short || got.Why != c.why {
				t.Errorf("%s (index %v): got %s same-domain %v short %v %q, want %s %v %v %q", c.name, indexed, g,
					got.SameDomain, got.Short, got.Why, c.want, c.sameDomain, c.short, c.why)
			}
		}
	}
	// fixed-checkpoint is DéjàVu's ring, domains or not, one copy.
	if got := ChooseHolders(FixedCheckpoint, cluster, nil, 0, 100, 1, 2, nil); holderIDs(cluster, got) != "a2" {
		t.Errorf("fixed-checkpoint: got %s, want the ring successor a2", holderIDs(cluster, got))
	}
}

// TestHolderIndexPickSkipMatchesScan: with a random node layout, the index
// skipping the serving node picks what the reference scan picks.
func TestHolderIndexPickSkipMatchesScan(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	ws := make([]Worker, 48)
	for i := range ws {
		ws[i] = onNode(fmt.Sprintf("w%02d", i), fmt.Sprintf("n%d", i/8), float64(rng.Intn(5)))
		ws[i].CheckpointBudget = uint64(rng.Intn(1000))
	}
	idx := NewHolderIndex(ws, 1)
	for step := 0; step < 3000; step++ {
		i := rng.Intn(len(ws))
		switch rng.Intn(3) {
		case 0:
			ws[i].Eligible = !ws[i].Eligible
		case 1:
			ws[i].QueueWaitMs = float64(rng.Intn(5))
		case 2:
			ws[i].Held++
			ws[i].Reserved += uint64(rng.Intn(300))
		}
		idx.Update(i, &ws[i])
		serving, fp := rng.Intn(len(ws)), uint64(rng.Intn(400))
		skip := func(j int) bool { return ws[j].Node == ws[serving].Node }
		g1, r1 := idx.PickSkip(serving, fp, skip)
		g2, r2 := pickHolderSkip(ws, serving, fp, 1, skip)
		if g1 != g2 || r1 != r2 {
			t.Fatalf("seed %d step %d: index %d %q, scan %d %q", seed, step, g1, r1, g2, r2)
		}
		if g1 >= 0 && ws[g1].Node == ws[serving].Node {
			t.Fatalf("seed %d step %d: holder %s on the serving worker's node %s", seed, step, ws[g1].ID, ws[serving].Node)
		}
	}
}

// TestPlanRecoveryPicksLiveCopy: a request whose first copy died with its
// serving worker restores from a live replica, the one with the KV room;
// with no live copy it is recomputed.
func TestPlanRecoveryPicksLiveCopy(t *testing.T) {
	dead := onNode("a2", "A", 0)
	dead.Eligible = false
	tight := onNode("c1", "C", 0)
	tight.KVPagesUsed = 995 // no room for a 200-token prefix
	ws := []Worker{dead, onNode("b1", "B", 0), tight, onNode("d1", "D", 0)}
	for i := range ws {
		ws[i].Running = 10 // they start the restores at once: no rebalancing
	}
	reqs := []Interrupted{
		{RequestID: "r1", Holder: "a2", Replicas: []string{"b1"}, PromptTokens: 200},
		{RequestID: "r2", Holder: "a2", Replicas: []string{"c1", "b1"}, PromptTokens: 200},
		{RequestID: "r3", Holder: "a2", PromptTokens: 200},
	}
	plan := PlanRecovery(Lumen, ws, reqs)
	want := []struct {
		target string
		mode   Mode
	}{{"b1", Reuse}, {"b1", Reuse}, {"", Recompute}}
	for k, a := range plan {
		if a.Mode != want[k].mode || want[k].target != "" && (ws[a.Target].ID != want[k].target || a.Holder != want[k].target) {
			t.Errorf("%s: target %s mode %d holder %s, want %s mode %d", a.RequestID, ws[a.Target].ID, a.Mode, a.Holder, want[k].target, want[k].mode)
		}
	}
}

// TestRebalanceToReplica: a holder with more restores than its share and
// than it runs sends the surplus to another live copy's holder, reusing
// the pages there, rather than recomputing them; past that copy's share
// too, the rest is recomputed.
func TestRebalanceToReplica(t *testing.T) {
	ws := []Worker{onNode("b1", "B", 0), onNode("c1", "C", 0), onNode("d1", "D", 0)}
	// c1 is busier: every restore goes to b1's copy first.
	ws[1].KVPagesUsed, ws[1].Running = 500, 10
	var reqs []Interrupted
	for i := 0; i < 6; i++ {
		reqs = append(reqs, Interrupted{RequestID: fmt.Sprintf("r%d", i), Holder: "b1", Replicas: []string{"c1"}, PromptTokens: uint32(100 + i)})
	}
	got := map[string]string{}
	for _, a := range PlanRecovery(Lumen, ws, reqs) {
		mode := "reuse"
		if a.Mode != Reuse {
			mode = "recompute"
		} else if a.Holder != ws[a.Target].ID {
			t.Errorf("%s: reuses %s's copy at %s", a.RequestID, a.Holder, ws[a.Target].ID)
		}
		got[ws[a.Target].ID+" "+mode] += a.RequestID
	}
	// The average is 2; the smallest prefixes move first.
	want := map[string]string{"c1 reuse": "r0r1", "d1 recompute": "r2r3", "b1 reuse": "r4r5"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("plan %v, want %v", got, want)
	}
}

// TestPlanRecoveryLongestLiveCopy: among a request's live copies the plan
// restores from the one with the longest checkpointed prefix, and among
// copies of equal prefix from the cheapest (the KV room, then the
// freest), whatever the holder order; a dead holder's longer copy counts
// for nothing.
func TestPlanRecoveryLongestLiveCopy(t *testing.T) {
	dead := onNode("a1", "A", 0)
	dead.Eligible = false
	busy := onNode("b1", "B", 0)
	busy.KVPagesUsed, busy.Running = 400, 10 // room for the prefix, but less free
	ws := []Worker{dead, busy, onNode("c1", "C", 0), onNode("d1", "D", 0)}
	for i := range ws {
		ws[i].Running = max(ws[i].Running, 10) // no rebalancing
	}
	reqs := []Interrupted{
		// The primary died with the longest copy; of the live ones b1's is
		// longer than the freer c1's.
		{RequestID: "r1", Holder: "a1", Replicas: []string{"c1", "b1"}, PromptTokens: 600, Checkpointed: []uint32{600, 160, 592}},
		// Equal prefixes: the freer copy.
		{RequestID: "r2", Holder: "a1", Replicas: []string{"b1", "c1"}, PromptTokens: 600, Checkpointed: []uint32{600, 320, 320}},
		// A replica without an entry holds nothing: the busy primary's 48
		// tokens win over the freer c1.
		{RequestID: "r3", Holder: "b1", Replicas: []string{"c1"}, PromptTokens: 600, Checkpointed: []uint32{48}},
		// Not known: the cheapest, as before.
		{RequestID: "r4", Holder: "a1", Replicas: []string{"b1", "c1"}, PromptTokens: 600},
	}
	want := []string{"b1", "c1", "b1", "c1"}
	for k, a := range PlanRecovery(Lumen, append([]Worker(nil), ws...), reqs) {
		if a.Mode != Reuse || ws[a.Target].ID != want[k] || a.Holder != want[k] {
			t.Errorf("%s: target %s mode %d holder %s, want reuse at %s", a.RequestID, ws[a.Target].ID, a.Mode, a.Holder, want[k])
		}
	}
}
