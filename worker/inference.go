package worker

import (
	"context"
	"errors"
	"io"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// This file is the Inference gRPC service: the Generate and Checkpoint
// handlers and the validation of their input. The daemon around them
// (start, registration, load reports, shutdown) is in worker.go.

// Errors a Generate call can end with.
var (
	errShutdown = errors.New("worker: shutting down; resume the request elsewhere")
	// errRejoined ends the calls of an incarnation the controller marked
	// failed while this process ran on (paused, cut off): its requests were
	// moved by a recovery plan.
	errRejoined = errors.New("worker: this incarnation was marked failed and its requests moved; resume where the controller placed them")
	errDraining = errors.New("worker: draining; not taking new requests")
	// errLoading refuses a call while a restarted worker loads its model.
	errLoading = errors.New("the model is still loading after a restart; not serving yet")
	// The scheduling core's refusals (see package core).
	errQueueFull  = core.ErrQueueFull
	errTooLarge   = core.ErrTooLarge
	errSuperseded = core.ErrSuperseded
	errStaleEpoch = core.ErrStaleEpoch
)

// inferenceServer implements the Inference service.
type inferenceServer struct {
	pb.UnimplementedInferenceServer
	w *Worker
}

// Generate validates the request, queues it, and streams its tokens.
func (s *inferenceServer) Generate(req *pb.GenerateRequest, stream grpc.ServerStreamingServer[pb.GenerateResponse]) error {
	w := s.w
	r, err := w.newRequest(req)
	if err != nil {
		w.metrics.rejected.WithLabelValues(status.Code(err).String()).Inc()
		return err
	}
	if w.isDraining() {
		return status.Error(codes.Unavailable, errDraining.Error())
	}
	if !w.cfg.Engine.Loaded() {
		// Recovering after a restart: the controller places nothing here
		// before FULL_SERVICE; a stale placement resumes elsewhere.
		return status.Errorf(codes.Unavailable, "worker %s: %v (phase %s)", w.cfg.ID, errLoading, phaseName(w.Phase()))
	}
	select {
	case w.sched.submit <- r:
	case <-stream.Context().Done():
		return status.FromContextError(stream.Context().Err()).Err()
	case <-w.stop:
		return status.Error(codes.Unavailable, errShutdown.Error())
	}
	w.admitted(r.prompt)
	for {
		select {
		case <-r.box.notify:
		case <-stream.Context().Done():
			// The client went away: free everything the request holds.
			select {
			case w.sched.cancel <- r:
			case <-w.sched.done:
			}
			return status.FromContextError(stream.Context().Err()).Err()
		}
		for _, ev := range r.box.take() {
			if ev.err != nil {
				return toStatus(ev.err)
			}
			if err := stream.Send(ev.resp); err != nil {
				select {
				case w.sched.cancel <- r:
				case <-w.sched.done:
				}
				return err
			}
			if ev.resp.Done || ev.resp.Moved != nil {
				return nil
			}
		}
	}
}

func toStatus(err error) error {
	switch {
	case errors.Is(err, errShutdown), errors.Is(err, errDraining), errors.Is(err, errRejoined):
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, errQueueFull):
		return status.Error(codes.ResourceExhausted, err.Error())
	case errors.Is(err, errSuperseded):
		return status.Error(codes.Aborted, err.Error())
	case errors.Is(err, errStaleEpoch):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.Is(err, errTooLarge), errors.Is(err, engine.ErrBadInput):
		return status.Error(codes.InvalidArgument, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

// Limits on a Generate call.
const (
	maxRequestIDBytes = 128
	maxStopTokens     = 16
)

// newRequest checks a Generate call and builds its scheduler request.
func (w *Worker) newRequest(req *pb.GenerateRequest) (*request, error) {
	info := w.cfg.Engine.Info()
	bad := func(format string, args ...any) error {
		return status.Errorf(codes.InvalidArgument, format, args...)
	}
	if req.RequestId == "" || len(req.RequestId) > maxRequestIDBytes {
		return nil, bad("request_id must be 1..%d bytes, got %d", maxRequestIDBytes, len(req.RequestId))
	}
	if len(req.Prompt) == 0 {
		return nil, bad("prompt is empty: it needs at least one token")
	}
	if len(req.Prompt) >= info.MaxContext {
		return nil, bad("prompt has %d tokens; the context holds %d, output included", len(req.Prompt), info.MaxContext)
	}
	if req.MaxTokens == 0 {
		return nil, bad("max_tokens must be >= 1")
	}
	if total := len(req.Prompt) + int(req.MaxTokens); total > info.MaxContext {
		return nil, bad("max_tokens %d: prompt (%d tokens) + max_tokens = %d exceeds the context of %d", req.MaxTokens, len(req.Prompt), total, info.MaxContext)
	}
	if len(req.Generated) >= int(req.MaxTokens) {
		return nil, bad("generated has %d tokens, max_tokens is %d: nothing left to generate", len(req.Generated), req.MaxTokens)
	}
	check := func(field string, ids []int32) error {
		for i, id := range ids {
			if id < 0 || int(id) >= info.Vocab {
				return bad("%s[%d] = %d is not a token id: the vocabulary is [0, %d)", field, i, id, info.Vocab)
			}
		}
		return nil
	}
	if err := check("prompt", req.Prompt); err != nil {
		return nil, err
	}
	if err := check("generated", req.Generated); err != nil {
		return nil, err
	}
	if len(req.StopTokens) > maxStopTokens {
		return nil, bad("stop_tokens has %d ids; at most %d", len(req.StopTokens), maxStopTokens)
	}
	if err := check("stop_tokens", req.StopTokens); err != nil {
		return nil, err
	}
	p := engine.Sampling{Temperature: req.GetSampling().GetTemperature(), TopP: req.GetSampling().GetTopP(), Seed: req.GetSampling().GetSeed()}
	if err := p.Validate(); err != nil {
		return nil, bad("sampling: %v", strings.TrimPrefix(err.Error(), engine.ErrBadInput.Error()+": "))
	}
	if req.TopLogprobs > engine.MaxTopLogprobs {
		return nil, bad("top_logprobs %d: at most %d", req.TopLogprobs, engine.MaxTopLogprobs)
	}
	if req.Priority < policy.MinPriority || req.Priority > policy.MaxPriority {
		return nil, bad("priority %d: must be %d..%d (lower is more urgent, 0 the default)", req.Priority, policy.MinPriority, policy.MaxPriority)
	}
	if req.TopLogprobs > 0 && !req.Logprobs && !req.PromptLogprobs {
		return nil, bad("top_logprobs %d needs logprobs or prompt_logprobs set", req.TopLogprobs)
	}
	stop := map[int32]bool{}
	for _, id := range req.StopTokens {
		stop[id] = true
	}
	history := make([]int32, 0, len(req.Prompt)+int(req.MaxTokens))
	history = append(append(history, req.Prompt...), req.Generated...)
	now := time.Now()
	if req.Holder != "" {
		if err := validatePeerID(req.Holder); err != nil {
			return nil, err
		}
	}
	replicas, err := validateReplicas(req.Holder, req.ReplicaHolders, w.cfg.ID)
	if err != nil {
		return nil, err
	}
	r := &request{replicas: replicas, id: req.RequestId, history: history, prompt: len(req.Prompt), outStart: len(req.Generated),
		maxTokens: int(req.MaxTokens), params: p, stop: stop, arrived: now, lastToken: now, box: newMailbox(),
		holder: req.Holder, epoch: req.Epoch, logprobs: req.Logprobs, topLogprobs: int(req.TopLogprobs), promptLogprobs: req.PromptLogprobs, priority: req.Priority}
	if r.holder != "" {
		// The footprint the controller reserved on the holder when it placed
		// the request here: the same function of the same numbers (the
		// dispatch's prompt and max tokens, this worker's registered
		// capacity), so the holder can cap the request at it.
		c := w.capacity()
		r.reserved = policy.Footprint(uint32(len(req.Prompt)), req.MaxTokens, c.MaxContextTokens, c.KvBytesPerToken)
	}
	return r, nil
}

// SetHolder gives a request this worker runs its checkpoint holder, once
// the gateway learned it from the placement's commit: the gateway started
// the request here before the commit (issue 16), with no holder. The
// request's next step ships every full page from page 0 to the holder. The
// footprint reserved there is computed as for a Generate call that names
// its holder. applied is false when the worker does not run the request
// under that epoch, or it has a holder already.
func (s *inferenceServer) SetHolder(ctx context.Context, req *pb.SetHolderRequest) (*pb.SetHolderResponse, error) {
	w := s.w
	if req.RequestId == "" || len(req.RequestId) > maxRequestIDBytes {
		return nil, status.Errorf(codes.InvalidArgument, "request_id must be 1..%d bytes, got %d", maxRequestIDBytes, len(req.RequestId))
	}
	if req.Holder == "" {
		return nil, status.Error(codes.InvalidArgument, "holder is empty: name the worker that holds the request's checkpoint")
	}
	if err := validatePeerID(req.Holder); err != nil {
		return nil, err
	}
	replicas, err := validateReplicas(req.Holder, req.ReplicaHolders, w.cfg.ID)
	if err != nil {
		return nil, err
	}
	c := w.capacity()
	var applied bool
	if !w.sched.do(ctx, func() { applied = w.sched.setHolder(req.RequestId, req.Epoch, req.Holder, replicas, c) }) {
		if ctx.Err() != nil {
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		return nil, status.Error(codes.Unavailable, errShutdown.Error())
	}
	return &pb.SetHolderResponse{Applied: applied}, nil
}

// maxPrefixQueries bounds a CheckpointPrefixes call: the requests a failed
// worker served that this worker holds copies of (a worker runs at most
// a few hundred; a node's failure asks once per failed worker).
const maxPrefixQueries = 65536

// CheckpointPrefixes answers the prefix, in tokens, the checkpoint store
// holds of each request (issue 24): the leader asks before it proposes a
// MarkFailed, so that the recovery plan restores each request from its
// longest copy.
func (s *inferenceServer) CheckpointPrefixes(_ context.Context, req *pb.CheckpointPrefixesRequest) (*pb.CheckpointPrefixesResponse, error) {
	if n := len(req.RequestIds); n > maxPrefixQueries {
		return nil, status.Errorf(codes.InvalidArgument, "%d request ids, at most %d a call", n, maxPrefixQueries)
	}
	out := &pb.CheckpointPrefixesResponse{Tokens: make([]uint32, len(req.RequestIds))}
	for i, id := range req.RequestIds {
		out.Tokens[i] = uint32(s.w.store.prefixPages(id) * engine.PageTokens)
	}
	return out, nil
}

// validateReplicas checks a call's further checkpoint copies
// (replica_holders): worker ids, after a holder, at most
// policy.MaxCheckpointReplicas − 1 of them, none repeated nor the holder.
// A copy named on this worker itself (self) is left out: it would store
// its own pages.
func validateReplicas(holder string, ids []string, self string) ([]string, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	if holder == "" {
		return nil, status.Errorf(codes.InvalidArgument, "replica_holders %v without a holder: the first copy is holder", ids)
	}
	if len(ids) > policy.MaxCheckpointReplicas-1 {
		return nil, status.Errorf(codes.InvalidArgument, "%d replica_holders: at most %d beside the holder", len(ids), policy.MaxCheckpointReplicas-1)
	}
	out := make([]string, 0, len(ids))
	for i, id := range ids {
		if id == "" {
			return nil, status.Errorf(codes.InvalidArgument, "replica_holders[%d] is empty", i)
		}
		if err := validatePeerID(id); err != nil {
			return nil, err
		}
		if id == holder || slices.Contains(ids[:i], id) {
			return nil, status.Errorf(codes.InvalidArgument, "replica_holders names %q twice (holder %q)", id, holder)
		}
		if id != self {
			out = append(out, id)
		}
	}
	return out, nil
}

func validatePeerID(id string) error {
	if len(id) > 64 || strings.ContainsAny(id, " /\t\n") {
		return status.Errorf(codes.InvalidArgument, "holder %q is not a worker id", id)
	}
	return nil
}

// Checkpoint stores the pages a serving worker streams to this holder.
func (s *inferenceServer) Checkpoint(stream grpc.ClientStreamingServer[pb.CheckpointMessage, pb.CheckpointAck]) error {
	var ack pb.CheckpointAck
	for {
		m, err := stream.Recv()
		if err == io.EOF {
			return stream.SendAndClose(&ack)
		}
		if err != nil {
			return err
		}
		if m.Release {
			s.w.store.release(m.RequestId)
			continue
		}
		first, err := s.w.store.put(m.RequestId, m.ReservedBytes, m.PrefixHash, m.Data)
		if err == nil {
			ack.Stored++
			continue
		}
		// A refused page is a checkpoint that will not be there at
		// recovery: counted, and logged once per request.
		ack.Dropped++
		s.w.metrics.ckptRefused.Inc()
		if first {
			used, budget, held := s.w.store.usage()
			s.w.log.Warn("refused a checkpoint page; later refusals for this request are only counted",
				"request", m.RequestId, "page", m.PageIndex, "reason", err, "stored_bytes", used, "budget_bytes", budget, "requests_held", held)
		}
	}
}
