package jepsen

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/completions"
	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	"github.com/lumen-project/lumen/internal/placer"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/tokenizer"
	"github.com/lumen-project/lumen/worker/engine"
)

// Config is one run: a cluster, workloads, and the nemeses to unleash.
type Config struct {
	Name        string
	Bin         string // the lumen binary
	Dir         string // this run's results: logs, data, histories
	ModelDir    string // a generated model (made when absent)
	Seed        int64
	Controllers int // 3 or 5
	Workers     int
	Duration    time.Duration // of the workload under faults
	Nemeses     []string      // names from Nemeses; combined, one fault at a time
	Interval    time.Duration // mean time between faults
	// Partitions picks how partitions are made: "netns" (network
	// namespaces; needs root), "proxy" (per-link TCP proxies on loopback),
	// or "" for namespaces where they can be made, else proxies.
	Partitions string
	// Clients of each workload.
	PlacementClients, ServingClients int
	// Gateways in front of the cluster (default 2); serving client c
	// streams through gateway c mod Gateways.
	Gateways int
	// SessionTTL is how long a dead gateway's session lives on (the
	// gateway's session TTL): the end-of-run leak check waits this long
	// for it to expire, after a gateway-kill. Default DefaultSessionTTL.
	SessionTTL time.Duration
	// ShortStreams keeps every stream streamMaxTokens long, also with the
	// migrate nemesis (whose odd serving clients otherwise stream
	// longStreamTokens): a long stream in flight when the faults end
	// would lengthen a run whose length is fixed (make test's).
	ShortStreams bool
	Log          io.Writer
}

// DefaultSessionTTL is Config.SessionTTL's default.
const DefaultSessionTTL = 10 * time.Second

// quiesceSettle is how long, beyond a session's expiry, the leak check
// waits for the last Completes, releases and load reports to land.
const quiesceSettle = 15 * time.Second

// Report is what a run found.
type Report struct {
	Name          string
	Seed          int64
	Ops           int // placement operations
	Indeterminate int
	Streams       int
	Faults        map[string]int
	Progress      ProgressStats  // what progressive recovery did
	Migrations    MigrationStats // what live migration did
	Place         PlaceStats     // what the stream clients' choices of worker met
	GatewayPaths  GatewayPaths   // what the gateways' request path did
	Verdicts      []Verdict
	Elapsed       time.Duration
}

// OK is true when every checker passed.
func (r *Report) OK() bool {
	for _, v := range r.Verdicts {
		if !v.OK {
			return false
		}
	}
	return len(r.Verdicts) > 0
}

// env is a running cluster and its faults.
type env struct {
	cfg    Config
	cl     *devcluster.Cluster
	net    partitioner
	client *ctlclient.Client
	rng    *rand.Rand
	logf   func(format string, args ...any)
	hist   *History

	gws []*devcluster.Gateway // fixed once the cluster is up

	mu       sync.Mutex   // guards the fields below
	removed  map[int]bool // controllers removed from the Raft configuration
	faults   map[string]int
	recent   [64]string // ids dispatched lately, for cross-client reads
	nRecent  int
	inflight map[string]int // streams open through each gateway
	kills    []GatewayKill  // gateways killed, oldest first
	// nodeKills are the node-kill faults, oldest first.
	nodeKills []NodeKill
	// workerKills counts each worker's kill -9s; assistKills, which
	// assist-kill faults landed.
	workerKills map[string]int
	assistKills map[string]int
	// inService is the last incarnation of each worker the event log
	// showed entering FULL_SERVICE.
	inService map[string]uint64
	// openIDs are the request ids of the streams in flight (as their
	// first chunk named them); migs, what live migration did; committed,
	// the request ids whose migration committed.
	openIDs   map[string]int // and their lengths
	lastOpen  int64          // when the latest stream's first chunk came
	migs      MigrationStats
	committed map[string]bool
	// peakKV and peakMigrating are the most KV pages a worker's load
	// report counted and the most MIGRATING placements into a worker, as
	// sampleBudgets saw them (what no-leak's zeros are set against).
	peakKV        uint64
	peakMigrating uint32
	// load is the stream clients' replica of the load table; place, what
	// their choices met; sessions, theirs (destroyed at quiescence).
	load       loadView
	place      PlaceStats
	sessions   []string
	shared     *ctlclient.Placer // the batch clients' Dispatches
	sharedOnce sync.Once
	// gwPaths sums the gateways' request-path counters.
	gwPaths GatewayPaths
}

// Run starts the cluster, runs the workloads under the nemeses, heals,
// checks, and tears everything down, even when it fails.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	start := time.Now()
	if cfg.Log == nil {
		cfg.Log = io.Discard
	}
	if cfg.Gateways <= 0 {
		cfg.Gateways = 2
	}
	if cfg.SessionTTL <= 0 {
		cfg.SessionTTL = DefaultSessionTTL
	}
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		return nil, err
	}
	e := &env{cfg: cfg, rng: rand.New(rand.NewSource(cfg.Seed)), hist: NewHistory(), removed: map[int]bool{}, faults: map[string]int{}, inflight: map[string]int{},
		workerKills: map[string]int{}, assistKills: map[string]int{}, inService: map[string]uint64{},
		openIDs: map[string]int{}, migs: newMigrationStats(), committed: map[string]bool{}}
	e.load.replica = placer.New()
	e.logf = func(format string, args ...any) {
		fmt.Fprintf(cfg.Log, "[%6.1fs] %s\n", time.Since(start).Seconds(), fmt.Sprintf(format, args...))
	}
	e.logf("%s: seed %d, %d controllers, %d workers, %d gateways, nemeses %s, %s", cfg.Name, cfg.Seed, cfg.Controllers, cfg.Workers, cfg.Gateways, strings.Join(cfg.Nemeses, "+"), cfg.Duration)
	for _, n := range cfg.Nemeses {
		if _, ok := Nemeses[n]; !ok {
			return nil, fmt.Errorf("unknown nemesis %q: use %s", n, strings.Join(NemesisNames(), ", "))
		}
	}

	opts := devcluster.Options{Bin: cfg.Bin, Dir: cfg.Dir, Controllers: cfg.Controllers, Args: []string{"-log-level", "info"}}
	var cl *devcluster.Cluster // the proxies' targets; set before anything dials them
	if needsNet(cfg.Nemeses) {
		mode := cfg.Partitions
		if mode == "" {
			mode = "netns"
			if err := NetAvailable(); err != nil {
				mode = "proxy"
				e.logf("network namespaces unavailable (%v): partitions through per-link TCP proxies", err)
			}
		}
		switch mode {
		case "netns":
			// The subnet and names follow the process, so two harnesses
			// on one machine (make test beside make jepsen) do not share
			// them.
			octet := 100 + os.Getpid()%150
			nt, err := NewNet(fmt.Sprintf("lj%d", octet), octet, cfg.Controllers)
			if err != nil {
				return nil, fmt.Errorf("partitions: %w", err)
			}
			defer nt.Teardown()
			e.net = nt
			opts.Hosts, opts.Wrap, opts.WorkerHost = nt.Hosts, nt.Wrap, nt.Bridge
		case "proxy":
			px, err := NewProxies(cfg.Controllers, func(j int) string { r, _ := cl.Addrs(j); return r },
				func(j int) string { _, g := cl.Addrs(j); return g })
			if err != nil {
				return nil, fmt.Errorf("partitions: %w", err)
			}
			defer px.Close()
			e.net = px
			opts.ClientAddr = px.ClientAddr
			opts.ControllerArgs = func(i int) []string {
				var peers []string
				for j := range cfg.Controllers {
					if j != i {
						peers = append(peers, devcluster.ControllerID(j)+"="+px.RaftAddr(i, j))
					}
				}
				return []string{"-raft-peer-addrs", strings.Join(peers, ",")}
			}
		default:
			return nil, fmt.Errorf("partitions %q: use netns or proxy", mode)
		}
		e.logf("partitions: %s", mode)
	}
	cl, err := devcluster.Prepare(opts)
	if err != nil {
		return nil, err
	}
	cctx, cancel := context.WithTimeout(ctx, time.Minute)
	err = cl.Launch(cctx)
	cancel()
	if err != nil {
		return nil, err
	}
	e.cl = cl
	defer cl.Stop()
	if cfg.ModelDir == "" {
		cfg.ModelDir = filepath.Join(cfg.Dir, "model")
	}
	if _, _, err := engine.InitModel(cfg.ModelDir, engine.DefaultSeed); err != nil {
		return nil, err
	}
	for i := 1; i <= cfg.Workers; i++ {
		// Transformer workers paced like Qwen3-14B/H100 at half speed, so
		// streams are still running when faults land. Reservations are
		// sized by the profile's KV bytes (5 MiB for a placement client's
		// request), so the budget holds every client's open placements
		// with room for the streams; the pages really stored are the tiny
		// model's. The first start loads at once; a restart after a kill
		// recovers progressively, its loads taking the profile's times
		// scaled by restartLoadScale (progressive.go).
		args := []string{"-model-dir", cfg.ModelDir, "-kv-pages", "1024",
			"-profile", workerProfile, "-time-scale", "2", "-checkpoint-budget", "2GiB"}
		if e.hasNemesis("migrate") {
			// Each migration's end, with its reason, in the worker's log.
			args = append(args, "-log-level", "info")
		}
		if node := e.workerNode(i); node != "" {
			args = append(args, "-node", node)
		}
		w, err := cl.AddWorker(fmt.Sprintf("worker-%d", i), append(slices.Clone(args), "-emulate-load=false")...)
		if err != nil {
			return nil, err
		}
		w.Args = append(args, "-load-scale", fmt.Sprint(restartLoadScale))
	}
	var gwAddrs []string
	for range cfg.Gateways {
		gw, err := cl.StartGateway("", "-session-ttl", cfg.SessionTTL.String())
		if err != nil {
			return nil, err
		}
		if err := gw.WaitReady(ctx); err != nil {
			return nil, err
		}
		e.gws = append(e.gws, gw)
		gwAddrs = append(gwAddrs, gw.Name+" "+gw.Addr)
	}
	if e.client, err = ctlclient.New(cl.GRPCAddrs(), nil); err != nil {
		return nil, err
	}
	defer e.client.Close()
	e.logf("cluster up: %s; %s", strings.Join(cl.GRPCAddrs(), " "), strings.Join(gwAddrs, ", "))

	// Observers: the load and worker tables (budgets, pairings), the event
	// log (failures, progressive recovery) and the draft counters.
	obsCtx, stopObs := context.WithCancel(ctx)
	var obs sync.WaitGroup
	var failures []Failure
	var progress ProgressStats
	var budgets []BudgetSample
	var tables []TableSample
	var spec [3]uint64
	obs.Go(func() { budgets, tables = e.sampleBudgets(obsCtx) })
	obs.Go(func() { e.watchLoad(obsCtx) })
	// The event log and the draft counters are followed until the last
	// restarted worker is back in full service.
	recCtx, stopRec := context.WithCancel(ctx)
	defer stopRec()
	var recObs sync.WaitGroup
	recObs.Go(func() { failures, progress = e.watchEvents(recCtx) })
	recObs.Go(func() { spec = e.sampleSpec(recCtx) })

	// Workloads.
	runCtx, stopRun := context.WithTimeout(ctx, cfg.Duration)
	defer stopRun()
	var work sync.WaitGroup
	for c := 0; c < cfg.PlacementClients; c++ {
		work.Go(func() { e.placementClient(runCtx, c) })
	}
	var streams []Stream
	var smu sync.Mutex
	var serving sync.WaitGroup
	for c := 0; c < cfg.ServingClients; c++ {
		serving.Go(func() {
			out := e.servingClient(runCtx, ctx, c, e.gws[c%len(e.gws)])
			smu.Lock()
			streams = append(streams, out...)
			smu.Unlock()
		})
	}
	// Live migration forced all along (the migrate nemesis).
	if e.hasNemesis("migrate") {
		e.migrationOn(ctx)
		work.Go(func() { e.migrator(runCtx) })
	}
	// The nemesis, until the run ends; then everything heals.
	e.nemesis(runCtx)
	work.Wait()
	e.closeShared()
	e.logf("faults over; healing")
	e.healAll(ctx)
	// Restarted workers finish their recovery meanwhile.
	recovered := make(chan Recovered, 1)
	go func() { recovered <- e.awaitRecovered(ctx) }()
	serving.Wait()
	for _, gw := range e.gws {
		if gw.Running() {
			e.scrapeGateway(ctx, gw)
		}
	}
	e.logf("workloads done: %d placement operations, %d streams", len(e.hist.Ops()), len(streams))

	ops := e.hist.Ops()
	final := e.finalReads(ctx, ops)
	stopObs()
	obs.Wait()
	quiet := e.quiesce(ctx, final)
	e.mu.Lock()
	quiet.PeakKVPages, quiet.PeakMigratingIn = e.peakKV, e.peakMigrating
	e.mu.Unlock()
	rec := <-recovered
	e.awaitEvents(ctx, rec.Rows)
	stopRec()
	recObs.Wait()
	e.logf("workers in full service after %s", rec.Waited.Round(100*time.Millisecond))
	states := e.converge(ctx)
	// Every process stops before its log is scanned, so a panic at
	// shutdown is seen too.
	cl.Stop()
	kills := e.gatewayKills()

	progress.Drafted, progress.Verified, progress.Accepted = spec[0], spec[1], spec[2]
	progress.AssistKills = e.assistKills
	e.mu.Lock()
	migs := e.migs
	migs.StreamsMigrated = streamsMigrated(streams, e.committed)
	e.mu.Unlock()
	e.mu.Lock()
	place, gwPaths := e.place, e.gwPaths
	e.mu.Unlock()
	rep := &Report{Name: cfg.Name, Seed: cfg.Seed, Ops: len(ops), Streams: len(streams), Faults: e.faults, Progress: progress, Migrations: migs, Place: place, GatewayPaths: gwPaths, Elapsed: time.Since(start)}
	for _, op := range ops {
		if op.Indeterminate {
			rep.Indeterminate++
		}
	}
	ref := newReference(filepath.Join(cfg.ModelDir, engine.TargetFile))
	rep.Verdicts = []Verdict{
		CheckLinearizable(ops, filepath.Join(cfg.Dir, "linearizability.html"), 2*time.Minute),
		CheckStaleReads(ops),
		CheckDurable(ops, final),
		CheckServing(streams, kills, ref.text),
		CheckGatewayPath(gwPaths, streams),
		CheckBudgets(budgets, e.storedSlack(ref)),
		CheckNoLeak(quiet),
		CheckNoDispatchToFailed(ops, failures),
		CheckPlacePath(ops),
		CheckConverged(states),
		CheckPanics(cfg.Dir),
		CheckPairing(tables),
		CheckRecovered(rec),
	}
	if e.hasNemesis("node-kill") {
		e.mu.Lock()
		nk := slices.Clone(e.nodeKills)
		e.mu.Unlock()
		rep.Verdicts = append(rep.Verdicts, CheckNodeKills(nk, failures))
	}
	if err := WriteJSONL(filepath.Join(cfg.Dir, "history.jsonl"), ops); err != nil {
		return rep, err
	}
	if b, err := json.MarshalIndent(streams, "", " "); err == nil {
		_ = os.WriteFile(filepath.Join(cfg.Dir, "streams.json"), b, 0o644)
	}
	if len(kills) > 0 {
		if b, err := json.MarshalIndent(kills, "", " "); err == nil {
			_ = os.WriteFile(filepath.Join(cfg.Dir, "gateway-kills.json"), b, 0o644)
		}
	}
	e.logf("progressive recovery: %s", progress)
	e.logf("place stream clients: %s", place)
	if migs.Any() {
		e.logf("live migration: %s", migs)
		if len(migs.WorkerAborts) > 0 {
			e.logf("aborts workers asked for: %s", countList(migs.WorkerAborts))
		}
	}
	for _, v := range rep.Verdicts {
		e.logf("checker %-22s %-8s %s", v.Checker, v.String(), v.Note)
		for _, x := range v.Violations {
			e.logf("    %s", x)
		}
	}
	return rep, nil
}

func needsNet(nemeses []string) bool {
	for _, n := range nemeses {
		if Nemeses[n].net {
			return true
		}
	}
	return false
}

// Placement clients leave a few of their requests open for a long time,
// so the durability check covers placements that live through many faults;
// the rest they complete at once. The open set is bounded: every open
// placement reserves a checkpoint footprint on a holder, and unbounded they
// would fill every budget and leave the streamed requests without holders.
const (
	keepOpenPercent = 2  // of a client's requests
	maxOpen         = 40 // per client; the oldest is completed past this
)

// placementClient dispatches unique request ids, reads them back
// (linearizably and stale), completes most at once and the rest later, and
// reads ids of other clients — over the path its mode says (clients.go).
func (e *env) placementClient(ctx context.Context, c int) {
	pc := e.newPlacementClient(ctx, c)
	defer pc.close()
	if !pc.ready() {
		return
	}
	var open []string
	for n := 0; ctx.Err() == nil; n++ {
		id := fmt.Sprintf("j%d-%d", c, n)
		e.mu.Lock()
		e.recent[e.nRecent%len(e.recent)] = id
		e.nRecent++
		e.mu.Unlock()
		if d := pc.dispatch(id); d.Err != "" {
			continue
		}
		pc.readBack(id)
		if pc.rng.Intn(100) < keepOpenPercent {
			open = append(open, id)
			if len(open) <= maxOpen {
				continue
			}
			id, open = open[0], open[1:]
		}
		pc.complete(id)
		pc.readAfter(id)
	}
}

func (e *env) recentID(rng *rand.Rand) string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.nRecent == 0 {
		return ""
	}
	return e.recent[rng.Intn(min(e.nRecent, len(e.recent)))]
}

// op performs one placement operation and records it.
func (e *env) op(c int, kind Kind, id string) Op {
	op := Op{Client: c, Kind: kind, ID: id, Call: e.hist.Now()}
	octx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	var err error
	switch kind {
	case Dispatch:
		var r *pb.DispatchResponse
		if r, err = e.client.Dispatch(octx, &pb.DispatchRequest{RequestId: id, PromptTokens: 16, MaxTokens: 16}); err == nil {
			op.Found, op.Index = true, r.Index
			fill(&op, r.Placement)
		}
	case Complete:
		var r *pb.CompleteResponse
		if r, err = e.client.Complete(octx, &pb.CompleteRequest{RequestIds: []string{id}}); err == nil {
			// Found: this id is complete now, by this call or by an
			// earlier attempt of it whose reply was lost.
			op.Found, op.Index = len(r.NotFound) == 0, r.Index
		}
	case GetLin, GetStale:
		cons := pb.Consistency_CONSISTENCY_LINEARIZABLE
		if kind == GetStale {
			cons = pb.Consistency_CONSISTENCY_STALE
		}
		var r *pb.GetPlacementResponse
		r, err = e.client.GetPlacement(octx, &pb.GetPlacementRequest{RequestId: id, Consistency: cons})
		if status.Code(err) == codes.NotFound {
			err = nil
		} else if err == nil {
			op.Found, op.Index = true, r.AppliedIndex
			fill(&op, r.Placement)
		}
	}
	op.Return = e.hist.Now()
	if err != nil {
		op.Err = err.Error()
		op.Refusal = ctlclient.Reason(err)
		if (kind == Dispatch || kind == Complete) && !definite(err) {
			// A definite refusal changed nothing; anything else may have.
			op.Indeterminate, op.Return = true, Unknown
		}
	}
	e.hist.Add(op)
	return op
}

func fill(op *Op, p *pb.Placement) {
	if p == nil {
		return
	}
	op.Worker, op.Inc, op.Epoch, op.Created = p.WorkerId, p.WorkerIncarnation, p.Epoch, p.CreatedIndex
}

// streamMaxTokens is the length of a streamed completion; with the
// migrate nemesis, odd serving clients stream longStreamTokens (a request
// of more than DefaultMigrationStopPages pages migrates in several stages,
// decoding on at its source while the first copy).
const (
	streamMaxTokens  = 24
	longStreamTokens = 320
)

// streamMax is the length of client c's completions.
func (e *env) streamMax(c int) int {
	if c%2 == 1 && e.hasNemesis("migrate") && !e.cfg.ShortStreams {
		return longStreamTokens
	}
	return streamMaxTokens
}

// streamPrompt is the prompt of client c's n-th stream.
func streamPrompt(c, n int) string {
	return fmt.Sprintf("jepsen client %d request %d: keep serving.", c, n)
}

// servingClient streams completions through its gateway until runCtx ends;
// a stream in flight then is let finish (under ctx). The streams open
// through each gateway are counted, so gateway-kill can pick one with
// streams in flight.
func (e *env) servingClient(runCtx, ctx context.Context, c int, gw *devcluster.Gateway) []Stream {
	var out []Stream
	httpc := &http.Client{}
	for n := 0; runCtx.Err() == nil; n++ {
		s := Stream{Client: c, N: n, Gateway: gw.Name, Prompt: streamPrompt(c, n), Max: e.streamMax(c)}
		e.mu.Lock()
		e.inflight[gw.Name]++
		e.mu.Unlock()
		s.Call = e.hist.Now()
		sctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
		streamCompletion(sctx, httpc, gw.Addr, &s, e.hist.Now, func(id string) { e.openStream(id, s.Max) })
		cancel()
		if s.ID != "" {
			e.closeStream(s.ID)
		}
		s.Return = e.hist.Now()
		e.mu.Lock()
		e.inflight[gw.Name]--
		e.mu.Unlock()
		out = append(out, s)
		if !s.Accepted {
			// Its gateway is down, not ready or full: a client that
			// retried at once would spin (100,000 refusals while a
			// killed gateway restarts).
			sleepCtx(runCtx, refusedPause)
		}
	}
	return out
}

// refusedPause is how long a serving client waits after a refusal.
const refusedPause = 50 * time.Millisecond

// storedSlack is how many bytes a holder may store beyond what the
// placement table reserves on it (CheckBudgets): every serving client's
// stream, twice (the one whose Complete just freed its reservation, its
// pages not yet released, and the next), in whole pages of the real model.
func (e *env) storedSlack(ref *reference) uint64 {
	info, err := ref.info()
	if err != nil {
		e.logf("stored-vs-reserved slack: %v", err)
		return 0
	}
	// A bound on the prompt's length: the largest numbers it can carry.
	tokens := len(streamPrompt(e.cfg.ServingClients, 1<<30)) + max(e.streamMax(0), e.streamMax(1))
	pages := tokens/info.PageTokens + 1
	return uint64(2 * e.cfg.ServingClients * pages * info.PageBytes())
}

// streamCompletion streams s through the gateway at addr, noting when
// each chunk with text came (on the clock now); opened, when not nil, is
// told the request id once the first chunk names it.
func streamCompletion(ctx context.Context, httpc *http.Client, addr string, s *Stream, now func() int64, opened func(id string)) {
	onChunk := func(ch completions.Chunk) {
		if ch.Text != "" {
			s.TokenTimes = append(s.TokenTimes, now())
		}
		if opened != nil && s.ID == "" && ch.ID != "" {
			s.ID = ch.ID
			opened(ch.ID)
		}
	}
	res, err := completions.Stream(ctx, httpc, addr, completions.Body(s.Prompt, s.Max, false), onChunk)
	s.Accepted, s.ID = res.Accepted, res.ID
	var ee *completions.EventError
	switch {
	case err == nil:
		s.Done, s.Text = true, res.Text
	case errors.As(err, &ee):
		s.ErrEvent = ee.Message
	default:
		s.Text, s.Err = res.Text, err.Error()
	}
}

// watchEvents follows the event log from the start, from whichever
// replica answers, and returns every committed MarkFailed and what
// progressive recovery did.
func (e *env) watchEvents(ctx context.Context) ([]Failure, ProgressStats) {
	var out []Failure
	var stats ProgressStats
	var from uint64
	for ctx.Err() == nil {
		st, err := e.client.WatchEvents(ctx, from)
		if err != nil {
			sleepCtx(ctx, 200*time.Millisecond)
			continue
		}
		for {
			ev, err := st.Recv()
			if err != nil {
				break
			}
			from = ev.Index
			if pc := ev.GetPhaseChanged(); pc != nil && pc.To == pb.WorkerPhase_WORKER_PHASE_FAILED {
				out = append(out, Failure{Worker: pc.WorkerId, Inc: pc.Incarnation, Index: ev.Index})
			}
			stats.countEvent(ev)
			if ev.GetMigration() != nil || ev.GetRecoveryPlan() != nil {
				e.mu.Lock()
				if id := e.migs.countMigration(ev); id != "" {
					e.committed[id] = true
				}
				e.mu.Unlock()
			}
			if pc := ev.GetPhaseChanged(); pc != nil && pc.To == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
				e.mu.Lock()
				e.inService[pc.WorkerId] = pc.Incarnation
				e.mu.Unlock()
			}
		}
	}
	return out, stats
}

// sampleBudgets reads the reservations, the load table and the worker
// table (for the pairings) twice a second.
func (e *env) sampleBudgets(ctx context.Context) ([]BudgetSample, []TableSample) {
	var out []BudgetSample
	var tables []TableSample
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return out, tables
		case <-t.C:
		}
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		r, err := e.client.ListWorkers(qctx, &pb.ListWorkersRequest{Consistency: pb.Consistency_CONSISTENCY_STALE})
		cancel()
		if err != nil {
			continue
		}
		now := e.hist.Now()
		out = append(out, holderSamples(now, r)...)
		e.mu.Lock()
		for _, l := range r.Loads {
			e.peakKV = max(e.peakKV, l.KvPagesUsed)
		}
		for _, m := range r.Migrations {
			e.peakMigrating = max(e.peakMigrating, m.In)
		}
		e.mu.Unlock()
		tables = append(tables, TableSample{At: now, Rows: tableRows(r.Workers)})
	}
}

// holderSamples pairs each holder's reservations with the bytes its store
// reported holding (the load report's stored_checkpoint_bytes).
func holderSamples(at int64, r *pb.ListWorkersResponse) []BudgetSample {
	stored := map[string]uint64{}
	for _, l := range r.Loads {
		stored[l.WorkerId] = l.StoredCheckpointBytes
	}
	var out []BudgetSample
	for _, h := range r.Reservations {
		out = append(out, BudgetSample{At: at, Worker: h.WorkerId, Reserved: h.ReservedBytes, Held: h.Held, Stored: stored[h.WorkerId], Budget: h.BudgetBytes})
	}
	return out
}

// quiesce completes the placements the placement clients left open (their
// final reads found them), then waits until no placement is left and no
// holder reserves or stores a byte: the streams have ended, so their
// gateways' Completes and their serving workers' releases must bring every
// table to zero, and a killed gateway's session must expire with its
// placements. It waits quiesceSettle, plus the session TTL after a
// gateway-kill, and returns the last observation.
func (e *env) quiesce(ctx context.Context, final map[string]Op) Quiescence {
	start := time.Now()
	wait := quiesceSettle
	if len(e.gatewayKills()) > 0 {
		wait += e.cfg.SessionTTL
	}
	deadline := start.Add(wait)
	var open []string
	for id, f := range final {
		if f.Found {
			open = append(open, id)
		}
	}
	sort.Strings(open)
	for len(open) > 0 && time.Now().Before(deadline) && ctx.Err() == nil {
		batch := open[:min(len(open), 100)]
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := e.client.Complete(cctx, &pb.CompleteRequest{RequestIds: batch})
		cancel()
		if err != nil {
			sleepCtx(ctx, 100*time.Millisecond)
			continue
		}
		open = open[len(batch):]
	}
	// The stream clients' sessions hold nothing any more.
	e.mu.Lock()
	sessions := e.sessions
	e.mu.Unlock()
	for _, sid := range sessions {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		if _, err := e.client.DestroySession(cctx, &pb.DestroySessionRequest{SessionId: sid}); err != nil {
			e.logf("destroying session %s: %v", sid, err)
		}
		cancel()
	}
	var q Quiescence
	for {
		q = e.observeQuiescence(ctx)
		q.Waited = time.Since(start)
		if q.Quiet() || !time.Now().Before(deadline) || ctx.Err() != nil {
			e.logf("quiescence after %s: %d placements, quiet %v", q.Waited.Round(100*time.Millisecond), q.Placements, q.Quiet())
			return q
		}
		sleepCtx(ctx, 250*time.Millisecond)
	}
}

// observeQuiescence reads every holder's reservations and stored bytes
// (linearizably) and the size of the placement table on the replica that
// has applied the most (load reports keep the log moving, so a follower is
// always an entry or two behind; nothing creates placements any more, so
// the most recent replica is the one to ask).
func (e *env) observeQuiescence(ctx context.Context) Quiescence {
	qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	r, err := e.client.ListWorkers(qctx, &pb.ListWorkersRequest{Consistency: pb.Consistency_CONSISTENCY_LINEARIZABLE})
	if err != nil {
		return Quiescence{Err: err.Error()}
	}
	var latest *pb.ClusterStatusResponse
	for i, ctl := range e.cl.Controllers {
		if !ctl.Running() {
			continue
		}
		if st, err := e.cl.Status(qctx, i); err == nil && (latest == nil || st.AppliedIndex > latest.AppliedIndex) {
			latest = st
		}
	}
	if latest == nil {
		return Quiescence{Err: "no controller answered ClusterStatus"}
	}
	return Quiescence{Placements: latest.Placements, Holders: holderSamples(e.hist.Now(), r), Workers: e.workersQuiet(qctx, r)}
}

// workersQuiet reads what each worker holds from the table r (its last
// load report, the MIGRATING placements out of and into it) and from its
// metrics (migrations under way, pre-allocations).
func (e *env) workersQuiet(ctx context.Context, r *pb.ListWorkersResponse) []WorkerQuiet {
	byID := map[string]*WorkerQuiet{}
	var out []WorkerQuiet
	for _, w := range e.cl.Workers {
		byID[w.ID] = &WorkerQuiet{Worker: w.ID}
	}
	for _, l := range r.Loads {
		if w := byID[l.WorkerId]; w != nil {
			w.Reported, w.Running, w.Waiting, w.KVPages = true, l.Running, l.Waiting, l.KvPagesUsed
		}
	}
	for _, m := range r.Migrations {
		if w := byID[m.WorkerId]; w != nil {
			w.TableOut, w.TableIn = m.Out, m.In
		}
	}
	for _, p := range e.cl.Workers {
		w := byID[p.ID]
		var err error
		if w.LiveOut, err = p.Metric(ctx, `lumen_worker_migrations{direction="out"}`); err == nil {
			w.LiveIn, err = p.Metric(ctx, `lumen_worker_migrations{direction="in"}`)
		}
		if err != nil {
			w.ScrapeErr = err.Error()
		}
		out = append(out, *w)
	}
	return out
}

// finalReads reads every dispatched id linearizably once the faults are
// healed, retrying until the cluster answers.
func (e *env) finalReads(ctx context.Context, ops []Op) map[string]Op {
	var ids []string
	seen := map[string]bool{}
	for _, op := range ops {
		if op.Kind == Dispatch && !seen[op.ID] {
			seen[op.ID] = true
			ids = append(ids, op.ID)
		}
	}
	out := map[string]Op{}
	var mu sync.Mutex
	// A cluster that never got its quorum back must not hold the run for
	// hours: ids left unread show up as durability violations.
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	jobs := make(chan string)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for id := range jobs {
				if f, ok := e.finalRead(ctx, id); ok {
					mu.Lock()
					out[id] = f
					mu.Unlock()
				}
			}
		})
	}
	for _, id := range ids {
		jobs <- id
	}
	close(jobs)
	wg.Wait()
	return out
}

func (e *env) finalRead(ctx context.Context, id string) (Op, bool) {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		r, err := e.client.GetPlacement(rctx, &pb.GetPlacementRequest{RequestId: id})
		cancel()
		if status.Code(err) == codes.NotFound {
			return Op{ID: id}, true
		}
		if err == nil {
			f := Op{ID: id, Found: true}
			fill(&f, r.Placement)
			return f, true
		}
		sleepCtx(ctx, 100*time.Millisecond)
	}
	return Op{}, false
}

// converge stops the workers (their load reports move the log) and waits until every replica has applied the same index, then
// returns each replica's state hash.
func (e *env) converge(ctx context.Context) []ReplicaState {
	e.cl.StopWorkers()
	deadline := time.Now().Add(45 * time.Second)
	var last []ReplicaState
	for time.Now().Before(deadline) && ctx.Err() == nil {
		last = last[:0]
		for i, ctl := range e.cl.Controllers {
			cl, err := ctlclient.New([]string{ctl.GRPCAddr}, nil)
			if err != nil {
				continue
			}
			sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			var st *pb.ClusterStatusResponse
			err = cl.Operator(sctx, func(ctx context.Context, op pb.OperatorClient) (err error) {
				st, err = op.ClusterStatus(ctx, &pb.ClusterStatusRequest{WithStateHash: true})
				return err
			})
			cancel()
			cl.Close()
			if err == nil {
				last = append(last, ReplicaState{Node: e.cl.Controllers[i].ID, Index: st.StateIndex, Hash: st.StateHash})
			}
		}
		if len(last) == len(e.cl.Controllers) && CheckConverged(last).OK {
			return last
		}
		sleepCtx(ctx, 250*time.Millisecond)
	}
	return last
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// reference decodes prompts alone with the transformer: the failure-free
// output every stream must equal.
type reference struct {
	mu    sync.Mutex
	path  string
	eng   *engine.Transformer
	cache map[string]string
}

func newReference(path string) *reference { return &reference{path: path, cache: map[string]string{}} }

func (r *reference) text(prompt string, max int) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	key := fmt.Sprintf("%d\x00%s", max, prompt)
	if t, ok := r.cache[key]; ok {
		return t
	}
	if err := r.loadLocked(); err != nil {
		return "reference engine: " + err.Error()
	}
	var tk tokenizer.Tokenizer
	t := engine.GreedyText(r.eng, tk.Encode(prompt), max)
	r.cache[key] = t
	return t
}

// loadLocked loads the engine on first use; r.mu must be held.
func (r *reference) loadLocked() error {
	if r.eng != nil {
		return nil
	}
	var err error
	r.eng, err = engine.NewTransformer(engine.TransformerConfig{Path: r.path, Pages: 64})
	return err
}

// info describes the model the workers run (its KV page size).
func (r *reference) info() (engine.Info, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.loadLocked(); err != nil {
		return engine.Info{}, err
	}
	return r.eng.Info(), nil
}

// Nemeses that cannot inject their fault say why.
var (
	// errNoLeader: no controller says it leads.
	errNoLeader = errors.New("no leader")
	// errOneGateway: gateway-kill needs a second gateway to keep serving.
	errOneGateway = errors.New("one gateway: gateway-kill needs another to keep serving")
)

// leader returns the index of the controller that says it leads (the
// highest term wins), among the running ones.
func (e *env) leader(ctx context.Context) (int, error) {
	best, term := -1, uint64(0)
	for i, ctl := range e.cl.Controllers {
		if !ctl.Running() {
			continue
		}
		sctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		st, err := e.cl.Status(sctx, i)
		cancel()
		if err == nil && st.State == "Leader" && st.Term >= term {
			best, term = i, st.Term
		}
	}
	if best < 0 {
		return -1, errNoLeader
	}
	return best, nil
}

// signalAll sends sig to every process of the cluster (SIGCONT at heal).
func (e *env) signalAll(sig syscall.Signal) {
	for i := range e.cl.Controllers {
		_ = e.cl.Signal(i, sig)
	}
	for _, w := range e.cl.Workers {
		if w.Running() {
			_ = e.cl.SignalWorker(w, sig)
		}
	}
}

// gatewayKills returns the gateways killed so far.
func (e *env) gatewayKills() []GatewayKill {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]GatewayKill(nil), e.kills...)
}

// Summary is the table `make jepsen` prints.
func Summary(reports []*Report) string {
	var b strings.Builder
	checkers := []string{}
	if len(reports) > 0 {
		for _, v := range reports[0].Verdicts {
			checkers = append(checkers, v.Checker)
		}
	}
	fmt.Fprintf(&b, "%-44s %6s %7s %6s %8s %6s", "nemesis", "seed", "ops", "indet", "streams", "faults")
	for _, c := range checkers {
		fmt.Fprintf(&b, " %-8s", abbreviate(c))
	}
	b.WriteString("\n")
	for _, r := range reports {
		faults := 0
		for _, n := range r.Faults {
			faults += n
		}
		fmt.Fprintf(&b, "%-44s %6d %7d %6d %8d %6d", r.Name, r.Seed, r.Ops, r.Indeterminate, r.Streams, faults)
		for _, v := range r.Verdicts {
			fmt.Fprintf(&b, " %-8s", v.String())
		}
		b.WriteString("\n")
	}
	for _, r := range reports {
		if p := r.Progress; p.Restarts > 0 || len(p.AssistKills) > 0 {
			fmt.Fprintf(&b, "%s: %s\n", r.Name, p)
		}
		if m := r.Migrations; m.Any() {
			fmt.Fprintf(&b, "%s: %s\n", r.Name, m)
		}
		if r.Place != (PlaceStats{}) {
			fmt.Fprintf(&b, "%s: place stream clients: %s\n", r.Name, r.Place)
		}
		if len(r.GatewayPaths.Counts) > 0 {
			fmt.Fprintf(&b, "%s: gateways: %s\n", r.Name, r.GatewayPaths)
		}
	}
	var keys []string
	for _, c := range checkers {
		keys = append(keys, abbreviate(c)+" = "+c)
	}
	sort.Strings(keys)
	fmt.Fprintf(&b, "(%s)\n", strings.Join(keys, ", "))
	return b.String()
}

func abbreviate(s string) string {
	if len(s) <= 8 {
		return s
	}
	parts := strings.Split(s, "-")
	if len(parts) > 1 {
		a := ""
		for _, p := range parts {
			a += p[:1]
		}
		return a
	}
	return s[:8]
}
