package gateway

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func committed(pl *pb.Placement) *pb.Event {
	return &pb.Event{Body: &pb.Event_Migration{Migration: &pb.Migration{Stage: pb.Migration_STAGE_COMMITTED, Placement: pl,
		FromWorker: "w1", ToWorker: pl.WorkerId}}}
}

func histCount(t *testing.T, g *Gateway, name string) uint64 {
	t.Helper()
	mfs, err := g.metrics.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			var n uint64
			for _, m := range mf.GetMetric() {
				n += m.GetHistogram().GetSampleCount()
			}
			return n
		}
	}
	return 0
}

func resumesBy(t *testing.T, g *Gateway, how string) float64 {
	t.Helper()
	var m dto.Metric
	if err := g.metrics.resumes.WithLabelValues(how).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// A live migration's switch: the source's last message names the
// destination's placement, and the gateway continues there at once with
// its journal (no controller read), with no gap and no repeated token; the
// client-visible downtime is recorded.
func TestMigrationSwitchFollowsTheSourcesLastMessage(t *testing.T) {
	r := newRig(t, 1, nil, nil)
	res := r.complete(t, 4)
	c1 := r.w["w1"].next(t)
	id := c1.req.RequestId
	c1.send(t, 0, 'a', false)
	c1.send(t, 1, 'b', false)
	before := r.fc.getPlacements.Load()
	c1.move(t, &pb.Placement{RequestId: id, WorkerId: "w2", Epoch: 2})
	c2 := r.w["w2"].next(t)
	if c2.req.Epoch != 2 || string(int32s(c2.req.Generated)) != "ab" {
		t.Fatalf("the destination's call: epoch %d, history %q; want 2 and \"ab\"", c2.req.Epoch, string(int32s(c2.req.Generated)))
	}
	if n := r.fc.getPlacements.Load() - before; n != 0 {
		t.Fatalf("the gateway read the placement %d times; the source's message carried it", n)
	}
	c2.send(t, 2, 'c', false)
	c2.send(t, 3, 'd', true)
	got := wait(t, res)
	if got.err != nil || !got.done || got.text.String() != "abcd" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
	if n := resumesBy(t, r.g, "migrated"); n != 1 {
		t.Fatalf("%v migration switches counted, want 1", n)
	}
	if n := histCount(t, r.g, "lumen_gateway_migration_downtime_seconds"); n != 1 {
		t.Fatalf("%d downtimes recorded, want 1", n)
	}
	// The gateway's own time: one accept-to-Generate per request (not per
	// call; the rig has no load table, so the controller placed it), one
	// token-to-write per token the client got.
	checkOwn(t, r.g, map[string]uint64{"accept_to_generate": 0, "accept_to_generate_via_controller": 1, "token_to_write": 4})
}

// checkOwn checks the observations of lumen_gateway_own_seconds by phase.
func checkOwn(t *testing.T, g *Gateway, want map[string]uint64) {
	t.Helper()
	for phase, w := range want {
		var m dto.Metric
		if err := g.metrics.own.WithLabelValues(phase).(prometheus.Metric).Write(&m); err != nil {
			t.Fatal(err)
		}
		if n := m.GetHistogram().GetSampleCount(); n != w {
			t.Errorf("lumen_gateway_own_seconds{phase=%q}: %d observations, want %d", phase, n, w)
		}
	}
}

// The commit's event may reach the gateway before the source's last
// tokens: the stream is cut, and the destination is called with the
// shorter journal (it delivers the missing tokens from the migrated
// history). A commit event no newer than the stream does not cut it.
func TestMigrationCommitEventCutsTheStream(t *testing.T) {
	r := newRig(t, 1, nil, nil)
	res := r.complete(t, 4)
	c1 := r.w["w1"].next(t)
	id := c1.req.RequestId
	c1.send(t, 0, 'a', false)
	idx := r.fc.publish(committed(&pb.Placement{RequestId: id, WorkerId: "w1", Epoch: 1}))
	waitFor(t, 10*time.Second, "the watcher to handle the stale commit", func() bool { return r.g.watched.Load() >= idx })
	c1.send(t, 1, 'b', false)
	waitFor(t, 10*time.Second, "the gateway to deliver two tokens", func() bool { return tokensOut(r.g) >= 2 })
	r.fc.publish(committed(&pb.Placement{RequestId: id, WorkerId: "w2", Epoch: 2}))
	c2 := r.w["w2"].next(t)
	if c2.req.Epoch != 2 || string(int32s(c2.req.Generated)) != "ab" {
		t.Fatalf("the destination's call: epoch %d, history %q; want 2 and \"ab\"", c2.req.Epoch, string(int32s(c2.req.Generated)))
	}
	c2.send(t, 2, 'c', false)
	c2.send(t, 3, 'd', true)
	got := wait(t, res)
	if got.err != nil || !got.done || got.text.String() != "abcd" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
	if n := resumesBy(t, r.g, "migrated"); n != 1 {
		t.Fatalf("%v migration switches counted, want 1", n)
	}
}
