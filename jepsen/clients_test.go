package jepsen

import (
	"fmt"
	"math/rand"
	"testing"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// The place clients' "dead" choices must be incarnations the controller
// can never accept again: a FAILED or LEFT row's, or one before a row's
// current incarnation — never a live row's current one, never a first
// incarnation's predecessor.
func TestDeadIncarnation(t *testing.T) {
	full, failed, left := pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, pb.WorkerPhase_WORKER_PHASE_FAILED, pb.WorkerPhase_WORKER_PHASE_LEFT
	e := &env{}
	if _, _, ok := e.deadIncarnation(rand.New(rand.NewSource(1))); ok {
		t.Fatal("a dead incarnation with no table")
	}
	e.load.last = &pb.LoadTable{Workers: []*pb.WorkerLoad{
		{WorkerId: "w1", Incarnation: 1, Phase: full},
		{WorkerId: "w2", Incarnation: 3, Phase: full},
		{WorkerId: "w3", Incarnation: 2, Phase: failed},
		{WorkerId: "w4", Incarnation: 1, Phase: left},
	}}
	got := map[string]bool{}
	rng := rand.New(rand.NewSource(7))
	for range 200 {
		w, inc, ok := e.deadIncarnation(rng)
		if !ok {
			t.Fatal("no dead incarnation found")
		}
		got[fmt.Sprintf("%s#%d", w, inc)] = true
	}
	want := map[string]bool{"w2#2": true, "w3#2": true, "w4#1": true}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("dead incarnations picked %v, want exactly %v", got, want)
	}
}

func TestClientModes(t *testing.T) {
	// Four clients (make test's) and six (the matrix's) cover every path.
	for _, n := range []int{4, 6} {
		seen := map[clientMode]int{}
		for c := range n {
			seen[modeOf(c)]++
		}
		if len(seen) != 3 {
			t.Errorf("%d clients take %v: not every path", n, seen)
		}
	}
}
