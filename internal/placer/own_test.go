package placer

import (
	"fmt"
	"math/rand"
	"slices"
	"testing"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Views with the per-worker sums equal the views computed from every own
// placement one by one, through random Takes, commits, forgets and tables.
func TestOwnSumsMatchOwnPlacements(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	r := New()
	var applied uint64
	table := func() *pb.LoadTable {
		applied += uint64(rng.Intn(5))
		tab := &pb.LoadTable{AppliedIndex: applied}
		for w := 0; w < 6; w++ {
			tab.Workers = append(tab.Workers, row(fmt.Sprintf("w%d", w), 1, full, uint32(rng.Intn(100)), uint32(rng.Intn(8))))
		}
		return tab
	}
	r.Update(table())
	for step := 0; step < 5000; step++ {
		id := fmt.Sprintf("r%d", rng.Intn(200))
		switch rng.Intn(4) {
		case 0:
			r.Take(id, uint32(1+rng.Intn(4000)))
		case 1:
			r.Committed(id, fmt.Sprintf("w%d", rng.Intn(7)), applied+uint64(rng.Intn(6)))
		case 2:
			r.Forget(id)
		case 3:
			r.Update(table())
		}
		r.mu.Lock()
		want := slices.Clone(r.views)
		for _, o := range r.own {
			if i, ok := r.find(o.worker); ok {
				want[i].PendingRequests++
				want[i].PendingPages += o.pages
			}
		}
		got := r.viewsLocked()
		r.mu.Unlock()
		if !slices.Equal(got, want) {
			t.Fatalf("step %d: views\n%+v\nwant\n%+v", step, got, want)
		}
	}
}

// While no table comes (the controllers are out, or the replica watched
// is stalled), every request adds an own placement and none leaves: the
// replica keeps at most MaxOwn, dropping the oldest, and its per-worker
// sums stay those of the placements it keeps.
func TestOwnIsCappedWithoutTables(t *testing.T) {
	r := New()
	r.Update(&pb.LoadTable{AppliedIndex: 1, Workers: []*pb.WorkerLoad{row("w0", 1, full, 0, 0), row("w1", 1, full, 0, 0)}})
	const extra = 1000
	for i := 0; i < MaxOwn+extra; i++ {
		id := fmt.Sprintf("r%d", i)
		if _, _, ok := r.Take(id, 100); !ok {
			t.Fatalf("take %d: no worker", i)
		}
		if i%3 == 0 {
			r.Committed(id, "w1", 10+uint64(i)) // committed past the table held: still counted
		}
	}
	if n := r.Pending(); n != MaxOwn {
		t.Fatalf("%d own placements after %d takes without a table, want the cap %d", n, MaxOwn+extra, MaxOwn)
	}
	var sum uint32
	for _, v := range r.Views() {
		sum += v.PendingRequests
	}
	if sum != MaxOwn {
		t.Fatalf("the views count %d pending requests, the replica keeps %d", sum, MaxOwn)
	}
	r.mu.Lock()
	_, oldest := r.own["r0"]
	_, newest := r.own[fmt.Sprintf("r%d", MaxOwn+extra-1)]
	order := len(r.order)
	r.mu.Unlock()
	if oldest || !newest {
		t.Fatalf("kept the oldest (%v) or dropped the newest (%v): the oldest goes first", oldest, !newest)
	}
	if order > 2*MaxOwn+64 {
		t.Fatalf("the order of takes holds %d entries for %d placements", order, MaxOwn)
	}
}
