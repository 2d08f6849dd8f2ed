package fsm

import (
	"bytes"
	"fmt"
	"math/rand"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// failWorkerRef is failWorker as it was before the drops went unordered
// (commit d3b03f1): every copy the worker held dropped one by one, in id
// order, each releasing its reservation on the worker and leaving its
// holding set, with proto.Clone. TestFailWorkerMatchesReference holds
// failWorker to it.
func (s *state) failWorkerRef(w *pb.Worker, reason string, idx uint64, evs eventSink) *pb.Worker {
	nw := s.setWorkerPhase(w, pb.WorkerPhase_WORKER_PHASE_FAILED, reason, idx, evs)
	for _, id := range sortedKeys(s.holding[w.Id]) {
		p := proto.Clone(s.placements[id]).(*pb.Placement)
		s.release(w.Id, p.ReservedBytes)
		removeFrom(s.holding, w.Id, p.RequestId)
		dropCopyFields(p, w.Id)
		s.placements[id] = p
	}
	delete(s.holding, w.Id)
	v := s.view(w.Id)
	v.Reserved, v.Held, v.PendingRequests, v.PendingPages = 0, 0, 0, 0
	s.touch(w.Id)
	s.recover(w.Id, w.Incarnation, idx, evs)
	return nw
}

// TestFailWorkerMatchesReference: on random clusters (nodes of 1 to 8
// workers, budgets tight or not, 1 to 3 copies, every strategy, loads and
// hundreds of placements), failing a node's workers in one entry, then
// another worker, leaves the same state, the same views and holder index
// and the same events (recovery plans included) as failWorkerRef.
func TestFailWorkerMatchesReference(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	strategies := []pb.Strategy{pb.Strategy_STRATEGY_LUMEN, pb.Strategy_STRATEGY_LUMEN, pb.Strategy_STRATEGY_FIXED_CHECKPOINT,
		pb.Strategy_STRATEGY_STOP_AND_RESTART, pb.Strategy_STRATEGY_RECOMPUTE}
	moved := 0
	for round := 0; round < 25; round++ {
		n, perNode := 8+rng.Intn(80), 1+rng.Intn(8)
		var setup [][]*pb.Command
		setup = append(setup, []*pb.Command{{Body: &pb.Command_SetStrategy{SetStrategy: &pb.SetStrategyCmd{
			Strategy: strategies[rng.Intn(len(strategies))], CheckpointReplicas: uint32(1 + rng.Intn(3))}}}})
		id := func(i int) string { return fmt.Sprintf("w%03d", i) }
		for i := range n {
			budget := uint64(1 << 40)
			if rng.Intn(3) == 0 {
				budget = uint64(rng.Intn(8)) * 100 * 600 // a few footprints, or none
			}
			setup = append(setup, []*pb.Command{nodeWorker(id(i), fmt.Sprintf("n%02d", i/perNode), budget)})
		}
		for i := range n {
			l := load(id(i), 1, float64(rng.Intn(6)), uint64(rng.Intn(900)))
			l.GetReportLoad().Load.Running = uint32(rng.Intn(12))
			setup = append(setup, []*pb.Command{l})
		}
		reqs := n * (1 + rng.Intn(12))
		for k := range reqs {
			setup = append(setup, []*pb.Command{dispatchOn(fmt.Sprintf("r%05d", k), id(rng.Intn(n)), 1, uint32(1+rng.Intn(2000)))})
		}
		a, b := newHarness(t), newHarness(t)
		for _, cmds := range setup {
			a.apply(cmds...)
			b.apply(cmds...)
		}
		// A node's workers in one entry, then one more worker, then
		// another node: each entry's plans see the last one's.
		node := rng.Intn((n + perNode - 1) / perNode)
		var entries [][]*pb.Command
		var first []*pb.Command
		for i := node * perNode; i < min((node+1)*perNode, n); i++ {
			first = append(first, markFailed(id(i), 1))
		}
		entries = append(entries, first, []*pb.Command{markFailed(id(rng.Intn(n)), 1)})
		var third []*pb.Command
		node2 := rng.Intn((n + perNode - 1) / perNode)
		for i := node2 * perNode; i < min((node2+1)*perNode, n); i++ {
			third = append(third, markFailed(id(i), 1))
		}
		entries = append(entries, third)
		for e, cmds := range entries {
			a.index++
			b.index++
			a.stamp += 1000
			b.stamp = a.stamp
			evA, evB := failEntry(a.f.st, cmds, a.index, a.stamp, false), failEntry(b.f.st, cmds, b.index, b.stamp, true)
			where := fmt.Sprintf("seed %d round %d (%d workers, %d a node, %d requests) entry %d", seed, round, n, perNode, reqs, e)
			sa, err1 := marshalSnapshot(a.f.st.capture(a.index))
			sb, err2 := marshalSnapshot(b.f.st.capture(b.index))
			if err1 != nil || err2 != nil || !bytes.Equal(sa, sb) {
				t.Fatalf("%s: the states differ (%v %v)", where, err1, err2)
			}
			if fmt.Sprint(a.f.st.views) != fmt.Sprint(b.f.st.views) {
				t.Fatalf("%s: the views differ", where)
			}
			if len(evA) != len(evB) {
				t.Fatalf("%s: %d events, the reference %d", where, len(evA), len(evB))
			}
			for k := range evA {
				if !proto.Equal(evA[k], evB[k]) {
					t.Fatalf("%s: event %d\n %v\nthe reference\n %v", where, k, evA[k], evB[k])
				}
			}
			// The holder index answers alike.
			for i := range a.f.st.ids {
				ha, _ := a.f.st.holders.Pick(i, 600*100)
				hb, _ := b.f.st.holders.Pick(i, 600*100)
				if ha != hb {
					t.Fatalf("%s: h(r) for %s: %d, the reference %d", where, a.f.st.ids[i], ha, hb)
				}
			}
			checkReservations(t, a.f.st)
			moved += len(evA)
		}
	}
	if moved == 0 {
		t.Fatal("no event: nothing was recovered")
	}
	t.Logf("%d events compared", moved)
}

// failEntry fails the workers of cmds (MarkFailed) as one entry does, with
// failWorker or the reference, and returns the events.
func failEntry(s *state, cmds []*pb.Command, idx uint64, stamp int64, ref bool) []*pb.Event {
	var evs []*pb.Event
	s.lastStamp = stamp
	s.failingTogether(cmds)
	for _, c := range cmds {
		w := s.workers[c.GetMarkFailed().WorkerId]
		if w.Phase == pb.WorkerPhase_WORKER_PHASE_FAILED {
			continue
		}
		if ref {
			s.failWorkerRef(w, "test", idx, &evs)
		} else {
			s.failWorker(w, "test", idx, &evs)
		}
	}
	s.endTogether()
	return evs
}
