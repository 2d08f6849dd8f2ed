package sim

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/lumen-project/lumen/fsm"
	"github.com/lumen-project/lumen/internal/placer"
	"github.com/lumen-project/lumen/internal/recoverystudy"
	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
	"github.com/lumen-project/lumen/worker/loadreport"
)

// ErrInvalid: the Config cannot be simulated.
var ErrInvalid = errors.New("sim: invalid config")

// Failure is one worker failure.
type Failure struct {
	Worker  int           // index, 0-based (worker-1 is 0)
	At      time.Duration // virtual time of the kill
	Restart bool          // the process restarts at once and reloads the model
}

// Config is one simulation.
type Config struct {
	// Workers is the cluster size; Profile the GPU and model every worker
	// emulates.
	Workers int
	Profile engine.Profile
	// Strategy is the recovery strategy; Lambda weighs the restore delay in
	// h(r) (0: the fsm's default, 1).
	Strategy policy.Strategy
	Lambda   float64

	// The worker's own limits (worker.Config): the step's token budget,
	// the running and waiting caps; KVPages is the KV cache in pages (0:
	// the profile's GPU, Profile.KVPages); CheckpointBudget is host memory
	// for other workers' checkpoints, bytes.
	TokenBudget, MaxRunning, MaxWaiting int
	KVPages                             int
	CheckpointBudget                    uint64

	// Failure domains and replication (issue 24). GPUsPerNode > 0 puts
	// the workers on nodes of that many, in id order (worker-1 …
	// worker-N on node-1, …), which they register (pb.Worker.node) unless
	// DomainBlind: then the fsm places checkpoints knowing no node, as
	// before, while a node's workers still fail together (NodeFailures).
	// CheckpointReplicas is SetStrategy's checkpoint_replicas (0: the
	// fsm's default, 1): the serving worker sends each page to every copy's
	// holder over its one link, each copy behind a queue of its own
	// (Timing.SendQueuePages pages), in step: a page goes to all of them or,
	// when any queue is full, to none until the next step.
	GPUsPerNode        int
	DomainBlind        bool
	CheckpointReplicas int

	// Arrivals are the requests, sorted by time.
	Arrivals []workload.Request
	Failures []Failure
	// StopAt, when > 0, ends the run there, with requests still open
	// (calibration runs); otherwise the run ends when the last request does.
	StopAt time.Duration

	Timing Timing

	// Speculation is progressive recovery with speculation assist
	// (strategy Lumen only): a restarted worker registers its new
	// incarnation in LOADING_DRAFT, drafts for the worker the fsm pairs it
	// with while in ASSIST, copies its weights to the GPU in HOTSWAP, then
	// serves (doc.go says the timeline). Off, a restarted worker registers
	// in FULL_SERVICE after the plain reload (Profile.LoadTime).
	Speculation bool
	Spec        SpecOptions
	// Oracle is the recovery no real system can run, the floor of every
	// failed column (recoverystudy.Column.Oracle), through the same core
	// and fsm: the failed worker's MarkFailed commits at the kill (no
	// detection delay), each request its plan moves is called again on
	// the chosen survivor at once (no poll) with every full page of its
	// history in that survivor's store (oraclePages), imported in no time
	// (step), so only the last partial page is computed with its next
	// token, admitted ahead as every resume (core.makeRoom). The restart
	// and the reload run at the usual detection time, so the capacity is
	// lost exactly as in the other columns. A request that had produced
	// no token has no restorable pages in the core (core.restorable): it
	// is called again at once, and prefilled again.
	Oracle bool
	// Migration is live migration for balance (Llumnix): the fsm's
	// switch is set ON (SetStrategyCmd.migration) and the leader's round
	// runs every Timing.MigrationInterval (migrate.go); off, no request
	// moves while its worker serves.
	Migration bool
	// Gateways, when > 0, is issue 16's dispatch: that many gateways, each
	// choosing the serving worker from its own lagging replica of the load
	// table (internal/placer), the request starting there at once and its
	// placement committing in parallel (gateways.go). 0 is the dispatch
	// inside Apply: the fsm chooses and the request starts after the
	// commit.
	Gateways int
	// GatewayChoice is how the gateways choose (ChooseFreest: the placer
	// without shares).
	GatewayChoice GatewayChoice
	// RoundRobin dispatches the requests to the workers in full service in
	// turn (the Dispatch names the worker, as a gateway's does) instead of
	// Apply's freeness choice: Llumnix's round-robin baseline.
	RoundRobin bool
	// MigrationFilter is how the leader's round uses the policy's plan
	// (llumnixsim.go): MigrateAsPlanned (the zero value) applies it as the
	// controller does.
	MigrationFilter MigrationFilter
	// PrefixCache turns on the workers' automatic prefix caching
	// (core.Config.PrefixCache); PrefixRouting places each request by
	// internal/placer.PickPrefix over an index of the workers' caches fed
	// by their KV events (prefix.go), naming the worker in the Dispatch
	// as a gateway does, instead of Apply's freeness choice.
	PrefixCache, PrefixRouting bool
	// PlanResumes, with PrefixRouting, resumes every interrupted request
	// where its recovery plan moved it, as before the gateway placed a
	// recomputed resume by its cached prefix (prefixResume): the
	// ablation of that choice, on the same arrivals.
	PlanResumes bool
	// Priorities: the requests carry their arrivals' priorities
	// (workload.Request.Priority) in their Dispatch and Generate calls,
	// as the API's priority field does; off, every request is of the
	// default priority whatever its arrival says (a cluster without
	// priorities, on the same arrivals).
	Priorities bool
	// TokenSeries records every worker's committed tokens at each queue
	// sample (Result.WorkerTokens), for decode rates over any interval.
	TokenSeries bool
	// StepTrace records every engine step and where and when each
	// request was admitted (Result.StepTrace, ReqTrace: spectrace.go).
	StepTrace bool

	// MeasureApply times fsm.Apply of every Dispatch and MarkFailed on the
	// wall clock (the only nondeterministic figures; off in tests).
	MeasureApply bool
	// Cells, when > 1, splits the cluster into that many cells (cells.go),
	// each a controller quorum (its own fsm) over Workers/Cells workers;
	// the gateways (Gateways > 0) choose the cell, then the worker. 0 and
	// 1 are one quorum.
	Cells int
	// RaftFrom and RaftTo are the span whose Raft writes Result.Raft
	// counts (RaftTo 0: to the end of the run).
	RaftFrom, RaftTo time.Duration
	// Progress, when set, is called about every ProgressEvery simulated
	// seconds (0: 10 s).
	Progress      func(now time.Duration, done, total int)
	ProgressEvery time.Duration

	// NoDecodeRuns turns the decode runs off (runs.go): every step end
	// touches every row, as before them; the results are the same.
	NoDecodeRuns bool

	// keepRequests keeps every request's simRequest to the end of the run
	// (tests that read them afterwards); otherwise a request that ended
	// leaves only what Result needs of it (reqDone).
	keepRequests bool
}

// Timing is the part of the system around the worker core and the fsm that
// is modelled by delays and rates. DefaultTiming says where each value
// comes from.
type Timing struct {
	// CommitDelay is a Dispatch's Raft commit: the gateway's Generate
	// reaches the worker this long after the request arrived.
	CommitDelay time.Duration
	// DetectDelay is from a kill to MarkFailed applied (the fast path: a
	// broken stream, ReportUnreachable, the leader's failed probe).
	DetectDelay time.Duration
	// Reload is how a restarted worker's model comes back (the zero
	// value, warm: the profile's LoadTime); New applies it to Profile and,
	// cold, to the draft's (engine.Profile.WithReload). ReloadScale
	// scales the result.
	Reload engine.Reload
	// Preemption is the workers' rule for a running request short of a KV
	// page (core.Config.Preemption; the zero value, lumen's: it waits).
	Preemption core.Preemption
	// DecodeContext turns on the profile's context-dependent decode step
	// (engine.Profile.DecodeContext): every row costs the KV read of its
	// own context. Off, the profile's fitted line, whatever the lengths.
	DecodeContext bool
	// StepScale makes every engine step this many times the profile's
	// (engine.Profile.Slowed; 0 or 1: the profile's own), the calibration's
	// as well as the columns': with the saturated rate given, the same
	// arrivals served a few percent slower (lumen sim -step-scale).
	StepScale float64
	// Hang makes a failure a hang (SIGSTOP) instead of a kill: the
	// process's connections stay open, so its streams break and calls to
	// it fail only when MarkFailed moves its requests (the gateway's event
	// watch) DetectDelay later (Serf's detection: DefaultHangDetect); the
	// process is killed and restarted then, its reload starting there.
	Hang bool
	// PollFirst and PollMax are the gateway's GetPlacement polling after a
	// broken stream (first wait, doubling to PollMax).
	PollFirst, PollMax time.Duration
	// RedispatchAfter: a request that had streamed nothing is dispatched
	// afresh when its placement has not moved by then.
	RedispatchAfter time.Duration
	// LoadInterval is how often the worker's reporter checks its load
	// against LoadRule (it checks after every step and call too);
	// QueueWindow the window of q_w; ReconcileInterval the holders' store
	// reconciliation.
	LoadInterval, QueueWindow, ReconcileInterval time.Duration
	// LoadRule is when a load report is sent (worker/loadreport, the
	// worker's Config.LoadRule).
	LoadRule loadreport.Rule
	// NetBytesPerSec is a worker's outgoing link for checkpoint pages;
	// SendQueuePages the sender's bounded queue per worker.
	NetBytesPerSec float64
	SendQueuePages int
	// ReloadScale scales the profile's LoadTime for a restarted worker.
	ReloadScale float64
	// SampleEvery is the queue-length sampling period (recovery time).
	SampleEvery time.Duration
	// LinkLatency is the Assist stream's one-way latency between a
	// drafter and its target (mirror updates one way, drafts the other),
	// and a migration stage's ack.
	LinkLatency time.Duration
	// Live migration: the leader's round (MigrationInterval) and its
	// stage timeout, from a migration's start to its commit
	// (MigrationTimeout); InterconnectBytesPerSec is the KV copy between
	// two workers (a stage of n pages takes n × page bytes / it).
	MigrationInterval, MigrationTimeout time.Duration
	InterconnectBytesPerSec             float64
	// Gateways (Config.Gateways): a gateway's WatchLoad stream brings a
	// load table every WatchInterval, each WatchDelay after the fsm was
	// read.
	WatchInterval, WatchDelay time.Duration
}

// DefaultHangDetect is from a hang to MarkFailed applied: Serf's
// detection with lumen's memberlist settings (internal/gossip: probe
// 200 ms, timeout 100 ms, suspicion ×2, gossip 100 ms), measured as
// 0.6–0.8 s by `lumen bench recovery -quick -setups w4 -detect hang`
// (docs/calibration.md, "Control-plane anchors"; memberlist's
// defaults take 5.6 s at 10 nodes, 9.8 s at 50: -detect hang:5.6s).
const DefaultHangDetect = 800 * time.Millisecond

// DefaultTiming returns the values measured on, or configured in, the real
// system:
//   - CommitDelay 3 ms: a fsync'd Raft commit, p50 (docs/calibration.md).
//   - DetectDelay 45 ms: MarkFailed after a kill -9 on the fast path, as
//     measured in the demo (docs/architecture.md); the recovery benchmark
//     saw 14–51 ms idle and 140–270 ms under load on 2 shared cores.
//   - PollFirst 20 ms, PollMax 250 ms, RedispatchAfter 1 s: the gateway's
//     resumeTarget.
//   - LoadInterval 250 ms, LoadRule loadreport.DefaultRule(), QueueWindow
//     10 s, ReconcileInterval 2 s: the worker's defaults
//     (worker.DefaultConfig).
//   - NetBytesPerSec 12.5 GB/s (100 GbE, docs/calibration.md), SendQueuePages
//     1024 (the worker's ckptQueue).
//   - ReloadScale 1, Reload warm: the profile's disk + host-to-GPU +
//     engine init, a restart on the same host.
//   - DecodeContext off: the profiles' fitted step line, with which the
//     setups' figures were measured.
//   - Hang off: a kill -9, detected on the fast path.
//   - SampleEvery 250 ms: the benchmark's queue sampler.
//   - LinkLatency 100 µs: one gRPC message on an open stream inside a
//     datacenter network (a few tens of µs of wire and switch latency plus
//     the stack on both ends); the batches are a few KB, so bandwidth adds
//     nothing that matters at 12.5 GB/s.
//   - MigrationInterval 500 ms and MigrationTimeout 10 s: the controller's
//     defaults (controller.DefaultConfig; Llumnix reschedules every
//     500 ms).
//   - InterconnectBytesPerSec 25 GB/s: the worker's -interconnect default,
//     the profile's, engine.DefaultInterconnectBytesPerSec (one 200 Gb/s
//     link between nodes; docs/calibration.md, "Migration arithmetic"): a
//     page of Qwen3-14B (2.6 MB) in 105 µs, a 4k-token request's 256 pages
//     in 27 ms.
//   - WatchInterval 10 ms: WatchLoad's default interval_ms
//     (proto/controller.proto). WatchDelay 1 ms: a table of 64 rows (a
//     few KB) on an open stream is one LinkLatency, but the controller
//     serving it may be a follower a replication round behind the leader
//     (an AppendEntries round trip on a LAN, a few hundred µs) and the
//     table is built and marshalled on a loaded controller: 1 ms rounds
//     that up.
func DefaultTiming() Timing {
	return Timing{CommitDelay: 3 * time.Millisecond, DetectDelay: 45 * time.Millisecond,
		PollFirst: 20 * time.Millisecond, PollMax: 250 * time.Millisecond, RedispatchAfter: time.Second,
		LoadInterval: 250 * time.Millisecond, LoadRule: loadreport.DefaultRule(), QueueWindow: 10 * time.Second, ReconcileInterval: 2 * time.Second,
		NetBytesPerSec: 12.5e9, SendQueuePages: 1024, ReloadScale: 1, SampleEvery: 250 * time.Millisecond,
		LinkLatency: 100 * time.Microsecond, MigrationInterval: 500 * time.Millisecond, MigrationTimeout: 10 * time.Second,
		InterconnectBytesPerSec: engine.DefaultInterconnectBytesPerSec, WatchInterval: 10 * time.Millisecond, WatchDelay: time.Millisecond}
}

// Under is t with a setup's conditions: its detection (ParseDetect), its
// reload (engine.ParseReload) and its decode step; an empty condition
// leaves t's.
func (t Timing) Under(c recoverystudy.Conditions) (Timing, error) {
	if c.Detect != "" {
		delay, hang, err := ParseDetect(c.Detect)
		if err != nil {
			return t, fmt.Errorf("detection: %w", err)
		}
		t.DetectDelay, t.Hang = delay, hang
	}
	if c.Reload != "" {
		r, err := engine.ParseReload(c.Reload)
		if err != nil {
			return t, fmt.Errorf("reload: %w", err)
		}
		t.Reload = r
	}
	if c.Preemption != "" {
		p, err := core.ParsePreemption(c.Preemption)
		if err != nil {
			return t, err
		}
		t.Preemption = p
	}
	t.DecodeContext = c.DecodeContext
	return t, nil
}

// Validate says what is wrong with the Config.
func (c *Config) Validate() error {
	var errs []error
	if c.Workers < 1 {
		errs = append(errs, fmt.Errorf("Workers (%d) must be >= 1", c.Workers))
	}
	if c.Profile.DecodeBaseMs <= 0 || c.Profile.PrefillTokensPerSec <= 0 {
		errs = append(errs, errors.New("a Profile with step times is required"))
	}
	if c.TokenBudget < 1 || c.MaxRunning < 1 || c.MaxWaiting < 1 {
		errs = append(errs, fmt.Errorf("TokenBudget (%d), MaxRunning (%d) and MaxWaiting (%d) must be >= 1", c.TokenBudget, c.MaxRunning, c.MaxWaiting))
	}
	if !c.Strategy.Known() {
		errs = append(errs, fmt.Errorf("unknown strategy %d: use %s", c.Strategy, policy.StrategyNames()))
	}
	if c.GPUsPerNode < 0 {
		errs = append(errs, fmt.Errorf("GPUsPerNode (%d) must be >= 0 (0: no nodes)", c.GPUsPerNode))
	}
	if c.CheckpointReplicas < 0 || c.CheckpointReplicas > policy.MaxCheckpointReplicas {
		errs = append(errs, fmt.Errorf("CheckpointReplicas (%d) must be in 0 … %d", c.CheckpointReplicas, policy.MaxCheckpointReplicas))
	}
	for _, f := range c.Failures {
		if f.Worker < 0 || f.Worker >= c.Workers {
			errs = append(errs, fmt.Errorf("failure of worker index %d: the cluster has %d", f.Worker, c.Workers))
		}
	}
	t := c.Timing
	if t.LoadInterval <= 0 || t.QueueWindow <= 0 || t.ReconcileInterval <= 0 || t.SampleEvery <= 0 || t.PollFirst <= 0 || t.PollMax <= 0 {
		errs = append(errs, errors.New("Timing: intervals must be positive (start from DefaultTiming)"))
	}
	if err := t.LoadRule.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("Timing.LoadRule: %w", err))
	}
	if t.NetBytesPerSec <= 0 || t.SendQueuePages < 1 {
		errs = append(errs, errors.New("Timing: NetBytesPerSec and SendQueuePages must be positive"))
	}
	if t.DecodeContext && (c.Profile.HBMBytesPerSec <= 0 || c.Profile.DecodeRefContext <= 0) {
		errs = append(errs, fmt.Errorf("Timing: DecodeContext needs a Profile with HBMBytesPerSec (%g) and DecodeRefContext (%d)", c.Profile.HBMBytesPerSec, c.Profile.DecodeRefContext))
	}
	if t.LinkLatency < 0 {
		errs = append(errs, fmt.Errorf("Timing: LinkLatency (%s) must be >= 0", t.LinkLatency))
	}
	if t.StepScale < 0 || t.StepScale > 0 && (t.StepScale < 0.5 || t.StepScale > 2) {
		errs = append(errs, fmt.Errorf("Timing: StepScale (%g) must be 0 (the profile's steps) or from 0.5 to 2", t.StepScale))
	}
	if c.Migration && (t.MigrationInterval <= 0 || t.MigrationTimeout < t.MigrationInterval || t.InterconnectBytesPerSec <= 0) {
		errs = append(errs, fmt.Errorf("Timing: with Migration, MigrationInterval (%s) must be positive, MigrationTimeout (%s) at least it, and InterconnectBytesPerSec (%g) positive",
			t.MigrationInterval, t.MigrationTimeout, t.InterconnectBytesPerSec))
	}
	if c.Gateways < 0 || c.Gateways > 0 && (t.WatchInterval <= 0 || t.WatchDelay < 0) {
		errs = append(errs, fmt.Errorf("Gateways (%d) must be >= 0, and with gateways Timing.WatchInterval (%s) positive and WatchDelay (%s) >= 0",
			c.Gateways, t.WatchInterval, t.WatchDelay))
	}
	if c.PrefixRouting && (c.Gateways > 0 || c.RoundRobin) {
		errs = append(errs, fmt.Errorf("PrefixRouting places inside the dispatch: it does not run with Gateways (%d) or RoundRobin", c.Gateways))
	}
	errs = append(errs, c.validateSpec()...)
	errs = append(errs, c.validateCells()...)
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrInvalid, errors.Join(errs...))
	}
	return nil
}

// epoch is virtual time zero on the clocks the core and the fsm read.
var epoch = time.Unix(1_800_000_000, 0)

// event is one scheduled happening; seq breaks ties in scheduling order.
// A worker's step end, the most frequent event, is fn nil with w and gen
// (the process generation it was started in; run runs it): no closure
// is allocated for it.
type event struct {
	at  time.Duration
	seq uint64
	fn  func()
	w   *simWorker
	gen uint64
}

// before is the events' order: by time, then by scheduling order.
func (e *event) before(o *event) bool {
	return e.at < o.at || e.at == o.at && e.seq < o.seq
}

// eventQueue is a 4-ary min-heap of events by before. The order is total
// (seq is unique), so any heap pops the same sequence; a 4-ary one is
// half as deep as a binary one and reads a node's children from one or
// two cache lines (container/heap also boxed every event in an
// interface: an allocation per push and pop).
type eventQueue []event

func (q eventQueue) Len() int { return len(q) }

func (q *eventQueue) push(e event) {
	*q = append(*q, e)
	h := *q
	i := len(h) - 1
	for i > 0 {
		p := (i - 1) / 4
		if !h[i].before(&h[p]) {
			break
		}
		h[i], h[p] = h[p], h[i]
		i = p
	}
}

func (q *eventQueue) pop() event {
	h := *q
	top := h[0]
	n := len(h) - 1
	h[0] = h[n]
	h[n] = event{} // no closure kept alive by the spare slot
	h = h[:n]
	*q = h
	i := 0
	for {
		c := 4*i + 1
		if c >= n {
			break
		}
		m := c
		for k := c + 1; k < c+4 && k < n; k++ {
			if h[k].before(&h[m]) {
				m = k
			}
		}
		if !h[m].before(&h[i]) {
			break
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
	return top
}

// Sim is one simulation in progress. Run it with Run.
type Sim struct {
	cfg   Config
	now   time.Duration
	queue eventQueue
	seq   uint64
	steps uint64 // events processed

	fsm *fsm.FSM // the one cell's; nil with Config.Cells > 1 (cells.go)
	// cells are the controller quorums (cells.go); reqCell, with more
	// than one, the cell of each dispatch id placed.
	cells   []*simCell
	reqCell map[string]*simCell

	workers   []*simWorker
	byWorker  map[string]*simWorker
	draftProf engine.Profile         // the draft model's (Speculation)
	reqs      []*simRequest          // by arrival index; nil until it arrives, and once it ended (done)
	byID      map[string]*simRequest // dispatch id → request
	// done is, by arrival index, what Result needs of a request that
	// ended (its simRequest is let go then, unless keepRequests), and
	// doneExtra the rare rest: of failed, interrupted and preempted
	// requests. At 10,000 workers a simRequest a request was most of
	// what grew with the run (≈ 300 bytes each, 44,500 a second).
	done      []reqDone
	doneExtra map[int]*reqExtra

	pageBytes uint64
	// Live migration (migrate.go): the profile with the interconnect's
	// bandwidth, and the migrations under way, in start order and by
	// request id.
	migProf engine.Profile
	migs    []*simMigration
	migByID map[string]*simMigration
	marks   map[time.Duration][]*pb.Command // MarkFailed commands by the time detection ends
	// replicaOf is, by request id, the holders of a call's further
	// checkpoint copies (Placement.replica_holders), while it sends pages.
	replicaOf map[string]callCopies
	res       Result
	firstFail time.Duration // -1: none
	err       error

	// The arrivals are not on the queue (a queue of millions of events
	// would hold memory for every request of the run): next takes them
	// in turn from Config.Arrivals, in the order order gives (nil: the
	// slice's, already sorted), with the seqs reserved for them in New,
	// so that the events run in the order a queue holding them all
	// would give.
	arrived int
	arrSeq  uint64
	order   []int

	// Issue 16's gateways (Config.Gateways), and their recent placements
	// by worker (GatewayStats' herding count).
	gateways []*simGateway
	gwPlaced map[string][]gatewayPlacement

	// rr is the round-robin dispatch's next worker (Config.RoundRobin).
	rr int
	// pidx is the index of the workers' prefix caches (prefix.go).
	pidx       *placer.PrefixIndex
	overlapBuf []int

	// The run's end: events after drainUntil (≥ 0 once every request
	// ended) are not run. nextProgress is the next Progress call.
	drainUntil, nextProgress time.Duration
	// noRuns: a caller acts on the Sim between events (advance with a
	// stop): no decode run starts (runs.go).
	noRuns bool
}

// simWorker is one worker process: its core, its store, its outgoing link.
type simWorker struct {
	id    string
	node  string   // Config.GPUsPerNode's node, "" for none
	cell  *simCell // the quorum it registers with
	inc   uint64
	gen   uint64     // bumped on every kill: events of the old process are void
	alive bool       // serving (registered and not killed)
	core  *core.Core // nil while the process is down
	store *simStore
	busy  bool
	kick  bool // a kick is scheduled
	waits core.WaitWindow

	linkFree time.Duration // the outgoing link is busy until then
	// The interconnect's two directions as live migration's copies use
	// them (nextStage): busy until then.
	migOutFree, migInFree time.Duration
	empties               int // consecutive empty steps at one instant

	// The load reporter (worker/loadreport, Timing.LoadRule): q_w as of
	// its last check, and the record it builds (reused).
	reporter *loadreport.Reporter
	qw       float64
	rec      pb.LoadRecord

	outBuf [][]int32 // a step's sampled tokens, reused
	tokBuf []int32
	// st is the step in flight (busy): its end is an event of w's (atStep).
	st core.Step
	// run is the decode run in progress (runs.go), if run.on.
	run decodeRun

	// Progressive recovery (spec.go): the incarnation's phase, the
	// pairing it is in (either side), the restart's phase times, and the
	// tokens its core has committed.
	phase  pb.WorkerPhase
	as     *assist
	span   *PhaseSpan
	tokens int

	// between are calls waiting for the step in flight to end (live
	// migration's stages: the worker's sched.do).
	between []func()

	// A hung process (Timing.Hang) until its detection at hungUntil: the
	// calls made to it meanwhile (hungCalls) hang with the ones it had.
	hungUntil time.Duration
	hungCalls []*simRequest

	traceAt int // Config.StepTrace: the step in flight's record
}

// simRequest is a client request as the gateway sees it.
type simRequest struct {
	idx      int
	w        *workload.Request // in Config.Arrivals
	id       string            // dispatch id (changes on a re-dispatch)
	cell     *simCell          // the cell of the attempt placed last (Config.Cells > 1)
	attempt  int
	arrival  time.Duration
	out      int // output tokens delivered (the journal)
	first    time.Duration
	last     time.Duration
	ended    int // how many times it ended (conservation: exactly 1)
	failed   error
	call     *core.Request // the live Generate call
	epoch    uint64
	worker   string // the placement's worker at the last call
	broken   time.Duration
	pollWait time.Duration
	polling  bool

	resumeEnd   time.Duration
	interrupted bool
	// regen: the live call was made with the prompt alone, and the
	// journal's out tokens are being decoded again (a resume under
	// stop-and-restart); fresh: no new token of the call has reached the
	// client yet.
	regen, fresh bool
	// afterFail is when the client got its first token after the first
	// failure (0: none yet): an interrupted request's recovery as the
	// client sees it.
	afterFail time.Duration

	// committing: a gateway placed it and its Dispatch has not been
	// applied yet; completeAfterCommit: it completed meanwhile, and the
	// Complete goes after the Dispatch's result, as on the gateway's
	// stream.
	committing, completeAfterCommit bool
	// refusedBy are the workers whose placement of it Apply refused: the
	// gateway excludes them when it places it again.
	refusedBy []string

	// migrated is set from a migration's switch to the destination's first
	// token (the downtime).
	migrated bool

	// Preemption loss (llumnixsim.go): the KV positions the live call's
	// cache held after its last step; while preempted (preemptedAt ≥ 0)
	// the positions it held then; the loss so far.
	kvFed, fedAtPreempt int
	preemptedAt         time.Duration
	preemptLoss         time.Duration
	preempted           bool
	// restored: after the failure interrupted it, a call restored pages
	// of it from a checkpoint store (Result.Restored).
	restored bool
	// liveCopy: the recovery plan found a live copy of its checkpoint.
	liveCopy bool
	// checkpointed: that copy held at least one page of it.
	checkpointed bool
	// recomputeOn: the last recovery plan that moved it recomputes it
	// there (no checkpoint to restore), "" when it restores it: with
	// PrefixRouting the gateway may place it by its cached prefix
	// instead (prefix.go, prefixResume).
	recomputeOn string
}

// Run simulates cfg to its end and returns the result, after checking
// conservation.
func Run(cfg Config) (*Result, error) {
	s, err := New(cfg)
	if err != nil {
		return nil, err
	}
	s.Run()
	if s.err != nil {
		return nil, s.err
	}
	if cfg.StopAt == 0 {
		if err := s.Check(); err != nil {
			return nil, err
		}
	}
	return &s.res, nil
}

// New sets up a simulation: the fsm with the strategy and every worker
// registered, the arrivals and failures scheduled.
func New(cfg Config) (*Sim, error) {
	if cfg.KVPages == 0 {
		cfg.KVPages = cfg.Profile.KVPages()
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	prof, err := cfg.Profile.WithReload(cfg.Timing.Reload)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	cfg.Profile = prof
	if cfg.Timing.DecodeContext {
		cfg.Profile.DecodeContext = true
	}
	if f := cfg.Timing.StepScale; f > 0 && f != 1 {
		cfg.Profile = cfg.Profile.Slowed(f)
	}
	s := &Sim{cfg: cfg, fsm: fsm.New(), byID: map[string]*simRequest{}, byWorker: map[string]*simWorker{}, firstFail: -1,
		replicaOf: map[string]callCopies{},
		marks:     map[time.Duration][]*pb.Command{},
		pageBytes: uint64(cfg.Profile.KVBytesPerToken()) * engine.PageTokens, migByID: map[string]*simMigration{},
		drainUntil: -1}
	s.nextProgress = s.progressEvery()
	s.initCells()
	s.res.Requests = len(cfg.Arrivals)
	if cfg.StepTrace {
		s.res.ReqTrace = make([]ReqTrace, len(cfg.Arrivals))
	}
	s.res.Raft, s.res.LoadReports = map[string]RaftCount{}, map[loadreport.Reason]int{}
	s.migProf = cfg.Profile
	s.migProf.InterconnectBytesPerSec = cfg.Timing.InterconnectBytesPerSec
	mode := pb.MigrationMode_MIGRATION_MODE_OFF
	if cfg.Migration {
		mode = pb.MigrationMode_MIGRATION_MODE_ON
	}
	s.apply(&pb.Command{Body: &pb.Command_SetStrategy{SetStrategy: &pb.SetStrategyCmd{Strategy: pb.Strategy(cfg.Strategy), Lambda: cfg.Lambda,
		Migration: mode, CheckpointReplicas: uint32(cfg.CheckpointReplicas)}}})
	s.draftProf = cfg.Spec.Draft
	if s.draftProf.DecodeBaseMs == 0 {
		s.draftProf = engine.Profiles[DefaultDraftProfile]
	}
	if cfg.Timing.Reload.Kind == engine.ReloadCold {
		// A replacement node reads the draft from cold storage too (a
		// fixed duration is the target's reload alone).
		s.draftProf, _ = s.draftProf.WithReload(cfg.Timing.Reload)
	}
	for i := range cfg.Workers {
		w := &simWorker{id: fmt.Sprintf("worker-%d", i+1), cell: s.cellAt(i)}
		if cfg.GPUsPerNode > 0 {
			w.node = NodeName(i, cfg.GPUsPerNode)
		}
		s.workers = append(s.workers, w)
		s.byWorker[w.id] = w
		if i >= cfg.Workers-cfg.Spec.AssistOnly {
			s.register(w, pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT)
			s.setPhase(w, pb.WorkerPhase_WORKER_PHASE_ASSIST)
			continue
		}
		s.register(w, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE)
	}
	s.reqs = make([]*simRequest, len(cfg.Arrivals))
	s.done = make([]reqDone, len(cfg.Arrivals))
	s.doneExtra = map[int]*reqExtra{}
	s.arrSeq = s.seq
	s.seq += uint64(len(cfg.Arrivals))
	arrAt := func(i int) time.Duration { return max(cfg.Arrivals[i].At, 0) }
	if !sort.SliceIsSorted(cfg.Arrivals, func(i, j int) bool { return arrAt(i) < arrAt(j) }) {
		s.order = make([]int, len(cfg.Arrivals))
		for i := range s.order {
			s.order[i] = i
		}
		sort.SliceStable(s.order, func(i, j int) bool { return arrAt(s.order[i]) < arrAt(s.order[j]) })
	}
	for _, f := range cfg.Failures {
		if s.firstFail < 0 || f.At < s.firstFail {
			s.firstFail = f.At
		}
		s.at(f.At, func() { s.kill(s.workers[f.Worker], f.Restart) })
	}
	s.res.FailAt = max(s.firstFail, 0)
	// Workers start at different moments: their periodic reports and
	// reconciliations are spread over the period, not all at one instant.
	for i, w := range s.workers {
		frac := float64(i) / float64(len(s.workers))
		s.every(time.Duration(frac*float64(cfg.Timing.LoadInterval)), cfg.Timing.LoadInterval, func() { s.tick(w) })
		s.every(time.Duration(frac*float64(cfg.Timing.ReconcileInterval)), cfg.Timing.ReconcileInterval, func() { s.reconcile(w) })
	}
	s.every(0, cfg.Timing.SampleEvery, s.sample)
	if cfg.Gateways > 0 {
		s.startGateways()
	}
	if cfg.Migration {
		s.every(0, cfg.Timing.MigrationInterval, s.migrationRound)
	}
	return s, nil
}

// at schedules fn at virtual time t (not before now).
func (s *Sim) at(t time.Duration, fn func()) {
	s.seq++
	s.queue.push(event{at: max(t, s.now), seq: s.seq, fn: fn})
}

// atStep schedules the end of worker w's step in flight (w.st) at t,
// for its process generation gen.
func (s *Sim) atStep(t time.Duration, w *simWorker, gen uint64) {
	s.seq++
	s.queue.push(event{at: max(t, s.now), seq: s.seq, w: w, gen: gen})
}

// run processes one event.
func (s *Sim) run(e *event) {
	if e.fn != nil {
		e.fn()
		return
	}
	if w := e.w; w.gen == e.gen {
		if w.run.on {
			s.runStepDone(w)
			return
		}
		s.stepDone(w, w.st)
	}
}

// every runs fn every period, the first time at offset+period, while the
// run goes on.
func (s *Sim) every(offset, period time.Duration, fn func()) {
	var tick func()
	tick = func() {
		fn()
		s.at(s.now+period, tick)
	}
	s.at(s.now+offset+period, tick)
}

// next removes and returns the earliest event: the queue's first or the
// next arrival, whichever comes first by (at, seq); false when none is left.
func (s *Sim) next() (event, bool) {
	if s.arrived < len(s.cfg.Arrivals) {
		i := s.arrived
		if s.order != nil {
			i = s.order[i]
		}
		a := event{at: max(s.cfg.Arrivals[i].At, 0), seq: s.arrSeq + uint64(i) + 1}
		if q := s.queue; len(q) == 0 || a.at < q[0].at || a.at == q[0].at && a.seq < q[0].seq {
			s.arrived++
			a.fn = func() { s.arrive(i) }
			return a, true
		}
	}
	if s.queue.Len() == 0 {
		return event{}, false
	}
	return s.queue.pop(), true
}

// progressEvery is the Progress period.
func (s *Sim) progressEvery() time.Duration {
	if s.cfg.ProgressEvery > 0 {
		return s.cfg.ProgressEvery
	}
	return 10 * time.Second
}

// open reports whether requests are still to end.
func (s *Sim) open() bool { return s.res.Ended < len(s.reqs) }

// Run processes events until every request has ended (or StopAt), then a
// little longer, so that checkpoint pages still on the wire land and a
// reconciliation pass runs before Check.
func (s *Sim) Run() {
	s.advance(nil)
	s.syncAll()
	if s.err == nil && s.open() && s.cfg.StopAt == 0 {
		s.err = fmt.Errorf("sim: the run stalled at %s with %d of %d requests open", s.now, len(s.reqs)-s.res.Ended, len(s.reqs))
	}
	if s.cfg.StopAt > 0 || s.res.End == 0 {
		s.res.End = s.now
	}
	s.res.Events = s.steps
	s.finish()
}

// advance processes events until the run is over (Run says when), or until
// stop, when not nil, reports true after an event: then it reports true and
// the run can go on (tests act on the Sim between events that way).
func (s *Sim) advance(stop func() bool) bool {
	if stop != nil {
		// The caller reads the Sim between events: no worker lags.
		s.noRuns = true
		s.syncAll()
	}
	for s.err == nil {
		e, ok := s.next()
		if !ok {
			return false
		}
		if s.cfg.StopAt > 0 && e.at >= s.cfg.StopAt {
			return false
		}
		if s.drainUntil >= 0 && e.at > s.drainUntil {
			return false
		}
		s.now = e.at
		s.run(&e)
		s.steps++
		if s.drainUntil < 0 && !s.open() && s.cfg.StopAt == 0 {
			s.res.End = s.now
			// Long enough for a last reconciliation, and for a
			// destination to reclaim a copy no call adopted.
			drain := s.cfg.Timing.ReconcileInterval
			if s.cfg.Migration {
				drain = max(drain, core.DefaultMigrationTimeout)
			}
			s.drainUntil = s.now + drain + time.Second
		}
		if s.cfg.Progress != nil && s.now >= s.nextProgress {
			s.cfg.Progress(s.now, s.res.Ended, len(s.reqs))
			s.nextProgress += s.progressEvery()
		}
		if stop != nil && stop() {
			return true
		}
	}
	return false
}

func (s *Sim) fail(format string, args ...any) {
	if s.err == nil {
		s.err = fmt.Errorf("sim: at %s: "+format, append([]any{s.now}, args...)...)
	}
}

func (s *Sim) clock() time.Time { return epoch.Add(s.now) }

// apply proposes one command, stamped with the virtual time, as one log
// entry, and returns its result.
func (s *Sim) apply(c *pb.Command) fsm.Result { return s.applyEntry([]*pb.Command{c})[0] }

// applyEntry proposes commands as one log entry (the leader coalesces the
// commands that arrive together), stamped with the virtual time. With
// MeasureApply, the wall time of the whole Apply — the FSM lock is held
// for all of it — is recorded for Dispatch and MarkFailed entries.
func (s *Sim) applyEntry(cmds []*pb.Command) []fsm.Result {
	for _, c := range cmds {
		c.StampedUnixNano = s.clock().UnixNano()
	}
	data, err := proto.Marshal(&pb.LogEntry{Commands: cmds})
	if err != nil {
		panic(err)
	}
	cells := s.entryCells(cmds)
	var res []fsm.Result
	for _, cell := range cells { // one but for SetStrategy (every cell's)
		s.countRaft(cell, cmds)
		cell.logIndex++
		l := &raft.Log{Index: cell.logIndex, Term: 1, Type: raft.LogCommand, Data: data}
		var start time.Time
		timed := s.cfg.MeasureApply
		if timed {
			start = time.Now()
		}
		res = cell.fsm.Apply(l).([]fsm.Result)
		if timed {
			d := time.Since(start)
			switch cmds[0].Body.(type) {
			case *pb.Command_Dispatch:
				s.res.ApplyDispatch = append(s.res.ApplyDispatch, d)
			case *pb.Command_MarkFailed:
				s.res.ApplyMarkFailed = append(s.res.ApplyMarkFailed, d)
			}
		}
	}
	s.appliedIn(cells[0], cmds, res)
	return res
}

// countRaft adds an entry's commands to the Raft write stream's counts
// (Result.Raft), by command type: each command, and its bytes in the
// entry (the LogEntry's field: tag, length and the command).
func (s *Sim) countRaft(cell *simCell, cmds []*pb.Command) {
	if !s.raftWindow() {
		return
	}
	for _, c := range cmds {
		typ := fsm.CommandType(c)
		n := proto.Size(c)
		rc := s.res.Raft[typ]
		rc.Commands++
		b := int64(protowire.SizeTag(1) + protowire.SizeBytes(n))
		rc.Bytes += b
		s.res.Raft[typ] = rc
		if cell.raft != nil {
			cc := cell.raft[typ]
			cc.Commands++
			cc.Bytes += b
			cell.raft[typ] = cc
		}
	}
}

// raftWindow reports whether now is in the span the Raft counts cover.
func (s *Sim) raftWindow() bool {
	return s.now >= s.cfg.RaftFrom && (s.cfg.RaftTo == 0 || s.now < s.cfg.RaftTo)
}

func (s *Sim) capacity() *pb.Capacity {
	p := s.cfg.Profile
	return &pb.Capacity{KvPagesTotal: uint64(s.cfg.KVPages), CheckpointBudgetBytes: s.cfg.CheckpointBudget,
		KvBytesPerToken: uint64(p.KVBytesPerToken()), MaxContextTokens: uint32(p.MaxContext), H2DBytesPerSec: p.H2DBytesPerSec,
		MaxRunning: uint32(s.cfg.MaxRunning)}
}

// register starts a worker's new incarnation: an empty core and store, in
// full service or, after a failure with Speculation, in LOADING_DRAFT.
func (s *Sim) register(w *simWorker, phase pb.WorkerPhase) {
	w.inc++
	w.alive = true
	w.store = newSimStore(s.cfg.CheckpointBudget)
	w.core = core.New(core.Config{Self: w.id, TokenBudget: s.cfg.TokenBudget, MaxRunning: s.cfg.MaxRunning,
		MaxWaiting: s.cfg.MaxWaiting, TotalPages: s.cfg.KVPages, Preemption: s.cfg.Timing.Preemption, PrefixCache: s.cfg.PrefixCache}, w.store)
	s.prefixIndex().Reset(w.id) // a new process's cache is empty
	w.waits = core.WaitWindow{}
	w.busy, w.kick, w.linkFree, w.qw = false, false, s.now, 0
	if w.reporter == nil {
		w.reporter = loadreport.New(s.cfg.Timing.LoadRule)
	}
	w.reporter.Reset()
	w.between = nil
	w.phase = phase
	row := &pb.Worker{Id: w.id, Incarnation: w.inc, Phase: phase, Capacity: s.capacity(), ModelId: s.cfg.Profile.Model}
	if !s.cfg.DomainBlind {
		row.Node = w.node
	}
	if s.cfg.Speculation {
		row.DraftId = s.draftProf.Model
	}
	res := s.apply(&pb.Command{Body: &pb.Command_RegisterWorker{RegisterWorker: &pb.RegisterWorkerCmd{Worker: row}}})
	if res.Err != nil {
		s.fail("register %s: %v", w.id, res.Err)
	}
	s.relink()
	s.checkLoad(w)
}

// loadRecord fills w.rec with the worker's load as its reporter reads it
// (worker.Worker.Load), with q_w as of qw.
func (s *Sim) loadRecord(w *simWorker, qw float64) *pb.LoadRecord {
	c, used := w.core, w.store.used
	w.rec = pb.LoadRecord{WorkerId: w.id, Incarnation: w.inc, QueueWaitMs: qw,
		FreeCheckpointBytes: s.cfg.CheckpointBudget - used, StoredCheckpointBytes: used,
		Running: uint32(c.Running()), Waiting: uint32(c.Waiting()), KvPagesUsed: uint64(s.cachedPages(w)),
		KvPagesTotal: uint64(s.cfg.KVPages), QueueHeadPages: uint64(c.HeadPages()), QueuedPages: uint64(c.QueuedPages()),
		HighPriority: uint32(s.highPriority(w))}
	return &w.rec
}

// tick is the reporter's periodic check (every Timing.LoadInterval): q_w
// moves with its window even when nothing happens, so it is read here.
func (s *Sim) tick(w *simWorker) {
	if !w.alive {
		return
	}
	w.qw = w.waits.Mean(s.clock(), s.cfg.Timing.QueueWindow)
	s.checkLoad(w)
}

// publish is the scheduler's publishStats after a step, a call or a
// migration's stage: the reporter checks the load against the rule, with
// q_w as of the last check (worker.scheduler.publishStats kicks it).
func (s *Sim) publish(w *simWorker) {
	if w.alive {
		s.checkLoad(w)
	}
}

// checkLoad reports the worker's load when the rule says it is due, as
// the worker's reporter does (worker.Worker.reportLoad).
func (s *Sim) checkLoad(w *simWorker) {
	now := s.clock()
	reason, due := w.reporter.Due(now, s.loadRecord(w, w.qw))
	if !due {
		return
	}
	w.qw = w.waits.Mean(now, s.cfg.Timing.QueueWindow)
	rec := s.loadRecord(w, w.qw)
	// The queued ids go in the report sent, not in the rule's check (it
	// reads the counts): a fresh slice, as the command keeps it.
	rec.Queued = w.core.AppendQueued(nil, maxQueuedReported)
	res := s.apply(&pb.Command{Body: &pb.Command_ReportLoad{ReportLoad: &pb.ReportLoadCmd{Load: rec}}})
	if res.Err != nil {
		s.fail("report %s: %v", w.id, res.Err)
		return
	}
	w.reporter.Sent(now, rec)
	if s.raftWindow() {
		s.res.LoadReports[reason]++
	}
}

// --- the gateway ---

func dispatchID(r *simRequest) string {
	if r.attempt == 0 {
		return fmt.Sprintf("r%07d", r.idx)
	}
	return fmt.Sprintf("r%07d~%d", r.idx, r.attempt)
}

// arrive is arrival i reaching the gateway.
func (s *Sim) arrive(i int) {
	a := &s.cfg.Arrivals[i]
	r := &simRequest{idx: i, w: a, arrival: a.At, first: -1, preemptedAt: -1}
	s.reqs[i] = r
	s.dispatch(r)
}

// dispatch places the request: through a gateway's replica with
// Config.Gateways, else through the fsm.
func (s *Sim) dispatch(r *simRequest) {
	if len(s.gateways) > 0 {
		s.place(r)
		return
	}
	s.dispatchApply(r)
}

// dispatchApply places the request through the fsm; the gateway calls
// Generate once the command commits.
func (s *Sim) dispatchApply(r *simRequest) {
	r.id = dispatchID(r)
	s.byID[r.id] = r
	d := &pb.DispatchCmd{RequestId: r.id, PromptTokens: uint32(r.w.PromptLen()), MaxTokens: uint32(r.w.Output), Priority: s.priority(r)}
	if s.cfg.RoundRobin {
		s.roundRobin(d)
	}
	if s.cfg.PrefixRouting {
		s.prefixRoute(d, s.callHashes(r, false))
	}
	s.applyDispatch(r, d, s.generate)
}

// applyDispatch applies d, r's Dispatch, and makes r's call with then once
// it commits; a refusal ends r.
func (s *Sim) applyDispatch(r *simRequest, d *pb.DispatchCmd, then func(*simRequest, *pb.Placement)) {
	res := s.apply(&pb.Command{Body: &pb.Command_Dispatch{Dispatch: d}})
	if res.Err != nil {
		s.end(r, fmt.Errorf("dispatch: %w", res.Err))
		return
	}
	pl := res.Dispatch.Placement
	s.at(s.now+s.cfg.Timing.CommitDelay, func() { then(r, pl) })
}

// priority is the request's priority in its calls (Config.Priorities).
func (s *Sim) priority(r *simRequest) int32 {
	if !s.cfg.Priorities {
		return 0
	}
	return r.w.Priority
}

// token is the simulated engine's output: a fixed function of the request
// and the output index (what is generated does not matter here, only that
// the history, and so the checkpoint pages' hashes, are the same wherever
// the request runs).
func token(req, index int) int32 {
	x := uint64(req)*0x9e3779b97f4a7c15 + uint64(index)*0xbf58476d1ce4e5b9
	x ^= x >> 31
	return 32 + int32(x%95)
}

// generate is the gateway's Generate call at the placement's worker, with
// the journal's token history.
func (s *Sim) generate(r *simRequest, pl *pb.Placement) { s.call(r, pl, false) }

// resume is the gateway's call after a break, at the placement the request
// moved to: under stop-and-restart with the prompt alone, the output the
// client has decoded again (gateway.Gateway.generate), else with the whole
// history.
func (s *Sim) resume(r *simRequest, pl *pb.Placement) {
	s.call(r, pl, s.cfg.Strategy.Regenerates() && r.out > 0)
}

// call makes a Generate call at the placement's worker: with the journal's
// token history, or with the prompt alone (regen).
func (s *Sim) call(r *simRequest, pl *pb.Placement, regen bool) {
	if r.ended > 0 {
		return
	}
	r.regen, r.fresh = regen, true
	w := s.worker(pl.WorkerId)
	r.worker, r.epoch = pl.WorkerId, pl.Epoch
	if w != nil && !w.alive && w.inc == pl.WorkerIncarnation && s.now < w.hungUntil {
		w.hungCalls = append(w.hungCalls, r) // it hangs until the detection
		return
	}
	if w == nil || !w.alive || w.inc != pl.WorkerIncarnation {
		s.broke(r) // connection refused
		return
	}
	s.sync(w)
	// The prompt's ids are drawn again for each call (a lazy arrival
	// keeps none) and the history is the call's: it goes with the call.
	hist := r.w.AppendPrompt(make([]int32, 0, r.w.PromptLen()+r.w.Output))
	if !regen {
		for k := range r.out {
			hist = append(hist, token(r.idx, k))
		}
	}
	cr := &core.Request{ID: r.id, Epoch: pl.Epoch, History: hist, Prompt: r.w.PromptLen(), MaxTokens: r.w.Output,
		Priority: s.priority(r), Arrived: s.clock(), Sink: r}
	if pl.HolderId != "" {
		// A call that names its holder (worker.newRequest): the caller
		// fills the request before Submit.
		cr.Holder, cr.Reserved = pl.HolderId, s.footprint(r)
	}
	s.setReplicas(r.id, pl)
	r.call, r.kvFed = cr, 0
	w.core.Submit(cr)
	w.reporter.Admitted(r.w.PromptLen())
	s.flush(w)
	s.publish(w)
	s.wake(w)
}

func (s *Sim) worker(id string) *simWorker { return s.byWorker[id] }

// footprint is what the controller reserves on r's holder
// (policy.Footprint of its prompt, its output and a worker's capacity).
func (s *Sim) footprint(r *simRequest) uint64 {
	return policy.Footprint(uint32(r.w.PromptLen()), uint32(r.w.Output), uint32(s.cfg.Profile.MaxContext),
		uint64(s.cfg.Profile.KVBytesPerToken()))
}

// setHolder is the worker's SetHolder handler for r's call at placement
// pl's worker, which the gateway started before the placement committed:
// the core gives the call under pl's epoch its holder (core.SetHolder:
// its epoch and empty-holder checks, the checkpoint resent from page 0).
func (s *Sim) setHolder(r *simRequest, pl *pb.Placement) {
	w := s.worker(pl.WorkerId)
	if w == nil || !w.alive || w.inc != pl.WorkerIncarnation {
		return // the call fails: the stream broke, the recovery places it
	}
	s.sync(w)
	if w.core.SetHolder(pl.RequestId, pl.Epoch, pl.HolderId, s.footprint(r)) {
		s.setReplicas(pl.RequestId, pl)
	}
}

// setReplicas notes the further copies' holders of the call made for
// placement pl.
func (s *Sim) setReplicas(id string, pl *pb.Placement) {
	if pl.HolderId != "" && len(pl.ReplicaHolders) > 0 {
		s.replicaOf[id] = callCopies{holder: pl.HolderId, replicas: pl.ReplicaHolders}
	} else {
		delete(s.replicaOf, id)
	}
}

// callCopies are a call's checkpoint holders: the first copy's (the core's
// Request.Holder) and the others'.
type callCopies struct {
	holder   string
	replicas []string
}

// NodeName is the node of worker index i (0-based) with perNode workers a
// node: node-1 for the first perNode.
func NodeName(i, perNode int) string { return fmt.Sprintf("node-%d", i/perNode+1) }

// broke is a Generate stream that broke: the gateway polls the placement
// until the controller moves the request.
func (s *Sim) broke(r *simRequest) {
	r.call = nil
	r.broken = s.now
	r.pollWait = s.cfg.Timing.PollFirst
	if !r.polling {
		r.polling = true
		s.at(s.now+r.pollWait, func() { s.poll(r) })
	}
}

// poll is one GetPlacement of resumeTarget.
func (s *Sim) poll(r *simRequest) {
	r.polling = false
	if r.ended > 0 || r.call != nil {
		return
	}
	if r.committing {
		// The gateway knows nothing of the placement before its
		// Dispatch's result: it waits for it (a refusal places again).
		r.polling = true
		s.at(s.now+r.pollWait, func() { s.poll(r) })
		return
	}
	pl := s.placement(r.id)
	switch {
	case pl != nil && (pl.WorkerId != r.worker || pl.Epoch != r.epoch):
		if !s.prefixResume(r, pl) {
			s.resume(r, pl)
		}
		return
	case r.out == 0 && (pl == nil || s.now-r.broken > s.cfg.Timing.RedispatchAfter):
		s.complete(r.id)
		delete(s.byID, r.id)
		r.attempt++
		s.dispatch(r)
		return
	}
	r.pollWait = min(2*r.pollWait, s.cfg.Timing.PollMax)
	r.polling = true
	s.at(s.now+r.pollWait, func() { s.poll(r) })
}

func (s *Sim) complete(id string) {
	s.apply(&pb.Command{Body: &pb.Command_Complete{Complete: &pb.CompleteCmd{RequestIds: []string{id}}}})
}

// end records that a request ended (err nil: completed).
func (s *Sim) end(r *simRequest, err error) {
	r.ended++
	if r.ended > 1 {
		s.fail("request %s ended twice", r.id)
		return
	}
	r.failed = err
	s.res.Ended++
	if err != nil {
		s.res.Failed++
	}
	r.call = nil
	if err == nil {
		if r.committing {
			r.completeAfterCommit = true
		} else {
			s.complete(r.id)
		}
	}
	delete(s.byID, r.id)
	s.retire(r)
}

// reqDone is what Result needs of a request that ended (finish, Check).
type reqDone struct {
	first, last time.Duration
	out         int32
	ended       uint8
	flags       uint8 // doneInterrupted, doneRestored, doneLiveCopy, donePreempted, doneCheckpointed
}

const (
	doneInterrupted = 1 << iota
	doneRestored
	doneLiveCopy
	donePreempted
	doneCheckpointed
)

// doneRecord is what Result reads of r (retire keeps it when r ends).
func (r *simRequest) doneRecord() reqDone {
	d := reqDone{first: r.first, last: r.last, out: int32(r.out), ended: uint8(min(r.ended, 255))}
	for _, f := range []struct {
		on   bool
		flag uint8
	}{{r.interrupted, doneInterrupted}, {r.restored, doneRestored}, {r.liveCopy, doneLiveCopy}, {r.preempted, donePreempted}, {r.checkpointed, doneCheckpointed}} {
		if f.on {
			d.flags |= f.flag
		}
	}
	return d
}

// reqExtra is the rest of a failed, interrupted or preempted request.
type reqExtra struct {
	failed                            error
	resumeEnd, afterFail, preemptLoss time.Duration
}

// retire keeps what Result needs of r, which ended, and lets the rest go
// (Config.keepRequests keeps it all). Nothing that finish reads changes
// after a request ends: its calls are over, and the events still
// scheduled for it only check that it ended (a second end fails the run).
func (s *Sim) retire(r *simRequest) {
	if s.cfg.keepRequests || s.reqs[r.idx] != r {
		return
	}
	d := r.doneRecord()
	if r.failed != nil || r.interrupted || r.preempted {
		s.doneExtra[r.idx] = &reqExtra{failed: r.failed, resumeEnd: r.resumeEnd, afterFail: r.afterFail, preemptLoss: r.preemptLoss}
	}
	s.done[r.idx] = d
	s.reqs[r.idx] = nil
}

// onToken is a token reaching the client, or under stop-and-restart's
// regeneration the gateway, which checks it and does not deliver it.
func (s *Sim) onToken(r *simRequest, ev core.Event) {
	if r.regen && ev.Index < r.out {
		// Decoded again. The tokens recomputed are the prompt, prefilled
		// again for the call's first token, and each of these.
		if want := token(r.idx, ev.Index); ev.Token != want || ev.Finish != core.FinishNone {
			s.fail("request %s: regenerated token %d is %d (finish %v), the client has %d", r.id, ev.Index, ev.Token, ev.Finish, want)
			return
		}
		if ev.First {
			s.res.RecomputedTokens += r.w.PromptLen()
		}
		s.res.RecomputedTokens++
		return
	}
	first := r.fresh
	r.fresh = false
	if ev.Index != r.out {
		s.fail("request %s: token %d arrived, the journal has %d", r.id, ev.Index, r.out)
		return
	}
	// Whatever happened (failures, resumes, speculation), the client gets
	// the tokens of a failure-free run without speculation.
	if want := token(r.idx, ev.Index); ev.Token != want {
		s.fail("request %s: output token %d is %d, the reference has %d", r.id, ev.Index, ev.Token, want)
		return
	}
	r.out++
	// When the token was committed: now, or a step of a decode run that
	// ended before (runs.go).
	now := ev.At.Sub(epoch)
	if r.first < 0 {
		r.first = now
	}
	if ff := s.firstFail; ff >= 0 && now > ff && r.afterFail == 0 {
		r.afterFail = now
	}
	if r.migrated {
		r.migrated = false
		s.res.Migrations.Downtimes = append(s.res.Migrations.Downtimes, now-r.last)
	}
	// The resume is exact here: the first token of the first call made
	// after the failure (the client-side estimate of the bench,
	// servingstats.Record.Resume, cannot see calls).
	if ff := s.firstFail; ff >= 0 && r.resumeEnd == 0 && first && ev.Req.Arrived.After(epoch.Add(ff)) {
		r.resumeEnd = now
	}
	r.last = now
	k := int(now / time.Second)
	for len(s.res.Delivered) <= k {
		s.res.Delivered = append(s.res.Delivered, 0)
	}
	s.res.Delivered[k]++
	if s.cfg.StopAt > 0 && now >= s.cfg.StopAt/2 {
		s.res.CalibrationTokens++
	}
	if ev.Finish != core.FinishNone {
		s.end(r, nil)
	}
}

// --- workers ---

// wake schedules a step on an idle worker (at the same instant: arrivals
// of the same instant join one batch, as the scheduler's intake drain does).
func (s *Sim) wake(w *simWorker) {
	if w.busy || w.kick || !w.alive {
		return
	}
	w.kick = true
	gen := w.gen
	s.at(s.now, func() {
		if w.gen != gen {
			return
		}
		w.kick = false
		s.step(w)
	})
}

// step builds and starts the worker's next step.
func (s *Sim) step(w *simWorker) {
	if w.busy || !w.alive || w.core.Idle() {
		return
	}
	free := s.cfg.KVPages - w.core.CachedPages() - w.core.EvictablePages()
	st := w.core.Next(s.clock(), free)
	s.flush(w)
	if len(st.Batch) == 0 {
		// Stalled: the queue waits for what a migration holds; its
		// commit, abort or expiry wakes the worker.
		if !w.core.Idle() && !w.core.Stalled() {
			if w.empties++; w.empties > 100000 {
				s.fail("%s: no step can run (%d running, %d waiting)", w.id, w.core.Running(), w.core.Waiting())
				return
			}
			s.wake(w)
		}
		s.publish(w)
		return
	}
	w.empties = 0
	if used := w.core.CachedPages() + w.core.EvictablePages(); used > s.cfg.KVPages || w.core.Running() > s.cfg.MaxRunning {
		s.fail("%s: %d KV pages in use of %d, %d running of %d", w.id, used, s.cfg.KVPages, w.core.Running(), s.cfg.MaxRunning)
	}
	p := s.cfg.Profile
	var dur time.Duration
	for _, rs := range st.Restores {
		if !s.cfg.Oracle {
			dur += p.ImportTime(len(rs.Pages))
		}
		if sr, ok := rs.Req.Sink.(*simRequest); ok && sr.interrupted && len(rs.Pages) > 0 {
			sr.restored = true
		}
		w.store.release(rs.Req.ID) // consumed: the request runs here now
	}
	// One fused pass: every decoding row at K+1 positions when any row
	// verifies drafts, each reading its context (Profile.Step; the
	// context counts with Profile.DecodeContext). A decoding row's chunk
	// starts at its history's last token: the rest is in the KV cache.
	shape := engine.BatchStep(st.Batch, func(i int) int { return len(st.Reqs[i].History) - 1 })
	dur += p.Step(shape)
	if k := shape.K; k > 0 {
		for _, ch := range st.Batch {
			if ch.Sample > 1 {
				s.res.Spec.KRows++
				s.res.Spec.KSum += w.core.SpecK()
			}
		}
	}
	if s.cfg.StepTrace {
		s.traceStep(w, st, shape, dur)
	}
	s.res.Steps++
	w.busy = true
	w.st = st
	s.startRun(w, st, shape)
	s.atStep(s.now+dur, w, w.gen)
}

func (s *Sim) stepDone(w *simWorker, st core.Step) {
	// Done reads the tokens and keeps nothing: the buffers are the worker's.
	// A chunk sampling at n positions (a verification: the last token and
	// n−1 drafts) gets the target's tokens at output indices OutIndex …
	// OutIndex+n−1, whatever the drafts were.
	n, sampled := len(st.Batch), 0
	for _, ch := range st.Batch {
		sampled += ch.Sample
	}
	if cap(w.outBuf) < n {
		w.outBuf = make([][]int32, n)
	}
	if cap(w.tokBuf) < sampled {
		w.tokBuf = make([]int32, sampled)
	}
	out, toks := w.outBuf[:n], w.tokBuf[:sampled]
	for i, ch := range st.Batch {
		out[i] = nil
		if ch.Sample > 0 {
			// A migration in's held pre-step has no call (no Sink) yet:
			// its tokens are the request's all the same.
			r, ok := st.Reqs[i].Sink.(*simRequest)
			if !ok {
				r = s.byID[st.Reqs[i].ID]
			}
			for j := range ch.Sample {
				toks[j] = token(r.idx, ch.OutIndex+j)
			}
			out[i], toks = toks[:ch.Sample:ch.Sample], toks[ch.Sample:]
		}
	}
	tokens := w.tokens
	w.core.Done(s.clock(), out)
	w.busy = false
	s.refilled(st)
	s.flush(w)
	if s.cfg.StepTrace {
		s.res.StepTrace[w.traceAt].Committed = int32(w.tokens - tokens)
	}
	s.runBetween(w)
	s.publish(w)
	if a := w.as; a != nil && a.target == w {
		s.mirror(a) // the step's progress to the drafter
	}
	s.step(w)
}

// flush carries out what the worker's core asked for.
func (s *Sim) flush(w *simWorker) {
	o := w.core.Output()
	s.cacheEvents(w, &o)
	s.res.RestoredPages += o.RestoredPages
	s.res.ResumeCachedPages += o.ResumeCachedPages
	s.res.RecomputedTokens += o.RecomputedTokens
	s.res.Preemptions += o.Preemptions
	if o.Preemptions > 0 {
		s.notePreempted(w)
	}
	s.res.Spec.DraftTokens += o.DraftTokens
	s.res.Spec.AcceptedTokens += o.AcceptedTokens
	s.res.Spec.Verifications += o.Verifications
	s.res.Migrations.Stages += o.MigrationStages
	s.res.Migrations.Pages += o.MigrationPagesOut
	s.res.Migrations.Reclaimed += o.MigrationsReclaimed
	s.res.Migrations.HeldTokens += o.HeldTokens
	ended := slices.Clone(o.MigrationsEnded) // o's slices are the core's: the aborts call into it
	w.waits.Add(o.Waits...)
	for _, ev := range o.Events {
		if ev.Err == nil {
			w.tokens++
		}
		r := ev.Req.Sink.(*simRequest)
		if r.call != ev.Req {
			continue // a call the gateway gave up on
		}
		if ev.Err != nil {
			switch {
			case errors.Is(ev.Err, core.ErrMigrated):
				// The source ends the stream with the new placement (the
				// gateway, which follows the commit's event, has
				// normally switched already).
				if pl := s.placement(r.id); pl != nil {
					s.switchStream(r, pl)
				} else {
					s.broke(r)
				}
			case errors.Is(ev.Err, core.ErrQueueFull), errors.Is(ev.Err, core.ErrTooLarge):
				s.end(r, ev.Err) // not resumable: the client gets the error
			default:
				s.broke(r)
			}
			continue
		}
		s.onToken(r, ev)
	}
	// Checkpoint pages: the sender's bounded queue, then the link.
	var behind *core.Request
	for i := 0; i < len(o.Checkpoints); {
		p := o.Checkpoints[i]
		j := i
		for j < len(o.Checkpoints) && o.Checkpoints[j].Req == p.Req {
			j++
		}
		if p.Req == behind {
			i = j
			continue
		}
		var hashes []uint64
		first := p.Page
		var replicas []string
		if c, ok := s.replicaOf[p.Req.ID]; ok && c.holder == p.Holder {
			replicas = c.replicas
		}
		copies := 1 + len(replicas)
		for k := i; k < j; k++ {
			// One queue per copy, all on the one link: the backlog bound
			// is a queue's each.
			backlog := float64(w.linkFree-s.now) / float64(time.Second) * s.cfg.Timing.NetBytesPerSec / float64(s.pageBytes)
			if backlog >= float64(s.cfg.Timing.SendQueuePages*copies) {
				w.core.CheckpointBehind(p.Req, o.Checkpoints[k].Page)
				behind = p.Req
				w.run.behind = true
				break
			}
			w.linkFree = max(w.linkFree, s.now) + time.Duration(float64(copies)*float64(s.pageBytes)/s.cfg.Timing.NetBytesPerSec*float64(time.Second))
			hashes = append(hashes, o.Checkpoints[k].Hash)
		}
		if len(hashes) > 0 {
			s.res.CheckpointBytesSent += uint64(copies*len(hashes)) * s.pageBytes
			s.ship(w, p.Holder, p.Req.ID, p.Reserved, first, hashes)
			for _, h := range replicas {
				s.ship(w, h, p.Req.ID, p.Reserved, first, hashes)
			}
		}
		i = j
	}
	for _, rel := range o.CheckpointReleases {
		s.ship(w, rel.Holder, rel.RequestID, 0, 0, nil)
		// A release names the first copy's holder: the replicas are
		// those of the call that sent to it (a later call's, after a
		// move, are not this release's).
		if c, ok := s.replicaOf[rel.RequestID]; ok && c.holder == rel.Holder {
			for _, h := range c.replicas {
				s.ship(w, h, rel.RequestID, 0, 0, nil)
			}
			delete(s.replicaOf, rel.RequestID)
		}
	}
	s.migrationsEnded(ended)
}

// ship delivers checkpoint pages (or, with none, a release) to a holder
// when the link has carried them.
func (s *Sim) ship(from *simWorker, holder, req string, reserved uint64, first int, hashes []uint64) {
	h := s.worker(holder)
	if h == nil {
		return
	}
	if h.cell != from.cell {
		s.fail("%s sends checkpoint pages of %s to %s, in another cell", from.id, req, holder)
		return
	}
	gen := h.gen
	s.at(max(from.linkFree, s.now), func() {
		if h.gen != gen || !h.alive {
			return // the holder died meanwhile: the pages are lost
		}
		if hashes == nil {
			h.store.release(req)
			return
		}
		h.store.put(req, reserved, first, hashes, s.pageBytes)
		if h.store.used > h.store.budget {
			s.fail("%s: checkpoint store holds %d bytes, budget %d", h.id, h.store.used, h.store.budget)
		}
	})
}

// reconcile is the holder's periodic check of its store against the
// placement table.
func (s *Sim) reconcile(w *simWorker) {
	if !w.alive {
		return
	}
	for _, id := range w.store.requests() {
		if w.store.reqs[id].oracle {
			continue // the oracle's cache stays until its request is admitted
		}
		pl, _ := w.cell.fsm.Placement(id) // a holder is in its request's cell
		if pl == nil || !fsm.HoldsCopy(pl, w.id) && !core.KeepsPages(pl.HolderId, pl.WorkerId, pl.State != pb.PlacementState_PLACEMENT_STATE_RUNNING, w.id) {
			w.store.release(id)
		}
	}
}

func (s *Sim) sample() {
	waiting := 0
	var stored uint64
	for _, w := range s.workers {
		if w.alive {
			waiting += w.core.Waiting()
			stored += w.store.used
		}
	}
	s.res.CheckpointHostBytes = append(s.res.CheckpointHostBytes, stored)
	s.res.Queue = append(s.res.Queue, queueSample{At: s.now, Waiting: float64(waiting)})
	s.sampleFragmentation()
	s.sampleSpread()
	if s.cfg.TokenSeries {
		row := make([]int, len(s.workers))
		for i, w := range s.workers {
			row[i] = w.tokens
		}
		s.res.WorkerTokens = append(s.res.WorkerTokens, row)
	}
}

// markFailed applies the MarkFailed commands pending, and notes the
// requests their recovery plans moved.
func (s *Sim) markFailed(at time.Duration) {
	cmds := s.marks[at]
	delete(s.marks, at)
	for _, c := range cmds {
		s.copyPrefixes(c.GetMarkFailed())
	}
	res := s.applyByCell(cmds)
	s.relink() // a drafter whose target failed is paired again
	if s.res.PlanAt == 0 {
		s.res.PlanAt = s.now
	}
	failed := map[string]uint64{}
	for i, c := range cmds {
		if res[i].Err == nil {
			failed[c.GetMarkFailed().WorkerId] = c.GetMarkFailed().Incarnation
		}
	}
	for _, rp := range s.recoveries() {
		if inc, ok := failed[rp.FailedWorker]; ok && rp.FailedIncarnation == inc {
			for _, a := range rp.Assignments {
				if r := s.byID[a.RequestId]; r != nil {
					r.interrupted = true
					// A live copy: the plan reuses it, or moved the request
					// off it by choice (rebalancing, no KV room there).
					if a.Mode == pb.RecoveryMode_RECOVERY_MODE_REUSE || a.Rebalanced {
						r.liveCopy = true
						if h := s.worker(a.CheckpointHolder); h != nil && h.store.holdsPages(r.id) {
							r.checkpointed = true
						}
					}
					r.recomputeOn = ""
					if a.Mode == pb.RecoveryMode_RECOVERY_MODE_RECOMPUTE {
						r.recomputeOn = a.TargetWorker
					}
					if s.cfg.Oracle {
						s.oracleResume(r)
					}
				}
			}
		}
	}
}

// copyPrefixes fills a MarkFailed with what the live holders of the failed
// worker's requests hold of each replicated one, as the controller's
// leader asks them before it proposes it (controller/copyprefix.go).
func (s *Sim) copyPrefixes(mf *pb.MarkFailedCmd) {
	if mf == nil || s.cfg.CheckpointReplicas <= 1 {
		return
	}
	byHolder := s.commandCell(&pb.Command{Body: &pb.Command_MarkFailed{MarkFailed: mf}}).fsm.ReplicatedCopies(mf.WorkerId)
	holders := make([]string, 0, len(byHolder))
	for h := range byHolder {
		holders = append(holders, h)
	}
	sort.Strings(holders)
	for _, h := range holders {
		w := s.worker(h)
		if w == nil || !w.alive {
			continue
		}
		for _, rid := range byHolder[h] {
			mf.Checkpointed = append(mf.Checkpointed, &pb.CopyPrefix{RequestId: rid, Holder: h,
				Tokens: uint32(w.store.prefixPages(rid) * engine.PageTokens)})
		}
	}
}

// oracleResume continues an interrupted request of the oracle
// (Config.Oracle) now on the worker its plan moved it to, with its whole
// history's pages in that worker's store.
func (s *Sim) oracleResume(r *simRequest) {
	if r.ended > 0 || r.call != nil || r.committing {
		return
	}
	pl := s.placement(r.id)
	if pl == nil || pl.WorkerId == r.worker && pl.Epoch == r.epoch {
		return // not moved: the gateway's poll handles it as in any column
	}
	if w := s.worker(pl.WorkerId); w != nil && w.alive && w.inc == pl.WorkerIncarnation && r.out > 0 {
		hist := r.w.AppendPrompt(make([]int32, 0, r.w.PromptLen()+r.out))
		for k := range r.out {
			hist = append(hist, token(r.idx, k))
		}
		// The pages the core will look up (core.restorable): every full
		// page but the one holding the last token.
		w.store.oraclePages(r.id, core.PageHashes(hist[:len(hist)-1], nil))
	}
	s.resume(r, pl)
}

// kill is a kill -9: the process and everything in it is gone; its calls
// break (the gateway sees it at once), the fast path marks it failed after
// DetectDelay, and it restarts and reloads when asked to. With
// Timing.Hang it is a hang: the calls break at the detection, and the
// restart starts there (hang).
func (s *Sim) kill(w *simWorker, restart bool) {
	if !w.alive {
		return
	}
	s.sync(w) // what it streamed before the kill, delivered
	if s.res.InFlightAtFail == 0 {
		for _, o := range s.workers {
			if o.alive {
				s.res.InFlightAtFail += o.core.Running() + o.core.Waiting()
			}
		}
	}
	w.alive = false
	w.gen++
	w.between = nil
	if w.as != nil {
		s.unpair(w.as)
	}
	s.endSpan(w)
	w.phase = pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED
	at := s.now + s.cfg.Timing.DetectDelay
	if s.cfg.Oracle {
		s.oracleKill(w, restart, at)
		return
	}
	w.hungUntil, w.hungCalls = 0, nil
	for _, r := range w.core.Requests() {
		sr := r.Sink.(*simRequest)
		if sr.call != r {
			continue
		}
		if s.cfg.Timing.Hang {
			sr.call = nil // the call hangs: nothing comes on it
			w.hungCalls = append(w.hungCalls, sr)
			continue
		}
		s.broke(sr)
	}
	s.killMigrations(w, w.gen-1)
	// The process's memory is gone: nothing touches the core of a worker
	// that is not alive, and a restart builds new ones.
	w.core, w.store = nil, newSimStore(0)
	// The probes of workers killed together fail together: their
	// MarkFailed commands reach the leader at once and commit as one entry.
	if len(s.marks[at]) == 0 {
		s.at(at, func() { s.markFailed(at) })
	}
	s.marks[at] = append(s.marks[at], &pb.Command{Body: &pb.Command_MarkFailed{MarkFailed: &pb.MarkFailedCmd{WorkerId: w.id, Incarnation: w.inc, Reason: "probe failed"}}})
	if !s.cfg.Timing.Hang {
		s.reload(w, restart, at)
		return
	}
	// A hang: after the MarkFailed (scheduled first, at the same time),
	// the gateway's streams to the process break as their placements move,
	// and the process is killed and restarted.
	w.hungUntil = at
	gen := w.gen
	s.at(at, func() {
		if w.gen != gen {
			return
		}
		calls := w.hungCalls
		w.hungUntil, w.hungCalls = 0, nil
		for _, r := range calls {
			if r.ended == 0 && r.call == nil && !r.polling && r.worker == w.id {
				s.broke(r)
			}
		}
		s.reload(w, restart, at)
	})
}

// oracleKill is kill's rest for the oracle (Config.Oracle): the calls
// break at once, a hang's too, the MarkFailed commits now, and the
// reload starts when the other columns' does (detected).
func (s *Sim) oracleKill(w *simWorker, restart bool, detected time.Duration) {
	w.hungUntil, w.hungCalls = 0, nil
	for _, r := range w.core.Requests() {
		if sr := r.Sink.(*simRequest); sr.call == r {
			s.broke(sr)
		}
	}
	s.killMigrations(w, w.gen-1)
	w.core, w.store = nil, newSimStore(0)
	at := s.now
	if len(s.marks[at]) == 0 {
		s.at(at, func() { s.markFailed(at) })
	}
	s.marks[at] = append(s.marks[at], &pb.Command{Body: &pb.Command_MarkFailed{MarkFailed: &pb.MarkFailedCmd{WorkerId: w.id, Incarnation: w.inc, Reason: "probe failed"}}})
	if !s.cfg.Timing.Hang {
		s.reload(w, restart, detected) // from the kill, as kill's
		return
	}
	gen := w.gen
	s.at(detected, func() { // from the detection, as a hang's
		if w.gen == gen {
			s.reload(w, restart, detected)
		}
	})
}

// reload restarts killed worker w now, when restart is set: progressively
// with Speculation (the new incarnation registers at detected), else
// registered in full service after the profile's LoadTime.
func (s *Sim) reload(w *simWorker, restart bool, detected time.Duration) {
	switch {
	case restart && s.cfg.Speculation:
		s.restart(w, detected)
	case restart:
		s.at(s.now+time.Duration(float64(s.cfg.Profile.LoadTime())*s.cfg.Timing.ReloadScale), func() {
			if !w.alive {
				s.register(w, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE)
			}
		})
	}
}
