package worker

import (
	"context"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/loadreport"
)

// reportsSent is the load reports the worker has had committed, and of
// them those sent because its incarnation was seen marked failed.
func reportsSent(w *Worker) (all, markedFailed int) {
	for _, r := range append(loadreport.Reasons, reasonMarkedFailed) {
		var m dto.Metric
		if err := w.metrics.loadReports.WithLabelValues(string(r)).Write(&m); err != nil {
			panic(err)
		}
		n := int(m.GetCounter().GetValue())
		all += n
		if r == reasonMarkedFailed {
			markedFailed = n
		}
	}
	return all, markedFailed
}

// TestIdleWorkerWritesNoLoadReports (issue 26): a worker reports its load
// when it registers and after serving a request (the controller counts
// the dispatch pending until a report), then, idle, writes nothing
// however many times it checks; marked failed while it runs on, it learns
// it from its event watch, not from a report it would never send, and
// rejoins as a new incarnation.
func TestIdleWorkerWritesNoLoadReports(t *testing.T) {
	addr, ctl := startController(t)
	h := start(t, 256, func(c *Config) {
		syntheticTarget(c)
		c.Controllers = []string{addr}
		c.LoadInterval = 5 * time.Millisecond
		c.LoadRule.Heartbeat = 50 * time.Millisecond
	})
	w := h.w
	waitUntil(t, 20*time.Second, "the first load report", func() bool { n, _ := reportsSent(w); return n >= 1 })
	first, _ := reportsSent(w)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, _, err := h.generate(ctx, &pb.GenerateRequest{RequestId: "r1", Prompt: []int32{1, 2, 3, 4, 5}, MaxTokens: 4}); err != nil {
		t.Fatal(err)
	}
	// One request, then none: the controller counts it pending until a
	// report says the queue is empty again.
	waitUntil(t, 10*time.Second, "a report after the request", func() bool { n, _ := reportsSent(w); return n > first })
	// The load settles (the request's pages freed, q_w the request's
	// wait): at most one more report for that.
	waitUntil(t, 10*time.Second, "the load to settle", func() bool {
		n, _ := reportsSent(w)
		w.reportMu.Lock()
		defer w.reportMu.Unlock()
		_, due := w.reporter.Due(time.Now().Add(time.Hour), w.Load())
		after, _ := reportsSent(w)
		return !due && n == after
	})
	settled, _ := reportsSent(w)
	checks := w.loadChecks.Load()
	waitUntil(t, 30*time.Second, "100 more checks of the idle load", func() bool { return w.loadChecks.Load() >= checks+100 })
	if n, _ := reportsSent(w); n != settled {
		t.Fatalf("an idle worker sent %d load reports in 100 checks, 20+ heartbeats: want none", n-settled)
	}

	inc := w.Incarnation()
	if _, err := ctl.SetWorkerPhase(ctx, &pb.SetWorkerPhaseRequest{WorkerId: w.cfg.ID, Incarnation: inc,
		Phase: pb.WorkerPhase_WORKER_PHASE_FAILED, Reason: "test: marked failed while the process runs on"}); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 20*time.Second, "the idle worker to rejoin as a new incarnation", func() bool {
		r := row(t, ctl, w.cfg.ID)
		return r != nil && r.Incarnation > inc && r.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE
	})
	if _, mf := reportsSent(w); mf != 0 {
		// The refused report is not counted as sent; a forced one that
		// went through would mean the fsm took a FAILED incarnation's load.
		t.Fatalf("%d marked_failed reports committed", mf)
	}
}
