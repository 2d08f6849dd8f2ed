// Package gateway is lumen's OpenAI-compatible HTTP front end. Each request's
// handler keeps its journal entry — the prompt and each output token, in
// index order — places the request through the controller, streams it from
// the chosen worker, and resumes a broken stream wherever the controller
// says the request continues, so a failure costs a client a delay, never a
// gap or a repeated token; a request that cannot be resumed within
// Config.ResumeTimeout ends with an explicit error.
package gateway

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/healthz"
	"github.com/lumen-project/lumen/internal/liveness"
	"github.com/lumen-project/lumen/internal/placer"
	"github.com/lumen-project/lumen/internal/tlsconf"
	"github.com/lumen-project/lumen/internal/workerdir"
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
	// ClusterTLS, when enabled, dials the controllers and the workers with
	// mutual TLS (their -tls-* CA; a certificate it signs).
	ClusterTLS tlsconf.Files
	// MaxBodyBytes caps a request body (default 1 MiB).
	MaxBodyBytes int64
	// MaxConcurrent caps requests in flight; more get 429 (default 1024).
	// It must be at least 1.
	MaxConcurrent int
	// ResumeTimeout is one request's deadline for resuming (default 60 s).
	// It starts when the request's worker stream breaks and covers every
	// attempt that follows — finding where the request continues, calling
	// the worker there, and each further break — until a new token
	// arrives, which ends the resume. Past it the client gets an explicit
	// error (code resume_timeout). Raise it when recoveries are expected
	// to take longer than a minute (a large model's cold restart).
	ResumeTimeout time.Duration
	// DispatchTimeout bounds placing a request (default 10 s); past it the
	// client gets 503.
	DispatchTimeout time.Duration
	// KeepaliveTime is how long a connection to a worker or to the
	// controller the gateway watches may be idle before the gateway pings
	// it (default 10 s, gRPC's minimum); KeepaliveTimeout how long the ping
	// may go unanswered before the connection is closed and its streams
	// break (default 5 s). Together they bound how long a stream to a
	// paused (SIGSTOP) or partitioned peer goes unnoticed.
	KeepaliveTime    time.Duration
	KeepaliveTimeout time.Duration
	// WatchProbeInterval is how often the gateway asks the controller
	// replica whose event stream it follows whether it still knows a
	// leader (default 2 s). A replica that does not answer within the
	// interval, or has lost its leader (it is cut off from the quorum, and
	// its stream would go silent), is left for the next one.
	WatchProbeInterval time.Duration
	// Name names the gateway's controller session, for operators (default
	// host@listen-address): printable ASCII without spaces.
	Name string
	// SessionTTL is how long the controller keeps the gateway's session
	// without a renewal (default DefaultSessionTTL, 10 s; 1 s..1 h). When a
	// gateway dies or is cut off from the quorum this long, its placements
	// are completed and their checkpoint reservations freed. It renews
	// SessionTTL/3 after the last renewal that went through and retries a
	// failed one within a second. Shorter frees a dead gateway's
	// reservations sooner; longer rides out longer controller outages.
	SessionTTL time.Duration
	// PrefixRouting (issue 25) follows every live worker's prefix-cache
	// events (WatchKV) into an index, and places each new request by
	// placer's prefix-aware score: the worker's freeness plus the pages of
	// the prompt its cache holds, discounted by its queue (kvwatch.go).
	// Off: freeness alone, no streams.
	PrefixRouting bool
	// Pprof serves Go's profiles under /debug/pprof/ (benchmarks).
	Pprof  bool
	Logger hclog.Logger

	// headless: the gateway of one cell inside Cells, which listens and
	// serves HTTP for it (no listener of its own; Addr is not used).
	headless bool
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{Addr: "127.0.0.1:8080", Model: "lumen-tiny", MaxContext: 2048, MaxBodyBytes: 1 << 20,
		MaxConcurrent: 1024, ResumeTimeout: 60 * time.Second, DispatchTimeout: 10 * time.Second,
		KeepaliveTime: liveness.DefaultTime, KeepaliveTimeout: liveness.DefaultTimeout, WatchProbeInterval: 2 * time.Second,
		SessionTTL: DefaultSessionTTL}
}

// Validate says what is wrong with the configuration, naming each field.
func (c *Config) Validate() error {
	var errs []error
	if c.Addr == "" {
		errs = append(errs, errors.New("an Addr to listen on is required"))
	}
	if len(c.Controllers) == 0 {
		errs = append(errs, errors.New("at least one controller address is required"))
	}
	if (c.TLSCert == "") != (c.TLSKey == "") {
		errs = append(errs, errors.New("-tls-cert and -tls-key must be given together"))
	}
	if c.Model == "" {
		errs = append(errs, errors.New("a Model name is required"))
	}
	if c.MaxContext < 1 {
		errs = append(errs, fmt.Errorf("MaxContext (%d) must be at least 1 token", c.MaxContext))
	}
	if c.MaxBodyBytes < 1 {
		errs = append(errs, fmt.Errorf("MaxBodyBytes (%d) must be at least 1", c.MaxBodyBytes))
	}
	if c.MaxConcurrent < 1 {
		errs = append(errs, fmt.Errorf("MaxConcurrent (%d) must be at least 1: with no slot every request is answered 429", c.MaxConcurrent))
	}
	if c.ResumeTimeout <= 0 || c.DispatchTimeout <= 0 {
		errs = append(errs, fmt.Errorf("ResumeTimeout (%s) and DispatchTimeout (%s) must be positive", c.ResumeTimeout, c.DispatchTimeout))
	}
	if c.KeepaliveTime < liveness.MinTime {
		errs = append(errs, fmt.Errorf("KeepaliveTime (%s) cannot be below %s, gRPC's floor for client pings", c.KeepaliveTime, liveness.MinTime))
	}
	if c.KeepaliveTimeout <= 0 || c.WatchProbeInterval <= 0 {
		errs = append(errs, fmt.Errorf("KeepaliveTimeout (%s) and WatchProbeInterval (%s) must be positive", c.KeepaliveTimeout, c.WatchProbeInterval))
	}
	if c.SessionTTL < time.Second || c.SessionTTL > time.Hour {
		errs = append(errs, fmt.Errorf("SessionTTL (%s) must be between 1s and 1h", c.SessionTTL))
	}
	if len(errs) > 0 {
		return fmt.Errorf("gateway: invalid config: %w", errors.Join(errs...))
	}
	return nil
}

// Gateway serves the OpenAI API.
type Gateway struct {
	cfg     Config
	log     hclog.Logger
	ctl     *ctlclient.Client
	metrics *metrics
	tok     tokenizer.Tokenizer
	admit   chan struct{}
	done    chan string // ids to Complete
	session *session

	// watchConns are the connections the move watcher follows events on,
	// one per controller, with keepalive; watched is the index of the last
	// event it handled (tests wait on it).
	watchConns []*grpc.ClientConn
	watched    atomic.Uint64
	// strategy is the cluster's recovery strategy (a pb.Strategy; 0 until
	// known) as the move watcher last saw it: read from the replica when
	// its stream opens, then from StrategyChanged events. It says what a
	// resumed call carries (Gateway.regenerates).
	strategy atomic.Int32

	workers *workerdir.Directory

	// replica is the gateway's copy of the load table it chooses serving
	// workers from (fastpath.go); tableAt is when the last table arrived
	// (unix ns). link is the Place stream (place.go).
	replica *placer.Replica
	tableAt atomic.Int64
	link    *placeLink
	// kv is prefix routing's index of the workers' caches, nil when
	// Config.PrefixRouting is off.
	kv *kvWatch

	mu         sync.Mutex // guards maxContext, readyAt, ready, reporting, flights, closing, draining
	maxContext int
	readyAt    time.Time
	ready      error
	reporting  map[string]bool // workers being reported unreachable
	// flights holds each in-flight request's worker stream, by dispatch
	// id, as the move watcher sees it (see moves.go).
	flights map[string]*flight
	closing bool // set by Close: goFunc starts nothing more
	// draining is set by Close once the HTTP server stopped: a handler that
	// starts after it answers 503 at once; handlers counts those running.
	draining bool
	handlers sync.WaitGroup
	// closeGrace is how long Close lets handlers finish before it cuts
	// their connections and cancels them (5 s; tests shorten it).
	closeGrace time.Duration

	srv    *http.Server
	lis    net.Listener
	ctx    context.Context // the gateway's life: cancelled by Close
	cancel context.CancelFunc
	stop   chan struct{}
	wg     sync.WaitGroup
	once   sync.Once
}

// New validates cfg and starts a gateway.
func New(cfg Config) (*Gateway, error) {
	if cfg.SessionTTL == 0 {
		cfg.SessionTTL = DefaultSessionTTL
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: "gateway"})
	}
	_, clusterTLS, err := cfg.ClusterTLS.Load()
	if err != nil {
		return nil, fmt.Errorf("gateway: -cluster-tls-*: %w", err)
	}
	creds := tlsconf.DialOption(clusterTLS)
	ctl, err := ctlclient.New(cfg.Controllers, clusterTLS)
	if err != nil {
		return nil, err
	}
	g := &Gateway{cfg: cfg, log: cfg.Logger, ctl: ctl, metrics: newMetrics(cfg.Model),
		admit: make(chan struct{}, cfg.MaxConcurrent), done: make(chan string, 4096),
		workers:    workerdir.New(ctl, creds, liveness.DialOption(cfg.KeepaliveTime, cfg.KeepaliveTimeout)),
		maxContext: cfg.MaxContext, stop: make(chan struct{}), closeGrace: 5 * time.Second,
		flights: map[string]*flight{}, replica: placer.New()}
	g.ctx, g.cancel = context.WithCancel(context.Background())
	if cfg.PrefixRouting {
		g.kv = newKVWatch(g)
	}
	for _, addr := range ctl.Addrs() {
		cc, err := grpc.NewClient(addr, creds, liveness.DialOption(cfg.KeepaliveTime, cfg.KeepaliveTimeout))
		if err != nil {
			g.cancel()
			g.closeConns()
			return nil, fmt.Errorf("gateway: controller %s: %w", addr, err)
		}
		g.watchConns = append(g.watchConns, cc)
	}
	if !cfg.headless {
		g.lis, err = net.Listen("tcp", cfg.Addr)
		if err != nil {
			g.cancel()
			g.closeConns()
			return nil, fmt.Errorf("gateway: listen on %s: %w", cfg.Addr, err)
		}
	}
	if cfg.Name == "" {
		host, _ := os.Hostname()
		cfg.Name = strings.ReplaceAll(host, " ", "-") + "@" + g.lis.Addr().String()
		g.cfg.Name = cfg.Name
	}
	g.session = newSession(ctl, g.log, cfg.Name, cfg.SessionTTL)
	g.session.changed = g.replica.SetSelf
	g.link = newPlaceLink(g)
	g.metrics.watchReplica(g.replica, &g.tableAt)
	g.srv = &http.Server{Handler: g.Handler(), ReadHeaderTimeout: 10 * time.Second}
	g.goFunc(func() { g.session.run(g.stop) })
	g.goFunc(g.watchMoves)
	g.goFunc(g.watchLoad)
	g.goFunc(func() {
		if cfg.headless {
			return
		}
		var err error
		if cfg.TLSCert != "" {
			err = g.srv.ServeTLS(g.lis, cfg.TLSCert, cfg.TLSKey)
		} else {
			err = g.srv.Serve(g.lis)
		}
		if err != nil && !errors.Is(err, http.ErrServerClosed) {
			g.log.Error("HTTP server stopped", "error", err)
		}
	})
	g.goFunc(g.completer)
	return g, nil
}

// goFunc runs f on the gateway's WaitGroup, unless Close has begun (then it
// returns false and f never runs). f must return once g.stop is closed.
func (g *Gateway) goFunc(f func()) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closing {
		return false
	}
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		f()
	}()
	return true
}

// Addr is the address the gateway listens on.
func (g *Gateway) Addr() string {
	if g.lis == nil {
		return ""
	}
	return g.lis.Addr().String()
}

// Close stops serving, flushes Completes and waits for every goroutine the
// gateway started. Handlers get closeGrace to finish; then their
// connections are closed and their requests cancelled (in-flight streams
// end), and Close waits for them before the last flush, so their Completes
// are sent and nothing calls a closed client. It is idempotent.
func (g *Gateway) Close() {
	g.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), g.closeGrace)
		if err := g.srv.Shutdown(ctx); err != nil {
			g.log.Warn("handlers still running after the grace period; cutting them", "grace", g.closeGrace, "error", err)
			_ = g.srv.Close()
		}
		cancel()
		g.mu.Lock()
		g.draining = true
		g.mu.Unlock()
		g.cancel() // ends the handlers' requests
		g.handlers.Wait()
		g.mu.Lock()
		g.closing = true
		g.mu.Unlock()
		close(g.stop)
		g.wg.Wait()
		// The Place stream sends what the last flush gave it.
		g.link.close(3 * time.Second)
		// After the last Complete flush: what is left of the session's
		// placements is completed with it.
		ctx, cancel = context.WithTimeout(context.Background(), 2*time.Second)
		g.session.destroy(ctx)
		cancel()
		g.closeConns()
	})
}

// enterHandler counts a request handler in, unless Close has stopped the
// HTTP server (false: the handler must answer at once, without the
// controller or workers).
func (g *Gateway) enterHandler() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.draining {
		return false
	}
	g.handlers.Add(1)
	return true
}

// closeConns closes every connection the gateway opened.
func (g *Gateway) closeConns() {
	g.workers.Close()
	for _, cc := range g.watchConns {
		cc.Close()
	}
	g.ctl.Close()
}

// Handler is the HTTP API.
func (g *Gateway) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { g.serve(w, r, false) })
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { g.serve(w, r, true) })
	mux.HandleFunc("GET /v1/models", g.models)
	mux.HandleFunc("GET /healthz", healthz.OK)
	mux.HandleFunc("GET /readyz", g.readyz)
	mux.Handle("GET /metrics", g.metrics.handler())
	if g.cfg.Pprof {
		mux.HandleFunc("GET /debug/pprof/", pprof.Index)
		mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
	}
	return jsonNotFound(mux)
}

// jsonNotFound answers what mux has no route for as OpenAI does, with a
// JSON error: 404 for an unknown path, 405 with Allow for a method the
// path does not take (the mux's plain-text answers otherwise).
func jsonNotFound(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h, pattern := mux.Handler(r)
		if pattern != "" {
			mux.ServeHTTP(w, r)
			return
		}
		// The mux's own answer says which (and, for 405, sets Allow).
		var probe headerProbe
		h.ServeHTTP(&probe, r)
		route := fmt.Sprintf("%s %s", r.Method, r.URL.Path)
		if allow := probe.h.Get("Allow"); probe.code == http.StatusMethodNotAllowed {
			w.Header().Set("Allow", allow)
			writeError(w, &apiError{Status: 405, Type: "invalid_request_error", Code: "method_not_allowed",
				Message: fmt.Sprintf("Invalid method (%s): %s takes %s", route, r.URL.Path, allow)})
			return
		}
		writeError(w, &apiError{Status: 404, Type: "invalid_request_error", Code: "unknown_url",
			Message: fmt.Sprintf("Invalid URL (%s): lumen serves POST /v1/completions, POST /v1/chat/completions and GET /v1/models", route)})
	})
}

// headerProbe is a ResponseWriter that keeps only the status and headers.
type headerProbe struct {
	h    http.Header
	code int
}

func (p *headerProbe) Header() http.Header {
	if p.h == nil {
		p.h = http.Header{}
	}
	return p.h
}
func (p *headerProbe) WriteHeader(code int) {
	if p.code == 0 {
		p.code = code
	}
}
func (p *headerProbe) Write(b []byte) (int, error) {
	p.WriteHeader(http.StatusOK)
	return len(b), nil
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, e *apiError) {
	if e.RetryAfter > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(max(1, int(math.Ceil(e.RetryAfter.Seconds())))))
	}
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
	healthz.Stamp(w)
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

// refreshWorkers reads the workers table (a stale read: addresses only)
// into the worker directory and returns the addresses of workers in full
// service.
func (g *Gateway) refreshWorkers(ctx context.Context) ([]string, error) {
	ws, err := g.workers.Refresh(ctx)
	if err != nil {
		return nil, err
	}
	var live []string
	maxCtx := 0
	for _, w := range ws {
		if w.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
			live = append(live, w.GrpcAddr)
			if c := int(w.GetCapacity().GetMaxContextTokens()); c > 0 && (maxCtx == 0 || c < maxCtx) {
				maxCtx = c
			}
		}
	}
	if maxCtx > 0 {
		g.mu.Lock()
		g.maxContext = maxCtx
		g.mu.Unlock()
	}
	return live, nil
}

// workerConn returns a connection to a worker by id.
func (g *Gateway) workerConn(ctx context.Context, id string) (*grpc.ClientConn, error) {
	return g.workers.Conn(ctx, id)
}

func newID(prefix string) string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// Completion flushing: how many ids one Complete carries, how many the
// flusher keeps while the controller is unreachable (past it, it stops
// taking new ones: the senders wait, nothing is dropped), and how long it
// backs off after a failed flush.
const (
	completeBatch      = 256
	completePendingMax = 1 << 16
	completeRetryMin   = 20 * time.Millisecond
	completeRetryMax   = 2 * time.Second
)

// completer sends Complete for finished requests in batches. A flush that
// fails keeps its ids for the next one, with backoff, until the controller
// takes them: a lost Complete would leave the placement and its holder's
// reservation until the session expired. On stop it drains what was sent
// and flushes for as long as Close allows; the session's destruction
// completes anything still left.
func (g *Gateway) completer() {
	var pending []string
	retry := completeRetryMin
	var notBefore time.Time // no flush before this after a failure
	var closeBy time.Time   // once stopping: no Complete runs past it
	flush := func() bool {
		for len(pending) > 0 {
			n := min(len(pending), completeBatch)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			if !closeBy.IsZero() {
				ctx, cancel = context.WithDeadline(context.Background(), closeBy)
			}
			err := g.link.complete(ctx, pending[:n])
			cancel()
			if err != nil && status.Code(err) != codes.InvalidArgument {
				g.log.Warn("complete failed; keeping the ids for the next flush", "requests", len(pending), "retry_in", retry, "error", err)
				notBefore = time.Now().Add(retry)
				retry = min(2*retry, completeRetryMax)
				return false
			}
			if err != nil {
				// Refused as malformed: no retry can succeed, and the
				// session's end completes these placements.
				g.log.Error("complete refused", "requests", n, "error", err)
			}
			pending = pending[n:]
			retry = completeRetryMin
		}
		pending = nil
		return true
	}
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		// While too many ids wait, take no more: senders block, ids are
		// never dropped.
		done := g.done
		if len(pending) >= completePendingMax {
			done = nil
		}
		select {
		case id := <-done:
			pending = append(pending, id)
			if len(pending) >= completeBatch && time.Now().After(notBefore) {
				flush()
			}
		case <-t.C:
			if time.Now().After(notBefore) {
				flush()
			}
		case <-g.stop:
			for {
				select {
				case id := <-g.done:
					pending = append(pending, id)
					continue
				default:
				}
				break
			}
			closeBy = time.Now().Add(3 * time.Second)
			for !flush() && time.Now().Before(closeBy) {
				time.Sleep(time.Until(notBefore))
			}
			if len(pending) > 0 {
				g.log.Warn("closing with completions unsent; the session's end completes them", "requests", len(pending))
			}
			return
		}
	}
}
