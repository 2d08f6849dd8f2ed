package sim

import (
	"fmt"
	"io"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/lumen-project/lumen/internal/progress"
	"github.com/lumen-project/lumen/internal/recoverystudy"
	"github.com/lumen-project/lumen/internal/servingstats"
	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/engine"
)

// The comparison's setups, columns, timeline, figures and table are
// internal/recoverystudy's: `lumen bench recovery` runs the same on real
// processes.

// Setup is one cluster shape of the recovery comparison.
type Setup = recoverystudy.Setup

// PrototypeSetups are `lumen bench recovery`'s setups, by the same names.
var PrototypeSetups = recoverystudy.Setups

// Column is one run of the comparison; Progressive is lumen's speculation
// assist (Config.Speculation).
type Column = recoverystudy.Column

// Columns are the benchmark's columns, in the order they run.
var Columns = recoverystudy.Columns

// Timeline is a run's schedule.
type Timeline = recoverystudy.Timeline

// FullTimeline is the benchmark's: 120 s of arrivals, the failure at 30 s,
// TTFT from 10 s; a one-minute calibration.
func FullTimeline() Timeline { return recoverystudy.FullTimeline() }

// QuickTimeline is `-quick`'s.
func QuickTimeline() Timeline { return recoverystudy.QuickTimeline() }

// Gain is a's change relative to b, as a signed percentage.
func Gain(a, b float64) string { return recoverystudy.Gain(a, b) }

// Figures are one column's results: the comparison's figures, under the
// keys of `lumen bench recovery -json`, and the simulator's own.
type Figures struct {
	recoverystudy.Figures
	// Wall-clock p99 of fsm.Apply (0 unless measured).
	ApplyMarkFailedP99Ms float64 `json:"apply_markfailed_p99_ms"`
	ApplyDispatchP99Ms   float64 `json:"apply_dispatch_p99_ms"`
	// Preemptions by recompute over every worker (core.Output).
	Preemptions int `json:"preemptions"`
	// The Raft write stream (issue 26) from the warm-up to the end of the
	// arrivals, per second, by command type (fsm.CommandType, the
	// controller's lumen_controller_fsm_apply_seconds label) and "total":
	// commands (each an entry as the simulator applies them; a leader
	// coalescing concurrent ones writes fewer entries, and fsyncs, than
	// this) and their bytes in the log. LoadReports are the load reports
	// by why they were sent (worker/loadreport.Reason), per second.
	RaftEntriesPerS map[string]float64 `json:"raft_entries_per_s"`
	RaftBytesPerS   map[string]float64 `json:"raft_bytes_per_s"`
	LoadReportsPerS map[string]float64 `json:"load_reports_per_s"`
	// Cells is, with -cells > 1, each cell's part of the Raft write
	// stream over the same span (cells.go); absent for one quorum.
	Cells []CellFigures `json:"cells,omitempty"`

	// Issue 24. RestoredFraction is, of the requests the failure
	// interrupted, those a call restored pages of from a checkpoint store
	// (1 with none interrupted); CheckpointBytesSent the checkpoint bytes
	// the serving workers sent over the run, every copy counted;
	// CheckpointHost* the bytes held in the live workers' checkpoint
	// stores, summed over them: mean and peak over the queue samples.
	RestoredFraction float64 `json:"restored_fraction"`
	// CheckpointLiveFraction is, of the same, those whose recovery plan
	// found a live copy of their checkpoint (what failure domains and
	// replicas keep): restored, or moved off the copy by the plan's own
	// choice (rebalancing a holder with more restores than its share).
	CheckpointLiveFraction float64 `json:"checkpoint_live_fraction"`
	// CheckpointedFraction is, of the same, those whose live copy held at
	// least one page: the requests a restore could serve at all (one
	// queued or not yet through its first page when its worker failed
	// has none). RestoredFraction / CheckpointedFraction is the share of
	// those the recovery restored.
	CheckpointedFraction    float64 `json:"checkpointed_fraction"`
	CheckpointBytesSent     float64 `json:"checkpoint_bytes_sent"`
	CheckpointHostMeanBytes float64 `json:"checkpoint_host_mean_bytes"`
	CheckpointHostPeakBytes float64 `json:"checkpoint_host_peak_bytes"`
	// CheckpointSameDomain and CheckpointReplicasShort count the
	// placements whose first copy had to share the serving worker's node
	// (nothing off it had the budget) and those with fewer copies than
	// asked (lumen_controller_checkpoint_same_domain_total and
	// _replicas_short_total in the cluster).
	CheckpointSameDomain    int `json:"checkpoint_same_domain"`
	CheckpointReplicasShort int `json:"checkpoint_replicas_short"`

	// Speculation, in the lumen column (absent where nothing was
	// drafted). AcceptRate is accepted / verified draft tokens; AssistS
	// the seconds drafters were paired, summed over them; SpecKMean the
	// K of its step per verification row; Verifications the rows that
	// verified drafts.
	AcceptRate     float64 `json:"accept_rate,omitempty"`
	DraftTokens    int     `json:"draft_tokens,omitempty"`
	AcceptedTokens int     `json:"accepted_tokens,omitempty"`
	AssistS        float64 `json:"assist_s,omitempty"`
	Verifications  int     `json:"verifications,omitempty"`
	SpecKMean      float64 `json:"spec_k_mean,omitempty"`
	Drafted        int     `json:"drafted_tokens,omitempty"`
	// The phases of a restart, mean seconds over the restarts that
	// reached full service: LOADING_DRAFT from the registration, ASSIST,
	// HOTSWAP.
	PhaseLoadingDraftS float64 `json:"phase_loading_draft_s,omitempty"`
	PhaseAssistS       float64 `json:"phase_assist_s,omitempty"`
	PhaseHotswapS      float64 `json:"phase_hotswap_s,omitempty"`
	// The paired workers' decode rate, committed tokens/s: while paired;
	// the same workers over the 10 s before the failure; the same
	// workers over the same spans in lumen-no-spec (weighted by the
	// pairings' lengths).
	PairedDecodeTokS       float64 `json:"paired_decode_tok_s,omitempty"`
	PairedDecodeBeforeTokS float64 `json:"paired_decode_before_tok_s,omitempty"`
	PairedDecodeNoSpecTokS float64 `json:"paired_decode_no_spec_tok_s,omitempty"`
	// Dispatch is issue 16's dispatch mode when gateways placed the
	// requests (GatewayMode.Name: "gateways-4", …); absent for the
	// dispatch inside Apply, so that the JSON of those runs is as before.
	Dispatch string `json:"dispatch,omitempty"`
}

// Study is a side-by-side comparison on one setup: a calibration run, then
// every column on the same arrivals.
type Study struct {
	Setup    Setup
	Timeline Timeline
	Seed     uint64
	// Load is the offered load as a fraction of the measured saturated
	// throughput (0.7 in the benchmark).
	Load   float64
	Lambda float64
	// NoRestart leaves the failed workers down.
	NoRestart bool
	// Saturated, when > 0, is the setup's saturated throughput measured
	// before (requests/s): the calibration run is skipped.
	// CalibrationWorkers, when > 0 and below the setup's workers,
	// calibrates on a cluster of that many and scales the rate to the
	// setup's (as the cells figure does): a calibration at 10,000 workers
	// costs as much as a column.
	Saturated          float64
	CalibrationWorkers int
	Timing             Timing
	MeasureApply       bool
	// Log receives progress lines and the table (nil: nothing).
	Log io.Writer
	// Series, when set, receives each column's time series as CSV rows
	// (WriteSeries).
	Series io.Writer
	// Trace, when set, replaces the Azure-shaped generator: its arrivals,
	// rescaled in time to the offered rate (workload.ReadAzureTrace, workload.Rescale).
	Trace []workload.Request
	// Spec is the lumen column's speculation (its Seed is the study's
	// unless SpecSeed is set).
	Spec SpecOptions
	// SpecSeed, when > 0, seeds the draft-agreement draws instead of
	// Seed: the same arrivals with other luck in the speculation, which
	// perturbs every speculating column's trajectory alike.
	SpecSeed uint64
	// Migration turns live migration on in every column (not in the
	// calibration: the saturated throughput is the cluster's without it).
	Migration bool
	// Meter, when set, counts the columns run (internal/progress), a
	// column's requests done as a fraction.
	Meter *progress.Meter
	// Gateways and GatewayChoice are every column's dispatch
	// (Config.Gateways; not the calibration's, which is Apply's).
	Gateways      int
	GatewayChoice GatewayChoice
	// PrefixRouting turns on every column's prefix caches and
	// prefix-aware placement (Config.PrefixCache, PrefixRouting).
	PrefixRouting bool
	// Cells is every column's cells (Config.Cells; not the
	// calibration's, which is one quorum's).
	Cells int
	// Failure domains and replication (issue 24; Config.GPUsPerNode,
	// DomainBlind, CheckpointReplicas): with GPUsPerNode > 0 the failure
	// kills every worker of nodes 1 … FailNodes, and Setup.Failures more
	// workers drawn at random (from the seed, the same in every column)
	// among the others; without, worker-1 … worker-Setup.Failures.
	GPUsPerNode        int
	FailNodes          int
	DomainBlind        bool
	CheckpointReplicas int
	// Only, when set, names the columns to run (of Columns, in their
	// order); empty: all of them. A failed column needs its reference
	// (Column.Ref) and lumen its ablation, lumen-no-spec; the table is
	// printed only for all of them.
	Only []string
	// StepTrace records the lumen and lumen-no-spec columns' steps and
	// admissions (Config.StepTrace) and prints where the TTFT of the
	// requests arriving while drafters assist goes (SpecTraceReport).
	StepTrace bool
	// TraceDir, when set, traces every column and writes each traced
	// run's requests and steps there as CSV (WriteSpecTrace).
	TraceDir string
}

// columns are the columns Run runs: Columns, or those Only names.
func (st *Study) columns() ([]Column, error) {
	if len(st.Only) == 0 {
		return Columns, nil
	}
	known := map[string]bool{}
	var names []string
	for _, col := range Columns {
		known[col.Name] = true
		names = append(names, col.Name)
	}
	named := map[string]bool{}
	for _, name := range st.Only {
		if !known[name] {
			return nil, fmt.Errorf("%w: column %q: use one of %s", ErrInvalid, name, strings.Join(names, ", "))
		}
		named[name] = true
	}
	var out []Column
	for _, col := range Columns {
		if !named[col.Name] {
			continue
		}
		if col.Ref != "" && !named[col.Ref] {
			return nil, fmt.Errorf("%w: column %s is measured against %s: run both", ErrInvalid, col.Name, col.Ref)
		}
		if col.Progressive && !named["lumen-no-spec"] {
			return nil, fmt.Errorf("%w: column %s's figures compare it with lumen-no-spec: run both", ErrInvalid, col.Name)
		}
		out = append(out, col)
	}
	return out, nil
}

// arrivals returns the requests of a run at rate for d: from the trace
// when there is one, else generated.
func (st *Study) arrivals(seed uint64, rate float64, d time.Duration) ([]workload.Request, error) {
	if len(st.Trace) > 0 {
		reqs := workload.Rescale(st.Trace, rate, d)
		if len(reqs) == 0 {
			return nil, fmt.Errorf("%w: no arrival of the trace falls in %s", workload.ErrTrace, d)
		}
		return reqs, nil
	}
	return workload.GenerateLazy(workload.Config{Seed: seed, Rate: rate, Duration: d, Trace: workload.AzureConversation})
}

func (st *Study) logf(format string, args ...any) {
	if st.Log != nil {
		fmt.Fprintf(st.Log, format, args...)
	}
}

func (st *Study) config(p engine.Profile, strategy policy.Strategy, reqs []workload.Request) Config {
	timing := st.Timing
	timing.ReloadScale *= st.Timeline.ReloadScale
	spec := st.Spec
	spec.Seed = st.Seed
	if st.SpecSeed > 0 {
		spec.Seed = st.SpecSeed
	}
	return Config{GPUsPerNode: st.GPUsPerNode, DomainBlind: st.DomainBlind, CheckpointReplicas: st.CheckpointReplicas,
		Workers: st.Setup.Workers, Profile: p, Strategy: strategy, Lambda: st.Lambda,
		TokenBudget: st.Setup.StepTokens(), MaxRunning: st.Setup.MaxRunning, MaxWaiting: 4096, CheckpointBudget: st.Setup.Budget, KVPages: st.Setup.KVPages,
		Arrivals: reqs, Timing: timing, MeasureApply: st.MeasureApply, Spec: spec,
		RaftFrom: st.Timeline.Warmup, RaftTo: st.Timeline.Duration,
		PrefixCache: st.PrefixRouting, PrefixRouting: st.PrefixRouting && st.Gateways == 0}
}

// Calibrate measures the setup's saturated throughput in requests per
// second as the benchmark does: arrivals at twice the modelled capacity for
// the calibration time, the output tokens delivered over its second half,
// divided by the mean output length.
func (st *Study) Calibrate() (saturated, modelled float64, err error) {
	p, ok, err := engine.LookupProfile(st.Setup.Profile)
	if err != nil || !ok {
		return 0, 0, fmt.Errorf("sim: setup %s: profile %q: %w", st.Setup.Name, st.Setup.Profile, err)
	}
	tr := workload.AzureConversation
	per, _ := p.SaturatedRate(st.Setup.MaxRunning, tr.Prompt.Mean(), tr.Output.Mean())
	modelled = per * float64(st.Setup.Workers)
	d := st.Timeline.Calibration
	reqs, err := st.arrivals(st.Seed+1000, 2*modelled, d)
	if err != nil {
		return 0, 0, err
	}
	cfg := st.config(p, policy.Lumen, reqs)
	// The offered load is a fraction of the cluster's throughput with one
	// copy, domain-aware: runs that differ only in their replicas or
	// domain mode get the same arrivals.
	cfg.CheckpointReplicas, cfg.DomainBlind = 0, false
	cfg.StopAt = d
	res, err := Run(cfg)
	if err != nil {
		return 0, 0, fmt.Errorf("calibration: %w", err)
	}
	return float64(res.CalibrationTokens) / (d / 2).Seconds() / tr.Output.Mean(), modelled, nil
}

// Run runs the study: calibration, then the columns. It returns the
// figures by column name.
func (st *Study) Run() (map[string]*Figures, error) {
	p, ok, err := engine.LookupProfile(st.Setup.Profile)
	if err != nil || !ok {
		return nil, fmt.Errorf("sim: setup %s: profile %q: %w", st.Setup.Name, st.Setup.Profile, err)
	}
	if st.Load <= 0 {
		return nil, fmt.Errorf("%w: load %g must be > 0", ErrInvalid, st.Load)
	}
	cols, err := st.columns()
	if err != nil {
		return nil, err
	}
	tr := workload.AzureConversation
	_, batch := p.SaturatedRate(st.Setup.MaxRunning, tr.Prompt.Mean(), tr.Output.Mean())
	tm := st.Timeline
	st.logf("== %s: %d workers simulated as %s, batch up to %d, %d of them killed at %s, dispatch %s\n",
		st.Setup.Name, st.Setup.Workers, st.Setup.Profile, batch, st.Setup.Failures, tm.FailAt, GatewayMode{Gateways: st.Gateways, Choice: st.GatewayChoice}.Name())
	saturated, modelled := st.Saturated, 0.0
	if cw := st.CalibrationWorkers; saturated <= 0 && cw > 0 && cw < st.Setup.Workers {
		small := *st
		small.Setup.Workers = cw
		if saturated, modelled, err = small.Calibrate(); err != nil {
			return nil, err
		}
		scale := float64(st.Setup.Workers) / float64(cw)
		saturated, modelled = saturated*scale, modelled*scale
		st.logf("   calibrated on %d workers, scaled to %d\n", cw, st.Setup.Workers)
	} else if saturated <= 0 {
		if saturated, modelled, err = st.Calibrate(); err != nil {
			return nil, err
		}
	} else {
		per, _ := p.SaturatedRate(st.Setup.MaxRunning, tr.Prompt.Mean(), tr.Output.Mean())
		modelled = per * float64(st.Setup.Workers)
	}
	rate := st.Load * saturated
	reqs, err := st.arrivals(st.Seed, rate, tm.Duration)
	if err != nil {
		return nil, err
	}
	st.logf("   saturated, the cluster completes %.2f requests/s (the model said %.2f); the workload offers %.0f%% of that:\n",
		saturated, modelled, 100*st.Load)
	if len(st.Trace) > 0 {
		st.logf("   %d requests of the trace, rescaled to %.2f/s over %s\n", len(reqs), rate, tm.Duration)
	} else {
		st.logf("   %d requests, Poisson %.2f/s over %s, %s lengths, seed %d\n", len(reqs), rate, tm.Duration, tr.Name, st.Seed)
	}
	failed, err := st.FailedWorkers()
	if err != nil {
		return nil, err
	}
	if st.GPUsPerNode > 0 {
		st.logf("   %d workers a node; killed together: %s\n", st.GPUsPerNode, workerNames(failed))
	}
	results := map[string]*Result{}
	for _, col := range cols {
		cfg := st.config(p, col.Strategy, reqs)
		cfg.Speculation = col.Progressive
		cfg.Oracle = col.Oracle
		cfg.Migration = st.Migration
		cfg.Gateways, cfg.GatewayChoice = st.Gateways, st.GatewayChoice
		cfg.Cells = st.Cells
		// The decode rates of the paired workers, with and without
		// speculation, come from the token series.
		cfg.TokenSeries = col.Strategy == policy.Lumen && col.Fail
		cfg.StepTrace = st.TraceDir != "" || st.StepTrace && (col.Name == "lumen" || col.Name == "lumen-no-spec")
		if col.Fail {
			for _, i := range failed {
				cfg.Failures = append(cfg.Failures, Failure{Worker: i, At: tm.FailAt, Restart: !st.NoRestart})
			}
		}
		base := st.Meter.Done()
		if st.Log != nil || st.Meter != nil {
			name := col.Name
			cfg.Progress = func(now time.Duration, done, total int) {
				if st.Log != nil && now%(60*time.Second) < 10*time.Second {
					st.logf("   %s/%s: t=%4.0fs  %d of %d requests done\n", st.Setup.Name, name, now.Seconds(), done, total)
				}
				if total > 0 {
					st.Meter.Set(base+float64(done)/float64(total), st.Setup.Name+" / "+name)
				}
			}
		}
		start := time.Now()
		res, err := Run(cfg)
		if err != nil {
			return nil, fmt.Errorf("%s/%s: %w", st.Setup.Name, col.Name, err)
		}
		wall := time.Since(start)
		st.logf("-- %s / %-24s %8d events in %6.2fs of wall time (%.0f events/s), %s simulated\n", st.Setup.Name, col.Name,
			res.Events, wall.Seconds(), float64(res.Events)/wall.Seconds(), res.End.Round(time.Millisecond))
		results[col.Name] = res
		st.Meter.Set(base+1, st.Setup.Name+" / "+col.Name+" done")
	}
	rule := servingstats.DefaultRecoveryRule(rate, p.StepTime(batch, 0))
	figs := map[string]*Figures{}
	common := map[string]*recoverystudy.Figures{}
	runs := map[string]*recoverystudy.Run{}
	for _, col := range cols {
		res := results[col.Name]
		f := &Figures{}
		common[col.Name] = &f.Figures
		runs[col.Name] = &recoverystudy.Run{Records: res.Records, Queue: res.Queue, FailAt: res.FailAt, End: res.End, Recoveries: res.Recoveries}
		f.ArrivalRatePerSec, f.SaturatedPerSec = rate, saturated
		if st.Gateways > 0 {
			f.Dispatch = GatewayMode{Gateways: st.Gateways, Choice: st.GatewayChoice}.Name()
		}
		f.Latencies(res.Records, tm.Warmup, tm.FailAt)
		f.Resumes(res.Resumes)
		f.Interrupted = res.Interrupted
		// Pages a resume found in the target's prefix cache are reused
		// too (0 with the cache off).
		f.PagesReused, f.TokensRecomputed = float64(res.RestoredPages+res.ResumeCachedPages), float64(res.RecomputedTokens)
		f.Preemptions = res.Preemptions
		f.RestoredFraction, f.CheckpointLiveFraction, f.CheckpointedFraction = 1, 1, 1
		if res.Interrupted > 0 {
			f.RestoredFraction = float64(res.Restored) / float64(res.Interrupted)
			f.CheckpointLiveFraction = float64(res.LiveCopy) / float64(res.Interrupted)
			f.CheckpointedFraction = float64(res.Checkpointed) / float64(res.Interrupted)
		}
		f.CheckpointBytesSent = float64(res.CheckpointBytesSent)
		f.CheckpointSameDomain, f.CheckpointReplicasShort = int(res.SameDomain), int(res.ShortReplicas)
		for _, b := range res.CheckpointHostBytes {
			f.CheckpointHostMeanBytes += float64(b) / float64(len(res.CheckpointHostBytes))
			f.CheckpointHostPeakBytes = max(f.CheckpointHostPeakBytes, float64(b))
		}
		f.ApplyDispatchP99Ms = servingstats.Percentile(res.ApplyDispatch, 0.99)
		f.ApplyMarkFailedP99Ms = servingstats.Percentile(res.ApplyMarkFailed, 0.99)
		f.raftFigures(res, tm.Duration-tm.Warmup)
		if col.Fail {
			f.PlanMs = float64(res.PlanAt-res.FailAt) / 1e6
		}
		if col.Progressive {
			specFigures(f, res, results["lumen-no-spec"], tm.FailAt)
		}
		figs[col.Name] = f
	}
	recoverystudy.FailureFigures(common, runs, rule)
	if st.StepTrace && results["lumen"] != nil && st.Log != nil {
		SpecTraceReport(st.Log, results["lumen"], results["lumen-no-spec"], tm.Warmup)
	}
	if st.TraceDir != "" {
		for _, col := range cols {
			path := filepath.Join(st.TraceDir, fmt.Sprintf("%s-%d-seed%d-%s", st.Setup.Name, st.Setup.Workers, st.Seed, col.Name))
			if err := WriteSpecTrace(path, results[col.Name]); err != nil {
				return nil, err
			}
		}
	}
	if st.Series != nil {
		for _, col := range cols {
			if err := WriteSeries(st.Series, st.Setup.Name, col.Name, results[col.Name], time.Second); err != nil {
				return nil, err
			}
		}
	}
	if st.Log != nil && len(cols) == len(Columns) {
		t := recoverystudy.Table{Setup: st.Setup, Note: "simulated", Figures: common, Rule: rule,
			Rows: []recoverystudy.Row{
				{Name: "Apply(MarkFailed) p99 ms", Cell: func(c string) string { return fmt.Sprintf("%.3f", figs[c].ApplyMarkFailedP99Ms) }},
				{Name: "Apply(Dispatch) p99 ms", Cell: func(c string) string { return fmt.Sprintf("%.3f", figs[c].ApplyDispatchP99Ms) }},
				{Name: "preemptions", Cell: func(c string) string { return fmt.Sprintf("%d", figs[c].Preemptions) }},
				{Name: "Raft commands/s (load reports)", Cell: func(c string) string {
					return fmt.Sprintf("%.0f (%.0f)", figs[c].RaftEntriesPerS["total"], figs[c].RaftEntriesPerS["report_load"])
				}},
			}}
		t.Print(st.Log)
		PrintSpec(st.Log, figs["lumen"])
		rejoin := time.Duration(-1)
		if !st.NoRestart {
			// The reload as the run took it: after the detection of a
			// hang, at the kill otherwise.
			lp, _ := p.WithReload(st.Timing.Reload)
			rejoin = tm.FailAt + time.Duration(float64(lp.LoadTime())*st.Timing.ReloadScale*tm.ReloadScale)
			if st.Timing.Hang {
				rejoin += st.Timing.DetectDelay
			}
		}
		for _, col := range cols {
			if col.Fail {
				a := Attribute(results[col.Name], results[col.Ref], tm.Warmup, tm.FailAt, rejoin)
				st.logf("where %s's TTFT goes, ms above %s per request: %s\n", col.Name, col.Ref, a)
			}
		}
		st.logf("\n")
	}
	return figs, nil
}

// FailedWorkers are the indices of the workers the failure kills
// (FailNodes, GPUsPerNode), in order.
func (st *Study) FailedWorkers() ([]int, error) {
	n, k := st.Setup.Workers, st.Setup.Failures
	if st.GPUsPerNode <= 0 {
		if st.FailNodes > 0 {
			return nil, fmt.Errorf("%w: %d failed nodes without nodes: give GPUsPerNode (-gpus-per-node)", ErrInvalid, st.FailNodes)
		}
		out := make([]int, k)
		for i := range out {
			out[i] = i
		}
		return out, nil
	}
	onNodes := min(st.FailNodes*st.GPUsPerNode, n)
	if st.FailNodes < 0 || onNodes+k > n-1 {
		return nil, fmt.Errorf("%w: %d failed nodes of %d workers and %d more workers leave none of the %d to recover on",
			ErrInvalid, st.FailNodes, st.GPUsPerNode, k, n)
	}
	out := make([]int, 0, onNodes+k)
	for i := range onNodes {
		out = append(out, i)
	}
	// The others at random, from the seed: a partial Fisher–Yates
	// shuffle of the workers off the failed nodes, by splitmix64.
	rest := make([]int, 0, n-onNodes)
	for i := onNodes; i < n; i++ {
		rest = append(rest, i)
	}
	x := st.Seed*0x9e3779b97f4a7c15 + 0x24
	next := func() uint64 {
		x += 0x9e3779b97f4a7c15
		z := x
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		return z ^ z>>31
	}
	for j := range k {
		r := j + int(next()%uint64(len(rest)-j))
		rest[j], rest[r] = rest[r], rest[j]
	}
	picked := append([]int(nil), rest[:k]...)
	sort.Ints(picked)
	return append(out, picked...), nil
}

func workerNames(idx []int) string {
	var b strings.Builder
	for k, i := range idx {
		if k > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "worker-%d", i+1)
	}
	return b.String()
}

// raftFigures sets the Raft write stream's figures from a run's counts
// over span.
func (f *Figures) raftFigures(res *Result, span time.Duration) {
	f.RaftEntriesPerS, f.RaftBytesPerS, f.LoadReportsPerS = map[string]float64{}, map[string]float64{}, map[string]float64{}
	sec := span.Seconds()
	if sec <= 0 {
		return
	}
	var total RaftCount
	for typ, rc := range res.Raft {
		f.RaftEntriesPerS[typ] = float64(rc.Commands) / sec
		f.RaftBytesPerS[typ] = float64(rc.Bytes) / sec
		total.Commands += rc.Commands
		total.Bytes += rc.Bytes
	}
	f.RaftEntriesPerS["total"], f.RaftBytesPerS["total"] = float64(total.Commands)/sec, float64(total.Bytes)/sec
	for r, n := range res.LoadReports {
		f.LoadReportsPerS[string(r)] = float64(n) / sec
	}
	f.Cells = cellFigures(res, span)
}

// Attribution splits a failed run's mean TTFT excess over its failure-free
// reference (the same arrivals) by when the requests arrived: before the
// failure, between the failure and the failed workers' rejoin (the
// capacity is short), in the 10 s after the rejoin, and later. Each part
// is the sum of the per-request differences over the requests counted
// (those arriving after the warm-up), so the parts add up to the
// difference of the two means.
type Attribution struct {
	Before, Down, AfterRejoin, Later float64 // ms per request
	Requests                         int
}

// String says the parts in words.
func (a Attribution) String() string {
	return fmt.Sprintf("before the failure %+.1f, failure to rejoin %+.1f, first 10 s after the rejoin %+.1f, later %+.1f (%d requests)",
		a.Before, a.Down, a.AfterRejoin, a.Later, a.Requests)
}

// Attribute computes the Attribution of run against ref. rejoin < 0: the
// failed workers never came back.
func Attribute(run, ref *Result, warmup, failAt, rejoin time.Duration) Attribution {
	var a Attribution
	var sums [4]time.Duration
	for i, r := range run.Records {
		if r.Arrival < warmup || r.Err != nil || ref.Records[i].Err != nil {
			continue
		}
		d1, ok1 := r.TTFT()
		d0, ok0 := ref.Records[i].TTFT()
		if !ok1 || !ok0 {
			continue
		}
		a.Requests++
		k := 3
		switch {
		case r.Arrival < failAt:
			k = 0
		case rejoin < 0 || r.Arrival < rejoin:
			k = 1
		case r.Arrival < rejoin+10*time.Second:
			k = 2
		}
		sums[k] += d1 - d0
	}
	if a.Requests == 0 {
		return a
	}
	per := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) / float64(a.Requests) }
	a.Before, a.Down, a.AfterRejoin, a.Later = per(sums[0]), per(sums[1]), per(sums[2]), per(sums[3])
	return a
}

// ParseSetups resolves a comma-separated list of prototype setup names.
func ParseSetups(list string) ([]Setup, error) {
	out, err := recoverystudy.ParseSetups(list)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return out, nil
}

// SeriesHeader is the header of WriteSeries' CSV rows.
const SeriesHeader = "setup,column,t_s,arrivals,ttft_mean_ms,waiting_mean\n"

// WriteSeries writes a run's time series as CSV rows, one per bin: the
// requests that arrived in it, their mean TTFT, and the mean number of
// requests waiting at live workers.
func WriteSeries(w io.Writer, setup, column string, res *Result, bin time.Duration) error {
	n := int(res.End/bin) + 1
	ttft := make([]time.Duration, n)
	arrivals := make([]int, n)
	queue := make([]float64, n)
	samples := make([]int, n)
	for _, r := range res.Records {
		k := int(r.Arrival / bin)
		if d, ok := r.TTFT(); ok && k < n {
			ttft[k] += d
			arrivals[k]++
		}
	}
	for _, q := range res.Queue {
		if k := int(q.At / bin); k < n {
			queue[k] += q.Waiting
			samples[k]++
		}
	}
	for k := range n {
		mean, wait := 0.0, 0.0
		if arrivals[k] > 0 {
			mean = float64(ttft[k]) / float64(time.Millisecond) / float64(arrivals[k])
		}
		if samples[k] > 0 {
			wait = queue[k] / float64(samples[k])
		}
		if _, err := fmt.Fprintf(w, "%s,%s,%g,%d,%.1f,%.1f\n", setup, column, (time.Duration(k) * bin).Seconds(), arrivals[k], mean, wait); err != nil {
			return err
		}
	}
	return nil
}
