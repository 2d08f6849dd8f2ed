package worker

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/kvpage"
)

// TestWatchKVWithoutACache: the daemon's core runs with the prefix cache
// off, so WatchKV sends one empty snapshot naming the worker, its
// incarnation and the page size, and keeps the stream open: the next
// Recv ends only when the caller cancels, never with EOF or
// Unimplemented (which a gateway would retry in a loop).
func TestWatchKVWithoutACache(t *testing.T) {
	h := start(t, 64, nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, err := h.cl.WatchKV(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	ev, err := stream.Recv()
	if err != nil {
		t.Fatalf("WatchKV: %v", err)
	}
	if !ev.Reset_ || ev.Seq != 1 || len(ev.Stored) != 0 || len(ev.Removed) != 0 {
		t.Fatalf("first message %+v: want an empty snapshot, seq 1", ev)
	}
	if ev.WorkerId != "w1" || ev.Incarnation != h.w.incarnation.Load() || ev.PageTokens != kvpage.Tokens {
		t.Fatalf("snapshot names worker %q incarnation %d, %d-token pages; want w1, %d, %d",
			ev.WorkerId, ev.Incarnation, ev.PageTokens, h.w.incarnation.Load(), kvpage.Tokens)
	}
	done := make(chan error, 1)
	go func() { _, err := stream.Recv(); done <- err }()
	cancel()
	if err := <-done; status.Code(err) != codes.Canceled {
		t.Fatalf("the stream ended with %v before the caller left; want it open until Canceled", err)
	}
}
