package ctlclient

import (
	"context"
	"fmt"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// MaxGetPlacements is the most ids one GetPlacements call carries; the
// client splits longer lists.
const MaxGetPlacements = 4096

// WatchLoad follows the load table until ctx ends: it opens WatchLoad on a
// replica (any: each serves its own applied state), calls fn with every
// table, in order, and when the stream breaks reopens it on the next
// replica. interval is the most often a table is sent (0: the
// controller's default, 10 ms; it is rounded to whole milliseconds, at
// least 1). A table after a reconnect may be older than the last one (a
// lagging replica): its applied_index says so (placer.Replica.Update
// ignores it). fn runs on WatchLoad's goroutine and must not block long.
// It returns ctx's error.
func (c *Client) WatchLoad(ctx context.Context, interval time.Duration, fn func(*pb.LoadTable)) error {
	ms := uint32(0)
	if interval > 0 {
		ms = uint32(max(1, interval.Milliseconds()))
	}
	backoff := 20 * time.Millisecond
	for attempt := 0; ctx.Err() == nil; attempt++ {
		i := (int(c.next.Load()) + attempt) % len(c.conns)
		got := false
		stream, err := pb.NewControllerClient(c.conns[i]).WatchLoad(ctx, &pb.WatchLoadRequest{IntervalMs: ms})
		if err == nil {
			for {
				t, err := stream.Recv()
				if err != nil {
					break
				}
				got = true
				fn(t)
			}
		}
		if got {
			backoff = 20 * time.Millisecond
			continue // straight to the next replica
		}
		if (attempt+1)%len(c.conns) == 0 {
			select {
			case <-ctx.Done():
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, ReconnectMax)
		}
	}
	return ctx.Err()
}

// GetPlacements reads many placements (any number of ids: the client splits
// them into calls of at most MaxGetPlacements). Linearizable reads are
// served by the leader, and the ids of concurrent calls share one read
// round: each reflects every write acknowledged before the call began.
// Stale reads are served by whichever replica answers. Placements come in
// the order of the ids; ids without one are in NotFound; AppliedIndex is
// the lowest of the calls'.
func (c *Client) GetPlacements(ctx context.Context, req *pb.GetPlacementsRequest) (*pb.GetPlacementsResponse, error) {
	if len(req.RequestIds) <= MaxGetPlacements {
		return call(c, ctx, req, pb.ControllerClient.GetPlacements)
	}
	out := &pb.GetPlacementsResponse{}
	for start := 0; start < len(req.RequestIds); start += MaxGetPlacements {
		part := &pb.GetPlacementsRequest{RequestIds: req.RequestIds[start:min(start+MaxGetPlacements, len(req.RequestIds))],
			Consistency: req.Consistency}
		r, err := call(c, ctx, part, pb.ControllerClient.GetPlacements)
		if err != nil {
			return nil, fmt.Errorf("ctlclient: GetPlacements ids %d..%d: %w", start, start+len(part.RequestIds)-1, err)
		}
		out.Placements = append(out.Placements, r.Placements...)
		out.NotFound = append(out.NotFound, r.NotFound...)
		if out.AppliedIndex == 0 || r.AppliedIndex < out.AppliedIndex {
			out.AppliedIndex = r.AppliedIndex
		}
	}
	return out, nil
}
