package ctlclient

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// MaxGetPlacements is the most ids one GetPlacements call carries; the
// client splits longer lists.
const MaxGetPlacements = 4096

// WatchLoad follows the load table until ctx ends: it opens WatchLoad on a
// replica (any: each serves its own applied state) and calls fn with every
// table, in order, as Watch does: it moves to the next replica when the
// stream breaks, or when the replica fails its probe every probe interval
// (0: DefaultProbeInterval) — a paused replica or a silently dropped
// connection, whose stream goes quiet, or one cut off from the quorum,
// whose table no longer changes: either would leave the caller choosing
// from a frozen table, dead workers still eligible in it. interval is the
// most often a table is sent (0: the controller's default, 10 ms; it is
// rounded to whole milliseconds, at least 1). A table after a reconnect
// may be older than the last one (a lagging replica): its applied_index
// says so (placer.Replica.Update ignores it). fn runs on WatchLoad's
// goroutine and must not block long. It returns ctx's error.
func (c *Client) WatchLoad(ctx context.Context, interval, probe time.Duration, fn func(*pb.LoadTable)) error {
	ms := uint32(0)
	if interval > 0 {
		ms = uint32(max(1, interval.Milliseconds()))
	}
	w := &Watch[pb.LoadTable]{Conns: c.conns, Start: int(c.next.Load()), ProbeInterval: probe, Deliver: fn,
		Open: func(ctx context.Context, cc *grpc.ClientConn, _ uint64) (grpc.ServerStreamingClient[pb.LoadTable], error) {
			return pb.NewControllerClient(cc).WatchLoad(ctx, &pb.WatchLoadRequest{IntervalMs: ms})
		}}
	return w.Run(ctx)
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
