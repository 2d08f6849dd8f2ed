package main

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"

	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/sim"
)

func init() {
	register("sim", "the recovery strategies side by side in the deterministic simulator (worker core + fsm), 4 to 10,000 workers (cells of quorums past one)", runSim)
}

// runSim parses `lumen sim`'s flags into a sim.Command and runs it.
func runSim(args []string) error {
	c := sim.DefaultCommand()
	fs := flag.NewFlagSet("sim", flag.ContinueOnError)
	fs.StringVar(&c.Setups, "setups", "", "setups of lumen bench recovery to run: w4, w8, w8_f4 (the seed's stress: batch cap 256, the context-dependent decode step, a cold reload, load 0.9, 360 s with the failure at 60 s), w4-mild, w8-mild, w8_f4-mild (the earlier: caps 64 and 32, warm reload, load 0.7, 120 s) (default: w4,w8,w8_f4, unless -workers is given); -load, -reload, -detect, -decode-context and -max-running given override every setup's")
	fs.IntVar(&c.Workers, "workers", 0, "a custom setup: this many workers (with -profile, -fail, -duration)")
	fs.StringVar(&c.Profile, "profile", c.Profile, "custom setup: timing profile")
	fs.IntVar(&c.Fail, "fail", c.Fail, "custom setup: workers killed at a quarter of the run; with -figure prefix: worker-1 … worker-K killed at -fail-at (default halfway through the measured stages), the interrupted requests' figures and the prefix-aware-planned-resumes column (resumes where the recovery plan put them) added")
	fs.DurationVar(&c.Duration, "duration", 0, "custom setup: arrivals span (default 120s, -quick 36s)")
	fs.IntVar(&c.MaxRunning, "max-running", c.MaxRunning, "a worker's batch cap (vLLM's --max-num-seqs default is 256): a custom setup's, the figures', and, given with -setups, an override of every named setup's (256 in w4, w8, w8_f4; w4-mild 64, w8-mild and w8_f4-mild 32)")
	fs.IntVar(&c.TokenBudget, "token-budget", 0, "the tokens one engine step may compute in every setup, the chunked prefill's budget (0: 2048; vLLM's takes 2048-8192)")
	budget := fs.String("checkpoint-budget", "80GB", "custom setup: host checkpoint budget per worker")
	fs.BoolVar(&c.Quick, "quick", false, "shorter runs, same keys")
	fs.Uint64Var(&c.Seed, "seed", c.Seed, "workload seed (the same for every strategy)")
	fs.Float64Var(&c.Load, "load", c.Load, "offered load as a fraction of the measured saturated throughput (named setups: their own unless given, 0.9 for w4, w8, w8_f4)")
	fs.Float64Var(&c.Lambda, "lambda", 0, "h(r)'s weight of the restore delay (0: the default, 1)")
	fs.DurationVar(&c.FailAt, "fail-at", 0, "when worker-1 … worker-K are killed, from the start of the arrivals (0: a quarter of a custom run, 30 s of the prototype timeline, 12 s with -quick)")
	fs.BoolVar(&c.NoRestart, "no-restart", false, "failed workers stay down")
	fs.StringVar(&c.Detect, "detect", c.Detect, "how a failure is detected: fast (a kill -9 on the fast path, 45ms), hang (a SIGSTOP: the streams stay open until Serf detects it, 0.8s, then the process is killed and restarted), a duration (a kill detected that long after) or hang:DURATION")
	fs.StringVar(&c.LoadReports, "load-reports", c.LoadReports, "when workers report their load: events (when a field moves past its threshold, else a 10 s heartbeat if anything changed: what workers run, docs/architecture.md) or periodic (every 250 ms, and at once on a large change of the queue: lumen before issue 26)")
	fs.StringVar(&c.Reload, "reload", c.Reload, "a restarted worker's reload: warm (the same host: weights in the page cache, 23.6s for Qwen3-14B), cold (a replacement node: weights at 0.4 GB/s, engine init with cold compile caches 60s: 2.2 min for Qwen3-14B) or a duration for the whole reload")
	fs.Func("xs", "with -figure failures, load, proportional, lambda or budget: the sweep's points, comma-separated (failed workers, loads, cluster sizes, lambdas, budget fractions), instead of the figure's own", func(v string) error {
		for _, f := range strings.Split(v, ",") {
			x, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
			if err != nil || x < 0 {
				return fmt.Errorf("%q is not a number >= 0", f)
			}
			c.Xs = append(c.Xs, x)
		}
		return nil
	})
	fs.StringVar(&c.Preemption, "preemption", c.Preemption, "a running request short of a KV page: wait (it sits the step out, its cache kept; lumen's) or vllm (it preempts the newest running request, by recompute, as vLLM's scheduler does)")
	fs.BoolVar(&c.Stress, "stress", false, "with -figure or -workers: run at the headline setups' stress (batch cap 256, -decode-context on, -reload cold, -load 0.9, 360 s with the failure at 60 s; docs/calibration.md); the flags given override each")
	fs.StringVar(&c.DecodeContext, "decode-context", c.DecodeContext, "on: a decode step grows with the context its rows read (weights + each row's KV over the HBM bandwidth, docs/calibration.md); off: the profiles' fitted line, whatever the lengths")
	fs.Float64Var(&c.StepScale, "step-scale", c.StepScale, "every engine step this many times the profile's (0.5 to 2), the calibration's too: with -saturated, the same arrivals served a few percent slower (what the real processes' host time between steps does, docs/benchmarks.md)")
	fs.BoolVar(&c.ApplyTiming, "apply-timing", c.ApplyTiming, "time fsm.Apply on the wall clock (apply_*_p99_ms); false makes the JSON byte-identical for a seed")
	fs.StringVar(&c.JSONPath, "json", "", "write setup → column → figures as JSON (with -figure: the figure's points)")
	fs.StringVar(&c.TracePath, "trace", "", "a CSV trace in the Azure LLM inference 2023 format (TIMESTAMP, ContextTokens, GeneratedTokens) instead of the generator; rescaled in time to -load")
	fs.StringVar(&c.CSVPath, "csv", "", "write every column's time series (1 s bins: arrivals, mean TTFT, mean queue) as CSV")
	fs.StringVar(&c.SVGPath, "svg", "", "with -figure or -replot: plot the figure as SVG")
	fs.StringVar(&c.Replot, "replot", "", "plot a figure's JSON written by -figure -json (with -svg), running nothing")
	fs.IntVar(&c.Seeds, "seeds", c.Seeds, "with -figure: run every point with this many seeds (from -seed) and report the means")
	fs.StringVar(&c.Figure, "figure", "", "run a figure instead: "+strings.Join(sim.FigureNames, ", ")+" (64 workers unless -workers; -quick shortens), spec-k (adaptive K against fixed K = 0 … 8, one target and its drafter), or burst (live migration off/on under Gamma arrivals: 8 and 64 workers unless -workers, loads 0.7, 0.85, 1 unless -load), or gateways (issue 16's balance: dispatch inside Apply against 1 and 4 gateways with lagging views, 64 workers unless -workers, load 0.7 unless -load, 300 s unless -duration; -seeds averages), or llumnix (issue 23: Llumnix's evaluation, 16 LLaMA-7B/A10 workers, its Zipf traces and rates, round-robin, infaas++ (no migration) and lumen (migration) on the same arrivals: -trace-mix, -arrivals, -requests, -seed), or prefix (issue 25: freeness alone against prefix-aware placement, both with the workers' prefix caches, on llm-d's shared-prefix benchmark (8 Qwen3-32B workers of two H100s, Poisson 3 → 60 QPS), multi-turn chat and no reuse: -prefix-routing, -seed, -quick, -workers), or cells (issue 26: the same gateways over one quorum and over -cells cells, failure-free: TTFT, each cell's Raft write stream against one quorum's measured capacity, and the simulator's own cost; 1,024 workers unless -workers, 4 gateways unless -gateways, 60 s unless -duration), or degradation (issue 22: what one failure costs stop-and-restart, its TTFT mean and p99 and TPOT mean over the affected requests against no-checkpoint-no-failure's on the same requests, only those two columns run: w4 and w8 at their stress unless -setups or -workers, loads 0.6, 0.7, 0.8, 0.85, 0.9, 0.95 unless -load, reloads warm and cold unless -reload; -quick shortens, -seeds averages)")
	fs.IntVar(&c.Gateways, "gateways", 0, "issue 16's dispatch: this many gateways choose the serving worker from their own lagging replica of the load table (internal/placer), the request starting there before its placement commits; 0 = the dispatch inside Apply. With -figure gateways: the gateway counts to compare with Apply (default 1,4)")
	fs.StringVar(&c.GatewayChoice, "gateway-choice", c.GatewayChoice, "with -gateways: how a gateway chooses ("+strings.Join(sim.GatewayChoices, ", ")+"; partition-fill is internal/placer's choice among several gateways, what lumen's gateways run; freest is PickServing alone, the placer before shares, the ablation); with -figure gateways, the choice run beside freest")
	fs.Float64Var(&c.GatewayBias, "gateway-bias", c.GatewayBias, "with -gateway-choice partition-fill: the preference for the gateway's own share of the workers; only internal/placer's (0.15) runs")
	fs.StringVar(&c.Migration, "migration", c.Migration, "live migration for balance (Llumnix; the leader's round every 500 ms): on or off")
	fs.IntVar(&c.KVPages, "kv-pages", 0, "with -figure burst: a worker's KV cache in 16-token pages (0: the profile's GPU); smaller puts the workers under memory pressure")
	fs.Float64Var(&c.CV, "cv", c.CV, "with -figure burst: the arrivals' coefficient of variation (Gamma gaps; 0 or 1 is Poisson)")
	fs.StringVar(&c.TraceMix, "trace-mix", "", "with -figure llumnix: Llumnix's generated traces to run, IN-OUT mean lengths, comma-separated (default: all five, 128-128,256-256,512-512,128-512,512-128), each at Llumnix's request rates (-xs: the rates, for one trace)")
	fs.Float64Var(&c.PriorityFraction, "priority-fraction", 0, "with -figure llumnix: Llumnix's priority experiment, this share of the requests of high priority (Llumnix's: 0.1); the columns are infaas++, lumen and lumen+priority, the trace 128-128 at 26 req/s unless -trace-mix and -xs, with per-class figures (high_*, normal_*) and priority_gains")
	fs.StringVar(&c.Arrivals, "arrivals", c.Arrivals, "with -figure llumnix: poisson or gamma:CV (Llumnix's CVs: 2, 4, 6, 8)")
	fs.StringVar(&c.Rates, "rates", c.Rates, "with -figure llumnix: llumnix (each trace at Llumnix's request rates) or saturation (at 0.85, 0.9, 0.95 and 1 of the simulated cluster's saturated rate, measured per trace; -xs: the fractions)")
	fs.DurationVar(&c.MigrationInterval, "migration-interval", 0, "with -figure llumnix: the leader's migration round period (default the controller's, 500ms)")
	fs.IntVar(&c.Requests, "requests", c.Requests, "with -figure llumnix: requests a run (Llumnix's: 10000)")
	fs.StringVar(&c.MigrationPlan, "migration-plan", c.MigrationPlan, "with -figure llumnix: how the lumen column's leader uses the migration policy's plan: as-planned (the controller's) or no-redispatch (without its balance re-dispatches of blocked workers' queued requests)")
	fs.Float64Var(&c.SpecAlpha, "spec-alpha", c.SpecAlpha, "lumen's speculation: the probability that a draft token equals the target's (docs/calibration.md)")
	fs.IntVar(&c.SpecK, "spec-k", 0, "lumen's speculation: drafts verified per request per step; 0 = adaptive (chosen each step from the measured acceptance and the step-cost model)")
	fs.IntVar(&c.GPUsPerNode, "gpus-per-node", 0, "failure domains (issue 24): put the workers on nodes of this many, in id order (worker-1 … worker-N on node-1), each registering its node; 0: no nodes. With it, -fail's workers are drawn at random (from -seed) outside the failed nodes")
	fs.IntVar(&c.FailNodes, "fail-nodes", 0, "with -gpus-per-node: every worker of this many nodes (node-1 …) fails at once, at -fail-at, besides -fail's")
	fs.IntVar(&c.CheckpointReplicas, "checkpoint-replicas", c.CheckpointReplicas, "copies of each request's checkpoint, each on a node of its own, none on the serving worker's (1 … "+strconv.Itoa(policy.MaxCheckpointReplicas)+"; fixed-checkpoint keeps one)")
	fs.StringVar(&c.Domains, "domains", c.Domains, "with -gpus-per-node: aware (the workers register their nodes and h(r) keeps checkpoints off the serving worker's node) or blind (they do not: h(r) as before, while a node's workers still fail together)")
	fs.StringVar(&c.PrefixRouting, "prefix-routing", c.PrefixRouting, "issue 25: on turns on the workers' prefix caches and places each request by internal/placer's prefix-aware score (its cached prefix against the worker's freeness); off: freeness alone, no cache. With -figure prefix: run only that column (default both)")
	fs.IntVar(&c.Cells, "cells", c.Cells, "issue 26: split the workers (-workers is the total) into this many cells, each its own controller quorum (fsm) over workers/cells of them (whole -gpus-per-node nodes), a request and its checkpoint holders in one cell; needs -gateways >= 1, which choose the cell, then the worker (sim/cells.go). 1 = one quorum. With -figure cells: the cell count run beside 1 (default 4; -xs: the counts)")
	fs.StringVar(&c.Columns, "columns", "", "comma-separated columns to run (default: all); a failed column needs its reference, lumen needs lumen-no-spec")
	fs.BoolVar(&c.SpecTrace, "spec-trace", false, "issue 22: print where the TTFT of the requests arriving while drafters assist goes, lumen against lumen-no-spec on the same arrivals (queueing at assisted and other workers, the assisted workers' steps with and without verification, K, acceptance); with -figure, also every point's tables")
	fs.Float64Var(&c.Saturated, "saturated", 0, "the saturated throughput in requests per second that -load is a fraction of, instead of the calibration's measure: the same arrivals as a run whose calibration measured it (its JSON's saturated_rate_per_s), for before/after comparisons of a change that moves the calibration (a 64-worker figure's points: one x at a time). The studies of one setup, -figure failures, load, proportional, lambda, budget and cells")
	fs.StringVar(&c.TraceDir, "trace-dir", "", "write every column's requests (arrival, TTFT, admission, worker) and engine steps as CSV into this directory, for analysis by hand (sim/spectrace.go)")
	fs.IntVar(&c.CalibrationWorkers, "calibration-workers", 0, "calibrate on a cluster of this many workers and scale the saturated rate to -workers (the studies: 0 = at full size; -figure cells: 64 unless given)")
	decodeRuns := fs.Bool("decode-runs", true, "the simulator's decode runs (issue 26): a worker whose batch only decodes touches each request once per several steps; false steps every request every step as before (the same results, slower)")
	cpuprofile := fs.String("cpuprofile", "", "write the run's CPU profile (runtime/pprof) to this file")
	memprofile := fs.String("memprofile", "", "write a heap profile (runtime/pprof: live and allocated bytes) to this file at the end")
	if err := fs.Parse(args); err != nil {
		return err
	}
	fs.Visit(func(f *flag.Flag) { c.Given[f.Name] = true })
	sim.SetDecodeRuns(*decodeRuns)
	if limit, ok := simMemoryLimit(); ok {
		debug.SetMemoryLimit(limit)
	}
	b, err := parseBytes(budget)
	if err != nil {
		return fmt.Errorf("-checkpoint-budget: %w", err)
	}
	c.Budget = b
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			return fmt.Errorf("-cpuprofile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("-cpuprofile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	if *memprofile != "" {
		defer func() {
			f, err := os.Create(*memprofile)
			if err != nil {
				fmt.Fprintf(os.Stderr, "-memprofile: %v\n", err)
				return
			}
			defer f.Close()
			runtime.GC()
			if err := pprof.WriteHeapProfile(f); err != nil {
				fmt.Fprintf(os.Stderr, "-memprofile: %v\n", err)
			}
		}()
	}
	return c.Run()
}

// simMemoryLimit is lumen sim's soft memory limit (debug.SetMemoryLimit)
// when GOMEMLIMIT does not set one: half the memory of the machine, or of
// the cgroup when it has less. A long run's live heap grows with it (its
// requests' records); with the collector's default (GOGC=100) the heap
// may reach twice its live size before a collection, so a run of 8 GB
// live would take 16 GB. Near the limit the collector runs more often
// instead. GOGC stays the default: the collector is about 2% of the
// simulator's CPU (GODEBUG=gctrace=1 at 10,000 workers), and a larger
// GOGC measured no faster at 2,000 workers (docs/benchmarks.md, "Issue 26:
// the simulator's speed"). ok is false when GOMEMLIMIT is set or the
// memory cannot be read.
func simMemoryLimit() (int64, bool) {
	if os.Getenv("GOMEMLIMIT") != "" {
		return 0, false
	}
	total := int64(0)
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if rest, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
				if err == nil {
					total = kb * 1024
				}
			}
		}
	}
	if b, err := os.ReadFile("/sys/fs/cgroup/memory.max"); err == nil {
		if n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil && n > 0 && (total == 0 || n < total) {
			total = n
		}
	}
	if total <= 0 {
		return 0, false
	}
	return total / 2, true
}
