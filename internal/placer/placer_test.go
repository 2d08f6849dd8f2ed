package placer

import (
	"testing"

	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func row(id string, inc uint64, phase pb.WorkerPhase, used, running uint32) *pb.WorkerLoad {
	return &pb.WorkerLoad{WorkerId: id, Incarnation: inc, Phase: phase,
		Load: &pb.LoadRecord{WorkerId: id, Incarnation: inc, KvPagesTotal: 100, KvPagesUsed: uint64(used), Running: running}}
}

const full = pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE

// TestTakeIsPickServingOverTheTable: with no own placements the choice is
// exactly policy.PickServing over the table's views, whatever the order of
// the table's rows.
func TestTakeIsPickServingOverTheTable(t *testing.T) {
	r := New()
	if _, _, ok := r.Take("a", 10); ok {
		t.Fatal("an empty replica chose a worker")
	}
	tab := &pb.LoadTable{AppliedIndex: 5, Workers: []*pb.WorkerLoad{
		row("w3", 1, full, 50, 2), row("w1", 7, full, 90, 4), row("w2", 2, pb.WorkerPhase_WORKER_PHASE_FAILED, 0, 0)}}
	r.Update(tab)
	var vs []policy.Worker
	for _, id := range []string{"w1", "w2", "w3"} {
		for _, w := range tab.Workers {
			if w.WorkerId == id {
				vs = append(vs, View(w))
			}
		}
	}
	want := vs[policy.PickServing(vs)].ID
	w, inc, ok := r.Take("a", 10)
	if !ok || w != want || w != "w3" || inc != 1 {
		t.Fatalf("took %s@%d (%v), want %s@1", w, inc, ok, want)
	}
}

// TestOwnPlacementsCountUntilATableCountsThem: a gateway's placements weigh
// on its choice until a table at or past their commit index arrives; an
// older table never replaces a newer one.
func TestOwnPlacementsCountUntilATableCountsThem(t *testing.T) {
	r := New()
	r.Update(&pb.LoadTable{AppliedIndex: 10, Workers: []*pb.WorkerLoad{row("w1", 1, full, 0, 0), row("w2", 1, full, 0, 0)}})
	w1, _, _ := r.Take("a", 160) // 10 pages on the first (ties: smaller id)
	w2, _, _ := r.Take("b", 160) // now the other is freer
	if w1 != "w1" || w2 != "w2" {
		t.Fatalf("took %s then %s, want w1 then w2", w1, w2)
	}
	if r.Pending() != 2 {
		t.Fatalf("%d pending, want 2", r.Pending())
	}
	r.Committed("a", "w1", 12)
	r.Update(&pb.LoadTable{AppliedIndex: 11, Workers: []*pb.WorkerLoad{row("w1", 1, full, 0, 0), row("w2", 1, full, 0, 0)}})
	if r.Pending() != 2 {
		t.Fatalf("a table at 11 dropped a placement committed at 12: %d pending", r.Pending())
	}
	r.Update(&pb.LoadTable{AppliedIndex: 9})
	if idx, _ := r.Applied(); idx != 11 {
		t.Fatalf("an older table replaced the newer one: applied %d", idx)
	}
	tab := &pb.LoadTable{AppliedIndex: 12, Workers: []*pb.WorkerLoad{row("w1", 1, full, 10, 1), row("w2", 1, full, 0, 0)}}
	tab.Workers[0].PendingRequests = 1
	r.Update(tab)
	if r.Pending() != 1 {
		t.Fatalf("%d pending after the table counted a, want 1 (b)", r.Pending())
	}
	r.Forget("b")
	if r.Pending() != 0 {
		t.Fatalf("%d pending after Forget", r.Pending())
	}
	if w, _, _ := r.Take("c", 16, "w2"); w != "w1" {
		t.Fatalf("took %s with w2 excluded", w)
	}
	if _, _, ok := r.Take("d", 16, "w1", "w2"); ok {
		t.Fatal("took a worker with every worker excluded")
	}
}

// TestShares: a gateway's share comes from its place in the table's
// gateway session list (in the list's order, not the ids'); two gateways with the same fresh table and one placement of
// their own each not yet counted choose different workers, where without
// shares both choose the freest.
func TestShares(t *testing.T) {
	tab := &pb.LoadTable{AppliedIndex: 1, Sessions: []string{"s-a", "s-b"}, Workers: []*pb.WorkerLoad{
		row("w1", 1, full, 0, 0), row("w2", 1, full, 0, 0), row("w3", 1, full, 0, 0), row("w4", 1, full, 0, 0)}}
	a, b, lone := New(), New(), New()
	a.SetSelf("s-a")
	b.SetSelf("s-b")
	for _, r := range []*Replica{a, b, lone} {
		r.Update(tab)
	}
	if g, G := a.Share(); g != 0 || G != 2 {
		t.Fatalf("s-a's share: %d of %d, want 0 of 2", g, G)
	}
	if g, G := b.Share(); g != 1 || G != 2 {
		t.Fatalf("s-b's share: %d of %d, want 1 of 2", g, G)
	}
	if g, G := lone.Share(); g != 0 || G != 1 {
		t.Fatalf("a replica with no session: %d of %d, want 0 of 1", g, G)
	}
	// A lone gateway fills the freest worker first (ties: smaller id).
	wa, _, _ := a.Take("a1", 160)
	wb, _, _ := b.Take("b1", 160)
	if wa == wb {
		t.Fatalf("both gateways chose %s", wa)
	}
	// Each then assumes the other placed as many: the second choice of
	// each stays off the worker the other just took.
	wa2, _, _ := a.Take("a2", 160)
	wb2, _, _ := b.Take("b2", 160)
	if wa2 == wb || wb2 == wa || wa2 == wb2 {
		t.Fatalf("second choices %s and %s collide with first %s, %s", wa2, wb2, wa, wb)
	}
	// A session the table no longer lists: a lone gateway again.
	a.Update(&pb.LoadTable{AppliedIndex: 2, Sessions: []string{"s-b"}, Workers: tab.Workers})
	if g, G := a.Share(); g != 0 || G != 1 {
		t.Fatalf("after its session left the table: %d of %d, want 0 of 1", g, G)
	}
}

// TestBestFreenessIsTheFreenessTakeChooses: Best is the freeness of the worker a
// lone gateway's Take would choose, own placements counted, and false with
// no eligible worker; it takes nothing.
func TestBestFreenessIsTheFreenessTakeChooses(t *testing.T) {
	r := New()
	if _, ok := r.BestFreeness(); ok {
		t.Fatal("an empty replica has a best worker")
	}
	r.Update(&pb.LoadTable{AppliedIndex: 3, Workers: []*pb.WorkerLoad{
		row("w1", 1, full, 40, 2), row("w2", 1, full, 10, 1), row("w3", 1, pb.WorkerPhase_WORKER_PHASE_FAILED, 0, 0)}})
	free := func(id string) float64 {
		for _, v := range r.Views() {
			if v.ID == id {
				return v.Freeness()
			}
		}
		t.Fatalf("no view of %s", id)
		return 0
	}
	if f, ok := r.BestFreeness(); !ok || f != free("w2") {
		t.Fatalf("best %v (%v), want w2's %v", f, ok, free("w2"))
	}
	if r.Pending() != 0 {
		t.Fatal("Best took a placement")
	}
	// Own placements weigh on it as on Take: after each, Best is the
	// freeness of the worker Take would choose next.
	for i := range 6 {
		r.Take(string(rune('a'+i)), 320)
		vs := r.Views()
		want := vs[policy.PickServing(vs)].Freeness()
		if f, _ := r.BestFreeness(); f != want {
			t.Fatalf("after %d placements best %v, want %v", i+1, f, want)
		}
	}
	if r.Pending() != 6 {
		t.Fatalf("%d pending, want the 6 Takes", r.Pending())
	}
	r.Update(&pb.LoadTable{AppliedIndex: 4, Workers: []*pb.WorkerLoad{row("w3", 1, pb.WorkerPhase_WORKER_PHASE_FAILED, 0, 0)}})
	if _, ok := r.BestFreeness(); ok {
		t.Fatal("a table with no eligible worker has a best one")
	}
}

// TestTakeAt: a placement on a named worker counts there, as Take's do,
// with the incarnation the table knows; a worker the table does not hold
// eligible (failed, or absent) is refused.
func TestTakeAt(t *testing.T) {
	r := New()
	r.Update(&pb.LoadTable{AppliedIndex: 3, Workers: []*pb.WorkerLoad{row("w1", 4, full, 0, 0), row("w2", 1, full, 0, 0),
		row("w3", 1, pb.WorkerPhase_WORKER_PHASE_FAILED, 0, 0)}})
	if inc, ok := r.TakeAt("a", "w1", 160); !ok || inc != 4 {
		t.Fatalf("TakeAt w1: incarnation %d, %v; want 4, true", inc, ok)
	}
	// w1 counts a's 10 pages: the freer is w2 (on a tie, w1).
	if w, _, _ := r.Take("b", 16); w != "w2" {
		t.Fatalf("after a placement on w1, Take chose %s, want w2", w)
	}
	if _, ok := r.TakeAt("c", "w3", 16); ok {
		t.Fatal("TakeAt placed on a failed worker")
	}
	if _, ok := r.TakeAt("d", "w9", 16); ok {
		t.Fatal("TakeAt placed on a worker the table does not have")
	}
	if r.Pending() != 2 {
		t.Fatalf("%d pending, want 2 (a, b)", r.Pending())
	}
}
