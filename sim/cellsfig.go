package sim

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/metrics"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/engine"
)

// The cells figure (issue 26, `lumen sim -figure cells`): the same
// Poisson arrivals at the Azure lengths, failure-free, lumen, placed by
// the same gateways over the cluster as one quorum and as several cells
// (cells.go); TTFT against one quorum's, each cell's Raft write stream
// against one quorum's measured capacity, and the simulator's own cost
// (wall time, events, peak memory).

// CellsFigureName is the figure's -figure name.
const CellsFigureName = "cells"

// QuorumPlacementsPerS is one quorum's measured supply: placements
// committed a second by `lumen bench controller` at 256 callers, 3
// replicas on this machine's 2 cores, quiet (a8cb199, docs/benchmarks.md);
// LoadedQuorumPlacementsPerS the same with five other sessions loading
// the machine.
const (
	QuorumPlacementsPerS       = 42358
	LoadedQuorumPlacementsPerS = 14409
)

// CellsOptions are the figure's parameters.
type CellsOptions struct {
	// Workers is the cluster, every run's; Cells the cell counts run, on
	// the same arrivals (the first is the baseline the others' TTFT is
	// compared with; 1 is one quorum).
	Workers int
	Cells   []int
	// Gateways and Choice are every run's dispatch.
	Gateways int
	Choice   GatewayChoice
	Load     float64
	// CalibrationWorkers: the saturated throughput is measured on a
	// cluster of that many (Study.Calibrate, one quorum, the dispatch
	// inside Apply) and scaled to Workers: at 64 and 1,024 workers the
	// measured rate per worker is within 0.6% (6.36 and 6.33 requests/s,
	// docs/benchmarks.md, issue 26), and a calibration at 10,000 workers
	// would cost more than the runs. Saturated > 0 (requests/s for
	// Workers) skips it.
	CalibrationWorkers int
	Saturated          float64
	Profile            string
	MaxRunning         int
	Budget             uint64
	Timeline           Timeline
	Seed               uint64
	// GoalPct is the TTFT goal: cells' mean at most this much above the
	// baseline's (2).
	GoalPct float64
	Timing  Timing
	Log     io.Writer
}

// DefaultCellsOptions: 1,024 Qwen3-14B/H100 workers, batches of 32, 70%
// load, 1 against 4 cells, 4 gateways choosing by partition-fill (what
// lumen's gateways run), 60 s of arrivals (TTFT and the Raft stream from
// 5 s), calibrated on 64 workers, seed 1.
func DefaultCellsOptions() CellsOptions {
	return CellsOptions{Workers: 1024, Cells: []int{1, 4}, Gateways: 4, Choice: ChoosePartitionFill, Load: 0.7, CalibrationWorkers: 64,
		Profile: "qwen3-14b-h100", MaxRunning: 32, Budget: 80e9,
		Timeline: Timeline{Warmup: 5 * time.Second, Duration: 60 * time.Second, Calibration: 30 * time.Second, ReloadScale: 1},
		Seed:     1, GoalPct: 2, Timing: DefaultTiming()}
}

// CellFigures are one cell's Raft write stream, per second, by command
// type and "total" (Figures.RaftEntriesPerS's keys).
type CellFigures struct {
	Workers         int                `json:"workers"`
	Placed          int                `json:"placed"`
	RaftEntriesPerS map[string]float64 `json:"raft_entries_per_s"`
	RaftBytesPerS   map[string]float64 `json:"raft_bytes_per_s"`
}

// cellFigures are a run's cells' figures over span (nil for one quorum).
func cellFigures(res *Result, span time.Duration) []CellFigures {
	if len(res.Cells) == 0 || span <= 0 {
		return nil
	}
	sec := span.Seconds()
	out := make([]CellFigures, len(res.Cells))
	for i, c := range res.Cells {
		f := CellFigures{Workers: c.Workers, Placed: c.Placed, RaftEntriesPerS: map[string]float64{}, RaftBytesPerS: map[string]float64{}}
		var total RaftCount
		for typ, rc := range c.Raft {
			f.RaftEntriesPerS[typ] = float64(rc.Commands) / sec
			f.RaftBytesPerS[typ] = float64(rc.Bytes) / sec
			total.Commands += rc.Commands
			total.Bytes += rc.Bytes
		}
		f.RaftEntriesPerS["total"], f.RaftBytesPerS["total"] = float64(total.Commands)/sec, float64(total.Bytes)/sec
		out[i] = f
	}
	return out
}

// CellsRun is one cell count's figures.
type CellsRun struct {
	Cells          int     `json:"cells"`
	TTFTMeanMs     float64 `json:"ttft_mean_ms"`
	TTFTP99Ms      float64 `json:"ttft_p99_ms"`
	ThroughputTokS float64 `json:"throughput_tok_s"`
	QueueMean      float64 `json:"queue_mean"`
	// Against the baseline (the first cell count): TTFT mean and p99,
	// percent (positive: worse), and whether the mean is within the goal.
	TTFTMeanVsBasePct float64 `json:"ttft_mean_vs_base_pct"`
	TTFTP99VsBasePct  float64 `json:"ttft_p99_vs_base_pct"`
	WithinGoal        bool    `json:"within_goal"`
	// The whole stream, and each cell's (absent for one quorum), per
	// second from the warm-up to the end of the arrivals.
	RaftEntriesPerS map[string]float64 `json:"raft_entries_per_s"`
	RaftBytesPerS   map[string]float64 `json:"raft_bytes_per_s"`
	CellRaft        []CellFigures      `json:"cell_raft,omitempty"`
	// The busiest cell's (the whole cluster's for one quorum) Dispatches a
	// second, and one quorum's measured capacity over it, quiet and
	// loaded (QuorumPlacementsPerS, LoadedQuorumPlacementsPerS).
	MaxCellDispatchPerS float64 `json:"max_cell_dispatch_per_s"`
	MaxCellTotalPerS    float64 `json:"max_cell_commands_per_s"`
	HeadroomQuiet       float64 `json:"headroom_quiet"`
	HeadroomLoaded      float64 `json:"headroom_loaded"`
	// The simulator's cost: wall seconds, events, the process's peak
	// resident memory over the run (VmHWM, reset before it where the
	// kernel allows; else the process's peak so far), and wall seconds a
	// simulated second from the warm-up to the end of the arrivals.
	WallS          float64 `json:"wall_s"`
	Events         uint64  `json:"events"`
	PeakRSSBytes   uint64  `json:"peak_rss_bytes"`
	PeakRSSIsReset bool    `json:"peak_rss_reset"`
	WallPerSimS    float64 `json:"wall_s_per_simulated_s"`
	SimulatedS     float64 `json:"simulated_s"`
	// CPU seconds (user + system, every thread: the garbage collector's
	// too) of the run, and a simulated second from the warm-up to the end
	// of the arrivals: on a shared machine steadier than the wall time.
	CPUS       float64 `json:"cpu_s"`
	CPUPerSimS float64 `json:"cpu_s_per_simulated_s"`
	// HeapLivePeak is the greatest live heap the garbage collector
	// marked (runtime/metrics /gc/heap/live:bytes), read every simulated
	// second: what the run holds, without the collector's headroom.
	HeapLivePeak uint64 `json:"heap_live_peak_bytes"`
}

// CellsFigure is the figure's result.
type CellsFigure struct {
	Name               string     `json:"name"`
	Profile            string     `json:"profile"`
	Workers            int        `json:"workers"`
	Gateways           int        `json:"gateways"`
	Choice             string     `json:"choice"`
	Load               float64    `json:"load"`
	MaxRunning         int        `json:"max_running"`
	DurationS          float64    `json:"duration_s"`
	WarmupS            float64    `json:"warmup_s"`
	Seed               uint64     `json:"seed"`
	CalibrationWorkers int        `json:"calibration_workers"`
	SaturatedPerSec    float64    `json:"saturated_rate_per_s"`
	RatePerSec         float64    `json:"arrival_rate_per_s"`
	Requests           int        `json:"requests"`
	GoalPct            float64    `json:"goal_pct"`
	QuorumPlacements   float64    `json:"quorum_placements_per_s"`
	LoadedPlacements   float64    `json:"loaded_quorum_placements_per_s"`
	Runs               []CellsRun `json:"runs"`
}

// RunCells runs the cells figure.
func RunCells(o CellsOptions) (*CellsFigure, error) {
	p, ok, err := engine.LookupProfile(o.Profile)
	if err != nil || !ok {
		return nil, fmt.Errorf("%w: profile %q: %v", ErrInvalid, o.Profile, err)
	}
	if o.Load <= 0 || o.Workers < 2 || len(o.Cells) == 0 || o.Gateways < 1 {
		return nil, fmt.Errorf("%w: the cells figure needs a load > 0 (%g), at least 2 workers (%d), a cell count (%v) and a gateway (%d)",
			ErrInvalid, o.Load, o.Workers, o.Cells, o.Gateways)
	}
	for _, n := range o.Cells {
		if n < 1 || o.Workers%n != 0 {
			return nil, fmt.Errorf("%w: %d cells of %d workers: a cell count must be >= 1 and divide the workers", ErrInvalid, n, o.Workers)
		}
	}
	tm := o.Timeline
	f := &CellsFigure{Name: CellsFigureName, Profile: o.Profile, Workers: o.Workers, Gateways: o.Gateways, Choice: o.Choice.String(), Load: o.Load,
		MaxRunning: o.MaxRunning, DurationS: tm.Duration.Seconds(), WarmupS: tm.Warmup.Seconds(), Seed: o.Seed,
		GoalPct: o.GoalPct, QuorumPlacements: QuorumPlacementsPerS, LoadedPlacements: LoadedQuorumPlacementsPerS}
	setup := func(n int) Setup {
		return Setup{Name: fmt.Sprintf("cells-%d", n), Workers: n, Profile: o.Profile, MaxRunning: o.MaxRunning, Budget: o.Budget}
	}
	st := Study{Setup: setup(o.Workers), Timeline: tm, Seed: o.Seed, Timing: o.Timing}
	sat := o.Saturated
	if sat <= 0 {
		cw := min(max(o.CalibrationWorkers, 1), o.Workers)
		cal := Study{Setup: setup(cw), Timeline: tm, Seed: o.Seed, Timing: o.Timing}
		s, _, err := cal.Calibrate()
		if err != nil {
			return nil, err
		}
		sat = s * float64(o.Workers) / float64(cw)
		f.CalibrationWorkers = cw
	}
	rate := o.Load * sat
	reqs, err := workload.GenerateLazy(workload.Config{Seed: o.Seed, Rate: rate, Duration: tm.Duration, Trace: workload.AzureConversation})
	if err != nil {
		return nil, err
	}
	f.SaturatedPerSec, f.RatePerSec, f.Requests = sat, rate, len(reqs)
	if o.Log != nil {
		fmt.Fprintf(o.Log, "   cells: %d workers, saturated %.1f requests/s (calibrated on %d workers, scaled), offered %.1f/s, %d requests over %s\n",
			o.Workers, sat, f.CalibrationWorkers, rate, len(reqs), tm.Duration)
	}
	for _, n := range o.Cells {
		cfg := st.config(p, policy.Lumen, reqs)
		cfg.Gateways, cfg.GatewayChoice, cfg.Cells = o.Gateways, o.Choice, n
		start, startCPU := time.Now(), cpuTime()
		var warmWall time.Time
		var warmAt, lastAt time.Duration
		var lastWall time.Time
		var warmCPU, lastCPU time.Duration
		cfg.ProgressEvery = time.Second
		var livePeak uint64
		nextLog := 10 * time.Second
		cfg.Progress = func(now time.Duration, done, total int) {
			livePeak = max(livePeak, heapLive())
			if warmWall.IsZero() && now >= tm.Warmup {
				warmWall, warmAt, warmCPU = time.Now(), now, cpuTime()
			}
			if now <= tm.Duration {
				lastWall, lastAt, lastCPU = time.Now(), now, cpuTime()
			}
			if o.Log != nil && now >= nextLog {
				nextLog += 10 * time.Second
				fmt.Fprintf(o.Log, "   cells-%d: t=%4.0fs  %d of %d requests done, %.0fs of wall time, %.0f CPU s, %.2f GB peak, %.2f GB live heap\n", n, now.Seconds(), done, total,
					time.Since(start).Seconds(), (cpuTime() - startCPU).Seconds(), float64(peakRSS())/1e9, float64(heapLive())/1e9)
			}
		}
		reset := resetPeakRSS()
		runtime.GC()
		res, err := Run(cfg)
		if err != nil {
			return nil, fmt.Errorf("cells figure, %d workers as %d cells: %w", o.Workers, n, err)
		}
		bf := burstFigures(res, tm)
		r := CellsRun{Cells: n, TTFTMeanMs: bf.TTFTMeanMs, TTFTP99Ms: bf.TTFTP99Ms, ThroughputTokS: bf.ThroughputTokS, QueueMean: bf.QueueMean,
			WallS: time.Since(start).Seconds(), Events: res.Events, PeakRSSBytes: peakRSS(), PeakRSSIsReset: reset, SimulatedS: res.End.Seconds(),
			CPUS: (cpuTime() - startCPU).Seconds(), HeapLivePeak: max(livePeak, heapLive())}
		if lastAt > warmAt {
			r.WallPerSimS = lastWall.Sub(warmWall).Seconds() / (lastAt - warmAt).Seconds()
			r.CPUPerSimS = (lastCPU - warmCPU).Seconds() / (lastAt - warmAt).Seconds()
		}
		var fig Figures
		fig.raftFigures(res, tm.Duration-tm.Warmup)
		r.RaftEntriesPerS, r.RaftBytesPerS, r.CellRaft = fig.RaftEntriesPerS, fig.RaftBytesPerS, fig.Cells
		r.MaxCellDispatchPerS, r.MaxCellTotalPerS = r.RaftEntriesPerS["dispatch"], r.RaftEntriesPerS["total"]
		if len(r.CellRaft) > 0 {
			r.MaxCellDispatchPerS, r.MaxCellTotalPerS = 0, 0
			for _, c := range r.CellRaft {
				r.MaxCellDispatchPerS = max(r.MaxCellDispatchPerS, c.RaftEntriesPerS["dispatch"])
				r.MaxCellTotalPerS = max(r.MaxCellTotalPerS, c.RaftEntriesPerS["total"])
			}
		}
		if r.MaxCellDispatchPerS > 0 {
			r.HeadroomQuiet = QuorumPlacementsPerS / r.MaxCellDispatchPerS
			r.HeadroomLoaded = LoadedQuorumPlacementsPerS / r.MaxCellDispatchPerS
		}
		if o.Log != nil {
			fmt.Fprintf(o.Log, "   cells-%d: TTFT mean %.1f ms, p99 %.1f ms; busiest cell %.0f dispatch/s, %.0f commands/s; %d events (%d steps, %.0f%% of them ended in decode runs) in %.1fs of wall time (%.1f CPU s), %.2f GB peak, %.2f GB live heap at most\n",
				n, r.TTFTMeanMs, r.TTFTP99Ms, r.MaxCellDispatchPerS, r.MaxCellTotalPerS, r.Events, res.Steps, 100*float64(res.RunSteps)/float64(max(res.Steps, 1)),
				r.WallS, r.CPUS, float64(r.PeakRSSBytes)/1e9, float64(r.HeapLivePeak)/1e9)
		}
		f.Runs = append(f.Runs, r)
	}
	base := f.Runs[0]
	for i := range f.Runs {
		r := &f.Runs[i]
		r.TTFTMeanVsBasePct = pctOver(r.TTFTMeanMs, base.TTFTMeanMs)
		r.TTFTP99VsBasePct = pctOver(r.TTFTP99Ms, base.TTFTP99Ms)
		r.WithinGoal = r.TTFTMeanVsBasePct <= o.GoalPct
	}
	if o.Log != nil {
		f.Print(o.Log)
	}
	return f, nil
}

// Print writes the figure as a table, with the goals' verdicts.
func (f *CellsFigure) Print(out io.Writer) {
	fmt.Fprintf(out, "\nfigure cells: %d workers %s, batches of %d, load %g (%.1f req/s, saturated %.1f), %d gateways (%s), Poisson arrivals at the Azure lengths, %.0f s (figures from %.0f s), seed %d\n",
		f.Workers, f.Profile, f.MaxRunning, f.Load, f.RatePerSec, f.SaturatedPerSec, f.Gateways, f.Choice, f.DurationS, f.WarmupS, f.Seed)
	fmt.Fprintf(out, "%6s %12s %11s %10s %10s %16s %16s %10s %10s %8s %12s %8s %11s %9s\n", "cells", "TTFT mean ms", "TTFT p99 ms", "vs base", "p99 vs", "busiest dispatch/s",
		"busiest cmds/s", "headroom", "(loaded)", "wall s", "wall/sim s", "CPU s", "CPU/sim s", "peak GB")
	for _, r := range f.Runs {
		fmt.Fprintf(out, "%6d %12.1f %11.1f %+9.2f%% %+9.2f%% %16.0f %16.0f %9.2fx %9.2fx %8.1f %12.2f %8.1f %11.2f %9.2f\n", r.Cells, r.TTFTMeanMs, r.TTFTP99Ms,
			r.TTFTMeanVsBasePct, r.TTFTP99VsBasePct, r.MaxCellDispatchPerS, r.MaxCellTotalPerS, r.HeadroomQuiet, r.HeadroomLoaded, r.WallS, r.WallPerSimS,
			r.CPUS, r.CPUPerSimS, float64(r.PeakRSSBytes)/1e9)
	}
	for _, r := range f.Runs[1:] {
		verdict := "met"
		if !r.WithinGoal {
			verdict = "MISSED"
		}
		fmt.Fprintf(out, "%d cells: TTFT mean %+.2f%% against %d cell(s) (goal: at most %g%% worse): %s\n", r.Cells, r.TTFTMeanVsBasePct, f.Runs[0].Cells, f.GoalPct, verdict)
	}
	fmt.Fprintln(out)
}

// cpuTime is the process's CPU time so far, user and system, every
// thread (0 where getrusage fails).
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// heapLive is the heap the last garbage collection found live, bytes.
func heapLive() uint64 {
	m := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(m)
	if m[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return m[0].Value.Uint64()
}

// resetPeakRSS resets the process's peak resident set (Linux: 5 to
// /proc/self/clear_refs); false where it cannot.
func resetPeakRSS() bool {
	return os.WriteFile("/proc/self/clear_refs", []byte("5"), 0) == nil
}

// peakRSS is the process's peak resident set, bytes (VmHWM; 0 where
// /proc is not there).
func peakRSS() uint64 {
	fh, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer fh.Close()
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, _ := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
			return kb * 1024
		}
	}
	return 0
}

// checkCells checks -cells against what runs.
func (c *Command) checkCells() error {
	if c.Cells < 1 {
		return fmt.Errorf("-cells %d: must be >= 1 (1: one quorum)", c.Cells)
	}
	if c.Cells == 1 || c.Figure == CellsFigureName {
		return nil
	}
	if c.Figure != "" {
		return fmt.Errorf("-cells applies to the studies and to -figure %s, not to -figure %s", CellsFigureName, c.Figure)
	}
	if c.Gateways < 1 {
		return fmt.Errorf("-cells %d needs -gateways >= 1: no one fsm sees every cell, the gateways choose the cell", c.Cells)
	}
	if c.Migration == "on" {
		return fmt.Errorf("-cells %d runs without -migration (a leader round per cell is not built)", c.Cells)
	}
	if c.Workers > 0 {
		if c.Workers%c.Cells != 0 {
			return fmt.Errorf("-cells %d must divide -workers %d: the workers are split evenly", c.Cells, c.Workers)
		}
		if c.GPUsPerNode > 0 && (c.Workers/c.Cells)%c.GPUsPerNode != 0 {
			return fmt.Errorf("-cells %d: a cell's %d workers must be whole nodes of -gpus-per-node %d", c.Cells, c.Workers/c.Cells, c.GPUsPerNode)
		}
	}
	return nil
}

// runCells runs -figure cells.
func (c *Command) runCells(timing Timing, choice GatewayChoice) error {
	for _, f := range []string{"fail", "fail-at", "no-restart", "trace", "csv", "migration", "stress", "quick", "seeds"} {
		if c.Given[f] {
			return fmt.Errorf("-figure %s runs failure-free lumen on generated arrivals: -%s does not apply", CellsFigureName, f)
		}
	}
	o := DefaultCellsOptions()
	o.Seed, o.Timing, o.Log, o.Profile, o.MaxRunning, o.Load, o.Budget, o.Choice = c.Seed, timing, c.Out, c.Profile, c.MaxRunning, c.Load, c.Budget, choice
	if c.Workers > 0 {
		o.Workers = c.Workers
	}
	if c.Given["gateways"] {
		o.Gateways = c.Gateways
	}
	if c.Given["cells"] {
		o.Cells = []int{1, c.Cells}
		if c.Cells == 1 {
			o.Cells = []int{1}
		}
	}
	if len(c.Xs) > 0 {
		o.Cells = nil
		for _, x := range c.Xs {
			o.Cells = append(o.Cells, int(x))
		}
	}
	if c.Duration > 0 {
		o.Timeline.Duration = c.Duration
		o.Timeline.Warmup = min(o.Timeline.Warmup, c.Duration/4)
	}
	if c.Saturated > 0 {
		o.Saturated = c.Saturated
	}
	if c.CalibrationWorkers > 0 {
		o.CalibrationWorkers = c.CalibrationWorkers
	}
	f, err := RunCells(o)
	if err != nil {
		return err
	}
	return c.writeJSON(f, false)
}
