package jepsen

import (
	"fmt"
	"strings"
	"time"
)

// Stream is what a client of the gateway saw of one streamed request.
type Stream struct {
	Client   int    `json:"client"`
	N        int    `json:"n"`
	Gateway  string `json:"gateway"`      // the gateway it went through
	ID       string `json:"id,omitempty"` // the request id, as its chunks gave it
	Prompt   string `json:"prompt"`
	Max      int    `json:"max_tokens"`
	Accepted bool   `json:"accepted"` // HTTP 200 and a stream began
	Done     bool   `json:"done"`     // ended with [DONE]
	ErrEvent string `json:"error_event,omitempty"`
	Err      string `json:"err,omitempty"` // transport error or HTTP status
	Text     string `json:"text"`
	Call     int64  `json:"call"`
	Return   int64  `json:"return"`
	// TokenTimes are when the chunks carrying text arrived (the history's
	// clock): whether the stream was being served at a given moment.
	TokenTimes []int64 `json:"token_times,omitempty"`
}

// servedDuring reports whether s completed, or got a token, while k's
// gateway was down.
func servedDuring(s Stream, k GatewayKill) bool {
	if s.Return >= k.At && s.Return <= k.Restarted {
		return true
	}
	for _, t := range s.TokenTimes {
		if t >= k.At && t <= k.Restarted {
			return true
		}
	}
	return false
}

// GatewayKill is a gateway killed: SIGKILL sent at At, the process gone
// at Dead, started again at Restarted (Unknown if it never was), on the
// history's clock.
type GatewayKill struct {
	Gateway   string `json:"gateway"`
	At        int64  `json:"at"`
	Dead      int64  `json:"dead"`
	Restarted int64  `json:"restarted"`
}

// abortedBy returns the kill of s's gateway that happened while s was open,
// if any.
func abortedBy(s Stream, kills []GatewayKill) (GatewayKill, bool) {
	for _, k := range kills {
		if k.Gateway == s.Gateway && s.Call <= k.Dead && k.At <= s.Return {
			return k, true
		}
	}
	return GatewayKill{}, false
}

// CheckServing checks the serving promises: every stream the gateway
// accepted ends with [DONE] or an explicit error event, never cut off
// silently; every completed output equals the failure-free reference, so no
// token was lost, repeated or changed (a stream served by two workers at
// once would repeat or garble tokens, and shows up here).
//
// The promise is for failures of workers and controllers. A gateway's
// crash is visible to its clients: a stream cut while its own gateway was
// killed is counted as aborted, not as a violation (the bytes it got must
// be a prefix of the reference); streams on the other
// gateways are held to the promise, and while a gateway was down at least
// one of them must have been served — completed, or got a token, in the
// window, and completed equal to the reference (the others keep serving; a
// stream longer than the window, 320 tokens with migrate, cannot complete
// inside it).
func CheckServing(streams []Stream, kills []GatewayKill, reference func(prompt string, max int) string) Verdict {
	v := Verdict{Checker: "serving", OK: true}
	done, errs, refused, aborted, servedDuringKills := 0, 0, 0, 0, 0
	for _, s := range streams {
		switch {
		case !s.Accepted:
			refused++
		case s.Done:
			done++
			if want := reference(s.Prompt, s.Max); s.Text != want {
				v.fail("stream %d/%d (%s) differs from the reference at byte %d:\n  got  %q\n  want %q", s.Client, s.N, s.Gateway, firstDiff(s.Text, want), s.Text, want)
			}
			for _, k := range kills {
				if k.Gateway != s.Gateway && servedDuring(s, k) {
					servedDuringKills++
					break
				}
			}
		case s.ErrEvent != "":
			errs++
		default:
			if _, ok := abortedBy(s, kills); ok {
				// What arrived before the crash must still be right.
				aborted++
				if want := reference(s.Prompt, s.Max); !strings.HasPrefix(want, s.Text) {
					v.fail("stream %d/%d (%s), cut by its gateway's crash, differs from the reference at byte %d:\n  got  %q\n  want %q", s.Client, s.N, s.Gateway, firstDiff(s.Text, want), s.Text, want)
				}
				continue
			}
			v.fail("stream %d/%d (%s) ended with neither [DONE] nor an error event after %d bytes: %s", s.Client, s.N, s.Gateway, len(s.Text), s.Err)
		}
	}
	if len(kills) > 0 && servedDuringKills == 0 {
		v.fail("%d gateway kills: no stream through another gateway was served (completed, or got a token) while one was down", len(kills))
	}
	v.Note = fmt.Sprintf("%d streams: %d complete and checked, %d ended with an explicit error, %d refused", len(streams), done, errs, refused)
	if len(kills) > 0 {
		v.Note += fmt.Sprintf("; %d gateway kills: %d streams aborted by their gateway's crash, %d completed on the others, served meanwhile", len(kills), aborted, servedDuringKills)
	}
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
// bookkeeping, replicated) for the Held placements whose checkpoints it
// holds, Stored what its checkpoint store reported holding (its load
// report).
type BudgetSample struct {
	At       int64
	Worker   string
	Reserved uint64
	Held     uint32
	Stored   uint64
	Budget   uint64
}

// CheckBudgets: no holder ever over its checkpoint budget, neither in the
// placement table's reservations nor in the bytes its store held; and no
// holder stores pages the placement table reserves nothing for. The two
// are in different units (a reservation is sized by the timing profile's KV
// bytes, a stored page is the real model's), so the second is stored ≤
// reserved + slack: slack covers the pages of the streams in flight, whose
// release reaches the holder after their Complete freed the reservation.
// Pages beyond it are pages the holder keeps for requests it no longer
// holds (moved, recomputed, re-dispatched): a leak that would fill its store.
func CheckBudgets(samples []BudgetSample, slack uint64) Verdict {
	v := Verdict{Checker: "budget", OK: true}
	peak, overReserved := uint64(0), 0
	for _, s := range samples {
		if s.Stored > s.Reserved+slack {
			overReserved++
			v.fail("%s: its store held %d bytes of checkpoints at %s, %d reserved on it for %d placements (slack %d): pages of requests it no longer holds", s.Worker, s.Stored, fmtNanos(s.At), s.Reserved, s.Held, slack)
		}
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
	v.Note = fmt.Sprintf("%d samples, peak %d%% of a budget; stored ≤ reserved + %d bytes", len(samples), peak, slack)
	return v
}

// Quiescence is the cluster once the clients have stopped, their open
// placements are completed and a dead gateway's session has expired:
// the placements left in the table and every worker's reservations and
// stored bytes, as last observed.
type Quiescence struct {
	Placements uint32 // ClusterStatus.placements
	Holders    []BudgetSample
	Workers    []WorkerQuiet
	// The most KV pages one worker's load report counted and the most
	// MIGRATING placements into one worker during the run (for the note).
	PeakKVPages     uint64
	PeakMigratingIn uint32
	Waited          time.Duration // how long it was waited for
	Err             string        // the last observation failed
}

// Quiet reports whether nothing is left: no placement, and every holder
// reserves and stores nothing.
func (q Quiescence) Quiet() bool {
	if q.Err != "" || q.Placements != 0 || len(q.Holders) == 0 {
		return false
	}
	for _, h := range q.Holders {
		if h.Reserved != 0 || h.Held != 0 || h.Stored != 0 {
			return false
		}
	}
	for _, w := range q.Workers {
		if w.leak() != "" {
			return false
		}
	}
	return true
}

// WorkerQuiet is what a worker holds once nothing runs: the requests and
// KV pages its last load report counted (pre-allocations for requests
// migrating in are engine sequences, so their pages are in KVPages), the
// MIGRATING placements the table has out of and into it, and what its
// metrics say of migrations under way (lumen_worker_migrations: out,
// requests of its own; in, pre-allocations it holds).
type WorkerQuiet struct {
	Worker            string
	Reported          bool // a load report was in the table
	Running, Waiting  uint32
	KVPages           uint64
	TableOut, TableIn uint32
	LiveOut, LiveIn   float64
	ScrapeErr         string
}

// leak says what the worker still holds, or "".
func (w WorkerQuiet) leak() string {
	var what []string
	if !w.Reported {
		what = append(what, "no load report")
	}
	if w.Running != 0 || w.Waiting != 0 {
		what = append(what, fmt.Sprintf("%d running and %d waiting requests", w.Running, w.Waiting))
	}
	if w.KVPages != 0 {
		what = append(what, fmt.Sprintf("%d KV pages in use", w.KVPages))
	}
	if w.TableOut != 0 || w.TableIn != 0 {
		what = append(what, fmt.Sprintf("%d MIGRATING placements out of it and %d into it", w.TableOut, w.TableIn))
	}
	if w.ScrapeErr != "" {
		what = append(what, "metrics unread: "+w.ScrapeErr)
	} else if w.LiveOut != 0 || w.LiveIn != 0 {
		what = append(what, fmt.Sprintf("%g migrations out under way and %g pre-allocations for migrations in", w.LiveOut, w.LiveIn))
	}
	return strings.Join(what, "; ")
}

// CheckNoLeak: after quiescence no placement survives (a dead gateway's
// placements end with its session; a gateway's Complete is never dropped),
// every holder's stored bytes match its reservations: both zero, and no
// worker holds a KV page, a request, a migration under way or a
// pre-allocation for one (nothing runs: every page held is a leak).
func CheckNoLeak(q Quiescence) Verdict {
	v := Verdict{Checker: "no-leak", OK: true}
	v.Note = fmt.Sprintf("after %s: %d placements, %d holders", q.Waited.Round(100*time.Millisecond), q.Placements, len(q.Holders))
	switch {
	case q.Err != "":
		v.fail("the cluster did not answer: %s", q.Err)
		return v
	case len(q.Holders) == 0:
		v.fail("no worker in the workers table")
		return v
	}
	if q.Placements != 0 {
		v.fail("%d placements survive the clients (a gateway's placements outlive it, or a Complete was dropped)", q.Placements)
	}
	for _, h := range q.Holders {
		if h.Reserved != 0 || h.Held != 0 {
			v.fail("%s: %d bytes still reserved on it for %d placements", h.Worker, h.Reserved, h.Held)
		}
		if h.Stored != 0 {
			v.fail("%s: its store still holds %d bytes of checkpoints (%d reserved)", h.Worker, h.Stored, h.Reserved)
		}
	}
	for _, w := range q.Workers {
		if l := w.leak(); l != "" {
			v.fail("%s: %s", w.Worker, l)
		}
	}
	v.Note += fmt.Sprintf(", %d workers' KV pages and migrations (peaks during the run: %d KV pages, %d migrations into a worker)", len(q.Workers), q.PeakKVPages, q.PeakMigratingIn)
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
