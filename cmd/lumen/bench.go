package main

import (
	"flag"
	"fmt"
	"strconv"
	"strings"

	"github.com/lumen-project/lumen/bench"
	"github.com/lumen-project/lumen/sim"
)

func init() {
	register("bench controller", "measure a 3-replica quorum: Dispatch/s, linearizable reads/s, failover", runBenchController)
	register("bench gateway", "TTFT and throughput through the gateway vs straight to the worker, at 1/100/500 streams", runBenchGateway)
	register("bench spread", "the spread of running requests across workers with 1, 2 and 4 gateways (the simulator's gateways figure, on real processes)", runBenchSpread)
	register("bench pacing", "64 paced synthetic engines decoding at once: does each step take the profile's time?", runBenchPacing)
	register("bench migration", "live migration on real processes: downtime vs context length, slowdown, burst balance, drain", runBenchMigration)
	register("bench recovery", "the recovery strategies side by side on real processes: one worker (or 4 of 8) killed under an Azure-like load", runBenchRecovery)
}

func runBenchController(args []string) error {
	var cfg bench.ControllerConfig
	fs := flag.NewFlagSet("bench controller", flag.ContinueOnError)
	fs.BoolVar(&cfg.Quick, "quick", false, "short run (under a minute) with the same keys")
	fs.StringVar(&cfg.CPUProfileLeader, "cpuprofile-leader", "", "save a CPU profile of the leader during the 256-caller run")
	fs.StringVar(&cfg.JSONPath, "json", "", "write the figures as JSON to this file")
	var extra stringList
	fs.Var(&extra, "controller-arg", "extra flag for every controller (repeatable), e.g. -controller-arg=-batch-inflight=2")
	fs.StringVar(&cfg.Dir, "dir", "", "data and log directory (default: a temporary one, removed afterwards)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg.ControllerArgs = extra
	return bench.Controller(cfg)
}

func runBenchGateway(args []string) error {
	cfg := bench.DefaultGatewayConfig()
	fs := flag.NewFlagSet("bench gateway", flag.ContinueOnError)
	fs.BoolVar(&cfg.Quick, "quick", false, "shorter phases")
	fs.StringVar(&cfg.JSONPath, "json", "", "write the figures as JSON")
	fs.StringVar(&cfg.Profile, "profile", cfg.Profile, "the worker's timing profile")
	fs.IntVar(&cfg.PromptLen, "prompt", cfg.PromptLen, "prompt tokens")
	fs.IntVar(&cfg.MaxTokens, "max-tokens", cfg.MaxTokens, "output tokens per request")
	fs.StringVar(&cfg.CPUProfile, "cpuprofile", "", "write the gateway's CPU profile of the 500-stream phase through it to this file")
	streams := fs.String("streams", "1,100,500", "comma-separated concurrent stream counts, one load each (1..20000)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg.Streams = nil
	for _, f := range strings.Split(*streams, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || n > 20000 {
			return fmt.Errorf("-streams: %q is not a stream count in 1..20000", f)
		}
		cfg.Streams = append(cfg.Streams, n)
	}
	return bench.Gateway(cfg)
}

func runBenchPacing(args []string) error {
	cfg := bench.DefaultPacingConfig()
	fs := flag.NewFlagSet("bench pacing", flag.ContinueOnError)
	fs.IntVar(&cfg.Workers, "workers", cfg.Workers, "engines decoding concurrently")
	fs.IntVar(&cfg.Batch, "batch", cfg.Batch, "sequences per decode step")
	fs.StringVar(&cfg.Profile, "profile", cfg.Profile, "timing profile")
	fs.Float64Var(&cfg.TimeScale, "time-scale", cfg.TimeScale, "time scale")
	fs.DurationVar(&cfg.Duration, "duration", cfg.Duration, "how long each engine decodes")
	fs.StringVar(&cfg.JSONPath, "json", "", "write the figures as JSON")
	if err := fs.Parse(args); err != nil {
		return err
	}
	return bench.Pacing(cfg)
}

func runBenchRecovery(args []string) error {
	cfg := bench.DefaultRecoveryConfig()
	fs := flag.NewFlagSet("bench recovery", flag.ContinueOnError)
	fs.BoolVar(&cfg.Quick, "quick", false, "shorter runs and a faster emulated model reload, same keys")
	fs.StringVar(&cfg.JSONPath, "json", "", "write the figures as JSON")
	fs.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "workload seed (the same for every strategy)")
	fs.Float64Var(&cfg.Load, "load", cfg.Load, "offered load as a fraction of the cluster's measured saturated throughput, in (0, 1.5] (named setups: their own unless given, 0.9 for w4, w8, w8_f4; this for the -mild ones)")
	fs.StringVar(&cfg.Setups, "setups", cfg.Setups, "comma-separated setups to run: w4, w8, w8_f4 (the seed's stress: batch cap 256, the context-dependent decode step, a cold reload, load 0.9, 360 s with the failure at 60 s; -quick scales the run and the reload by 0.3), w4-mild, w8-mild, w8_f4-mild (the earlier: caps 64 and 32, warm reload, load 0.7, 120 s); -load, -reload, -detect, -decode-context and -max-running given override every setup's")
	fs.IntVar(&cfg.MaxRunning, "max-running", 0, "override every setup's batch cap, the workers' -max-running (vLLM's --max-num-seqs default is 256; 0: the setup's, 256 in w4, w8, w8_f4; w4-mild 64, w8-mild and w8_f4-mild 32)")
	fs.IntVar(&cfg.TokenBudget, "token-budget", 0, "override every setup's step token budget, the workers' -token-budget (0: the setup's, 2048; vLLM's chunked prefill takes 2048-8192)")
	fs.StringVar(&cfg.Reload, "reload", cfg.Reload, "a restarted worker's emulated reload: warm (the same host: weights in the page cache, 23.6s for Qwen3-14B), cold (a replacement node: weights at 0.4 GB/s, engine init with cold compile caches 60s) or a duration for the whole reload (named setups: their own unless given, cold for w4, w8, w8_f4; this for the -mild ones)")
	fs.StringVar(&cfg.DecodeContext, "decode-context", cfg.DecodeContext, "on: the workers' decode step grows with the context its rows read (docs/calibration.md); off: the profile's fitted line (named setups: their own unless given, on for w4, w8, w8_f4, off for the -mild ones)")
	fs.StringVar(&cfg.TracePath, "trace", "", "a CSV trace in the Azure LLM inference 2023 format (TIMESTAMP, ContextTokens, GeneratedTokens) whose arrivals, rescaled in time to -load, replace the Poisson generator (as lumen sim -trace)")
	fs.StringVar(&cfg.Detect, "detect", cfg.Detect, "the failure: fast (kill -9, detected on the fast path) or hang (SIGSTOP: detected by Serf, then killed and restarted) (named setups: their own unless given, fast for all of them)")
	fs.Float64Var(&cfg.TimeScale, "time-scale", cfg.TimeScale, "slow every emulated time, arrivals included, by this factor (for a host too slow at 1; every figure is still reported in emulated time, as lumen sim reports it)")
	fs.StringVar(&cfg.Dir, "dir", "", "keep logs and data here (default: a temporary directory, removed)")
	fs.IntVar(&cfg.CheckpointReplicas, "checkpoint-replicas", 0, "copies of each request's checkpoint, each on a node of its own, none on the serving worker's (1 … 4; 0: one; fixed-checkpoint keeps one)")
	fs.StringVar(&cfg.Columns, "columns", "", "comma-separated columns to run (default: all): stop-and-restart, recompute, fixed-checkpoint, lumen-no-spec, lumen, lumen-no-failure, no-checkpoint-no-failure")
	fs.IntVar(&cfg.Nodes, "nodes", 0, "put each setup's workers on this many hosts, in order, each registering its node (failure domains: no checkpoint on its serving worker's node), and kill every worker of node-1 at once instead of worker-1 … worker-K (2 … the setup's workers; 0: no nodes)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg.Given = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { cfg.Given[f.Name] = true })
	return bench.Recovery(cfg)
}

func runBenchMigration(args []string) error {
	cfg := bench.DefaultMigrationConfig()
	fs := flag.NewFlagSet("bench migration", flag.ContinueOnError)
	fs.BoolVar(&cfg.Quick, "quick", false, "fewer migrations per length and a shorter burst (under 5 minutes), same keys")
	fs.StringVar(&cfg.JSONPath, "json", "", "write the figures as JSON (after every phase)")
	fs.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the prompts and of the burst's arrivals")
	fs.Float64Var(&cfg.Load, "load", cfg.Load, "the burst's mean offered load as a fraction of the cluster's modelled saturated throughput")
	fs.StringVar(&cfg.Phases, "phases", cfg.Phases, "comma-separated phases to run: downtime, burst, drain (the default three), llumnix (issue 23: Llumnix's comparison on real processes, -trace, -arrivals, -rate, -requests)")
	fs.IntVar(&cfg.BurstKVPages, "burst-kv-pages", 0, "KV pages of each burst worker (default: the profile's GPU); fewer make memory bind before the batch cap")
	fs.StringVar(&cfg.Dir, "dir", "", "keep logs and data here (default: a temporary directory, removed)")
	fs.StringVar(&cfg.Profile, "profile", "", "every worker's timing profile (default qwen3-14b-h100, and llama-7b-a10, Llumnix's instance, for the llumnix phase)")
	fs.StringVar(&cfg.Llumnix.Trace, "trace", cfg.Llumnix.Trace, "with -phases llumnix: Llumnix's generated trace, IN-OUT mean lengths (128-128, 256-256, 512-512, 128-512, 512-128)")
	arrivals := fs.String("arrivals", sim.ArrivalsName(cfg.Llumnix.CV), "with -phases llumnix: poisson or gamma:CV (Llumnix's CVs: 2, 4, 6, 8)")
	fs.Float64Var(&cfg.Llumnix.Rate, "rate", 0, "with -phases llumnix: arrivals per second (default: Llumnix's middle rate for the trace on 16 instances, scaled to -workers)")
	fs.IntVar(&cfg.Llumnix.Requests, "requests", cfg.Llumnix.Requests, "with -phases llumnix: requests a column (the same arrivals for both)")
	fs.IntVar(&cfg.Llumnix.Workers, "workers", cfg.Llumnix.Workers, "with -phases llumnix: paced synthetic workers")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var err error
	if cfg.Llumnix.CV, err = sim.ParseArrivals(*arrivals); err != nil {
		return err
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, f := range []string{"trace", "arrivals", "rate", "requests", "workers"} {
		if given[f] && !strings.Contains(cfg.Phases, "llumnix") {
			return fmt.Errorf("-%s applies to -phases llumnix only (-phases is %q)", f, cfg.Phases)
		}
	}
	return bench.Migration(cfg)
}

// stringList is a repeatable string flag.
type stringList []string

func (s *stringList) String() string     { return fmt.Sprint(*s) }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

func runBenchSpread(args []string) error {
	cfg := bench.DefaultSpreadConfig()
	fs := flag.NewFlagSet("bench spread", flag.ContinueOnError)
	gws := fs.String("gateways", "1,2,4", "comma-separated gateway counts, one cluster each")
	fs.IntVar(&cfg.Workers, "workers", cfg.Workers, "synthetic workers")
	fs.Float64Var(&cfg.Rate, "rate", cfg.Rate, "arrivals per second over all gateways (Poisson)")
	fs.DurationVar(&cfg.Warmup, "warmup", cfg.Warmup, "time before the samples start")
	fs.DurationVar(&cfg.Duration, "duration", cfg.Duration, "time the samples are taken over")
	fs.StringVar(&cfg.Profile, "profile", cfg.Profile, "the workers' timing profile")
	fs.IntVar(&cfg.MaxTokens, "max-tokens", cfg.MaxTokens, "output tokens per request: uniform in 1..this")
	fs.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "arrivals and lengths seed")
	fs.StringVar(&cfg.Bin, "bin", "", "the lumen binary the cluster runs (default: this one), to measure another commit")
	fs.StringVar(&cfg.JSONPath, "json", "", "write the figures as JSON")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg.Gateways = nil
	for _, f := range strings.Split(*gws, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return fmt.Errorf("-gateways %q: want counts of at least 1, comma-separated", *gws)
		}
		cfg.Gateways = append(cfg.Gateways, n)
	}
	return bench.Spread(cfg)
}
