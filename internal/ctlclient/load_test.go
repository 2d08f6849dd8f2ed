package ctlclient

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// WatchLoad leaves a replica whose table stopped — one cut off from the
// quorum (no leader) or paused (no answer) — within the probe interval,
// and the tables of the next arrive: a frozen table would keep dead
// workers eligible. Before the shared watch, WatchLoad had no probe and
// stayed on the first replica for ever.
func TestWatchLoadLeavesSilentReplica(t *testing.T) {
	for _, tc := range []struct {
		name    string
		silence func(*fakeReplica)
	}{
		{"no leader", func(r *fakeReplica) { r.noLeader.Store(true) }},
		{"paused", func(r *fakeReplica) { r.paused.Store(true) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newFakeLog()
			l.setTable(&pb.LoadTable{AppliedIndex: 1, ControllerId: "c0"})
			reps, addrs := serveReplicas(t, l, 2)
			c, err := New(addrs, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			var applied atomic.Uint64
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() {
				done <- c.WatchLoad(ctx, 0, 50*time.Millisecond, func(t *pb.LoadTable) { applied.Store(t.AppliedIndex) })
			}()
			defer func() { cancel(); <-done }()
			waitFor(t, 10*time.Second, "the first table", func() bool { return applied.Load() == 1 })
			tc.silence(reps[0])
			l.setTable(&pb.LoadTable{AppliedIndex: 2, ControllerId: "c0"})
			waitFor(t, 10*time.Second, "the table from the second replica", func() bool { return applied.Load() == 2 })
		})
	}
}
