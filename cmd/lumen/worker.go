package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/lumen-project/lumen/gpu"
	"github.com/lumen-project/lumen/internal/gossip"
	"github.com/lumen-project/lumen/worker"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// draftProfile times the draft model when the target is paced.
const draftProfile = "qwen3-0.6b-h100"

func init() {
	register("worker", "run a worker: an inference engine serving Generate, registered with the controllers", runWorker)
}

func runWorker(args []string) error {
	cfg := worker.DefaultConfig()
	fs := flag.NewFlagSet("worker", flag.ContinueOnError)
	fs.StringVar(&cfg.ID, "id", "", "worker id (required)")
	fs.StringVar(&cfg.Node, "node", os.Getenv("LUMEN_NODE"), "failure domain: the host this worker runs on (env LUMEN_NODE; in Kubernetes the downward API's spec.nodeName). Workers of one node fail together, so no request's checkpoint goes to a worker of its serving worker's node, and -checkpoint-replicas copies go to as many nodes (empty: a domain of its own)")
	fs.StringVar(&cfg.Rack, "rack", os.Getenv("LUMEN_RACK"), "failure domain above -node: the worker's rack (env LUMEN_RACK), recorded in the worker table")
	fs.StringVar(&cfg.DataDir, "data-dir", "", "directory for the incarnation counter")
	fs.StringVar(&cfg.GRPCAddr, "grpc-addr", "127.0.0.1:7500", "Inference API host:port")
	fs.StringVar(&cfg.HTTPAddr, "http-addr", "", "host:port for /metrics, /healthz, /readyz (empty: off)")
	fs.StringVar(&cfg.SerfAddr, "serf-addr", "127.0.0.1:7600", "Serf gossip host:port (empty: no gossip)")
	join := fs.String("join", "", "comma-separated Serf addresses to join (controllers)")
	controllers := fs.String("controllers", "", "comma-separated controller gRPC addresses (empty: standalone)")
	gossipKey := fs.String("gossip-key", os.Getenv("LUMEN_GOSSIP_KEY"), "base64 key (16, 24 or 32 bytes) encrypting Serf traffic: the controllers' -gossip-key (env LUMEN_GOSSIP_KEY, which keeps it off the command line)")
	fs.StringVar(&cfg.TLS.Cert, "tls-cert", "", "PEM certificate for the Inference API and calls to controllers and workers (mutual TLS)")
	fs.StringVar(&cfg.TLS.Key, "tls-key", "", "PEM private key")
	fs.StringVar(&cfg.TLS.CA, "tls-ca", "", "PEM CA certificate that signs every peer")
	backend := fs.String("engine", "transformer", "transformer or synthetic")
	modelDir := fs.String("model-dir", engine.DefaultModelDir(), "model directory (made on first use when absent)")
	profileName := fs.String("profile", "none", "timing profile to emulate: none, "+strings.Join(profileNames(), ", "))
	timeScale := fs.Float64("time-scale", 1, "scale the profile's times (0.1 = ten times faster)")
	emulateLoad := fs.Bool("emulate-load", true, "with a profile, take the profile's model-load time before serving")
	loadScale := fs.Float64("load-scale", 0, "scale the emulated model-load time alone (default: -time-scale)")
	pages := fs.Int("kv-pages", 0, "KV cache pages of 16 tokens (default: the profile's GPU, or 4096 for the transformer)")
	budget := fs.String("checkpoint-budget", "1GiB", "host memory for other workers' checkpoints (e.g. 80GB, 512MiB)")
	fs.IntVar(&cfg.TokenBudget, "token-budget", cfg.TokenBudget, "tokens one engine step may compute")
	fs.IntVar(&cfg.MaxRunning, "max-running", cfg.MaxRunning, "most requests in the running batch")
	fs.IntVar(&cfg.MaxWaiting, "max-waiting", cfg.MaxWaiting, "most requests in the waiting queue; a new request beyond it is refused (ResourceExhausted, naming the limit)")
	fs.IntVar(&cfg.SpecK, "spec-k", cfg.SpecK, "drafts verified per request per step while a drafter assists, without a -profile (with one, K adapts); 0 refuses drafts; at most "+strconv.Itoa(core.MaxSpecK))
	draftAlpha := fs.Float64("draft-alpha", core.PriorAcceptance, "synthetic engine: the probability that the draft proposes the target's next token, per position")
	draftSeed := fs.Uint64("draft-seed", 1, "synthetic engine: the seed of the draft's agreement")
	progressive := fs.Bool("progressive", true, "after a failure, recover progressively: load the draft, assist a survivor while the model loads, then hot-swap it in (false: load the model at once, as on a fresh start)")
	fs.DurationVar(&cfg.MigrationTimeout, "migration-timeout", cfg.MigrationTimeout, "how long a request migrating here waits for its source's next stage (and, after the last, for its call) before its pages are reclaimed")
	fs.Func("preemption", "a running request short of a KV page: wait (it sits the step out, its cache kept; the default) or vllm (it preempts the newest running request, by recompute, as vLLM's scheduler does)", func(v string) (err error) {
		cfg.Preemption, err = core.ParsePreemption(v)
		return err
	})
	fs.Func("prefix-cache", "on or off (the default): keep full KV pages under their prefix hash after their request ends and share them, read-only, with later requests whose history starts with them (automatic prefix caching; LRU eviction of unreferenced pages; events on Inference.WatchKV)", func(v string) error {
		switch v {
		case "on":
			cfg.PrefixCache = true
		case "off":
			cfg.PrefixCache = false
		default:
			return fmt.Errorf("%q: use on or off", v)
		}
		return nil
	})
	decodeContext := fs.Bool("decode-context", false, "with a profile, a decode step grows with the context its rows read (engine.Profile.DecodeContext; docs/calibration.md)")
	reloadFlag := fs.String("reload", "warm", "with a profile, the emulated model load: warm (weights in the page cache), cold (a replacement node: cold storage, cold compile caches) or a duration for the whole load")
	interconnect := fs.String("interconnect", "", "with a profile, the KV copy bandwidth to another worker per second (live migration), e.g. 25GB (default: the profile's)")
	faultFile := fs.String("gpu-fault-file", "", "report a GPU fault for each line appended to this file (xid 79, ecc-double-bit): a drill, or a test, without a GPU; with NVML the driver's events are watched anyway")
	level := fs.String("log-level", "info", "trace, debug, info, warn or error")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if cfg.ID == "" {
		return fmt.Errorf("-id is required")
	}
	// Before the model loads: worker.New's Validate would say it minutes later.
	if err := core.CheckSpecK(cfg.SpecK); err != nil {
		return fmt.Errorf("-spec-k: %w", err)
	}
	var err error
	if cfg.CheckpointBudget, err = parseBytes(budget); err != nil {
		return fmt.Errorf("-checkpoint-budget: %w", err)
	}
	if *join != "" {
		cfg.Join = strings.Split(*join, ",")
	}
	if *controllers != "" {
		cfg.Controllers = strings.Split(*controllers, ",")
	}
	if cfg.GossipKey, err = gossip.ParseKey(*gossipKey); err != nil {
		return err
	}
	logger := hclog.New(&hclog.LoggerOptions{Name: "worker", Level: hclog.LevelFromString(*level), Output: os.Stderr})
	cfg.Logger = logger
	profile, paced, err := engine.LookupProfile(*profileName)
	if err != nil {
		return err
	}
	fallback := gpu.Device{Name: "CPU (no GPU emulated)"}
	if paced {
		fallback = gpu.Device{Name: profile.GPU, MemoryBytes: uint64(profile.GPUMemBytes)}
		cfg.Profile = &profile
	}
	found := gpu.Discover(fallback)
	if !found.NVML {
		logger.Info(found.Reason)
	} else {
		cfg.GPUHealth = gpu.NVML{}
		for _, d := range found.Devices {
			logger.Info("GPU", "index", d.Index, "name", d.Name, "uuid", d.UUID, "memory_mib", d.MemoryBytes>>20)
			cfg.GPUs = append(cfg.GPUs, d.UUID)
		}
		if paced && found.Devices[0].MemoryBytes > 0 {
			// KV capacity follows the real device's memory.
			profile.GPUMemBytes = int64(found.Devices[0].MemoryBytes)
			cfg.Profile = &profile
		}
	}
	if *faultFile != "" {
		if cfg.GPUHealth != nil {
			logger.Warn("-gpu-fault-file replaces the NVML health events", "file", *faultFile)
		}
		cfg.GPUHealth = gpu.FaultFile{Path: *faultFile}
	}
	if *interconnect != "" {
		if !paced {
			return fmt.Errorf("-interconnect needs a -profile: it paces the copy of the profile's KV bytes")
		}
		bw, err := parseBytes(interconnect)
		if err != nil || bw == 0 {
			return fmt.Errorf("-interconnect %q: a positive size per second, like 25GB", *interconnect)
		}
		profile.InterconnectBytesPerSec = float64(bw)
		cfg.Profile = &profile
	}
	reload, err := engine.ParseReload(*reloadFlag)
	if err != nil {
		return fmt.Errorf("-reload: %w", err)
	}
	if (*decodeContext || reload != engine.Reload{}) && !paced {
		return fmt.Errorf("-decode-context and -reload need a -profile: they change its emulated times")
	}
	if paced {
		profile.DecodeContext = *decodeContext
		if profile, err = profile.WithReload(reload); err != nil {
			return fmt.Errorf("-reload: %w", err)
		}
		cfg.Profile = &profile
	}
	if *timeScale <= 0 || *loadScale < 0 {
		return fmt.Errorf("-time-scale (%g) must be > 0 and -load-scale (%g) >= 0", *timeScale, *loadScale)
	}
	if *loadScale == 0 {
		*loadScale = *timeScale
	}
	// The engine starts unloaded: the worker loads it, at once on a fresh
	// start, progressively after a failure (worker.Recovery).
	var eng, draft engine.Engine
	var stages engine.Stages
	switch *backend {
	case "transformer":
		path, err := engine.EnsureModel(*modelDir)
		if err != nil {
			return err
		}
		n := *pages
		if n == 0 {
			n = 4096
		}
		t, err := engine.NewTransformer(engine.TransformerConfig{Path: path, Pages: n})
		if err != nil {
			return err
		}
		d, err := engine.NewTransformer(engine.TransformerConfig{Path: filepath.Join(filepath.Dir(path), engine.DraftFile), Pages: n})
		if err != nil {
			return fmt.Errorf("the draft model (run lumen model init to write it): %w", err)
		}
		t.Unload()
		d.Unload()
		eng, draft, stages = t, d, engine.TransformerStages(t)
	case "synthetic":
		n := *pages
		if n == 0 {
			n = 4096
			if paced {
				n = profile.KVPages()
			}
		}
		sc := engine.SyntheticConfig{Pages: n}
		if paced {
			sc.KVBytesPerToken, sc.WeightBytes, sc.Model, sc.MaxContext = profile.KVBytesPerToken(), profile.WeightBytes, profile.Model, profile.MaxContext
		}
		s, err := engine.NewSynthetic(sc)
		if err != nil {
			return err
		}
		dc := sc
		dc.Model = ""
		if paced {
			dp := engine.Profiles[draftProfile]
			dc.KVBytesPerToken, dc.WeightBytes, dc.Model = dp.KVBytesPerToken(), dp.WeightBytes, dp.Model+" (synthetic draft)"
		}
		d, err := engine.NewSyntheticDraft(dc, *draftAlpha, *draftSeed)
		if err != nil {
			return fmt.Errorf("-draft-alpha: %w", err)
		}
		s.Unload()
		d.Unload()
		eng, draft, stages = s, d, engine.LoadStages(s)
	default:
		return fmt.Errorf("-engine %q: use transformer or synthetic", *backend)
	}
	loadDraft := draft.Load
	if paced {
		// The profile's times: the draft's load (LOADING_DRAFT) and steps,
		// the target's disk read and initialisation (ToHost), its copy to
		// the device (HOTSWAP).
		dp := engine.Profiles[draftProfile]
		if reload.Kind == engine.ReloadCold {
			dp, _ = dp.WithReload(reload) // its weights from cold storage too
		}
		if *emulateLoad {
			stages = stages.Paced(profile, *loadScale)
			loadDraft = engine.NewPaced(draft, dp, *loadScale).Load
			logger.Info("loads take the profile's times", "profile", profile.Name, "load", time.Duration(float64(profile.LoadTime())**loadScale),
				"draft", dp.Name, "draft_load", time.Duration(float64(dp.LoadTime())**loadScale))
		}
		eng = engine.NewPaced(eng, profile, *timeScale)
		draft = engine.NewPaced(draft, dp, *timeScale)
	}
	cfg.Recovery = &worker.Recovery{Draft: draft, LoadDraft: loadDraft, Target: stages, Direct: !*progressive}
	cfg.Engine = eng
	w, err := worker.New(cfg)
	if err != nil {
		return err
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	select {
	case s := <-sig:
		logger.Info("draining", "signal", s.String())
		w.Shutdown(context.Background())
	case <-w.Exited():
		logger.Info("drained and left")
	}
	return nil
}

func profileNames() []string {
	var out []string
	for n := range engine.Profiles {
		out = append(out, n)
	}
	return sortStrings(out)
}

// parseBytes reads sizes like 80GB, 512MiB or 1048576.
func parseBytes(s *string) (uint64, error) {
	v := strings.TrimSpace(*s)
	units := []struct {
		suffix string
		mult   float64
	}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}, {"B", 1}}
	for _, u := range units {
		if strings.HasSuffix(v, u.suffix) {
			var f float64
			if _, err := fmt.Sscan(strings.TrimSuffix(v, u.suffix), &f); err != nil || f < 0 {
				return 0, fmt.Errorf("%q is not a size like 80GB or 512MiB", v)
			}
			return uint64(f * u.mult), nil
		}
	}
	var n uint64
	if _, err := fmt.Sscan(v, &n); err != nil {
		return 0, fmt.Errorf("%q is not a size like 80GB or 512MiB", v)
	}
	return n, nil
}
