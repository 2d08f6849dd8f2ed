package servingstats

import (
	"errors"
	"testing"
	"time"
)

const ms1 = time.Millisecond

func TestRecordFigures(t *testing.T) {
	r := &Record{Arrival: 100 * ms1, Chunks: []time.Duration{150 * ms1, 160 * ms1, 170 * ms1, 180 * ms1}, Tokens: 4}
	if d, _ := r.TTFT(); d != 50*ms1 {
		t.Fatalf("TTFT %s", d)
	}
	if d, _ := r.TPOT(); d != 10*ms1 {
		t.Fatalf("TPOT %s", d)
	}
	// Failure at 1000 ms: two chunks already in flight arrive at 1001 and
	// 1002 ms, then the resumed stream continues at 1300 ms.
	r = &Record{Chunks: []time.Duration{990 * ms1, 1001 * ms1, 1002 * ms1, 1300 * ms1, 1310 * ms1}, Tokens: 5}
	if d, ok := r.Resume(1000 * ms1); !ok || d != 300*ms1 {
		t.Fatalf("resume %s %v, want 300ms", d, ok)
	}
	// No token before the failure: the first token is the resume.
	r = &Record{Arrival: 990 * ms1, Chunks: []time.Duration{1400 * ms1, 1410 * ms1}, Tokens: 2}
	if d, ok := r.Resume(1000 * ms1); !ok || d != 400*ms1 {
		t.Fatalf("resume %s %v, want 400ms", d, ok)
	}
	r = &Record{Chunks: []time.Duration{900 * ms1}, Tokens: 1}
	if _, ok := r.Resume(1000 * ms1); ok {
		t.Fatal("a request finished before the failure resumed")
	}
	if _, ok := r.TPOT(); ok {
		t.Fatal("TPOT of one token")
	}
}

func TestPercentileAndMean(t *testing.T) {
	var xs []time.Duration
	for i := 1; i <= 100; i++ {
		xs = append(xs, time.Duration(i)*ms1)
	}
	if p := Percentile(xs, 0.99); p != 99 {
		t.Fatalf("p99 %v", p)
	}
	if p := Percentile(xs, 0.5); p != 50 {
		t.Fatalf("p50 %v", p)
	}
	if m := Mean(xs); m != 50.5 {
		t.Fatalf("mean %v", m)
	}
	if Mean(nil) != 0 || Percentile(nil, 0.5) != 0 {
		t.Fatal("empty input")
	}
}

// TestRecoveryTime: a run whose TTFT triples after the failure and comes
// back to within 10% of the reference 12 s later, with a blip at 6 s that
// must not count as recovered.
func TestRecoveryTime(t *testing.T) {
	rule := RecoveryRule{Window: 2 * time.Second, Step: time.Second, Tolerance: 0.1, QueueSlack: 1}
	var run, ref []*Record
	var qRun, qRef []Sample
	for i := 0; i < 300; i++ { // 10 requests a second for 30 s
		at := time.Duration(i) * 100 * ms1
		ttft := 100 * ms1
		ref = append(ref, &Record{Arrival: at, Chunks: []time.Duration{at + ttft}})
		switch {
		case at >= 12*time.Second: // recovered (5% above the reference)
			ttft = 105 * ms1
		case at >= 6*time.Second && at < 7*time.Second: // a blip of normal
		default:
			ttft = 300 * ms1
		}
		run = append(run, &Record{Arrival: at, Chunks: []time.Duration{at + ttft}})
	}
	for at := time.Duration(0); at < 30*time.Second; at += 250 * ms1 {
		qRef = append(qRef, Sample{at, 2})
		w := 2.0
		if at < 10*time.Second {
			w = 40 // the queue drains 2 s before TTFT recovers
		}
		qRun = append(qRun, Sample{at, w})
	}
	a := Levels(run, qRun, 0, 30*time.Second, rule)
	b := Levels(ref, qRef, 0, 30*time.Second, rule)
	d, ok := RecoveryTime(a, b, rule)
	if !ok || d != 12*time.Second {
		t.Fatalf("recovery %s %v, want 12s", d, ok)
	}
	// Never back: TTFT stays 3× to the end.
	for _, r := range run {
		r.Chunks[0] = r.Arrival + 300*ms1
	}
	a = Levels(run, qRef, 0, 30*time.Second, rule)
	if d, ok := RecoveryTime(a, b, rule); ok || d != 30*time.Second {
		t.Fatalf("unrecovered run: %s %v, want 30s false", d, ok)
	}
	// The queue alone keeps it out: 1.1 × 2 + 1 = 3.2 < 4.
	for _, r := range run {
		r.Chunks[0] = r.Arrival + 100*ms1
	}
	var q4 []Sample
	for _, s := range qRef {
		q4 = append(q4, Sample{s.At, 4})
	}
	if _, ok := RecoveryTime(Levels(run, q4, 0, 30*time.Second, rule), b, rule); ok {
		t.Fatal("a queue twice the reference's counted as recovered")
	}
}

// TestRecoveryTTFTSlack checks that a window within the TTFT slack of the
// reference counts as normal, and one beyond it does not.
func TestRecoveryTTFTSlack(t *testing.T) {
	ref := []Level{{TTFT: 100, Requests: 10}, {TTFT: 110, Requests: 10}, {TTFT: 100, Requests: 10}}
	run := []Level{{TTFT: 400, Requests: 10}, {TTFT: 135, Requests: 10}, {TTFT: 105, Requests: 10}}
	rule := RecoveryRule{Step: time.Second, Window: time.Second, Tolerance: 0.10, QueueSlack: 1}
	if d, ok := RecoveryTime(run, ref, rule); !ok || d != 2*time.Second {
		t.Errorf("without slack: %v %v, want 2s (135 ms is beyond 110 ms + 10%%)", d, ok)
	}
	rule.TTFTSlack = 20 * time.Millisecond
	if d, ok := RecoveryTime(run, ref, rule); !ok || d != time.Second {
		t.Errorf("with 20 ms slack: %v %v, want 1s (135 <= 121 + 20; 400 > 130)", d, ok)
	}
	if r := DefaultRecoveryRule(10, 15*time.Millisecond); r.Window != 10*time.Second || r.TTFTSlack != 30*time.Millisecond {
		t.Errorf("DefaultRecoveryRule(10/s, 15 ms) = %+v, want a 10 s window (100 arrivals) and 30 ms slack", r)
	}
}

// TestResumeIgnoresLaterStalls checks that a pause starting well after the
// failure (an ordinary stall of the resumed request) is not taken for its
// resume, while a token in flight at the failure does not end the resume.
func TestResumeIgnoresLaterStalls(t *testing.T) {
	s := func(ms int) time.Duration { return time.Duration(ms) * time.Millisecond }
	// Failure at 2000 ms: a chunk in flight lands at 2002, the resume at
	// 2100, then decoding every 20 ms, then a 300 ms stall at 3000.
	r := &Record{Chunks: []time.Duration{s(1000), s(1990), s(2002), s(2100)}}
	for c := 2120; c <= 3000; c += 20 {
		r.Chunks = append(r.Chunks, s(c))
	}
	r.Chunks = append(r.Chunks, s(3300))
	if d, ok := r.Resume(s(2000)); !ok || d != s(100) {
		t.Errorf("Resume = %v %v, want 100ms (the pause from the in-flight chunk to 2100)", d, ok)
	}
}

// TestAffected: a request counts when it arrived in [From, To) or was
// interrupted, whenever it arrived.
func TestAffected(t *testing.T) {
	w := Window{From: 5 * time.Second, To: 8 * time.Second}
	for _, c := range []struct {
		name string
		rec  Record
		want bool
	}{
		{"before the failure", Record{Arrival: 4 * time.Second}, false},
		{"at the failure", Record{Arrival: 5 * time.Second}, true},
		{"inside", Record{Arrival: 7 * time.Second}, true},
		{"at the end of recovery", Record{Arrival: 8 * time.Second}, false},
		{"after", Record{Arrival: 9 * time.Second}, false},
		{"interrupted, arrived before", Record{Arrival: time.Second, Interrupted: true}, true},
		{"interrupted, arrived after", Record{Arrival: 9 * time.Second, Interrupted: true}, true},
		{"failed, inside", Record{Arrival: 6 * time.Second, Err: errTest}, true},
	} {
		if got := Affected([]*Record{&c.rec}, w)[0]; got != c.want {
			t.Errorf("%s (arrival %s): affected %v, want %v", c.name, c.rec.Arrival, got, c.want)
		}
	}
	if got := Affected(nil, w); len(got) != 0 {
		t.Fatalf("no records: %v", got)
	}
	// An empty window (a failure-free run) leaves the interrupted only:
	// none there.
	if got := Affected([]*Record{{Arrival: 6 * time.Second}}, Window{}); got[0] {
		t.Fatal("an empty window holds an arrival")
	}
}

var errTest = errors.New("HTTP 503")
