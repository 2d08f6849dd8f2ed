package controller

// The Operator service: cluster administration.

import (
	"context"
	"math"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/policy"
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
	if req.Strategy != pb.Strategy_STRATEGY_UNSPECIFIED && !policy.Strategy(req.Strategy).Known() {
		return nil, status.Errorf(codes.InvalidArgument, "strategy %d unknown: use %s (or unspecified to keep it)", req.Strategy, policy.StrategyNames())
	}
	if math.IsNaN(req.Lambda) || math.IsInf(req.Lambda, 0) || req.Lambda < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "lambda %v must be a finite number >= 0", req.Lambda)
	}
	if _, ok := pb.MigrationMode_name[int32(req.Migration)]; !ok {
		return nil, status.Errorf(codes.InvalidArgument, "migration %d unknown: use on, off or unchanged", req.Migration)
	}
	if req.CheckpointReplicas > policy.MaxCheckpointReplicas {
		return nil, status.Errorf(codes.InvalidArgument, "checkpoint_replicas %d: at most %d (0 keeps the current value)", req.CheckpointReplicas, policy.MaxCheckpointReplicas)
	}
	if req.Strategy == pb.Strategy_STRATEGY_UNSPECIFIED && req.Lambda == 0 && req.Migration == pb.MigrationMode_MIGRATION_MODE_UNCHANGED && req.CheckpointReplicas == 0 {
		return nil, status.Error(codes.InvalidArgument, "nothing to set: give a strategy, a lambda, a migration mode or checkpoint replicas")
	}
	cmd := &pb.Command{Body: &pb.Command_SetStrategy{SetStrategy: &pb.SetStrategyCmd{Strategy: req.Strategy, Lambda: req.Lambda, Migration: req.Migration,
		CheckpointReplicas: req.CheckpointReplicas}}}
	return write(ctx, s.n, "SetStrategy", cmd, func(r proposalResult) *pb.SetStrategyResponse {
		return &pb.SetStrategyResponse{Previous: r.res.Previous, Index: r.index}
	}, func(ctx context.Context, cc *grpc.ClientConn) (*pb.SetStrategyResponse, error) {
		return pb.NewOperatorClient(cc).SetStrategy(ctx, req)
	})
}

func (s *server) ClusterStatus(ctx context.Context, req *pb.ClusterStatusRequest) (*pb.ClusterStatusResponse, error) {
	_, leader := s.n.raft.LeaderWithID()
	strategy, lambda := s.n.fsm.Strategy()
	migration := pb.MigrationMode_MIGRATION_MODE_OFF
	if s.n.fsm.Migration() {
		migration = pb.MigrationMode_MIGRATION_MODE_ON
	}
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
		Strategy: strategy, Lambda: lambda, Migration: migration, Workers: uint32(workers), Placements: uint32(placements), Sessions: uint32(s.n.fsm.Sessions()),
		NodeId: s.n.cfg.NodeID, State: s.n.raft.State().String(),
	}, nil
}

// Migrate starts a live migration of one request, to the worker named or,
// when none is, to the freest other worker in full service. It runs on the
// leader, which reads the placement's epoch and the destination's
// incarnation from its own tables; Apply checks them again.
func (s *server) Migrate(ctx context.Context, req *pb.MigrateRequest) (*pb.MigrateResponse, error) {
	if err := validateRequestID(req.RequestId); err != nil {
		return nil, err
	}
	if req.ToWorker != "" {
		if err := validateWorkerID(req.ToWorker); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "to_worker: %s", status.Convert(err).Message())
		}
	}
	return leaderOp(ctx, s.n, "Migrate", func(ctx context.Context, ls *leaderState) (*pb.MigrateResponse, error) {
		mc, err := s.n.fsm.OperatorMigration(req.RequestId, req.ToWorker)
		if err != nil {
			return nil, toStatus(err)
		}
		r, err := ls.proposer.propose(ctx, &pb.Command{Body: &pb.Command_Migrate{Migrate: mc}})
		if err != nil {
			return nil, err
		}
		if r.res.Err != nil {
			return nil, toStatus(r.res.Err)
		}
		return &pb.MigrateResponse{Placement: r.res.Placement, Index: r.index}, nil
	}, func(ctx context.Context, cc *grpc.ClientConn) (*pb.MigrateResponse, error) {
		return pb.NewOperatorClient(cc).Migrate(ctx, req)
	})
}
