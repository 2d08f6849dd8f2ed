package jepsen

import (
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"
)

// Verdict is one checker's finding.
type Verdict struct {
	Checker    string
	OK         bool
	Violations []string
	Note       string // what was checked
}

func (v Verdict) String() string {
	if v.OK {
		return "ok"
	}
	return fmt.Sprintf("FAIL (%d)", len(v.Violations))
}

func (v *Verdict) fail(format string, args ...any) {
	v.OK = false
	if len(v.Violations) < 50 {
		v.Violations = append(v.Violations, fmt.Sprintf(format, args...))
	}
}

// placement state in the model, per request id.
type pstate struct {
	st      int // 0 absent, 1 present, 2 completed
	known   bool
	created uint64
	epoch   uint64
	worker  string
}

// refusedCompleted is in the error of a Dispatch of a completed id.
const refusedCompleted = "request already completed"

const (
	absent = iota
	present
	completed
)

// PlacementModel is the sequential specification of one request id's
// placement: Dispatch creates it (idempotently), Complete removes it for
// good, a linearizable read sees exactly the current placement. A move by
// recovery or migration (not a client operation) may happen at any time: it
// raises the epoch and may change the worker, never lowers the epoch or
// changes the index of the Dispatch that created it. An operation with an
// unknown outcome may or may not have taken effect.
var PlacementModel = porcupine.NondeterministicModel{
	Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
		by := map[string][]porcupine.Operation{}
		var ids []string
		for _, op := range h {
			id := op.Input.(Op).ID
			if _, ok := by[id]; !ok {
				ids = append(ids, id)
			}
			by[id] = append(by[id], op)
		}
		sort.Strings(ids)
		out := make([][]porcupine.Operation, 0, len(ids))
		for _, id := range ids {
			out = append(out, by[id])
		}
		return out
	},
	Init: func() []interface{} { return []interface{}{pstate{}} },
	Step: func(state, input, output interface{}) []interface{} {
		s, in, out := state.(pstate), input.(Op), output.(Op)
		switch in.Kind {
		case Dispatch:
			if out.Indeterminate {
				if s.st == absent {
					return []interface{}{s, pstate{st: present}}
				}
				return []interface{}{s}
			}
			if out.Err != "" {
				// A definite refusal changed nothing. A present id is never
				// refused (its Dispatch answers with the placement), a
				// completed one is refused as such, and an absent one only
				// for want of a worker.
				if s.st == present || (s.st == completed) != strings.Contains(out.Err, refusedCompleted) {
					return nil
				}
				return []interface{}{s}
			}
			switch {
			case s.st == absent:
				return []interface{}{pstate{st: present, known: true, created: out.Created, epoch: out.Epoch, worker: out.Worker}}
			case s.st == present && (!s.known || s.created == out.Created && out.Epoch >= s.epoch):
				return []interface{}{pstate{st: present, known: true, created: out.Created, epoch: out.Epoch, worker: out.Worker}}
			}
			return nil
		case Complete:
			if out.Indeterminate {
				return []interface{}{s, pstate{st: completed}}
			}
			if out.Err != "" {
				return []interface{}{s} // refused (a malformed call): nothing changed
			}
			if in.Via == ViaPlace {
				// Acknowledged on the Place stream, which answers a
				// batch's completes together, not each id's outcome: a
				// present id is completed now, any other unchanged.
				if s.st == present {
					return []interface{}{pstate{st: completed}}
				}
				return []interface{}{s}
			}
			if out.Found == (s.st == present) {
				if s.st == present {
					return []interface{}{pstate{st: completed}}
				}
				return []interface{}{s}
			}
			return nil
		case GetLin:
			if !out.Found {
				if s.st != present {
					return []interface{}{s}
				}
				return nil
			}
			if s.st != present {
				return nil
			}
			if s.known && (out.Created != s.created || out.Epoch < s.epoch || out.Epoch == s.epoch && out.Worker != s.worker) {
				return nil
			}
			return []interface{}{pstate{st: present, known: true, created: out.Created, epoch: out.Epoch, worker: out.Worker}}
		}
		return nil
	},
	Equal: func(a, b interface{}) bool { return a.(pstate) == b.(pstate) },
	DescribeOperation: func(input, output interface{}) string {
		in, out := input.(Op), output.(Op)
		switch {
		case out.Indeterminate:
			return fmt.Sprintf("%s(%s) -> ?", in.Kind, in.ID)
		case out.Err != "":
			return fmt.Sprintf("%s(%s) -> refused: %s", in.Kind, in.ID, out.Err)
		case in.Kind == Complete && in.Via == ViaPlace:
			return fmt.Sprintf("complete(%s) -> acknowledged (place stream)", in.ID)
		case in.Kind == Complete:
			return fmt.Sprintf("complete(%s) -> %v", in.ID, out.Found)
		case !out.Found && in.Kind != Dispatch:
			return fmt.Sprintf("%s(%s) -> not found", in.Kind, in.ID)
		}
		return fmt.Sprintf("%s(%s) -> %s epoch %d created@%d", in.Kind, in.ID, out.Worker, out.Epoch, out.Created)
	},
	DescribeState: func(state interface{}) string {
		s := state.(pstate)
		switch s.st {
		case absent:
			return "absent"
		case completed:
			return "completed"
		}
		if !s.known {
			return "present (unseen)"
		}
		return fmt.Sprintf("%s epoch %d created@%d", s.worker, s.epoch, s.created)
	},
}

// CheckLinearizable checks the dispatch/complete/linearizable-read part of a
// history against PlacementModel. Reads that failed are dropped (a read
// changes nothing); writes that failed are indeterminate. On a violation
// the porcupine visualization is written to htmlPath (when not empty).
func CheckLinearizable(ops []Op, htmlPath string, timeout time.Duration) Verdict {
	v := Verdict{Checker: "linearizable", OK: true}
	var hist []porcupine.Operation
	for _, op := range ops {
		if op.Kind == GetStale || (op.Kind == GetLin && (op.Indeterminate || op.Err != "")) {
			continue
		}
		hist = append(hist, porcupine.Operation{ClientId: op.Client, Input: op, Call: op.Call, Output: op, Return: op.Return})
	}
	model := PlacementModel.ToModel()
	res, info := porcupine.CheckOperationsVerbose(model, hist, timeout)
	v.Note = fmt.Sprintf("%d operations", len(hist))
	switch res {
	case porcupine.Illegal:
		v.fail("the placement history is not linearizable (porcupine)")
		// Name the request ids whose histories are not linearizable,
		// each on its own (the model partitions by id), with their ops.
		for _, part := range PlacementModel.Partition(hist) {
			if porcupine.CheckOperations(model, part) {
				continue
			}
			id := part[0].Input.(Op).ID
			v.fail("request %s: %d operations, not linearizable: %s", id, len(part), describe(part))
		}
		if htmlPath != "" {
			if err := porcupine.VisualizePath(model, info, htmlPath); err == nil {
				v.Violations = append(v.Violations, "visualization: "+htmlPath)
			}
		}
	case porcupine.Unknown:
		v.Note += "; porcupine timed out: unknown (not counted as a violation)"
	}
	return v
}

// describe lists a partition's operations, call order, for a violation.
func describe(part []porcupine.Operation) string {
	var b strings.Builder
	for i, op := range part {
		if i > 0 {
			b.WriteString("; ")
		}
		ret := "∞"
		if op.Return != Unknown {
			ret = fmt.Sprintf("%.3fs", float64(op.Return)/1e9)
		}
		in := op.Input.(Op)
		via := ""
		if in.Via != "" {
			via = " via " + in.Via
		}
		if in.Chose != "" {
			via += fmt.Sprintf(" naming %s#%d", in.Chose, in.ChoseInc)
		}
		fmt.Fprintf(&b, "[%.3fs..%s c%d%s] %s", float64(op.Call)/1e9, ret, op.ClientId, via, PlacementModel.DescribeOperation(op.Input, op.Output))
	}
	return b.String()
}

// CheckStaleReads checks that every stale read saw some committed state: a
// placement it returns was created by a Dispatch of that id (same creation
// index as the acknowledged one), never one that no Dispatch made.
func CheckStaleReads(ops []Op) Verdict {
	v := Verdict{Checker: "stale-reads", OK: true}
	created := map[string]uint64{}
	dispatched := map[string]bool{}
	for _, op := range ops {
		if op.Kind == Dispatch {
			dispatched[op.ID] = true
			if !op.Indeterminate && op.Err == "" {
				created[op.ID] = op.Created
			}
		}
		if op.Kind == GetLin && op.Found {
			if c, ok := created[op.ID]; !ok || c == 0 {
				created[op.ID] = op.Created
			}
		}
	}
	n := 0
	for _, op := range ops {
		if op.Kind != GetStale || !op.Found || op.Err != "" {
			continue
		}
		n++
		if !dispatched[op.ID] {
			v.fail("stale read of %s found a placement no Dispatch made (worker %s)", op.ID, op.Worker)
		} else if c, ok := created[op.ID]; ok && c != op.Created {
			v.fail("stale read of %s: created at index %d, the Dispatch created it at %d", op.ID, op.Created, c)
		}
	}
	v.Note = fmt.Sprintf("%d stale reads that found a placement", n)
	return v
}

// CheckDurable takes the final linearizable reads (after the faults healed
// and the cluster converged) and checks that every acknowledged Dispatch
// not followed by a Complete is still there, as created, and that every
// acknowledged Complete stayed complete.
func CheckDurable(ops []Op, final map[string]Op) Verdict {
	v := Verdict{Checker: "durable", OK: true}
	acked := map[string]Op{}
	completeCalled := map[string]bool{}
	completeAcked := map[string]bool{}
	for _, op := range ops {
		switch {
		case op.Kind == Dispatch && !op.Indeterminate && op.Err == "":
			acked[op.ID] = op
		case op.Kind == Complete:
			completeCalled[op.ID] = true
			if !op.Indeterminate && op.Err == "" {
				completeAcked[op.ID] = true
			}
		}
	}
	checked := 0
	for id, d := range acked {
		f, ok := final[id]
		if !ok {
			v.fail("no final read of %s", id)
			continue
		}
		checked++
		switch {
		case completeAcked[id] && f.Found:
			v.fail("%s: Complete acknowledged, the placement is back (worker %s)", id, f.Worker)
		case !completeCalled[id] && !f.Found:
			v.fail("%s: Dispatch acknowledged at index %d (worker %s), the placement is lost", id, d.Index, d.Worker)
		case !completeCalled[id] && f.Created != d.Created:
			v.fail("%s: created at index %d, now says %d", id, d.Created, f.Created)
		}
	}
	v.Note = fmt.Sprintf("%d acknowledged dispatches read back", checked)
	return v
}
