package controller

// The Operator service: cluster administration.

import (
	"context"
	"math"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

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
	return leaderOp(ctx, s.n, "AddVoter", func(ctx context.Context, _ *leaderState) (*pb.AddVoterResponse, error) {
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
	return leaderOp(ctx, s.n, "RemovePeer", func(ctx context.Context, _ *leaderState) (*pb.RemovePeerResponse, error) {
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
	return leaderOp(ctx, s.n, "TransferLeadership", func(ctx context.Context, _ *leaderState) (*pb.TransferLeadershipResponse, error) {
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
		Strategy: strategy, Lambda: lambda, Workers: uint32(workers), Placements: uint32(placements), Sessions: uint32(s.n.fsm.Sessions()),
		NodeId: s.n.cfg.NodeID, State: s.n.raft.State().String(),
	}, nil
}
