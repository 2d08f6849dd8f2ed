// Package servingstats turns client-side records of streamed requests into
// the serving figures the recovery benchmark reports: TTFT, TPOT, the resume
// latency of interrupted requests and the cluster's recovery time.
//
// Every time is an offset from the start of the run on one monotonic clock.
package servingstats

import (
	"math"
	"sort"
	"time"
)

// Record is what a client saw of one streamed request.
type Record struct {
	ID      string        // the id the gateway gave it
	Arrival time.Duration // when it was sent
	Chunks  []time.Duration
	Tokens  int // output tokens, from the stream's usage
	Err     error
	// Interrupted: the request was running or queued on a worker when it
	// failed (a recovery plan moved it).
	Interrupted bool
}

// TTFT is the time from sending to the first token; ok is false when no
// token came.
func (r *Record) TTFT() (time.Duration, bool) {
	if len(r.Chunks) == 0 {
		return 0, false
	}
	return r.Chunks[0] - r.Arrival, true
}

// TPOT is the mean time per output token after the first; ok is false for
// fewer than two tokens.
func (r *Record) TPOT() (time.Duration, bool) {
	if r.Tokens < 2 || len(r.Chunks) < 2 {
		return 0, false
	}
	return (r.Chunks[len(r.Chunks)-1] - r.Chunks[0]) / time.Duration(r.Tokens-1), true
}

// ResumeGrace bounds when the pause a failure causes can start: tokens
// already in flight when the worker died still arrive just after it, then
// the stream pauses until the resume.
const ResumeGrace = 500 * time.Millisecond

// Resume is how long after a failure at `at` the request got its next token
// once resumed: the end of the longest pause between tokens that starts
// within ResumeGrace of the failure (the pause the failure caused; chunks
// already in flight when the worker died arrive just after it without a
// resume). Later pauses are the resumed request's ordinary stalls (a long
// prefill in its new batch) and are not the resume: with a fast resume they
// can be longer than it. A request with no token before the failure resumes
// at its first token. ok is false when no token came after the failure.
func (r *Record) Resume(at time.Duration) (time.Duration, bool) {
	prev := at
	best, bestEnd := time.Duration(-1), time.Duration(0)
	for i, c := range r.Chunks {
		if c <= at {
			continue
		}
		if i > 0 && r.Chunks[i-1] > at {
			prev = r.Chunks[i-1]
		}
		if prev > at+ResumeGrace {
			break
		}
		if gap := c - prev; gap > best {
			best, bestEnd = gap, c
		}
	}
	if best < 0 {
		return 0, false
	}
	return bestEnd - at, true
}

// Window is a span of arrival times, [From, To): the arrivals a failure
// touches are those from the failure to the end of the cluster's recovery.
type Window struct {
	From, To time.Duration
}

// Contains reports whether t falls in w.
func (w Window) Contains(t time.Duration) bool { return t >= w.From && t < w.To }

// Affected marks, by index, the records a failure touched: those that
// arrived in w, and every interrupted one, whenever it arrived.
func Affected(recs []*Record, w Window) []bool {
	out := make([]bool, len(recs))
	for i, r := range recs {
		out[i] = r.Interrupted || w.Contains(r.Arrival)
	}
	return out
}

// Mean returns the mean of xs in milliseconds (0 for none).
func Mean(xs []time.Duration) float64 {
	if len(xs) == 0 {
		return 0
	}
	var s time.Duration
	for _, x := range xs {
		s += x
	}
	return ms(s) / float64(len(xs))
}

// Percentile returns the p-quantile of xs (nearest rank) in milliseconds.
func Percentile(xs []time.Duration, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), xs...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	k := int(math.Ceil(p*float64(len(s)))) - 1
	return ms(s[min(max(k, 0), len(s)-1)])
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Sample is one reading of the cluster's queue length.
type Sample struct {
	At      time.Duration
	Waiting float64
}

// Level is the cluster's state over one window: mean TTFT of the requests
// that arrived in it, and mean queue length sampled in it.
type Level struct {
	TTFT, Queue float64 // ms, requests
	Requests    int
}

// RecoveryRule says when a window is back to normal: TTFT at most
// (1+Tolerance) × the reference's + TTFTSlack and queue length at most
// (1+Tolerance) × the reference's + QueueSlack.
type RecoveryRule struct {
	Window     time.Duration // 5 s
	Step       time.Duration // 250 ms
	Tolerance  float64       // 0.10
	QueueSlack float64       // 1 request: an idle cluster's queue is 0
	// TTFTSlack absorbs the noise between two runs whose dispatch diverged
	// (after a failure the same arrival lands on another worker, behind
	// another batch): two decode steps. Without it a failure that barely
	// moves TTFT (1 of 8 workers at 70% load) never "recovers": failure-free
	// windows of two such runs differ by ±15% (docs/benchmarks.md).
	TTFTSlack time.Duration
	// MinRequests: a window with fewer arrivals (the tail of the run, as
	// arrivals end) says nothing about TTFT; only its queue is compared.
	MinRequests int
}

// DefaultRecoveryRule is the rule of `lumen bench recovery` and `lumen
// sim` for a cluster offering rate requests/s whose decode step at the
// saturated batch takes step: 5 s windows holding at least 100 arrivals (so
// that one long prompt does not move a window's mean by 10% on its own),
// 250 ms apart, TTFT compared only over windows of at least 50 arrivals;
// 10% tolerance; slack of one queued request and two decode steps.
func DefaultRecoveryRule(rate float64, step time.Duration) RecoveryRule {
	rule := RecoveryRule{Window: 5 * time.Second, Step: 250 * time.Millisecond, Tolerance: 0.10, QueueSlack: 1, TTFTSlack: 2 * step, MinRequests: 50}
	if w := time.Duration(100 / rate * float64(time.Second)); w > rule.Window {
		rule.Window = w.Round(time.Second)
	}
	return rule
}

// Levels computes the windowed level at each step from `from` while the
// window fits before `end`.
func Levels(recs []*Record, queue []Sample, from, end time.Duration, rule RecoveryRule) []Level {
	var out []Level
	for t := from; t+rule.Window <= end; t += rule.Step {
		out = append(out, level(recs, queue, t, t+rule.Window))
	}
	return out
}

func level(recs []*Record, queue []Sample, a, b time.Duration) Level {
	var l Level
	var sum time.Duration
	for _, r := range recs {
		if r.Arrival >= a && r.Arrival < b {
			if d, ok := r.TTFT(); ok {
				sum += d
				l.Requests++
			}
		}
	}
	if l.Requests > 0 {
		l.TTFT = ms(sum) / float64(l.Requests)
	}
	n := 0
	for _, s := range queue {
		if s.At >= a && s.At < b {
			l.Queue += s.Waiting
			n++
		}
	}
	if n > 0 {
		l.Queue /= float64(n)
	}
	return l
}

// RecoveryTime compares a run with a failure at failAt against a
// failure-free reference run of the same seeded arrivals: window by window
// (the same requests arrive in the same window of both runs), the failed
// run is back to normal when its TTFT and queue length are within the rule
// of the reference's. The recovery time is from the failure to the start of
// the first window after which every window is back to normal, up to the
// last window that fits before end. recovered is false when the last window
// is still out of bounds; the time returned is then end − failAt.
func RecoveryTime(run, ref []Level, rule RecoveryRule) (d time.Duration, recovered bool) {
	n := min(len(run), len(ref))
	first := n // the first window of the final all-normal stretch
	for i := n - 1; i >= 0; i-- {
		ttftOK := run[i].Requests == 0 || run[i].Requests < rule.MinRequests || run[i].TTFT <= (1+rule.Tolerance)*ref[i].TTFT+float64(rule.TTFTSlack)/1e6
		queueOK := run[i].Queue <= (1+rule.Tolerance)*ref[i].Queue+rule.QueueSlack
		if !ttftOK || !queueOK {
			break
		}
		first = i
	}
	if first == n {
		return time.Duration(max(n-1, 0))*rule.Step + rule.Window, false
	}
	return time.Duration(first) * rule.Step, true
}
