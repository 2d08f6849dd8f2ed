package sim

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/lumen-project/lumen/worker/engine"
)

// The degradation figure (issue 22, item 4): how much one failure costs
// stop-and-restart, the seed's baseline, against the offered load and the
// reload's length. The seed measures 4.0× TTFT and 1.6× TPOT; the figure
// says under which conditions the simulator's stop-and-restart reaches it.

// DegradationFigure is the name of the figure, `lumen sim -figure
// degradation`.
const DegradationFigure = "degradation"

// PaperTTFTX and PaperTPOTX are the seed's degradation of stop-and-restart
// by one worker failure, at 4 to 64 workers: TTFT 4.0×, TPOT 1.6×.
const (
	PaperTTFTX = 4.0
	PaperTPOTX = 1.6
)

// DegradationSetups are the setups the figure sweeps unless told others:
// the headline setups of one failure at 4 and 8 workers.
const DegradationSetups = "w4,w8"

// degradationColumns are the only columns the figure needs: the failed
// baseline and its failure-free reference on the same arrivals.
var degradationColumns = []string{"no-checkpoint-no-failure", "stop-and-restart"}

// DegradationOptions are the figure's sweep.
type DegradationOptions struct {
	// Setups are swept under their own conditions but for the load and
	// the reload, which the sweep sets.
	Setups []Setup
	// Loads are the offered loads (fractions of the measured saturated
	// throughput); Reloads the restarted worker's reloads, as
	// engine.ParseReload reads them (warm, cold, a duration).
	Loads   []float64
	Reloads []string
	// Quick runs the setups' quick timelines (Setup.Timeline).
	Quick bool
	Seed  uint64
	// Seeds, when > 1, runs every point with seeds Seed … Seed+Seeds−1;
	// each figure is the mean over them (MeanFigures) and each ratio the
	// ratio of those means.
	Seeds int
	// Timing is every point's before the setup's conditions
	// (Timing.Under).
	Timing Timing
	// Log receives progress lines and the table (nil: nothing).
	Log io.Writer
}

// DefaultDegradationOptions sweep w4 and w8 over loads 0.6 to 0.95, warm
// and cold, seed 1.
func DefaultDegradationOptions() DegradationOptions {
	setups, err := ParseSetups(DegradationSetups)
	if err != nil {
		panic(err) // DegradationSetups names setups of PrototypeSetups
	}
	return DegradationOptions{Setups: setups, Loads: []float64{0.6, 0.7, 0.8, 0.85, 0.9, 0.95}, Reloads: []string{"warm", "cold"},
		Seed: 1, Seeds: 1, Timing: DefaultTiming()}
}

// DegradationPoint is stop-and-restart's degradation at one setup, load
// and reload: its figures over the requests the failure affected, against
// no-checkpoint-no-failure's over the very same requests.
type DegradationPoint struct {
	Setup  string  `json:"setup"`
	Load   float64 `json:"load"`
	Reload string  `json:"reload"`
	// ReloadS is the restarted worker's reload as the run took it (the
	// profile's under Reload, scaled by the timeline).
	ReloadS float64 `json:"reload_s"`
	// The degradation: affected over reference, 0 where the reference
	// is 0.
	TTFTMeanX float64 `json:"ttft_mean_x"`
	TTFTP99X  float64 `json:"ttft_p99_x"`
	TPOTMeanX float64 `json:"tpot_mean_x"`
	// AffectedRequests, ClusterRecoveryS and Recovered are
	// stop-and-restart's (recoverystudy.Figures).
	AffectedRequests int     `json:"affected_requests"`
	ClusterRecoveryS float64 `json:"cluster_recovery_s"`
	Recovered        bool    `json:"recovered"`
	Interrupted      int     `json:"interrupted"`
	// The raw figures the ratios are of: stop-and-restart's over its
	// affected requests, no-checkpoint-no-failure's over the same.
	AffectedTTFTMeanMs  float64 `json:"affected_ttft_mean_ms"`
	AffectedTTFTP99Ms   float64 `json:"affected_ttft_p99_ms"`
	AffectedTPOTMeanMs  float64 `json:"affected_tpot_mean_ms"`
	ReferenceTTFTMeanMs float64 `json:"reference_affected_ttft_mean_ms"`
	ReferenceTTFTP99Ms  float64 `json:"reference_affected_ttft_p99_ms"`
	ReferenceTPOTMeanMs float64 `json:"reference_affected_tpot_mean_ms"`
	// Whole-run figures of both columns (every arrival after the
	// warm-up), for comparison with the other figures.
	TTFTMeanMs          float64 `json:"ttft_mean_ms"`
	TPOTMeanMs          float64 `json:"tpot_mean_ms"`
	NoFailureTTFTMeanMs float64 `json:"no_failure_ttft_mean_ms"`
	NoFailureTPOTMeanMs float64 `json:"no_failure_tpot_mean_ms"`
	ArrivalRatePerSec   float64 `json:"arrival_rate_per_s"`
	SaturatedPerSec     float64 `json:"saturated_rate_per_s"`
}

// Degradation is the figure: its points by setup, reload and load, in
// that order, and the seed's figures it is compared with.
type Degradation struct {
	Name       string             `json:"name"`
	PaperTTFTX float64            `json:"paper_ttft_x"`
	PaperTPOTX float64            `json:"paper_tpot_x"`
	Seed       uint64             `json:"seed"`
	Seeds      int                `json:"seeds"`
	Quick      bool               `json:"quick"`
	Points     []DegradationPoint `json:"points"`
}

// ratio is a over b, 0 when b is 0 (nothing to compare with).
func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

// degradationPoint is the point of stop-and-restart's figures sr against
// its reference ref.
func degradationPoint(setup string, load float64, reload string, reloadS float64, sr, ref *Figures) DegradationPoint {
	return DegradationPoint{Setup: setup, Load: load, Reload: reload, ReloadS: reloadS,
		TTFTMeanX: ratio(sr.AffectedTTFTMeanMs, sr.ReferenceTTFTMeanMs), TTFTP99X: ratio(sr.AffectedTTFTP99Ms, sr.ReferenceTTFTP99Ms),
		TPOTMeanX: ratio(sr.AffectedTPOTMeanMs, sr.ReferenceTPOTMeanMs), AffectedRequests: sr.AffectedRequests,
		ClusterRecoveryS: sr.ClusterRecoveryS, Recovered: sr.Recovered, Interrupted: sr.Interrupted,
		AffectedTTFTMeanMs: sr.AffectedTTFTMeanMs, AffectedTTFTP99Ms: sr.AffectedTTFTP99Ms, AffectedTPOTMeanMs: sr.AffectedTPOTMeanMs,
		ReferenceTTFTMeanMs: sr.ReferenceTTFTMeanMs, ReferenceTTFTP99Ms: sr.ReferenceTTFTP99Ms, ReferenceTPOTMeanMs: sr.ReferenceTPOTMeanMs,
		TTFTMeanMs: sr.TTFTMeanMs, TPOTMeanMs: sr.TPOTMeanMs, NoFailureTTFTMeanMs: ref.TTFTMeanMs, NoFailureTPOTMeanMs: ref.TPOTMeanMs,
		ArrivalRatePerSec: sr.ArrivalRatePerSec, SaturatedPerSec: sr.SaturatedPerSec}
}

// RunDegradation runs the figure: for each setup, reload and load, the
// columns stop-and-restart and no-checkpoint-no-failure on the same
// arrivals (a setup's saturated throughput is measured once per seed: the
// reload and the load do not change it). Every reload is checked before
// anything runs.
func RunDegradation(o DegradationOptions) (*Degradation, error) {
	if len(o.Setups) == 0 || len(o.Loads) == 0 || len(o.Reloads) == 0 {
		return nil, fmt.Errorf("%w: -figure degradation: %d setups, %d loads, %d reloads: at least one of each", ErrInvalid,
			len(o.Setups), len(o.Loads), len(o.Reloads))
	}
	reloads := make([]engine.Reload, len(o.Reloads))
	for i, r := range o.Reloads {
		var err error
		if reloads[i], err = engine.ParseReload(r); err != nil {
			return nil, fmt.Errorf("%w: -figure degradation: reload %q: %w", ErrInvalid, r, err)
		}
	}
	for _, l := range o.Loads {
		if l <= 0 {
			return nil, fmt.Errorf("%w: -figure degradation: load %g must be > 0", ErrInvalid, l)
		}
	}
	for _, s := range o.Setups {
		if s.Failures < 1 || s.Failures > s.Workers-1 {
			return nil, fmt.Errorf("%w: -figure degradation: %s: %d failures of %d workers: at least one, and one worker left to recover on",
				ErrInvalid, s.Name, s.Failures, s.Workers)
		}
		switch _, ok, err := engine.LookupProfile(s.Profile); {
		case err != nil:
			return nil, fmt.Errorf("%w: -figure degradation: %s: %w", ErrInvalid, s.Name, err)
		case !ok:
			return nil, fmt.Errorf("%w: -figure degradation: %s: unknown profile %q", ErrInvalid, s.Name, s.Profile)
		}
	}
	seeds := max(o.Seeds, 1)
	out := &Degradation{Name: DegradationFigure, PaperTTFTX: PaperTTFTX, PaperTPOTX: PaperTPOTX, Seed: o.Seed, Seeds: seeds, Quick: o.Quick}
	points := len(o.Setups) * len(o.Reloads) * len(o.Loads)
	meter := newMeter(o.Log, "sim -figure "+DegradationFigure, float64(points*seeds*len(degradationColumns)))
	defer meter.Finish("")
	saturated := map[string]float64{} // by setup and seed
	for _, base := range o.Setups {
		tm := base.Timeline(o.Quick)
		for i, reload := range reloads {
			s := base
			s.Reload = reload.String()
			timing, err := o.Timing.Under(s.Conditions)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", s.Name, err)
			}
			p, _, _ := engine.LookupProfile(s.Profile)
			lp, err := p.WithReload(timing.Reload)
			if err != nil {
				return nil, fmt.Errorf("%w: -figure degradation: %s: reload %q: %w", ErrInvalid, s.Name, o.Reloads[i], err)
			}
			reloadS := lp.LoadTime().Seconds() * timing.ReloadScale * tm.ReloadScale
			for _, load := range o.Loads {
				s.Load = load
				start := time.Now()
				var srs, refs []*Figures
				for k := range seeds {
					seed := o.Seed + uint64(k)
					key := fmt.Sprintf("%s/%d", s.Name, seed)
					st := Study{Setup: s, Timeline: tm, Seed: seed, Load: load, Timing: timing, Saturated: saturated[key],
						Meter: meter, Only: degradationColumns}
					if st.Saturated == 0 {
						sat, _, err := st.Calibrate()
						if err != nil {
							return nil, fmt.Errorf("figure %s: %s: %w", DegradationFigure, s.Name, err)
						}
						saturated[key], st.Saturated = sat, sat
					}
					figs, err := st.Run()
					if err != nil {
						return nil, fmt.Errorf("figure %s: %s, reload %s, load %g, seed %d: %w", DegradationFigure, s.Name, s.Reload, load, seed, err)
					}
					srs, refs = append(srs, figs["stop-and-restart"]), append(refs, figs["no-checkpoint-no-failure"])
				}
				sr, ref := srs[0], refs[0]
				if seeds > 1 {
					sr, ref = MeanFigures(srs), MeanFigures(refs)
				}
				pt := degradationPoint(s.Name, load, s.Reload, reloadS, sr, ref)
				out.Points = append(out.Points, pt)
				if o.Log != nil {
					fmt.Fprintf(o.Log, "   %s: %s, reload %s, load %g done in %.1fs: TTFT mean %.2fx, TPOT %.2fx\n", DegradationFigure,
						s.Name, s.Reload, load, time.Since(start).Seconds(), pt.TTFTMeanX, pt.TPOTMeanX)
				}
			}
		}
	}
	if o.Log != nil {
		out.Print(o.Log)
	}
	return out, nil
}

// Print writes the figure as a table, and the points at or beyond the
// seed's degradation.
func (d *Degradation) Print(w io.Writer) {
	seeds := ""
	if d.Seeds > 1 {
		seeds = fmt.Sprintf(", mean of seeds %d-%d", d.Seed, d.Seed+uint64(d.Seeds)-1)
	} else {
		seeds = fmt.Sprintf(", seed %d", d.Seed)
	}
	fmt.Fprintf(w, "\nfigure %s: stop-and-restart over no-checkpoint-no-failure on the requests the failure affected%s\n", d.Name, seeds)
	fmt.Fprintf(w, "%-8s %-8s %9s %6s %12s %12s %8s %8s %8s %9s %11s\n", "setup", "reload", "reload s", "load",
		"SR TTFT ms", "ref TTFT ms", "TTFT x", "p99 x", "TPOT x", "affected", "recovery s")
	var both []string
	for _, p := range d.Points {
		rec := fmt.Sprintf("%.1f", p.ClusterRecoveryS)
		if !p.Recovered {
			rec = ">" + rec
		}
		fmt.Fprintf(w, "%-8s %-8s %9.1f %6g %12.1f %12.1f %8.2f %8.2f %8.2f %9d %11s\n", p.Setup, p.Reload, p.ReloadS, p.Load,
			p.AffectedTTFTMeanMs, p.ReferenceTTFTMeanMs, p.TTFTMeanX, p.TTFTP99X, p.TPOTMeanX, p.AffectedRequests, rec)
		if p.TTFTMeanX >= d.PaperTTFTX && p.TPOTMeanX >= d.PaperTPOTX {
			both = append(both, fmt.Sprintf("%s/%s@%g", p.Setup, p.Reload, p.Load))
		}
	}
	list := "none"
	if len(both) > 0 {
		list = strings.Join(both, ", ")
	}
	fmt.Fprintf(w, "at or beyond the seed's TTFT %.1fx and TPOT %.1fx together: %s\n\n", d.PaperTTFTX, d.PaperTPOTX, list)
}
