package controller

// The Controller service: the calls gateways and workers make. Each handler
// validates its input (validate.go) and routes through write, read or
// leaderOp (routing.go).

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"net"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/fsm"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

type server struct {
	pb.UnimplementedControllerServer
	pb.UnimplementedOperatorServer
	n *Node
}

func (s *server) Dispatch(ctx context.Context, req *pb.DispatchRequest) (*pb.DispatchResponse, error) {
	if err := validateDispatch(req); err != nil {
		return nil, err
	}
	return write(ctx, s.n, "Dispatch", dispatchCmd(req), func(r proposalResult) *pb.DispatchResponse { return r.res.Dispatch },
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
	switch w.Phase {
	case pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT:
	default:
		// The fsm refuses these too; refusing here keeps them out of the log.
		return nil, status.Errorf(codes.InvalidArgument, "worker.phase %s: a worker registers in FULL_SERVICE, or in LOADING_DRAFT when it restarts after a failure", w.Phase)
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
		t := s.n.fsm.Workers()
		return &pb.ListWorkersResponse{Workers: t.Workers, Loads: t.Loads, Reservations: t.Reservations,
			Migrations: t.Migrations, AppliedIndex: t.AppliedIndex}, nil
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

func (s *server) SetWorkerPhase(ctx context.Context, req *pb.SetWorkerPhaseRequest) (*pb.SetWorkerPhaseResponse, error) {
	if err := validateWorkerID(req.WorkerId); err != nil {
		return nil, err
	}
	// Every named phase goes through, the recovery phases included (a
	// restarted worker reports LOADING_DRAFT → ASSIST → HOTSWAP →
	// FULL_SERVICE itself); the fsm refuses steps backward.
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

func (s *server) ReportUnreachable(ctx context.Context, req *pb.ReportUnreachableRequest) (*pb.ReportUnreachableResponse, error) {
	if err := validateWorkerID(req.WorkerId); err != nil {
		return nil, err
	}
	return leaderOp(ctx, s.n, "ReportUnreachable", func(ctx context.Context, ls *leaderState) (*pb.ReportUnreachableResponse, error) {
		w := s.n.fsm.Worker(req.WorkerId)
		if w == nil {
			return nil, status.Errorf(codes.NotFound, "no worker %q", req.WorkerId)
		}
		if w.Phase == pb.WorkerPhase_WORKER_PHASE_FAILED || w.Phase == pb.WorkerPhase_WORKER_PHASE_LEFT {
			return &pb.ReportUnreachableResponse{MarkedFailed: true}, nil
		}
		probeErr := probeWorker(ctx, w.GrpcAddr, s.n.cfg.ProbeTimeout, s.n.clientTLS)
		if probeErr == nil {
			return &pb.ReportUnreachableResponse{}, nil
		}
		s.n.log.Info("worker failed its probe", "worker", w.Id, "reporter", req.Reporter, "error", probeErr)
		r, err := ls.proposer.propose(ctx, &pb.Command{Body: &pb.Command_MarkFailed{MarkFailed: &pb.MarkFailedCmd{
			WorkerId: w.Id, Incarnation: w.Incarnation, Reason: "probe failed after report by " + req.Reporter + ": " + probeErr.Error(),
			Checkpointed: s.n.copyPrefixes(ctx, w.Id)}}})
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
// gRPC health check within timeout.
func probeWorker(ctx context.Context, addr string, timeout time.Duration, clientTLS *tls.Config) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	c.Close()
	cc, err := grpc.NewClient(addr, DialOptions(clientTLS)...)
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

// FinishMigration commits a migration at its destination or aborts it. The
// destination calls it with commit once it holds every page and the source
// has stopped; either end (or anyone) aborts. The migration is named by the
// placement epoch and the destination the Migration STARTED event gave: a
// call about any other — aborted, overtaken by a recovery or a later
// migration — fails FailedPrecondition (ctlclient.MigrationOver).
func (s *server) FinishMigration(ctx context.Context, req *pb.FinishMigrationRequest) (*pb.FinishMigrationResponse, error) {
	if err := validateRequestID(req.RequestId); err != nil {
		return nil, err
	}
	if err := validateWorkerID(req.ToWorker); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "to_worker: %s", status.Convert(err).Message())
	}
	if req.ToIncarnation == 0 {
		return nil, status.Error(codes.InvalidArgument, "to_incarnation must be >= 1: name the destination as the Migration STARTED event did")
	}
	if len(req.Reason) > MaxReasonBytes {
		return nil, status.Errorf(codes.InvalidArgument, "reason is %d bytes: at most %d", len(req.Reason), MaxReasonBytes)
	}
	cmd := &pb.Command{Body: &pb.Command_FinishMigration{FinishMigration: &pb.FinishMigrationCmd{RequestId: req.RequestId,
		Epoch: req.Epoch, Commit: req.Commit, Reason: req.Reason, ToWorker: req.ToWorker, ToIncarnation: req.ToIncarnation}}}
	return write(ctx, s.n, "FinishMigration", cmd, func(r proposalResult) *pb.FinishMigrationResponse {
		return &pb.FinishMigrationResponse{Placement: r.res.Placement, Index: r.index}
	}, func(ctx context.Context, cc *grpc.ClientConn) (*pb.FinishMigrationResponse, error) {
		return pb.NewControllerClient(cc).FinishMigration(ctx, req)
	})
}

// CreateSession opens a session. The replica that proposes it draws the id
// at random (Apply never draws one).
func (s *server) CreateSession(ctx context.Context, req *pb.CreateSessionRequest) (*pb.CreateSessionResponse, error) {
	if err := validatePrintable("owner", req.Owner, MaxOwnerBytes); err != nil {
		return nil, err
	}
	ttl := time.Duration(req.TtlMs) * time.Millisecond
	if ttl < MinSessionTTL || ttl > MaxSessionTTL {
		return nil, status.Errorf(codes.InvalidArgument, "ttl_ms %d out of range: must be %d..%d", req.TtlMs, MinSessionTTL.Milliseconds(), MaxSessionTTL.Milliseconds())
	}
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, status.Errorf(codes.Internal, "session id: %v", err)
	}
	cmd := &pb.Command{Body: &pb.Command_CreateSession{CreateSession: &pb.CreateSessionCmd{
		Id: hex.EncodeToString(b[:]), Owner: req.Owner, TtlNanos: int64(ttl), Gateway: req.Gateway}}}
	return write(ctx, s.n, "CreateSession", cmd, func(r proposalResult) *pb.CreateSessionResponse {
		return &pb.CreateSessionResponse{Session: r.res.Session, Index: r.index}
	}, func(ctx context.Context, cc *grpc.ClientConn) (*pb.CreateSessionResponse, error) {
		return pb.NewControllerClient(cc).CreateSession(ctx, req)
	})
}

func (s *server) RenewSession(ctx context.Context, req *pb.RenewSessionRequest) (*pb.RenewSessionResponse, error) {
	if err := validateSessionID(req.SessionId); err != nil {
		return nil, err
	}
	cmd := &pb.Command{Body: &pb.Command_RenewSession{RenewSession: &pb.RenewSessionCmd{Id: req.SessionId}}}
	return write(ctx, s.n, "RenewSession", cmd, func(r proposalResult) *pb.RenewSessionResponse {
		return &pb.RenewSessionResponse{Session: r.res.Session, Index: r.index}
	}, func(ctx context.Context, cc *grpc.ClientConn) (*pb.RenewSessionResponse, error) {
		return pb.NewControllerClient(cc).RenewSession(ctx, req)
	})
}

func (s *server) DestroySession(ctx context.Context, req *pb.DestroySessionRequest) (*pb.DestroySessionResponse, error) {
	if err := validateSessionID(req.SessionId); err != nil {
		return nil, err
	}
	cmd := &pb.Command{Body: &pb.Command_DestroySession{DestroySession: &pb.DestroySessionCmd{Id: req.SessionId}}}
	return write(ctx, s.n, "DestroySession", cmd, func(r proposalResult) *pb.DestroySessionResponse { return r.res.Destroyed },
		func(ctx context.Context, cc *grpc.ClientConn) (*pb.DestroySessionResponse, error) {
			return pb.NewControllerClient(cc).DestroySession(ctx, req)
		})
}
