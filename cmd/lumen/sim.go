package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/lumen-project/lumen/internal/plot"
	"github.com/lumen-project/lumen/sim"
	"github.com/lumen-project/lumen/worker/core"
)

func init() {
	register("sim", "the recovery strategies side by side in the deterministic simulator (worker core + fsm), 4 to 1,024 workers", runSim)
}

func runSim(args []string) error {
	fs := flag.NewFlagSet("sim", flag.ContinueOnError)
	setups := fs.String("setups", "", "prototype setups of lumen bench recovery to run: w4, w8, w8_f4 (default: all three, unless -workers is given)")
	workers := fs.Int("workers", 0, "a custom setup: this many workers (with -profile, -fail, -duration)")
	profile := fs.String("profile", "qwen3-14b-h100", "custom setup: timing profile")
	fail := fs.Int("fail", 1, "custom setup: workers killed at a quarter of the run")
	duration := fs.Duration("duration", 0, "custom setup: arrivals span (default 120s, -quick 36s)")
	maxRunning := fs.Int("max-running", 32, "custom setup: a worker's batch cap")
	budget := fs.String("checkpoint-budget", "80GB", "custom setup: host checkpoint budget per worker")
	quick := fs.Bool("quick", false, "shorter runs, same keys")
	seed := fs.Uint64("seed", 1, "workload seed (the same for every strategy)")
	load := fs.Float64("load", 0.7, "offered load as a fraction of the measured saturated throughput")
	lambda := fs.Float64("lambda", 0, "h(r)'s weight of the restore delay (0: the default, 1)")
	failAt := fs.Duration("fail-at", 0, "when worker-1 … worker-K are killed, from the start of the arrivals (0: a quarter of a custom run, 30 s of the prototype timeline, 12 s with -quick)")
	noRestart := fs.Bool("no-restart", false, "failed workers stay down")
	detect := fs.Duration("detect", sim.DefaultTiming().DetectDelay, "failure detection delay, kill to MarkFailed")
	applyTiming := fs.Bool("apply-timing", true, "time fsm.Apply on the wall clock (apply_*_p99_ms); false makes the JSON byte-identical for a seed")
	jsonPath := fs.String("json", "", "write setup → column → figures as JSON (with -figure: the figure's points)")
	tracePath := fs.String("trace", "", "a CSV trace in the Azure LLM inference 2023 format (TIMESTAMP, ContextTokens, GeneratedTokens) instead of the generator; rescaled in time to -load")
	csvPath := fs.String("csv", "", "write every column's time series (1 s bins: arrivals, mean TTFT, mean queue) as CSV")
	svgPath := fs.String("svg", "", "with -figure or -replot: plot the figure as SVG")
	replot := fs.String("replot", "", "plot a figure's JSON written by -figure -json (with -svg), running nothing")
	seeds := fs.Int("seeds", 1, "with -figure: run every point with this many seeds (from -seed) and report the means")
	figure := fs.String("figure", "", "run a figure instead: "+strings.Join(sim.FigureNames, ", ")+" (64 workers unless -workers; -quick shortens), spec-k (adaptive K against fixed K = 0 … 8, one target and its drafter), or burst (live migration off/on under Gamma arrivals: 8 and 64 workers unless -workers, loads 0.7, 0.85, 1 unless -load), or gateways (issue 16's balance: dispatch inside Apply against 1 and 4 gateways with lagging views, 64 workers unless -workers, load 0.7 unless -load, 300 s unless -duration; -seeds averages)")
	gateways := fs.Int("gateways", 0, "issue 16's dispatch: this many gateways choose the serving worker from their own lagging replica of the load table (internal/placer), the request starting there before its placement commits; 0 = the dispatch inside Apply. With -figure gateways: the gateway counts to compare with Apply (default 1,4)")
	gatewayChoice := fs.String("gateway-choice", "partition-fill", "with -gateways: how a gateway chooses ("+strings.Join(sim.GatewayChoices, ", ")+"; partition-fill at the default bias is internal/placer's choice among several gateways, what lumen's gateways run; freest is PickServing alone, the placer before shares; the others are prototypes, docs/benchmarks.md); with -figure gateways, the choice run beside freest")
	gatewayBias := fs.Float64("gateway-bias", sim.DefaultGatewayBias, "with -gateway-choice partition or partition-fill: the preference for the gateway's own share of the workers")
	migration := fs.String("migration", "off", "live migration for balance (Llumnix; the leader's round every 500 ms): on or off")
	kvPages := fs.Int("kv-pages", 0, "with -figure burst: a worker's KV cache in 16-token pages (0: the profile's GPU); smaller puts the workers under memory pressure")
	cv := fs.Float64("cv", 4, "with -figure burst: the arrivals' coefficient of variation (Gamma gaps; 0 or 1 is Poisson)")
	specAlpha := fs.Float64("spec-alpha", core.PriorAcceptance, "lumen's speculation: the probability that a draft token equals the target's (docs/calibration.md)")
	specK := fs.Int("spec-k", 0, "lumen's speculation: drafts verified per request per step; 0 = adaptive (chosen each step from the measured acceptance and the step-cost model)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *specAlpha <= 0 || *specAlpha > 1 {
		return fmt.Errorf("-spec-alpha %g: must be in (0, 1]", *specAlpha)
	}
	if *specK < 0 || *specK > 64 {
		return fmt.Errorf("-spec-k %d: must be in [0, 64] (0: adaptive)", *specK)
	}
	var migrate bool
	switch *migration {
	case "on":
		migrate = true
	case "off":
	default:
		return fmt.Errorf("-migration %q: on or off", *migration)
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if (set["cv"] || set["kv-pages"]) && *figure != "burst" {
		return fmt.Errorf("-cv and -kv-pages apply to -figure burst only")
	}
	if migrate && *figure != "" && *figure != "burst" {
		return fmt.Errorf("-migration on applies to the studies, not to -figure %s (-figure burst runs it off and on)", *figure)
	}
	choice, err := sim.ParseGatewayChoice(*gatewayChoice)
	if err != nil {
		return fmt.Errorf("-gateway-choice: %w", err)
	}
	if *gateways < 0 {
		return fmt.Errorf("-gateways %d: must be >= 0 (0: the dispatch inside Apply)", *gateways)
	}
	if *gatewayBias < 0 {
		return fmt.Errorf("-gateway-bias %g: must be >= 0", *gatewayBias)
	}
	if *figure != "" && *figure != "gateways" && (set["gateways"] || set["gateway-choice"] || set["gateway-bias"]) {
		return fmt.Errorf("-gateways, -gateway-choice and -gateway-bias apply to the studies and to -figure gateways, not to -figure %s", *figure)
	}
	o := sim.Options{Gateways: *gateways, GatewayChoice: choice, GatewayBias: *gatewayBias, Migration: migrate, Quick: *quick, Seed: *seed, Load: *load, Lambda: *lambda, NoRestart: *noRestart, FailAt: *failAt,
		Timing: sim.DefaultTiming(), MeasureApply: *applyTiming, JSONPath: *jsonPath, CSVPath: *csvPath, TracePath: *tracePath, Log: os.Stdout}
	o.Timing.DetectDelay = *detect
	o.Spec = sim.SpecOptions{Alpha: *specAlpha, K: *specK}
	if *replot != "" {
		data, err := os.ReadFile(*replot)
		if err != nil {
			return err
		}
		var f sim.Figure
		if err := json.Unmarshal(data, &f); err != nil {
			return fmt.Errorf("-replot %s: %w", *replot, err)
		}
		if *svgPath == "" {
			f.Print(os.Stdout)
			return nil
		}
		return writeSVG(&f, *svgPath)
	}
	if *figure == "spec-k" {
		ko := sim.DefaultSpecKOptions()
		ko.Seed, ko.Timing, ko.Log = *seed, o.Timing, os.Stdout
		if set["spec-k"] || set["spec-alpha"] {
			return fmt.Errorf("-figure spec-k runs every K at alpha 0.5, 0.7 and 0.9: -spec-k and -spec-alpha do not apply")
		}
		f, err := sim.RunSpecK(ko)
		if err != nil {
			return err
		}
		if *jsonPath != "" {
			data, err := json.MarshalIndent(f, "", "  ")
			if err != nil {
				return err
			}
			return writeJSONAndPlot(*jsonPath, data)
		}
		return nil
	}
	if *figure == "gateways" {
		if migrate {
			return fmt.Errorf("-figure gateways runs without migration: -migration does not apply")
		}
		g := sim.DefaultGatewayOptions()
		g.Seed, g.Seeds, g.Timing, g.Log, g.Profile, g.MaxRunning, g.Load = *seed, *seeds, o.Timing, os.Stdout, *profile, *maxRunning, *load
		if *workers > 0 {
			g.Workers = *workers
		}
		if *quick {
			g.Timeline = sim.QuickTimeline()
		}
		if *duration > 0 {
			g.Timeline.Duration, g.Timeline.Warmup = *duration, *duration/12
		}
		if set["gateways"] || set["gateway-choice"] || set["gateway-bias"] {
			counts := []int{1, 4}
			if set["gateways"] {
				counts = []int{*gateways}
			}
			if !set["gateway-choice"] {
				choice = sim.ChoosePartitionFill
			}
			g.Modes = nil
			for _, n := range counts {
				g.Modes = append(g.Modes, sim.GatewayMode{Gateways: n})
				if choice != sim.ChooseFreest && n > 1 {
					g.Modes = append(g.Modes, sim.GatewayMode{Gateways: n, Choice: choice, Bias: *gatewayBias})
				}
			}
		}
		b, err := parseBytes(budget)
		if err != nil {
			return fmt.Errorf("-checkpoint-budget: %w", err)
		}
		g.Budget = b
		f, err := sim.RunGateways(g)
		if err != nil {
			return err
		}
		if *jsonPath != "" {
			data, err := json.MarshalIndent(f, "", "  ")
			if err != nil {
				return err
			}
			return os.WriteFile(*jsonPath, append(data, '\n'), 0o644)
		}
		return nil
	}
	if *figure == "burst" {
		if set["migration"] {
			return fmt.Errorf("-figure burst runs migration off and on: -migration does not apply")
		}
		bo := sim.DefaultBurstOptions()
		bo.Seed, bo.Timing, bo.Log, bo.Profile, bo.MaxRunning, bo.CV, bo.KVPages = *seed, o.Timing, os.Stdout, *profile, *maxRunning, *cv, *kvPages
		if *workers > 0 {
			bo.Sizes = []int{*workers}
		}
		if set["load"] {
			bo.Loads = []float64{*load}
		}
		if *quick {
			bo.Timeline = sim.QuickTimeline()
		}
		if *duration > 0 {
			bo.Timeline.Duration, bo.Timeline.Warmup = *duration, *duration/12
		}
		b, err := parseBytes(budget)
		if err != nil {
			return fmt.Errorf("-checkpoint-budget: %w", err)
		}
		bo.Budget = b
		f, err := sim.RunBurst(bo)
		if err != nil {
			return err
		}
		if *jsonPath != "" {
			data, err := json.MarshalIndent(f, "", "  ")
			if err != nil {
				return err
			}
			return writeJSONAndPlot(*jsonPath, data)
		}
		return nil
	}
	if *figure != "" {
		fo := sim.DefaultFigureOptions()
		fo.Seed, fo.Seeds, fo.Load, fo.Timing, fo.Log, fo.Profile, fo.MaxRunning = *seed, *seeds, *load, o.Timing, os.Stdout, *profile, *maxRunning
		fo.Spec = o.Spec
		if *workers > 0 {
			fo.Workers = *workers
		}
		if *quick {
			fo.Timeline = sim.QuickTimeline()
		}
		if *duration > 0 {
			fo.Timeline.Duration, fo.Timeline.FailAt, fo.Timeline.Warmup = *duration, *duration/4, *duration/12
		}
		b, err := parseBytes(budget)
		if err != nil {
			return fmt.Errorf("-checkpoint-budget: %w", err)
		}
		fo.Budget = b
		f, err := sim.RunFigure(*figure, fo)
		if err != nil {
			return err
		}
		if *svgPath != "" {
			if err := writeSVG(f, *svgPath); err != nil {
				return err
			}
		}
		if *jsonPath != "" {
			data, err := json.MarshalIndent(f, "", "  ")
			if err != nil {
				return err
			}
			return writeJSONAndPlot(*jsonPath, data)
		}
		return nil
	}
	switch {
	case *workers > 0 && *setups != "":
		return fmt.Errorf("-setups and -workers: choose prototype setups or one custom setup")
	case *workers > 0:
		b, err := parseBytes(budget)
		if err != nil {
			return fmt.Errorf("-checkpoint-budget: %w", err)
		}
		o.Setups = []sim.Setup{sim.CustomSetup(*workers, *profile, *fail, *maxRunning, b)}
		o.Duration = *duration
	default:
		if *setups == "" {
			*setups = "w4,w8,w8_f4"
		}
		s, err := sim.ParseSetups(*setups)
		if err != nil {
			return fmt.Errorf("-setups: %w", err)
		}
		o.Setups = s
	}
	start := time.Now()
	if _, err := sim.RunStudies(o); err != nil {
		return err
	}
	for _, p := range []string{*jsonPath, *csvPath} {
		if p != "" {
			plotNextTo(p)
		}
	}
	fmt.Printf("simulated in %s of wall time\n", time.Since(start).Round(10*time.Millisecond))
	return nil
}

// writeJSONAndPlot writes a figure's JSON and its plot next to it.
func writeJSONAndPlot(path string, data []byte) error {
	if err := os.WriteFile(path, append(data, '\n'), 0o644); err != nil {
		return err
	}
	plotNextTo(path)
	return nil
}

// plotNextTo plots path into the same name with .svg (internal/plot); a
// plot that cannot be drawn is said, not fatal.
func plotNextTo(path string) {
	out, err := plot.WriteNextTo(path)
	if err != nil {
		fmt.Fprintf(os.Stderr, "plot: %v\n", err)
		return
	}
	fmt.Printf("wrote %s\n", out)
}

func writeSVG(f *sim.Figure, path string) error {
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
