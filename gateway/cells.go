package gateway

// A gateway over several cells (issue 26): each cell is a whole lumen
// cluster — its own controller quorum, its own workers — and no consensus
// spans cells. Cells keeps one Gateway per cell, each with everything a
// gateway has (its session, its replica of that cell's load table, its
// Place stream, its move watcher, its workers), and serves the HTTP API
// for all of them. A new request goes to one cell and lives there: its
// placement, its checkpoint holder, any resume or migration are that
// cell's, so a failure is recovered inside its cell by that cell's quorum.
//
// The cell of a request: among the cells whose quorum answers (the cell
// gateway's last session renewal went through), the one whose freest
// eligible worker is the freest (placer.Replica.BestFreeness, own placements
// counted). That is the worker a single quorum over every cell's workers
// would choose — policy.PickServing over the union — so cells cost only
// what the tables' staleness costs, as several gateways do. A cell whose
// quorum is gone keeps serving the requests already on its workers (a
// placement that cannot commit runs on, as with one cell), but gets no new
// ones while another cell answers; its requests whose worker fails wait
// for its quorum to return, as they would with one cell. With no cell
// answering, or no table with an eligible worker, requests go round-robin
// over the cells whose quorum answers (all, if none does), whose gateways
// then place through their controllers as a lone gateway does.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/hashicorp/go-hclog"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"

	"github.com/lumen-project/lumen/internal/healthz"
)

// Cell is one cell a gateway places into: its name and its controllers.
type Cell struct {
	Name        string
	Controllers []string
}

// MaxCells bounds a gateway's cells: each is a session, a load-table
// replica, a Place stream and a move watcher.
const MaxCells = 64

var cellName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$`)

// ParseCell parses a -cell value, NAME=ADDR[,ADDR...].
func ParseCell(s string) (Cell, error) {
	name, addrs, ok := strings.Cut(s, "=")
	if !ok {
		return Cell{}, fmt.Errorf("-cell %q: want NAME=ADDR[,ADDR...] (a cell's name and its controllers' gRPC addresses)", s)
	}
	if !cellName.MatchString(name) {
		return Cell{}, fmt.Errorf("-cell %q: the name %q must be 1-63 letters, digits, '_', '.' or '-', starting with a letter or digit", s, name)
	}
	c := Cell{Name: name}
	for _, a := range strings.Split(addrs, ",") {
		if a = strings.TrimSpace(a); a != "" {
			c.Controllers = append(c.Controllers, a)
		}
	}
	if len(c.Controllers) == 0 {
		return Cell{}, fmt.Errorf("-cell %q: no controller address for cell %s", s, name)
	}
	return c, nil
}

// Cells serves the OpenAI API over several cells.
type Cells struct {
	cfg   Config
	log   hclog.Logger
	cells []*cellGateway
	rr    atomic.Uint64

	reg    *prometheus.Registry
	placed *prometheus.CounterVec

	srv  *http.Server
	lis  net.Listener
	wg   sync.WaitGroup
	once sync.Once
}

type cellGateway struct {
	name string
	g    *Gateway
	h    http.Handler
}

// NewCells starts a gateway over cells: cfg as for New (its Controllers
// unused: each cell names its own), one cell gateway per cell, and the
// HTTP API on cfg.Addr. -max-concurrent applies per cell.
func NewCells(cfg Config, cells []Cell) (*Cells, error) {
	if len(cells) == 0 || len(cells) > MaxCells {
		return nil, fmt.Errorf("gateway: %d cells: want 1 to %d", len(cells), MaxCells)
	}
	seen := map[string]bool{}
	for _, c := range cells {
		if seen[c.Name] {
			return nil, fmt.Errorf("gateway: cell %s is named twice", c.Name)
		}
		seen[c.Name] = true
		if len(c.Controllers) == 0 {
			return nil, fmt.Errorf("gateway: cell %s has no controller address", c.Name)
		}
	}
	if cfg.SessionTTL == 0 {
		cfg.SessionTTL = DefaultSessionTTL
	}
	if cfg.Logger == nil {
		cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: "gateway"})
	}
	probe := cfg
	probe.Controllers = cells[0].Controllers
	if err := probe.Validate(); err != nil {
		return nil, err
	}
	lis, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("gateway: listen on %s: %w", cfg.Addr, err)
	}
	if cfg.Name == "" {
		host, _ := os.Hostname()
		cfg.Name = strings.ReplaceAll(host, " ", "-") + "@" + lis.Addr().String()
	}
	cs := &Cells{cfg: cfg, log: cfg.Logger, lis: lis, reg: prometheus.NewRegistry(),
		placed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_gateway_cell_requests_total",
			Help: "Completion requests a gateway over several cells sent to each cell, by why: freest (the cell of the freest worker), round_robin (no cell had a table with an eligible worker)."},
			[]string{"cell", "choice"})}
	cs.reg.MustRegister(cs.placed)
	for _, c := range cells {
		cc := cfg
		cc.Controllers = c.Controllers
		cc.Name = cfg.Name + "/" + c.Name
		cc.Logger = cfg.Logger.Named(c.Name)
		cc.headless = true
		g, err := New(cc)
		if err != nil {
			cs.closeCells()
			lis.Close()
			return nil, fmt.Errorf("gateway: cell %s: %w", c.Name, err)
		}
		cg := &cellGateway{name: c.Name, g: g, h: g.Handler()}
		cs.cells = append(cs.cells, cg)
		cs.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "lumen_gateway_cell_up", ConstLabels: prometheus.Labels{"cell": c.Name},
			Help: "1 while the cell's quorum answers this gateway (its last session renewal went through), else 0: a cell at 0 gets no new requests while another answers."},
			func() float64 {
				if g.session.up.Load() {
					return 1
				}
				return 0
			}))
	}
	cs.srv = &http.Server{Handler: cs.Handler(), ReadHeaderTimeout: cs.cells[0].g.srv.ReadHeaderTimeout}
	cs.wg.Add(1)
	go func() {
		defer cs.wg.Done()
		var err error
		if cfg.TLSCert != "" {
			err = cs.srv.ServeTLS(lis, cfg.TLSCert, cfg.TLSKey)
		} else {
			err = cs.srv.Serve(lis)
		}
		if err != nil && !errors.Is(err, http.ErrServerClosed) {
			cs.log.Error("HTTP server stopped", "error", err)
		}
	}()
	return cs, nil
}

// Addr is the address the gateway listens on.
func (cs *Cells) Addr() string { return cs.lis.Addr().String() }

// Close stops serving, lets handlers finish (each cell gateway's grace),
// then closes every cell's gateway: its Completes flushed, its session
// destroyed.
func (cs *Cells) Close() {
	cs.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), cs.cells[0].g.closeGrace)
		if err := cs.srv.Shutdown(ctx); err != nil {
			cs.log.Warn("handlers still running after the grace period; cutting them", "error", err)
			_ = cs.srv.Close()
		}
		cancel()
		cs.closeCells()
		cs.wg.Wait()
	})
}

func (cs *Cells) closeCells() {
	var wg sync.WaitGroup
	for _, c := range cs.cells {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.g.Close()
		}()
	}
	wg.Wait()
}

// pick chooses the cell of a new request (the package comment). Cells
// whose freest workers tie (idle cells) take turns.
func (cs *Cells) pick() (*cellGateway, string) {
	var best, up []*cellGateway
	bestF := 0.0
	for _, c := range cs.cells {
		if !c.g.session.up.Load() {
			continue
		}
		up = append(up, c)
		f, ok := c.g.replica.BestFreeness()
		switch {
		case !ok:
		case len(best) == 0 || f > bestF:
			best, bestF = append(best[:0], c), f
		case f == bestF:
			best = append(best, c)
		}
	}
	turn := int(cs.rr.Add(1) - 1)
	if len(best) > 0 {
		return best[turn%len(best)], "freest"
	}
	if len(up) == 0 {
		up = cs.cells
	}
	return up[turn%len(up)], "round_robin"
}

// Handler is the HTTP API: completions go to the cell pick chooses; the
// rest is answered for all cells.
func (cs *Cells) Handler() http.Handler {
	mux := http.NewServeMux()
	route := func(w http.ResponseWriter, r *http.Request) {
		c, why := cs.pick()
		cs.placed.WithLabelValues(c.name, why).Inc()
		c.h.ServeHTTP(w, r)
	}
	mux.HandleFunc("POST /v1/completions", route)
	mux.HandleFunc("POST /v1/chat/completions", route)
	mux.HandleFunc("GET /v1/models", cs.cells[0].g.models)
	mux.HandleFunc("GET /healthz", healthz.OK)
	mux.HandleFunc("GET /readyz", cs.readyz)
	mux.Handle("GET /metrics", promhttp.HandlerFor(cs.gatherers(), promhttp.HandlerOpts{}))
	if cs.cfg.Pprof {
		mux.HandleFunc("GET /debug/pprof/", pprof.Index)
		mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
	}
	return jsonNotFound(mux)
}

// readyz: ready while at least one cell is (its quorum has a leader and a
// worker in full service answers); the body names each cell's state.
func (cs *Cells) readyz(w http.ResponseWriter, r *http.Request) {
	healthz.Stamp(w)
	lines := make([]string, len(cs.cells))
	errs := make([]error, len(cs.cells))
	var wg sync.WaitGroup
	for i, c := range cs.cells {
		wg.Go(func() { errs[i] = c.g.readiness(r.Context()) })
	}
	wg.Wait()
	ready := false
	for i, c := range cs.cells {
		if errs[i] != nil {
			lines[i] = fmt.Sprintf("cell %s: not ready: %v", c.name, errs[i])
			continue
		}
		ready, lines[i] = true, fmt.Sprintf("cell %s: ready", c.name)
	}
	if !ready {
		http.Error(w, strings.Join(lines, "\n"), http.StatusServiceUnavailable)
		return
	}
	fmt.Fprintln(w, "ready")
	fmt.Fprintln(w, strings.Join(lines, "\n"))
}

// gatherers merges the cell gateways' metrics, each series labelled with
// its cell, and this gateway's own; the Go runtime's and the process's
// series once (every cell gateway's registry has them: one process).
func (cs *Cells) gatherers() prometheus.Gatherers {
	gs := prometheus.Gatherers{cs.reg}
	for i, c := range cs.cells {
		gs = append(gs, cellGatherer{g: c.g.metrics.reg, cell: c.name, runtime: i == 0})
	}
	return gs
}

type cellGatherer struct {
	g       prometheus.Gatherer
	cell    string
	runtime bool
}

func (c cellGatherer) Gather() ([]*dto.MetricFamily, error) {
	mfs, err := c.g.Gather()
	out := mfs[:0]
	for _, mf := range mfs {
		if name := mf.GetName(); strings.HasPrefix(name, "go_") || strings.HasPrefix(name, "process_") {
			if c.runtime {
				out = append(out, mf)
			}
			continue
		}
		for _, m := range mf.Metric {
			cell, label := c.cell, "cell"
			m.Label = append(m.Label, &dto.LabelPair{Name: &label, Value: &cell})
			sort.Slice(m.Label, func(i, j int) bool { return m.Label[i].GetName() < m.Label[j].GetName() })
		}
		out = append(out, mf)
	}
	return slices.Clip(out), err
}
