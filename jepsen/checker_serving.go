package jepsen

import (
	"fmt"
	"strings"
)

// Stream is what a client of the gateway saw of one streamed request.
type Stream struct {
	Client   int    `json:"client"`
	N        int    `json:"n"`
	Prompt   string `json:"prompt"`
	Max      int    `json:"max_tokens"`
	Accepted bool   `json:"accepted"` // HTTP 200 and a stream began
	Done     bool   `json:"done"`     // ended with [DONE]
	ErrEvent string `json:"error_event,omitempty"`
	Err      string `json:"err,omitempty"` // transport error or HTTP status
	Text     string `json:"text"`
	Call     int64  `json:"call"`
	Return   int64  `json:"return"`
}

// CheckServing checks the serving promises: every stream the gateway
// accepted ends with [DONE] or an explicit error event, never cut off
// silently; every completed output equals the failure-free reference, so no
// token was lost, repeated or changed (a stream served by two workers at
// once would repeat or garble tokens, and shows up here).
func CheckServing(streams []Stream, reference func(prompt string, max int) string) Verdict {
	v := Verdict{Checker: "serving", OK: true}
	done, errs, refused := 0, 0, 0
	for _, s := range streams {
		switch {
		case !s.Accepted:
			refused++
		case s.Done:
			done++
			if want := reference(s.Prompt, s.Max); s.Text != want {
				v.fail("stream %d/%d differs from the reference at byte %d:\n  got  %q\n  want %q", s.Client, s.N, firstDiff(s.Text, want), s.Text, want)
			}
		case s.ErrEvent != "":
			errs++
		default:
			v.fail("stream %d/%d ended with neither [DONE] nor an error event after %d bytes: %s", s.Client, s.N, len(s.Text), s.Err)
		}
	}
	v.Note = fmt.Sprintf("%d streams: %d complete and checked, %d ended with an explicit error, %d refused", len(streams), done, errs, refused)
	return v
}

func firstDiff(a, b string) int {
	for i := 0; i < len(a) && i < len(b); i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// BudgetSample is a holder's checkpoint bytes against its budget at one
// moment: Reserved is what the placement table reserves on it (h(r)'s
// bookkeeping, replicated), Stored what its checkpoint store reported
// holding.
type BudgetSample struct {
	At       int64
	Worker   string
	Reserved uint64
	Stored   uint64
	Budget   uint64
}

// CheckBudgets: no holder ever over its checkpoint budget, neither in the
// placement table's reservations nor in the bytes its store held.
func CheckBudgets(samples []BudgetSample) Verdict {
	v := Verdict{Checker: "budget", OK: true}
	peak := uint64(0)
	for _, s := range samples {
		if s.Budget == 0 {
			continue
		}
		peak = max(peak, 100*max(s.Reserved, s.Stored)/s.Budget)
		if s.Reserved > s.Budget {
			v.fail("%s: %d bytes of checkpoints reserved on it at %s, budget %d", s.Worker, s.Reserved, fmtNanos(s.At), s.Budget)
		}
		if s.Stored > s.Budget {
			v.fail("%s: its store held %d bytes of checkpoints at %s, budget %d", s.Worker, s.Stored, fmtNanos(s.At), s.Budget)
		}
	}
	v.Note = fmt.Sprintf("%d samples, peak %d%% of a budget", len(samples), peak)
	return v
}

// Failure is a committed MarkFailed: worker incarnation inc failed at log
// index Index.
type Failure struct {
	Worker string
	Inc    uint64
	Index  uint64
}

// CheckNoDispatchToFailed: no Dispatch committed after a worker's
// MarkFailed places a request on that incarnation.
func CheckNoDispatchToFailed(ops []Op, failures []Failure) Verdict {
	v := Verdict{Checker: "no-dispatch-to-failed", OK: true}
	n := 0
	for _, op := range ops {
		if op.Kind != Dispatch || op.Indeterminate || op.Err != "" || op.Index == 0 {
			continue
		}
		n++
		for _, f := range failures {
			if f.Worker == op.Worker && f.Inc == op.Inc && op.Index > f.Index {
				v.fail("%s dispatched to %s incarnation %d at index %d, marked failed at index %d", op.ID, op.Worker, op.Inc, op.Index, f.Index)
			}
		}
	}
	v.Note = fmt.Sprintf("%d acknowledged dispatches against %d failures", n, len(failures))
	return v
}

// ReplicaState is one replica's state hash at an applied index.
type ReplicaState struct {
	Node  string
	Index uint64
	Hash  uint64
}

// CheckConverged: every replica at the same applied index has the same
// state, and they all reached the same index.
func CheckConverged(states []ReplicaState) Verdict {
	v := Verdict{Checker: "converged", OK: true}
	if len(states) == 0 {
		v.fail("no replica answered")
		return v
	}
	var parts []string
	for _, s := range states {
		parts = append(parts, fmt.Sprintf("%s %x@%d", s.Node, s.Hash, s.Index))
		if s.Index != states[0].Index || s.Hash != states[0].Hash {
			v.OK = false
		}
	}
	if !v.OK {
		v.Violations = append(v.Violations, "replicas differ: "+strings.Join(parts, ", "))
	}
	v.Note = strings.Join(parts, ", ")
	return v
}

func fmtNanos(n int64) string { return fmt.Sprintf("%.3fs", float64(n)/1e9) }
