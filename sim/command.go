package sim

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/lumen-project/lumen/internal/progress"
	"github.com/lumen-project/lumen/internal/workload"
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
	Lambda float64
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
	// replaces the generator (ReadAzureTrace).
	TracePath string
	// Spec is the lumen column's speculation.
	Spec SpecOptions
	// Migration turns live migration on in every column (Config.Migration).
	Migration bool
	// Gateways, GatewayChoice and GatewayBias are every column's dispatch
	// (Config.Gateways; 0: inside Apply).
	Gateways      int
	GatewayChoice GatewayChoice
	GatewayBias   float64
	Log           io.Writer
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
		trace, err = ReadAzureTrace(f, o.Seed)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", o.TracePath, err)
		}
	}
	meter := newMeter(o.Log, "sim", float64(len(o.Setups)*len(Columns)))
	defer meter.Finish("")
	for _, s := range o.Setups {
		tm := FullTimeline()
		if o.Quick {
			tm = QuickTimeline()
		}
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
		if s.Failures > s.Workers-1 {
			return nil, fmt.Errorf("%w: %s: %d failures of %d workers leave none to recover on", ErrInvalid, s.Name, s.Failures, s.Workers)
		}
		st := Study{Setup: s, Timeline: tm, Seed: o.Seed, Load: o.Load, Lambda: o.Lambda, NoRestart: o.NoRestart,
			Timing: o.Timing, MeasureApply: o.MeasureApply, Log: o.Log, Series: series, Trace: trace, Spec: o.Spec, Migration: o.Migration, Meter: meter,
			Gateways: o.Gateways, GatewayChoice: o.GatewayChoice, GatewayBias: o.GatewayBias}
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
