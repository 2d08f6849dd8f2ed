package policy

import (
	"cmp"
	"fmt"
	"math"
	"slices"
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
	if m.Drain {
		return fmt.Sprintf("%s: %s is draining; %s is the freest destination (freeness %.1f)", ReasonDrain, ws[m.From].ID, ws[m.To].ID, m.ToFreeness)
	}
	return fmt.Sprintf("%s: freeness %.1f at %s, %.1f at %s", ReasonBalance, m.FromFreeness, ws[m.From].ID, m.ToFreeness, ws[m.To].ID)
}

// PlanMigrations is one round of Llumnix's migration scheduling over the
// load table ws (sorted by id) and the placements ps (any order: what it
// returns does not depend on it).
//
// Drains come first: every RUNNING request of a DRAINING worker moves, in
// Order, each to the freest eligible worker that has the room for it
// (MigrationPages) and has not been given a migration in this round. A
// destination thus takes at most one new migration in per round, but
// migrations already in flight into it do not hold it back (a drain is
// bounded by its destinations, not by the draining worker); a request no
// destination can take waits for the next round, served where it is.
//
// Then, when p.Balance is set, load balance: the least-free sources are
// paired with the freest destinations, both eligible (FULL_SERVICE), under
// Llumnix's rules:
//   - one migration out and one in per worker: a worker with a MIGRATING
//     placement out (in) is no source (destination), and a worker takes one
//     role per round;
//   - never A→B together with B→A, in flight or planned;
//   - only where the pair's imbalance shrinks: with the source's first
//     request in Order moved (MigrationPages off the source and one request
//     fewer; the pages and the request pending at the destination), the two
//     freeness values are closer than before. That also means a source only
//     ever sends to a freer worker, and a small imbalance is left alone when
//     moving one request would overshoot it.
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
	inflight := map[[2]int]bool{}
	cands := make([][]*Placed, n)
	for k := range ps {
		pl := &ps[k]
		s, ok := byID[pl.Worker]
		if !ok {
			continue
		}
		switch pl.State {
		case PlacedMigrating:
			out[s]++
			if d, ok := byID[pl.MigrationTarget]; ok {
				in[d]++
				inflight[[2]int{s, d}] = true
			}
		case PlacedRunning:
			cands[s] = append(cands[s], pl)
		}
	}
	for s := range cands {
		slices.SortFunc(cands[s], order)
	}

	views := slices.Clone(ws)
	room := func(d int) int64 {
		v := &views[d]
		return int64(v.KVPagesTotal) - int64(v.KVPagesUsed) - int64(v.QueueHeadPages) - int64(v.PendingPages)
	}
	taken := make([]bool, n) // a role in this round
	var plan []Migration
	add := func(s, d int, pl *Placed, drain bool) {
		plan = append(plan, Migration{RequestID: pl.RequestID, Epoch: pl.Epoch, From: s, To: d, Drain: drain,
			FromFreeness: views[s].Freeness(), ToFreeness: views[d].Freeness()})
		views[s], views[d] = afterMove(views[s], views[d], MigrationPages(pl))
	}

	for s := range ws {
		if !ws[s].Draining {
			continue
		}
		for _, pl := range cands[s] {
			pages := int64(MigrationPages(pl))
			d, best := -1, math.Inf(-1)
			for i := range views {
				if i == s || !views[i].Eligible || taken[i] || room(i) < pages {
					continue
				}
				if f := views[i].Freeness(); f > best {
					d, best = i, f
				}
			}
			if d < 0 {
				break
			}
			taken[d] = true
			add(s, d, pl, true)
		}
	}
	if !p.Balance {
		return plan
	}

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
	slices.SortFunc(srcs, byFreeness(false))
	slices.SortFunc(dsts, byFreeness(true))
	for _, s := range srcs {
		if taken[s] {
			continue
		}
		pl := cands[s][0]
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
			if !shrinks(views[s], views[d], pages) {
				continue
			}
			taken[s], taken[d] = true, true
			add(s, d, pl, false)
			break
		}
	}
	return plan
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
