package worker

import (
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/kvpage"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// WatchKV is the worker's stream of prefix-cache events (issue 25), which
// the gateways' prefix index follows. The daemon runs its core with the
// prefix cache off (docs/architecture.md, "Prefix caching"): it holds no
// page for another request, so, as the protocol says of a worker without
// a cache, it sends one empty snapshot and keeps the stream open until the
// caller leaves or the worker stops. A gateway with -prefix-routing on
// therefore places by freeness alone against these workers, and finds no
// Unimplemented error to retry.
func (s *inferenceServer) WatchKV(_ *pb.WatchKVRequest, stream grpc.ServerStreamingServer[pb.KVEvents]) error {
	w := s.w
	snap := &pb.KVEvents{WorkerId: w.cfg.ID, Incarnation: w.incarnation.Load(), Seq: 1, Reset_: true,
		PageTokens: uint32(kvpage.Tokens)}
	if err := stream.Send(snap); err != nil {
		return err
	}
	select {
	case <-stream.Context().Done():
		return status.FromContextError(stream.Context().Err()).Err()
	case <-w.stop:
		return status.Error(codes.Unavailable, errShutdown.Error())
	}
}
