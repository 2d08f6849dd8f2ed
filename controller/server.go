package controller

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"time"

	"github.com/hashicorp/raft"
	"github.com/hashicorp/serf/serf"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/fsm"
	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/gossip"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Limits on what a call may carry.
const (
	MaxRequestIDBytes = 128
	MaxWorkerIDBytes  = 64
	MaxPromptTokens   = 1 << 20
	MaxOutputTokens   = 1 << 20
	MaxCompleteBatch  = 4096
)

// forwardedKey marks a call a follower forwarded to the leader; the receiver
// never forwards it again.
const forwardedKey = "x-lumen-forwarded"

type server struct {
	pb.UnimplementedControllerServer
	pb.UnimplementedOperatorServer
	n *Node
}

// --- Controller ---

func (s *server) Dispatch(ctx context.Context, req *pb.DispatchRequest) (*pb.DispatchResponse, error) {
	if err := validateRequestID(req.RequestId); err != nil {
		return nil, err
	}
	if req.PromptTokens == 0 || req.PromptTokens > MaxPromptTokens {
		return nil, status.Errorf(codes.InvalidArgument, "prompt_tokens %d out of range: must be 1..%d", req.PromptTokens, MaxPromptTokens)
	}
	if req.MaxTokens == 0 || req.MaxTokens > MaxOutputTokens {
		return nil, status.Errorf(codes.InvalidArgument, "max_tokens %d out of range: must be 1..%d", req.MaxTokens, MaxOutputTokens)
	}
	cmd := &pb.Command{Body: &pb.Command_Dispatch{Dispatch: &pb.DispatchCmd{
		RequestId: req.RequestId, PromptTokens: req.PromptTokens, MaxTokens: req.MaxTokens}}}
	return write(ctx, s.n, "Dispatch", cmd, func(r proposalResult) *pb.DispatchResponse { return r.res.Dispatch },
		func(ctx context.Context, cc *grpc.ClientConn) (*pb.DispatchResponse, error) {
			return pb.NewControllerClient(cc).Dispatch(ctx, req)
		})
}

func (s *server) Complete(ctx context.Context, req *pb.CompleteRequest) (*pb.CompleteResponse, error) {
	if len(req.RequestIds) == 0 || len(req.RequestIds) > MaxCompleteBatch {
		return nil, status.Errorf(codes.InvalidArgument, "request_ids has %d ids: must be 1..%d", len(req.RequestIds), MaxCompleteBatch)
	}
	for _, id := range req.RequestIds {
		if err := validateRequestID(id); err != nil {
			return nil, err
		}
	}
	cmd := &pb.Command{Body: &pb.Command_Complete{Complete: &pb.CompleteCmd{RequestIds: req.RequestIds}}}
	return write(ctx, s.n, "Complete", cmd, func(r proposalResult) *pb.CompleteResponse { return r.res.Complete },
		func(ctx context.Context, cc *grpc.ClientConn) (*pb.CompleteResponse, error) {
			return pb.NewControllerClient(cc).Complete(ctx, req)
		})
}

func (s *server) ReportLoad(ctx context.Context, req *pb.ReportLoadRequest) (*pb.ReportLoadResponse, error) {
	l := req.GetLoad()
	if l == nil {
		return nil, status.Error(codes.InvalidArgument, "load is required")
	}
	if err := validateWorkerID(l.WorkerId); err != nil {
		return nil, err
	}
	if math.IsNaN(l.QueueWaitMs) || math.IsInf(l.QueueWaitMs, 0) || l.QueueWaitMs < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "load.queue_wait_ms %v must be a finite number >= 0", l.QueueWaitMs)
	}
	if l.KvPagesUsed > l.KvPagesTotal {
		return nil, status.Errorf(codes.InvalidArgument, "load.kv_pages_used %d exceeds kv_pages_total %d", l.KvPagesUsed, l.KvPagesTotal)
	}
	cmd := &pb.Command{Body: &pb.Command_ReportLoad{ReportLoad: &pb.ReportLoadCmd{Load: l}}}
	return write(ctx, s.n, "ReportLoad", cmd, func(r proposalResult) *pb.ReportLoadResponse { return &pb.ReportLoadResponse{Index: r.index} },
		func(ctx context.Context, cc *grpc.ClientConn) (*pb.ReportLoadResponse, error) {
			return pb.NewControllerClient(cc).ReportLoad(ctx, req)
		})
}

func (s *server) RegisterWorker(ctx context.Context, req *pb.RegisterWorkerRequest) (*pb.RegisterWorkerResponse, error) {
	w := req.GetWorker()
	if w == nil {
		return nil, status.Error(codes.InvalidArgument, "worker is required")
	}
	if err := validateWorkerID(w.Id); err != nil {
		return nil, err
	}
	if w.Incarnation == 0 {
		return nil, status.Error(codes.InvalidArgument, "worker.incarnation must be >= 1")
	}
	if _, _, err := net.SplitHostPort(w.GrpcAddr); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "worker.grpc_addr %q is not host:port", w.GrpcAddr)
	}
	c := w.GetCapacity()
	if c == nil || c.KvPagesTotal == 0 || c.KvBytesPerToken == 0 {
		return nil, status.Error(codes.InvalidArgument, "worker.capacity needs kv_pages_total and kv_bytes_per_token > 0")
	}
	if math.IsNaN(c.H2DBytesPerSec) || c.H2DBytesPerSec < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "worker.capacity.h2d_bytes_per_sec %v must be >= 0", c.H2DBytesPerSec)
	}
	cmd := &pb.Command{Body: &pb.Command_RegisterWorker{RegisterWorker: &pb.RegisterWorkerCmd{Worker: w}}}
	return write(ctx, s.n, "RegisterWorker", cmd, func(r proposalResult) *pb.RegisterWorkerResponse {
		return &pb.RegisterWorkerResponse{Worker: r.res.Worker, Index: r.index}
	}, func(ctx context.Context, cc *grpc.ClientConn) (*pb.RegisterWorkerResponse, error) {
		return pb.NewControllerClient(cc).RegisterWorker(ctx, req)
	})
}

func (s *server) GetPlacement(ctx context.Context, req *pb.GetPlacementRequest) (*pb.GetPlacementResponse, error) {
	if err := validateRequestID(req.RequestId); err != nil {
		return nil, err
	}
	serve := func() (*pb.GetPlacementResponse, error) {
		p, idx := s.n.fsm.Placement(req.RequestId)
		if p == nil {
			return nil, status.Errorf(codes.NotFound, "no placement for request %q (applied index %d)", req.RequestId, idx)
		}
		return &pb.GetPlacementResponse{Placement: p, AppliedIndex: idx}, nil
	}
	return read(ctx, s.n, "GetPlacement", req.Consistency, serve,
		func(ctx context.Context, cc *grpc.ClientConn) (*pb.GetPlacementResponse, error) {
			return pb.NewControllerClient(cc).GetPlacement(ctx, req)
		})
}

func (s *server) ListWorkers(ctx context.Context, req *pb.ListWorkersRequest) (*pb.ListWorkersResponse, error) {
	serve := func() (*pb.ListWorkersResponse, error) {
		ws, ls, rs, idx := s.n.fsm.Workers()
		return &pb.ListWorkersResponse{Workers: ws, Loads: ls, Reservations: rs, AppliedIndex: idx}, nil
	}
	return read(ctx, s.n, "ListWorkers", req.Consistency, serve,
		func(ctx context.Context, cc *grpc.ClientConn) (*pb.ListWorkersResponse, error) {
			return pb.NewControllerClient(cc).ListWorkers(ctx, req)
		})
}

// WatchEvents streams the events this replica derives from the committed
// log. Every replica derives the same events at the same indexes, so a
// watcher may resume on any replica from the last index it saw.
func (s *server) WatchEvents(req *pb.WatchEventsRequest, stream grpc.ServerStreamingServer[pb.Event]) error {
	from := req.FromIndex
	for {
		evs, changed, err := s.n.fsm.Events().Since(from)
		if err != nil {
			if errors.Is(err, fsm.ErrCompacted) {
				return status.Error(codes.OutOfRange, err.Error())
			}
			return toStatus(err)
		}
		for _, ev := range evs {
			if err := stream.Send(ev); err != nil {
				return err
			}
			from = ev.Index
		}
		select {
		case <-changed:
		case <-stream.Context().Done():
			return stream.Context().Err()
		case <-s.n.shutdownCh:
			return status.Error(codes.Unavailable, "controller shutting down")
		}
	}
}

// --- Operator ---

func (s *server) RaftPeers(ctx context.Context, _ *pb.RaftPeersRequest) (*pb.RaftPeersResponse, error) {
	f := s.n.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return nil, toStatus(err)
	}
	_, leader := s.n.raft.LeaderWithID()
	resp := &pb.RaftPeersResponse{Term: s.n.term()}
	for _, srv := range f.Configuration().Servers {
		resp.Peers = append(resp.Peers, &pb.RaftPeer{Id: string(srv.ID), Address: string(srv.Address),
			Suffrage: srv.Suffrage.String(), Leader: srv.ID == leader, GrpcAddr: s.n.grpcAddrOf(string(srv.ID))})
	}
	return resp, nil
}

func (s *server) AddVoter(ctx context.Context, req *pb.AddVoterRequest) (*pb.AddVoterResponse, error) {
	if req.Id == "" || req.RaftAddr == "" {
		return nil, status.Error(codes.InvalidArgument, "id and raft_addr are required")
	}
	return leaderOp(ctx, s.n, "AddVoter", func(ctx context.Context) (*pb.AddVoterResponse, error) {
		f := s.n.raft.AddVoter(raft.ServerID(req.Id), raft.ServerAddress(req.RaftAddr), 0, timeLeft(ctx))
		if err := f.Error(); err != nil {
			return nil, err
		}
		return &pb.AddVoterResponse{Index: f.Index()}, nil
	}, func(ctx context.Context, cc *grpc.ClientConn) (*pb.AddVoterResponse, error) {
		return pb.NewOperatorClient(cc).AddVoter(ctx, req)
	})
}

func (s *server) RemovePeer(ctx context.Context, req *pb.RemovePeerRequest) (*pb.RemovePeerResponse, error) {
	if req.Id == "" {
		return nil, status.Error(codes.InvalidArgument, "id is required")
	}
	return leaderOp(ctx, s.n, "RemovePeer", func(ctx context.Context) (*pb.RemovePeerResponse, error) {
		f := s.n.raft.GetConfiguration()
		if err := f.Error(); err != nil {
			return nil, err
		}
		found := false
		for _, srv := range f.Configuration().Servers {
			found = found || string(srv.ID) == req.Id
		}
		if !found {
			return nil, status.Errorf(codes.NotFound, "no raft peer with id %q", req.Id)
		}
		rf := s.n.raft.RemoveServer(raft.ServerID(req.Id), 0, timeLeft(ctx))
		if err := rf.Error(); err != nil {
			return nil, err
		}
		return &pb.RemovePeerResponse{Index: rf.Index()}, nil
	}, func(ctx context.Context, cc *grpc.ClientConn) (*pb.RemovePeerResponse, error) {
		return pb.NewOperatorClient(cc).RemovePeer(ctx, req)
	})
}

func (s *server) TransferLeadership(ctx context.Context, req *pb.TransferLeadershipRequest) (*pb.TransferLeadershipResponse, error) {
	return leaderOp(ctx, s.n, "TransferLeadership", func(ctx context.Context) (*pb.TransferLeadershipResponse, error) {
		var f raft.Future
		if req.Id == "" {
			f = s.n.raft.LeadershipTransfer()
		} else {
			addr := ""
			cf := s.n.raft.GetConfiguration()
			if err := cf.Error(); err != nil {
				return nil, err
			}
			for _, srv := range cf.Configuration().Servers {
				if string(srv.ID) == req.Id {
					addr = string(srv.Address)
				}
			}
			if addr == "" {
				return nil, status.Errorf(codes.NotFound, "no raft peer with id %q", req.Id)
			}
			f = s.n.raft.LeadershipTransferToServer(raft.ServerID(req.Id), raft.ServerAddress(addr))
		}
		if err := f.Error(); err != nil {
			return nil, err
		}
		_, id := s.n.raft.LeaderWithID()
		return &pb.TransferLeadershipResponse{NewLeader: string(id)}, nil
	}, func(ctx context.Context, cc *grpc.ClientConn) (*pb.TransferLeadershipResponse, error) {
		return pb.NewOperatorClient(cc).TransferLeadership(ctx, req)
	})
}

func (s *server) SetStrategy(ctx context.Context, req *pb.SetStrategyRequest) (*pb.SetStrategyResponse, error) {
	if req.Strategy < pb.Strategy_STRATEGY_LUMEN || req.Strategy > pb.Strategy_STRATEGY_STOP_AND_RESTART {
		return nil, status.Errorf(codes.InvalidArgument, "strategy %d unknown: use lumen, fixed-checkpoint or stop-and-restart", req.Strategy)
	}
	if math.IsNaN(req.Lambda) || math.IsInf(req.Lambda, 0) || req.Lambda < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "lambda %v must be a finite number >= 0", req.Lambda)
	}
	cmd := &pb.Command{Body: &pb.Command_SetStrategy{SetStrategy: &pb.SetStrategyCmd{Strategy: req.Strategy, Lambda: req.Lambda}}}
	return write(ctx, s.n, "SetStrategy", cmd, func(r proposalResult) *pb.SetStrategyResponse {
		return &pb.SetStrategyResponse{Previous: r.res.Previous, Index: r.index}
	}, func(ctx context.Context, cc *grpc.ClientConn) (*pb.SetStrategyResponse, error) {
		return pb.NewOperatorClient(cc).SetStrategy(ctx, req)
	})
}

func (s *server) ClusterStatus(ctx context.Context, req *pb.ClusterStatusRequest) (*pb.ClusterStatusResponse, error) {
	_, leader := s.n.raft.LeaderWithID()
	strategy, lambda := s.n.fsm.Strategy()
	workers, placements := s.n.fsm.Counts()
	var hash, at uint64
	if req.GetWithStateHash() {
		var err error
		if hash, at, err = s.n.fsm.StateHash(); err != nil {
			return nil, status.Errorf(codes.Internal, "state hash: %v", err)
		}
	}
	return &pb.ClusterStatusResponse{StateHash: hash, StateIndex: at,
		LeaderId: string(leader), LeaderGrpcAddr: s.n.grpcAddrOf(string(leader)),
		Term: s.n.term(), CommitIndex: s.n.raft.CommitIndex(), AppliedIndex: s.n.fsm.Applied(),
		Strategy: strategy, Lambda: lambda, Workers: uint32(workers), Placements: uint32(placements),
		NodeId: s.n.cfg.NodeID, State: s.n.raft.State().String(),
	}, nil
}

// --- routing ---

// write proposes cmd on the leader (forwarding when this replica is not it)
// and turns the FSM's result into the response.
func write[T any](ctx context.Context, n *Node, method string, cmd *pb.Command, resp func(proposalResult) T,
	remote func(context.Context, *grpc.ClientConn) (T, error)) (T, error) {
	return leaderOp(ctx, n, method, func(ctx context.Context) (T, error) {
		var zero T
		r, err := n.leaderStateOrNil().proposer.propose(ctx, cmd)
		if err != nil {
			return zero, err
		}
		if r.res.Err != nil {
			return zero, toStatus(r.res.Err)
		}
		return resp(r), nil
	}, remote)
}

// read serves a query: stale ones locally; linearizable ones on the leader
// after a read round, or forwarded to it.
func read[T any](ctx context.Context, n *Node, method string, c pb.Consistency, serve func() (T, error),
	remote func(context.Context, *grpc.ClientConn) (T, error)) (T, error) {
	if c == pb.Consistency_CONSISTENCY_STALE {
		return serve()
	}
	if c != pb.Consistency_CONSISTENCY_LINEARIZABLE {
		var zero T
		return zero, status.Errorf(codes.InvalidArgument, "consistency %d unknown: use linearizable or stale", c)
	}
	return leaderOp(ctx, n, method, func(ctx context.Context) (T, error) {
		if err := n.leaderStateOrNil().reads.read(ctx); err != nil {
			var zero T
			return zero, err
		}
		return serve()
	}, remote)
}

func (n *Node) leaderStateOrNil() *leaderState {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.leader
}

// leaderOp runs local on this replica while it is the ready leader, or calls
// remote on the leader. It retries across leader changes until the call's
// budget runs out, then fails Unavailable: never a hang past the deadline.
func leaderOp[T any](ctx context.Context, n *Node, method string, local func(context.Context) (T, error),
	remote func(context.Context, *grpc.ClientConn) (T, error)) (T, error) {
	var zero T
	ctx, cancel := n.budget(ctx)
	defer cancel()
	forwarded := false
	if md, ok := metadata.FromIncomingContext(ctx); ok && len(md.Get(forwardedKey)) > 0 {
		forwarded = true
	}
	backoff := 2 * time.Millisecond
	var last error
	for {
		if ls := n.leaderStateOrNil(); ls != nil {
			select {
			case <-ls.ready:
				v, err := local(ctx)
				if err == nil || !retryable(err) {
					return v, toStatus(err)
				}
				last = err
			case <-ls.stop:
			case <-ctx.Done():
			}
		} else if forwarded {
			return zero, status.Errorf(codes.Unavailable, "controller %s: not the leader", n.cfg.NodeID)
		} else if cc, err := n.leaderConn(ctx); err != nil {
			last = err
		} else {
			n.metrics.forwarded.WithLabelValues(method).Inc()
			v, err := remote(metadata.AppendToOutgoingContext(ctx, forwardedKey, n.cfg.NodeID), cc)
			if status.Code(err) != codes.Unavailable {
				return v, err
			}
			last = err
		}
		select {
		case <-ctx.Done():
			if errors.Is(context.Cause(ctx), errBudget) || errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return zero, status.Errorf(codes.Unavailable, "controller: no leader with a quorum answered in time (last error: %v)", last)
			}
			return zero, status.FromContextError(ctx.Err()).Err()
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 100*time.Millisecond)
	}
}

func timeLeft(ctx context.Context) time.Duration {
	if d, ok := ctx.Deadline(); ok {
		return time.Until(d)
	}
	return 0
}

var errBudget = errors.New("controller: request budget spent")

// budget returns ctx bounded so the call answers before its caller's
// deadline (or within RequestTimeout when the caller set none).
func (n *Node) budget(ctx context.Context) (context.Context, context.CancelFunc) {
	d, ok := ctx.Deadline()
	if !ok {
		return context.WithTimeoutCause(ctx, n.cfg.RequestTimeout, errBudget)
	}
	left := time.Until(d)
	margin := min(left/10, 100*time.Millisecond)
	return context.WithDeadlineCause(ctx, d.Add(-margin), errBudget)
}

// leaderConn returns a connection to the leader's gRPC server, waiting for
// a leader to be known.
func (n *Node) leaderConn(ctx context.Context) (*grpc.ClientConn, error) {
	backoff := 2 * time.Millisecond
	for {
		_, id := n.raft.LeaderWithID()
		if id != "" && string(id) != n.cfg.NodeID {
			if addr := n.grpcAddrOf(string(id)); addr != "" {
				return n.peers.get(addr)
			}
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("controller: no leader known: %w", ctx.Err())
		case <-n.shutdownCh:
			return nil, raft.ErrRaftShutdown
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 50*time.Millisecond)
	}
}

// grpcAddrOf returns a controller's gRPC address from its Serf tags.
func (n *Node) grpcAddrOf(id string) string {
	if id == n.cfg.NodeID {
		return n.GRPCAddr()
	}
	for _, m := range n.serf.Members() {
		if m.Name == id && m.Tags[gossip.TagRole] == gossip.RoleController && m.Status != serf.StatusLeft {
			return m.Tags[gossip.TagGRPCAddr]
		}
	}
	return ""
}

func (n *Node) term() uint64 {
	var t uint64
	fmt.Sscan(n.raft.Stats()["term"], &t)
	return t
}

// --- errors and validation ---

func retryable(err error) bool {
	return errors.Is(err, errNotLeader) || errors.Is(err, raft.ErrNotLeader) ||
		errors.Is(err, raft.ErrLeadershipLost) || errors.Is(err, raft.ErrLeadershipTransferInProgress) ||
		errors.Is(err, raft.ErrEnqueueTimeout)
}

// toStatus maps errors to gRPC statuses.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	switch {
	case errors.Is(err, fsm.ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, fsm.ErrIncarnationFailed):
		// The worker acts on this one: the reason says it is not the
		// stale-incarnation refusal a second process under the same id gets.
		st, derr := status.New(codes.FailedPrecondition, err.Error()).WithDetails(&errdetails.ErrorInfo{
			Reason: ctlclient.ReasonIncarnationFailed, Domain: ctlclient.ErrorDomain})
		if derr != nil {
			return status.Error(codes.FailedPrecondition, err.Error())
		}
		return st.Err()
	case errors.Is(err, fsm.ErrUnknownWorker):
		return status.Error(codes.NotFound, err.Error())
	case errors.Is(err, fsm.ErrStaleIncarnation), errors.Is(err, fsm.ErrCompleted), errors.Is(err, fsm.ErrNoWorker):
		return status.Error(codes.FailedPrecondition, err.Error())
	case retryable(err), errors.Is(err, raft.ErrRaftShutdown), errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

func validateRequestID(id string) error {
	if id == "" || len(id) > MaxRequestIDBytes {
		return status.Errorf(codes.InvalidArgument, "request_id must be 1..%d bytes, got %d", MaxRequestIDBytes, len(id))
	}
	for _, c := range []byte(id) {
		if c < 0x21 || c > 0x7e {
			return status.Errorf(codes.InvalidArgument, "request_id %q has a byte 0x%02x: only printable ASCII without spaces is allowed", id, c)
		}
	}
	return nil
}

func validateWorkerID(id string) error {
	if id == "" || len(id) > MaxWorkerIDBytes {
		return status.Errorf(codes.InvalidArgument, "worker id must be 1..%d bytes, got %d", MaxWorkerIDBytes, len(id))
	}
	for _, c := range id {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return status.Errorf(codes.InvalidArgument, "worker id %q: only letters, digits, '-', '_' and '.' are allowed", id)
		}
	}
	return nil
}

func (s *server) SetWorkerPhase(ctx context.Context, req *pb.SetWorkerPhaseRequest) (*pb.SetWorkerPhaseResponse, error) {
	if err := validateWorkerID(req.WorkerId); err != nil {
		return nil, err
	}
	if _, ok := pb.WorkerPhase_name[int32(req.Phase)]; !ok || req.Phase == pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED {
		return nil, status.Errorf(codes.InvalidArgument, "phase %d unknown", req.Phase)
	}
	cmd := &pb.Command{Body: &pb.Command_SetPhase{SetPhase: &pb.SetPhaseCmd{
		WorkerId: req.WorkerId, Incarnation: req.Incarnation, Phase: req.Phase, Reason: req.Reason}}}
	return write(ctx, s.n, "SetWorkerPhase", cmd, func(r proposalResult) *pb.SetWorkerPhaseResponse {
		return &pb.SetWorkerPhaseResponse{Worker: r.res.Worker, Index: r.index}
	}, func(ctx context.Context, cc *grpc.ClientConn) (*pb.SetWorkerPhaseResponse, error) {
		return pb.NewControllerClient(cc).SetWorkerPhase(ctx, req)
	})
}

// probeTimeout bounds the leader's probe of a worker reported unreachable.
const probeTimeout = 300 * time.Millisecond

func (s *server) ReportUnreachable(ctx context.Context, req *pb.ReportUnreachableRequest) (*pb.ReportUnreachableResponse, error) {
	if err := validateWorkerID(req.WorkerId); err != nil {
		return nil, err
	}
	return leaderOp(ctx, s.n, "ReportUnreachable", func(ctx context.Context) (*pb.ReportUnreachableResponse, error) {
		w := s.n.fsm.Worker(req.WorkerId)
		if w == nil {
			return nil, status.Errorf(codes.NotFound, "no worker %q", req.WorkerId)
		}
		if w.Phase == pb.WorkerPhase_WORKER_PHASE_FAILED || w.Phase == pb.WorkerPhase_WORKER_PHASE_LEFT {
			return &pb.ReportUnreachableResponse{MarkedFailed: true}, nil
		}
		probeErr := probeWorker(ctx, w.GrpcAddr)
		if probeErr == nil {
			return &pb.ReportUnreachableResponse{}, nil
		}
		s.n.log.Info("worker failed its probe", "worker", w.Id, "reporter", req.Reporter, "error", probeErr)
		r, err := s.n.leaderStateOrNil().proposer.propose(ctx, &pb.Command{Body: &pb.Command_MarkFailed{MarkFailed: &pb.MarkFailedCmd{
			WorkerId: w.Id, Incarnation: w.Incarnation, Reason: "probe failed after report by " + req.Reporter + ": " + probeErr.Error()}}})
		if err != nil {
			return nil, err
		}
		if r.res.Err != nil {
			return nil, toStatus(r.res.Err)
		}
		return &pb.ReportUnreachableResponse{MarkedFailed: true, ProbeError: probeErr.Error()}, nil
	}, func(ctx context.Context, cc *grpc.ClientConn) (*pb.ReportUnreachableResponse, error) {
		return pb.NewControllerClient(cc).ReportUnreachable(ctx, req)
	})
}

// probeWorker checks that a worker accepts a connection and answers its
// gRPC health check within probeTimeout.
func probeWorker(ctx context.Context, addr string) error {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	c.Close()
	cc, err := grpc.NewClient(addr, DialOptions(nil)...)
	if err != nil {
		return err
	}
	defer cc.Close()
	resp, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		return err
	}
	if resp.Status != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("health %s", resp.Status)
	}
	return nil
}
