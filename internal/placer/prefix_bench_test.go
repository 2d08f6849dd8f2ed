package placer

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/kvpage"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
)

// Issue 25's cost goal: the gateway's index update and lookup at 1,024
// workers and 30,000 requests in flight, p99 per request ≤ 100 µs.
const (
	benchWorkers  = 1024
	benchInFlight = 30000
	benchPrompt   = 6000 // tokens: 375 full pages of 16
	benchShared   = 4800 // of them a group's shared context (llm-d's workload shape)
	benchGroups   = 150
)

// prefixBenchRig is a gateway's state at 1,024 workers with 30,000
// requests in flight: a load table, an index holding every in-flight
// request's pages on its worker (a group's shared context on every worker
// that served one of the group's requests), and the requests' hashes.
type prefixBenchRig struct {
	r      *Replica
	idx    *PrefixIndex
	groups [][]int32 // each group's shared context
	rng    *rand.Rand
	// flight is the ring of in-flight requests: worker and unique hashes.
	flight []benchFlight
	next   int
	seq    int
}

type benchFlight struct {
	worker string
	unique []uint64
}

func newPrefixBenchRig(b *testing.B, seed uint64) *prefixBenchRig {
	b.Helper()
	rng := rand.New(rand.NewPCG(seed, 25))
	tbl := &pb.LoadTable{AppliedIndex: 1}
	for i := range benchWorkers {
		used := uint64(rng.IntN(8000))
		tbl.Workers = append(tbl.Workers, &pb.WorkerLoad{WorkerId: fmt.Sprintf("worker-%04d", i), Incarnation: 1,
			Phase: pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE,
			Load:  &pb.LoadRecord{KvPagesTotal: 10000, KvPagesUsed: used, Running: uint32(rng.IntN(40)), Waiting: uint32(rng.IntN(4))}})
	}
	x := &prefixBenchRig{r: New(), idx: NewPrefixIndex(), rng: rng, flight: make([]benchFlight, benchInFlight)}
	x.r.Update(tbl)
	for range benchGroups {
		g := make([]int32, benchShared)
		for i := range g {
			g[i] = int32(rng.IntN(32000))
		}
		x.groups = append(x.groups, g)
	}
	// Fill the window: 30,000 requests placed and their pages stored.
	for range benchInFlight {
		x.request()
	}
	return x
}

// prompt is a new request's prompt: a group's context and a question of
// its own.
func (x *prefixBenchRig) prompt() []int32 {
	p := make([]int32, 0, benchPrompt)
	p = append(p, x.groups[x.rng.IntN(benchGroups)]...)
	for len(p) < benchPrompt {
		p = append(p, int32(x.rng.IntN(32000)))
	}
	return p
}

// place is what the gateway does for one request whose prompt's hashes
// are given: place it by prefix (the load table's views, the index's
// overlaps, PickPrefix), then take the worker's KV events for it (its
// prompt's pages stored) and for the request leaving the window (its own
// pages removed; the shared context stays cached). The placement stays
// counted as the gateway's own (no table arrives: MaxOwn bounds them), so
// the requests spread as the chosen workers fill.
func (x *prefixBenchRig) place(hashes []uint64) {
	x.seq++
	id := fmt.Sprint("r", x.seq)
	w, _, ok := x.r.TakePrefix(id, benchPrompt, hashes, x.idx)
	if !ok {
		panic("no worker")
	}
	old := x.flight[x.next]
	if old.worker != "" {
		x.idx.Apply(old.worker, nil, old.unique)
	}
	x.idx.Apply(w, hashes, nil)
	x.flight[x.next] = benchFlight{worker: w, unique: hashes[benchShared/kvpage.Tokens:]}
	x.next = (x.next + 1) % benchInFlight
}

func (x *prefixBenchRig) request() { x.place(core.PageHashes(x.prompt(), nil)) }

// BenchmarkPrefixRouting1024 measures, per request, the gateway's index
// update and lookup at 1,024 workers and 30,000 requests in flight: the
// KV events of the request (375 stored hashes) and of the one leaving
// (75 removed), and the prefix-aware choice over 1,024 workers for its
// 6,000-token prompt's 375 hashes (TakePrefix: views, Overlaps,
// PickPrefix). Hashing the prompt is left out (BenchmarkPageHashes6000).
// p50 and p99 are of the per-request times; the goal is p99 ≤ 100 µs.
func BenchmarkPrefixRouting1024(b *testing.B) {
	seed := uint64(25)
	b.Logf("seed %d", seed)
	x := newPrefixBenchRig(b, seed)
	// Prompts and their hashes made before the clock runs.
	const pool = 512
	hs := make([][]uint64, pool)
	for i := range hs {
		hs[i] = core.PageHashes(x.prompt(), nil)
	}
	times := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		h := hs[i%pool]
		t0 := time.Now()
		x.place(h)
		times = append(times, time.Since(t0))
	}
	b.StopTimer()
	slices.Sort(times)
	q := func(p float64) float64 { return float64(times[int(p*float64(len(times)-1))].Nanoseconds()) / 1e3 }
	b.ReportMetric(q(0.5), "p50-µs")
	b.ReportMetric(q(0.99), "p99-µs")
	b.ReportMetric(q(0.9), "p90-µs")
	b.ReportMetric(q(0.999), "p99.9-µs")
	b.ReportMetric(float64(x.idx.Hashes()), "hashes")
}

// BenchmarkPageHashes6000 is the gateway's other per-request cost of
// prefix routing: hashing a 6,000-token prompt's 375 pages.
func BenchmarkPageHashes6000(b *testing.B) {
	rng := rand.New(rand.NewPCG(25, 25))
	p := make([]int32, benchPrompt)
	for i := range p {
		p[i] = int32(rng.IntN(32000))
	}
	var buf []uint64
	for b.Loop() {
		buf = core.PageHashes(p, buf[:0])
	}
}
