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
	"os"
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
	"github.com/lumen-project/lumen/worker/engine"
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
	// Name names the gateway's controller session, for operators (default
	// host@listen-address): printable ASCII without spaces.
	Name string
	// SessionTTL is how long the controller keeps the gateway's session
	// without a renewal (default DefaultSessionTTL, 10 s; 1 s..1 h). When a
	// gateway dies or is cut off from the quorum this long, its placements
	// are completed and their checkpoint reservations freed. It renews every
	// SessionTTL/3. Shorter frees a dead gateway's reservations sooner; longer
	// rides out longer controller outages.
	SessionTTL time.Duration
	Logger     hclog.Logger
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{Addr: "127.0.0.1:8080", Model: "lumen-tiny", MaxContext: 2048, MaxBodyBytes: 1 << 20,
		MaxConcurrent: 1024, ResumeTimeout: 60 * time.Second, DispatchTimeout: 10 * time.Second,
		SessionTTL: DefaultSessionTTL}
}

// Gateway serves the OpenAI API.
type Gateway struct {
	cfg     Config
	log     hclog.Logger
	ctl     *ctlclient.Client
	journal *journal
	metrics *metrics
	tok     engine.Tokenizer
	admit   chan struct{}
	done    chan string // ids to Complete
	session *session

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
	if cfg.SessionTTL == 0 {
		cfg.SessionTTL = DefaultSessionTTL
	}
	if cfg.SessionTTL < time.Second || cfg.SessionTTL > time.Hour {
		return nil, fmt.Errorf("gateway: SessionTTL (%s) must be between 1s and 1h", cfg.SessionTTL)
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
	if cfg.Name == "" {
		host, _ := os.Hostname()
		cfg.Name = strings.ReplaceAll(host, " ", "-") + "@" + g.lis.Addr().String()
		g.cfg.Name = cfg.Name
	}
	g.session = newSession(ctl, g.log, cfg.Name, cfg.SessionTTL)
	g.srv = &http.Server{Handler: g.Handler(), ReadHeaderTimeout: 10 * time.Second}
	g.wg.Add(4)
	go func() { defer g.wg.Done(); g.session.run(g.stop) }()
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
		// After the last Complete flush: what is left of the session's
		// placements is completed with it.
		ctx, cancel = context.WithTimeout(context.Background(), 2*time.Second)
		g.session.destroy(ctx)
		cancel()
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
	flush := func() bool {
		for len(pending) > 0 {
			n := min(len(pending), completeBatch)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, err := g.ctl.Complete(ctx, &pb.CompleteRequest{RequestIds: pending[:n]})
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
			deadline := time.Now().Add(3 * time.Second)
			for !flush() && time.Now().Before(deadline) {
				time.Sleep(time.Until(notBefore))
			}
			if len(pending) > 0 {
				g.log.Warn("closing with completions unsent; the session's end completes them", "requests", len(pending))
			}
			return
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
