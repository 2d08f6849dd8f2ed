package policy

import (
	"fmt"
	"math/rand"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// lw is an eligible worker of 1000 KV pages with used of them taken by
// running requests.
func lw(id string, used uint64, running uint32) Worker {
	return Worker{ID: id, Eligible: true, KVPagesTotal: 1000, KVPagesUsed: used, Running: running}
}

func run(id, worker string, prompt, max uint32) Placed {
	return Placed{RequestID: id, Worker: worker, PromptTokens: prompt, MaxTokens: max, State: PlacedRunning}
}

func moving(id, from, to string) Placed {
	return Placed{RequestID: id, Worker: from, PromptTokens: 100, MaxTokens: 28, State: PlacedMigrating, MigrationTarget: to}
}

// moves describes a plan as "r1 a>b" strings, drains marked "drain".
func moves(ws []Worker, plan []Migration) []string {
	out := []string{}
	for _, m := range plan {
		s := fmt.Sprintf("%s %s>%s", m.RequestID, ws[m.From].ID, ws[m.To].ID)
		if m.Drain {
			s += " drain"
		}
		out = append(out, s)
	}
	return out
}

func LongestFirst(a, b *Placed) int { return -ShortestFirst(a, b) }

func TestPlanMigrationsPairing(t *testing.T) {
	assist := lw("z", 0, 0)
	assist.Eligible = false
	cases := []struct {
		name  string
		ws    []Worker
		ps    []Placed
		order func(a, b *Placed) int
		want  []string
	}{
		{"least free to freest",
			[]Worker{lw("a", 900, 10), lw("b", 100, 10), lw("c", 500, 10)},
			[]Placed{run("r1", "a", 100, 28), run("r2", "c", 100, 28)}, nil,
			[]string{"r1 a>b"}},
		{"pairs head to head, one role per worker",
			[]Worker{lw("a", 900, 10), lw("b", 800, 10), lw("c", 300, 10), lw("d", 100, 10)},
			[]Placed{run("r1", "a", 100, 28), run("r2", "b", 100, 28), run("r3", "c", 100, 28), run("r4", "d", 100, 28)}, nil,
			[]string{"r1 a>d", "r2 b>c"}},
		{"an imbalance one move would overshoot is left",
			// a: 500/10 = 50, b: 520/10 = 52; moving 8 pages gives 54.7 and 46.5.
			[]Worker{lw("a", 500, 10), lw("b", 480, 10)},
			[]Placed{run("r1", "a", 100, 28)}, nil,
			nil},
		{"equal freeness: nothing moves",
			[]Worker{lw("a", 500, 10), lw("b", 500, 10)},
			[]Placed{run("r1", "a", 100, 28), run("r2", "b", 100, 28)}, nil,
			nil},
		{"no second migration into a worker",
			[]Worker{lw("a", 900, 10), lw("b", 850, 10), lw("c", 100, 10), lw("d", 200, 10)},
			[]Placed{moving("m1", "a", "c"), run("r1", "b", 100, 28)}, nil,
			[]string{"r1 b>d"}},
		{"no second migration out of a worker",
			[]Worker{lw("a", 900, 10), lw("b", 850, 10), lw("c", 100, 10), lw("d", 200, 10)},
			[]Placed{moving("m1", "a", "d"), run("r1", "a", 100, 28), run("r2", "b", 100, 28)}, nil,
			[]string{"r2 b>c"}},
		{"never against a migration in flight",
			// b→a is in flight; a is now the least free, b the freest.
			[]Worker{lw("a", 900, 10), lw("b", 100, 10)},
			[]Placed{moving("m1", "b", "a"), run("r1", "a", 100, 28)}, nil,
			nil},
		{"workers out of full service are neither source nor destination",
			[]Worker{lw("a", 900, 10), lw("b", 800, 10), func() Worker { x := lw("c", 0, 0); x.Eligible = false; return x }()},
			[]Placed{run("r1", "a", 100, 28)}, nil,
			[]string{"r1 a>b"}},
		{"a loaded worker out of full service is no source",
			[]Worker{lw("a", 500, 10), lw("b", 100, 10), func() Worker { x := lw("c", 990, 50); x.Eligible = false; return x }()},
			[]Placed{run("r1", "c", 100, 28)}, nil,
			nil},
		{"migrating and recovering requests stay",
			[]Worker{lw("a", 900, 10), lw("b", 100, 10), lw("c", 50, 1)},
			[]Placed{moving("m1", "a", "c"), {RequestID: "r1", Worker: "b", State: PlacedRecovering}}, nil,
			nil},
		{"shortest first",
			[]Worker{lw("a", 900, 10), lw("b", 100, 10)},
			[]Placed{run("long", "a", 1000, 500), run("short", "a", 10, 10), run("mid", "a", 100, 100)}, nil,
			[]string{"short a>b"}},
		{"another order is a policy",
			[]Worker{lw("a", 900, 10), lw("b", 100, 10)},
			[]Placed{run("long", "a", 1000, 500), run("short", "a", 10, 10), run("mid", "a", 100, 100)}, LongestFirst,
			[]string{"long a>b"}},
		{"the first request in order decides: too large to shrink the gap",
			// a: 100/10 = 10, b: 400/5 = 80; a request of 500 pages would
			// leave a at 66.7 and b at -16.7.
			[]Worker{lw("a", 900, 10), lw("b", 600, 5)},
			[]Placed{run("huge", "a", 4000, 4000)}, nil,
			nil},
		{"a freer destination that overshoots yields to one that does not",
			// a: 500/4 = 125; b: 750/3 = 250 is the freest, but a request
			// of 250 pages leaves a at 250 and b at 125, as far apart;
			// c: 970/4 = 242.5 ends at 144.
			[]Worker{lw("a", 500, 4), lw("b", 250, 3), lw("c", 30, 4)},
			[]Placed{run("big", "a", 2000, 2000)}, nil,
			[]string{"big a>c"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			plan := PlanMigrations(c.ws, c.ps, MigrationParams{Balance: true, Order: c.order})
			got := moves(c.ws, plan)
			want := c.want
			if want == nil {
				want = []string{}
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("plan %v, want %v", got, want)
			}
			checkPlan(t, c.ws, c.ps, plan, MigrationParams{Balance: true, Order: c.order})
			if off := PlanMigrations(c.ws, c.ps, MigrationParams{Order: c.order}); len(off) != 0 {
				t.Fatalf("balance off planned %v", moves(c.ws, off))
			}
		})
	}
}

func TestPlanMigrationsDrain(t *testing.T) {
	d := lw("d", 600, 5)
	d.Eligible, d.Draining = false, true
	ws := []Worker{lw("a", 900, 10), lw("b", 100, 10), lw("c", 300, 10), d, lw("e", 998, 1)}
	ps := []Placed{run("r5", "d", 500, 500), run("r1", "d", 10, 10), run("r2", "d", 20, 10), run("r3", "d", 30, 10), run("r4", "d", 40, 10),
		run("x", "a", 100, 28), moving("m1", "c", "b")}
	// Shortest first, each to the freest destination with room, several
	// into one destination in a round (e has 2 pages free: no room for
	// 4); the in-flight migration into b does not hold the drain back.
	plan := PlanMigrations(ws, ps, MigrationParams{})
	if got, want := moves(ws, plan), []string{"r1 d>b drain", "r2 d>b drain", "r3 d>b drain", "r4 d>c drain", "r5 d>b drain"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("drain plan %v, want %v", got, want)
	}
	for _, m := range plan {
		if m.Epoch != 0 || m.Reason(ws) == "" || m.Redispatch {
			t.Fatalf("migration %+v", m)
		}
	}
	checkPlan(t, ws, ps, plan, MigrationParams{})
	// With balance on, the destinations the drain took are not paired.
	on := PlanMigrations(ws, ps, MigrationParams{Balance: true})
	if got := moves(ws, on); !reflect.DeepEqual(got, moves(ws, plan)) {
		t.Fatalf("drain plan with balance on %v", got)
	}
	// A request no destination has room for waits.
	full := []Worker{d, lw("a", 999, 1)}
	if plan := PlanMigrations(full, []Placed{run("r1", "d", 100, 28)}, MigrationParams{}); len(plan) != 0 {
		t.Fatalf("drained into a full worker: %v", moves(full, plan))
	}
	// The links bound a round: 20 pages each. The source's carries r1 to
	// r4 (2 + 2 + 3 + 4 pages), not r5 (63) on top of them; b's, with
	// m1's 8 pages in flight, would take 12 more.
	link := MigrationParams{LinkPages: []uint64{20, 20, 20, 20, 20}}
	lplan := PlanMigrations(ws, ps, link)
	if got, want := moves(ws, lplan), []string{"r1 d>b drain", "r2 d>b drain", "r3 d>b drain", "r4 d>c drain"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("drain plan within the links %v, want %v", got, want)
	}
	checkPlan(t, ws, ps, lplan, link)
	// A destination runs its most requests: b has 2 slots, 1 taken by the
	// migration in flight, so it takes one copy; the rest go to c.
	slots := slices.Clone(ws)
	slots[1].MaxRunning = 12
	splan := PlanMigrations(slots, ps, MigrationParams{})
	if got, want := moves(slots, splan), []string{"r1 d>b drain", "r2 d>c drain", "r3 d>c drain", "r4 d>c drain", "r5 d>c drain"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("drain plan with b at its most requests %v, want %v", got, want)
	}
	checkPlan(t, slots, ps, splan, MigrationParams{})
	// A request larger than a link's round goes alone on an idle link.
	big := PlanMigrations(ws, []Placed{run("r5", "d", 500, 500)}, link)
	if got, want := moves(ws, big), []string{"r5 d>b drain"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("a request larger than the link's round: %v, want %v", got, want)
	}
}

// TestPlanMigrationsQueued: a request queued at its worker (no KV cache)
// is never chosen to migrate for balance — the shortest running request
// goes instead, and a source with only queued requests sends none — and
// a drain moves it by re-dispatch, to the freest worker, with no room or
// link to wait for.
func TestPlanMigrationsQueued(t *testing.T) {
	q := func(p Placed) Placed { p.Queued = true; return p }
	ws := []Worker{lw("a", 900, 10), lw("b", 100, 10)}
	ps := []Placed{q(run("r0", "a", 10, 10)), run("r1", "a", 100, 28), q(run("r2", "a", 5, 5))}
	for _, prm := range []MigrationParams{{Balance: true}, {Balance: true, Order: LongestFirst}} {
		plan := PlanMigrations(ws, ps, prm)
		if got, want := moves(ws, plan), []string{"r1 a>b"}; !reflect.DeepEqual(got, want) {
			t.Fatalf("balance with queued requests: %v, want %v", got, want)
		}
		checkPlan(t, ws, ps, plan, prm)
	}
	if plan := PlanMigrations(ws, []Placed{q(run("r0", "a", 10, 10)), q(run("r2", "a", 5, 5))}, MigrationParams{Balance: true}); len(plan) != 0 {
		t.Fatalf("a queued request moved for balance: %v", moves(ws, plan))
	}

	d := lw("d", 600, 5)
	d.Eligible, d.Draining, d.Waiting = false, true, 2
	full := lw("f", 1000, 30) // no room for any copy
	ws = []Worker{lw("a", 900, 10), lw("b", 700, 10), d, full}
	ps = []Placed{q(run("r0", "d", 10, 10)), run("r1", "d", 4000, 1000), q(run("r2", "d", 5, 5))}
	link := MigrationParams{LinkPages: []uint64{1, 1, 1, 1}}
	plan := PlanMigrations(ws, ps, link)
	if got, want := moves(ws, plan), []string{"r2 d>b drain", "r0 d>b drain"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("drain with queued requests %v, want %v (r1 has no room anywhere)", got, want)
	}
	for _, m := range plan {
		if !m.Redispatch || !strings.Contains(m.Reason(ws), "re-dispatched") {
			t.Fatalf("%s: a queued request's drain is no re-dispatch: %+v, %q", m.RequestID, m, m.Reason(ws))
		}
	}
	checkPlan(t, ws, ps, plan, link)
}

// checkPlan checks the rules every plan keeps, whatever the inputs.
func checkPlan(t *testing.T, ws []Worker, ps []Placed, plan []Migration, prm MigrationParams) {
	t.Helper()
	byID := map[string]int{}
	for i := range ws {
		byID[ws[i].ID] = i
	}
	out, in := map[int]bool{}, map[int]bool{}
	inflight := map[[2]int]bool{}
	running := map[string]Placed{}
	linkOut, linkIn := map[int]uint64{}, map[int]uint64{}
	inN := map[int]uint64{}
	for _, p := range ps {
		switch p.State {
		case PlacedMigrating:
			out[byID[p.Worker]] = true
			in[byID[p.MigrationTarget]] = true
			inN[byID[p.MigrationTarget]]++
			inflight[[2]int{byID[p.Worker], byID[p.MigrationTarget]}] = true
			if !p.Queued {
				linkOut[byID[p.Worker]] += MigrationPages(&p)
				linkIn[byID[p.MigrationTarget]] += MigrationPages(&p)
			}
		case PlacedRunning:
			running[p.RequestID] = p
		}
	}
	// growth: the pages still to come of the requests with a cache on
	// each worker, as PlanMigrations counts them.
	reserved := map[int]uint64{}
	for _, p := range ps {
		switch {
		case p.State == PlacedMigrating && !p.Queued:
			reserved[byID[p.Worker]] += MigrationPages(&p)
			reserved[byID[p.MigrationTarget]] += MigrationPages(&p)
		case p.State == PlacedRunning && !p.Queued:
			reserved[byID[p.Worker]] += MigrationPages(&p)
		}
	}
	growth := func(i int) int64 {
		g := int64(reserved[i]) - int64(ws[i].KVPagesUsed)
		if prm.GrowthPages > 0 {
			g = min(g, int64(ws[i].Running)*int64(prm.GrowthPages))
		}
		return max(g, 0)
	}
	overLink := func(i int, used, pages uint64) bool {
		return i < len(prm.LinkPages) && prm.LinkPages[i] > 0 && used > 0 && used+pages > prm.LinkPages[i]
	}
	role := map[int]string{}
	seen := map[string]bool{}
	views := append([]Worker(nil), ws...)
	for _, m := range plan {
		p, ok := running[m.RequestID]
		if !ok || byID[p.Worker] != m.From || seen[m.RequestID] {
			t.Fatalf("%s moves from %s: not a running request there, or twice", m.RequestID, ws[m.From].ID)
		}
		seen[m.RequestID] = true
		if m.From == m.To || !ws[m.To].Eligible {
			t.Fatalf("%s: to %s", m.RequestID, ws[m.To].ID)
		}
		if m.Redispatch != p.Queued {
			t.Fatalf("%s: queued %v, planned as a re-dispatch %v", m.RequestID, p.Queued, m.Redispatch)
		}
		pages := MigrationPages(&p)
		if m.Drain {
			if !ws[m.From].Draining {
				t.Fatalf("%s: drain from %s, which is not draining", m.RequestID, ws[m.From].ID)
			}
			if r := role[m.To]; r != "" && r != "drain" {
				t.Fatalf("%s: %s already has a role (%s) in this round", m.RequestID, ws[m.To].ID, r)
			}
			role[m.To] = "drain"
			if m.Redispatch {
				views[m.From], views[m.To] = afterRedispatch(views[m.From], views[m.To], Pages(uint64(p.PromptTokens)))
				continue
			}
			v := views[m.To]
			if int64(v.KVPagesTotal)-int64(v.KVPagesUsed)-int64(v.QueueHeadPages)-int64(v.PendingPages) < int64(pages) {
				t.Fatalf("%s: %s has no room for its %d pages", m.RequestID, ws[m.To].ID, pages)
			}
			if v.MaxRunning > 0 && uint64(v.Running)+uint64(v.Waiting)+uint64(v.PendingRequests)+inN[m.To] >= uint64(v.MaxRunning) {
				t.Fatalf("%s: %s has no running slot (%d run, %d pending, %d in flight in, at most %d)", m.RequestID, ws[m.To].ID,
					v.Running, v.PendingRequests, inN[m.To], v.MaxRunning)
			}
			if overLink(m.From, linkOut[m.From], pages) || overLink(m.To, linkIn[m.To], pages) {
				t.Fatalf("%s: %d pages over the link of %s (%d on it) or %s (%d)", m.RequestID, pages, ws[m.From].ID, linkOut[m.From],
					ws[m.To].ID, linkIn[m.To])
			}
			linkOut[m.From] += pages
			linkIn[m.To] += pages
		} else {
			v := views[m.To]
			room := int64(v.KVPagesTotal) - int64(v.KVPagesUsed) - int64(v.QueueHeadPages) - int64(v.PendingPages) - growth(m.To)
			slot := v.MaxRunning == 0 || uint64(v.Running)+uint64(v.Waiting)+uint64(v.PendingRequests)+inN[m.To] < uint64(v.MaxRunning)
			if room < int64(pages) || !slot {
				t.Fatalf("%s: %s→%s: no room (%d pages with growth, %d wanted) or no slot (%v)", m.RequestID, ws[m.From].ID, ws[m.To].ID, room, pages, slot)
			}
			if !ws[m.From].Eligible || out[m.From] || in[m.To] && !m.Redispatch {
				t.Fatalf("%s: %s→%s breaks one in and one out", m.RequestID, ws[m.From].ID, ws[m.To].ID)
			}
			if inflight[[2]int{m.To, m.From}] {
				t.Fatalf("%s: %s→%s against a migration in flight", m.RequestID, ws[m.From].ID, ws[m.To].ID)
			}
			if m.Redispatch {
				// Away from a blocked worker, to one with no queue; any
				// number into one destination, which then
				// takes no other role.
				src := views[m.From]
				lacks := int64(src.QueueHeadPages)+int64(src.KVPagesUsed) > int64(src.KVPagesTotal)
				full := src.MaxRunning > 0 && src.Running >= src.MaxRunning
				if src.Waiting == 0 || !lacks && !full {
					t.Fatalf("%s: re-dispatched from %s, whose queue is not blocked (%+v)", m.RequestID, ws[m.From].ID, src)
				}
				if v.Waiting != 0 {
					t.Fatalf("%s: re-dispatched to %s, which has a queue (%+v)", m.RequestID, ws[m.To].ID, v)
				}
				if r := role[m.To]; r == "in" || r == "out" {
					t.Fatalf("%s: %s already has a role (%s) in this round", m.RequestID, ws[m.To].ID, r)
				}
				role[m.To] = "redispatch"
				views[m.From], views[m.To] = afterRedispatch(views[m.From], views[m.To], Pages(uint64(p.PromptTokens)))
				continue
			}
			if role[m.To] != "" || role[m.From] != "" {
				t.Fatalf("%s: %s or %s already has a role (%s, %s) in this round", m.RequestID, ws[m.From].ID, ws[m.To].ID, role[m.From], role[m.To])
			}
			role[m.To] = "in"
			if !shrinks(views[m.From], views[m.To], pages) {
				t.Fatalf("%s: %s→%s does not shrink the imbalance", m.RequestID, ws[m.From].ID, ws[m.To].ID)
			}
			role[m.From] = "out"
		}
		views[m.From], views[m.To] = afterMove(views[m.From], views[m.To], pages)
	}
}

// TestPlanMigrationsRandom checks the rules over random tables, and that
// the plan does not depend on the order of the placements.
func TestPlanMigrationsRandom(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	planned := 0
	for round := 0; round < 500; round++ {
		n := 2 + rng.Intn(12)
		ws := make([]Worker, n)
		for i := range ws {
			ws[i] = lw(fmt.Sprintf("w%02d", i), uint64(rng.Intn(1000)), uint32(rng.Intn(40)))
			ws[i].Waiting = uint32(rng.Intn(3))
			if rng.Intn(2) == 0 {
				ws[i].MaxRunning = uint32(rng.Intn(50))
			}
			switch rng.Intn(8) {
			case 0:
				ws[i].Eligible = false
			case 1:
				ws[i].Eligible, ws[i].Draining = false, true
			}
		}
		var ps []Placed
		for k := 0; k < rng.Intn(60); k++ {
			p := run(fmt.Sprintf("r%03d", k), ws[rng.Intn(n)].ID, uint32(1+rng.Intn(4000)), uint32(1+rng.Intn(1000)))
			p.Epoch = uint64(rng.Intn(3))
			switch rng.Intn(10) {
			case 0:
				p.State = PlacedRecovering
			case 1:
				p.State, p.MigrationTarget = PlacedMigrating, ws[rng.Intn(n)].ID
			}
			p.Queued = rng.Intn(4) == 0
			ps = append(ps, p)
		}
		prm := MigrationParams{Balance: rng.Intn(4) != 0}
		if rng.Intn(2) == 0 {
			prm.LinkPages = make([]uint64, n)
			for i := range prm.LinkPages {
				prm.LinkPages[i] = uint64(rng.Intn(400))
			}
		}
		plan := PlanMigrations(ws, ps, prm)
		checkPlan(t, ws, ps, plan, prm)
		planned += len(plan)
		rng.Shuffle(len(ps), func(i, j int) { ps[i], ps[j] = ps[j], ps[i] })
		if again := PlanMigrations(ws, ps, prm); !reflect.DeepEqual(again, plan) {
			t.Fatalf("seed %d round %d: the order of the placements changed the plan: %v vs %v", seed, round, moves(ws, plan), moves(ws, again))
		}
	}
	if planned == 0 {
		t.Fatalf("seed %d: nothing planned in 500 rounds", seed)
	}
	t.Logf("%d migrations planned", planned)
}

func TestMigrationDestination(t *testing.T) {
	off := lw("d", 0, 0)
	off.Eligible = false
	ws := []Worker{lw("a", 900, 10), lw("b", 500, 10), lw("c", 500, 10), off}
	for _, c := range []struct {
		from int
		want string
	}{{0, "b"}, {1, "c"}, {2, "b"}} {
		if got := ids(ws, MigrationDestination(ws, c.from)); got != c.want {
			t.Errorf("from %s: %s, want %s", ws[c.from].ID, got, c.want)
		}
	}
	if got := MigrationDestination([]Worker{lw("a", 0, 0), off}, 0); got != -1 {
		t.Errorf("with no other eligible worker: %d", got)
	}
}

func TestShortestFirstBreaksTies(t *testing.T) {
	a, b := run("a", "w", 10, 10), run("b", "w", 15, 5)
	if ShortestFirst(&a, &b) >= 0 || ShortestFirst(&b, &a) <= 0 || ShortestFirst(&a, &a) != 0 {
		t.Fatal("ShortestFirst does not order equal lengths by id")
	}
}

// The destination of a migration the failure interrupted holds the pages
// copied so far: under lumen the request resumes there.
func TestPlanRecoveryReusesMigrationCopy(t *testing.T) {
	ws := func() []Worker {
		off := w("d", 0)
		off.Eligible = false
		return []Worker{w("a", 0), w("b", 0), w("c", 0), off}
	}
	r := Interrupted{RequestID: "r1", Holder: "b", PromptTokens: 100, MaxTokens: 28, MigrationTarget: "c"}
	for _, c := range []struct {
		name string
		s    Strategy
		r    Interrupted
		want Assignment
	}{
		{"lumen: the copy", Lumen, r, Assignment{RequestID: "r1", Target: 2, Mode: Reuse, Holder: "c", MigrationCopy: true}},
		{"fixed-checkpoint: the checkpoint, as ever", FixedCheckpoint, r, Assignment{RequestID: "r1", Target: 1, Mode: Reuse, Holder: "b"}},
		{"stop-and-restart: recompute, as ever", StopAndRestart, r, Assignment{RequestID: "r1", Target: 0, Mode: Recompute, Holder: "b"}},
		{"recompute: recompute, not the copy", RecomputeHistory, r, Assignment{RequestID: "r1", Target: 0, Mode: Recompute, Holder: "b"}},
		{"lumen: the destination is gone", Lumen, func() Interrupted { x := r; x.MigrationTarget = "d"; return x }(),
			Assignment{RequestID: "r1", Target: 1, Mode: Reuse, Holder: "b"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			plan := PlanRecovery(c.s, ws(), []Interrupted{c.r})
			if len(plan) != 1 || plan[0] != c.want {
				t.Fatalf("plan %+v, want %+v", plan, c.want)
			}
		})
	}
	// Rebalancing leaves the copies where they are, however many land on
	// one destination.
	var reqs []Interrupted
	for i := 0; i < 6; i++ {
		reqs = append(reqs, Interrupted{RequestID: fmt.Sprintf("r%d", i), PromptTokens: uint32(10 * (i + 1)), MigrationTarget: "c"})
	}
	for _, a := range PlanRecovery(Lumen, ws(), reqs) {
		if a.Target != 2 || !a.MigrationCopy || a.Rebalanced {
			t.Fatalf("assignment %+v", a)
		}
	}
}

// TestPlanMigrationsRedispatch: a worker whose queue head cannot start
// sends its queued requests, by re-dispatch, to a freer worker that can
// start them now (no queue, a slot, room with its requests' growth); a
// worker whose head is not blocked sends none.
func TestPlanMigrationsRedispatch(t *testing.T) {
	q := func(p Placed) Placed { p.Queued = true; return p }
	blocked := lw("a", 990, 10)
	blocked.Waiting, blocked.QueueHeadPages = 2, 40 // lacks 30 pages
	queue := lw("c", 100, 10)
	queue.Waiting = 1 // freer, but it has a queue
	ps := []Placed{q(run("q1", "a", 320, 16)), q(run("q2", "a", 160, 16)), q(run("q3", "a", 160, 16))}
	ws := []Worker{blocked, lw("b", 300, 10), queue}
	prm := MigrationParams{Balance: true}
	plan := PlanMigrations(ws, ps, prm)
	// Two waited in a's report: two move, shortest first, both to b.
	if got, want := moves(ws, plan), []string{"q2 a>b", "q3 a>b"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("re-dispatch from a blocked worker: %v, want %v", got, want)
	}
	for _, m := range plan {
		if !m.Redispatch || m.Drain || !strings.HasPrefix(m.Reason(ws), ReasonBalance) || !strings.Contains(m.Reason(ws), "re-dispatched") {
			t.Fatalf("%s: %+v, %q", m.RequestID, m, m.Reason(ws))
		}
	}
	checkPlan(t, ws, ps, plan, prm)

	// Blocked for a slot rather than pages: the same.
	slots := lw("a", 100, 10)
	slots.Waiting, slots.MaxRunning = 1, 10
	ws = []Worker{slots, lw("b", 300, 10)}
	if got, want := moves(ws, PlanMigrations(ws, ps, prm)), []string{"q2 a>b"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("re-dispatch from a worker with every slot taken: %v, want %v", got, want)
	}
	// Not blocked (the head fits, a slot is free): nothing moves.
	free := slots
	free.MaxRunning = 0
	ws = []Worker{free, lw("b", 300, 10)}
	if plan := PlanMigrations(ws, ps, prm); len(plan) != 0 {
		t.Fatalf("a queued request moved from a worker whose head can start: %v", moves(ws, plan))
	}
	// The destination's running requests will grow into its free pages:
	// no re-dispatch there (b: 100 pages free, its request will take 150
	// more).
	ws = []Worker{blocked, lw("b", 900, 1)}
	grow := append(slices.Clone(ps), run("r1", "b", 16*1000, 16*50))
	if plan := PlanMigrations(ws, grow, prm); len(plan) != 0 {
		t.Fatalf("re-dispatch into a worker whose requests' growth fills it: %v", moves(ws, plan))
	}
	// Counting at most 16 pages of growth a request, b has the room.
	prm.GrowthPages = 16
	if got, want := moves(ws, PlanMigrations(ws, grow, prm)), []string{"q2 a>b", "q3 a>b"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("with GrowthPages 16: %v, want %v", got, want)
	}
}

// TestPlanMigrationsCoversDeficit: a source whose queue head lacks pages
// sends the running request with the fewest prompt pages that covers the
// lack, else its largest; a balance move needs the destination's slot and
// its room with its requests' growth.
func TestPlanMigrationsCoversDeficit(t *testing.T) {
	src := lw("a", 990, 10)
	src.Waiting, src.QueueHeadPages = 1, 40 // lacks 30 pages
	ps := []Placed{run("r10", "a", 160, 16), run("r40", "a", 640, 16), run("r99", "a", 1584, 16), run("r50", "a", 800, 16)}
	ws := []Worker{src, lw("b", 100, 10)}
	prm := MigrationParams{Balance: true}
	if got, want := moves(ws, PlanMigrations(ws, ps, prm)), []string{"r40 a>b"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("deficit 30: %v, want %v", got, want)
	}
	src.QueueHeadPages = 200 // lacks 190: nothing covers it
	ws = []Worker{src, lw("b", 100, 10)}
	if got, want := moves(ws, PlanMigrations(ws, ps, prm)), []string{"r99 a>b"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("deficit 190: %v, want %v", got, want)
	}
	src.Waiting = 0 // not blocked: shortest first
	ws = []Worker{src, lw("b", 100, 10)}
	if got, want := moves(ws, PlanMigrations(ws, ps, prm)), []string{"r10 a>b"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("no deficit: %v, want %v", got, want)
	}
	full := lw("b", 100, 10)
	full.MaxRunning = 10
	ws = []Worker{src, full}
	if plan := PlanMigrations(ws, ps, prm); len(plan) != 0 {
		t.Fatalf("a balance move into a worker with no running slot: %v", moves(ws, plan))
	}
	ws = []Worker{src, lw("b", 100, 1)}
	grow := append(slices.Clone(ps), run("big", "b", 16*100, 16*895)) // 895 pages to come: 5 left
	if plan := PlanMigrations(ws, grow, prm); len(plan) != 0 {
		t.Fatalf("a balance move into a worker whose requests' growth fills it: %v", moves(ws, plan))
	}
}
