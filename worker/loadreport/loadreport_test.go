package loadreport

import (
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

var t0 = time.Unix(1_700_000_000, 0)

// base is a worker with 40 requests, 1,000 of 10,000 KV pages free of
// the queue head's, q_w 50 ms, 10 of 100 GB of checkpoints stored.
func base() *pb.LoadRecord {
	return &pb.LoadRecord{WorkerId: "w1", Incarnation: 1, QueueWaitMs: 50, Running: 36, Waiting: 4,
		KvPagesTotal: 10000, KvPagesUsed: 8900, QueueHeadPages: 100,
		FreeCheckpointBytes: 90e9, StoredCheckpointBytes: 10e9}
}

func sent(rule Rule) *Reporter {
	r := New(rule)
	r.Sent(t0, base())
	return r
}

// TestThresholds: each field is reported exactly when it passes its
// stated threshold (DefaultRule), and not a step before.
func TestThresholds(t *testing.T) {
	rule := DefaultRule()
	cases := []struct {
		name   string
		edit   func(l *pb.LoadRecord)
		reason Reason
	}{
		{"nothing changed", func(l *pb.LoadRecord) {}, ReasonNone},
		{"one request finished", func(l *pb.LoadRecord) { l.Running-- }, ReasonNone},
		{"two finished (max(2, 5% of 40))", func(l *pb.LoadRecord) { l.Running -= 2 }, ReasonQueue},
		{"two more waiting", func(l *pb.LoadRecord) { l.Waiting += 2 }, ReasonQueue},
		{"one started, one finished", func(l *pb.LoadRecord) { l.Waiting--; l.Running++ }, ReasonNone},
		{"q_w +9.9 ms (20% of 50 is 10)", func(l *pb.LoadRecord) { l.QueueWaitMs = 59.9 }, ReasonNone},
		{"q_w +10 ms", func(l *pb.LoadRecord) { l.QueueWaitMs = 60 }, ReasonQueueWait},
		{"q_w -10 ms", func(l *pb.LoadRecord) { l.QueueWaitMs = 40 }, ReasonQueueWait},
		{"149 pages used (1.5% of 10,000 is 150)", func(l *pb.LoadRecord) { l.KvPagesUsed += 149 }, ReasonNone},
		{"150 pages used", func(l *pb.LoadRecord) { l.KvPagesUsed += 150 }, ReasonPages},
		{"150 pages freed", func(l *pb.LoadRecord) { l.KvPagesUsed -= 150 }, ReasonPages},
		{"queue head needs 150 more", func(l *pb.LoadRecord) { l.QueueHeadPages += 150 }, ReasonPages},
		{"the KV cache changed size", func(l *pb.LoadRecord) { l.KvPagesTotal++ }, ReasonPages},
		{"50 GB more stored (no threshold of its own)", func(l *pb.LoadRecord) {
			l.FreeCheckpointBytes -= 50e9
			l.StoredCheckpointBytes += 50e9
		}, ReasonNone},
		{"a new incarnation", func(l *pb.LoadRecord) { l.Incarnation++ }, ReasonFirst},
	}
	// Reaching zero, from a little: the worker went idle.
	idle := []struct {
		name   string
		edit   func(l *pb.LoadRecord)
		reason Reason
	}{
		{"no KV page used any more", func(l *pb.LoadRecord) { l.KvPagesUsed = 0 }, ReasonPages},
		{"no checkpoint stored any more", func(l *pb.LoadRecord) {
			l.FreeCheckpointBytes += l.StoredCheckpointBytes
			l.StoredCheckpointBytes = 0
		}, ReasonCheckpoint},
	}
	for _, c := range idle {
		t.Run(c.name, func(t *testing.T) {
			last := base()
			last.Running, last.Waiting, last.QueueHeadPages, last.KvPagesUsed = 0, 0, 0, 3
			last.FreeCheckpointBytes, last.StoredCheckpointBytes = 100e9-1e6, 1e6
			r := New(rule)
			r.Sent(t0, last)
			cur := base()
			cur.Running, cur.Waiting, cur.QueueHeadPages, cur.KvPagesUsed = 0, 0, 0, 3
			cur.FreeCheckpointBytes, cur.StoredCheckpointBytes = 100e9-1e6, 1e6
			c.edit(cur)
			if reason, _ := r.Due(t0, cur); reason != c.reason {
				t.Fatalf("Due = %q, want %q", reason, c.reason)
			}
		})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cur := base()
			c.edit(cur)
			reason, due := sent(rule).Due(t0.Add(time.Second), cur)
			if reason != c.reason || due != (c.reason != ReasonNone) {
				t.Fatalf("Due = %q, %v; want %q", reason, due, c.reason)
			}
		})
	}
}

// TestCheckpointThreshold: with CheckpointFrac set, free checkpoint bytes
// are reported once they moved by that fraction of the budget.
func TestCheckpointThreshold(t *testing.T) {
	rule := DefaultRule()
	rule.CheckpointFrac = 0.05
	cur := base()
	cur.FreeCheckpointBytes -= 4.9e9 // 5% of 100 GB is 5
	cur.StoredCheckpointBytes += 4.9e9
	if reason, due := sent(rule).Due(t0, cur); due {
		t.Fatalf("4.9 of 100 GB reported (%s)", reason)
	}
	cur.FreeCheckpointBytes -= 0.1e9
	cur.StoredCheckpointBytes += 0.1e9
	if reason, _ := sent(rule).Due(t0, cur); reason != ReasonCheckpoint {
		t.Fatalf("5 of 100 GB: %q, want checkpoint", reason)
	}
}

// TestQueueFraction: at 500 requests the queue's threshold is 5% (25),
// not 2; with none, two requests.
func TestQueueFraction(t *testing.T) {
	r := New(DefaultRule())
	l := base()
	l.Running, l.Waiting = 256, 244
	r.Sent(t0, l)
	l.Waiting -= 24
	if reason, due := r.Due(t0, l); due {
		t.Fatalf("24 of 500 reported (%s): the threshold is 25", reason)
	}
	l.Waiting--
	if reason, _ := r.Due(t0, l); reason != ReasonQueue {
		t.Fatalf("25 of 500: %q, want queue", reason)
	}
	l.Running, l.Waiting = 0, 0
	r.Sent(t0, l)
	l.Running = 1
	if reason, due := r.Due(t0, l); due {
		t.Fatalf("1 of 0 reported (%s): the threshold is 2", reason)
	}
	l.Running = 2
	if reason, _ := r.Due(t0, l); reason != ReasonQueue {
		t.Fatalf("2 of 0 (requests the controller does not count): %q, want queue", reason)
	}
}

// TestAdmittedCountsAsPending: the controller counts a dispatch as pending
// on the worker until the next report, so an arrival that the worker's
// queue shows is no change, and a queue that did not grow while requests
// arrived (they finished as fast) is.
func TestAdmittedCountsAsPending(t *testing.T) {
	r := sent(DefaultRule())
	cur := base()
	cur.Waiting += 3
	r.Admitted(1000)
	r.Admitted(1000)
	r.Admitted(1000)
	// 3 admitted, 3 more waiting: what the controller counts; their
	// prompts prefilled, the pages it counts pending.
	cur.KvPagesUsed += 3 * policy.Pages(1000)
	if reason, due := r.Due(t0, cur); due {
		t.Fatalf("3 arrivals the controller counts as pending were reported (%s)", reason)
	}
	// Three admitted and three finished: the queue is as reported, the
	// controller's count three too high (5% of 43 is 2.15).
	r = sent(DefaultRule())
	r.Admitted(10)
	r.Admitted(10)
	if reason, due := r.Due(t0, base()); due {
		t.Fatalf("two arrivals that finished, 2 < 5%% of 42: reported (%s)", reason)
	}
	r.Admitted(10)
	if reason, _ := r.Due(t0, base()); reason != ReasonQueue {
		t.Fatalf("three arrivals that finished: %q, want queue (the controller counts 3 pending)", reason)
	}
}

// TestQueuedPagesAreThePending: requests admitted since the report that
// still wait are not news: the controller counts their pages pending, and
// the record counts them queued (freeness's numerator, QueuedPages). With
// the queue head's pages alone a queue forming made the pages look freed
// by every page of the requests behind the head, and was reported.
func TestQueuedPagesAreThePending(t *testing.T) {
	r := sent(DefaultRule())
	cur := base()
	cur.QueuedPages = 4 * 100 // the 4 waiting of the report, 100 pages each
	r.Sent(t0, cur)
	cur = proto.Clone(cur).(*pb.LoadRecord)
	for range 10 {
		r.Admitted(100 * 16)
		cur.Waiting++
		cur.QueuedPages += 100
	}
	if reason, due := r.Due(t0, cur); due && reason == ReasonPages {
		t.Fatalf("10 arrivals waiting, their pages pending at the controller and queued in the record: reported (%s)", reason)
	}
	old := proto.Clone(cur).(*pb.LoadRecord)
	old.QueuedPages = 0 // a worker that reports the head's pages alone
	if free, est := freePages(old), freePages(base())-float64(r.admittedPages); free-est < 0.015*10000 {
		t.Fatalf("the head's pages alone: free %.0f against the controller's %.0f, want the queue's pages apart", free, est)
	}
}

// TestAdmittedPages: the prompt pages of the requests admitted since the
// report are what the controller subtracts from the free pages.
func TestAdmittedPages(t *testing.T) {
	r := sent(DefaultRule())
	cur := base()
	cur.KvPagesUsed += 450 // prefilled: 450 pages, 50 beyond the 400 the controller counts pending
	r.Admitted(400 * 16)
	if reason, due := r.Due(t0, cur); due {
		t.Fatalf("450 pages used of which 400 the controller counts pending: reported (%s)", reason)
	}
	cur.KvPagesUsed += 100 // 150 beyond the pending pages: 1.5%
	if reason, _ := r.Due(t0, cur); reason != ReasonPages {
		t.Fatalf("150 pages beyond the pending ones: %q, want kv_pages", reason)
	}
}

// TestHeartbeat: an unchanged load is never reported again; a changed one
// below every threshold, or an admission since, is at the heartbeat.
func TestHeartbeat(t *testing.T) {
	rule := DefaultRule()
	r := sent(rule)
	late := t0.Add(rule.Heartbeat)
	if reason, due := r.Due(late.Add(time.Hour), base()); due {
		t.Fatalf("an unchanged load reported after an hour (%s)", reason)
	}
	cur := base()
	cur.QueueWaitMs++
	if _, due := r.Due(late.Add(-time.Nanosecond), cur); due {
		t.Fatal("a small change reported before the heartbeat")
	}
	if reason, _ := r.Due(late, cur); reason != ReasonHeartbeat {
		t.Fatalf("a small change at the heartbeat: %q, want heartbeat", reason)
	}
	r.Sent(late, cur)
	if _, due := r.Due(late.Add(rule.Heartbeat), cur); due {
		t.Fatal("reported again once sent")
	}
	r.Admitted(16)
	r.Admitted(16)
	r.Sent(late, cur)
	r.Admitted(16)
	// One admitted (below the queue's threshold of 2) and finished: the
	// load is as reported, but the controller holds a pending dispatch.
	if reason, _ := r.Due(late.Add(rule.Heartbeat), cur); reason != ReasonHeartbeat {
		t.Fatalf("an admission since the report, at the heartbeat: %q, want heartbeat", reason)
	}
}

// TestPeriodic: PeriodicRule reports every interval whatever changed, and
// before on a queue change of more than max(4, 10%).
func TestPeriodic(t *testing.T) {
	rule := PeriodicRule(250 * time.Millisecond)
	r := sent(rule)
	if _, due := r.Due(t0.Add(249*time.Millisecond), base()); due {
		t.Fatal("reported before the interval")
	}
	if reason, _ := r.Due(t0.Add(250*time.Millisecond), base()); reason != ReasonHeartbeat {
		t.Fatalf("at the interval: %q, want heartbeat", reason)
	}
	cur := base()
	cur.Waiting += 4
	if _, due := r.Due(t0, cur); due {
		t.Fatal("a queue change of 4 reported at once")
	}
	cur.Waiting++
	if reason, _ := r.Due(t0, cur); reason != ReasonQueue {
		t.Fatalf("a queue change of 5: %q, want queue", reason)
	}
}

// TestResetReportsAtOnce: after Reset (a new registration) the next check
// reports.
func TestResetReportsAtOnce(t *testing.T) {
	r := sent(DefaultRule())
	r.Reset()
	if reason, _ := r.Due(t0, base()); reason != ReasonFirst {
		t.Fatalf("after Reset: %q, want first", reason)
	}
}

func TestValidate(t *testing.T) {
	if err := DefaultRule().Validate(); err != nil {
		t.Fatal(err)
	}
	if err := PeriodicRule(time.Second).Validate(); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []Rule{{}, {Heartbeat: time.Second, QueueMin: -1}, {Heartbeat: time.Second, PagesFrac: 1.5}} {
		if err := bad.Validate(); !errors.Is(err, ErrInvalidRule) {
			t.Errorf("%+v: %v, want ErrInvalidRule", bad, err)
		}
	}
}

// TestIdleRandomWalk: a worker whose load moves at random reports no more
// often than its changes, the controller's count (last report plus the
// admitted since) is never off by the thresholds after a check, and once
// the load stops moving the reports stop after at most one heartbeat.
func TestIdleRandomWalk(t *testing.T) {
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	rule := DefaultRule()
	r := New(rule)
	cur := base()
	now := t0
	var reported *pb.LoadRecord
	admitted := 0
	reports, changes := 0, 0
	check := func() {
		if _, due := r.Due(now, cur); due {
			r.Sent(now, cur)
			reported = cloneLoad(cur)
			admitted = 0
			reports++
		}
	}
	for range 10000 {
		now = now.Add(time.Duration(rng.IntN(100)) * time.Millisecond)
		switch rng.IntN(3) {
		case 0:
			cur.Waiting++
			r.Admitted(16)
			admitted++
		case 1:
			if cur.Running > 0 {
				cur.Running--
			}
		case 2:
			cur.KvPagesUsed = uint64(rng.IntN(int(cur.KvPagesTotal)))
		}
		changes++
		check()
		est := int(reported.Running+reported.Waiting) + admitted
		if d := est - int(cur.Running+cur.Waiting); d >= max(rule.QueueMin, int(rule.QueueFrac*float64(est))+1) || -d >= max(rule.QueueMin, int(rule.QueueFrac*float64(est))+1) {
			t.Fatalf("after a check the controller's queue %d is %d from the worker's %d", est, d, cur.Running+cur.Waiting)
		}
	}
	if reports > changes {
		t.Fatalf("%d reports for %d changes", reports, changes)
	}
	// Still: at most one more report (the heartbeat), then none.
	before := reports
	for range 100 {
		now = now.Add(time.Second)
		check()
	}
	if reports-before > 1 {
		t.Fatalf("%d reports in 100 s of an unchanging load, want at most 1", reports-before)
	}
}

func cloneLoad(l *pb.LoadRecord) *pb.LoadRecord { return proto.Clone(l).(*pb.LoadRecord) }

// Refused and Eager: a refusal reports at the next check, once; while
// eager, any change reports, and none without one.
func TestRefusedAndEager(t *testing.T) {
	r := New(DefaultRule())
	now := time.Unix(100, 0)
	rec := &pb.LoadRecord{WorkerId: "w", Incarnation: 1, Running: 10, KvPagesTotal: 1000, KvPagesUsed: 100}
	r.Sent(now, rec)
	one := proto.Clone(rec).(*pb.LoadRecord)
	one.Running = 11 // under the queue threshold
	if reason, due := r.Due(now, one); due {
		t.Fatalf("a change of one request is due (%s) before the rule says", reason)
	}
	r.Refused()
	if reason, due := r.Due(now, rec); !due || reason != ReasonRefused {
		t.Fatalf("after a refusal: %q %v, want due for %q", reason, due, ReasonRefused)
	}
	r.Sent(now, rec)
	if _, due := r.Due(now, rec); due {
		t.Fatal("the refusal is due again after its report")
	}
	r.Eager(true)
	if _, due := r.Due(now, rec); due {
		t.Fatal("eager with no change: due")
	}
	if reason, due := r.Due(now, one); !due || reason != ReasonDraining {
		t.Fatalf("eager, one request more: %q %v, want due for %q", reason, due, ReasonDraining)
	}
	r.Eager(false)
	if _, due := r.Due(now, one); due {
		t.Fatal("no longer eager: a change under the thresholds is due")
	}
}
