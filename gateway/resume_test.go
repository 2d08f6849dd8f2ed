package gateway

import (
	"errors"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// A PlacementMoved event that is not newer than the running stream (a late
// event from a lagging replica, or one delivered again after a reconnect)
// must not cut it; a newer one cuts it, and the request continues where the
// event says without asking the controller again.
func TestMoveEventsAreFencedByEpoch(t *testing.T) {
	r := newRig(t, 1, nil, nil)
	res := r.complete(t, 4)
	c1 := r.w["w1"].next(t)
	if c1.req.Epoch != 1 {
		t.Fatalf("Generate carried epoch %d, want the placement's 1", c1.req.Epoch)
	}
	id := c1.req.RequestId
	c1.send(t, 0, 'a', false)

	// The move that put the request here, arriving late.
	idx := r.fc.publish(moved(&pb.Placement{RequestId: id, WorkerId: "w1", Epoch: 1}))
	waitFor(t, 10*time.Second, "the watcher to handle the stale event", func() bool { return r.g.watched.Load() >= idx })
	c1.send(t, 1, 'b', false)
	waitFor(t, 10*time.Second, "the gateway to deliver two tokens", func() bool { return tokensOut(r.g) >= 2 })

	// A real move: to w2 at epoch 2. GetPlacement still answers epoch 1
	// (a lagging replica): the event's placement is what counts.
	before := r.fc.getPlacements.Load()
	r.fc.publish(moved(&pb.Placement{RequestId: id, WorkerId: "w2", Epoch: 2}))
	c2 := r.w["w2"].next(t)
	if c2.req.Epoch != 2 || string(int32s(c2.req.Generated)) != "ab" {
		t.Fatalf("resumed call: epoch %d, history %q; want epoch 2 and \"ab\"", c2.req.Epoch, string(int32s(c2.req.Generated)))
	}
	if n := r.fc.getPlacements.Load() - before; n != 0 {
		t.Fatalf("the gateway asked GetPlacement %d times after a move event carried the placement", n)
	}
	// The old epoch's event again, and the new one again: neither cuts w2.
	r.fc.publish(moved(&pb.Placement{RequestId: id, WorkerId: "w1", Epoch: 1}))
	idx = r.fc.publish(moved(&pb.Placement{RequestId: id, WorkerId: "w2", Epoch: 2}))
	waitFor(t, 10*time.Second, "the watcher to handle the repeats", func() bool { return r.g.watched.Load() >= idx })
	c2.send(t, 2, 'c', false)
	c2.send(t, 3, 'd', true)
	got := wait(t, res)
	if got.err != nil || !got.done || got.text.String() != "abcd" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
}

func int32s(ids []int32) []byte {
	b := make([]byte, len(ids))
	for i, id := range ids {
		b[i] = byte(id)
	}
	return b
}

// A request whose resumes never make progress ends with an explicit error
// once ResumeTimeout has passed since the break, however many attempts it
// took; each attempt does not get a budget of its own.
func TestResumeHasOneDeadline(t *testing.T) {
	r := newRig(t, 1, func(c *Config) { c.ResumeTimeout = 300 * time.Millisecond }, nil)
	r.fc.nextEpoch = true // every GetPlacement answers "moved": each attempt starts at once
	res := r.complete(t, 4)
	c1 := r.w["w1"].next(t)
	c1.send(t, 0, 'a', false)
	r.w["w1"].breakAll.Store(true)
	start := time.Now()
	c1.out <- &pb.GenerateResponse{Token: 'a', Index: 0} // a repeat: not progress
	<-c1.sent
	// Break the call: the gateway resumes, and every attempt breaks at once.
	c1.out <- &pb.GenerateResponse{Token: 'z', Index: 5} // a gap
	<-c1.sent
	got := wait(t, res)
	took := time.Since(start)
	if got.code != "resume_timeout" || !strings.Contains(got.errMsg, "was not resumed within 300ms") {
		t.Fatalf("client got %q, error %q (code %q), err %v; want a resume_timeout error event", got.text.String(), got.errMsg, got.code, got.err)
	}
	if got.text.String() != "a" {
		t.Fatalf("text before the error %q, want \"a\"", got.text.String())
	}
	if took > 10*time.Second {
		t.Fatalf("the error came after %s", took)
	}
	t.Logf("error after %s and %d GetPlacement calls: %s", took, r.fc.getPlacements.Load(), got.errMsg)
}

// A worker that stops answering mid-stream (SIGSTOP: the connection stays
// open, nothing comes back) is noticed by the connection's keepalive, and
// the request resumes where the controller then places it.
func TestPausedWorkerIsNoticed(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out gRPC's 10 s keepalive floor")
	}
	var p *pauser
	r := newRig(t, 1, func(c *Config) { c.KeepaliveTimeout = 500 * time.Millisecond },
		func(addr string) string { p = newPauser(t, addr); return p.lis.Addr().String() })
	res := r.complete(t, 3)
	c1 := r.w["w1"].next(t)
	c1.send(t, 0, 'a', false)
	waitFor(t, 10*time.Second, "the token to reach the gateway", func() bool { return tokensOut(r.g) >= 1 })
	p.pause()
	r.fc.setPlacement(&pb.Placement{RequestId: c1.req.RequestId, WorkerId: "w2", Epoch: 2})
	start := time.Now()
	c2 := r.w["w2"].next(t)
	t.Logf("the paused worker was noticed after %s", time.Since(start))
	if string(int32s(c2.req.Generated)) != "a" {
		t.Fatalf("resumed with history %q", string(int32s(c2.req.Generated)))
	}
	c2.send(t, 1, 'b', false)
	c2.send(t, 2, 'c', true)
	if got := wait(t, res); got.err != nil || !got.done || got.text.String() != "abc" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
}

// A watched replica that loses its leader (cut off from the quorum: its
// stream goes silent) is left for another, whose events then arrive.
func TestWatchMovesOffReplicaWithoutLeader(t *testing.T) {
	r := newRig(t, 2, func(c *Config) { c.WatchProbeInterval = 50 * time.Millisecond }, nil)
	res := r.complete(t, 2)
	c1 := r.w["w1"].next(t)
	c1.send(t, 0, 'a', false)
	waitFor(t, 10*time.Second, "the gateway to deliver the token", func() bool { return tokensOut(r.g) >= 1 })
	// Whichever replica the watcher follows, the first goes silent; the
	// watcher starts on it (the first address).
	r.rep[0].stalled.Store(true)
	r.fc.publish(moved(&pb.Placement{RequestId: c1.req.RequestId, WorkerId: "w2", Epoch: 2}))
	c2 := r.w["w2"].next(t)
	c2.send(t, 1, 'b', true)
	if got := wait(t, res); got.err != nil || !got.done || got.text.String() != "ab" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
}

// A move committed while the move watch was away, on a replica that no
// longer keeps the events it missed (OutOfRange: the watch starts again
// from now), still moves the request: the watch reads the placements of
// the requests in flight when it starts. The worker stream never breaks,
// so nothing else would.
func TestMoveMissedAcrossOutOfRangeIsApplied(t *testing.T) {
	r := newRig(t, 1, func(c *Config) { c.WatchProbeInterval = 50 * time.Millisecond }, nil)
	res := r.complete(t, 2)
	c1 := r.w["w1"].next(t)
	c1.send(t, 0, 'a', false)
	waitFor(t, 10*time.Second, "the gateway to deliver the token", func() bool { return tokensOut(r.g) >= 1 })
	r.rep[0].stalled.Store(true)
	waitFor(t, 10*time.Second, "the watch to leave the replica", func() bool { return r.fc.watching.Load() == 0 })
	to := &pb.Placement{RequestId: c1.req.RequestId, WorkerId: "w2", Epoch: 2}
	r.fc.setPlacement(to)
	r.fc.publish(moved(to))
	r.fc.compact()
	r.rep[0].stalled.Store(false)
	var c2 *call
	select {
	case c2 = <-r.w["w2"].calls:
	case <-time.After(10 * time.Second):
		t.Fatal("the request was not moved to w2: the watch missed the move committed while it was away")
	}
	if c2.req.Epoch != 2 || c2.req.RequestId != c1.req.RequestId {
		t.Fatalf("moved as %s at epoch %d, want %s at 2", c2.req.RequestId, c2.req.Epoch, c1.req.RequestId)
	}
	c2.send(t, 1, 'b', true)
	if got := wait(t, res); got.err != nil || !got.done || got.text.String() != "ab" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
}

// A handler that finished gives its admission slot back before it waits on
// the completion flusher: a flusher held up by the controller does not turn
// new requests away with 429.
func TestFinishedRequestFreesSlotBeforeFlush(t *testing.T) {
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
	c := r.w["w1"].next(t)
	c.send(t, 0, 'a', true)
	if got := wait(t, res); got.err != nil || !got.done {
		t.Fatalf("client got %q done=%v err=%v", got.text.String(), got.done, got.err)
	}
	waitFor(t, 2*time.Second, "the admission slot to be free", func() bool { return len(r.g.admit) == 0 })
}

// Close waits for the goroutine that reports an unreachable worker; it does
// not outlive the gateway.
func TestCloseWaitsForUnreachableReport(t *testing.T) {
	r := newRig(t, 1, nil, nil)
	r.fc.reportGate = make(chan struct{}) // never answers
	r.g.reportUnreachable("w1", errors.New("stream broke"))
	waitFor(t, 10*time.Second, "the report to reach the controller", func() bool { return r.fc.reports.Load() > 0 })
	r.g.Close()
	r.g.mu.Lock()
	running := r.g.reporting["w1"]
	r.g.mu.Unlock()
	if running {
		t.Fatal("the report goroutine is still running after Close")
	}
}

// tokensOut is how many tokens the gateway has delivered to clients.
func tokensOut(g *Gateway) float64 {
	var m dto.Metric
	if err := g.metrics.tokens.Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}
