package fsm

import (
	"fmt"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// BenchmarkApplyMarkFailedNode: a whole node of 8 workers marked failed in
// one entry (its probes fail at once and the leader commits them
// together) in a cluster of 1,024 workers on 128 nodes, each worker
// serving 64 requests (65,536 placements), with one and two checkpoint
// copies. Each op is one such entry: the 8 recovery plans of the node's
// requests (512 under load=steady, below) and the drop of every copy the
// node held. Between ops, untimed, the node's workers register new
// incarnations, and the next op fails the next node. It reports the p50
// and p99 of the entries' wall time (issue 24's goal: p99 ≤ 10 ms), and
// of the CPU time of the thread that
// applied them (CLOCK_THREAD_CPUTIME_ID, the goroutine locked to it; the
// RUSAGE_THREAD of before counted in scheduler ticks, 0 for half the
// entries): on a shared machine the wall time counts every other
// process's turn on the cores.
//
//	go test -run '^$' -bench ApplyMarkFailedNode -benchtime 128x ./fsm/
//
// (128 ops: one per node; later ops would fail nodes already emptied.)
//
// Issue 26 asks it of a cell of 1,000 workers, for a node and for one
// worker: -bench 'ApplyMarkFailedNode/workers=1000' (node=1 is a lone
// worker's MarkFailed; 128 ops fail 128 of the 1,000 in turn).
//
// load=piled is the benchmark as it was: a node's recovered requests stay
// on the survivors, so the later ops fail nodes serving up to twice the
// 64 a worker (at 1,000 workers the 128 ops wrap around its 125 nodes),
// and its p99 is of those. load=steady holds the stated load: between
// ops, untimed, the failed node's requests complete and its new workers
// report the same load and take 64 new requests each, so every op fails
// a node serving 512.
func BenchmarkApplyMarkFailedNode(b *testing.B) {
	const perWorker = 64
	for _, sz := range []struct{ workers, perNode int }{{1024, 8}, {1000, 8}, {1000, 1}} {
		for _, replicas := range []uint32{1, 2} {
			for _, steady := range []bool{false, true} {
				benchMarkFailed(b, sz.workers, sz.perNode, perWorker, replicas, steady)
			}
		}
	}
}

func benchMarkFailed(b *testing.B, workers, perNode, perWorker int, replicas uint32, steady bool) {
	{
		loadName := "piled"
		if steady {
			loadName = "steady"
		}
		b.Run(fmt.Sprintf("workers=%d/node=%d/replicas=%d/load=%s", workers, perNode, replicas, loadName), func(b *testing.B) {
			f := New()
			var idx uint64
			apply := func(cmds ...*pb.Command) {
				data, err := proto.Marshal(&pb.LogEntry{Commands: cmds})
				if err != nil {
					b.Fatal(err)
				}
				idx++
				// The set-up's commands must hold: a refused dispatch or
				// completion would quietly change the load measured.
				for i, r := range f.Apply(&raft.Log{Index: idx, Type: raft.LogCommand, Data: data}).([]Result) {
					if r.Err != nil {
						b.Fatalf("set-up entry %d, command %d: %v", idx, i, r.Err)
					}
				}
			}
			apply(&pb.Command{Body: &pb.Command_SetStrategy{SetStrategy: &pb.SetStrategyCmd{CheckpointReplicas: replicas}}})
			id := func(w int) string { return fmt.Sprintf("w%04d", w) }
			inc := make([]uint64, workers)
			register := func(w int) {
				inc[w]++
				c := nodeWorker(id(w), fmt.Sprintf("n%03d", w/perNode), 1<<40)
				c.GetRegisterWorker().Worker.Incarnation = inc[w]
				apply(c)
			}
			for w := range workers {
				register(w)
			}
			report := func(w int) {
				// Running 64, a third of the KV in use: restores start at
				// once, as under load.
				apply(&pb.Command{Body: &pb.Command_ReportLoad{ReportLoad: &pb.ReportLoadCmd{Load: &pb.LoadRecord{
					WorkerId: id(w), Incarnation: inc[w], QueueWaitMs: float64(w % 7), KvPagesUsed: 333, KvPagesTotal: 1000, Running: uint32(perWorker)}}}})
			}
			for w := range workers {
				report(w)
			}
			n := 0
			fill := func(w int) {
				cmds := make([]*pb.Command, 0, perWorker)
				for range perWorker {
					c := dispatch(fmt.Sprintf("r%06d", n), 100+uint32(n%900), 200)
					c.GetDispatch().WorkerId, c.GetDispatch().WorkerIncarnation = id(w), inc[w]
					cmds = append(cmds, c)
					n++
				}
				apply(cmds...)
			}
			for w := range workers {
				fill(w)
			}
			served := make([]int, 0, b.N) // requests on the failed node, per op
			times := make([]time.Duration, 0, b.N)
			cpu := make([]time.Duration, 0, b.N)
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			b.ResetTimer()
			for i := range b.N {
				b.StopTimer()
				node := i % (workers / perNode)
				cmds := make([]*pb.Command, 0, perNode)
				for w := node * perNode; w < (node+1)*perNode; w++ {
					cmds = append(cmds, markFailed(id(w), inc[w]))
				}
				data, err := proto.Marshal(&pb.LogEntry{Commands: cmds})
				if err != nil {
					b.Fatal(err)
				}
				idx++
				l := &raft.Log{Index: idx, Type: raft.LogCommand, Data: data}
				var gone []string
				for w := node * perNode; w < (node+1)*perNode; w++ {
					for rid := range f.st.serving[id(w)] {
						gone = append(gone, rid)
					}
				}
				served = append(served, len(gone))
				b.StartTimer()
				c0 := threadCPU()
				start := time.Now()
				f.Apply(l)
				times = append(times, time.Since(start))
				cpu = append(cpu, threadCPU()-c0)
				b.StopTimer()
				for w := node * perNode; w < (node+1)*perNode; w++ {
					register(w)
				}
				if steady {
					apply(complete(gone...))
					for w := node * perNode; w < (node+1)*perNode; w++ {
						report(w)
						fill(w)
					}
				}
				b.StartTimer()
			}
			b.StopTimer()
			slices.Sort(times)
			slices.Sort(cpu)
			q := func(xs []time.Duration, p float64) float64 { return float64(xs[int(p*float64(len(xs)-1))]) / 1e6 }
			b.ReportMetric(q(times, 0.5), "p50-ms")
			b.ReportMetric(q(times, 0.99), "p99-ms")
			b.ReportMetric(q(cpu, 0.5), "p50-cpu-ms")
			b.ReportMetric(q(cpu, 0.99), "p99-cpu-ms")
			slices.Sort(served)
			b.ReportMetric(float64(served[len(served)/2]), "p50-served")
			b.ReportMetric(float64(served[len(served)-1]), "max-served")
			if k := max(len(cpu)-5, 0); b.N > 1 {
				b.Logf("slowest 5: CPU %v, wall %v", cpu[k:], times[k:])
			}
		})
	}
}
