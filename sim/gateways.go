package sim

import (
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/lumen-project/lumen/fsm"
	"github.com/lumen-project/lumen/internal/placer"
	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// Issue 16's gateways: the request starts on the worker a gateway chose
// from its own replica of the load table, and its placement commits in
// parallel (Config.Gateways > 0). Each gateway keeps an
// internal/placer.Replica, the code the real gateway runs, fed by its
// WatchLoad stream: a LoadTable of the fsm's views every WatchInterval
// (the gateways' ticks spread over the interval), delivered WatchDelay
// later. A request goes to gateway idx mod G (round-robin over arrivals);
// the gateway Take()s a worker, calls Generate there at once (epoch 0, no
// holder), and the Dispatch naming that worker commits CommitDelay later:
// accepted, the replica counts it until a table does (Committed) and the
// worker learns the holder LinkLatency later (SetHolder); refused (the
// worker's incarnation failed), the call is cancelled, the replica forgets
// it, and the request is placed again, excluding every worker that refused
// it, with the journal's tokens. A gateway with no table yet (the first
// WatchDelay) sends the Dispatch without a worker: Apply chooses and the
// request waits for the commit, as with Gateways = 0.

// simGateway is one gateway's placement state.
type simGateway struct {
	idx int
	rep *placer.Replica
	// With Config.Cells > 1 (cells.go): the gateway's replica of each
	// cell (cells), each of them the replica of cell (best: the freeness
	// of its freest worker, as of its last table or Take).
	cells []*simGateway
	cell  *simCell
	best  float64
	// tableAt is when the table the replica holds was read from the fsm.
	tableAt time.Duration
}

// GatewayChoice is how a gateway chooses among the workers of its view:
// internal/placer's own choice, with or without the gateway's share. The
// prototypes that led to the placer's choice (fill, partition and other
// biases; docs/benchmarks.md has their figures) are gone: the simulator
// runs only what a gateway runs.
type GatewayChoice int

const (
	// ChooseFreest is the placer without shares (a lone gateway's):
	// PickServing over the view, what Apply runs. Gateways with about the
	// same table choose the same worker until their tables count each
	// other's placements: the ablation of the shares.
	ChooseFreest GatewayChoice = iota
	// ChoosePartitionFill is the placer with shares (Replica.SetShare,
	// placer.PickShared): gateway g of G prefers the workers at positions
	// ≡ g (mod G) of the table, by placer.ShareBias, after counting, on
	// each other gateway's share, as many virtual placements as it has
	// itself that its table does not count. What lumen's gateways run.
	ChoosePartitionFill
)

// GatewayChoices names the choices (`lumen sim -gateway-choice`).
var GatewayChoices = []string{"freest", "partition-fill"}

// DefaultGatewayBias is the placer's preference for a gateway's own share
// (placer.ShareBias), the only one the simulator runs.
const DefaultGatewayBias = placer.ShareBias

func (c GatewayChoice) String() string {
	if c >= 0 && int(c) < len(GatewayChoices) {
		return GatewayChoices[c]
	}
	return fmt.Sprintf("choice(%d)", int(c))
}

// ParseGatewayChoice returns the choice named.
func ParseGatewayChoice(name string) (GatewayChoice, error) {
	if i := slices.Index(GatewayChoices, name); i >= 0 {
		return GatewayChoice(i), nil
	}
	return 0, fmt.Errorf("%w: gateway choice %q: one of %s (the prototypes fill and partition were removed: internal/placer's choice is partition-fill)",
		ErrInvalid, name, strings.Join(GatewayChoices, ", "))
}

// gatewayPlacement is a placement a gateway made, for the herding count.
type gatewayPlacement struct {
	gateway int
	at      time.Duration // Take
	applied time.Duration // when the Dispatch was applied; -1 while not
}

// GatewayStats are the gateways' counters (Config.Gateways > 0).
type GatewayStats struct {
	// Placed: requests started on a worker a gateway chose; Fallback:
	// Dispatches sent without a worker (no table yet); Refused:
	// placements Apply refused (the worker had failed), each placed again.
	Placed, Fallback, Refused int
	// Unseen sums, over the placements, the other gateways' placements on
	// the same worker that the choosing gateway's table did not count
	// (made after the table was read, within the last second); Herded
	// counts the placements with at least one. Apply, deciding on the
	// latest state, would count them all.
	Unseen, Herded int
	// StalenessSum is the age of the table at each Take, summed.
	StalenessSum time.Duration
	// Tables delivered to the gateways.
	Tables int
}

// SpreadSample is the running requests across the workers in full
// service at one queue sample.
type SpreadSample struct {
	At time.Duration
	// Mean running requests per worker, their coefficient of variation
	// (population standard deviation over the mean; 0 when the mean is 0)
	// and max − min.
	Mean, CV float64
	MaxMin   int
}

// placerShares says whether the gateways know their share
// (ChoosePartitionFill); without, each is a lone gateway's placer.
func (s *Sim) placerShares() bool { return s.cfg.GatewayChoice == ChoosePartitionFill }

// startGateways creates the gateways and their WatchLoad streams: a table
// at once, then one every WatchInterval, gateway g's ticks offset by
// g/G of it.
func (s *Sim) startGateways() {
	if len(s.cells) > 1 {
		s.startCellGateways()
		return
	}
	n := s.cfg.Gateways
	iv := s.cfg.Timing.WatchInterval
	for g := range n {
		gw := &simGateway{idx: g, rep: placer.New(), tableAt: -1}
		if s.placerShares() {
			gw.rep.SetShare(g, n) // the placer's own choice among gateways
		}
		s.gateways = append(s.gateways, gw)
		s.at(0, func() { s.sendTable(gw) })
		s.every(time.Duration(g)*iv/time.Duration(n), iv, func() { s.sendTable(gw) })
	}
	s.gwPlaced = map[string][]gatewayPlacement{}
}

// sendTable reads the fsm's load table for gw and delivers it WatchDelay
// later.
func (s *Sim) sendTable(gw *simGateway) {
	t := s.loadTable(gw)
	at := s.now
	s.at(s.now+s.cfg.Timing.WatchDelay, func() {
		gw.rep.Update(t)
		gw.rescore()
		if idx, _ := gw.rep.Applied(); idx == t.AppliedIndex {
			gw.tableAt = at
		}
		s.res.Gateways.Tables++
	})
}

// loadTable is WatchLoad's table: the fsm's (fsm.LoadTable, shared and
// read-only; the replica copies what it keeps).
func (s *Sim) loadTable(gw *simGateway) *pb.LoadTable {
	f := s.fsm
	if gw.cell != nil {
		f = gw.cell.fsm
	}
	t, _ := f.LoadTable()
	return t
}

// place is a gateway placing a request: Take a worker from its replica,
// Generate there at once, the Dispatch with that worker committing in
// parallel.
func (s *Sim) place(r *simRequest, exclude ...string) {
	gw := s.gateways[r.idx%len(s.gateways)]
	r.id = dispatchID(r)
	s.byID[r.id] = r
	prompt := uint32(r.w.PromptLen())
	var w string
	var inc uint64
	var ok bool
	if len(gw.cells) > 0 {
		gw, w, inc, ok = s.takeInCells(gw, r, prompt, exclude)
	} else {
		w, inc, ok = gw.rep.Take(r.id, prompt, exclude...)
	}
	if !ok {
		s.res.Gateways.Fallback++
		s.dispatchApply(r)
		return
	}
	s.res.Gateways.Placed++
	s.countHerd(gw, w)
	r.committing = true
	id := r.id
	s.at(s.now+s.cfg.Timing.CommitDelay, func() { s.committed(r, gw, id, w, inc) })
	s.generate(r, &pb.Placement{RequestId: id, WorkerId: w, WorkerIncarnation: inc})
}

// countHerd counts the other gateways' recent placements on w that gw's
// table does not count, and notes this one.
func (s *Sim) countHerd(gw *simGateway, w string) {
	s.res.Gateways.StalenessSum += s.now - max(gw.tableAt, 0)
	ps := s.gwPlaced[w]
	k := 0
	for k < len(ps) && s.now-ps[k].at > time.Second {
		k++
	}
	ps = ps[k:]
	unseen := 0
	for _, p := range ps {
		if p.gateway != gw.idx && (p.applied < 0 || p.applied > gw.tableAt) {
			unseen++
		}
	}
	s.res.Gateways.Unseen += unseen
	if unseen > 0 {
		s.res.Gateways.Herded++
	}
	s.gwPlaced[w] = append(ps, gatewayPlacement{gateway: gw.idx, at: s.now, applied: -1})
}

// markApplied notes when the placement made on w at `at` was applied.
func (s *Sim) markApplied(w string, gateway int, at time.Duration) {
	ps := s.gwPlaced[w]
	for i := range ps {
		if ps[i].gateway == gateway && ps[i].at == at && ps[i].applied < 0 {
			ps[i].applied = s.now
			return
		}
	}
}

// committed is the Dispatch naming worker w (incarnation inc) reaching the
// fsm, CommitDelay after the gateway chose it.
func (s *Sim) committed(r *simRequest, gw *simGateway, id, w string, inc uint64) {
	r.committing = false
	res := s.apply(&pb.Command{Body: &pb.Command_Dispatch{Dispatch: &pb.DispatchCmd{RequestId: id,
		PromptTokens: uint32(r.w.PromptLen()), MaxTokens: uint32(r.w.Output), WorkerId: w, WorkerIncarnation: inc, Priority: s.priority(r)}}})
	s.markApplied(w, gw.idx, s.now-s.cfg.Timing.CommitDelay)
	if res.Err != nil {
		gw.rep.Forget(id)
		if !refusedWorker(res.Err) {
			if r.ended == 0 {
				if r.call != nil {
					s.cancel(r)
				}
				s.end(r, fmt.Errorf("dispatch: %w", res.Err))
			}
			return
		}
		s.res.Gateways.Refused++
		delete(s.byID, id)
		if r.ended > 0 {
			return // it finished there before the refusal: nothing to place
		}
		if r.call != nil {
			s.cancel(r)
		}
		r.attempt++
		r.refusedBy = append(r.refusedBy, w)
		s.place(r, r.refusedBy...)
		return
	}
	pl := res.Dispatch.Placement
	gw.rep.Committed(id, pl.WorkerId, res.Dispatch.Index)
	if r.ended > 0 {
		if r.completeAfterCommit {
			r.completeAfterCommit = false
			s.complete(id)
		}
		return
	}
	if pl.HolderId == "" {
		return
	}
	// SetHolder: the worker learns the holder one message later and
	// checkpoints every full page from then on.
	call := r.call
	s.at(s.now+s.cfg.Timing.LinkLatency, func() {
		if call == nil || r.call != call || call.ID != pl.RequestId || r.worker != pl.WorkerId {
			return
		}
		s.setHolder(r, pl)
	})
}

// cancel is the gateway closing the request's stream: the worker drops the
// call.
func (s *Sim) cancel(r *simRequest) {
	if w := s.worker(r.worker); w != nil && w.alive {
		s.sync(w)
	}
	call := r.call
	r.call = nil
	if w := s.worker(r.worker); w != nil && w.alive && call != nil {
		w.core.Cancel(call)
		s.flush(w)
		s.wake(w)
	}
}

// refusedWorker reports whether Apply refused a Dispatch because the
// worker it names is not alive.
func refusedWorker(err error) bool { return errors.Is(err, fsm.ErrWorkerUnavailable) }

// sampleSpread records the running requests across the workers in full
// service.
func (s *Sim) sampleSpread() {
	var sum, sq float64
	n, lo, hi := 0, math.MaxInt, 0
	for _, w := range s.workers {
		if !w.alive || w.phase != pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
			continue
		}
		x := w.core.Running()
		sum += float64(x)
		sq += float64(x) * float64(x)
		n++
		lo, hi = min(lo, x), max(hi, x)
	}
	if n == 0 {
		return
	}
	sp := SpreadSample{At: s.now, Mean: sum / float64(n), MaxMin: hi - lo}
	if sp.Mean > 0 {
		sp.CV = math.Sqrt(max(sq/float64(n)-sp.Mean*sp.Mean, 0)) / sp.Mean
	}
	s.res.Spread = append(s.res.Spread, sp)
}

// The gateways figure (issue 16, "Balance does not get worse"): the same
// Poisson arrivals at the Azure lengths, dispatch inside Apply against 1
// and 4 gateways with their own lagging views, no failure.

// SpreadDefinition is how running_cv and running_max_min are measured.
const SpreadDefinition = "every 250 ms (the queue sample) from the warm-up to the end of the arrivals, the running requests " +
	"(core.Running) of each worker in full service: running_cv is the mean over the samples of their coefficient of " +
	"variation (population standard deviation / mean), running_max_min the mean of max - min"

// GatewayMode is one dispatch mode of the figure.
type GatewayMode struct {
	// Gateways: 0 is the dispatch inside Apply.
	Gateways int
	Choice   GatewayChoice
}

// Name is the mode's name in the table and the JSON: "apply",
// "gateways-G" (ChooseFreest), "gateways-G-CHOICE".
func (m GatewayMode) Name() string {
	switch {
	case m.Gateways == 0:
		return "apply"
	case m.Choice == ChooseFreest:
		return fmt.Sprintf("gateways-%d", m.Gateways)
	}
	return fmt.Sprintf("gateways-%d-%s", m.Gateways, m.Choice)
}

// GatewayOptions are the gateways figure's parameters.
type GatewayOptions struct {
	Workers int
	Load    float64
	// Modes run side by side on the same arrivals; Apply's (Gateways 0),
	// the baseline the others are compared with, runs first whether
	// listed or not.
	Modes      []GatewayMode
	Profile    string
	MaxRunning int
	Budget     uint64
	Timeline   Timeline
	Seed       uint64
	// Seeds, when > 1, runs every mode with seeds Seed … Seed+Seeds−1
	// (each its own calibration and arrivals) and reports the means.
	Seeds int
	// Saturated, when > 0, is the cluster's saturated throughput
	// (requests/s) measured before: the calibration runs are skipped.
	Saturated float64
	// GoalPct is the goal: TTFT mean and running_cv at most this much
	// above Apply's (5).
	GoalPct float64
	Timing  Timing
	Log     io.Writer
}

// DefaultGatewayModes: Apply, 1 and 4 gateways with internal/placer as
// it is, and 4 gateways choosing by ChoosePartitionFill (the proposed
// change; with 1 gateway it is ChooseFreest).
func DefaultGatewayModes() []GatewayMode {
	return []GatewayMode{{}, {Gateways: 1}, {Gateways: 4}, {Gateways: 4, Choice: ChoosePartitionFill}}
}

// DefaultGatewayOptions: 64 paced Qwen3-14B/H100 workers, batches of 32,
// 70% load, DefaultGatewayModes, 300 s of arrivals (TTFT and the spread
// from 10 s), seed 1.
func DefaultGatewayOptions() GatewayOptions {
	return GatewayOptions{Workers: 64, Load: 0.7, Modes: DefaultGatewayModes(), Profile: "qwen3-14b-h100", MaxRunning: 32, Budget: 80e9,
		Timeline: BurstTimeline(), Seed: 1, Seeds: 1, GoalPct: 5, Timing: DefaultTiming()}
}

// GatewayRun is one dispatch mode's figures (means over the seeds).
type GatewayRun struct {
	// Dispatch is the mode's name (GatewayMode.Name); Choice and Bias the
	// gateways' choice.
	Dispatch       string  `json:"dispatch"`
	Gateways       int     `json:"gateways"`
	Choice         string  `json:"choice,omitempty"`
	Bias           float64 `json:"bias,omitempty"`
	TTFTMeanMs     float64 `json:"ttft_mean_ms"`
	TTFTP99Ms      float64 `json:"ttft_p99_ms"`
	RunningCV      float64 `json:"running_cv"`
	RunningMaxMin  float64 `json:"running_max_min"`
	RunningMean    float64 `json:"running_mean"`
	QueueMean      float64 `json:"queue_mean"`
	ThroughputTokS float64 `json:"throughput_tok_s"`
	Preemptions    float64 `json:"preemptions"`
	// The gateways' counters: placements from a replica, Dispatches Apply
	// placed (no table yet), placements refused; HerdedPct the placements
	// onto a worker another gateway had placed on without this one's table
	// counting it, UnseenPerPlacement how many such placements on average;
	// TableAgeMeanMs the age of the table at a choice.
	Placed             float64 `json:"placed,omitempty"`
	Fallback           float64 `json:"fallback,omitempty"`
	Refused            float64 `json:"refused,omitempty"`
	HerdedPct          float64 `json:"herded_pct,omitempty"`
	UnseenPerPlacement float64 `json:"unseen_per_placement,omitempty"`
	TableAgeMeanMs     float64 `json:"table_age_mean_ms,omitempty"`
	// Against Apply's: the TTFT mean's and running_cv's change, percent
	// (positive: worse), and whether both are within the goal.
	TTFTMeanVsApplyPct  float64 `json:"ttft_mean_vs_apply_pct"`
	RunningCVVsApplyPct float64 `json:"running_cv_vs_apply_pct"`
	WithinGoal          bool    `json:"within_goal"`
}

// GatewayFigure is the gateways figure's result.
type GatewayFigure struct {
	Name             string       `json:"name"`
	Profile          string       `json:"profile"`
	Workers          int          `json:"workers"`
	Load             float64      `json:"load"`
	MaxRunning       int          `json:"max_running"`
	DurationS        float64      `json:"duration_s"`
	WarmupS          float64      `json:"warmup_s"`
	Seed             uint64       `json:"seed"`
	Seeds            int          `json:"seeds"`
	SaturatedPerSec  float64      `json:"saturated_rate_per_s"`
	RatePerSec       float64      `json:"arrival_rate_per_s"`
	Requests         int          `json:"requests"`
	WatchIntervalMs  float64      `json:"watch_interval_ms"`
	WatchDelayMs     float64      `json:"watch_delay_ms"`
	CommitDelayMs    float64      `json:"commit_delay_ms"`
	GoalPct          float64      `json:"goal_pct"`
	SpreadDefinition string       `json:"spread_definition"`
	Runs             []GatewayRun `json:"runs"`
}

// RunGateways runs the gateways figure.
func RunGateways(o GatewayOptions) (*GatewayFigure, error) {
	p, ok, err := engine.LookupProfile(o.Profile)
	if err != nil || !ok {
		return nil, fmt.Errorf("%w: profile %q: %v", ErrInvalid, o.Profile, err)
	}
	if o.Load <= 0 || o.Workers < 2 {
		return nil, fmt.Errorf("%w: the gateways figure needs a load > 0 (%g) and at least 2 workers (%d)", ErrInvalid, o.Load, o.Workers)
	}
	modes := []GatewayMode{{}}
	for _, m := range o.Modes {
		if m.Gateways < 0 || m.Choice < 0 || int(m.Choice) >= len(GatewayChoices) {
			return nil, fmt.Errorf("%w: %d gateways choosing %s: gateways must be >= 0 (0: dispatch inside Apply) and the choice one of %s",
				ErrInvalid, m.Gateways, m.Choice, strings.Join(GatewayChoices, ", "))
		}
		if m.Gateways == 0 {
			m = GatewayMode{}
		}
		if !slices.Contains(modes, m) {
			modes = append(modes, m)
		}
	}
	seeds := max(o.Seeds, 1)
	tm := o.Timeline
	f := &GatewayFigure{Name: "gateways", Profile: o.Profile, Workers: o.Workers, Load: o.Load, MaxRunning: o.MaxRunning,
		DurationS: tm.Duration.Seconds(), WarmupS: tm.Warmup.Seconds(), Seed: o.Seed, Seeds: seeds,
		WatchIntervalMs: ms(o.Timing.WatchInterval), WatchDelayMs: ms(o.Timing.WatchDelay), CommitDelayMs: ms(o.Timing.CommitDelay),
		GoalPct: o.GoalPct, SpreadDefinition: SpreadDefinition}
	f.Runs = make([]GatewayRun, len(modes))
	for k := range seeds {
		seed := o.Seed + uint64(k)
		st := Study{Setup: Setup{Name: fmt.Sprintf("gateways-%d", o.Workers), Workers: o.Workers, Profile: o.Profile, MaxRunning: o.MaxRunning,
			Budget: o.Budget}, Timeline: tm, Seed: seed, Timing: o.Timing}
		sat := o.Saturated
		if sat <= 0 {
			if sat, _, err = st.Calibrate(); err != nil {
				return nil, err
			}
		}
		rate := o.Load * sat
		reqs, err := workload.GenerateLazy(workload.Config{Seed: seed, Rate: rate, Duration: tm.Duration, Trace: workload.AzureConversation})
		if err != nil {
			return nil, err
		}
		f.SaturatedPerSec += sat / float64(seeds)
		f.RatePerSec += rate / float64(seeds)
		f.Requests += len(reqs)
		for i, m := range modes {
			start := time.Now()
			cfg := st.config(p, policy.Lumen, reqs)
			cfg.Gateways, cfg.GatewayChoice = m.Gateways, m.Choice
			res, err := Run(cfg)
			if err != nil {
				return nil, fmt.Errorf("gateways figure, %d workers, seed %d, %s: %w", o.Workers, seed, m.Name(), err)
			}
			r := gatewayRun(res, tm)
			if o.Log != nil {
				fmt.Fprintf(o.Log, "   gateways: %d workers, load %g (%.1f/s, %d requests), seed %d, %-26s: TTFT mean %7.1f ms, p99 %7.1f ms, running_cv %.4f (%.1fs of wall time)\n",
					o.Workers, o.Load, rate, len(reqs), seed, m.Name(), r.TTFTMeanMs, r.TTFTP99Ms, r.RunningCV, time.Since(start).Seconds())
			}
			f.Runs[i].add(r, 1/float64(seeds))
		}
	}
	base := f.Runs[0]
	for i := range f.Runs {
		r := &f.Runs[i]
		m := modes[i]
		r.Dispatch, r.Gateways = m.Name(), m.Gateways
		if m.Gateways > 0 {
			r.Choice = m.Choice.String()
		}
		if m.Gateways > 0 && m.Choice == ChoosePartitionFill {
			r.Bias = DefaultGatewayBias
		}
		r.TTFTMeanVsApplyPct = pctOver(r.TTFTMeanMs, base.TTFTMeanMs)
		r.RunningCVVsApplyPct = pctOver(r.RunningCV, base.RunningCV)
		r.WithinGoal = r.TTFTMeanVsApplyPct <= o.GoalPct && r.RunningCVVsApplyPct <= o.GoalPct
	}
	if o.Log != nil {
		f.Print(o.Log)
	}
	return f, nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func pctOver(x, base float64) float64 {
	if base == 0 {
		return 0
	}
	return 100 * (x - base) / base
}

// gatewayRun measures one run.
func gatewayRun(res *Result, tm Timeline) GatewayRun {
	bf := burstFigures(res, tm)
	r := GatewayRun{TTFTMeanMs: bf.TTFTMeanMs, TTFTP99Ms: bf.TTFTP99Ms,
		QueueMean: bf.QueueMean, ThroughputTokS: bf.ThroughputTokS, Preemptions: float64(bf.Preemptions)}
	r.RunningCV, r.RunningMaxMin, r.RunningMean = spreadOver(res.Spread, tm.Warmup, tm.Duration)
	g := res.Gateways
	r.Placed, r.Fallback, r.Refused = float64(g.Placed), float64(g.Fallback), float64(g.Refused)
	if g.Placed > 0 {
		r.HerdedPct = 100 * float64(g.Herded) / float64(g.Placed)
		r.UnseenPerPlacement = float64(g.Unseen) / float64(g.Placed)
		r.TableAgeMeanMs = ms(g.StalenessSum) / float64(g.Placed)
	}
	return r
}

// spreadOver returns the means of the samples' CV (of those with running
// requests), max − min and mean in [from, to).
func spreadOver(ss []SpreadSample, from, to time.Duration) (cv, maxMin, mean float64) {
	n, nc := 0, 0
	for _, sp := range ss {
		if sp.At < from || sp.At >= to {
			continue
		}
		n++
		maxMin += float64(sp.MaxMin)
		mean += sp.Mean
		if sp.Mean > 0 {
			cv += sp.CV
			nc++
		}
	}
	if n > 0 {
		maxMin /= float64(n)
		mean /= float64(n)
	}
	if nc > 0 {
		cv /= float64(nc)
	}
	return cv, maxMin, mean
}

// add adds w × r's measured fields.
func (g *GatewayRun) add(r GatewayRun, w float64) {
	g.TTFTMeanMs += w * r.TTFTMeanMs
	g.TTFTP99Ms += w * r.TTFTP99Ms
	g.RunningCV += w * r.RunningCV
	g.RunningMaxMin += w * r.RunningMaxMin
	g.RunningMean += w * r.RunningMean
	g.QueueMean += w * r.QueueMean
	g.ThroughputTokS += w * r.ThroughputTokS
	g.Preemptions += w * r.Preemptions
	g.Placed += w * r.Placed
	g.Fallback += w * r.Fallback
	g.Refused += w * r.Refused
	g.HerdedPct += w * r.HerdedPct
	g.UnseenPerPlacement += w * r.UnseenPerPlacement
	g.TableAgeMeanMs += w * r.TableAgeMeanMs
}

// Print writes the figure as a table, with the goal's verdicts.
func (f *GatewayFigure) Print(out io.Writer) {
	fmt.Fprintf(out, "\nfigure gateways: dispatch inside Apply against gateways with lagging views (WatchLoad every %g ms, delivered %g ms later; commit %g ms), %d workers %s, batches of %d, load %g (%.1f req/s), Poisson arrivals at the Azure lengths, %.0f s, seed %d",
		f.WatchIntervalMs, f.WatchDelayMs, f.CommitDelayMs, f.Workers, f.Profile, f.MaxRunning, f.Load, f.RatePerSec, f.DurationS, f.Seed)
	if f.Seeds > 1 {
		fmt.Fprintf(out, " (means of seeds %d–%d)", f.Seed, f.Seed+uint64(f.Seeds)-1)
	}
	fmt.Fprintf(out, "\nspread: %s\n", f.SpreadDefinition)
	fmt.Fprintf(out, "%-26s %12s %11s %10s %9s %15s %11s %9s %13s %12s %11s\n", "dispatch", "TTFT mean ms", "TTFT p99 ms", "running_cv", "max-min",
		"running/worker", "TTFT vs apply", "cv vs apply", "herded %", "unseen/place", "table age ms")
	for _, r := range f.Runs {
		fmt.Fprintf(out, "%-26s %12.1f %11.1f %10.4f %9.2f %15.2f %+10.2f%% %+8.2f%% %13.2f %12.3f %11.2f\n", r.Dispatch, r.TTFTMeanMs, r.TTFTP99Ms,
			r.RunningCV, r.RunningMaxMin, r.RunningMean, r.TTFTMeanVsApplyPct, r.RunningCVVsApplyPct, r.HerdedPct, r.UnseenPerPlacement, r.TableAgeMeanMs)
	}
	for _, r := range f.Runs[1:] {
		verdict := "met"
		if !r.WithinGoal {
			verdict = "MISSED"
		}
		fmt.Fprintf(out, "%s: TTFT mean %+.2f%%, running_cv %+.2f%% against Apply's (goal: neither more than %g%% worse): %s\n",
			r.Dispatch, r.TTFTMeanVsApplyPct, r.RunningCVVsApplyPct, f.GoalPct, verdict)
	}
	fmt.Fprintln(out)
}
