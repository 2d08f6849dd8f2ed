package sim

import (
	"fmt"
	"github.com/lumen-project/lumen/internal/recoverystudy"
	"io"
	"math"
	"time"
)

// The figures of the issue ("results to reproduce"): each is a sweep of
// one parameter, every point a Study (the five columns on the same
// arrivals).

// FigureNames are the figures RunFigure knows, in the order `make sim`
// runs them.
var FigureNames = []string{"failures", "load", "proportional", "lambda", "budget"}

// FigureOptions are a figure's fixed parameters.
type FigureOptions struct {
	// Workers is the cluster size of the 64-worker figures (failures, load,
	// lambda, budget); Sizes the cluster sizes of the proportional one.
	Workers int
	Sizes   []int
	// Xs overrides the figure's default sweep.
	Xs         []float64
	Profile    string
	MaxRunning int
	Budget     uint64
	Timeline   Timeline
	Seed       uint64
	// Seeds, when > 1, runs every point with seeds Seed … Seed+Seeds−1
	// and reports the mean of each figure: a single seed ranks strategies
	// a few percent apart by chance (docs/benchmarks.md).
	Seeds  int
	Load   float64 // for the figures that do not sweep it
	Timing Timing
	// Spec is the lumen column's speculation.
	Spec SpecOptions
	// Only and StepTrace are every point's Study.Only and StepTrace.
	Only      []string
	StepTrace bool
	TraceDir  string
	// Saturated, when > 0, replaces every point's calibration: the
	// offered load is a fraction of it (requests per second).
	Saturated float64
	Log       io.Writer
}

// DefaultFigureOptions are the paper's simulation: 64 Qwen3-14B/H100
// workers, batches of 32, 80 GB host budgets, 70% load, the benchmark's
// timeline.
func DefaultFigureOptions() FigureOptions {
	return FigureOptions{Workers: 64, Sizes: []int{4, 8, 16, 32, 64}, Profile: "qwen3-14b-h100", MaxRunning: 32,
		Budget: 80e9, Timeline: FullTimeline(), Seed: 1, Load: 0.7, Timing: DefaultTiming()}
}

// Point is one x of a figure.
type Point struct {
	X       float64             `json:"x"`
	Columns map[string]*Figures `json:"columns"`
}

// Figure is a sweep's result.
type Figure struct {
	Name   string  `json:"name"`
	XLabel string  `json:"x_label"`
	Points []Point `json:"points"`
}

// RunFigure runs one figure.
func RunFigure(name string, o FigureOptions) (*Figure, error) {
	base := Setup{Name: name, Workers: o.Workers, Profile: o.Profile, Failures: 1, MaxRunning: o.MaxRunning, Budget: o.Budget}
	type point struct {
		x     float64
		setup Setup
		load  float64
		lam   float64
	}
	var pts []point
	xs := func(def ...float64) []float64 {
		if len(o.Xs) > 0 {
			return o.Xs
		}
		return def
	}
	f := &Figure{Name: name}
	switch name {
	case "failures":
		f.XLabel = "failed workers"
		for _, x := range xs(1, 2, 4, 8, 16) {
			s := base
			s.Failures = int(x)
			pts = append(pts, point{x, s, o.Load, 0})
		}
	case "load":
		f.XLabel = "offered load (fraction of saturated throughput)"
		for _, x := range xs(0.3, 0.5, 0.7, 0.8, 0.9, 0.95) {
			pts = append(pts, point{x, base, x, 0})
		}
	case "proportional":
		f.XLabel = "workers (25% of them fail)"
		sizes := o.Sizes
		if len(o.Xs) > 0 {
			sizes = nil
			for _, x := range o.Xs {
				sizes = append(sizes, int(x))
			}
		}
		for _, n := range sizes {
			s := base
			s.Workers, s.Failures = n, max(1, n/4)
			pts = append(pts, point{float64(n), s, o.Load, 0})
		}
	case "lambda":
		f.XLabel = "lambda in h(r)"
		for _, x := range xs(0, 0.5, 1, 2, 4) {
			// λ = 0 is sent as "unchanged" to the fsm (its default, 1):
			// the smallest positive weight stands for it.
			lam := x
			if lam == 0 {
				lam = math.SmallestNonzeroFloat64
			}
			pts = append(pts, point{x, base, o.Load, lam})
		}
	case "budget":
		f.XLabel = "host checkpoint budget (fraction of " + fmt.Sprintf("%.0f GB)", float64(o.Budget)/1e9)
		for _, x := range xs(0.1, 0.25, 0.5, 1) {
			s := base
			s.Budget = uint64(x * float64(o.Budget))
			pts = append(pts, point{x, s, o.Load, 0})
		}
	default:
		return nil, fmt.Errorf("%w: unknown figure %q: use one of %v", ErrInvalid, name, FigureNames)
	}
	saturated := map[string]float64{} // by cluster shape: calibrate once
	meter := newMeter(o.Log, "sim -figure "+name, float64(len(pts)*max(o.Seeds, 1)*len(Columns)))
	defer meter.Finish("")
	for _, pt := range pts {
		start := time.Now()
		var runs []map[string]*Figures
		for k := range max(o.Seeds, 1) {
			seed := o.Seed + uint64(k)
			key := fmt.Sprintf("%d/%d/%d", pt.setup.Workers, pt.setup.MaxRunning, seed)
			st := Study{Setup: pt.setup, Timeline: o.Timeline, Seed: seed, Load: pt.load, Lambda: pt.lam, Timing: o.Timing,
				Saturated: saturated[key], Spec: o.Spec, Meter: meter,
				Only: o.Only, StepTrace: o.StepTrace, TraceDir: o.TraceDir, Log: o.traceLog()}
			if st.Saturated == 0 && o.Saturated > 0 {
				st.Saturated = o.Saturated
			}
			if st.Saturated == 0 {
				sat, _, err := st.Calibrate()
				if err != nil {
					return nil, err
				}
				saturated[key], st.Saturated = sat, sat
			}
			figs, err := st.Run()
			if err != nil {
				return nil, fmt.Errorf("figure %s at %g, seed %d: %w", name, pt.x, seed, err)
			}
			runs = append(runs, figs)
		}
		figs := runs[0]
		if len(runs) > 1 {
			figs = map[string]*Figures{}
			for _, col := range Columns {
				var per []*Figures
				for _, r := range runs {
					if r[col.Name] != nil {
						per = append(per, r[col.Name])
					}
				}
				if len(per) == 0 {
					continue // not run (Only)
				}
				figs[col.Name] = MeanFigures(per)
			}
			// The excess vs the oracle of the means, not the mean of
			// the ratios (a seed where the oracle's excess is small
			// would weigh most).
			common := map[string]*recoverystudy.Figures{}
			for name, f := range figs {
				common[name] = &f.Figures
			}
			recoverystudy.ExcessesVsOracle(common)
		}
		if o.Log != nil {
			fmt.Fprintf(o.Log, "   %s: %s = %g done in %.1fs\n", name, f.XLabel, pt.x, time.Since(start).Seconds())
		}
		f.Points = append(f.Points, Point{X: pt.x, Columns: figs})
	}
	if o.Log != nil {
		f.Print(o.Log)
	}
	return f, nil
}

// traceLog is where a point's Study writes: only the speculation trace
// (StepTrace) of a figure's points is printed, to the figure's log.
func (o FigureOptions) traceLog() io.Writer {
	if o.StepTrace || o.TraceDir != "" {
		return o.Log
	}
	return nil
}

// Print writes the figure as a table: TTFT mean per strategy, lumen's
// gain over each baseline, and stop-and-restart's and lumen's excess vs
// the oracle (TTFT mean / p99 over the common affected requests; "-" where
// there is none: a figure from before the oracle, or an oracle without
// excess).
func (f *Figure) Print(out io.Writer) {
	fmt.Fprintf(out, "\nfigure %s: TTFT mean (ms) against %s\n", f.Name, f.XLabel)
	fmt.Fprintf(out, "%10s %12s %12s %13s %12s %12s %12s %14s %14s %17s %13s %13s\n", "x", "stop-restart", "fixed-ckpt", "lumen-no-spec", "lumen", "oracle", "no-failure",
		"lumen vs S&R", "lumen vs FC", "recovery s", "S&R x oracle", "lumen x oracle")
	for _, p := range f.Points {
		c := map[string]*Figures{}
		for _, col := range Columns {
			c[col.Name] = &Figures{} // a column not run (Only)
		}
		for k, v := range p.Columns {
			c[k] = v
		}
		l, sr, fc := c["lumen"], c["stop-and-restart"], c["fixed-checkpoint"]
		ns := c["lumen-no-spec"]
		if ns == nil { // a figure's JSON from before the ablation
			ns = &Figures{}
		}
		or := c[recoverystudy.OracleColumn]
		if or == nil { // a figure's JSON from before the oracle
			or = &Figures{}
		}
		fmt.Fprintf(out, "%10g %12.1f %12.1f %13.1f %12.1f %12.1f %12.1f %14s %14s %17s %13s %13s\n", p.X, sr.TTFTMeanMs, fc.TTFTMeanMs, ns.TTFTMeanMs, l.TTFTMeanMs,
			or.TTFTMeanMs, c["lumen-no-failure"].TTFTMeanMs, Gain(l.TTFTMeanMs, sr.TTFTMeanMs), Gain(l.TTFTMeanMs, fc.TTFTMeanMs),
			fmt.Sprintf("%.1f/%.1f/%.1f/%.1f", sr.RecoveryS, fc.RecoveryS, ns.RecoveryS, l.RecoveryS), excessCell(sr), excessCell(l))
	}
	fmt.Fprintln(out)
}

// excessCell is a column's excess vs the oracle as "mean/p99", each "-"
// where there is none.
func excessCell(f *Figures) string {
	one := func(v *float64) string {
		if v == nil {
			return "-"
		}
		return fmt.Sprintf("%.2f", *v)
	}
	x := f.ExcessVsOracle
	if x == nil {
		return "-"
	}
	return one(x.TTFTMean) + "/" + one(x.TTFTP99)
}

// MeanFigures is the mean of each figure over runs (a flag is true when
// it is in every run; counts are rounded).
func MeanFigures(runs []*Figures) *Figures {
	m := &Figures{}
	m.Recovered = true
	n := float64(len(runs))
	var requests, failed, interrupted, draft, accepted, verif, drafted, affected, common float64
	for _, f := range runs {
		m.AffectedTTFTMeanMs += f.AffectedTTFTMeanMs / n
		m.AffectedTTFTP99Ms += f.AffectedTTFTP99Ms / n
		m.AffectedTPOTMeanMs += f.AffectedTPOTMeanMs / n
		m.AffectedFromS += f.AffectedFromS / n
		m.AffectedToS += f.AffectedToS / n
		m.ReferenceTTFTMeanMs += f.ReferenceTTFTMeanMs / n
		m.ReferenceTTFTP99Ms += f.ReferenceTTFTP99Ms / n
		m.ReferenceTPOTMeanMs += f.ReferenceTPOTMeanMs / n
		m.InterruptedRecoveryMeanS += f.InterruptedRecoveryMeanS / n
		m.InterruptedRecoveryP99S += f.InterruptedRecoveryP99S / n
		m.ClusterRecoveryS += f.ClusterRecoveryS / n
		m.CommonTTFTMeanMs += f.CommonTTFTMeanMs / n
		m.CommonTTFTP99Ms += f.CommonTTFTP99Ms / n
		m.CommonTPOTMeanMs += f.CommonTPOTMeanMs / n
		affected += float64(f.AffectedRequests) / n
		common += float64(f.CommonRequests) / n
		m.TTFTMeanMs += f.TTFTMeanMs / n
		m.TTFTP99Ms += f.TTFTP99Ms / n
		m.TPOTMeanMs += f.TPOTMeanMs / n
		m.ResumeMeanMs += f.ResumeMeanMs / n
		m.RecoveryS += f.RecoveryS / n
		m.PagesReused += f.PagesReused / n
		m.TokensRecomputed += f.TokensRecomputed / n
		m.ResumeP99Ms += f.ResumeP99Ms / n
		m.PlanMs += f.PlanMs / n
		m.PreFailureTTFTMs += f.PreFailureTTFTMs / n
		m.ArrivalRatePerSec += f.ArrivalRatePerSec / n
		m.SaturatedPerSec += f.SaturatedPerSec / n
		m.ApplyMarkFailedP99Ms += f.ApplyMarkFailedP99Ms / n
		m.ApplyDispatchP99Ms += f.ApplyDispatchP99Ms / n
		m.AcceptRate += f.AcceptRate / n
		m.AssistS += f.AssistS / n
		m.SpecKMean += f.SpecKMean / n
		m.PhaseLoadingDraftS += f.PhaseLoadingDraftS / n
		m.PhaseAssistS += f.PhaseAssistS / n
		m.PhaseHotswapS += f.PhaseHotswapS / n
		m.PairedDecodeTokS += f.PairedDecodeTokS / n
		m.PairedDecodeBeforeTokS += f.PairedDecodeBeforeTokS / n
		m.PairedDecodeNoSpecTokS += f.PairedDecodeNoSpecTokS / n
		draft += float64(f.DraftTokens) / n
		accepted += float64(f.AcceptedTokens) / n
		verif += float64(f.Verifications) / n
		drafted += float64(f.Drafted) / n
		requests += float64(f.Requests) / n
		failed += float64(f.FailedRequests) / n
		interrupted += float64(f.Interrupted) / n
		m.Recovered = m.Recovered && f.Recovered
		m.RestoredFraction += f.RestoredFraction / n
		m.CheckpointLiveFraction += f.CheckpointLiveFraction / n
		m.CheckpointedFraction += f.CheckpointedFraction / n
		m.CheckpointBytesSent += f.CheckpointBytesSent / n
		m.CheckpointHostMeanBytes += f.CheckpointHostMeanBytes / n
		m.CheckpointHostPeakBytes = max(m.CheckpointHostPeakBytes, f.CheckpointHostPeakBytes)
	}
	m.Requests, m.FailedRequests, m.Interrupted = int(math.Round(requests)), int(math.Round(failed)), int(math.Round(interrupted))
	m.AffectedRequests, m.CommonRequests = int(math.Round(affected)), int(math.Round(common))
	m.DraftTokens, m.AcceptedTokens = int(math.Round(draft)), int(math.Round(accepted))
	m.Verifications, m.Drafted = int(math.Round(verif)), int(math.Round(drafted))
	return m
}
