package worker

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/serf/serf"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/gossip"
	"github.com/lumen-project/lumen/internal/liveness"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// Errors a Generate call can end with.
var (
	errShutdown = errors.New("worker: shutting down; resume the request elsewhere")
	// errRejoined ends the calls of an incarnation the controller marked
	// failed while this process ran on (paused, cut off): its requests were
	// moved by a recovery plan.
	errRejoined  = errors.New("worker: this incarnation was marked failed and its requests moved; resume where the controller placed them")
	errDraining  = errors.New("worker: draining; not taking new requests")
	errQueueFull = errors.New("worker: waiting queue full")
	errTooLarge  = errors.New("worker: request does not fit in the KV cache")
)

// Worker is a running worker daemon.
type Worker struct {
	cfg         Config
	log         hclog.Logger
	incarnation atomic.Uint64 // bumped when the controller marked this one failed
	metrics     *metrics
	sched       *scheduler

	grpc    *grpc.Server
	lis     net.Listener
	health  *health.Server
	httpSrv *http.Server
	serf    *serf.Serf
	ctl     *ctlclient.Client

	store *ckptStore

	mu        sync.Mutex // guards draining, senders, peerAddrs, peerConns
	draining  bool
	senders   map[string]*ckptSender
	peerAddrs map[string]string
	peerConns map[string]*grpc.ClientConn

	loadKick chan struct{}
	stop     chan struct{}
	wg       sync.WaitGroup
	once     sync.Once
}

// New starts a worker: the scheduler, the gRPC server, Serf, registration
// and load reports.
func New(cfg Config) (w *Worker, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: "worker", Level: hclog.Info})
	}
	w = &Worker{cfg: cfg, log: cfg.Logger.With("worker", cfg.ID), metrics: newMetrics(),
		loadKick: make(chan struct{}, 1), stop: make(chan struct{}), store: newCkptStore(cfg.CheckpointBudget),
		senders: map[string]*ckptSender{}, peerAddrs: map[string]string{}, peerConns: map[string]*grpc.ClientConn{}}
	w.metrics.watchPacing(cfg.Engine)
	defer func() {
		if err != nil {
			w.Shutdown(context.Background())
		}
	}()
	inc, err := nextIncarnation(cfg.DataDir)
	if err != nil {
		return nil, err
	}
	w.incarnation.Store(inc)
	info := cfg.Engine.Info()
	w.metrics.kvTotal.Set(float64(info.TotalPages))
	if w.lis, err = net.Listen("tcp", cfg.GRPCAddr); err != nil {
		return nil, fmt.Errorf("worker: listen on %s: %w", cfg.GRPCAddr, err)
	}
	w.cfg.GRPCAddr = w.lis.Addr().String()
	w.sched = newScheduler(w)
	w.goFunc(w.sched.run)
	w.grpc = grpc.NewServer(liveness.ServerOptions()...)
	pb.RegisterInferenceServer(w.grpc, &inferenceServer{w: w})
	w.health = health.NewServer()
	healthpb.RegisterHealthServer(w.grpc, w.health)
	reflection.Register(w.grpc)
	w.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	w.health.SetServingStatus(pb.Inference_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	w.goFunc(func() { _ = w.grpc.Serve(w.lis) })
	if cfg.HTTPAddr != "" {
		if err := w.serveHTTP(); err != nil {
			return nil, err
		}
	}
	if cfg.SerfAddr != "" {
		w.serf, err = gossip.Start(gossip.Config{NodeName: cfg.ID, BindAddr: cfg.SerfAddr, Logger: w.log.Named("serf"),
			Tags: map[string]string{gossip.TagRole: gossip.RoleWorker, gossip.TagGRPCAddr: w.cfg.GRPCAddr,
				gossip.TagIncarnation: strconv.FormatUint(inc, 10)}})
		if err != nil {
			return nil, err
		}
		if len(cfg.Join) > 0 {
			w.goFunc(w.joinSerf)
		}
	}
	if len(cfg.Controllers) > 0 {
		if w.ctl, err = ctlclient.New(cfg.Controllers, nil); err != nil {
			return nil, err
		}
		w.goFunc(w.registerAndReport)
	}
	w.log.Info("worker running", "grpc", w.cfg.GRPCAddr, "incarnation", inc, "engine", info.Backend,
		"model", info.Model, "kv_pages", info.TotalPages)
	return w, nil
}

func (w *Worker) goFunc(f func()) {
	w.wg.Add(1)
	go func() { defer w.wg.Done(); f() }()
}

// GRPCAddr is the address Generate is served on.
func (w *Worker) GRPCAddr() string { return w.cfg.GRPCAddr }

// Incarnation is this run's incarnation.
func (w *Worker) Incarnation() uint64 { return w.incarnation.Load() }

// nextIncarnation bumps the counter in dataDir, or uses the clock.
func nextIncarnation(dataDir string) (uint64, error) {
	now := uint64(time.Now().UnixNano())
	if dataDir == "" {
		return now, nil
	}
	if err := os.MkdirAll(dataDir, 0o755); err != nil {
		return 0, err
	}
	path := filepath.Join(dataDir, "incarnation")
	var prev uint64
	if b, err := os.ReadFile(path); err == nil {
		prev, _ = strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	}
	next := max(prev+1, now)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(strconv.FormatUint(next, 10)), 0o644); err != nil {
		return 0, err
	}
	return next, os.Rename(tmp, path)
}

func (w *Worker) serveHTTP() error {
	lis, err := net.Listen("tcp", w.cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("worker: listen HTTP on %s: %w", w.cfg.HTTPAddr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(w.metrics.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(rw http.ResponseWriter, _ *http.Request) { fmt.Fprintln(rw, "ok") })
	mux.HandleFunc("/readyz", func(rw http.ResponseWriter, _ *http.Request) {
		if w.isDraining() || !w.cfg.Engine.Loaded() {
			http.Error(rw, "not ready", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(rw, "ready")
	})
	w.httpSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	w.goFunc(func() { _ = w.httpSrv.Serve(lis) })
	return nil
}

func (w *Worker) joinSerf() {
	wait := 100 * time.Millisecond
	for {
		if _, err := w.serf.Join(w.cfg.Join, true); err == nil {
			return
		}
		select {
		case <-w.stop:
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, 2*time.Second)
	}
}

// capacity is what the worker registers with.
func (w *Worker) capacity() *pb.Capacity {
	info := w.cfg.Engine.Info()
	c := &pb.Capacity{KvPagesTotal: uint64(info.TotalPages), CheckpointBudgetBytes: w.cfg.CheckpointBudget,
		KvBytesPerToken: uint64(info.KVBytesPerToken), MaxContextTokens: uint32(info.MaxContext),
		H2DBytesPerSec: 25e9, PageTokens: engine.PageTokens}
	if p := w.cfg.Profile; p != nil {
		c.KvBytesPerToken, c.H2DBytesPerSec = uint64(p.KVBytesPerToken()), p.H2DBytesPerSec
	}
	return c
}

// registerAndReport registers (retrying until a controller answers), then
// reports load every LoadInterval and at once when it changes a lot. A
// report refused with ReasonIncarnationFailed means the controller marked
// this incarnation failed while the process ran on (a pause, a partition):
// the worker then hands back what it was serving and registers anew. (A
// report refused because another process registered a newer incarnation
// under this id is only logged: two workers must not fight over one id.)
func (w *Worker) registerAndReport() {
	if !w.register() {
		return
	}
	t := time.NewTicker(w.cfg.LoadInterval)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
		case <-w.loadKick:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := w.ctl.ReportLoad(ctx, &pb.ReportLoadRequest{Load: w.Load()})
		cancel()
		switch {
		case err == nil:
		case ctlclient.Reason(err) == ctlclient.ReasonIncarnationFailed && !w.isDraining():
			w.log.Warn("the controller refused this incarnation's load; rejoining as a new incarnation", "error", status.Convert(err).Message())
			if err := w.rejoin(); err != nil {
				w.log.Error("could not rejoin", "error", err)
				continue
			}
			if !w.register() {
				return
			}
		default:
			w.log.Debug("load report failed", "error", err)
		}
	}
}

// register registers the current incarnation, retrying until a controller
// answers; false when the worker stops first.
func (w *Worker) register() bool {
	info := w.cfg.Engine.Info()
	serfAddr := ""
	if w.serf != nil {
		serfAddr = gossip.Addr(w.serf)
	}
	inc := w.incarnation.Load()
	reg := &pb.RegisterWorkerRequest{Worker: &pb.Worker{Id: w.cfg.ID, Incarnation: inc, GrpcAddr: w.cfg.GRPCAddr,
		SerfAddr: serfAddr, ModelId: info.Model, Capacity: w.capacity()}}
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, 2*time.Second) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := w.ctl.RegisterWorker(ctx, reg)
		cancel()
		if err == nil {
			w.log.Info("registered with the controller", "incarnation", inc)
			return true
		}
		w.log.Warn("registration failed; retrying", "error", err)
		select {
		case <-w.stop:
			return false
		case <-time.After(wait):
		}
	}
}

// rejoin makes this process a new incarnation: every call in flight ends
// Unavailable (the controller has moved those requests; their gateways
// resume them there, from their checkpoints), the checkpoints it held for
// others are dropped (the controller released those reservations), and
// Serf gossips the new incarnation, so a later failure is detected as this
// one's.
func (w *Worker) rejoin() error {
	inc, err := nextIncarnation(w.cfg.DataDir)
	if err != nil {
		return err
	}
	old := w.incarnation.Swap(inc)
	select {
	case w.sched.reset <- errRejoined:
	case <-w.sched.done:
	}
	w.store.reset()
	if w.serf != nil {
		tags := maps.Clone(w.serf.LocalMember().Tags)
		tags[gossip.TagIncarnation] = strconv.FormatUint(inc, 10)
		if err := w.serf.SetTags(tags); err != nil {
			w.log.Warn("could not gossip the new incarnation", "error", err)
		}
	}
	w.metrics.rejoins.Inc()
	w.log.Info("rejoining", "old_incarnation", old, "incarnation", inc)
	return nil
}

// Load is the worker's current load record.
func (w *Worker) Load() *pb.LoadRecord {
	running, waiting, head, qw := w.sched.snapshot(w.cfg.QueueWindow)
	info := w.cfg.Engine.Info()
	free := w.cfg.Engine.FreePages()
	used := info.TotalPages - free
	w.metrics.kvUsed.Set(float64(used))
	ckUsed, ckBudget := w.store.usage()
	return &pb.LoadRecord{WorkerId: w.cfg.ID, Incarnation: w.incarnation.Load(), QueueWaitMs: qw,
		FreeCheckpointBytes: ckBudget - ckUsed, ReservedCheckpointBytes: ckUsed, Running: uint32(running), Waiting: uint32(waiting),
		KvPagesUsed: uint64(used), KvPagesTotal: uint64(info.TotalPages), QueueHeadPages: uint64(head)}
}

func (w *Worker) isDraining() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.draining
}

// Shutdown drains: it refuses new requests, tells the controller, lets
// in-flight requests finish until ctx or DrainTimeout ends, hands the rest
// back (their streams end Unavailable, so the gateway resumes them
// elsewhere), leaves, and stops. Idempotent.
func (w *Worker) Shutdown(ctx context.Context) {
	w.once.Do(func() {
		w.mu.Lock()
		w.draining = true
		w.mu.Unlock()
		if w.health != nil {
			w.health.SetServingStatus(pb.Inference_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_NOT_SERVING)
		}
		w.setPhase(pb.WorkerPhase_WORKER_PHASE_DRAINING, "graceful shutdown")
		if w.sched != nil {
			drain, cancel := context.WithTimeout(ctx, w.cfg.DrainTimeout)
			for w.inFlight() > 0 && drain.Err() == nil {
				select {
				case <-drain.Done():
				case <-time.After(20 * time.Millisecond):
				}
			}
			cancel()
			close(w.sched.stop)
			<-w.sched.done
		}
		w.setPhase(pb.WorkerPhase_WORKER_PHASE_LEFT, "graceful shutdown")
		close(w.stop)
		if w.serf != nil {
			_ = w.serf.Leave()
			_ = w.serf.Shutdown()
		}
		if w.grpc != nil {
			w.grpc.Stop()
		} else if w.lis != nil {
			w.lis.Close()
		}
		if w.httpSrv != nil {
			_ = w.httpSrv.Close()
		}
		w.wg.Wait()
		if w.ctl != nil {
			w.ctl.Close()
		}
		w.mu.Lock()
		for _, cc := range w.peerConns {
			cc.Close()
		}
		w.mu.Unlock()
	})
}

func (w *Worker) inFlight() int {
	r, wt, _, _ := w.sched.snapshot(time.Hour)
	return r + wt
}

func (w *Worker) setPhase(phase pb.WorkerPhase, reason string) {
	if w.ctl == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if _, err := w.ctl.SetWorkerPhase(ctx, &pb.SetWorkerPhaseRequest{WorkerId: w.cfg.ID, Incarnation: w.incarnation.Load(),
		Phase: phase, Reason: reason}); err != nil {
		w.log.Warn("could not set phase", "phase", phase, "error", err)
	}
}

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
	select {
	case w.sched.submit <- r:
	case <-stream.Context().Done():
		return status.FromContextError(stream.Context().Err()).Err()
	case <-w.stop:
		return status.Error(codes.Unavailable, errShutdown.Error())
	}
	select {
	case w.loadKick <- struct{}{}:
	default:
	}
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
			if ev.resp.Done {
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
	return &request{id: req.RequestId, history: history, prompt: len(req.Prompt), outStart: len(req.Generated),
		maxTokens: int(req.MaxTokens), params: p, stop: stop, arrived: now, lastToken: now, box: newMailbox(),
		holder: req.Holder}, nil
}

func validatePeerID(id string) error {
	if len(id) > 64 || strings.ContainsAny(id, " /\t\n") {
		return status.Errorf(codes.InvalidArgument, "holder %q is not a worker id", id)
	}
	return nil
}
