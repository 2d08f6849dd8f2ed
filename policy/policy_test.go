package policy

import (
	"fmt"
	"math/rand"
	"sort"
	"testing"
	"time"
)

// w builds an eligible worker with a large budget and fast bandwidth.
func w(id string, q float64) Worker {
	return Worker{ID: id, Eligible: true, QueueWaitMs: q, KVPagesTotal: 1000,
		CheckpointBudget: 1 << 30, H2DBytesPerSec: 1e9}
}

func ids(ws []Worker, i int) string {
	if i < 0 {
		return "-"
	}
	return ws[i].ID
}

func TestFreeness(t *testing.T) {
	cases := []struct {
		name string
		w    Worker
		want float64
	}{
		{"idle", Worker{KVPagesTotal: 100}, 100},
		{"running", Worker{KVPagesTotal: 100, KVPagesUsed: 40, Running: 3}, 20},
		{"every waiting request counts", Worker{KVPagesTotal: 100, KVPagesUsed: 40, QueueHeadPages: 20, Running: 3, Waiting: 5}, 5},
		{"batch full, pages free, a queue", Worker{KVPagesTotal: 1000, KVPagesUsed: 100, Running: 32, Waiting: 40}, 12.5},
		{"pending dispatches", Worker{KVPagesTotal: 100, PendingRequests: 4, PendingPages: 20}, 20},
		{"over-committed", Worker{KVPagesTotal: 100, KVPagesUsed: 100, QueueHeadPages: 10, Waiting: 1}, -10},
		{"every waiting request's pages", Worker{KVPagesTotal: 100, KVPagesUsed: 40, QueueHeadPages: 5, QueuedPages: 20, Running: 3, Waiting: 5}, 5},
		{"no queued pages reported: the head's", Worker{KVPagesTotal: 100, KVPagesUsed: 40, QueueHeadPages: 20, QueuedPages: 0, Running: 3, Waiting: 5}, 5},
		{"over-committed: the pages short", Worker{KVPagesTotal: 100, KVPagesUsed: 90, QueueHeadPages: 10, QueuedPages: 60, Running: 5, Waiting: 6, PendingRequests: 1, PendingPages: 10}, -60},
	}
	for _, c := range cases {
		if got := c.w.Freeness(); got != c.want {
			t.Errorf("%s: freeness = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestFreenessReportForgivesNoQueue is issue 22's dispatch defect: a
// worker's freeness must not rise when a load report turns the requests
// dispatched to it since the last one (pending, each with its prompt's
// pages) into waiting requests. With only the queue head's pages in the
// numerator it did — a worker whose batch had just shrunk looked free for
// a queue of many times its free pages, report after report, and took
// every arrival (docs/benchmarks.md, issue 22's trace: the assisted worker
// of w8 seed 2 went from 0 to 162 waiting in under 3 s while the others had 1–6).
func TestFreenessReportForgivesNoQueue(t *testing.T) {
	const n, pages = 40, 115 // 40 conversational prompts of ~1,800 tokens
	before := Worker{KVPagesTotal: 16212, KVPagesUsed: 14300, Running: 175, PendingRequests: n, PendingPages: n * pages}
	after := Worker{KVPagesTotal: 16212, KVPagesUsed: 14300, Running: 175, Waiting: n, QueueHeadPages: pages, QueuedPages: n * pages}
	if fb, fa := before.Freeness(), after.Freeness(); fa != fb {
		t.Fatalf("the report of %d pending requests as waiting moved freeness from %.3f to %.3f", n, fb, fa)
	}
	// A busier worker with no queue (the others in the trace) is freer
	// than the one holding the 40 it cannot start yet.
	other := Worker{KVPagesTotal: 16212, KVPagesUsed: 15500, Running: 190, Waiting: 2, QueueHeadPages: 100, QueuedPages: 200}
	if after.Freeness() >= other.Freeness() {
		t.Fatalf("a worker with %d waiting (%d pages) and %d free is freer (%.2f) than one with 2 waiting and %d free (%.2f)",
			n, n*pages, 16212-14300, after.Freeness(), 16212-15500, other.Freeness())
	}
}

// TestFreenessOverCommittedByBacklog: among over-committed workers the
// one with the smaller backlog is the freer, whatever its waiting
// requests' mean size. Per request, freeness tends to minus the mean pages
// of a waiting request as the queue grows, so a queue of 901 short
// prompts looked freer than one of 545 longer ones (issue 22's trace,
// w8_f4 seed 3), and a worker with any room is freer than both.
func TestFreenessOverCommittedByBacklog(t *testing.T) {
	long := Worker{KVPagesTotal: 16212, KVPagesUsed: 15770, Running: 198, Waiting: 901, QueuedPages: 901 * 100}
	short := Worker{KVPagesTotal: 16212, KVPagesUsed: 15800, Running: 183, Waiting: 545, QueuedPages: 545 * 115}
	room := Worker{KVPagesTotal: 16212, KVPagesUsed: 16200, Running: 250, Waiting: 0}
	if long.Freeness() >= short.Freeness() {
		t.Fatalf("901 waiting (%.0f pages short) is as free (%.1f) as 545 waiting (%.0f short: %.1f)",
			-long.Freeness(), long.Freeness(), -short.Freeness(), short.Freeness())
	}
	if room.Freeness() < 0 || room.Freeness() <= short.Freeness() {
		t.Fatalf("a worker with 12 pages free and no queue (%.2f) is not freer than an over-committed one (%.1f)", room.Freeness(), short.Freeness())
	}
	if got := PickServing([]Worker{{ID: "a", Eligible: true, KVPagesTotal: long.KVPagesTotal, KVPagesUsed: long.KVPagesUsed, Running: long.Running,
		Waiting: long.Waiting, QueuedPages: long.QueuedPages}, {ID: "b", Eligible: true, KVPagesTotal: short.KVPagesTotal,
		KVPagesUsed: short.KVPagesUsed, Running: short.Running, Waiting: short.Waiting, QueuedPages: short.QueuedPages}}); got != 1 {
		t.Fatalf("PickServing chose %d, want the smaller backlog (1)", got)
	}
}

func TestPickServing(t *testing.T) {
	busy := func(id string, used uint64) Worker { x := w(id, 0); x.KVPagesUsed = used; x.Running = 1; return x }
	queued := func(id string, used uint64, waiting uint32) Worker {
		x := w(id, 0)
		x.KVPagesUsed, x.Running, x.Waiting = used, 32, waiting
		return x
	}
	ineligible := w("a", 0)
	ineligible.Eligible = false
	cases := []struct {
		name string
		ws   []Worker
		want string
	}{
		{"empty cluster", nil, "-"},
		{"none eligible", []Worker{ineligible}, "-"},
		{"freest wins", []Worker{busy("a", 900), busy("b", 100), busy("c", 500)}, "b"},
		{"tie breaks by id", []Worker{busy("a", 100), busy("b", 100)}, "a"},
		{"skips ineligible even if freest", []Worker{ineligible, busy("b", 500)}, "b"},
		// Issue 12: batches full, KV mostly free; the shorter queue wins
		// although the other worker's requests hold fewer pages.
		{"shorter queue wins at a full batch", []Worker{queued("a", 100, 40), queued("b", 200, 1)}, "b"},
		{"equal queues: fewer pages in use wins", []Worker{queued("a", 200, 10), queued("b", 100, 10)}, "b"},
	}
	for _, c := range cases {
		if got := ids(c.ws, PickServing(c.ws)); got != c.want {
			t.Errorf("%s: got %s, want %s", c.name, got, c.want)
		}
	}
}

func TestPickHolder(t *testing.T) {
	full := w("c", 0)
	full.Reserved = full.CheckpointBudget - 10
	holding := w("b", 1)
	holding.Held, holding.Reserved, holding.CheckpointBudget = 2, 2e9, 4e9 // mean 1e9 bytes at 1e9 B/s: 1000 ms
	down := w("a", 0)
	down.Eligible = false
	cases := []struct {
		name      string
		ws        []Worker
		serving   int
		footprint uint64
		lambda    float64
		want      string
		reason    NoHolder
	}{
		{"empty cluster", nil, -1, 100, 1, "-", NoHolderNoPeer},
		{"only the serving worker", []Worker{w("a", 0)}, 0, 100, 1, "-", NoHolderNoPeer},
		{"lowest q_w", []Worker{w("a", 5), w("b", 3), w("c", 9)}, 0, 100, 1, "b", HolderFound},
		{"excludes serving worker", []Worker{w("a", 0), w("b", 3)}, 0, 100, 1, "b", HolderFound},
		{"tie breaks by id", []Worker{w("a", 9), w("b", 2), w("c", 2)}, 0, 100, 1, "b", HolderFound},
		{"restore delay counts", []Worker{w("a", 0), holding, w("c", 2)}, 0, 100, 1, "c", HolderFound},
		{"lambda 0 ignores restore delay", []Worker{w("a", 0), holding, w("c", 2)}, 0, 100, 0, "b", HolderFound},
		{"full budget skipped", []Worker{w("a", 0), full, w("d", 7)}, 0, 100, 1, "d", HolderFound},
		{"all budgets full", []Worker{w("a", 0), full}, 0, 100, 1, "-", NoHolderBudgetFull},
		{"footprint exactly fits", []Worker{w("a", 0), full}, 0, 10, 1, "c", HolderFound},
		{"ineligible skipped", []Worker{down, w("b", 0)}, 1, 100, 1, "-", NoHolderNoPeer},
	}
	for _, c := range cases {
		got, reason := PickHolder(c.ws, c.serving, c.footprint, c.lambda)
		if ids(c.ws, got) != c.want || reason != c.reason {
			t.Errorf("%s: got %s (%q), want %s (%q)", c.name, ids(c.ws, got), reason, c.want, c.reason)
		}
	}
}

func TestRingHolder(t *testing.T) {
	down := w("b", 0)
	down.Eligible = false
	full := w("b", 0)
	full.Reserved = full.CheckpointBudget
	cases := []struct {
		name    string
		ws      []Worker
		serving int
		want    string
		reason  NoHolder
	}{
		{"next on ring", []Worker{w("a", 0), w("b", 99), w("c", 0)}, 0, "b", HolderFound},
		{"wraps around", []Worker{w("a", 0), w("b", 0), w("c", 0)}, 2, "a", HolderFound},
		{"skips ineligible", []Worker{w("a", 0), down, w("c", 0)}, 0, "c", HolderFound},
		{"full next worker: no holder", []Worker{w("a", 0), full, w("c", 0)}, 0, "-", NoHolderBudgetFull},
		{"alone", []Worker{w("a", 0)}, 0, "-", NoHolderNoPeer},
	}
	for _, c := range cases {
		got, reason := RingHolder(c.ws, c.serving, 100)
		if ids(c.ws, got) != c.want || reason != c.reason {
			t.Errorf("%s: got %s (%q), want %s (%q)", c.name, ids(c.ws, got), reason, c.want, c.reason)
		}
	}
	for _, s := range []Strategy{StopAndRestart, RecomputeHistory} {
		if got, reason := ChooseHolder(s, []Worker{w("a", 0), w("b", 0)}, nil, 0, 1, 1); got != -1 || reason != NoHolderStrategy {
			t.Errorf("%s chose holder %d (%q)", s, got, reason)
		}
	}
}

func TestFootprint(t *testing.T) {
	if got := Footprint(100, 28, 0, 1024); got != 128*1024 {
		t.Errorf("footprint = %d", got)
	}
	if got := Footprint(100, 1000, 512, 10); got != 5120 {
		t.Errorf("capped footprint = %d, want 5120", got)
	}
	if got := Pages(17); got != 2 {
		t.Errorf("Pages(17) = %d", got)
	}
}

func TestParseStrategy(t *testing.T) {
	for _, s := range []Strategy{Lumen, FixedCheckpoint, StopAndRestart, RecomputeHistory} {
		got, ok := ParseStrategy(s.String())
		if !ok || got != s || !s.Known() {
			t.Errorf("round trip of %v: %v %v (known %v)", s, got, ok, s.Known())
		}
	}
	if got, _ := ParseStrategy("recompute"); got != RecomputeHistory || int(got) != 4 {
		t.Errorf("recompute parsed as %d, want 4 (lumenpb.Strategy_STRATEGY_RECOMPUTE)", got)
	}
	if _, ok := ParseStrategy("round-robin"); ok {
		t.Error("unknown strategy parsed")
	}
	if Strategy(0).Known() || Strategy(5).Known() {
		t.Error("0 or 5 is a known strategy")
	}
	if got, want := StrategyNames(), "lumen, fixed-checkpoint, stop-and-restart or recompute"; got != want {
		t.Errorf("StrategyNames() = %q, want %q", got, want)
	}
}

// Only stop-and-restart runs a resumed request again from its prompt; only
// the checkpointing strategies give holders.
func TestStrategyResume(t *testing.T) {
	for _, c := range []struct {
		s                  Strategy
		keeps, regenerates bool
	}{{Lumen, true, false}, {FixedCheckpoint, true, false}, {StopAndRestart, false, true}, {RecomputeHistory, false, false}} {
		if c.s.KeepsCheckpoints() != c.keeps || c.s.Regenerates() != c.regenerates {
			t.Errorf("%s: keeps checkpoints %v, regenerates %v; want %v, %v", c.s, c.s.KeepsCheckpoints(), c.s.Regenerates(), c.keeps, c.regenerates)
		}
	}
}

func planString(ws []Worker, plan []Assignment) string {
	s := ""
	for _, a := range plan {
		mode := "reuse"
		if a.Mode == Recompute {
			mode = "recompute"
		}
		if a.Rebalanced {
			mode += "*"
		}
		s += fmt.Sprintf("%s->%s:%s ", a.RequestID, ids(ws, a.Target), mode)
	}
	return s
}

func TestPlanRecovery(t *testing.T) {
	dead := func(id string) Worker { x := w(id, 0); x.Eligible = false; return x }
	cluster := func() []Worker { return []Worker{dead("a"), w("b", 0), w("c", 0), w("d", 0)} }
	req := func(id, holder string, prompt uint32) Interrupted {
		return Interrupted{RequestID: id, Holder: holder, PromptTokens: prompt, MaxTokens: 64}
	}
	cases := []struct {
		name     string
		strategy Strategy
		ws       []Worker
		reqs     []Interrupted
		want     string
	}{
		{"holder reuse", Lumen, cluster(),
			[]Interrupted{req("r1", "b", 100), req("r2", "c", 100)},
			"r1->b:reuse r2->c:reuse "},
		{"holder gone: recompute on freest", Lumen, cluster(),
			[]Interrupted{req("r1", "a", 100), req("r2", "", 100)},
			"r1->b:recompute r2->c:recompute "},
		{"stop-and-restart ignores holders", StopAndRestart, cluster(),
			[]Interrupted{req("r1", "b", 100), req("r2", "b", 100), req("r3", "b", 100)},
			"r1->b:recompute r2->c:recompute r3->d:recompute "},
		{"recompute ignores holders", RecomputeHistory, cluster(),
			[]Interrupted{req("r1", "b", 100), req("r2", "b", 100), req("r3", "b", 100)},
			"r1->b:recompute r2->c:recompute r3->d:recompute "},
		{"recompute does not rebalance: there is no holder to shed", RecomputeHistory, cluster(),
			[]Interrupted{req("r1", "b", 300), req("r2", "b", 10), req("r3", "b", 200), req("r4", "b", 50)},
			"r1->b:recompute r2->c:recompute r3->d:recompute r4->c:recompute "},
		{"rebalance smallest prefix off an overloaded holder", Lumen, cluster(),
			// 4 requests, 3 eligible workers: average rounds up to 2.
			[]Interrupted{req("r1", "b", 300), req("r2", "b", 10), req("r3", "b", 200), req("r4", "b", 50)},
			"r1->b:reuse r2->c:recompute* r3->b:reuse r4->d:recompute* "},
		{"a holder keeps the restores it can start at once (as many as it runs)", Lumen, func() []Worker {
			ws := cluster()
			ws[1].Running = 4
			return ws
		}(),
			[]Interrupted{req("r1", "b", 300), req("r2", "b", 10), req("r3", "b", 200), req("r4", "b", 50)},
			"r1->b:reuse r2->b:reuse r3->b:reuse r4->b:reuse "},
		{"a holder sheds, smallest prefix first, only the restores beyond what it runs", Lumen, func() []Worker {
			ws := cluster()
			ws[1].Running = 3
			return ws
		}(),
			[]Interrupted{req("r1", "b", 300), req("r2", "b", 10), req("r3", "b", 200), req("r4", "b", 50)},
			"r1->b:reuse r2->c:recompute* r3->b:reuse r4->b:reuse "},
		{"dispatches since the holder's report count against what it can start", Lumen, func() []Worker {
			ws := cluster()
			ws[1].Running, ws[1].PendingRequests = 4, 2
			return ws
		}(),
			[]Interrupted{req("r1", "b", 300), req("r2", "b", 10), req("r3", "b", 200), req("r4", "b", 50)},
			"r1->b:reuse r2->c:recompute* r3->b:reuse r4->d:recompute* "},
		{"lumen recomputes elsewhere when the holder has no KV room", Lumen, func() []Worker {
			ws := cluster()
			ws[1].KVPagesUsed = 995 // b: 5 pages free, r1 needs 7
			return ws
		}(),
			[]Interrupted{req("r1", "b", 100), req("r2", "d", 100)},
			"r1->c:recompute* r2->d:reuse "},
		{"fixed-checkpoint waits at a full holder", FixedCheckpoint, func() []Worker {
			ws := cluster()
			ws[1].KVPagesUsed = 995
			return ws
		}(),
			[]Interrupted{req("r1", "b", 100)},
			"r1->b:reuse "},
		{"fixed-checkpoint restores everything at the holder (DéjàVu)", FixedCheckpoint, cluster(),
			[]Interrupted{req("r1", "b", 300), req("r2", "b", 10), req("r3", "b", 200), req("r4", "b", 50)},
			"r1->b:reuse r2->b:reuse r3->b:reuse r4->b:reuse "},
		{"no eligible worker", Lumen, []Worker{dead("a"), dead("b")},
			[]Interrupted{req("r1", "b", 1)}, ""},
		{"nothing to recover", Lumen, cluster(), nil, ""},
	}
	for _, c := range cases {
		got := planString(c.ws, PlanRecovery(c.strategy, c.ws, c.reqs))
		if got != c.want {
			t.Errorf("%s:\n got  %s\n want %s", c.name, got, c.want)
		}
	}
}

// TestPlanRecoverySuccessivePlans: the fsm plans each failed worker's
// requests in turn, with the restores of the earlier plans pending on the
// holders. A holder that took as many restores as it runs from the first
// plan keeps them; the second plan's restores at it are beyond what it can
// start at once and are rebalanced, down to what it runs.
func TestPlanRecoverySuccessivePlans(t *testing.T) {
	dead := func(id string) Worker { x := w(id, 0); x.Eligible = false; return x }
	ws := []Worker{dead("a"), w("b", 0), w("c", 0), w("d", 0), dead("e")}
	ws[1].Running = 4
	req := func(id string, prompt uint32) Interrupted {
		return Interrupted{RequestID: id, Holder: "b", PromptTokens: prompt, MaxTokens: 64}
	}
	first := planString(ws, PlanRecovery(Lumen, ws, []Interrupted{req("a1", 300), req("a2", 10), req("a3", 200)}))
	if want := "a1->b:reuse a2->b:reuse a3->b:reuse "; first != want {
		t.Errorf("first plan:\n got  %s\n want %s", first, want)
	}
	second := planString(ws, PlanRecovery(Lumen, ws, []Interrupted{req("e1", 400), req("e2", 20), req("e3", 100)}))
	if want := "e1->b:reuse e2->c:recompute* e3->d:recompute* "; second != want {
		t.Errorf("second plan:\n got  %s\n want %s", second, want)
	}
	if ws[1].PendingRequests != 4 {
		t.Errorf("b has %d restores on their way, want 4 (what it runs)", ws[1].PendingRequests)
	}
}

// TestPlanRecoveryBalanced checks, over random clusters, that every request
// gets an eligible target, that reuse only happens at the request's own
// eligible holder, and that no holder keeps more than the average unless it
// can start them all at once (no more on their way to it than it runs).
func TestPlanRecoveryBalanced(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	for trial := 0; trial < 200; trial++ {
		n := 1 + rng.Intn(12)
		ws := make([]Worker, n)
		for i := range ws {
			ws[i] = w(fmt.Sprintf("w%02d", i), rng.Float64()*10)
			ws[i].Eligible = rng.Intn(4) != 0
			ws[i].KVPagesUsed = uint64(rng.Intn(1000))
			ws[i].Running = uint32(rng.Intn(8))
			ws[i].PendingRequests = uint32(rng.Intn(3))
		}
		reqs := make([]Interrupted, rng.Intn(40))
		for i := range reqs {
			reqs[i] = Interrupted{RequestID: fmt.Sprintf("r%03d", i), Holder: fmt.Sprintf("w%02d", rng.Intn(n+1)), PromptTokens: uint32(rng.Intn(4000))}
		}
		eligible := 0
		for _, x := range ws {
			if x.Eligible {
				eligible++
			}
		}
		plan := PlanRecovery(Lumen, ws, reqs)
		if eligible == 0 || len(reqs) == 0 {
			if plan != nil {
				t.Fatalf("trial %d: plan without eligible workers or requests", trial)
			}
			continue
		}
		if len(plan) != len(reqs) {
			t.Fatalf("trial %d: %d assignments for %d requests", trial, len(plan), len(reqs))
		}
		avg := (len(reqs) + eligible - 1) / eligible
		reuse := map[int]int{}
		for k, a := range plan {
			if !ws[a.Target].Eligible {
				t.Fatalf("trial %d: %s sent to ineligible %s", trial, a.RequestID, ws[a.Target].ID)
			}
			if a.Mode == Reuse {
				if ws[a.Target].ID != reqs[k].Holder {
					t.Fatalf("trial %d: %s reuses at %s, holder %s", trial, a.RequestID, ws[a.Target].ID, reqs[k].Holder)
				}
				reuse[a.Target]++
			}
		}
		// A holder keeps more than the average only when it can start
		// them all at once, or every other eligible worker already has
		// the average.
		count := map[int]int{}
		for _, a := range plan {
			count[a.Target]++
		}
		for h, c := range reuse {
			if c <= avg || ws[h].PendingRequests <= ws[h].Running {
				continue
			}
			for i := range ws {
				if i != h && ws[i].Eligible && count[i] < avg {
					t.Fatalf("trial %d: holder %s keeps %d > avg %d while %s has %d", trial, ws[h].ID, c, avg, ws[i].ID, count[i])
				}
			}
		}
	}
}

func tenThousandWorkers() []Worker {
	rng := rand.New(rand.NewSource(1))
	ws := make([]Worker, 10000)
	for i := range ws {
		ws[i] = w(fmt.Sprintf("w%05d", i), rng.Float64()*50)
		ws[i].Held = uint32(rng.Intn(20))
		ws[i].Reserved = uint64(ws[i].Held) * 1 << 24
		ws[i].Eligible = rng.Intn(50) != 0
	}
	return ws
}

// benchDecisions times each decision and reports p50 and p99 in µs.
func benchDecisions(b *testing.B, pick func(i int) int) {
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		h := pick(i)
		lat = append(lat, time.Since(start))
		if h < 0 {
			b.Fatal("no holder")
		}
	}
	b.StopTimer()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
}

// BenchmarkHolder10k measures one h(r) decision over 10,000 workers, as the
// fsm makes it (the index) and by the reference scan.
func BenchmarkHolder10k(b *testing.B) {
	ws := tenThousandWorkers()
	idx := NewHolderIndex(ws, 1)
	b.Run("index", func(b *testing.B) {
		benchDecisions(b, func(i int) int { h, _ := idx.Pick(i%len(ws), 1<<20); return h })
	})
	b.Run("scan", func(b *testing.B) {
		benchDecisions(b, func(i int) int { h, _ := PickHolder(ws, i%len(ws), 1<<20, 1); return h })
	})
}

// TestHolderIndexMatchesPickHolder changes random workers and checks, after
// each change, that the index picks what the reference scan picks: at 40
// workers, and at 1,000 (a cell; a deeper tree, scores tied in hundreds).
func TestHolderIndexMatchesPickHolder(t *testing.T) {
	for _, n := range []int{40, 1000} {
		t.Run(fmt.Sprintf("workers=%d", n), func(t *testing.T) { testHolderIndexMatchesPickHolder(t, n) })
	}
}

func testHolderIndexMatchesPickHolder(t *testing.T, n int) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	ws := make([]Worker, n)
	for i := range ws {
		ws[i] = w(fmt.Sprintf("w%02d", i), float64(rng.Intn(5)))
		ws[i].CheckpointBudget = uint64(rng.Intn(1000))
	}
	lambda := float64(rng.Intn(3))
	idx := NewHolderIndex(ws, lambda)
	for step := 0; step < 5000; step++ {
		i := rng.Intn(len(ws))
		switch rng.Intn(4) {
		case 0:
			ws[i].Eligible = !ws[i].Eligible
		case 1:
			ws[i].QueueWaitMs = float64(rng.Intn(5))
		case 2:
			ws[i].Held++
			ws[i].Reserved += uint64(rng.Intn(300))
		case 3:
			ws[i].Held, ws[i].Reserved = 0, 0
		}
		idx.Update(i, &ws[i])
		serving, fp := rng.Intn(len(ws)+1)-1, uint64(rng.Intn(400))
		g1, r1 := idx.Pick(serving, fp)
		g2, r2 := PickHolder(ws, serving, fp, lambda)
		if g1 != g2 || r1 != r2 {
			t.Fatalf("seed %d step %d: index %d %q, scan %d %q", seed, step, g1, r1, g2, r2)
		}
	}
}
