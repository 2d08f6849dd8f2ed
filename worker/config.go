// Package worker is lumen's worker daemon: one per GPU. It serves Generate
// with continuous batching over an engine's paged KV cache, registers with
// the controller quorum, gossips in Serf, and reports its load.
//
// One goroutine, the scheduler, owns the waiting and running queues and
// drives the engine; the gRPC handlers reach it through channels, and each
// request's tokens flow back through a mailbox that never blocks the
// scheduler.
package worker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/lumen-project/lumen/gpu"
	"github.com/lumen-project/lumen/internal/tlsconf"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
	"github.com/lumen-project/lumen/worker/loadreport"
)

// Config configures a worker.
type Config struct {
	// ID names the worker in the controller and Serf. Required.
	ID string
	// Node and Rack are the worker's failure domains (issue 24), sent
	// with its registration: the host it runs on (in Kubernetes the
	// downward API's spec.nodeName), whose workers fail together, and its
	// rack. No request's checkpoint is placed on its serving worker's
	// node. Empty: a domain of its own.
	Node, Rack string
	// DataDir keeps the incarnation counter; empty derives incarnations from
	// the clock.
	DataDir string
	// GRPCAddr serves the Inference API. Required.
	GRPCAddr string
	// HTTPAddr serves /metrics, /healthz, /readyz; empty disables it.
	HTTPAddr string
	// SerfAddr is the gossip address; Join lists Serf members to join.
	SerfAddr string
	Join     []string
	// Controllers are controller gRPC addresses; empty runs standalone (no
	// registration, no load reports).
	Controllers []string
	// TLS, when enabled, serves the Inference API with mutual TLS and dials
	// the controllers and the other workers with this certificate: the
	// controllers' -tls-* files, a certificate the same CA signs.
	TLS tlsconf.Files
	// GossipKey encrypts Serf traffic (16, 24 or 32 bytes): the
	// controllers' key, or the worker is not let into their pool.
	GossipKey []byte

	// Engine serves the tokens. Required. Loaded already when Recovery is
	// nil; otherwise the worker loads it (Recovery.Target).
	Engine engine.Engine
	// Recovery, when set, is how the worker loads Engine: at once on a
	// fresh start, and, on a restart after a failure (the data directory's
	// run marker survived the last run: see progressive.go), by progressive
	// recovery — register in LOADING_DRAFT, load the draft, ASSIST the
	// partner the controller pairs it with while the target's weights load
	// into host memory, HOTSWAP them onto the device, then FULL_SERVICE.
	Recovery *Recovery
	// SpecK is the drafts per request this worker verifies per step while a
	// drafter assists it, when it has no Profile (default 4; 0 refuses
	// drafts; at most core.MaxSpecK). With a Profile, K is chosen each step (adaptive, up to
	// core.DefaultKMax) from the measured acceptance and the profile's cost
	// of the fused verification step: the CPU transformer has no GPU cost
	// model to choose by.
	SpecK int
	// Profile, when set, is the emulated GPU and model: it sets the KV bytes
	// per token and host-to-GPU bandwidth the controller accounts with.
	Profile *engine.Profile
	// CheckpointBudget is host memory for other workers' checkpoints, bytes.
	CheckpointBudget uint64

	// TokenBudget caps the tokens one step computes (prefill chunks plus
	// decodes; default 512). MaxRunning caps running requests (default 256);
	// MaxWaiting the waiting queue (default 4096).
	TokenBudget int
	MaxRunning  int
	MaxWaiting  int
	// Preemption is what a running request short of a KV page does
	// (core.Config.Preemption; default core.PreemptWait).
	Preemption core.Preemption
	// PrefixCache turns on automatic prefix caching (core.Config.PrefixCache;
	// worker/prefixcache.go): full KV pages kept under their prefix hash
	// and shared by later requests whose history starts with them. The
	// engine must share pages (engine.PageSharer).
	PrefixCache bool

	// LoadInterval is how often the reporter checks the load against
	// LoadRule (default 250 ms); it checks at once too when a request
	// arrives and after every engine step. A check writes nothing unless
	// the rule says a report is due.
	LoadInterval time.Duration
	// LoadRule is when a load report, a Raft entry, is sent (default
	// loadreport.DefaultRule(): on a threshold, else a 10 s heartbeat when
	// anything changed; docs/architecture.md, "Load reports").
	LoadRule loadreport.Rule
	// QueueWindow is the sliding window of q_w (default 10 s).
	QueueWindow time.Duration
	// DrainTimeout bounds graceful shutdown (default 30 s).
	DrainTimeout time.Duration
	// ReconcileInterval is how often a holder checks the requests it stores
	// checkpoint pages of against the placement table and frees those it
	// no longer holds (default 2 s): the longest a finished or moved
	// request's pages outlive its reservation, when its serving worker
	// could not release them.
	ReconcileInterval time.Duration

	// MigrationTimeout is how long a pre-allocation for a request migrating
	// in waits for the source's next stage (and, after the last, for the
	// request's call) before its pages are reclaimed (default 5 s). A
	// source that died mid-copy leaves its pages here that long for a
	// recovery to reuse.
	MigrationTimeout time.Duration
	// GPUHealth, when set, reports the GPU's faults (gpu.NVML on a machine
	// with an NVIDIA driver): a fault it does not survive drains the worker
	// by migration (drain.go). GPUs are the devices' UUIDs it watches.
	GPUHealth gpu.HealthSource
	GPUs      []string

	Logger hclog.Logger
}

// Recovery is what progressive recovery loads, and how.
type Recovery struct {
	// Draft is the draft engine, not loaded; LoadDraft loads it (the
	// LOADING_DRAFT phase). While the worker assists, the Drafter drives
	// Draft; it is unloaded at HOTSWAP.
	Draft     engine.Engine
	LoadDraft func(ctx context.Context) error
	// Target loads Config.Engine: ToHost in the background from the start
	// (through LOADING_DRAFT and ASSIST), ToDevice in HOTSWAP.
	Target engine.Stages
	// Direct loads the target at once after a failure too, as on a fresh
	// start: no draft, no assist (the ablation of progressive recovery).
	Direct bool
}

// DefaultConfig returns a Config with the optional fields at their defaults.
func DefaultConfig() Config {
	return Config{TokenBudget: 512, MaxRunning: 256, MaxWaiting: 4096, LoadInterval: 250 * time.Millisecond, LoadRule: loadreport.DefaultRule(),
		QueueWindow: 10 * time.Second, DrainTimeout: 30 * time.Second, ReconcileInterval: 2 * time.Second,
		CheckpointBudget: 1 << 30, SpecK: 4, MigrationTimeout: core.DefaultMigrationTimeout}
}

// Validate says what is wrong with the configuration.
func (c *Config) Validate() error {
	var errs []error
	if c.ID == "" {
		errs = append(errs, errors.New("an ID is required"))
	}
	if c.GRPCAddr == "" {
		errs = append(errs, errors.New("a GRPCAddr is required"))
	}
	if c.Engine == nil {
		errs = append(errs, errors.New("an Engine is required"))
	} else if _, ok := c.Engine.(engine.PageSharer); c.PrefixCache && !ok {
		errs = append(errs, fmt.Errorf("the prefix cache needs an engine that shares KV pages; engine %s does not", c.Engine.Info().Backend))
	}
	if n := len(c.GossipKey); n != 0 && n != 16 && n != 24 && n != 32 {
		errs = append(errs, fmt.Errorf("GossipKey is %d bytes; it must be 16, 24 or 32", n))
	}
	if c.TokenBudget < 1 || c.MaxRunning < 1 || c.MaxWaiting < 1 {
		errs = append(errs, fmt.Errorf("TokenBudget (%d), MaxRunning (%d) and MaxWaiting (%d) must be >= 1", c.TokenBudget, c.MaxRunning, c.MaxWaiting))
	}
	if err := core.CheckSpecK(c.SpecK); err != nil {
		errs = append(errs, fmt.Errorf("SpecK (-spec-k): %w", err))
	}
	if r := c.Recovery; r != nil && (r.Draft == nil || r.LoadDraft == nil || r.Target.ToHost == nil || r.Target.ToDevice == nil) {
		errs = append(errs, errors.New("Recovery needs a Draft engine, LoadDraft and both Target stages"))
	}
	if c.LoadInterval <= 0 || c.QueueWindow <= 0 || c.DrainTimeout <= 0 || c.ReconcileInterval <= 0 || c.MigrationTimeout <= 0 {
		errs = append(errs, fmt.Errorf("LoadInterval (%s), QueueWindow (%s), DrainTimeout (%s), ReconcileInterval (%s) and MigrationTimeout (%s) must be positive",
			c.LoadInterval, c.QueueWindow, c.DrainTimeout, c.ReconcileInterval, c.MigrationTimeout))
	}
	if err := c.LoadRule.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("LoadRule: %w", err))
	}
	if len(errs) > 0 {
		return fmt.Errorf("worker: invalid config: %w", errors.Join(errs...))
	}
	return nil
}
