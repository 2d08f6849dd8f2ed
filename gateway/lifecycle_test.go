package gateway

import (
	"context"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// setOnDispatch installs fc's Dispatch hook.
func (fc *fakeController) setOnDispatch(f func(ctx context.Context, pl *pb.Placement) error) {
	fc.mu.Lock()
	defer fc.mu.Unlock()
	fc.onDispatch = f
}

// A Dispatch that commits after the gateway gave up on it (DispatchTimeout
// ran out, as in an election) still has its placement completed: the
// client got 503, and nothing else would ever complete it while the
// gateway's session lives.
func TestFailedDispatchIsCompleted(t *testing.T) {
	r := newRig(t, 1, func(c *Config) { c.DispatchTimeout = 200 * time.Millisecond }, nil)
	r.fc.setOnDispatch(func(ctx context.Context, _ *pb.Placement) error {
		<-ctx.Done() // placed, but the answer comes too late
		return ctx.Err()
	})
	got := wait(t, r.complete(t, 2))
	if got.err == nil || !strings.Contains(got.err.Error(), "status 503") {
		t.Fatalf("client got %v, want a 503", got.err)
	}
	ids := r.fc.dispatchedIDs()
	if len(ids) == 0 {
		t.Fatal("no Dispatch reached the controller")
	}
	waitFor(t, 10*time.Second, "the placed request to be completed", func() bool {
		return slices.Contains(r.fc.completedIDs(), ids[0])
	})
}

// An attempt a resume abandons (the request broke before its first token
// and is placed afresh) is completed after the handler gave its admission
// slot back: a flusher held up by the controller does not stall the resume
// of a request that holds a slot.
func TestAbandonedAttemptCompletedAfterSlotIsBack(t *testing.T) {
	r := newRig(t, 1, func(c *Config) { c.MaxConcurrent = 1 }, nil)
	r.fc.completeGate = make(chan struct{})
	defer close(r.fc.completeGate)
	// Hold the flusher in a Complete, then fill its queue.
	r.g.done <- "held"
	waitFor(t, 10*time.Second, "the flusher to call Complete", func() bool { return r.fc.completes.Load() > 0 })
	for full := false; !full; {
		select {
		case r.g.done <- "filler":
		default:
			full = true
		}
	}
	res := r.complete(t, 1)
	c1 := r.w["w1"].next(t)
	first := c1.req.RequestId
	// GetPlacement answers NotFound and a gap breaks the stream: the
	// request is placed afresh under a new attempt id.
	r.fc.forget(first)
	c1.out <- &pb.GenerateResponse{Token: 'z', Index: 3}
	<-c1.sent
	broke := time.Now()
	c2 := r.w["w1"].next(t)
	// The held Complete gives up after 5 s and the flusher then takes
	// from its queue again: a resume that waited on the queue comes after.
	if took := time.Since(broke); took > 4*time.Second || r.fc.completes.Load() != 1 {
		t.Fatalf("the request was placed afresh %s after the break, after %d Complete calls: it waited on the flusher", took, r.fc.completes.Load())
	}
	if c2.req.RequestId != first+"~1" {
		t.Fatalf("second attempt is %q, want %q", c2.req.RequestId, first+"~1")
	}
	c2.send(t, 0, 'a', true)
	if got := wait(t, res); got.err != nil || !got.done || got.text.String() != "a" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
	waitFor(t, 2*time.Second, "the admission slot to be free", func() bool { return len(r.g.admit) == 0 })
}

// A completion the flusher hands the Place stream before the controller
// answers Place with Unimplemented (the stream opens in the background,
// and under load the answer comes late) is sent unary after the answer:
// no stream would ever send it.
func TestCompleteBeforeUnimplementedIsSentUnary(t *testing.T) {
	r := newRigThen(t, 1, nil, nil, func(r *rig) { r.fc.placeGate = make(chan struct{}) })
	r.g.done <- "early"
	waitFor(t, 10*time.Second, "the Placer to queue the complete", func() bool {
		_, n := r.g.link.p.Pending()
		return n == 1
	})
	close(r.fc.placeGate)
	waitFor(t, 10*time.Second, "the early complete to reach the controller", func() bool {
		return slices.Contains(r.fc.completedIDs(), "early")
	})
	if _, n := r.g.link.p.Pending(); n != 0 {
		t.Fatalf("the Placer still holds %d completes", n)
	}
}

// A PlacementMoved event that the watcher handles before Dispatch has
// answered (the move committed right after the placement) is not lost: the
// first stream starts where the event says.
func TestMoveDuringDispatchIsKept(t *testing.T) {
	r := newRig(t, 1, nil, nil)
	r.fc.setOnDispatch(func(_ context.Context, pl *pb.Placement) error {
		idx := r.fc.publish(moved(&pb.Placement{RequestId: pl.RequestId, WorkerId: "w2", Epoch: 2}))
		waitFor(t, 10*time.Second, "the watcher to handle the move", func() bool { return r.g.watched.Load() >= idx })
		return nil
	})
	res := r.complete(t, 1)
	c := r.w["w2"].next(t)
	if c.req.Epoch != 2 {
		t.Fatalf("first stream at epoch %d, want the moved placement's 2", c.req.Epoch)
	}
	c.send(t, 0, 'a', true)
	if got := wait(t, res); got.err != nil || !got.done || got.text.String() != "a" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
}

// A request whose placement is gone after tokens were streamed (its
// session expired and the controller completed it) is placed afresh and
// continues from the journal: no error, no gap, no repeated token — not a
// wait until ResumeTimeout.
func TestLostPlacementContinuesFromJournal(t *testing.T) {
	r := newRig(t, 1, func(c *Config) { c.ResumeTimeout = 20 * time.Second }, nil)
	res := r.complete(t, 3)
	c1 := r.w["w1"].next(t)
	id := c1.req.RequestId
	c1.send(t, 0, 'a', false)
	c1.send(t, 1, 'b', false)
	waitFor(t, 10*time.Second, "two tokens to reach the client", func() bool { return tokensOut(r.g) >= 2 })
	r.fc.forget(id)
	start := time.Now()
	c1.out <- &pb.GenerateResponse{Token: 'z', Index: 7} // a gap breaks the stream
	<-c1.sent
	c2 := r.w["w1"].next(t)
	if c2.req.RequestId != id+"~1" || string(int32s(c2.req.Generated)) != "ab" {
		t.Fatalf("continued as %q with history %q; want %q with \"ab\"", c2.req.RequestId, string(int32s(c2.req.Generated)), id+"~1")
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("placed afresh after %s", took)
	}
	c2.send(t, 1, 'b', false) // a repeat the journal drops
	c2.send(t, 2, 'c', true)
	if got := wait(t, res); got.err != nil || !got.done || got.text.String() != "abc" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
	waitFor(t, 10*time.Second, "both attempts to be completed", func() bool {
		done := r.fc.completedIDs()
		return slices.Contains(done, id) && slices.Contains(done, id+"~1")
	})
}

// Close does not return while a handler still streams: past its grace it
// cuts the handler's connection and request, and waits for it before it
// ends the session and closes the clients the handler uses.
func TestCloseWaitsForHandlers(t *testing.T) {
	r := newRig(t, 1, nil, nil)
	res := r.complete(t, 4)
	c := r.w["w1"].next(t)
	c.send(t, 0, 'a', false)
	waitFor(t, 10*time.Second, "the token to reach the client", func() bool { return tokensOut(r.g) >= 1 })
	r.g.closeGrace = 100 * time.Millisecond
	r.g.Close()
	if n := len(r.g.admit); n != 0 {
		t.Fatalf("%d handlers still hold a slot after Close returned", n)
	}
	if !slices.Contains(r.fc.completedIDs(), c.req.RequestId) {
		t.Fatalf("the cut request %s was not completed before Close returned (completed %v)", c.req.RequestId, r.fc.completedIDs())
	}
	if got := wait(t, res); got.done {
		t.Fatalf("the cut stream ended as if complete: %q", got.text.String())
	}
}

// Dispatch failures say what failed: no controller session, no controller
// answering, no worker.
func TestDispatchErrorsSayWhy(t *testing.T) {
	g := newTestGateway(t, nil) // nobody answers at its controller address
	code, body := post(t, g.Handler(), "/v1/completions", `{"model":"lumen-tiny","prompt":"x","max_tokens":2}`)
	if e, _ := body["error"].(map[string]any); code != 503 || e["code"] != "no_controller_session" {
		t.Fatalf("no controller: %d %v, want 503 no_controller_session", code, body)
	}

	r := newRig(t, 1, func(c *Config) { c.DispatchTimeout = 200 * time.Millisecond }, nil)
	var refusing atomic.Bool // answer as the controller does when no worker serves
	refusing.Store(true)
	r.fc.setOnDispatch(func(ctx context.Context, _ *pb.Placement) error {
		if refusing.Load() {
			return status.Error(codes.FailedPrecondition, "fsm: no worker in full service")
		}
		<-ctx.Done()
		return ctx.Err()
	})
	got := wait(t, r.complete(t, 2))
	if got.err == nil || !strings.Contains(got.err.Error(), "status 503") || !strings.Contains(got.err.Error(), `"no_worker"`) {
		t.Fatalf("no worker: %v, want 503 no_worker", got.err)
	}
	refusing.Store(false)
	got = wait(t, r.complete(t, 2))
	if got.err == nil || !strings.Contains(got.err.Error(), `"controller_unavailable"`) {
		t.Fatalf("dispatch timed out: %v, want 503 controller_unavailable", got.err)
	}
}
