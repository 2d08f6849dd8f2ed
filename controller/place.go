package controller

// Issue 16's calls: the gateways' Place stream (placements and completions
// in batches, on the leader), WatchLoad (the load table a gateway chooses
// serving workers from, from any replica) and GetPlacements (batched
// reads; linearizable batches share one read round).

import (
	"context"
	"fmt"
	"io"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// DefaultWatchLoadInterval is WatchLoad's interval when the caller gives
// none.
const DefaultWatchLoadInterval = 10 * time.Millisecond

// notLeader is the Unavailable a leader-only stream ends with on a replica
// that does not lead (or is not ready, or lost leadership): the message
// and the ErrorInfo (ctlclient.ReasonNotLeader) name the leader's gRPC
// address when this replica knows it.
func (n *Node) notLeader(why string) error {
	_, id := n.raft.LeaderWithID()
	addr := ""
	if id != "" {
		addr = n.grpcAddrOf(string(id))
	}
	msg := fmt.Sprintf("controller %s %s: the Place stream is served by the leader only", n.cfg.NodeID, why)
	if addr != "" {
		msg += fmt.Sprintf("; the leader is %s at %s", id, addr)
	} else {
		msg += "; no leader is known yet"
	}
	info := &errdetails.ErrorInfo{Reason: ctlclient.ReasonNotLeader, Domain: ctlclient.ErrorDomain}
	if addr != "" {
		info.Metadata = map[string]string{ctlclient.MetaLeaderID: string(id), ctlclient.MetaLeaderAddr: addr}
	}
	st, err := status.New(codes.Unavailable, msg).WithDetails(info)
	if err != nil {
		return status.Error(codes.Unavailable, msg)
	}
	return st.Err()
}

// placeBatch is a received PlaceBatch on its way: its proposals (nil for a
// dispatch refused before proposing, whose refusal is in refused) in order.
type placeBatch struct {
	seq      uint64
	received time.Time
	props    []*proposal // one per dispatch; nil where refused
	refused  []error
	complete *proposal // nil when the batch had no completes
}

// prepareBatch validates a PlaceBatch and builds its commands: a malformed
// batch (over a limit, a bad complete id) fails the stream with
// InvalidArgument; a malformed dispatch fails alone, as the unary Dispatch
// would.
func prepareBatch(b *pb.PlaceBatch) (cmds []*pb.Command, refused []error, err error) {
	if len(b.Dispatches) > MaxPlaceBatch {
		return nil, nil, status.Errorf(codes.InvalidArgument, "Place batch seq %d has %d dispatches: at most %d per batch", b.Seq, len(b.Dispatches), MaxPlaceBatch)
	}
	if len(b.Completes) > MaxPlaceBatch {
		return nil, nil, status.Errorf(codes.InvalidArgument, "Place batch seq %d has %d completes: at most %d per batch", b.Seq, len(b.Completes), MaxPlaceBatch)
	}
	for i, id := range b.Completes {
		if err := validateRequestID(id); err != nil {
			return nil, nil, status.Errorf(codes.InvalidArgument, "Place batch seq %d completes[%d]: %s", b.Seq, i, status.Convert(err).Message())
		}
	}
	refused = make([]error, len(b.Dispatches))
	cmds = make([]*pb.Command, 0, len(b.Dispatches)+1)
	for i, d := range b.Dispatches {
		err := validateDispatch(d)
		if err == nil && d.SessionId == "" {
			err = status.Errorf(codes.InvalidArgument, "request %q has no session_id: a placement on the Place stream belongs to the gateway's session", d.RequestId)
		}
		if err != nil {
			refused[i] = err
			continue
		}
		cmds = append(cmds, dispatchCmd(d))
	}
	if len(b.Completes) > 0 {
		cmds = append(cmds, &pb.Command{Body: &pb.Command_Complete{Complete: &pb.CompleteCmd{RequestIds: b.Completes}}})
	}
	return cmds, refused, nil
}

// Place serves a gateway's stream of placements and completions. Only the
// ready leader serves it; it accepts by sending the header
// ctlclient.AcceptedHeader. Batches are validated and their commands queued
// to the proposer as they arrive (group commit with every other caller);
// answers go back in order. The stream ends Unavailable (NOT_LEADER) when
// leadership is lost: what was not answered is unknown, and the gateway
// sends it again on the next leader.
func (s *server) Place(stream grpc.BidiStreamingServer[pb.PlaceBatch, pb.PlaceResults]) error {
	n := s.n
	ls := n.leaderStateOrNil()
	if ls == nil {
		return n.notLeader("is not the leader")
	}
	select {
	case <-ls.ready:
	default:
		return n.notLeader("leads but is not ready yet")
	}
	if err := stream.SendHeader(metadata.Pairs(ctlclient.AcceptedHeader, n.cfg.NodeID)); err != nil {
		return err
	}
	n.metrics.placeStreams.Inc()
	defer n.metrics.placeStreams.Dec()
	ctx := stream.Context()

	// The receiver validates and queues; this goroutine answers in order.
	batches := make(chan *placeBatch, 256)
	recvErr := make(chan error, 1)
	go func() {
		defer close(batches)
		for {
			b, err := stream.Recv()
			if err != nil {
				if err == io.EOF {
					err = nil
				}
				recvErr <- err
				return
			}
			received := time.Now()
			cmds, refused, err := prepareBatch(b)
			if err != nil {
				recvErr <- err
				return
			}
			pbt := &placeBatch{seq: b.Seq, received: received, refused: refused, props: make([]*proposal, len(b.Dispatches))}
			var props []*proposal
			if len(cmds) > 0 {
				if props, err = ls.proposer.enqueue(cmds...); err != nil {
					recvErr <- n.notLeader("lost leadership")
					return
				}
			}
			k := 0
			for i := range b.Dispatches {
				if refused[i] == nil {
					pbt.props[i] = props[k]
					k++
				}
			}
			if len(b.Completes) > 0 {
				pbt.complete = props[k]
			}
			n.metrics.placeBatches.Inc()
			select {
			case batches <- pbt:
			case <-ctx.Done():
				recvErr <- ctx.Err()
				return
			}
		}
	}()

	wait := func(pr *proposal) (proposalResult, error) {
		select {
		case r := <-pr.done:
			if r.err != nil {
				if retryable(r.err) {
					return r, n.notLeader("lost leadership")
				}
				return r, toStatus(r.err)
			}
			return r, nil
		case <-ls.stop:
			return proposalResult{}, n.notLeader("lost leadership")
		case <-n.shutdownCh:
			return proposalResult{}, status.Error(codes.Unavailable, "controller shutting down")
		case <-ctx.Done():
			return proposalResult{}, ctx.Err()
		}
	}
	for {
		var b *placeBatch
		var ok bool
		select {
		case b, ok = <-batches:
		case <-ls.stop:
			return n.notLeader("lost leadership")
		case <-n.shutdownCh:
			return status.Error(codes.Unavailable, "controller shutting down")
		}
		if !ok {
			return <-recvErr
		}
		out := &pb.PlaceResults{Seq: b.seq, Dispatches: make([]*pb.PlaceResult, len(b.props))}
		for i, pr := range b.props {
			res := &pb.PlaceResult{}
			err := b.refused[i]
			if pr != nil {
				r, werr := wait(pr)
				if werr != nil {
					return werr
				}
				if r.res.Err != nil {
					err = toStatus(r.res.Err)
				} else {
					res.Response = r.res.Dispatch
				}
			}
			if err != nil {
				st := status.Convert(err)
				res.Code, res.Message, res.Reason = uint32(st.Code()), st.Message(), ctlclient.Reason(err)
				n.metrics.placeDispatches.WithLabelValues(dispatchOutcome(st.Code(), res.Reason)).Inc()
			} else {
				n.metrics.placeDispatches.WithLabelValues("placed").Inc()
			}
			out.Dispatches[i] = res
		}
		if b.complete != nil {
			r, err := wait(b.complete)
			if err != nil {
				return err
			}
			if r.res.Err != nil {
				return toStatus(r.res.Err)
			}
			out.Complete = r.res.Complete
			n.metrics.placeCompletes.Add(float64(r.res.Complete.GetCompleted()))
		}
		if err := stream.Send(out); err != nil {
			return err
		}
		n.metrics.placeBatchTime.Observe(time.Since(b.received).Seconds())
	}
}

// dispatchOutcome is a refusal's label: its ErrorInfo reason, or its code.
func dispatchOutcome(c codes.Code, reason string) string {
	if reason != "" {
		return reason
	}
	return c.String()
}

// WatchLoad streams this replica's load table: at once, then whenever a
// row changed, at most one per interval. Any replica serves it (its own
// applied state; applied_index says how fresh). It ends when the client
// goes or the server shuts down.
func (s *server) WatchLoad(req *pb.WatchLoadRequest, stream grpc.ServerStreamingServer[pb.LoadTable]) error {
	n := s.n
	interval := DefaultWatchLoadInterval
	if req.IntervalMs > 0 {
		interval = time.Duration(req.IntervalMs) * time.Millisecond
	}
	n.metrics.watchLoadStreams.Inc()
	defer n.metrics.watchLoadStreams.Dec()
	ctx := stream.Context()
	var lastVer uint64
	sent := false
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		t, ver := n.fsm.LoadTable()
		if !sent || ver != lastVer {
			msg := LoadTableMessage(t, n.cfg.NodeID, n.IsLeader())
			if err := stream.Send(msg); err != nil {
				return err
			}
			n.metrics.watchLoadTables.Inc()
			sent, lastVer = true, ver
			// At most one per interval.
			timer.Reset(interval)
			select {
			case <-timer.C:
			case <-ctx.Done():
				return ctx.Err()
			case <-n.shutdownCh:
				return status.Error(codes.Unavailable, "controller shutting down")
			}
		}
		select {
		case <-n.fsm.WaitApplied(t.AppliedIndex + 1):
		case <-ctx.Done():
			return ctx.Err()
		case <-n.shutdownCh:
			return status.Error(codes.Unavailable, "controller shutting down")
		}
	}
}

// LoadTableMessage is the LoadTable WatchLoad sends: every field of the
// FSM's table t (fsm.LoadTable; shared, so not modified) and the replica
// that serves it. The server and the tests build the message here alone: a
// field left out reaches no gateway (the gateway session list once did
// not, and every gateway chose alone).
func LoadTableMessage(t *pb.LoadTable, controllerID string, leader bool) *pb.LoadTable {
	return &pb.LoadTable{AppliedIndex: t.AppliedIndex, Workers: t.Workers, Sessions: t.Sessions,
		ControllerId: controllerID, Leader: leader}
}

// GetPlacements reads many placements. Linearizable calls are served by the
// leader after a read round that concurrent calls share (readBatcher);
// stale ones by this replica.
func (s *server) GetPlacements(ctx context.Context, req *pb.GetPlacementsRequest) (*pb.GetPlacementsResponse, error) {
	if len(req.RequestIds) == 0 || len(req.RequestIds) > MaxGetPlacements {
		return nil, status.Errorf(codes.InvalidArgument, "request_ids has %d ids: must be 1..%d", len(req.RequestIds), MaxGetPlacements)
	}
	for i, id := range req.RequestIds {
		if err := validateRequestID(id); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "request_ids[%d]: %s", i, status.Convert(err).Message())
		}
	}
	s.n.metrics.getPlacementsIDs.Observe(float64(len(req.RequestIds)))
	serve := func() (*pb.GetPlacementsResponse, error) {
		found, notFound, idx := s.n.fsm.Placements(req.RequestIds)
		return &pb.GetPlacementsResponse{Placements: found, NotFound: notFound, AppliedIndex: idx}, nil
	}
	return read(ctx, s.n, "GetPlacements", req.Consistency, serve,
		func(ctx context.Context, cc *grpc.ClientConn) (*pb.GetPlacementsResponse, error) {
			return pb.NewControllerClient(cc).GetPlacements(ctx, req)
		})
}
