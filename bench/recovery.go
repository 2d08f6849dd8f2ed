package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/lumen-project/lumen/internal/completions"
	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	"github.com/lumen-project/lumen/internal/plot"
	"github.com/lumen-project/lumen/internal/progress"
	"github.com/lumen-project/lumen/internal/recoverystudy"
	"github.com/lumen-project/lumen/internal/servingstats"
	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// RecoveryConfig is `lumen bench recovery`.
type RecoveryConfig struct {
	// Quick is shorter runs and a faster emulated model reload, same keys.
	Quick bool
	// JSONPath, when set, receives the figures as JSON (after every setup).
	JSONPath string
	// Seed seeds the workload, the same for every strategy.
	Seed uint64
	// Load is the offered load as a fraction of the cluster's measured
	// saturated throughput, in (0, 1.5].
	Load float64
	// Setups is a comma-separated list of setups: w4, w8, w8_f4.
	Setups string
	// TimeScale slows every emulated time, arrivals included (> 0).
	TimeScale float64
	// Dir keeps logs and data; empty means a temporary directory, removed.
	Dir string
	// Nodes, when > 0, puts each setup's workers on that many hosts, in
	// order (devcluster.DevNode: worker-1 … on node-1), each started with
	// -node (issue 24's failure domains), and the failure kills every
	// worker of node-1 at once instead of worker-1 … worker-K.
	Nodes int
	// CheckpointReplicas is the copies of each request's checkpoint
	// (SetStrategy's checkpoint_replicas, issue 24), each on a node of its
	// own; 0 or 1: one.
	CheckpointReplicas int
	// Columns, when set, runs only these columns (comma-separated, of
	// recoverystudy.RealColumns), to cut a run short.
	Columns string

	// The conditions (issue 22). Each setup carries its own
	// (recoverystudy.Conditions: w4, w8 and w8_f4 the stress, the -mild
	// setups none); a flag given on the command line (Given) overrides
	// every setup's, and one not given leaves the setup's, or the value
	// here where the setup names none: as lumen sim resolves them
	// (sim.Command.setups).
	//
	// MaxRunning, when > 0, overrides every setup's batch cap (the
	// workers' -max-running; vLLM's default is 256); TokenBudget, when >
	// 0, every setup's step token budget (the workers' -token-budget;
	// 2,048 by default, vLLM's chunked prefill takes 2,048–8,192).
	MaxRunning, TokenBudget int
	// Reload is a restarted worker's model load: warm, cold or a
	// duration (engine.ParseReload; the workers' -reload).
	Reload string
	// DecodeContext is "on" or "off": the workers' context-dependent
	// decode step (engine.Profile.DecodeContext).
	DecodeContext string
	// Detect is how the failure comes: fast (kill -9, which the fast
	// path detects) or hang (SIGSTOP: the process's connections stay
	// open until Serf detects it; it is killed and restarted then).
	Detect string
	// Given names the flags set on the command line ("load", "reload",
	// "detect", "decode-context", "max-running"): those override every
	// setup's condition. Nil: none given.
	Given map[string]bool
	// TracePath, when set, is a CSV trace in the Azure 2023 format whose
	// arrivals, rescaled in time to the offered rate, replace the Poisson
	// generator (workload.ReadAzureTrace; lumen sim -trace reads the same
	// into the same requests for a seed).
	TracePath string
}

// DefaultRecoveryConfig is `lumen bench recovery` without flags.
func DefaultRecoveryConfig() RecoveryConfig {
	return RecoveryConfig{Seed: 1, Load: 0.7, Setups: "w4,w8,w8_f4", TimeScale: 1, Reload: "warm", DecodeContext: "off", Detect: "fast"}
}

// Validate says what is wrong with the config, before anything starts.
func (cfg RecoveryConfig) Validate() error {
	if cfg.Load <= 0 || cfg.Load > 1.5 {
		return fmt.Errorf("-load %g: use a fraction of capacity in (0, 1.5]", cfg.Load)
	}
	if cfg.TimeScale <= 0 {
		return fmt.Errorf("-time-scale %g: must be > 0", cfg.TimeScale)
	}
	if cfg.MaxRunning < 0 || cfg.TokenBudget < 0 {
		return fmt.Errorf("-max-running %d and -token-budget %d: must be >= 1 (0: each setup's)", cfg.MaxRunning, cfg.TokenBudget)
	}
	// The flags' values, whether given or not: a default is a setup's
	// condition too.
	if _, err := parseConditions(recoverystudy.Conditions{Reload: cfg.Reload, Detect: cfg.Detect}, cfg.DecodeContext == "on"); err != nil {
		return err
	}
	if cfg.DecodeContext != "on" && cfg.DecodeContext != "off" && cfg.DecodeContext != "" {
		return fmt.Errorf("-decode-context %q: on or off", cfg.DecodeContext)
	}
	if cfg.CheckpointReplicas < 0 || cfg.CheckpointReplicas > policy.MaxCheckpointReplicas {
		return fmt.Errorf("-checkpoint-replicas %d: use 1 … %d", cfg.CheckpointReplicas, policy.MaxCheckpointReplicas)
	}
	if _, err := cfg.columns(); err != nil {
		return err
	}
	_, err := cfg.setups()
	return err
}

// columns are the real columns -columns names (all without it).
func (cfg RecoveryConfig) columns() ([]recoverystudy.Column, error) {
	all := recoverystudy.RealColumns()
	if cfg.Columns == "" {
		return all, nil
	}
	var out []recoverystudy.Column
	seen := map[string]bool{}
	for _, name := range strings.Split(cfg.Columns, ",") {
		name = strings.TrimSpace(name)
		if seen[name] {
			// Each column's run is kept by its name: a second run of it
			// would replace the first's figures.
			return nil, fmt.Errorf("-columns: %q is named twice", name)
		}
		seen[name] = true
		found := false
		for _, c := range all {
			if c.Name == name {
				out, found = append(out, c), true
			}
		}
		if !found {
			names := make([]string, len(all))
			for i, c := range all {
				names[i] = c.Name
			}
			return nil, fmt.Errorf("-columns: %q is not a column: use %s", name, strings.Join(names, ", "))
		}
	}
	return out, nil
}

// parseConditions parses a setup's resolved conditions; the errors name
// the flags that set them.
func parseConditions(sc recoverystudy.Conditions, decodeContext bool) (runConditions, error) {
	c := runConditions{decodeContext: decodeContext}
	var err error
	if c.reload, err = engine.ParseReload(sc.ReloadOr()); err != nil {
		return c, fmt.Errorf("-reload: %w", err)
	}
	switch sc.DetectOr() {
	case "hang":
		c.hang = true
	case "fast":
	default:
		return c, fmt.Errorf("-detect %q: fast (kill -9) or hang (SIGSTOP); real processes take the detection they get, so no duration", sc.Detect)
	}
	return c, nil
}

// runConditions are what every run of a setup emulates beside its setup.
type runConditions struct {
	reload        engine.Reload
	decodeContext bool
	hang          bool
}

// benchSetupPlan is one setup with its conditions resolved: what its runs
// offer and emulate.
type benchSetupPlan struct {
	recoverystudy.Setup
	load float64 // the offered fraction of the measured saturation
	cond runConditions
}

// workerArgs are the workers' flags for the conditions.
func (c runConditions) workerArgs() []string {
	return []string{"-reload", c.reload.String(), fmt.Sprintf("-decode-context=%v", c.decodeContext)}
}

// benchTiming is a run's timeline, and the meter of the runs: it counts
// runs (calibration included); a run adds its arrivals sent as a fraction.
// cond are the run's conditions.
type benchTiming struct {
	recoverystudy.Timeline
	progress *progress.Meter
	cond     runConditions
	trace    []workload.Request // TracePath's, nil for the generator
	// reload is a restarted worker's whole model reload under cond, in
	// emulated time before ReloadScale (engine.Profile.LoadTime).
	reload time.Duration
	// nodes is RecoveryConfig.Nodes; replicas CheckpointReplicas.
	nodes, replicas int
	// columns are the columns to run (RecoveryConfig.Columns).
	columns []recoverystudy.Column
}

// runSlack is the wall time a run may take past its scaled bound: the
// processes' start and stop, the last streams' tail.
const runSlack = 5 * time.Minute

// wallBound is the longest a run can last in wall time at time scale
// scale: its arrivals, a restarted worker's reload after the last of them
// (the reload cannot start later than the failure, itself before the
// arrivals end), both scaled, and runSlack. It bounds the run, and it is
// the gateways' resume deadline (-resume-timeout): the gateway's deadline
// is wall time (60 s by default), where everything emulated is scale×
// slower, and an interrupted request may rightly wait a long time — under
// stop-and-restart at the stress it queues at a survivor behind the
// failed worker's share of the load for as long as the reload lasts, and
// under lumen a restarted worker reloads for minutes. A deadline that
// cannot fire before the run ends leaves a request's failure to a real
// fault, never to the emulation's slowness.
func (tm benchTiming) wallBound(scale float64) time.Duration {
	emulated := float64(tm.Duration) + float64(tm.reload)*tm.ReloadScale
	return time.Duration(emulated*scale) + runSlack
}

// arrivals are a run's requests at rate for d: the trace's, rescaled, when
// there is one, else generated (Poisson, the conversation trace's lengths),
// as lumen sim's are.
func (tm benchTiming) arrivals(seed uint64, rate float64, d time.Duration) ([]workload.Request, error) {
	if tm.trace == nil {
		return workload.Generate(workload.Config{Seed: seed, Rate: rate, Duration: d, Trace: workload.AzureConversation})
	}
	reqs := workload.Rescale(tm.trace, rate, d)
	if len(reqs) == 0 {
		return nil, fmt.Errorf("%w: no arrival of the trace falls in %s", workload.ErrTrace, d)
	}
	out := make([]workload.Request, len(reqs))
	for i, r := range reqs {
		out[i] = r.Materialize()
	}
	return out, nil
}

// runOutcome is everything one run measured.
type runOutcome struct {
	recs        []*servingstats.Record
	texts       []string
	queue       []servingstats.Sample
	interrupted map[string]bool
	failAt      time.Duration // offset of the kill (0: none)
	planAt      time.Duration // offset of the first recovery plan
	restored    float64
	// Speculation: drafts verified and accepted at the targets, seconds
	// the drafters assisted.
	draftTokens, acceptedTokens, assistS float64
	recomputed                           float64
	// restoredReqs and ckptPages: the workers' restored requests and
	// checkpoint pages sent.
	restoredReqs, ckptPages float64
	// preemptions: the workers' preemptions (vLLM's num_preemptions).
	preemptions float64
	emulated    float64
	paced       float64
	// stepGap: the workers' host time between consecutive steps
	// (lumen_worker_step_gap_seconds_total), on the clock like paced.
	stepGap float64
	// regenerates: the strategy regenerates (stop-and-restart), and
	// regenerated is the gateway's count of the output tokens decoded
	// again; finish adds what the regenerations recomputed.
	regenerates bool
	regenerated float64
}

// recoveryFigures are a column's figures: the comparison's
// (internal/recoverystudy, what `lumen sim` reports too) and what only real
// processes measure.
type recoveryFigures struct {
	recoverystudy.Figures
	// WrongOutputs: completed requests whose text differs from the
	// failure-free reference's; PacingOverrunPct how much longer the
	// engines' steps ran than the profile's.
	WrongOutputs     int     `json:"wrong_outputs"`
	PacingOverrunPct float64 `json:"pacing_overrun_pct"`
	// HostGapPct is the workers' host time between consecutive engine
	// steps while requests ran or waited, as a percentage of the engines'
	// paced time: what the real processes add to every step period on
	// top of the profile's step (the simulator adds nothing; a profile's
	// step time is an engine's whole step period, its scheduling
	// included). From the workers alive at the end, as below.
	HostGapPct float64 `json:"host_gap_pct"`
	// TimeScale is the run's -time-scale: its clock ran this much slower
	// than the emulated time every figure is in.
	TimeScale float64 `json:"time_scale"`
	// Issue 24, the keys of lumen sim's recovery JSON. RestoredFraction
	// is, of the requests the failure interrupted, those a call restored
	// pages of from a checkpoint store (the workers'
	// lumen_worker_restored_requests_total over the interrupted, at most
	// 1; 1 with none interrupted); CheckpointBytesSent the checkpoint
	// pages the serving workers sent, every copy counted, at the profile's
	// KV bytes per page (the synthetic engine's pages are smaller). Both
	// from the workers alive at the end: a killed worker's counters
	// restart with it, so what it sent before the kill is not counted.
	RestoredFraction    float64 `json:"restored_fraction"`
	CheckpointBytesSent float64 `json:"checkpoint_bytes_sent"`
	// Preemptions are the workers' (lumen_worker_num_preemptions_total,
	// lumen sim's key): requests put back to wait, their KV dropped, to
	// make room. From the workers alive at the end, as above.
	Preemptions float64 `json:"preemptions"`
	// Progressive recovery (the lumen column): drafts verified and
	// accepted at the assisted workers, their ratio, the drafters' seconds
	// of assist (summed).
	AcceptRate     float64 `json:"accept_rate,omitempty"`
	DraftTokens    float64 `json:"draft_tokens,omitempty"`
	AcceptedTokens float64 `json:"accepted_tokens,omitempty"`
	AssistS        float64 `json:"assist_s,omitempty"`
	// Series is the run's TTFT and queue length over time (1 s bins),
	// the failure marked: what the plot shows around it.
	Series *plot.Series `json:"series,omitempty"`
}

// Recovery runs the recovery strategies side by side on real processes:
// one worker (or 4 of 8) killed under an Azure-like load.
func Recovery(cfg RecoveryConfig) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	var timing benchTiming
	setups, err := cfg.setups()
	if err != nil {
		return err
	}
	if cfg.TracePath != "" {
		f, err := os.Open(cfg.TracePath)
		if err != nil {
			return err
		}
		timing.trace, err = workload.ReadAzureTrace(f, cfg.Seed)
		f.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", cfg.TracePath, err)
		}
	}
	dir := cfg.Dir
	if dir == "" {
		d, err := os.MkdirTemp("", "lumen-bench-recovery-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(d)
		dir = d
	}
	if timing.columns, err = cfg.columns(); err != nil {
		return err
	}
	timing.replicas = cfg.CheckpointReplicas
	timing.progress = progress.New("bench recovery", "runs", float64(len(setups)*(len(timing.columns)+1)))
	defer timing.progress.Finish("")
	out := map[string]map[string]*recoveryFigures{}
	for _, s := range setups {
		tm := timing
		tm.Timeline, tm.cond, tm.nodes = s.Timeline(cfg.Quick), s.cond, cfg.Nodes
		figs, err := benchSetup(s.Setup, tm, cfg.Seed, s.load, cfg.TimeScale, filepath.Join(dir, s.Name))
		if err != nil {
			return fmt.Errorf("%s: %w", s.Name, err)
		}
		out[s.Name] = figs
		if cfg.JSONPath != "" { // after every setup: a long run keeps what it measured
			if err := writeJSON(cfg.JSONPath, out); err != nil {
				return err
			}
		}
	}
	return nil
}

// setups are the named setups, each with MaxRunning's cap and
// TokenBudget's budget when they are set, and its conditions resolved as
// lumen sim resolves them (sim.Command.setups): a condition whose flag
// was given is the flag's for every setup; one not given is the setup's
// own, or the flag's value (its default) where the setup names none. The
// decode step is the setup's unless -decode-context is given (a setup
// that names none has the fitted line, the flag's default).
func (cfg RecoveryConfig) setups() ([]benchSetupPlan, error) {
	setups, err := recoverystudy.ParseSetups(cfg.Setups)
	if err != nil {
		return nil, fmt.Errorf("-setups: %w", err)
	}
	out := make([]benchSetupPlan, len(setups))
	for i, s := range setups {
		if cfg.MaxRunning > 0 {
			s.MaxRunning = cfg.MaxRunning
		}
		if cfg.TokenBudget > 0 {
			s.TokenBudget = cfg.TokenBudget
		}
		c := &s.Conditions
		c.Override(recoverystudy.Conditions{Load: cfg.Load, Reload: cfg.Reload, Detect: cfg.Detect,
			DecodeContext: cfg.DecodeContext == "on"}, cfg.Given)
		cond, err := parseConditions(*c, c.DecodeContext)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.Name, err)
		}
		if cfg.Nodes != 0 {
			if cfg.Nodes < 2 || cfg.Nodes > s.Workers {
				return nil, fmt.Errorf("-nodes %d: must be in 2 … %d, the workers of setup %s (node-1's are killed, the others recover)", cfg.Nodes, s.Workers, s.Name)
			}
			s.Failures = len(nodeVictims(s.Workers, cfg.Nodes))
		}
		out[i] = benchSetupPlan{Setup: s, load: c.LoadOr(0.7), cond: cond}
	}
	return out, nil
}

func benchSetup(s recoverystudy.Setup, tm benchTiming, seed uint64, busy, scale float64, dir string) (map[string]*recoveryFigures, error) {
	prof, _, err := engine.LookupProfile(s.Profile)
	if err != nil {
		return nil, err
	}
	tr := workload.AzureConversation
	modelled, batch := prof.SaturatedRate(s.MaxRunning, tr.Prompt.Mean(), tr.Output.Mean())
	fmt.Printf("== %s: %d workers, synthetic engine paced as %s (time scale %g), batch up to %d, %d of them killed at %s\n",
		s.Name, s.Workers, s.Profile, scale, batch, s.Failures, tm.FailAt)
	reloaded, err := prof.WithReload(tm.cond.reload)
	if err != nil {
		return nil, fmt.Errorf("-reload: %w", err)
	}
	tm.reload = reloaded.LoadTime()
	// "Busy" is measured, not modelled: a calibration run offers twice
	// the modelled capacity and counts what the cluster delivers.
	saturated, err := calibrate(s, tm, scale, seed, 2*modelled*float64(s.Workers), filepath.Join(dir, "calibration"))
	if err != nil {
		return nil, fmt.Errorf("calibration: %w", err)
	}
	rate := busy * saturated
	reqs, err := tm.arrivals(seed, rate, tm.Duration)
	if err != nil {
		return nil, err
	}
	fmt.Printf("   saturated, the cluster completes %.2f requests/s (the model said %.2f); the workload offers %.0f%% of that:\n",
		saturated, modelled*float64(s.Workers), 100*busy)
	if tm.trace != nil {
		fmt.Printf("   %d requests of the trace, rescaled to %.2f/s over %s\n", len(reqs), rate, tm.Duration)
	} else {
		fmt.Printf("   %d requests, Poisson %.2f/s over %s, %s lengths, seed %d\n", len(reqs), rate, tm.Duration, tr.Name, seed)
	}
	how := "kill -9: the failed workers restart at once"
	if tm.cond.hang {
		how = "SIGSTOP: the failed workers hang until Serf detects them, then are killed and restart"
	}
	reload := time.Duration(float64(reloaded.LoadTime()) * tm.ReloadScale)
	onClock := ""
	if scale != 1 {
		onClock = fmt.Sprintf(" (%s on the clock at time scale %g)", time.Duration(float64(reload)*scale).Round(100*time.Millisecond), scale)
	}
	fmt.Printf("   %s and reload (%s) for %s%s, as the profile says; decode steps %s\n", how, tm.cond.reload,
		reload.Round(100*time.Millisecond), onClock,
		map[bool]string{false: "on the fitted line", true: "grow with the context read"}[tm.cond.decodeContext])

	// The failure-free reference of every output: the synthetic engine
	// alone, in this process.
	refs, err := syntheticReferences(reqs)
	if err != nil {
		return nil, err
	}
	bodies := requestBodies(reqs)

	outcomes := map[string]*runOutcome{}
	figs := map[string]*recoveryFigures{}
	for _, run := range tm.columns {
		fmt.Printf("-- %s / %s\n", s.Name, run.Name)
		o, err := benchRun(s, run, tm, scale, reqs, bodies, filepath.Join(dir, run.Name), 0)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", run.Name, err)
		}
		outcomes[run.Name] = o
	}
	// Every figure is in emulated time, the profile's, as lumen sim
	// reports it: each run's clock readings are divided by the scale.
	rule := servingstats.DefaultRecoveryRule(rate, prof.StepTime(batch, 0))
	nominalFail, end := tm.FailAt, tm.Duration
	common := map[string]*recoverystudy.Figures{}
	runs := map[string]*recoverystudy.Run{}
	pageBytes := float64(prof.KVBytesPerToken() * engine.PageTokens)
	prompts := make([]int, len(reqs))
	for i, r := range reqs {
		prompts[i] = r.PromptLen()
	}
	for _, run := range tm.columns {
		o := outcomes[run.Name]
		o.finish(scale, prompts)
		f := runFigures(o, refs, tm.Warmup, nominalFail)
		f.CheckpointBytesSent = o.ckptPages * pageBytes
		f.Series = timeSeries(o, time.Second)
		f.ArrivalRatePerSec, f.SaturatedPerSec, f.TimeScale = rate, saturated, scale
		if run.Fail {
			f.PlanMs = float64(o.planAt-o.failAt) / 1e6
		}
		figs[run.Name], common[run.Name] = f, &f.Figures
		runs[run.Name] = &recoverystudy.Run{Records: o.recs, Queue: o.queue, FailAt: o.failAt, End: end, Recoveries: o.recoveries()}
	}
	recoverystudy.FailureFigures(common, runs, rule)
	if scale != 1 {
		fmt.Printf("(every time below is emulated: the clock's / the time scale %g)\n", scale)
	}
	printRecoveryTable(os.Stdout, s, figs, rule)
	return figs, nil
}

// runFigures is what one run measured, but its recovery time: request
// counts, outputs against the references, TTFT and TPOT of the requests
// that arrived after warmup (TTFT before nominalFail apart), the resume
// times of the interrupted requests, pages reused, tokens recomputed and
// the pacing overrun.
func runFigures(o *runOutcome, refs []string, warmup, nominalFail time.Duration) *recoveryFigures {
	f := &recoveryFigures{}
	f.Latencies(o.recs, warmup, nominalFail)
	for i, r := range o.recs {
		if r.Err == nil && o.texts[i] != refs[i] {
			f.WrongOutputs++
		}
	}
	f.Resumes(o.recoveries())
	f.Interrupted = len(o.interrupted)
	f.PagesReused, f.TokensRecomputed = o.restored, o.recomputed
	f.RestoredFraction = 1
	if f.Interrupted > 0 {
		f.RestoredFraction = min(1, o.restoredReqs/float64(f.Interrupted))
	}
	f.DraftTokens, f.AcceptedTokens, f.AssistS = o.draftTokens, o.acceptedTokens, o.assistS
	f.Preemptions = o.preemptions
	if o.draftTokens > 0 {
		f.AcceptRate = o.acceptedTokens / o.draftTokens
	}
	if o.emulated > 0 {
		f.PacingOverrunPct = 100 * (o.paced/o.emulated - 1)
	}
	if o.paced > 0 {
		f.HostGapPct = 100 * o.stepGap / o.paced
	}
	return f
}

// finish readies a run's outcome for its figures: its clock readings in
// emulated time (toEmulatedTime), then, under a strategy that
// regenerates, what the regenerations recomputed added to recomputed.
// Which requests had streamed is read off their pauses, whose grace
// (servingstats.ResumeGrace) is emulated time: hence after the
// conversion. prompts are every request's prompt length.
func (o *runOutcome) finish(scale float64, prompts []int) {
	o.toEmulatedTime(scale)
	if o.regenerates {
		o.recomputed += regenerationRecomputed(o.recs, prompts, o.failAt, o.regenerated)
	}
}

// toEmulatedTime rescales a run's clock readings, taken at time scale
// scale, to emulated time: at -time-scale 2 a TTFT of 300 ms on the clock
// is 150 ms of the profile's, what lumen sim reports for the same
// arrivals.
func (o *runOutcome) toEmulatedTime(scale float64) {
	if scale == 1 {
		return
	}
	e := func(d time.Duration) time.Duration { return time.Duration(float64(d) / scale) }
	for _, r := range o.recs {
		if r == nil {
			continue
		}
		r.Arrival = e(r.Arrival)
		for i := range r.Chunks {
			r.Chunks[i] = e(r.Chunks[i])
		}
	}
	for i := range o.queue {
		o.queue[i].At = e(o.queue[i].At)
	}
	o.failAt, o.planAt = e(o.failAt), e(o.planAt)
	o.assistS /= scale
}

// markInterrupted marks the records of the requests the recovery plans
// moved: those running or queued on a killed worker.
func (o *runOutcome) markInterrupted() {
	for _, r := range o.recs {
		if r != nil {
			r.Interrupted = o.interrupted[r.ID]
		}
	}
}

// recoveries are, per interrupted request that completed, the time from
// the kill to its next token as the client saw it: the end of the pause
// the failure caused (servingstats.Record.Resume; the chunks already in
// flight when the worker died arrive just after the kill, and with a
// regeneration the gateway holds back the tokens sent before). A client
// cannot see the calls behind its stream: this is the bench's resume
// latency too, where the simulator times the new call's first token.
func (o *runOutcome) recoveries() []time.Duration {
	var out []time.Duration
	for _, r := range o.recs {
		if r == nil || r.Err != nil || !r.Interrupted {
			continue
		}
		if d, ok := r.Resume(o.failAt); ok {
			out = append(out, d)
		}
	}
	return out
}

// timeSeries bins a run by arrival: the requests that arrived in each bin
// and their mean TTFT, and the mean queue length sampled in it (the
// simulator's -csv series, sim.WriteSeries, for real processes).
func timeSeries(o *runOutcome, bin time.Duration) *plot.Series {
	var end time.Duration
	for _, r := range o.recs {
		if r != nil {
			end = max(end, r.Arrival)
		}
	}
	for _, q := range o.queue {
		end = max(end, q.At)
	}
	n := int(end/bin) + 1
	s := &plot.Series{BinS: bin.Seconds(), FailAtS: o.failAt.Seconds(), TS: make([]float64, n), Arrivals: make([]int, n),
		TTFTMeanMs: make([]float64, n), Waiting: make([]float64, n)}
	samples := make([]int, n)
	for i := range s.TS {
		s.TS[i] = float64(i) * bin.Seconds()
	}
	for _, r := range o.recs {
		if r == nil || r.Err != nil {
			continue
		}
		if d, ok := r.TTFT(); ok {
			k := int(r.Arrival / bin)
			s.TTFTMeanMs[k] += float64(d) / 1e6
			s.Arrivals[k]++
		}
	}
	for _, q := range o.queue {
		k := int(q.At / bin)
		s.Waiting[k] += q.Waiting
		samples[k]++
	}
	for i := range s.TS {
		if s.Arrivals[i] > 0 {
			s.TTFTMeanMs[i] /= float64(s.Arrivals[i])
		}
		if samples[i] > 0 {
			s.Waiting[i] /= float64(samples[i])
		}
	}
	return s
}

// requestBodies are the streaming requests of reqs, with usage.
func requestBodies(reqs []workload.Request) [][]byte {
	bodies := make([][]byte, len(reqs))
	for i, r := range reqs {
		bodies[i] = completions.Body(r.Prompt, r.Output, true)
	}
	return bodies
}

// syntheticReferences decodes every request alone on a synthetic engine:
// what a failure-free, unbatched run returns.
func syntheticReferences(reqs []workload.Request) ([]string, error) {
	out := make([]string, len(reqs))
	var wg sync.WaitGroup
	var firstErr atomic.Value
	jobs := make(chan int)
	for range 2 {
		wg.Go(func() {
			e, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 1024})
			if err != nil {
				firstErr.CompareAndSwap(nil, err)
				return
			}
			for i := range jobs {
				out[i] = engine.GreedyText(e, reqs[i].Prompt, reqs[i].Output)
			}
		})
	}
	for i := range reqs {
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	if err, _ := firstErr.Load().(error); err != nil {
		return nil, err
	}
	return out, nil
}

// benchRun runs one column: a fresh cluster, the arrivals, the failure.
// With stopAt > 0 every request still open then is cancelled (calibration).
func benchRun(s recoverystudy.Setup, run recoverystudy.Column, tm benchTiming, scale float64, reqs []workload.Request, bodies [][]byte, dir string, stopAt time.Duration) (*runOutcome, error) {
	bound := tm.wallBound(scale)
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	reqCtx, stopRequests := context.WithCancel(ctx)
	defer stopRequests()
	// Every run starts from empty data directories (a -dir kept from an
	// earlier invocation would restart its old quorum).
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	cl, err := devcluster.Start(ctx, devcluster.Options{Dir: dir, Controllers: 3, Args: []string{"-log-level", "warn"}})
	if err != nil {
		return nil, err
	}
	defer cl.Stop()
	client, err := ctlclient.New(cl.GRPCAddrs(), nil)
	if err != nil {
		return nil, err
	}
	defer client.Close()
	if err := client.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) error {
		_, err := op.SetStrategy(ctx, &pb.SetStrategyRequest{Strategy: pb.Strategy(run.Strategy), CheckpointReplicas: uint32(tm.replicas)})
		return err
	}); err != nil {
		return nil, fmt.Errorf("set strategy: %w", err)
	}
	args := []string{"-engine", "synthetic", "-profile", s.Profile,
		"-time-scale", fmt.Sprint(scale), "-load-scale", fmt.Sprint(tm.ReloadScale * scale), "-emulate-load=false",
		"-max-running", fmt.Sprint(s.MaxRunning), "-token-budget", fmt.Sprint(s.StepTokens()), "-checkpoint-budget", fmt.Sprint(s.Budget)}
	args = append(args, tm.cond.workerArgs()...)
	if s.KVPages > 0 {
		args = append(args, "-kv-pages", fmt.Sprint(s.KVPages))
	}
	for i := 1; i <= s.Workers; i++ {
		wargs := args
		if node := devcluster.DevNode(i, s.Workers, tm.nodes); node != "" {
			wargs = append(append([]string(nil), args...), "-node", node)
		}
		if _, err := cl.AddWorker(fmt.Sprintf("worker-%d", i), wargs...); err != nil {
			return nil, err
		}
	}
	gw, err := cl.StartGateway("", "-max-concurrent", "16384", "-max-context", "32768", "-resume-timeout", bound.String())
	if err != nil {
		return nil, err
	}
	if err := gw.WaitReady(ctx); err != nil {
		return nil, err
	}
	if err := waitWorkersServing(ctx, client, s.Workers); err != nil {
		return nil, err
	}

	o := &runOutcome{recs: make([]*servingstats.Record, len(reqs)), texts: make([]string, len(reqs)), interrupted: map[string]bool{}}
	base := tm.progress.Done()
	defer tm.progress.Set(base+1, s.Name+" / "+run.Name+" done")
	httpc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4096}}
	start := time.Now()
	since := func() time.Duration { return time.Since(start) }

	// The queue length: requests waiting at the live workers, from the
	// controllers' load table.
	sampleCtx, stopSampling := context.WithCancel(ctx)
	var sampler sync.WaitGroup
	sampler.Go(func() {
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-sampleCtx.Done():
				return
			case <-t.C:
			}
			qctx, qcancel := context.WithTimeout(sampleCtx, time.Second)
			resp, err := client.ListWorkers(qctx, &pb.ListWorkersRequest{Consistency: pb.Consistency_CONSISTENCY_STALE})
			qcancel()
			if err != nil {
				continue
			}
			live := map[string]uint64{}
			for _, w := range resp.Workers {
				if w.Phase != pb.WorkerPhase_WORKER_PHASE_FAILED {
					live[w.Id] = w.Incarnation
				}
			}
			waiting := 0.0
			for _, l := range resp.Loads {
				if inc, ok := live[l.WorkerId]; ok && inc == l.Incarnation {
					waiting += float64(l.Waiting)
				}
			}
			o.queue = append(o.queue, servingstats.Sample{At: since(), Waiting: waiting})
		}
	})

	// The failure: fixed workers at a fixed time, restarted at once to
	// reload their model.
	var failer sync.WaitGroup
	var killed atomic.Bool
	evCtx, stopEvents := context.WithCancel(ctx)
	defer stopEvents()
	if run.Fail {
		failer.Go(func() {
			st, err := client.ClusterStatus(ctx)
			if err != nil {
				fmt.Printf("   cluster status: %v\n", err)
				return
			}
			events, err := client.WatchEvents(evCtx, st.AppliedIndex)
			if err != nil {
				fmt.Printf("   watch events: %v\n", err)
				return
			}
			victims := map[string]bool{}
			for i := 1; i <= s.Failures; i++ {
				victims[fmt.Sprintf("worker-%d", i)] = true
			}
			if tm.nodes > 0 {
				victims = nodeVictims(s.Workers, tm.nodes)
			}
			timer := time.NewTimer(time.Duration(float64(tm.FailAt)*scale) - since())
			select {
			case <-ctx.Done():
				return
			case <-timer.C:
			}
			o.failAt = since()
			restart := func() {
				for _, w := range cl.Workers {
					if victims[w.ID] {
						w.Args = append(w.Args, "-emulate-load=true", fmt.Sprintf("-progressive=%v", run.Progressive))
						if err := cl.StartWorker(w); err != nil {
							fmt.Printf("   restart %s: %v\n", w.ID, err)
						}
					}
				}
			}
			// plans waits for the victims' recovery plans: they say which
			// requests the failure interrupted.
			plans := func() {
				for n := 0; n < s.Failures; {
					ev, err := events.Recv()
					if err != nil {
						return
					}
					if rp := ev.GetRecoveryPlan(); rp != nil && victims[rp.FailedWorker] {
						if n == 0 {
							o.planAt = since()
						}
						n++
						for _, a := range rp.Assignments {
							id, _, _ := strings.Cut(a.RequestId, "~")
							o.interrupted[id] = true
						}
					}
				}
			}
			if tm.cond.hang {
				for _, w := range cl.Workers {
					if victims[w.ID] {
						if err := cl.PauseWorker(w); err != nil {
							fmt.Printf("   SIGSTOP %s: %v\n", w.ID, err)
						}
					}
				}
				killed.Store(true)
				fmt.Printf("   t=%4.1fs  SIGSTOP %d worker(s); once detected they are killed, restart and reload\n", o.failAt.Seconds(), s.Failures)
				plans()
				for _, w := range cl.Workers {
					if victims[w.ID] {
						cl.KillWorker(w)
					}
				}
				if o.planAt > 0 {
					fmt.Printf("   t=%4.1fs  detected %.1fs after the hang; kill -9, restart\n", since().Seconds(), (o.planAt - o.failAt).Seconds())
				}
				restart()
				return
			}
			for _, w := range cl.Workers {
				if victims[w.ID] {
					cl.KillWorker(w)
				}
			}
			killed.Store(true)
			fmt.Printf("   t=%4.1fs  kill -9 %d worker(s); they restart and reload\n", o.failAt.Seconds(), s.Failures)
			restart()
			plans()
		})
	}

	var wg sync.WaitGroup
	var done, failed atomic.Int64
	progress := time.NewTicker(10 * time.Second)
	defer progress.Stop()
	for i := range reqs {
		at := time.Duration(float64(reqs[i].At) * scale)
		for wait := at - since(); wait > 0; wait = at - since() {
			select {
			case <-progress.C:
				fmt.Printf("   t=%4.0fs  %d sent, %d done, %d failed\n", since().Seconds(), i, done.Load(), failed.Load())
				tm.progress.Set(base+0.9*float64(i)/float64(len(reqs)), s.Name+" / "+run.Name)
			case <-time.After(wait):
			}
		}
		rec := &servingstats.Record{Arrival: since()}
		o.recs[i] = rec
		wg.Go(func() {
			o.texts[i], rec.ID, rec.Err = streamOne(reqCtx, httpc, gw.Addr, bodies[i], rec, since)
			if rec.Err != nil {
				failed.Add(1)
			}
			done.Add(1)
		})
	}
	if stopAt > 0 {
		sleepUntil(ctx, start.Add(stopAt))
		stopRequests()
	} else {
		fmt.Printf("   t=%4.0fs  all %d sent; waiting for the last streams\n", since().Seconds(), len(reqs))
	}
	wg.Wait()
	stopEvents()
	failer.Wait()
	o.markInterrupted()
	stopSampling()
	sampler.Wait()
	fmt.Printf("   t=%4.0fs  %d done, %d failed\n", since().Seconds(), done.Load(), failed.Load())
	if stopAt == 0 {
		shown := 0
		for i, r := range o.recs {
			if r.Err != nil && shown < 5 {
				fmt.Printf("   request %d (%s, sent at %.1fs, %d tokens streamed) failed: %v\n", i, r.ID, r.Arrival.Seconds(), len(r.Chunks), r.Err)
				shown++
			}
		}
	}
	for _, w := range cl.Workers {
		if !w.Running() {
			continue
		}
		for _, m := range []struct {
			sum  *float64
			name string
		}{{&o.restored, "lumen_worker_restored_pages_total"}, {&o.recomputed, "lumen_worker_resume_recomputed_tokens_total"},
			{&o.restoredReqs, "lumen_worker_restored_requests_total"}, {&o.ckptPages, "lumen_worker_checkpoint_pages_sent_total"},
			{&o.emulated, "lumen_worker_emulated_seconds_total"}, {&o.paced, "lumen_worker_paced_seconds_total"},
			{&o.draftTokens, "lumen_worker_spec_draft_tokens_total"}, {&o.acceptedTokens, "lumen_worker_spec_accepted_tokens_total"},
			{&o.assistS, "lumen_worker_assist_seconds_total"}, {&o.preemptions, "lumen_worker_num_preemptions_total"},
			{&o.stepGap, "lumen_worker_step_gap_seconds_total"}} {
			v, err := w.Metric(ctx, m.name)
			if err != nil {
				// Counted as nothing, and said so: the figures of this
				// run miss a worker.
				fmt.Printf("   %v\n", err)
				continue
			}
			*m.sum += v
		}
	}
	if run.Strategy.Regenerates() {
		// The workers count only what a resumed call prefills beyond its
		// checkpoint: a stop-and-restart call carries the prompt alone, a
		// new request to them. Its recompute is the gateway's, added by
		// finish.
		regenerated, err := devcluster.ScrapeMetric(ctx, "http://"+gw.Addr+"/metrics", regeneratedMetric)
		if err != nil {
			fmt.Printf("   %v\n", err)
		}
		o.regenerates, o.regenerated = true, regenerated
	}
	if run.Fail && !killed.Load() {
		return nil, errors.New("the failure was never injected")
	}
	return o, nil
}

// regeneratedMetric is the gateway's count of the output tokens a
// stop-and-restart resume decoded again (matched and mismatched).
const regeneratedMetric = "lumen_gateway_regenerated_tokens_total"

// regenerationRecomputed is what stop-and-restart's regenerations
// recompute, as the simulator counts it (sim.Sim.onToken): per interrupted
// request that had streamed tokens when its worker failed and got a token
// from its regenerated call, its prompt, prefilled again, and every output
// token it had, decoded again (regenerated: the gateway's count of those,
// summed over the requests). A request interrupted before its first token
// runs again as a new one and recomputes nothing there either. The client
// sees which requests had streamed: those with a chunk before the end of
// the pause the failure caused (servingstats.Record.Resume; chunks still
// in flight at the kill count, they were sent before it). recs must be
// marked interrupted.
func regenerationRecomputed(recs []*servingstats.Record, prompts []int, failAt time.Duration, regenerated float64) float64 {
	n := regenerated
	for i, r := range recs {
		if r == nil || !r.Interrupted || len(r.Chunks) == 0 {
			continue
		}
		d, ok := r.Resume(failAt)
		if ok && r.Chunks[0] < failAt+d {
			n += float64(prompts[i])
		}
	}
	return n
}

func sleepUntil(ctx context.Context, t time.Time) {
	timer := time.NewTimer(time.Until(t))
	defer timer.Stop()
	select {
	case <-ctx.Done():
	case <-timer.C:
	}
}

// calibrate measures the cluster's saturated throughput in requests per
// (emulated) second: arrivals at `offered`, well above capacity, and the
// output tokens delivered per second over the second half of the run,
// divided by the mean output length. Run at the same lengths, it is the
// rate the "busy" fraction is of.
func calibrate(s recoverystudy.Setup, tm benchTiming, scale float64, seed uint64, offered float64, dir string) (float64, error) {
	d := tm.Calibration
	reqs, err := tm.arrivals(seed+1000, offered, d)
	if err != nil {
		return 0, err
	}
	bodies := requestBodies(reqs)
	fmt.Printf("-- %s / calibration: %.1f requests/s offered for %s\n", s.Name, offered, d)
	wall := time.Duration(float64(d) * scale)
	o, err := benchRun(s, recoverystudy.Column{Name: "calibration", Strategy: policy.Lumen}, tm, scale, reqs, bodies, dir, wall)
	if err != nil {
		return 0, err
	}
	tokens := 0
	for _, r := range o.recs {
		for _, c := range r.Chunks {
			if c >= wall/2 && c < wall {
				tokens++
			}
		}
	}
	perWallSec := float64(tokens) / (wall / 2).Seconds()
	if o.emulated > 0 {
		fmt.Printf("   %.0f tokens/s delivered; engine steps ran %.1f%% over the profile's times, and the hosts took %.1f%% more between them\n",
			perWallSec, 100*(o.paced/o.emulated-1), 100*o.stepGap/o.paced)
	}
	return perWallSec * scale / workload.AzureConversation.Output.Mean(), nil
}

// waitWorkersServing waits until n workers are registered in full service.
func waitWorkersServing(ctx context.Context, c *ctlclient.Client, n int) error {
	for {
		resp, err := c.ListWorkers(ctx, &pb.ListWorkersRequest{})
		if err == nil {
			ok := 0
			for _, w := range resp.Workers {
				if w.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
					ok++
				}
			}
			if ok >= n {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d workers never all in full service: %w", n, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// streamOne sends one streaming completion and records when each chunk came.
func streamOne(ctx context.Context, httpc *http.Client, addr string, body []byte, rec *servingstats.Record, since func() time.Duration) (text, id string, err error) {
	res, err := completions.Stream(ctx, httpc, addr, body, func(c completions.Chunk) {
		if c.Usage != nil {
			rec.Tokens = c.Usage.CompletionTokens
		} else if c.Text != "" {
			rec.Chunks = append(rec.Chunks, since())
		}
	})
	if err != nil {
		return "", res.ID, err
	}
	return res.Text, res.ID, nil
}

// printRecoveryTable prints one setup's comparison of the strategies:
// the comparison's table with what only real processes measure.
func printRecoveryTable(w io.Writer, s recoverystudy.Setup, figs map[string]*recoveryFigures, rule servingstats.RecoveryRule) {
	f1 := func(v float64) string { return fmt.Sprintf("%.1f", v) }
	t := recoverystudy.Table{Setup: s, Figures: map[string]*recoverystudy.Figures{}, Rule: rule, Rows: []recoverystudy.Row{
		{Name: "outputs != reference", Cell: func(c string) string { return fmt.Sprint(figs[c].WrongOutputs) }},
		{Name: "pacing overrun (%)", Cell: func(c string) string { return f1(figs[c].PacingOverrunPct) }},
		{Name: "host gap between steps (%)", Cell: func(c string) string { return f1(figs[c].HostGapPct) }},
		{Name: "drafts accepted/verified", Cell: func(c string) string {
			return fmt.Sprintf("%.0f/%.0f", figs[c].AcceptedTokens, figs[c].DraftTokens)
		}},
		{Name: "assist (s)", Cell: func(c string) string { return f1(figs[c].AssistS) }},
		{Name: "restored fraction", Cell: func(c string) string { return fmt.Sprintf("%.3f", figs[c].RestoredFraction) }},
		{Name: "checkpoint GB sent", Cell: func(c string) string { return fmt.Sprintf("%.1f", figs[c].CheckpointBytesSent/1e9) }},
		{Name: "preemptions", Cell: func(c string) string { return fmt.Sprintf("%.0f", figs[c].Preemptions) }},
	}}
	for name, f := range figs {
		t.Figures[name] = &f.Figures
	}
	t.Print(w)
}

// nodeVictims are the workers of node-1 when workers are on nodes hosts
// (devcluster.DevNode): the ones a node failure kills together.
func nodeVictims(workers, nodes int) map[string]bool {
	out := map[string]bool{}
	for i := 1; i <= workers; i++ {
		if devcluster.DevNode(i, workers, nodes) == "node-1" {
			out[fmt.Sprintf("worker-%d", i)] = true
		}
	}
	return out
}
