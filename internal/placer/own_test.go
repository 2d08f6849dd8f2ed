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
