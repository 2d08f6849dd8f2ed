package sim

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/lumen-project/lumen/internal/plot"
	"github.com/lumen-project/lumen/internal/progress"
	"github.com/lumen-project/lumen/internal/recoverystudy"
	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
	"github.com/lumen-project/lumen/worker/loadreport"
)

// Options is what `lumen sim` runs: prototype setups by name, or one
// custom setup.
type Options struct {
	Setups []Setup
	// Duration, for a custom setup, is the arrivals' span (0: the
	// timeline's); the failure comes at a quarter of it, TTFT counts after
	// a twelfth, and calibration lasts half of it, at most a minute.
	Duration time.Duration
	// FailAt, when set, is when the failed workers (worker-1 … worker-K)
	// are killed, from the start of the arrivals; 0 keeps the timeline's
	// (a quarter of a custom run, 30 s of the full prototype timeline).
	FailAt time.Duration
	Quick  bool
	Seed   uint64
	Load   float64
	// Saturated, when > 0, is every setup's saturated throughput in
	// requests per second (Study.Saturated): the offered load is a
	// fraction of it instead of the calibration's measure.
	Saturated float64
	Lambda    float64
	// NoRestart leaves failed workers down.
	NoRestart    bool
	Timing       Timing
	MeasureApply bool
	// JSONPath, when set, receives setup → column → Figures after every
	// setup (a long run keeps what it measured).
	JSONPath string
	// CSVPath, when set, receives every column's time series
	// (SeriesHeader, WriteSeries).
	CSVPath string
	// TracePath, when set, is a CSV trace in the Azure 2023 format that
	// replaces the generator (workload.ReadAzureTrace).
	TracePath string
	// Spec is the lumen column's speculation.
	Spec SpecOptions
	// Migration turns live migration on in every column (Config.Migration).
	Migration bool
	// Gateways and GatewayChoice are every column's dispatch
	// (Config.Gateways; 0: inside Apply).
	Gateways int
	// PrefixRouting turns on every column's prefix caches and
	// prefix-aware placement (Config.PrefixCache, PrefixRouting).
	PrefixRouting bool
	GatewayChoice GatewayChoice
	// Cells is every column's cells (Study.Cells).
	Cells int
	// Failure domains and replication (Study's fields of the same names).
	GPUsPerNode, FailNodes, CheckpointReplicas int
	DomainBlind                                bool
	// Columns, when set, are the columns to run (Study.Only).
	Columns []string
	// StepTrace and TraceDir are every Study's.
	StepTrace bool
	TraceDir  string
	// CalibrationWorkers is every study's (Study.CalibrationWorkers).
	CalibrationWorkers int
	Log                io.Writer
}

// newMeter is a progress meter of runs on standard error for a command
// that logs (the CLI), nil (nothing) for a quiet caller (tests).
func newMeter(log io.Writer, name string, runs float64) *progress.Meter {
	if log == nil {
		return nil
	}
	return progress.New(name, "runs", runs)
}

// CustomSetup is a setup outside the prototype's, named "custom" in the
// JSON.
func CustomSetup(workers int, profile string, failures, maxRunning int, budget uint64) Setup {
	return Setup{Name: "custom", Workers: workers, Profile: profile, Failures: failures, MaxRunning: maxRunning, Budget: budget}
}

// RunStudies runs a Study per setup and returns setup → column → figures.
func RunStudies(o Options) (map[string]map[string]*Figures, error) {
	out := map[string]map[string]*Figures{}
	var series io.Writer
	if o.CSVPath != "" {
		f, err := os.Create(o.CSVPath)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		if _, err := io.WriteString(f, SeriesHeader); err != nil {
			return nil, err
		}
		series = f
	}
	var trace []workload.Request
	if o.TracePath != "" {
		f, err := os.Open(o.TracePath)
		if err != nil {
			return nil, err
		}
		trace, err = workload.ReadAzureTrace(f, o.Seed)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", o.TracePath, err)
		}
	}
	// The meter counts the columns that run: every one, or -columns'.
	cols, err := (&Study{Only: o.Columns}).columns()
	if err != nil {
		return nil, err
	}
	meter := newMeter(o.Log, "sim", float64(len(o.Setups)*len(cols)))
	defer meter.Finish("")
	for _, s := range o.Setups {
		tm := s.Timeline(o.Quick)
		if o.Duration > 0 {
			tm.Duration = o.Duration
			tm.FailAt = o.Duration / 4
			tm.Warmup = o.Duration / 12
			tm.Calibration = min(o.Duration/2, time.Minute)
		}
		if o.FailAt > 0 {
			if o.FailAt >= tm.Duration {
				return nil, fmt.Errorf("%w: %s: failures at %s, not before the arrivals end at %s", ErrInvalid, s.Name, o.FailAt, tm.Duration)
			}
			tm.FailAt = o.FailAt
		}
		if o.GPUsPerNode == 0 && s.Failures > s.Workers-1 {
			return nil, fmt.Errorf("%w: %s: %d failures of %d workers leave none to recover on", ErrInvalid, s.Name, s.Failures, s.Workers)
		}
		timing, err := o.Timing.Under(s.Conditions)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.Name, err)
		}
		st := Study{Setup: s, Timeline: tm, Seed: o.Seed, Load: s.LoadOr(o.Load), Saturated: o.Saturated, Lambda: o.Lambda, NoRestart: o.NoRestart,
			Timing: timing, MeasureApply: o.MeasureApply, Log: o.Log, Series: series, Trace: trace, Spec: o.Spec, Migration: o.Migration, Meter: meter,
			Gateways: o.Gateways, GatewayChoice: o.GatewayChoice, PrefixRouting: o.PrefixRouting, Cells: o.Cells,
			GPUsPerNode: o.GPUsPerNode, FailNodes: o.FailNodes, DomainBlind: o.DomainBlind, CheckpointReplicas: o.CheckpointReplicas, Only: o.Columns,
			StepTrace: o.StepTrace, TraceDir: o.TraceDir, CalibrationWorkers: o.CalibrationWorkers}
		figs, err := st.Run()
		if err != nil {
			return nil, err
		}
		out[s.Name] = figs
		if o.JSONPath != "" {
			b, err := json.MarshalIndent(out, "", "  ")
			if err != nil {
				return nil, err
			}
			if err := os.WriteFile(o.JSONPath, append(b, '\n'), 0o644); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

// Command is `lumen sim`: what its flags say (cmd/lumen parses them), run
// by Run. A zero value is not useful: start from DefaultCommand.
type Command struct {
	// Setups names prototype setups (PrototypeSetups), comma-separated;
	// empty: all three, unless Workers is set.
	Setups string
	// Workers > 0 is one custom setup of that many workers, with Profile,
	// Fail, Duration, MaxRunning and Budget.
	Workers    int
	Profile    string
	Fail       int
	Duration   time.Duration
	MaxRunning int
	// TokenBudget, when given, is every setup's step token budget
	// (Setup.TokenBudget; 0: the default, 2,048).
	TokenBudget int
	Budget      uint64 // bytes
	Quick       bool
	Seed        uint64
	// Seeds > 1 runs every figure point with seeds Seed … Seed+Seeds−1.
	Seeds int
	Load  float64
	// Saturated, when > 0, replaces the calibration (Options.Saturated;
	// with -figure, FigureOptions.Saturated).
	Saturated float64
	Lambda    float64
	FailAt    time.Duration
	NoRestart bool
	// Detect is how a failure is detected (ParseDetect): fast (a kill -9
	// on the fast path, DefaultTiming's DetectDelay), hang (a SIGSTOP that
	// Serf detects, DefaultHangDetect), a duration (the fast path taking
	// that long) or hang:DURATION.
	Detect string
	// Reload is a restarted worker's reload: warm, cold or a duration
	// (engine.ParseReload).
	Reload string
	// DecodeContext is "on" or "off": the context-dependent decode step
	// (Timing.DecodeContext).
	DecodeContext string
	// StepScale: every engine step this many times the profile's
	// (Timing.StepScale; 1: the profile's).
	StepScale float64
	// Preemption is the workers' rule for a running request short of a
	// KV page: wait or vllm (core.ParsePreemption).
	Preemption string
	// LoadReports is when workers report their load: events
	// (loadreport.DefaultRule, issue 26) or periodic (every
	// Timing.LoadInterval, loadreport.PeriodicRule: lumen before it).
	LoadReports string
	// Stress runs a figure or a custom setup at the headline setups'
	// conditions and timeline (recoverystudy.Stress, a batch cap of 256,
	// 360 s with the failure at 60 s); a flag given overrides each.
	Stress      bool
	ApplyTiming bool
	// JSONPath, CSVPath, SVGPath: where the results go (empty: nowhere);
	// TracePath: an Azure 2023 trace instead of the generator; Replot: a
	// figure's JSON to plot, running nothing.
	JSONPath, CSVPath, SVGPath, TracePath, Replot string
	// Figure is the figure to run (FigureNames, spec-k, burst, gateways);
	// empty: the studies.
	Figure string
	// Xs, when set, replaces the sweep of a figure of FigureNames
	// (FigureOptions.Xs).
	Xs []float64
	// Gateways, GatewayChoice (a name of GatewayChoices) and GatewayBias
	// (only placer.ShareBias runs) are issue 16's dispatch.
	Gateways      int
	GatewayChoice string
	GatewayBias   float64
	// Cells (issue 26) splits the workers into that many cells, each its
	// own controller quorum, behind the gateways (Config.Cells).
	Cells int
	// Migration is "on" or "off".
	Migration string
	// KVPages and CV apply to the burst figure.
	KVPages int
	CV      float64
	// TraceMix (names of workload.LlumnixTraces, comma-separated; empty:
	// all five), Arrivals (ParseArrivals), Requests (a run's size) and
	// MigrationPlan (a name of MigrationFilters) apply to the llumnix
	// figure.
	TraceMix, Arrivals, MigrationPlan string
	// MigrationInterval, for the llumnix figure, replaces the leader's
	// round period (0: Timing's, 500 ms).
	MigrationInterval time.Duration
	// Rates is llumnix (Llumnix's request rates) or saturation (fractions
	// of the simulated cluster's measured saturated rate: -xs, default
	// LlumnixLoads).
	Rates    string
	Requests int
	// PriorityFraction, for the llumnix figure, is Llumnix's priority
	// experiment (LlumnixOptions.PriorityFraction): that share of the
	// requests of high priority, 128-128 at 26 req/s unless -trace-mix
	// and -xs say.
	PriorityFraction float64
	// SpecAlpha and SpecK are lumen's speculation.
	SpecAlpha float64
	SpecK     int
	// Issue 24: GPUsPerNode puts the workers on nodes of that many;
	// FailNodes kills every worker of that many nodes at the failure
	// (Fail more, drawn at random); CheckpointReplicas is the copies of
	// each checkpoint; Domains is "aware" (the workers register their
	// nodes) or "blind" (they do not: h(r) as before).
	GPUsPerNode, FailNodes, CheckpointReplicas int
	Domains                                    string
	// Columns, comma-separated, are the columns to run (empty: all).
	Columns string
	// SpecTrace prints where the TTFT of the requests arriving while
	// drafters assist goes, lumen against lumen-no-spec (Study.StepTrace).
	SpecTrace bool
	// TraceDir receives every column's requests and steps as CSV
	// (Study.TraceDir).
	TraceDir string
	// CalibrationWorkers calibrates on that many workers and scales the
	// rate (0: the studies' own size, the cells figure's 64). For the
	// studies of one setup and -figure cells.
	CalibrationWorkers int
	// PrefixRouting is "on" (the workers' prefix caches and prefix-aware
	// placement, issue 25) or "off" (freeness alone, no cache); with
	// -figure prefix, given, it runs only that column.
	PrefixRouting string
	// Given names the flags set on the command line: some defaults depend
	// on whether a value was given, and a flag that does not apply to what
	// runs is refused rather than ignored.
	Given map[string]bool
	// Out receives the tables and progress lines, Errs what could not be
	// plotted.
	Out, Errs io.Writer
}

// DefaultCommand is `lumen sim` without flags.
func DefaultCommand() Command {
	return Command{Cells: 1, Profile: "qwen3-14b-h100", Fail: 1, MaxRunning: 32, Budget: 80e9, Seed: 1, Seeds: 1, Load: 0.7,
		Detect: "fast", Reload: "warm", DecodeContext: "off", StepScale: 1, Preemption: "wait", LoadReports: "events", ApplyTiming: true, GatewayChoice: ChoosePartitionFill.String(), GatewayBias: DefaultGatewayBias,
		Migration: "off", CV: 4, Arrivals: "poisson", MigrationPlan: MigrateAsPlanned.String(), Requests: 10000, Rates: "llumnix", PrefixRouting: "off", CheckpointReplicas: 1, Domains: "aware", SpecAlpha: core.PriorAcceptance, Given: map[string]bool{}, Out: os.Stdout, Errs: os.Stderr}
}

// Run checks the command and runs it: a replot, a figure, or the studies.
func (c *Command) Run() error {
	given := func(names ...string) bool {
		for _, n := range names {
			if c.Given[n] {
				return true
			}
		}
		return false
	}
	if c.SpecAlpha <= 0 || c.SpecAlpha > 1 {
		return fmt.Errorf("-spec-alpha %g: must be in (0, 1]", c.SpecAlpha)
	}
	if err := core.CheckSpecK(c.SpecK); err != nil {
		return fmt.Errorf("-spec-k (0: adaptive): %w", err)
	}
	var migrate bool
	switch c.Migration {
	case "on":
		migrate = true
	case "off":
	default:
		return fmt.Errorf("-migration %q: on or off", c.Migration)
	}
	if given("token-budget") && c.Figure != "" {
		return fmt.Errorf("-token-budget applies to the studies, not to -figure %s", c.Figure)
	}
	if given("calibration-workers") && c.Figure != "" && c.Figure != CellsFigureName {
		return fmt.Errorf("-calibration-workers applies to the studies and to -figure %s, not to -figure %s", CellsFigureName, c.Figure)
	}
	if given("saturated") && c.Figure != "" && c.Figure != CellsFigureName && !slices.Contains(FigureNames, c.Figure) {
		return fmt.Errorf("-saturated applies to the studies and to -figure %s, %s, not to -figure %s", strings.Join(FigureNames, ", "), CellsFigureName, c.Figure)
	}
	if c.Saturated < 0 || c.CalibrationWorkers < 0 {
		return fmt.Errorf("-saturated %g (a throughput in requests per second; 0: calibrate) and -calibration-workers %d must be >= 0", c.Saturated, c.CalibrationWorkers)
	}
	if given("saturated", "calibration-workers") && c.Figure == "" && c.Workers == 0 && (c.Setups == "" || strings.Contains(c.Setups, ",")) {
		return fmt.Errorf("-saturated and -calibration-workers apply to the studies of one setup (-workers, or one of -setups), not to %q (empty: all three)", c.Setups)
	}
	if given("cv", "kv-pages") && c.Figure != "burst" {
		return fmt.Errorf("-cv and -kv-pages apply to -figure burst only")
	}
	if given("trace-mix", "arrivals", "requests", "migration-plan", "rates", "migration-interval", "priority-fraction") && c.Figure != LlumnixFigureName {
		return fmt.Errorf("-trace-mix, -arrivals, -requests, -rates, -migration-plan, -migration-interval and -priority-fraction apply to -figure %s only", LlumnixFigureName)
	}
	if c.PrefixRouting != "on" && c.PrefixRouting != "off" {
		return fmt.Errorf("-prefix-routing %q: on or off", c.PrefixRouting)
	}
	if c.Figure != "" && c.Figure != PrefixFigureName && given("prefix-routing") {
		return fmt.Errorf("-prefix-routing applies to the studies and to -figure %s, not to -figure %s", PrefixFigureName, c.Figure)
	}
	if c.PrefixRouting == "on" && c.Gateways > 0 {
		return fmt.Errorf("-prefix-routing on places inside the dispatch: it does not run with -gateways %d", c.Gateways)
	}
	if migrate && c.Figure != "" && c.Figure != "burst" {
		return fmt.Errorf("-migration on applies to the studies, not to -figure %s (-figure burst runs it off and on)", c.Figure)
	}
	choice, err := ParseGatewayChoice(c.GatewayChoice)
	if err != nil {
		return fmt.Errorf("-gateway-choice: %w", err)
	}
	if c.Gateways < 0 {
		return fmt.Errorf("-gateways %d: must be >= 0 (0: the dispatch inside Apply)", c.Gateways)
	}
	if c.GatewayBias != DefaultGatewayBias {
		return fmt.Errorf("-gateway-bias %g: the gateways run internal/placer's choice, whose preference for a gateway's share is placer.ShareBias (%g); "+
			"the prototypes with other biases were removed (docs/benchmarks.md has their figures)", c.GatewayBias, DefaultGatewayBias)
	}
	if c.Figure != "" && c.Figure != "gateways" && given("gateways", "gateway-choice", "gateway-bias") {
		return fmt.Errorf("-gateways, -gateway-choice and -gateway-bias apply to the studies and to -figure gateways, not to -figure %s", c.Figure)
	}
	if c.Figure != "" && given("gpus-per-node", "fail-nodes", "checkpoint-replicas", "domains") {
		return fmt.Errorf("-gpus-per-node, -fail-nodes, -checkpoint-replicas and -domains apply to the studies, not to -figure %s", c.Figure)
	}
	if given("columns", "spec-trace", "trace-dir") && c.Figure != "" && !slices.Contains(FigureNames, c.Figure) {
		return fmt.Errorf("-columns, -spec-trace and -trace-dir apply to the studies and to -figure %s, not to -figure %s", strings.Join(FigureNames, ", "), c.Figure)
	}
	if c.GPUsPerNode < 0 {
		return fmt.Errorf("-gpus-per-node %d: must be >= 0 (0: no nodes)", c.GPUsPerNode)
	}
	if err := c.checkCells(); err != nil {
		return err
	}
	if c.FailNodes < 0 || c.FailNodes > 0 && c.GPUsPerNode == 0 {
		return fmt.Errorf("-fail-nodes %d: must be >= 0, and needs -gpus-per-node", c.FailNodes)
	}
	if c.CheckpointReplicas < 1 || c.CheckpointReplicas > policy.MaxCheckpointReplicas {
		return fmt.Errorf("-checkpoint-replicas %d: must be in 1 … %d", c.CheckpointReplicas, policy.MaxCheckpointReplicas)
	}
	if c.Domains != "aware" && c.Domains != "blind" {
		return fmt.Errorf("-domains %q: aware or blind", c.Domains)
	}
	if c.Domains == "blind" && c.GPUsPerNode == 0 {
		return fmt.Errorf("-domains blind needs -gpus-per-node (without nodes every worker is its own domain)")
	}
	timing, err := c.timing()
	if err != nil {
		return err
	}
	spec := SpecOptions{Alpha: c.SpecAlpha, K: c.SpecK}
	switch {
	case c.Replot != "":
		return c.replot()
	case c.Figure == "spec-k":
		if given("spec-k", "spec-alpha") {
			return fmt.Errorf("-figure spec-k runs every K at alpha 0.5, 0.7 and 0.9: -spec-k and -spec-alpha do not apply")
		}
		ko := DefaultSpecKOptions()
		ko.Seed, ko.Timing, ko.Log = c.Seed, timing, c.Out
		f, err := RunSpecK(ko)
		if err != nil {
			return err
		}
		return c.writeJSON(f, true)
	case c.Figure == "gateways":
		if migrate {
			return fmt.Errorf("-figure gateways runs without migration: -migration does not apply")
		}
		g := DefaultGatewayOptions()
		g.Seed, g.Seeds, g.Timing, g.Log, g.Profile, g.MaxRunning, g.Load, g.Budget = c.Seed, c.Seeds, timing, c.Out, c.Profile, c.MaxRunning, c.Load, c.Budget
		if c.Workers > 0 {
			g.Workers = c.Workers
		}
		g.Timeline = c.timeline(g.Timeline)
		if given("gateways", "gateway-choice", "gateway-bias") {
			counts := []int{1, 4}
			if given("gateways") {
				counts = []int{c.Gateways}
			}
			if !given("gateway-choice") {
				choice = ChoosePartitionFill
			}
			g.Modes = nil
			for _, n := range counts {
				g.Modes = append(g.Modes, GatewayMode{Gateways: n})
				if choice != ChooseFreest && n > 1 {
					g.Modes = append(g.Modes, GatewayMode{Gateways: n, Choice: choice})
				}
			}
		}
		f, err := RunGateways(g)
		if err != nil {
			return err
		}
		return c.writeJSON(f, false)
	case c.Figure == CellsFigureName:
		return c.runCells(timing, choice)
	case c.Figure == "burst":
		if given("migration") {
			return fmt.Errorf("-figure burst runs migration off and on: -migration does not apply")
		}
		bo := DefaultBurstOptions()
		bo.Seed, bo.Timing, bo.Log, bo.Profile, bo.MaxRunning, bo.CV, bo.KVPages, bo.Budget = c.Seed, timing, c.Out, c.Profile, c.MaxRunning, c.CV, c.KVPages, c.Budget
		if c.Workers > 0 {
			bo.Sizes = []int{c.Workers}
		}
		if given("load") {
			bo.Loads = []float64{c.Load}
		}
		bo.Timeline = c.timeline(bo.Timeline)
		f, err := RunBurst(bo)
		if err != nil {
			return err
		}
		return c.writeJSON(f, true)
	case c.Figure == DegradationFigure:
		return c.runDegradation(timing)
	case c.Figure == LlumnixFigureName:
		return c.runLlumnix()
	case c.Figure == PrefixFigureName:
		return c.runPrefix(given)
	case c.Figure != "":
		fo := DefaultFigureOptions()
		fo.Seed, fo.Seeds, fo.Load, fo.Timing, fo.Log, fo.Profile, fo.MaxRunning, fo.Budget = c.Seed, c.Seeds, c.Load, timing, c.Out, c.Profile, c.MaxRunning, c.Budget
		fo.Spec, fo.Xs, fo.StepTrace, fo.TraceDir, fo.Saturated = spec, c.Xs, c.SpecTrace, c.TraceDir, c.Saturated
		if c.Columns != "" {
			fo.Only = strings.Split(c.Columns, ",")
		}
		if c.Workers > 0 {
			fo.Workers = c.Workers
		}
		if c.Quick {
			fo.Timeline = QuickTimeline()
		}
		if c.Stress {
			s := c.stress(Setup{MaxRunning: fo.MaxRunning, Conditions: recoverystudy.Conditions{Load: fo.Load}})
			fo.MaxRunning, fo.Load, fo.Timeline = s.MaxRunning, s.Load, s.Timeline(c.Quick)
			if fo.Timing, err = fo.Timing.Under(s.Conditions); err != nil {
				return err
			}
		}
		if c.Duration > 0 {
			fo.Timeline.Duration, fo.Timeline.FailAt, fo.Timeline.Warmup = c.Duration, c.Duration/4, c.Duration/12
		}
		f, err := RunFigure(c.Figure, fo)
		if err != nil {
			return err
		}
		if c.SVGPath != "" {
			if err := writeSVG(f, c.SVGPath); err != nil {
				return err
			}
		}
		return c.writeJSON(f, true)
	}
	o := Options{Gateways: c.Gateways, GatewayChoice: choice, PrefixRouting: c.PrefixRouting == "on", Cells: c.Cells, Migration: migrate, Quick: c.Quick, Seed: c.Seed, Load: c.Load, Saturated: c.Saturated, Lambda: c.Lambda,
		NoRestart: c.NoRestart, FailAt: c.FailAt, Timing: timing, MeasureApply: c.ApplyTiming, JSONPath: c.JSONPath, CSVPath: c.CSVPath,
		TracePath: c.TracePath, Spec: spec, Log: c.Out, StepTrace: c.SpecTrace, TraceDir: c.TraceDir,
		GPUsPerNode: c.GPUsPerNode, FailNodes: c.FailNodes, CheckpointReplicas: c.CheckpointReplicas, DomainBlind: c.Domains == "blind",
		CalibrationWorkers: c.CalibrationWorkers}
	if c.Columns != "" {
		o.Columns = strings.Split(c.Columns, ",")
	}
	if o.Setups, err = c.setups(); err != nil {
		return err
	}
	if c.Workers > 0 {
		o.Duration = c.Duration
	}
	start := time.Now()
	if _, err := RunStudies(o); err != nil {
		return err
	}
	for _, p := range []string{c.JSONPath, c.CSVPath} {
		if p != "" {
			c.plotNextTo(p)
		}
	}
	fmt.Fprintf(c.Out, "simulated in %s of wall time\n", time.Since(start).Round(10*time.Millisecond))
	return nil
}

// runDegradation runs -figure degradation: the setups of -setups (w4, w8
// unless given) or -workers, each under its own conditions but for the
// swept load and reload, which -load and -reload replace by one value.
func (c *Command) runDegradation(timing Timing) error {
	for _, f := range []string{"duration", "fail-at", "no-restart", "lambda", "trace", "csv", "spec-k", "spec-alpha"} {
		if c.Given[f] {
			return fmt.Errorf("-figure %s runs stop-and-restart and no-checkpoint-no-failure on the setups' timelines: -%s does not apply",
				DegradationFigure, f)
		}
	}
	o := DefaultDegradationOptions()
	o.Quick, o.Seed, o.Seeds, o.Timing, o.Log = c.Quick, c.Seed, c.Seeds, timing, c.Out
	sc := *c
	if sc.Setups == "" && sc.Workers == 0 {
		sc.Setups = DegradationSetups
	}
	var err error
	if o.Setups, err = sc.setups(); err != nil {
		return err
	}
	if c.Given["load"] {
		o.Loads = []float64{c.Load}
	}
	if c.Given["reload"] {
		o.Reloads = []string{c.Reload}
	}
	d, err := RunDegradation(o)
	if err != nil {
		return err
	}
	if c.SVGPath != "" {
		if err := writeSVG(d, c.SVGPath); err != nil {
			return err
		}
		fmt.Fprintf(c.Out, "wrote %s\n", c.SVGPath)
	}
	// With -svg the plot is where it says, not also next to the JSON.
	return c.writeJSON(d, c.SVGPath == "")
}

// setups are the studies' setups: one custom setup (Workers), or the
// named ones, each with the batch cap of -max-running when it is given;
// all with -token-budget's budget.
func (c *Command) setups() ([]Setup, error) {
	var out []Setup
	switch {
	case c.Workers > 0 && c.Setups != "":
		return nil, fmt.Errorf("-setups and -workers: choose prototype setups or one custom setup")
	case c.Workers > 0:
		s := CustomSetup(c.Workers, c.Profile, c.Fail, c.MaxRunning, c.Budget)
		s.TokenBudget = c.TokenBudget
		if c.Stress {
			s = c.stress(s)
		}
		out = []Setup{s}
	default:
		list := c.Setups
		if list == "" {
			list = recoverystudy.DefaultSetups
		}
		var err error
		if out, err = ParseSetups(list); err != nil {
			return nil, fmt.Errorf("-setups: %w", err)
		}
		for i := range out {
			if c.Given["max-running"] {
				out[i].MaxRunning = c.MaxRunning
			}
			out[i].TokenBudget = c.TokenBudget
		}
	}
	// A condition given on the command line holds for every setup; one
	// not given is the setup's own, or the flag's default where the setup
	// names none (a custom setup names none).
	flags := recoverystudy.Conditions{Load: c.Load, Reload: c.Reload, Detect: c.Detect,
		DecodeContext: c.DecodeContext == "on", Preemption: c.Preemption}
	for i := range out {
		out[i].Conditions.Override(flags, c.Given)
	}
	return out, nil
}

// stress is s at the headline setups' stress: their conditions, batch cap
// and timeline, but for the flags given (which keep s's values: the
// command's).
func (c *Command) stress(s Setup) Setup {
	keep := s
	s.Conditions, s.Duration, s.FailAt = recoverystudy.Stress, recoverystudy.StressDuration, recoverystudy.StressFailAt
	s.MaxRunning = StressMaxRunning
	if c.Given["max-running"] {
		s.MaxRunning = keep.MaxRunning
	}
	if c.Given["load"] {
		s.Load = c.Load
	}
	if c.Given["reload"] {
		s.Reload = c.Reload
	}
	if c.Given["detect"] {
		s.Detect = c.Detect
	}
	if c.Given["decode-context"] {
		s.DecodeContext = c.DecodeContext == "on"
	}
	return s
}

// StressMaxRunning is the headline setups' batch cap, vLLM's
// --max-num-seqs default.
const StressMaxRunning = 256

// timing is DefaultTiming with the command's conditions: detection,
// reload, decode step.
func (c *Command) timing() (Timing, error) {
	t := DefaultTiming()
	delay, hang, err := ParseDetect(c.Detect)
	if err != nil {
		return t, fmt.Errorf("-detect: %w", err)
	}
	t.DetectDelay, t.Hang = delay, hang
	if t.Reload, err = engine.ParseReload(c.Reload); err != nil {
		return t, fmt.Errorf("-reload: %w", err)
	}
	if t.Preemption, err = core.ParsePreemption(c.Preemption); err != nil {
		return t, fmt.Errorf("-preemption: %w", err)
	}
	switch c.DecodeContext {
	case "on":
		t.DecodeContext = true
	case "off":
	default:
		return t, fmt.Errorf("-decode-context %q: on or off", c.DecodeContext)
	}
	switch c.LoadReports {
	case "events":
	case "periodic":
		t.LoadRule = loadreport.PeriodicRule(t.LoadInterval)
	default:
		return t, fmt.Errorf("-load-reports %q: events or periodic", c.LoadReports)
	}
	if c.StepScale != 0 && c.StepScale != 1 {
		if c.StepScale < 0.5 || c.StepScale > 2 {
			return t, fmt.Errorf("-step-scale %g: from 0.5 to 2 (1: the profile's step times)", c.StepScale)
		}
		t.StepScale = c.StepScale
	}
	if c.MaxRunning < 1 || c.TokenBudget < 0 {
		return t, fmt.Errorf("-max-running %d must be >= 1 and -token-budget %d >= 0 (0: 2048)", c.MaxRunning, c.TokenBudget)
	}
	return t, nil
}

// ParseDetect reads how a failure is detected: fast (a kill -9 that the
// fast path detects in DefaultTiming's DetectDelay), hang (a SIGSTOP
// that Serf detects in DefaultHangDetect), a positive duration (a kill
// detected that long after) or hang:DURATION (a hang detected that long
// after). It returns the delay and whether the failure is a hang.
func ParseDetect(s string) (time.Duration, bool, error) {
	switch s {
	case "fast":
		return DefaultTiming().DetectDelay, false, nil
	case "hang":
		return DefaultHangDetect, true, nil
	}
	hang := false
	if rest, ok := strings.CutPrefix(s, "hang:"); ok {
		s, hang = rest, true
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return 0, false, fmt.Errorf("%w: detection %q: use fast, hang, a positive duration (a kill detected that long after) or hang:DURATION", ErrInvalid, s)
	}
	return d, hang, nil
}

// timeline is a figure's timeline def shortened by Quick and set to
// Duration (a twelfth of it warm-up) when given.
func (c *Command) timeline(def Timeline) Timeline {
	if c.Quick {
		def = QuickTimeline()
	}
	if c.Duration > 0 {
		def.Duration, def.Warmup = c.Duration, c.Duration/12
	}
	return def
}

// replot plots a figure's JSON (Replot) as SVG, or prints its table.
func (c *Command) replot() error {
	data, err := os.ReadFile(c.Replot)
	if err != nil {
		return err
	}
	var named struct {
		Name string `json:"name"`
	}
	if err := json.Unmarshal(data, &named); err == nil && named.Name == LlumnixFigureName {
		var l LlumnixFigure
		if err := json.Unmarshal(data, &l); err != nil {
			return fmt.Errorf("-replot %s: %w", c.Replot, err)
		}
		if c.SVGPath == "" {
			l.Print(c.Out)
			return nil
		}
		return writeSVG(&l, c.SVGPath)
	}
	var f Figure
	if err := json.Unmarshal(data, &f); err != nil {
		return fmt.Errorf("-replot %s: %w", c.Replot, err)
	}
	if f.Name == DegradationFigure {
		var d Degradation
		if err := json.Unmarshal(data, &d); err != nil {
			return fmt.Errorf("-replot %s: %w", c.Replot, err)
		}
		if c.SVGPath == "" {
			d.Print(c.Out)
			return nil
		}
		return writeSVG(&d, c.SVGPath)
	}
	if c.SVGPath == "" {
		f.Print(c.Out)
		return nil
	}
	return writeSVG(&f, c.SVGPath)
}

// writeJSON writes a figure's JSON to JSONPath, when set, and with plot
// its plot next to it.
func (c *Command) writeJSON(v any, plot bool) error {
	if c.JSONPath == "" {
		return nil
	}
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(c.JSONPath, append(data, '\n'), 0o644); err != nil {
		return err
	}
	if plot {
		c.plotNextTo(c.JSONPath)
	}
	return nil
}

// plotNextTo plots path into the same name with .svg (internal/plot); a
// plot that cannot be drawn is said, not fatal.
func (c *Command) plotNextTo(path string) {
	out, err := plot.WriteNextTo(path)
	if err != nil {
		fmt.Fprintf(c.Errs, "plot: %v\n", err)
		return
	}
	fmt.Fprintf(c.Out, "wrote %s\n", out)
}

// writeSVG plots f (a Figure, a Degradation) into path.
func writeSVG(f interface{ WriteSVG(io.Writer) error }, path string) error {
	out, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := f.WriteSVG(out); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// runLlumnix runs -figure llumnix (issue 23): the traces of -trace-mix at
// Llumnix's rates (or -xs, for one trace), -arrivals, -requests a run,
// -workers (16), -max-running (256), -preemption (vllm).
func (c *Command) runLlumnix() error {
	for _, f := range []string{"setups", "duration", "fail", "fail-at", "no-restart", "lambda", "trace", "csv", "load", "profile", "quick", "stress", "seeds", "reload", "detect", "decode-context", "spec-k", "spec-alpha"} {
		if c.Given[f] {
			return fmt.Errorf("-figure %s runs Llumnix's setup (16 × %s, no failure, the context-dependent decode step): -%s does not apply", LlumnixFigureName, LlamaA10.Name, f)
		}
	}
	o := DefaultLlumnixOptions()
	o.Seed, o.Log, o.Progress = c.Seed, c.Out, c.Errs
	if c.TraceMix != "" {
		o.Traces = nil
		for _, t := range strings.Split(c.TraceMix, ",") {
			o.Traces = append(o.Traces, strings.TrimSpace(t))
		}
	}
	if c.PriorityFraction != 0 {
		if c.PriorityFraction < 0 || c.PriorityFraction >= 1 {
			return fmt.Errorf("-priority-fraction %g: must be in [0, 1) (Llumnix's: %g)", c.PriorityFraction, LlumnixPriorityFraction)
		}
		if c.Rates != "llumnix" {
			return fmt.Errorf("-priority-fraction runs at Llumnix's priority rate (or -xs): -rates %s does not apply", c.Rates)
		}
		o.PriorityFraction = c.PriorityFraction
		o.TokenBudget = LlumnixPriorityTokenBudget
		if c.TraceMix == "" {
			o.Traces = []string{"128-128"}
		}
	}
	var err error
	if o.CV, err = ParseArrivals(c.Arrivals); err != nil {
		return err
	}
	if c.Requests < 1 || c.Requests > 1_000_000 {
		return fmt.Errorf("-requests %d: must be in [1, 1000000] (Llumnix's runs: 10000)", c.Requests)
	}
	o.Requests = c.Requests
	if c.Workers > 0 {
		if c.Workers < 2 {
			return fmt.Errorf("-workers %d: the llumnix figure needs at least 2 (Llumnix's: 16)", c.Workers)
		}
		o.Workers = c.Workers
	}
	if c.Given["max-running"] {
		o.MaxRunning = c.MaxRunning
	}
	if c.Given["preemption"] {
		if o.Timing.Preemption, err = core.ParsePreemption(c.Preemption); err != nil {
			return fmt.Errorf("-preemption: %w", err)
		}
	}
	filter, ok := MigrationFilters[c.MigrationPlan]
	if !ok {
		return fmt.Errorf("-migration-plan %q: as-planned (the controller's use of the policy) or no-redispatch (without the policy's re-dispatches of blocked workers' queued requests)", c.MigrationPlan)
	}
	o.Filter = filter
	if c.Given["migration-interval"] {
		if c.MigrationInterval < 10*time.Millisecond || c.MigrationInterval > o.Timing.MigrationTimeout {
			return fmt.Errorf("-migration-interval %s: must be in [10ms, %s] (the controller's: 500ms)", c.MigrationInterval, o.Timing.MigrationTimeout)
		}
		o.Timing.MigrationInterval = c.MigrationInterval
	}
	switch c.Rates {
	case "llumnix":
	case "saturation":
		o.Loads = LlumnixLoads
		for _, x := range c.Xs {
			if x <= 0 || x > 4 {
				return fmt.Errorf("-xs with -rates saturation: load %g must be in (0, 4]", x)
			}
		}
		if len(c.Xs) > 0 {
			o.Loads = c.Xs
		}
	default:
		return fmt.Errorf("-rates %q: llumnix (Llumnix's request rates) or saturation (fractions of the simulated cluster's measured saturated rate)", c.Rates)
	}
	if len(c.Xs) > 0 && len(o.Loads) == 0 {
		if len(o.Traces) != 1 {
			return fmt.Errorf("-xs with -figure %s: the request rates of one trace; -trace-mix names %d", LlumnixFigureName, len(o.Traces))
		}
		for _, x := range c.Xs {
			if x <= 0 {
				return fmt.Errorf("-xs: request rate %g must be > 0", x)
			}
		}
		o.Rates = map[string][]float64{o.Traces[0]: c.Xs}
	}
	f, err := RunLlumnix(o)
	if err != nil {
		return err
	}
	if c.SVGPath != "" {
		if err := writeSVG(f, c.SVGPath); err != nil {
			return err
		}
		fmt.Fprintf(c.Out, "wrote %s\n", c.SVGPath)
	}
	// With -svg the plot is where it says, not also next to the JSON.
	return c.writeJSON(f, c.SVGPath == "")
}
