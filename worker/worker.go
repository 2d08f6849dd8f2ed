package worker

import (
	"context"
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
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/gossip"
	"github.com/lumen-project/lumen/internal/healthz"
	"github.com/lumen-project/lumen/internal/liveness"
	"github.com/lumen-project/lumen/internal/tlsconf"
	"github.com/lumen-project/lumen/internal/workerdir"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/loadreport"
)

// Worker is a running worker daemon.
type Worker struct {
	cfg         Config
	log         hclog.Logger
	incarnation atomic.Uint64 // bumped when the controller marked this one failed
	metrics     *metrics
	sched       *scheduler
	kv          *kvHub // the prefix cache's hashes, for WatchKV

	grpc    *grpc.Server
	lis     net.Listener
	health  *health.Server
	httpSrv *http.Server
	serf    *serf.Serf
	ctl     *ctlclient.Client
	// dialCreds are the transport credentials of this worker's calls to
	// other workers (mutual TLS when configured).
	dialCreds grpc.DialOption

	store *ckptStore
	peers *workerdir.Directory // checkpoint holders, by id

	mu        sync.Mutex // guards draining, leaving, senders, assisting, outgoing, migDone, incoming, linkFree
	draining  bool
	senders   map[string]*ckptSender
	assisting *assistSession // the drafter's open Assist stream (assist.go)
	// outgoing are the migrations out under way, by request id; migDone
	// the STARTED event's index of each one's last (a repeated event does
	// not start it again) (migrate.go).
	outgoing map[string]*migrationOut
	// linkFree is when the paced copies of migrations out queued so far
	// are through the link (sendStage).
	linkFree time.Time
	migDone  map[string]uint64
	// incoming are the migrations in this worker accepted, by request id
	// (migrate.go; made on first use).
	incoming map[string]migrationIn
	// leaving: the worker drains by migration and leaves once empty
	// (drain.go); exited closes when it has.
	leaving bool
	exited  chan struct{}

	// phase is the phase this process is in or entering (a pb.WorkerPhase);
	// phaseMu serialises its commits with registrations (progressive.go).
	phase   atomic.Int32
	phaseMu sync.Mutex
	// registered closes at the first registration.
	registered chan struct{}
	regOnce    sync.Once
	// restarted: the last run of this data directory did not shut down
	// cleanly (progressive.go); started: New returned this worker.
	restarted, started bool

	// loadKick asks the reporter (registerAndReport) to check the load;
	// reportForced makes the check report. reportMu guards reporter, which
	// the reporter goroutine and Generate's handlers (admitted) share.
	loadKick     chan struct{}
	reportForced atomic.Bool
	reportMu     sync.Mutex
	reporter     *loadreport.Reporter
	loadChecks   atomic.Uint64 // the reporter's checks so far (tests wait on it)
	stop         chan struct{}
	// stopCtx is cancelled with stop, for calls a goroutine makes until the
	// worker stops.
	stopCtx    context.Context
	cancelStop context.CancelFunc
	// recoverCtx is cancelled when Shutdown starts: a progressive recovery
	// stops there.
	recoverCtx    context.Context
	cancelRecover context.CancelFunc
	wg            sync.WaitGroup
	once          sync.Once
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
	w = &Worker{cfg: cfg, log: cfg.Logger.With("worker", cfg.ID), metrics: newMetrics(cfg.Engine.Info().Model),
		loadKick: make(chan struct{}, 1), reporter: loadreport.New(cfg.LoadRule), stop: make(chan struct{}), store: newCkptStore(cfg.CheckpointBudget),
		senders: map[string]*ckptSender{}, registered: make(chan struct{}), outgoing: map[string]*migrationOut{},
		migDone: map[string]uint64{}, exited: make(chan struct{}), kv: newKVHub()}
	w.stopCtx, w.cancelStop = context.WithCancel(context.Background())
	w.recoverCtx, w.cancelRecover = context.WithCancel(context.Background())
	w.metrics.watchPacing(cfg.Engine)
	w.metrics.watchStore(w.store)
	defer func() {
		if err != nil {
			w.Shutdown(context.Background())
		}
	}()
	if w.restarted, err = markRunning(cfg.DataDir); err != nil {
		return nil, err
	}
	inc, err := nextIncarnation(cfg.DataDir)
	if err != nil {
		return nil, err
	}
	w.incarnation.Store(inc)
	progressive := cfg.Recovery != nil && w.restarted && !cfg.Recovery.Direct
	if w.restarted && !progressive {
		w.log.Info("restarted after a failure; progressive recovery is off: loading the model at once")
	}
	if progressive {
		w.setLocalPhase(pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT)
	} else {
		if cfg.Recovery != nil {
			if err := w.loadTarget(); err != nil {
				return nil, err
			}
		}
		w.setLocalPhase(pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE)
	}
	serverTLS, clientTLS, err := cfg.TLS.Load()
	if err != nil {
		return nil, fmt.Errorf("worker: %w", err)
	}
	w.dialCreds = tlsconf.DialOption(clientTLS)
	var table workerdir.Lister // none standalone: no holder can be found
	if len(cfg.Controllers) > 0 {
		if w.ctl, err = ctlclient.New(cfg.Controllers, clientTLS); err != nil {
			return nil, err
		}
		table = w.ctl
	}
	w.peers = workerdir.New(table, w.dialCreds)
	info := cfg.Engine.Info()
	w.metrics.kvTotal.Set(float64(info.TotalPages))
	w.metrics.ckptBudget.Set(float64(cfg.CheckpointBudget))
	if w.lis, err = net.Listen("tcp", cfg.GRPCAddr); err != nil {
		return nil, fmt.Errorf("worker: listen on %s: %w", cfg.GRPCAddr, err)
	}
	w.cfg.GRPCAddr = w.lis.Addr().String()
	w.sched = newScheduler(w)
	w.goFunc(w.sched.run)
	w.grpc = grpc.NewServer(append(liveness.ServerOptions(), tlsconf.ServerOptions(serverTLS)...)...)
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
		w.serf, err = gossip.Start(gossip.Config{NodeName: cfg.ID, BindAddr: cfg.SerfAddr, Key: cfg.GossipKey, Logger: w.log.Named("serf"),
			Tags: map[string]string{gossip.TagRole: gossip.RoleWorker, gossip.TagGRPCAddr: w.cfg.GRPCAddr,
				gossip.TagIncarnation: strconv.FormatUint(inc, 10)}})
		if err != nil {
			return nil, err
		}
		if len(cfg.Join) > 0 {
			w.goFunc(w.joinSerf)
		}
	}
	if w.ctl != nil {
		w.goFunc(w.registerAndReport)
		w.goFunc(w.reconcileHolds)
		w.goFunc(w.watchEvents)
	}
	if cfg.GPUHealth != nil {
		w.goFunc(w.watchGPU)
	}
	w.log.Info("worker running", "grpc", w.cfg.GRPCAddr, "incarnation", inc, "engine", info.Backend,
		"model", info.Model, "kv_pages", info.TotalPages, "phase", phaseName(w.Phase()))
	if progressive {
		w.goFunc(w.recoverProgressively)
	}
	w.started = true
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
	mux.HandleFunc("/healthz", healthz.OK)
	mux.HandleFunc("/readyz", func(rw http.ResponseWriter, _ *http.Request) {
		healthz.Stamp(rw)
		if w.isDraining() || w.isLeaving() || !w.cfg.Engine.Loaded() {
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
		H2DBytesPerSec: 25e9, MaxRunning: uint32(w.cfg.MaxRunning)}
	if p := w.cfg.Profile; p != nil {
		c.KvBytesPerToken, c.H2DBytesPerSec = uint64(p.KVBytesPerToken()), p.H2DBytesPerSec
	}
	return c
}

// registerAndReport registers (retrying until a controller answers), then
// checks the load every LoadInterval, and at once when a request arrives or
// an engine step ends, and reports it when LoadRule says so
// (worker/loadreport: a report is a Raft entry). A report refused with
// ReasonIncarnationFailed means the controller marked this incarnation
// failed while the process ran on (a pause, a partition): the worker then
// hands back what it was serving and registers anew. An idle worker sends
// no report, so the event watch asks for one when it sees this
// incarnation marked failed (reportNow). (A report refused because another
// process registered a newer incarnation under this id is only logged: two
// workers must not fight over one id.)
func (w *Worker) registerAndReport() {
	if !w.register() {
		return
	}
	w.resetReporter()
	t := time.NewTicker(w.cfg.LoadInterval)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-t.C:
		case <-w.loadKick:
		}
		w.loadChecks.Add(1)
		rec := w.Load()
		now := time.Now()
		forced := w.reportForced.Swap(false)
		w.reportMu.Lock()
		reason, due := w.reporter.Due(now, rec)
		w.reportMu.Unlock()
		if forced && !due {
			reason, due = reasonMarkedFailed, true
		}
		if !due {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := w.ctl.ReportLoad(ctx, &pb.ReportLoadRequest{Load: rec})
		cancel()
		switch {
		case err == nil:
			w.reportMu.Lock()
			w.reporter.Sent(now, rec)
			w.reportMu.Unlock()
			w.metrics.loadReports.WithLabelValues(string(reason)).Inc()
		case ctlclient.Reason(err) == ctlclient.ReasonIncarnationFailed && !w.isDraining():
			w.log.Warn("the controller refused this incarnation's load; rejoining as a new incarnation", "error", status.Convert(err).Message())
			if err := w.rejoin(); err != nil {
				w.log.Error("could not rejoin", "error", err)
				continue
			}
			if !w.register() {
				return
			}
			w.resetReporter()
		default:
			// Not Sent: the next check finds the same report due.
			w.log.Debug("load report failed", "error", err)
		}
	}
}

// reasonMarkedFailed labels a report sent because the event watch saw this
// incarnation marked failed (reportNow): its refusal makes the worker
// rejoin.
const reasonMarkedFailed loadreport.Reason = "marked_failed"

// resetReporter makes the next check report (a new registration: the
// table holds no load of this incarnation yet) and kicks it.
func (w *Worker) resetReporter() {
	w.reportMu.Lock()
	w.reporter.Reset()
	w.reportMu.Unlock()
	w.kickLoad()
}

// kickLoad has the reporter check the load now.
func (w *Worker) kickLoad() {
	select {
	case w.loadKick <- struct{}{}:
	default:
	}
}

// reportNow sends a load report at the next check whatever the rule says.
func (w *Worker) reportNow() {
	w.reportForced.Store(true)
	w.kickLoad()
}

// admitted tells the reporter a request of prompt tokens was accepted: the
// controller counts its dispatch as pending here until the next report.
// (One admitted while a report is on the wire is cleared with it: the
// next record counts the request, so only the reporter's estimate of the
// controller's count is one off until then.)
func (w *Worker) admitted(prompt int) {
	w.reportMu.Lock()
	w.reporter.Admitted(prompt)
	w.reportMu.Unlock()
	w.kickLoad()
}

// register registers the current incarnation, retrying until a controller
// answers; false when the worker stops first.
func (w *Worker) register() bool {
	info := w.cfg.Engine.Info()
	serfAddr := ""
	if w.serf != nil {
		serfAddr = gossip.Addr(w.serf)
	}
	w.phaseMu.Lock()
	defer w.phaseMu.Unlock()
	inc := w.incarnation.Load()
	// A worker still loading its model registers in LOADING_DRAFT (the only
	// recovery phase a registration may name), then commits the phase it
	// is in.
	phase, regPhase := w.Phase(), pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE
	if recovering(phase) {
		regPhase = pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT
	}
	reg := &pb.RegisterWorkerRequest{Worker: &pb.Worker{Id: w.cfg.ID, Incarnation: inc, GrpcAddr: w.cfg.GRPCAddr,
		SerfAddr: serfAddr, ModelId: info.Model, Capacity: w.capacity(), Phase: regPhase, Node: w.cfg.Node, Rack: w.cfg.Rack}}
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, 2*time.Second) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := w.ctl.RegisterWorker(ctx, reg)
		cancel()
		if err == nil {
			w.log.Info("registered with the controller", "incarnation", inc, "phase", phaseName(regPhase))
			if phase != regPhase && recovering(phase) && !w.commitPhaseLocked(phase, "re-registered while recovering") {
				return false
			}
			w.regOnce.Do(func() { close(w.registered) })
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
	running, waiting, head, qw, queued := w.sched.snapshot(w.cfg.QueueWindow)
	info := w.cfg.Engine.Info()
	free := w.cfg.Engine.FreePages()
	used := info.TotalPages - free
	w.metrics.kvUsed.Set(float64(used))
	if info.TotalPages > 0 {
		w.metrics.kvUsage.Set(float64(used) / float64(info.TotalPages))
	}
	w.metrics.queueWait.Set(qw / 1000)
	ckUsed, ckBudget, _ := w.store.usage()
	return &pb.LoadRecord{WorkerId: w.cfg.ID, Incarnation: w.incarnation.Load(), QueueWaitMs: qw,
		FreeCheckpointBytes: ckBudget - ckUsed, StoredCheckpointBytes: ckUsed, Running: uint32(running), Waiting: uint32(waiting),
		KvPagesUsed: uint64(used), KvPagesTotal: uint64(info.TotalPages), QueueHeadPages: uint64(head), Queued: queued,
		QueuedPages: uint64(w.sched.queuedPages()), HighPriority: uint32(w.sched.highPriority())}
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
		// A recovery in progress stops: its phase changes would be refused
		// from DRAINING.
		w.cancelRecover()
		// The drain plans over this worker's requests round by round:
		// every change is reported (loadreport.Reporter.Eager).
		w.reportMu.Lock()
		w.reporter.Eager(true)
		w.reportMu.Unlock()
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
		w.cancelStop()
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
		if w.peers != nil {
			w.peers.Close()
		}
		if w.ctl != nil {
			w.ctl.Close()
		}
		defer close(w.exited)
		// A clean shutdown: the next start is not a restart after a failure.
		// (A start that failed leaves a failed run's marker in place.)
		if w.started || !w.restarted {
			if err := clearRunning(w.cfg.DataDir); err != nil {
				w.log.Warn("could not remove the run marker; the next start will recover progressively", "error", err)
			}
		}
	})
}

func (w *Worker) inFlight() int {
	r, wt, _, _, _ := w.sched.snapshot(time.Hour)
	return r + wt
}

func (w *Worker) setPhase(phase pb.WorkerPhase, reason string) {
	w.setLocalPhase(phase)
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
