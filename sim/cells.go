package sim

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/lumen-project/lumen/fsm"
	"github.com/lumen-project/lumen/internal/placer"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Cells (issue 26, Config.Cells > 1): the cluster is several cells, each
// a full controller quorum — its own fsm.FSM, its own Raft log — over its
// own workers, Workers/Cells of them in id order (worker-1 … worker-n/C in
// cell 1, …), whole nodes (Config.GPUsPerNode) each. A worker registers
// with its cell's quorum, reports its load there and is marked failed
// there; a request is placed in one cell, and its checkpoint holders are
// that cell's workers (h(r) is the cell's fsm's, which knows no other
// worker), so a failure is recovered inside its cell — the plan is the
// cell's fsm's, over the cell's survivors — and no command spans cells.
// The only cross-cell state is the gateways'.
//
// The gateways place across the cells (Config.Gateways ≥ 1: there is no
// Apply that sees every cell). Each keeps one internal/placer.Replica per
// cell, fed by that cell's WatchLoad stream (the same WatchInterval and
// WatchDelay, the gateway's ticks offset as with one cell), and chooses
// in two steps:
//
//  1. the cell whose replica's freest eligible worker is freest
//     (placer.Replica.BestFreeness: the table plus this gateway's own
//     placements the table does not count yet; ties to the lower cell);
//  2. the worker within it by the replica's own Take (with the
//     gateway's share, as with one cell).
//
// Why the freest worker and not a cell-level sum: with one gateway and
// ChooseFreest, step 1 then 2 is exactly PickServing over the union of the
// cells' tables, the choice one (ideal) quorum's Apply would make from the
// same rows, so the cost of cells is only what cells change — each table
// is a cell's, each gateway's own placements count in the cell it made
// them in — and not a coarser rule; a sum (free pages over requests of the
// whole cell) would send a request to a cell with more room on average
// even where the other cell has the one idle worker. It costs the gateway
// O(cells) a placement, plus the chosen cell's Take and its new best
// (the replica's share trees, internal/placer/tree.go: O(G × pending ×
// log n) and O(G)), and one pass over a cell's rows when its table
// arrives (row pointers compared: the FSM shares unchanged rows, and the
// replica updates only the changed ones, placer.Replica.Update) — never a
// pass over every cell's rows per request. A
// request whose Take finds no eligible worker in the chosen cell (every
// one refused it) tries the next cell by the same order; with no table
// from any cell yet, the Dispatch goes without a worker to cell idx mod
// Cells, whose Apply chooses.

// simCell is one cell: a controller quorum and its Raft log.
type simCell struct {
	idx      int
	fsm      *fsm.FSM
	logIndex uint64
	// raft counts the cell's log as Result.Raft does the whole stream
	// (nil with one cell); placed counts the Dispatches it accepted.
	raft   map[string]RaftCount
	placed int
	lo, hi int // its workers' indices
}

func (c *simCell) name() string {
	if c.raft == nil {
		return ""
	}
	return fmt.Sprintf(" in cell %d", c.idx+1)
}

// CellStats is one cell's part of a run (Result.Cells).
type CellStats struct {
	// Workers is the cell's size; Raft its log's write stream by
	// command type over Config.RaftFrom..RaftTo, as Result.Raft counts
	// every cell's; Placed the Dispatches its fsm accepted over the run.
	Workers int
	Raft    map[string]RaftCount
	Placed  int
}

// validateCells says what is wrong with the Config's cells.
func (c *Config) validateCells() []error {
	n := c.Cells
	switch {
	case n < 0:
		return []error{fmt.Errorf("Cells (%d) must be >= 0 (0 or 1: one quorum)", n)}
	case n <= 1:
		return nil
	}
	var errs []error
	if c.Workers%n != 0 {
		errs = append(errs, fmt.Errorf("Cells (%d) must divide Workers (%d): the workers are split evenly", n, c.Workers))
	} else if c.GPUsPerNode > 0 && (c.Workers/n)%c.GPUsPerNode != 0 {
		errs = append(errs, fmt.Errorf("with Cells (%d), a cell's %d workers must be whole nodes of GPUsPerNode (%d): a node never spans cells",
			n, c.Workers/n, c.GPUsPerNode))
	}
	if c.Gateways < 1 {
		errs = append(errs, fmt.Errorf("Cells (%d) needs Gateways >= 1: no Apply sees every cell, the gateways choose the cell", n))
	}
	if c.Migration || c.RoundRobin {
		errs = append(errs, errors.New("Cells > 1 runs without Migration and RoundRobin (a leader round per cell is not built)"))
	}
	return errs
}

// initCells creates the cells: with one, the Sim's fsm is it.
func (s *Sim) initCells() {
	n := max(s.cfg.Cells, 1)
	if n == 1 {
		s.cells = []*simCell{{fsm: s.fsm, hi: s.cfg.Workers}}
		return
	}
	s.fsm = nil // every read names its cell
	s.reqCell = map[string]*simCell{}
	per := s.cfg.Workers / n
	for k := range n {
		s.cells = append(s.cells, &simCell{idx: k, fsm: fsm.New(), raft: map[string]RaftCount{}, lo: k * per, hi: (k + 1) * per})
	}
}

// cellAt is the cell of worker index i.
func (s *Sim) cellAt(i int) *simCell {
	return s.cells[i*len(s.cells)/s.cfg.Workers]
}

// entryCells are the cells whose log takes an entry: SetStrategy goes to
// every cell's; any other command names a worker or a request of one
// cell, and an entry's commands are all of one cell.
func (s *Sim) entryCells(cmds []*pb.Command) []*simCell {
	if len(s.cells) == 1 {
		return s.cells
	}
	if _, ok := cmds[0].Body.(*pb.Command_SetStrategy); ok {
		return s.cells
	}
	c := s.commandCell(cmds[0])
	for _, cmd := range cmds[1:] {
		if s.commandCell(cmd) != c {
			panic(fmt.Sprintf("sim: one log entry spans cells (%s)", fsm.CommandType(cmd)))
		}
	}
	return []*simCell{c}
}

// commandCell is the cell a command is for.
func (s *Sim) commandCell(c *pb.Command) *simCell {
	worker := ""
	switch b := c.Body.(type) {
	case *pb.Command_RegisterWorker:
		worker = b.RegisterWorker.GetWorker().GetId()
	case *pb.Command_ReportLoad:
		worker = b.ReportLoad.GetLoad().GetWorkerId()
	case *pb.Command_MarkFailed:
		worker = b.MarkFailed.WorkerId
	case *pb.Command_SetPhase:
		worker = b.SetPhase.WorkerId
	case *pb.Command_Dispatch:
		if worker = b.Dispatch.WorkerId; worker == "" {
			if r := s.byID[b.Dispatch.RequestId]; r != nil && r.cell != nil {
				return r.cell
			}
		}
	case *pb.Command_Complete:
		if ids := b.Complete.RequestIds; len(ids) > 0 {
			if cell := s.reqCell[ids[0]]; cell != nil {
				return cell
			}
			if r := s.byID[ids[0]]; r != nil && r.cell != nil {
				return r.cell
			}
		}
	}
	if w := s.byWorker[worker]; w != nil {
		return w.cell
	}
	panic(fmt.Sprintf("sim: no cell for a %s command", fsm.CommandType(c)))
}

// appliedIn notes, with cells, the cell of each Dispatch cell applied and
// forgets each id Completed.
func (s *Sim) appliedIn(cell *simCell, cmds []*pb.Command, res []fsm.Result) {
	if s.reqCell == nil {
		return
	}
	for i, c := range cmds {
		switch b := c.Body.(type) {
		case *pb.Command_Dispatch:
			if res[i].Err == nil {
				s.reqCell[b.Dispatch.RequestId] = cell
				cell.placed++
			}
		case *pb.Command_Complete:
			for _, id := range b.Complete.RequestIds {
				delete(s.reqCell, id)
			}
		}
	}
}

// placement is the request's placement in its cell's fsm (nil: none).
func (s *Sim) placement(id string) *pb.Placement {
	f := s.fsm
	if s.reqCell != nil {
		c := s.reqCell[id]
		if c == nil {
			return nil
		}
		f = c.fsm
	}
	pl, _ := f.Placement(id)
	return pl
}

// recoveries are every cell's recovery plans, cell by cell.
func (s *Sim) recoveries() []*pb.RecoveryPlan {
	if len(s.cells) == 1 {
		return s.cells[0].fsm.Recoveries()
	}
	var out []*pb.RecoveryPlan
	for _, c := range s.cells {
		out = append(out, c.fsm.Recoveries()...)
	}
	return out
}

// applyByCell applies MarkFailed commands that reached the leaders at once:
// with cells, each cell's as one entry of its log, the cells in order; the
// results in cmds' order.
func (s *Sim) applyByCell(cmds []*pb.Command) []fsm.Result {
	if len(s.cells) == 1 {
		return s.applyEntry(cmds)
	}
	out := make([]fsm.Result, len(cmds))
	for _, c := range s.cells {
		var part []*pb.Command
		var at []int
		for i, cmd := range cmds {
			if s.commandCell(cmd) == c {
				part = append(part, cmd)
				at = append(at, i)
			}
		}
		if len(part) == 0 {
			continue
		}
		for k, r := range s.applyEntry(part) {
			out[at[k]] = r
		}
	}
	return out
}

// finishCells sets Result.Cells.
func (s *Sim) finishCells() {
	if len(s.cells) == 1 {
		return
	}
	s.res.Cells = make([]CellStats, len(s.cells))
	for i, c := range s.cells {
		s.res.Cells[i] = CellStats{Workers: c.hi - c.lo, Raft: c.raft, Placed: c.placed}
	}
}

// startCellGateways creates the gateways of a cluster of cells: gateway g
// keeps one replica per cell, each fed by its cell's WatchLoad stream on
// gateway g's ticks.
func (s *Sim) startCellGateways() {
	n := s.cfg.Gateways
	iv := s.cfg.Timing.WatchInterval
	for g := range n {
		gw := &simGateway{idx: g, tableAt: -1}
		for _, c := range s.cells {
			sub := &simGateway{idx: g, rep: placer.New(), tableAt: -1, cell: c, best: math.Inf(-1)}
			if s.placerShares() {
				sub.rep.SetShare(g, n)
			}
			gw.cells = append(gw.cells, sub)
			s.at(0, func() { s.sendTable(sub) })
			s.every(time.Duration(g)*iv/time.Duration(n), iv, func() { s.sendTable(sub) })
		}
		s.gateways = append(s.gateways, gw)
	}
	s.gwPlaced = map[string][]gatewayPlacement{}
}

// rescore sets a cell replica's best (no-op for one cell's gateways).
func (gw *simGateway) rescore() {
	if gw.cell == nil {
		return
	}
	f, ok := gw.rep.BestFreeness()
	if !ok {
		f = math.Inf(-1)
	}
	gw.best = f
}

// takeInCells is gateway gw's choice in a cluster of cells (the rule
// above): the cell's replica it took from (the one whose Dispatch and
// counts follow), the worker, and false when no cell had one (r.cell is
// then the cell the Dispatch goes to without a worker).
func (s *Sim) takeInCells(gw *simGateway, r *simRequest, prompt uint32, exclude []string) (*simGateway, string, uint64, bool) {
	tried := make([]bool, len(gw.cells))
	for range gw.cells {
		k := -1
		for i, sub := range gw.cells {
			if !tried[i] && !math.IsInf(sub.best, -1) && (k < 0 || sub.best > gw.cells[k].best) {
				k = i
			}
		}
		if k < 0 {
			break
		}
		tried[k] = true
		sub := gw.cells[k]
		if w, inc, ok := sub.rep.Take(r.id, prompt, exclude...); ok {
			sub.rescore()
			r.cell = sub.cell
			return sub, w, inc, true
		}
	}
	sub := gw.cells[r.idx%len(gw.cells)]
	r.cell = sub.cell
	return sub, "", 0, false
}
