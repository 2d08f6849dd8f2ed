package policy

import (
	"cmp"
	"fmt"
	"math"
	"slices"

	"github.com/lumen-project/lumen/internal/kvpage"
)

// PlacedState is what PlanMigrations needs to know of a placement's state.
type PlacedState int

// Placement states. A recovering placement is neither moved nor counted.
const (
	PlacedRunning PlacedState = iota + 1
	PlacedMigrating
	PlacedRecovering
)

// Placed is a placement as PlanMigrations sees it.
type Placed struct {
	RequestID    string
	Worker       string // the serving worker (the source while migrating)
	PromptTokens uint32
	MaxTokens    uint32
	Epoch        uint64
	State        PlacedState
	// MigrationTarget is the destination while State is PlacedMigrating.
	MigrationTarget string
	// Queued: the request holds no KV cache at its worker (it waits in
	// the queue there, or was dispatched after the worker's last load
	// report). There is nothing to copy: it moves only by re-dispatch
	// (Migration.Redispatch), out of a draining worker or away from a
	// blocked one, never as a balance migration of pages.
	Queued bool
	// High: the request is of high priority (HighPriority): it moves
	// before the others of its worker (PlanMigrations).
	High bool
}

// MigrationPages is the KV pages a migration of p is taken to move: its
// prompt plus every output token it may produce. The placement table does
// not know how far a request has got, so PlanMigrations reckons with the
// most the request can hold: a move judged to shrink an imbalance at that
// size is not judged on a request that turns out smaller.
func MigrationPages(p *Placed) uint64 {
	return Pages(uint64(p.PromptTokens) + uint64(p.MaxTokens))
}

// ShortestFirst is the default order in which a source's requests move: the
// smallest prompt_tokens + max_tokens first (the least to copy; Llumnix
// moves short requests first too), ties to the smaller request id.
func ShortestFirst(a, b *Placed) int {
	if c := cmp.Compare(uint64(a.PromptTokens)+uint64(a.MaxTokens), uint64(b.PromptTokens)+uint64(b.MaxTokens)); c != 0 {
		return c
	}
	return cmp.Compare(a.RequestID, b.RequestID)
}

// MigrationParams tunes PlanMigrations.
type MigrationParams struct {
	// Balance pairs workers for load balance (the cluster's migration
	// switch is ON). Draining workers are planned either way.
	Balance bool
	// Order is the order in which a source's requests move, a comparison
	// like slices.SortFunc's that must break every tie; nil means
	// ShortestFirst.
	Order func(a, b *Placed) int
	// LinkPages[i] is the KV pages ws[i]'s interconnect carries in one
	// round (DrainLinkPages); a drain plans no more than that out of a
	// draining worker, nor into a destination, counting the migrations
	// already in flight. Absent or 0: no bound.
	LinkPages []uint64
	// GrowthPages bounds the growth PlanMigrations expects of each
	// request running on a destination (the pages its remaining output
	// will take) to that many pages a request: the horizon over which a
	// balance move must not make its destination preempt. 0: the whole
	// remaining output (prompt + max_tokens of every running request,
	// less the pages the worker reports used).
	GrowthPages uint64
}

// DefaultGrowthPages is the controller's MigrationParams.GrowthPages: 8
// pages, 128 tokens a request, a few seconds of decoding at a step of tens
// of milliseconds (the next rounds' growth, not a request's whole life).
// Measured in the llumnix figure (docs/benchmarks.md, "Issue 23: the
// policy by virtual usage"): 4 and 8 pages did best, 16 and 32 less well,
// the whole remaining output left few moves and lost most of the gain.
const DefaultGrowthPages = 8

// DrainLinkBytesPerRound is what one worker's interconnect carries in a
// migration round: 25 GB/s (the workers' -interconnect default, one
// 200 Gb/s NIC or NVLink-class) over the controller's 500 ms round.
const DrainLinkBytesPerRound = 25e9 * 0.5

// DrainLinkPages is the pages of kvBytesPerToken bytes a token that
// DrainLinkBytesPerRound carries (0, no bound, when the size is unknown).
func DrainLinkPages(kvBytesPerToken uint64) uint64 {
	if kvBytesPerToken == 0 {
		return 0
	}
	return uint64(DrainLinkBytesPerRound / float64(kvBytesPerToken*kvpage.Tokens))
}

// Migration is one decision of PlanMigrations: move request RequestID, at
// placement epoch Epoch, from ws[From] to ws[To].
type Migration struct {
	RequestID string
	Epoch     uint64
	From, To  int
	// Drain is set when From is DRAINING; otherwise the move is for
	// balance.
	Drain bool
	// Redispatch: the request is queued at From (Placed.Queued): the
	// move copies no KV, and the destination queues it as a dispatch
	// would. Drains plan these, and balance away from a blocked worker.
	Redispatch bool
	// The freeness of both workers when the decision was made.
	FromFreeness, ToFreeness float64
}

// The words a planned migration's reason starts with.
const (
	ReasonBalance = "balance"
	ReasonDrain   = "drain"
)

// Reason says why the migration was planned, for its Migration event: it
// starts with ReasonDrain or ReasonBalance.
func (m Migration) Reason(ws []Worker) string {
	if m.Drain && m.Redispatch {
		return fmt.Sprintf("%s: %s is draining; a queued request, re-dispatched to the freest worker %s (freeness %.1f)", ReasonDrain, ws[m.From].ID, ws[m.To].ID, m.ToFreeness)
	}
	if m.Drain {
		return fmt.Sprintf("%s: %s is draining; %s is the freest destination (freeness %.1f)", ReasonDrain, ws[m.From].ID, ws[m.To].ID, m.ToFreeness)
	}
	if m.Redispatch {
		return fmt.Sprintf("%s: %s's queue is blocked (freeness %.1f); a queued request, re-dispatched to %s, which can start it (freeness %.1f)", ReasonBalance, ws[m.From].ID, m.FromFreeness, ws[m.To].ID, m.ToFreeness)
	}
	return fmt.Sprintf("%s: freeness %.1f at %s, %.1f at %s", ReasonBalance, m.FromFreeness, ws[m.From].ID, m.ToFreeness, ws[m.To].ID)
}

// PlanMigrations is one round of Llumnix's migration scheduling over the
// load table ws (sorted by id) and the placements ps (any order: what it
// returns does not depend on it). Only a request with a KV cache at its
// worker migrates as Llumnix's migration does, its cache copied; a queued
// one (Placed.Queued) has nothing to copy and moves by re-dispatch
// (Migration.Redispatch): the destination queues it as a dispatch would.
//
// Drains come first: every RUNNING request of a DRAINING worker moves (a
// draining worker is Llumnix's infinitely loaded one: never a destination,
// every request off it). The queued ones first, by re-dispatch: each to
// the freest eligible worker, as a dispatch would go, with no room or link
// to wait for. Then the rest, in Order, each to the freest eligible worker
// that has the room for it (MigrationPages) and a running slot (MaxRunning:
// those it runs, those waiting and pending there and the migrations in
// flight into it count), as many as the links carry in
// a round (LinkPages, out of the draining worker and into each
// destination, the migrations already in flight counted; a link with
// nothing on it always takes one): a drain goes as fast as the
// interconnect and the destinations' free pages allow, not one migration
// per destination per round. A request no destination can take now waits
// for the next round, served where it is.
//
// Then, when p.Balance is set, load balance over the eligible workers
// (FULL_SERVICE), by Llumnix's virtual usage: a worker's freeness counts
// its queue head's demand (Worker.Freeness), and a destination's room is
// its free pages less its queue head, the pages pending there and the
// growth still to come of the requests it runs (their prompt + max_tokens
// less the pages it reports used, at most GrowthPages a request), so that
// no move makes its destination preempt. Two kinds of move:
//
//  1. Re-dispatch away from a blocked worker: a worker whose queue head
//     cannot start (it lacks pages, or every running slot is taken) sends
//     its queued requests, in Order, each to the freest worker that can
//     start it now: no queue there, a running slot, and room for it at
//     its full length. These copy nothing and take no role in the round
//     (any number a round); a worker with a migration in flight out
//     sends none.
//  2. Migrations of a running request, under Llumnix's rules:
//     - one migration out and one in per worker: a worker with a MIGRATING
//     placement out (in) is no source (destination), and a worker takes
//     one role per round (a drain's destination, or a re-dispatch's,
//     included);
//     - never A→B together with B→A, in flight or planned;
//     - the source sends, when its head lacks pages, the running request
//     with the fewest prompt pages that covers the lack (its prompt
//     pages, the least it holds, at least the head's deficit), else the
//     largest; when its head is not blocked, its first request in Order;
//     - the destination has the room for the request at its full length
//     (MigrationPages) and a running slot;
//     - only where the pair's imbalance shrinks: with the request moved
//     (MigrationPages off the source and one request fewer; the pages and
//     the request pending at the destination), the two freeness values
//     are closer than before. That also means a source only ever sends to
//     a freer worker, and a small imbalance is left alone when moving one
//     request would overshoot it.
//
// A worker's high-priority requests (Placed.High) come before its others
// in every use of Order: re-dispatched first, sent first when its head is
// not blocked (Llumnix's high priority, first to migrate), and the
// headroom they reserve (Worker.Freeness) makes their worker a source
// sooner and a destination later.
//
// Sources are taken least free first; each takes the freest destination
// that passes. Ties go to the smaller id. Freeness is recomputed as moves
// are planned; ws is not changed.
func PlanMigrations(ws []Worker, ps []Placed, p MigrationParams) []Migration {
	order := p.Order
	if order == nil {
		order = ShortestFirst
	}
	n := len(ws)
	byID := make(map[string]int, n)
	for i := range ws {
		byID[ws[i].ID] = i
	}
	out, in := make([]int, n), make([]int, n)
	// Pages on each worker's link, out and in: in flight, then planned.
	linkOut, linkIn := make([]uint64, n), make([]uint64, n)
	// reserved: the pages the requests with a cache on each worker take
	// at their full length, those migrating in included.
	reserved := make([]uint64, n)
	inflight := map[[2]int]bool{}
	cands := make([][]*Placed, n)  // with a KV cache
	queued := make([][]*Placed, n) // without
	for k := range ps {
		pl := &ps[k]
		s, ok := byID[pl.Worker]
		if !ok {
			continue
		}
		switch pl.State {
		case PlacedMigrating:
			out[s]++
			pages := MigrationPages(pl)
			if pl.Queued {
				pages = 0
			}
			linkOut[s] += pages
			reserved[s] += pages
			if d, ok := byID[pl.MigrationTarget]; ok {
				in[d]++
				linkIn[d] += pages
				reserved[d] += pages
				inflight[[2]int{s, d}] = true
			}
		case PlacedRunning:
			if pl.Queued {
				queued[s] = append(queued[s], pl)
			} else {
				cands[s] = append(cands[s], pl)
				reserved[s] += MigrationPages(pl)
			}
		}
	}
	// High priority moves first (Llumnix's priorities): then Order.
	byOrder := func(a, b *Placed) int {
		if a.High != b.High {
			if a.High {
				return -1
			}
			return 1
		}
		return order(a, b)
	}
	for s := range cands {
		slices.SortFunc(cands[s], byOrder)
		slices.SortFunc(queued[s], byOrder)
	}
	// fits says whether worker i's link takes pages more this round.
	fits := func(i int, used []uint64, pages uint64) bool {
		if i >= len(p.LinkPages) || p.LinkPages[i] == 0 || used[i] == 0 {
			return true
		}
		return used[i]+pages <= p.LinkPages[i]
	}

	views := slices.Clone(ws)
	room := func(d int) int64 {
		v := &views[d]
		return int64(v.KVPagesTotal) - int64(v.KVPagesUsed) - int64(v.QueueHeadPages) - int64(v.PendingPages)
	}
	// growth is the pages the requests running on d will still take: at
	// their full length less what d reports used, at most GrowthPages
	// each (the report's running count).
	growth := func(d int) int64 {
		g := int64(reserved[d]) - int64(ws[d].KVPagesUsed)
		if p.GrowthPages > 0 {
			g = min(g, int64(ws[d].Running)*int64(p.GrowthPages))
		}
		return max(g, 0)
	}
	// slot says whether worker d has a running slot for one more copy:
	// those it runs, those waiting there (they take the slots that free
	// first), those dispatched or planned since its report (pending) and
	// the migrations in flight into it each take one.
	slot := func(d int) bool {
		v := &views[d]
		return v.MaxRunning == 0 || uint64(v.Running)+uint64(v.Waiting)+uint64(v.PendingRequests)+uint64(in[d]) < uint64(v.MaxRunning)
	}
	// freest is the freest eligible worker other than s that ok accepts,
	// ties to the smaller index; -1 for none.
	freest := func(s int, ok func(i int) bool) int {
		d, best := -1, math.Inf(-1)
		for i := range views {
			if i == s || !views[i].Eligible || !ok(i) {
				continue
			}
			if f := views[i].Freeness(); f > best {
				d, best = i, f
			}
		}
		return d
	}
	taken := make([]bool, n) // a role in this round
	var plan []Migration
	add := func(s, d int, pl *Placed, drain bool) {
		plan = append(plan, Migration{RequestID: pl.RequestID, Epoch: pl.Epoch, From: s, To: d, Drain: drain,
			FromFreeness: views[s].Freeness(), ToFreeness: views[d].Freeness()})
		views[s], views[d] = afterMove(views[s], views[d], MigrationPages(pl))
	}
	redispatch := func(s, d int, pl *Placed, drain bool) {
		plan = append(plan, Migration{RequestID: pl.RequestID, Epoch: pl.Epoch, From: s, To: d, Drain: drain, Redispatch: true,
			FromFreeness: views[s].Freeness(), ToFreeness: views[d].Freeness()})
		views[s], views[d] = afterRedispatch(views[s], views[d], Pages(uint64(pl.PromptTokens)))
	}

	for s := range ws {
		if !ws[s].Draining {
			continue
		}
		for _, pl := range queued[s] {
			d := freest(s, func(int) bool { return true })
			if d < 0 {
				break
			}
			taken[d] = true
			redispatch(s, d, pl, true)
		}
		for _, pl := range cands[s] {
			pages := MigrationPages(pl)
			if !fits(s, linkOut, pages) {
				continue
			}
			d := freest(s, func(i int) bool { return room(i) >= int64(pages) && slot(i) && fits(i, linkIn, pages) })
			if d < 0 {
				continue
			}
			linkOut[s] += pages
			linkIn[d] += pages
			taken[d] = true
			add(s, d, pl, true)
		}
	}
	if !p.Balance {
		return plan
	}

	// deficit is the pages s's queue head lacks (0: none waits, or it
	// fits); headless says its head waits for a running slot.
	deficit := func(s int) int64 {
		v := &views[s]
		if v.Waiting == 0 {
			return 0
		}
		return max(int64(v.QueueHeadPages)+int64(v.KVPagesUsed)-int64(v.KVPagesTotal), 0)
	}
	slotBlocked := func(s int) bool {
		v := &views[s]
		return v.Waiting > 0 && v.MaxRunning > 0 && v.Running >= v.MaxRunning
	}
	// starts says whether d can start a request of pages at its full
	// length now: no queue, a slot, the room with its running requests'
	// growth counted.
	starts := func(d int, pages uint64) bool {
		v := &views[d]
		return v.Waiting == 0 && slot(d) && room(d)-growth(d) >= int64(pages)
	}
	byFreeness := func(desc bool) func(a, b int) int {
		return func(a, b int) int {
			c := cmp.Compare(views[a].Freeness(), views[b].Freeness())
			if desc {
				c = -c
			}
			if c != 0 {
				return c
			}
			return cmp.Compare(a, b)
		}
	}

	// 1. Re-dispatch the queued requests of blocked workers, the least
	// free first.
	var blocked []int
	for i := range ws {
		if ws[i].Eligible && out[i] == 0 && len(queued[i]) > 0 && (deficit(i) > 0 || slotBlocked(i)) {
			blocked = append(blocked, i)
		}
	}
	slices.SortFunc(blocked, byFreeness(false))
	for _, s := range blocked {
		for _, pl := range queued[s] {
			if deficit(s) == 0 && !slotBlocked(s) {
				break // as many moved as its report had waiting
			}
			pages := MigrationPages(pl)
			d := freest(s, func(i int) bool { return i != s && !inflight[[2]int{i, s}] && starts(i, pages) })
			if d < 0 {
				continue
			}
			taken[d] = true
			redispatch(s, d, pl, false)
		}
	}

	// 2. Migrations of running requests.
	var srcs, dsts []int
	for i := range ws {
		if !ws[i].Eligible || taken[i] {
			continue
		}
		if out[i] == 0 && len(cands[i]) > 0 {
			srcs = append(srcs, i)
		}
		if in[i] == 0 {
			dsts = append(dsts, i)
		}
	}
	slices.SortFunc(srcs, byFreeness(false))
	slices.SortFunc(dsts, byFreeness(true))
	for _, s := range srcs {
		if taken[s] {
			continue
		}
		pl := pick(cands[s], deficit(s))
		pages := MigrationPages(pl)
		fs := views[s].Freeness()
		for _, d := range dsts {
			if taken[d] || d == s || inflight[[2]int{d, s}] {
				continue
			}
			fd := views[d].Freeness()
			if fd <= fs {
				break // the rest are no freer
			}
			if !slot(d) || room(d)-growth(d) < int64(pages) || !shrinks(views[s], views[d], pages) {
				continue
			}
			taken[s], taken[d] = true, true
			add(s, d, pl, false)
			break
		}
	}
	return plan
}

// pick is the running request a balance source sends, of cands in the
// plan's order: with deficit > 0 (its queue head lacks that many pages)
// the one with the fewest prompt pages (the least it holds) that covers
// it, ties in order, else the one with the most; with none, the first.
func pick(cands []*Placed, deficit int64) *Placed {
	if deficit <= 0 {
		return cands[0]
	}
	var cover, largest *Placed
	for _, pl := range cands {
		k := Pages(uint64(pl.PromptTokens))
		if int64(k) >= deficit && (cover == nil || k < Pages(uint64(cover.PromptTokens))) {
			cover = pl
		}
		if largest == nil || k > Pages(uint64(largest.PromptTokens)) {
			largest = pl
		}
	}
	if cover != nil {
		return cover
	}
	return largest
}

// afterMove is the load of s and d once a request of pages has moved from s
// to d: off the source's pages and batch, pending at the destination (as a
// dispatch is, until its next load report).
func afterMove(s, d Worker, pages uint64) (Worker, Worker) {
	s.KVPagesUsed -= min(pages, s.KVPagesUsed)
	if s.Running > 0 {
		s.Running--
	}
	d.PendingRequests++
	d.PendingPages += pages
	return s, d
}

// afterRedispatch is the load of s and d once a queued request whose
// prompt fills pages has moved from s to d: one fewer waiting at the
// source, pending at the destination as a dispatch is.
func afterRedispatch(s, d Worker, pages uint64) (Worker, Worker) {
	if s.Waiting > 0 {
		s.Waiting--
	}
	d.PendingRequests++
	d.PendingPages += pages
	return s, d
}

// shrinks says whether moving a request of pages from s to d brings their
// freeness closer together.
func shrinks(s, d Worker, pages uint64) bool {
	s2, d2 := afterMove(s, d, pages)
	return math.Abs(s2.Freeness()-d2.Freeness()) < math.Abs(s.Freeness()-d.Freeness())
}

// MigrationDestination is where an operator's migration of a request from
// ws[from] goes when the operator names none: the freest eligible worker
// other than from, ties to the smaller id; -1 when there is none. It
// ignores the per-worker limits of PlanMigrations: the operator asked.
func MigrationDestination(ws []Worker, from int) int {
	best, bestF := -1, math.Inf(-1)
	for i := range ws {
		if i == from || !ws[i].Eligible {
			continue
		}
		if f := ws[i].Freeness(); f > bestF {
			best, bestF = i, f
		}
	}
	return best
}
