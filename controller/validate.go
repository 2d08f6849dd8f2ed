package controller

// Validation of what a call carries, and the mapping of errors to gRPC
// statuses.

import (
	"context"
	"errors"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/fsm"
	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Limits on what a call may carry.
const (
	MaxRequestIDBytes = 128
	MaxWorkerIDBytes  = 64
	MaxPromptTokens   = 1 << 20
	MaxOutputTokens   = 1 << 20
	MaxCompleteBatch  = 4096
	MaxSessionIDBytes = 128
	MaxOwnerBytes     = 128
	MaxReasonBytes    = 512
	// MaxPlaceBatch caps the dispatches, and the completes, of one
	// PlaceBatch; MaxGetPlacements the ids of one GetPlacements.
	MaxPlaceBatch    = ctlclient.MaxPlaceBatch
	MaxGetPlacements = ctlclient.MaxGetPlacements
	MinSessionTTL    = time.Duration(fsm.MinSessionTTLNanos)
	MaxSessionTTL    = time.Duration(fsm.MaxSessionTTLNanos)
)

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
		return withReason(codes.FailedPrecondition, err, ctlclient.ReasonIncarnationFailed)
	case errors.Is(err, fsm.ErrSessionExpired):
		// The gateway acts on this one: it creates a new session.
		return withReason(codes.FailedPrecondition, err, ctlclient.ReasonSessionExpired)
	case errors.Is(err, fsm.ErrStaleEpoch):
		return withReason(codes.FailedPrecondition, err, ctlclient.ReasonStaleEpoch)
	case errors.Is(err, fsm.ErrStaleMigration):
		return withReason(codes.FailedPrecondition, err, ctlclient.ReasonStaleMigration)
	case errors.Is(err, fsm.ErrPlacementState):
		return withReason(codes.FailedPrecondition, err, ctlclient.ReasonPlacementState)
	case errors.Is(err, fsm.ErrWorkerUnavailable):
		// The gateway acts on this one: it places the request elsewhere.
		return withReason(codes.FailedPrecondition, err, ctlclient.ReasonWorkerUnavailable)
	case errors.Is(err, fsm.ErrCompleted):
		return withReason(codes.FailedPrecondition, err, ctlclient.ReasonCompleted)
	case errors.Is(err, fsm.ErrUnknownWorker), errors.Is(err, fsm.ErrUnknownPlacement):
		return status.Error(codes.NotFound, err.Error())
	case errors.Is(err, fsm.ErrStaleIncarnation), errors.Is(err, fsm.ErrNoWorker), errors.Is(err, fsm.ErrNotEligible):
		return status.Error(codes.FailedPrecondition, err.Error())
	case retryable(err), errors.Is(err, raft.ErrRaftShutdown), errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

// withReason is a status of code with an ErrorInfo reason a client acts on.
func withReason(code codes.Code, err error, reason string) error {
	st, derr := status.New(code, err.Error()).WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: ctlclient.ErrorDomain})
	if derr != nil {
		return status.Error(code, err.Error())
	}
	return st.Err()
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

// validatePrintable checks an id-like field: 1..max printable ASCII bytes
// without spaces.
func validatePrintable(field, v string, max int) error {
	if v == "" || len(v) > max {
		return status.Errorf(codes.InvalidArgument, "%s must be 1..%d bytes, got %d", field, max, len(v))
	}
	for _, c := range []byte(v) {
		if c < 0x21 || c > 0x7e {
			return status.Errorf(codes.InvalidArgument, "%s %q has a byte 0x%02x: only printable ASCII without spaces is allowed", field, v, c)
		}
	}
	return nil
}

func validateSessionID(id string) error {
	return validatePrintable("session_id", id, MaxSessionIDBytes)
}

// validateDispatch checks a DispatchRequest as the unary Dispatch and the
// Place stream both take it.
func validateDispatch(req *pb.DispatchRequest) error {
	if err := validateRequestID(req.RequestId); err != nil {
		return err
	}
	if req.PromptTokens == 0 || req.PromptTokens > MaxPromptTokens {
		return status.Errorf(codes.InvalidArgument, "prompt_tokens %d out of range: must be 1..%d", req.PromptTokens, MaxPromptTokens)
	}
	if req.MaxTokens == 0 || req.MaxTokens > MaxOutputTokens {
		return status.Errorf(codes.InvalidArgument, "max_tokens %d out of range: must be 1..%d", req.MaxTokens, MaxOutputTokens)
	}
	if req.SessionId != "" {
		if err := validateSessionID(req.SessionId); err != nil {
			return err
		}
	}
	if req.WorkerId != "" {
		if err := validateWorkerID(req.WorkerId); err != nil {
			return status.Errorf(codes.InvalidArgument, "worker_id: %s", status.Convert(err).Message())
		}
		if req.WorkerIncarnation == 0 {
			return status.Errorf(codes.InvalidArgument, "worker_incarnation must be >= 1 with worker_id %q: name the incarnation the load table showed", req.WorkerId)
		}
	} else if req.WorkerIncarnation != 0 {
		return status.Errorf(codes.InvalidArgument, "worker_incarnation %d without worker_id", req.WorkerIncarnation)
	}
	if req.Priority < policy.MinPriority || req.Priority > policy.MaxPriority {
		return status.Errorf(codes.InvalidArgument, "priority %d out of range: must be %d..%d (lower is more urgent, 0 the default)",
			req.Priority, policy.MinPriority, policy.MaxPriority)
	}
	return nil
}

func dispatchCmd(req *pb.DispatchRequest) *pb.Command {
	return &pb.Command{Body: &pb.Command_Dispatch{Dispatch: &pb.DispatchCmd{
		RequestId: req.RequestId, PromptTokens: req.PromptTokens, MaxTokens: req.MaxTokens, SessionId: req.SessionId,
		WorkerId: req.WorkerId, WorkerIncarnation: req.WorkerIncarnation, Priority: req.Priority}}}
}
