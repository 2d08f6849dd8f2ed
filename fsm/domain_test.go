package fsm

import (
	"fmt"
	"testing"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// nodeWorker registers worker id on node.
func nodeWorker(id, node string, budget uint64) *pb.Command {
	c := worker(id, budget)
	c.GetRegisterWorker().Worker.Node = node
	return c
}

func replicas(r uint32) *pb.Command {
	return &pb.Command{Body: &pb.Command_SetStrategy{SetStrategy: &pb.SetStrategyCmd{CheckpointReplicas: r}}}
}

// domainCluster is two nodes of two workers and one of one: a1 a2 | b1 b2 | c1.
func domainCluster(t *testing.T, budget uint64) *harness {
	h := newHarness(t)
	for _, w := range [][2]string{{"a1", "A"}, {"a2", "A"}, {"b1", "B"}, {"b2", "B"}, {"c1", "C"}} {
		if r := h.one(nodeWorker(w[0], w[1], budget)); r.Err != nil {
			t.Fatal(r.Err)
		}
	}
	return h
}

func copiesOf(p *pb.Placement) []string {
	if p.HolderId == "" {
		return nil
	}
	return append([]string{p.HolderId}, p.ReplicaHolders...)
}

// TestNodeLabelReplicated: the worker table keeps a worker's domain labels.
func TestNodeLabelReplicated(t *testing.T) {
	h := newHarness(t)
	c := nodeWorker("w1", "node-7", 1<<20)
	c.GetRegisterWorker().Worker.Rack = "rack-2"
	h.one(c)
	w := h.f.Worker("w1")
	if w.Node != "node-7" || w.Rack != "rack-2" || h.f.st.view("w1").Node != "node-7" {
		t.Fatalf("row %v, view node %q", w, h.f.st.view("w1").Node)
	}
}

// TestHolderOutsideServingNode: with every load equal, h(r) would take
// the serving worker's node-mate (the smaller id after it); the holder is
// on another node, and each of R copies on a node of its own.
func TestHolderOutsideServingNode(t *testing.T) {
	h := domainCluster(t, 1<<30)
	for i := 0; i < 20; i++ {
		p := h.one(dispatch(fmt.Sprintf("r%d", i), 100, 28)).Dispatch.Placement
		if p.HolderId == "" || h.f.Worker(p.HolderId).Node == h.f.Worker(p.WorkerId).Node {
			t.Fatalf("%s on %s: holder %q shares its node", p.RequestId, p.WorkerId, p.HolderId)
		}
	}
	if r := h.one(replicas(2)); r.Err != nil {
		t.Fatal(r.Err)
	}
	for i := 20; i < 40; i++ {
		p := h.one(dispatch(fmt.Sprintf("r%d", i), 100, 28)).Dispatch.Placement
		cs := copiesOf(p)
		nodes := map[string]bool{h.f.Worker(p.WorkerId).Node: true}
		for _, c := range cs {
			nodes[h.f.Worker(c).Node] = true
		}
		if len(cs) != 2 || len(nodes) != 3 {
			t.Fatalf("%s on %s: copies %v, want two on the two other nodes", p.RequestId, p.WorkerId, cs)
		}
	}
	checkReservations(t, h.f.st)
	if same, short := h.f.DomainCounts(); same != 0 || short != 0 {
		t.Fatalf("same-domain %d, short %d: want none", same, short)
	}
	// Three copies among three nodes, one of them the serving worker's:
	// two copies, counted short.
	h.one(replicas(3))
	p := h.one(dispatch("r-short", 100, 28)).Dispatch.Placement
	if len(copiesOf(p)) != 2 {
		t.Fatalf("copies %v: want 2 (three nodes, one serving)", copiesOf(p))
	}
	if _, short := h.f.DomainCounts(); short != 1 {
		t.Fatalf("short %d, want 1", short)
	}
	if r := h.one(replicas(9)); r.Err == nil {
		t.Fatal("9 replicas accepted")
	}
}

// TestSameDomainFallbackCounted: when no worker off the serving node has
// budget, the copy goes to the node-mate and the counter says so.
func TestSameDomainFallbackCounted(t *testing.T) {
	h := newHarness(t)
	h.one(nodeWorker("a1", "A", 1<<30))
	h.one(nodeWorker("a2", "A", 1<<30))
	h.one(nodeWorker("b1", "B", 1)) // no room for any footprint
	h.one(load("a2", 1, 0, 900))    // a1 serves
	h.one(load("b1", 1, 0, 900))
	p := h.one(dispatch("r1", 100, 28)).Dispatch.Placement
	if p.WorkerId != "a1" || p.HolderId != "a2" {
		t.Fatalf("served by %s, held by %s: want a1, a2 (the fallback)", p.WorkerId, p.HolderId)
	}
	if same, _ := h.f.DomainCounts(); same != 1 {
		t.Fatalf("same-domain %d, want 1", same)
	}
}

// TestReplicaSurvivesHolder: R = 2; the first copy's holder fails, the
// replica takes its place; then the serving worker fails and the request
// restores from that copy. Complete frees every reservation.
func TestReplicaSurvivesHolder(t *testing.T) {
	h := domainCluster(t, 1<<30)
	h.one(replicas(2))
	p := h.one(dispatch("r1", 100, 28)).Dispatch.Placement
	cs := copiesOf(p)
	if len(cs) != 2 {
		t.Fatalf("copies %v", cs)
	}
	first, second := cs[0], cs[1]
	h.one(markFailed(first, 1))
	p, _ = h.f.Placement("r1")
	if p.HolderId != second || len(p.ReplicaHolders) != 0 || p.ReservedBytes == 0 {
		t.Fatalf("after %s failed: holder %q replicas %v reserved %d, want %s alone", first, p.HolderId, p.ReplicaHolders, p.ReservedBytes, second)
	}
	checkReservations(t, h.f.st)
	h.one(markFailed(p.WorkerId, 1))
	rps := h.f.Recoveries()
	a := rps[len(rps)-1].Assignments[0]
	if a.Mode != pb.RecoveryMode_RECOVERY_MODE_REUSE || a.TargetWorker != second || a.CheckpointHolder != second {
		t.Fatalf("recovery %v: want a reuse at %s", a, second)
	}
	checkReservations(t, h.f.st)
	h.one(complete("r1"))
	for id, u := range h.f.HolderUsage() {
		if u[0] != 0 {
			t.Fatalf("%s still reserves %d bytes", id, u[0])
		}
	}
}

// TestNodeFailureRestoresEverything: a whole node (a1, a2) fails in one
// entry, as the simulator and the leader's probes commit it; with the
// holders off the node every request reuses a checkpoint.
func TestNodeFailureRestoresEverything(t *testing.T) {
	h := domainCluster(t, 1<<30)
	var onA int
	for i := 0; i < 40; i++ {
		if p := h.one(dispatch(fmt.Sprintf("r%d", i), 100, 28)).Dispatch.Placement; p.WorkerId == "a1" || p.WorkerId == "a2" {
			onA++
		}
	}
	if onA == 0 {
		t.Fatal("nothing served on node A")
	}
	for _, id := range []string{"b1", "b2", "c1"} {
		h.one(load(id, 1, 0, 200)) // 20 running each: they start restores at once (no rebalancing)
	}
	h.apply(markFailed("a1", 1), markFailed("a2", 1))
	reused := 0
	for _, rp := range h.f.Recoveries() {
		for _, a := range rp.Assignments {
			if a.Mode != pb.RecoveryMode_RECOVERY_MODE_REUSE {
				t.Errorf("%s: %v, want a reuse", a.RequestId, a.Mode)
			}
			reused++
		}
	}
	if reused != onA {
		t.Fatalf("%d reused of %d on the node", reused, onA)
	}
	checkReservations(t, h.f.st)
}

// TestFailingTogetherNoTargetAmongThem: workers marked failed in one entry
// are no recovery target for one another: a1's requests go to b1, not to
// its freer node-mate a2, which the same entry fails (and whose plan would
// move them a second time).
func TestFailingTogetherNoTargetAmongThem(t *testing.T) {
	h := newHarness(t)
	h.one(strategy(pb.Strategy_STRATEGY_RECOMPUTE))
	h.one(nodeWorker("a1", "A", 1<<30))
	h.one(nodeWorker("a2", "A", 1<<30))
	h.one(nodeWorker("b1", "B", 1<<30))
	h.one(load("a2", 1, 0, 900))
	h.one(load("b1", 1, 0, 900))
	for i := 0; i < 4; i++ {
		if p := h.one(dispatch(fmt.Sprintf("r%d", i), 100, 28)).Dispatch.Placement; p.WorkerId != "a1" {
			t.Fatalf("r%d on %s, want a1", i, p.WorkerId)
		}
	}
	h.one(load("b1", 1, 0, 500)) // a2 (100 pages free) is still freer than b1
	h.one(load("a2", 1, 0, 0))
	h.apply(markFailed("a1", 1), markFailed("a2", 1))
	planned := 0
	for _, rp := range h.f.Recoveries() {
		for _, a := range rp.Assignments {
			planned++
			if a.TargetWorker != "b1" {
				t.Errorf("%s (plan of %s) to %s, want b1", a.RequestId, rp.FailedWorker, a.TargetWorker)
			}
		}
	}
	if planned != 4 {
		t.Fatalf("%d assignments for 4 requests: some were planned twice", planned)
	}
}

// TestMigrationOntoTheHoldersNode: a request migrates to a worker on its
// checkpoint holder's node (not the holder itself): the commit chooses the
// copy again, off the destination's node, as the copy may not share its
// serving worker's failure domain; a migration elsewhere keeps it.
func TestMigrationOntoTheHoldersNode(t *testing.T) {
	h := domainCluster(t, 1<<30)
	p := h.one(dispatch("r1", 100, 28)).Dispatch.Placement
	holder := h.f.Worker(p.HolderId)
	var mate, other string // the holder's node-mate, and a worker on the third node
	for _, id := range []string{"a1", "a2", "b1", "b2", "c1"} {
		w := h.f.Worker(id)
		switch {
		case id == p.WorkerId || id == p.HolderId:
		case w.Node == holder.Node:
			mate = id
		case w.Node != h.f.Worker(p.WorkerId).Node && other == "":
			other = id
		}
	}
	if mate == "" || other == "" {
		t.Fatalf("r1 on %s held by %s: no node-mate of the holder free to migrate to", p.WorkerId, p.HolderId)
	}
	from := p.WorkerId + "/1>" + mate + "/1"
	h.expect(migrateCmd("r1", p.Epoch, mate, 1), "STARTED r1 "+from)
	c := h.expect(finishCmd("r1", p.Epoch, mate, 1, true), "COMMITTED r1 "+from, "move r1>"+mate).Placement
	if c.HolderId == "" || h.f.Worker(c.HolderId).Node == h.f.Worker(mate).Node {
		t.Fatalf("after the commit onto %s (node %s): holder %q, on the destination's node", mate, holder.Node, c.HolderId)
	}
	checkReservations(t, h.f.st)
	// Onward to the third node, away from the copy's: the copy stays.
	kept := c.HolderId
	if h.f.Worker(other).Node == h.f.Worker(kept).Node {
		t.Fatalf("the new copy %s is on %s's node: the keep case needs another destination", kept, other)
	}
	from = mate + "/1>" + other + "/1"
	h.expect(migrateCmd("r1", c.Epoch, other, 1), "STARTED r1 "+from)
	c = h.expect(finishCmd("r1", c.Epoch, other, 1, true), "COMMITTED r1 "+from, "move r1>"+other).Placement
	if c.HolderId != kept {
		t.Fatalf("after a migration away from the copy's node: holder %q, want %q kept", c.HolderId, kept)
	}
	checkReservations(t, h.f.st)
}

// TestMarkFailedCarriesCopyPrefixes: the prefixes the leader gathered from
// the live holders (MarkFailedCmd.checkpointed) reach the recovery plan,
// which restores from the longest copy. Without them it takes the freer
// copy; with the less free copy reported longer, that one.
func TestMarkFailedCarriesCopyPrefixes(t *testing.T) {
	for _, c := range []struct {
		name      string
		reported  bool
		wantFreer bool
	}{{"not reported: the freer copy", false, true}, {"reported: the longest copy", true, false}} {
		t.Run(c.name, func(t *testing.T) {
			h := domainCluster(t, 1<<30)
			h.one(replicas(2))
			p := h.one(dispatch("r1", 600, 28)).Dispatch.Placement
			cs := copiesOf(p)
			if len(cs) != 2 {
				t.Fatalf("r1 copies %v, want 2", cs)
			}
			// The first copy's holder is freer; the second holds more.
			h.one(load(cs[0], 1, 0, 100))
			h.one(load(cs[1], 1, 0, 300))
			mf := markFailed(p.WorkerId, 1)
			if c.reported {
				mf.GetMarkFailed().Checkpointed = []*pb.CopyPrefix{
					{RequestId: "r1", Holder: cs[0], Tokens: 64}, {RequestId: "r1", Holder: cs[1], Tokens: 592}}
			}
			if r := h.one(mf); r.Err != nil {
				t.Fatal(r.Err)
			}
			plans := h.f.Recoveries()
			a := plans[len(plans)-1].Assignments[0]
			want := cs[1]
			if c.wantFreer {
				want = cs[0]
			}
			if a.Mode != pb.RecoveryMode_RECOVERY_MODE_REUSE || a.CheckpointHolder != want || a.TargetWorker != want {
				t.Fatalf("copies %v: plan %v, want a reuse of %s's copy", cs, a, want)
			}
			checkReservations(t, h.f.st)
		})
	}
}
