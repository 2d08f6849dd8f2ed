// Package gateway is lumen's OpenAI-compatible HTTP front end. It keeps the
// journal of every in-flight request — its prompt and each output token, in
// index order — places requests through the controller, streams them from
// the chosen worker, and resumes a broken stream wherever the controller
// says the request continues, so a failure costs a client a delay, never an
// error, a gap or a repeated token.
package gateway

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/tokenizer"
)

// Config configures a gateway.
type Config struct {
	// Addr is the HTTP listen address (default 127.0.0.1:8080).
	Addr string
	// Controllers are controller gRPC addresses. Required.
	Controllers []string
	// Model is the model name clients ask for (default lumen-tiny).
	Model string
	// MaxContext is the context length when no worker reports one
	// (default 2048).
	MaxContext int
	// APIKeys, when set, are the bearer tokens accepted.
	APIKeys []string
	// TLSCert and TLSKey serve HTTPS when both are set.
	TLSCert, TLSKey string
	// MaxBodyBytes caps a request body (default 1 MiB).
	MaxBodyBytes int64
	// MaxConcurrent caps requests in flight; more get 429 (default 1024).
	MaxConcurrent int
	// ResumeTimeout bounds the search for where a broken stream continues
	// (default 60 s).
	ResumeTimeout time.Duration
	// DispatchTimeout bounds placing a request (default 10 s); past it the
	// client gets 503.
	DispatchTimeout time.Duration
	Logger          hclog.Logger
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{Addr: "127.0.0.1:8080", Model: "lumen-tiny", MaxContext: 2048, MaxBodyBytes: 1 << 20,
		MaxConcurrent: 1024, ResumeTimeout: 60 * time.Second, DispatchTimeout: 10 * time.Second}
}

// Gateway serves the OpenAI API.
type Gateway struct {
	cfg     Config
	log     hclog.Logger
	ctl     *ctlclient.Client
	journal *journal
	metrics *metrics
	tok     tokenizer.Tokenizer
	admit   chan struct{}
	done    chan string // ids to Complete

	mu         sync.Mutex // guards workers, conns, maxContext, readyAt, ready
	workers    map[string]string
	conns      map[string]*grpc.ClientConn
	maxContext int
	readyAt    time.Time
	ready      error
	reporting  map[string]bool // workers being reported unreachable
	// streams holds the cancel of each request's live worker stream, by
	// dispatch id: a placement moved by the controller cuts it.
	streams map[string]context.CancelFunc

	srv  *http.Server
	lis  net.Listener
	stop chan struct{}
	wg   sync.WaitGroup
	once sync.Once
}

// New starts a gateway.
func New(cfg Config) (*Gateway, error) {
	if len(cfg.Controllers) == 0 {
		return nil, errors.New("gateway: at least one controller address is required")
	}
	if (cfg.TLSCert == "") != (cfg.TLSKey == "") {
		return nil, errors.New("gateway: -tls-cert and -tls-key must be given together")
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: "gateway"})
	}
	ctl, err := ctlclient.New(cfg.Controllers, nil)
	if err != nil {
		return nil, err
	}
	g := &Gateway{cfg: cfg, log: cfg.Logger, ctl: ctl, journal: newJournal(), metrics: newMetrics(),
		admit: make(chan struct{}, cfg.MaxConcurrent), done: make(chan string, 4096),
		workers: map[string]string{}, conns: map[string]*grpc.ClientConn{}, maxContext: cfg.MaxContext, stop: make(chan struct{}),
		streams: map[string]context.CancelFunc{}}
	g.lis, err = net.Listen("tcp", cfg.Addr)
	if err != nil {
		ctl.Close()
		return nil, fmt.Errorf("gateway: listen on %s: %w", cfg.Addr, err)
	}
	g.srv = &http.Server{Handler: g.Handler(), ReadHeaderTimeout: 10 * time.Second}
	g.wg.Add(3)
	go func() { defer g.wg.Done(); g.watchMoves() }()
	go func() {
		defer g.wg.Done()
		var err error
		if cfg.TLSCert != "" {
			err = g.srv.ServeTLS(g.lis, cfg.TLSCert, cfg.TLSKey)
		} else {
			err = g.srv.Serve(g.lis)
		}
		if err != nil && !errors.Is(err, http.ErrServerClosed) {
			g.log.Error("HTTP server stopped", "error", err)
		}
	}()
	go func() { defer g.wg.Done(); g.completer() }()
	return g, nil
}

// Addr is the address the gateway listens on.
func (g *Gateway) Addr() string { return g.lis.Addr().String() }

// Close stops serving (in-flight streams end) and flushes Completes.
func (g *Gateway) Close() {
	g.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = g.srv.Shutdown(ctx)
		cancel()
		close(g.stop)
		g.wg.Wait()
		g.mu.Lock()
		for _, cc := range g.conns {
			cc.Close()
		}
		g.mu.Unlock()
		g.ctl.Close()
	})
}

// Handler is the HTTP API.
func (g *Gateway) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { g.serve(w, r, false) })
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { g.serve(w, r, true) })
	mux.HandleFunc("GET /v1/models", g.models)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", g.readyz)
	mux.Handle("GET /metrics", g.metrics.handler())
	return mux
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, e *apiError) {
	writeJSON(w, e.Status, map[string]any{"error": e})
}

func (g *Gateway) authorized(r *http.Request) bool {
	if len(g.cfg.APIKeys) == 0 {
		return true
	}
	got := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
	for _, k := range g.cfg.APIKeys {
		if subtle.ConstantTimeCompare([]byte(got), []byte(k)) == 1 {
			return true
		}
	}
	return false
}

func (g *Gateway) models(w http.ResponseWriter, r *http.Request) {
	if !g.authorized(r) {
		writeError(w, errUnauthorized)
		return
	}
	writeJSON(w, 200, map[string]any{"object": "list", "data": []map[string]any{
		{"id": g.cfg.Model, "object": "model", "created": 1767225600, "owned_by": "lumen"}}})
}

var errUnauthorized = &apiError{Status: 401, Type: "invalid_request_error", Code: "invalid_api_key",
	Message: "Incorrect API key provided: send Authorization: Bearer <key>"}

// readyz: a controller leader answers and at least one worker is in full
// service and reachable.
func (g *Gateway) readyz(w http.ResponseWriter, r *http.Request) {
	if err := g.readiness(r.Context()); err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	fmt.Fprintln(w, "ready")
}

func (g *Gateway) readiness(ctx context.Context) error {
	g.mu.Lock()
	if time.Since(g.readyAt) < time.Second {
		err := g.ready
		g.mu.Unlock()
		return err
	}
	g.mu.Unlock()
	err := func() error {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		st, err := g.ctl.ClusterStatus(ctx)
		if err != nil || st.LeaderId == "" {
			return fmt.Errorf("no controller leader: %v", err)
		}
		addrs, err := g.refreshWorkers(ctx)
		if err != nil {
			return err
		}
		for _, addr := range addrs {
			d := net.Dialer{Timeout: 500 * time.Millisecond}
			if c, err := d.DialContext(ctx, "tcp", addr); err == nil {
				c.Close()
				return nil
			}
		}
		return fmt.Errorf("no worker in full service is reachable (%d registered)", len(addrs))
	}()
	g.mu.Lock()
	g.readyAt, g.ready = time.Now(), err
	g.mu.Unlock()
	return err
}

// refreshWorkers reads the workers table (a stale read: addresses only) and
// returns the addresses of workers in full service.
func (g *Gateway) refreshWorkers(ctx context.Context) ([]string, error) {
	resp, err := g.ctl.ListWorkers(ctx, &pb.ListWorkersRequest{Consistency: pb.Consistency_CONSISTENCY_STALE})
	if err != nil {
		return nil, fmt.Errorf("list workers: %w", err)
	}
	var live []string
	maxCtx := 0
	g.mu.Lock()
	for _, w := range resp.Workers {
		g.workers[w.Id] = w.GrpcAddr
		if w.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
			live = append(live, w.GrpcAddr)
			if c := int(w.GetCapacity().GetMaxContextTokens()); c > 0 && (maxCtx == 0 || c < maxCtx) {
				maxCtx = c
			}
		}
	}
	if maxCtx > 0 {
		g.maxContext = maxCtx
	}
	g.mu.Unlock()
	return live, nil
}

// workerConn returns a connection to a worker by id.
func (g *Gateway) workerConn(ctx context.Context, id string) (*grpc.ClientConn, error) {
	g.mu.Lock()
	addr, ok := g.workers[id]
	g.mu.Unlock()
	if !ok {
		if _, err := g.refreshWorkers(ctx); err != nil {
			return nil, err
		}
		g.mu.Lock()
		addr, ok = g.workers[id]
		g.mu.Unlock()
		if !ok {
			return nil, fmt.Errorf("gateway: worker %q is not in the workers table", id)
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if cc, ok := g.conns[addr]; ok {
		return cc, nil
	}
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	g.conns[addr] = cc
	return cc, nil
}

func newID(prefix string) string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// completer sends Complete for finished requests in batches.
func (g *Gateway) completer() {
	var batch []string
	flush := func() {
		if len(batch) == 0 {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if _, err := g.ctl.Complete(ctx, &pb.CompleteRequest{RequestIds: batch}); err != nil {
			g.log.Warn("complete failed", "requests", len(batch), "error", err)
		}
		cancel()
		batch = batch[:0]
	}
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case id := <-g.done:
			batch = append(batch, id)
			if len(batch) >= 256 {
				flush()
			}
		case <-t.C:
			flush()
		case <-g.stop:
			for {
				select {
				case id := <-g.done:
					batch = append(batch, id)
				default:
					flush()
					return
				}
			}
		}
	}
}

// watchMoves follows the controller's events and cuts the worker stream of
// any in-flight request whose placement moved: a worker that hangs (and
// breaks no stream) is caught by Serf, and its requests resume where the
// recovery plan put them.
func (g *Gateway) watchMoves() {
	var from uint64
	for {
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			select {
			case <-g.stop:
			case <-ctx.Done():
			}
			cancel()
		}()
		if from == 0 {
			if st, err := g.ctl.ClusterStatus(ctx); err == nil {
				from = st.AppliedIndex
			}
		}
		stream, err := g.ctl.WatchEvents(ctx, from)
		for err == nil {
			var ev *pb.Event
			if ev, err = stream.Recv(); err != nil {
				break
			}
			from = ev.Index
			if mv := ev.GetPlacementMoved(); mv != nil {
				g.mu.Lock()
				if c, ok := g.streams[mv.Placement.RequestId]; ok {
					c()
				}
				g.mu.Unlock()
			}
		}
		cancel()
		if status.Code(err) == codes.OutOfRange {
			from = 0 // too far behind: start from now
		}
		select {
		case <-g.stop:
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
}
