package bench

import (
	"bytes"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/servingstats"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// TestFragmentationOf: the free pages of workers in full service whose
// queue head needs more than they have free, over those workers' pages.
func TestFragmentationOf(t *testing.T) {
	row := func(id string, phase pb.WorkerPhase, total, used, head uint64, waiting uint32) *pb.WorkerLoad {
		return &pb.WorkerLoad{WorkerId: id, Phase: phase, Load: &pb.LoadRecord{KvPagesTotal: total, KvPagesUsed: used, QueueHeadPages: head, Waiting: waiting}}
	}
	full, draining := pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, pb.WorkerPhase_WORKER_PHASE_DRAINING
	tab := &pb.LoadTable{Workers: []*pb.WorkerLoad{
		row("blocked", full, 100, 90, 20, 1),      // 10 free, the head needs 20: stuck
		row("fits", full, 100, 50, 20, 3),         // the head fits: not stuck
		row("idle", full, 100, 10, 0, 0),          // nothing waits
		row("draining", draining, 100, 95, 50, 2), // not in full service: not counted at all
	}}
	if v, ok := fragmentationOf(tab); !ok || math.Abs(v-10.0/300) > 1e-12 {
		t.Fatalf("fragmentation %v (%v), want 10/300", v, ok)
	}
	if _, ok := fragmentationOf(&pb.LoadTable{Workers: []*pb.WorkerLoad{row("d", draining, 100, 0, 0, 0)}}); ok {
		t.Fatal("a fragmentation without a worker in full service")
	}
	if _, ok := fragmentationOf(nil); ok {
		t.Fatal("a fragmentation without a table")
	}
}

// TestLlumnixColumnFigures: the simulator's definitions on the client's
// records: TTFT, per-request TPOT, end-to-end, the preemption loss per
// observation and per request, the throughput until the last arrival's
// whole second.
func TestLlumnixColumnFigures(t *testing.T) {
	rec := func(arrival time.Duration, chunks ...time.Duration) *servingstats.Record {
		return &servingstats.Record{Arrival: arrival, Chunks: chunks, Tokens: len(chunks)}
	}
	s := time.Second
	c := &llumnixColumn{lastArrival: 2500 * time.Millisecond, lossCount: 2, lossSum: 3,
		run: &burstResult{recs: []*servingstats.Record{
			rec(0, s/2, s, 3*s/2),      // TTFT 0.5 s, TPOT 0.5 s, e2e 1.5 s
			rec(2*s, 3*s, 4*s),         // TTFT 1 s, TPOT 1 s, e2e 2 s
			{Arrival: s, Err: errTest}, // failed: left out
		}}}
	f := c.figures()
	near := func(name string, got, want float64) {
		t.Helper()
		if math.Abs(got-want) > 1e-9 {
			t.Errorf("%s %v, want %v", name, got, want)
		}
	}
	near("prefill mean", f.PrefillMeanMs, 750)
	near("e2e mean", f.E2EMeanMs, 1750)
	near("decode mean", f.DecodeMeanMs, 750)
	near("preemption loss per preemption", f.PreemptionLossMs, 1500)
	near("preemption loss per request", f.PreemptionLossPerRequestMs, 1000)
	// Tokens before 2 s (the last arrival's whole second): 3 of the first
	// request's, over 2 s.
	near("throughput", f.ThroughputTokS, 1.5)
	if f.OutputTokens != 5 {
		t.Errorf("%d output tokens, want 5", f.OutputTokens)
	}
}

var errTest = errors.New("the stream failed")

// TestLlumnixSetup: the default rate is Llumnix's middle rate scaled to
// the workers; bad setups say what was wrong and the limit.
func TestLlumnixSetup(t *testing.T) {
	b := DefaultLlumnixBench()
	if r, err := llumnixRate(b); err != nil || r != 3.9 {
		t.Fatalf("default rate %v (%v), want 7.8 × 8/16 = 3.9", r, err)
	}
	b.Rate = 2.5
	if r, _ := llumnixRate(b); r != 2.5 {
		t.Fatalf("given rate %v, want 2.5", r)
	}
	if err := checkLlumnixBench(DefaultLlumnixBench()); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		tweak func(*LlumnixBench)
		says  string
	}{
		{func(b *LlumnixBench) { b.Trace = "100-100" }, "-trace"},
		{func(b *LlumnixBench) { b.CV = -1 }, "[0, 20]"},
		{func(b *LlumnixBench) { b.Requests = 0 }, "[1, 20000]"},
		{func(b *LlumnixBench) { b.Workers = 1 }, "[2, 32]"},
		{func(b *LlumnixBench) { b.Rate = 5000 }, "(0, 1000]"},
	} {
		b := DefaultLlumnixBench()
		c.tweak(&b)
		if err := checkLlumnixBench(b); err == nil || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%+v: error %v, want one saying %q", b, err, c.says)
		}
	}
	// The workers run the simulator's batch cap, step budget and
	// preemption rule.
	o := llumnixOptions(DefaultLlumnixBench(), 3.9, 1)
	args := strings.Join(llumnixWorkerArgs(llumnixProfile, o), " ")
	for _, want := range []string{"-max-running 256", "-token-budget 12800", "-preemption vllm", "-decode-context", "-profile llama-7b-a10"} {
		if !strings.Contains(args, want) {
			t.Errorf("worker flags %q lack %q", args, want)
		}
	}
}

// TestLlumnixTableVerdict: the table's P99 comparison with the simulator:
// the same direction and within a factor of 1.5.
func TestLlumnixTableVerdict(t *testing.T) {
	for _, c := range []struct {
		real, sim float64
		verdict   string
	}{{2, 1.6, "| met |"}, {2, 1.2, "**missed**"}, {0.9, 1.3, "**missed**"}, {0.95, 0.99, "| met |"}} {
		f := map[string]float64{"prefill_p99_ms_infaas": 1, "prefill_p99_ms_lumen": 1, "llumnix_prefill_p99_x": c.real, "sim_llumnix_prefill_p99_x": c.sim}
		var b bytes.Buffer
		printMigrationTable(&b, f)
		var line string
		for _, l := range strings.Split(b.String(), "\n") {
			if strings.Contains(l, "real / simulator") {
				line = l
			}
		}
		if !strings.Contains(line, c.verdict) {
			t.Errorf("real %v, simulator %v: %q, want %s", c.real, c.sim, line, c.verdict)
		}
	}
}
