package devcluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/lumen-project/lumen/internal/progress"
	"github.com/lumen-project/lumen/policy"
)

// DevStateFile, in a dev cluster's directory, records the controllers'
// addresses, so that `lumen dev -keep-state` can bring the quorum back where
// its Raft configuration says it is.
const DevStateFile = "dev-state.json"

// ErrNoDevState: -keep-state was asked of a directory that holds a dev
// cluster's data but no DevStateFile (an older lumen wrote it).
var ErrNoDevState = errors.New("devcluster: no recorded addresses to keep the state with")

// ErrNotDevDir: a fresh start found entries with a dev cluster's names in a
// directory no dev cluster ran in, and removed nothing.
var ErrNotDevDir = errors.New("devcluster: the directory is not a dev cluster's")

// devEntry names what a dev cluster writes in its directory; a fresh start
// removes these and nothing else.
var devEntry = regexp.MustCompile(`^((ctl\d+|worker-\d+)(\.log)?|gateway(-\d+)?\.log|cell-\d+|` + regexp.QuoteMeta(DevStateFile) + `)$`)

// DevConfig is a `lumen dev` cluster: 3 controllers, workers, a gateway.
type DevConfig struct {
	// Dir holds every process's data directory and log.
	Dir string
	// Workers is the number of workers (at least 1).
	Workers int
	// Engine, Profile and TimeScale are the workers' -engine, -profile
	// and -time-scale.
	Engine, Profile, TimeScale string
	// ModelDir is the workers' -model-dir.
	ModelDir string
	// HTTPAddr is the first gateway's address.
	HTTPAddr string
	// Gateways is the number of gateways (default 1): each keeps its own
	// replica of the load table and its own Place stream (issue 16). The
	// first listens on HTTPAddr, the others on free ports.
	Gateways int
	// KeepState restarts the cluster from the data directories of the
	// last run in Dir, on the addresses that run recorded; without it
	// every run starts from empty directories, as `consul agent -dev`
	// does (a Raft configuration names ports that are gone otherwise).
	KeepState bool
	// StartTimeout bounds the start (quorum, workers, gateway); 0 means 2
	// minutes.
	StartTimeout time.Duration
	// Nodes, when > 0, puts the workers on that many simulated hosts
	// (issue 24's failure domains): worker-1 … in order, DevNode's, each
	// started with -node. 0: no labels.
	Nodes int
	// Cells, when > 1, runs that many cells (issue 26): each a quorum of
	// 3 controllers over its share of the workers (in order, in blocks),
	// its data under Dir/cell-N, and the gateways place across them
	// (gateway -cell). 0 or 1: one cell, in Dir itself.
	Cells int
	// CheckpointReplicas is the strategy's replication factor, set at the
	// start (SetStrategy's checkpoint_replicas, as `lumen strategy set
	// -checkpoint-replicas` does), on every cell's quorum: 1 …
	// policy.MaxCheckpointReplicas; 0 means 1. Each copy goes to a node of
	// its own, none to the serving worker's (Nodes; without Nodes, each
	// worker is a domain of its own): a request gets at most as many copies
	// as there are other nodes with budget, the rest counted in
	// lumen_controller_checkpoint_replicas_short_total.
	CheckpointReplicas int
	// PrefixRouting (issue 25) starts every gateway with -prefix-routing
	// on; PrefixCache every worker with -prefix-cache on (routing by
	// prefix needs it: RunDev refuses routing without the cache).
	PrefixRouting, PrefixCache bool
	// KVPages is each worker's -kv-pages (0: the worker's default).
	KVPages int
	// Out receives what the user reads.
	Out io.Writer
}

// workerArgs are the flags of worker i (1-based) of cfg's workers.
func (cfg *DevConfig) workerArgs(i int) []string {
	args := []string{"-engine", cfg.Engine, "-model-dir", cfg.ModelDir, "-profile", cfg.Profile, "-time-scale", cfg.TimeScale}
	if node := DevNode(i, cfg.Workers, cfg.Nodes); node != "" {
		args = append(args, "-node", node)
	}
	if cfg.PrefixCache {
		args = append(args, "-prefix-cache", "on")
	}
	if cfg.KVPages > 0 {
		args = append(args, "-kv-pages", strconv.Itoa(cfg.KVPages))
	}
	return args
}

// gatewayArgs are the flags every gateway of cfg adds to its own.
func (cfg *DevConfig) gatewayArgs() []string {
	if cfg.PrefixRouting {
		return []string{"-prefix-routing", "on"}
	}
	return nil
}

// maxDevCells caps -cells: each cell is 3 controller processes here.
const maxDevCells = 4

// DevNode is the node of worker i (1-based) of workers on nodes hosts: the
// workers in order, ⌈workers/nodes⌉ a node ("node-1" …); "" when nodes is 0.
func DevNode(i, workers, nodes int) string {
	if nodes <= 0 {
		return ""
	}
	per := (workers + nodes - 1) / nodes
	return fmt.Sprintf("node-%d", (i-1)/per+1)
}

// dev state is what DevStateFile holds.
type devState struct {
	Controllers []ControllerAddrs `json:"controllers"`
}

// RunDev starts the cluster, prints how to reach it, and runs until ctx
// ends (Ctrl-C), then stops everything. Every wait of the start ends with
// ctx too: it then stops what had started and returns ctx's error.
func RunDev(ctx context.Context, cfg DevConfig) error {
	if cfg.Workers < 1 {
		return fmt.Errorf("-workers must be at least 1")
	}
	if cfg.Gateways == 0 {
		cfg.Gateways = 1
	}
	if cfg.Gateways < 1 || cfg.Gateways > maxDevGateways {
		return fmt.Errorf("-gateways %d: must be between 1 and %d", cfg.Gateways, maxDevGateways)
	}
	if cfg.PrefixRouting && !cfg.PrefixCache {
		return fmt.Errorf("-prefix-routing on needs the workers' prefix caches (-prefix-cache on)")
	}
	cells := max(cfg.Cells, 1)
	if cells > maxDevCells || cells > cfg.Workers {
		return fmt.Errorf("-cells %d: must be between 1 and %d, and at most -workers (%d): each cell needs a worker", cfg.Cells, maxDevCells, cfg.Workers)
	}
	if cells > 1 && cfg.Nodes > 0 {
		return fmt.Errorf("-nodes with -cells: not supported (a node's workers would have to stay in one cell); use one of them")
	}
	if cfg.CheckpointReplicas == 0 {
		cfg.CheckpointReplicas = 1
	}
	if err := CheckReplicas(cfg.CheckpointReplicas); err != nil {
		return err
	}
	if cfg.StartTimeout == 0 {
		cfg.StartTimeout = 2 * time.Minute
	}
	out := cfg.Out
	dirs := []string{cfg.Dir}
	if cells > 1 {
		dirs = dirs[:0]
		for k := 1; k <= cells; k++ {
			dirs = append(dirs, filepath.Join(cfg.Dir, fmt.Sprintf("cell-%d", k)))
		}
	}
	// The addresses named in advance are never handed to another
	// component: the kernel may offer a port its user released a moment
	// ago (the caller that picked -http, a kept controller's).
	Reserve(cfg.HTTPAddr)
	optss := make([]Options, cells)
	for k, dir := range dirs {
		optss[k] = Options{Dir: dir, Controllers: 3, Args: []string{"-log-level", "warn"}}
		if cfg.KeepState {
			addrs, err := loadDevState(dir)
			if err != nil {
				return err
			}
			optss[k].Addrs = addrs
			for _, a := range addrs {
				for _, s := range []string{a.Raft, a.GRPC, a.Serf, a.HTTP} {
					Reserve(s)
				}
			}
		}
	}
	if !cfg.KeepState {
		if err := cleanDevDir(cfg.Dir); err != nil {
			return err
		}
	}
	startCtx, cancel := context.WithTimeout(ctx, cfg.StartTimeout)
	defer cancel()
	state := "empty data directories"
	if optss[0].Addrs != nil {
		state = "the kept state"
	}
	gateways := "a gateway"
	if cfg.Gateways > 1 {
		gateways = fmt.Sprintf("%d gateways", cfg.Gateways)
	}
	quorums := "3 controllers"
	if cells > 1 {
		quorums = fmt.Sprintf("%d cells of 3 controllers", cells)
	}
	fmt.Fprintf(out, "starting %s, %d %s workers and %s under %s (%s)\n", quorums, cfg.Workers, cfg.Engine, gateways, cfg.Dir, state)
	// Progress while the quorums form and the workers load: the steps
	// are each quorum, each worker, the gateways.
	tty := false
	if f, ok := out.(*os.File); ok {
		tty = progress.IsTerminal(f)
	}
	meter := progress.NewTo(out, tty, "starting", "steps", float64(cfg.Workers+cells+1))
	var cls []*Cluster
	defer func() {
		if len(cls) > 0 {
			fmt.Fprintln(out, "stopping: gateways, workers (draining), controllers")
		}
		for _, cl := range cls {
			cl.Stop()
		}
	}()
	for k := range cells {
		what := "3 controllers: forming the quorum"
		if cells > 1 {
			what = fmt.Sprintf("cell-%d: 3 controllers forming its quorum", k+1)
		}
		meter.Set(float64(k), what)
		cl, err := Start(startCtx, optss[k])
		if err != nil {
			meter.Finish("failed")
			return interrupted(ctx, err)
		}
		cls = append(cls, cl)
		if err := saveDevState(dirs[k], devState{Controllers: cl.ControllerAddrs()}); err != nil {
			return err
		}
		// Before any worker registers, so that every placement has the
		// factor (a kept state's earlier value included is replaced).
		if err := cl.SetCheckpointReplicas(startCtx, cfg.CheckpointReplicas); err != nil {
			meter.Finish("failed")
			return interrupted(ctx, err)
		}
	}
	per := (cfg.Workers + cells - 1) / cells
	for i := 1; i <= cfg.Workers; i++ {
		meter.Set(float64(cells+i-1), fmt.Sprintf("a leader; worker-%d of %d starting", i, cfg.Workers))
		if _, err := cls[min((i-1)/per, cells-1)].AddWorkerContext(startCtx, fmt.Sprintf("worker-%d", i), cfg.workerArgs(i)...); err != nil {
			meter.Finish("failed")
			return interrupted(ctx, err)
		}
	}
	meter.Set(float64(cfg.Workers+cells), "the gateways: waiting for a worker in full service")
	var cellFlags []string
	if cells > 1 {
		for k, cl := range cls {
			cellFlags = append(cellFlags, cl.CellFlag(fmt.Sprintf("cell-%d", k+1)))
		}
	}
	var gws []*Gateway
	for i := 0; i < cfg.Gateways; i++ {
		addr := cfg.HTTPAddr
		if i > 0 {
			addr = ""
		}
		gw, err := cls[0].startGateway(startCtx, addr, cellFlags, cfg.gatewayArgs())
		if err != nil {
			meter.Finish("failed")
			return interrupted(ctx, err)
		}
		gws = append(gws, gw)
	}
	for _, gw := range gws {
		if err := gw.WaitReady(startCtx); err != nil {
			meter.Finish("failed")
			return interrupted(ctx, err)
		}
	}
	meter.Set(float64(cfg.Workers+cells+1), "")
	meter.Finish("ready")
	gw := gws[0]
	fmt.Fprintln(out)
	for i, g := range gws {
		name := "gateway"
		if len(gws) > 1 {
			name = fmt.Sprintf("gateway %d", i+1)
		}
		fmt.Fprintf(out, "  %-12s http://%s/v1   (OpenAI API; model %q)\n", name, g.Addr, "lumen-tiny")
	}
	var all []string
	for k, cl := range cls {
		label := "controllers"
		if cells > 1 {
			label = fmt.Sprintf("cell-%d", k+1)
		}
		fmt.Fprintf(out, "  %-12s %s\n", label, strings.Join(cl.GRPCAddrs(), ","))
		var others []string
		for i := 1; i < len(cl.Controllers); i++ {
			others = append(others, cl.Controllers[i].ID+" "+cl.DashboardURL(i))
		}
		fmt.Fprintf(out, "  %-12s %s   (every controller serves one: %s)\n", "dashboard", cl.DashboardURL(0), strings.Join(others, ", "))
		for _, w := range cl.Workers {
			fmt.Fprintf(out, "  %-12s %s   metrics http://%s/metrics\n", w.ID, w.GRPCAddr, w.HTTPAddr)
		}
		if k == 0 {
			all = cl.GRPCAddrs()
		}
	}
	logs := cfg.Dir + "/*.log"
	if cells > 1 {
		logs = cfg.Dir + "/cell-*/*.log"
	}
	fmt.Fprintf(out, "  checkpoints  %s\n", ReplicasLine(cfg.CheckpointReplicas, cfg.Workers, cfg.Nodes))
	fmt.Fprintf(out, "  logs         %s\n\n", logs)
	fmt.Fprintf(out, "try:\n  curl -s http://%s/v1/completions -H 'Content-Type: application/json' \\\n    -d '{\"model\":\"lumen-tiny\",\"prompt\":\"Hello\",\"max_tokens\":16,\"temperature\":0}'\n", gw.Addr)
	fmt.Fprintf(out, "  LUMEN_ADDR=%s lumen workers\n\nCtrl-C stops everything.\n", strings.Join(all, ","))
	<-ctx.Done()
	return nil
}

// CheckReplicas validates a replication factor for -checkpoint-replicas.
func CheckReplicas(r int) error {
	if r < 1 || r > policy.MaxCheckpointReplicas {
		return fmt.Errorf("-checkpoint-replicas %d: must be between 1 and %d (policy.MaxCheckpointReplicas: each copy is a request's whole footprint in another worker's host memory)", r, policy.MaxCheckpointReplicas)
	}
	return nil
}

// ReplicasLine says how many checkpoint copies a request gets in a dev
// cluster of workers on nodes hosts at replication factor r: each copy in a
// domain of its own other than the serving worker's (policy.ChooseHolders),
// so at most the other nodes' number, each worker a domain of its own
// without nodes; where the serving worker's node is the only one, one copy
// falls back to another worker of it.
func ReplicasLine(r, workers, nodes int) string {
	copies := "copy"
	if r > 1 {
		copies = "copies"
	}
	line := fmt.Sprintf("%d %s of each request's checkpoint", r, copies)
	domains, what := workers, "workers"
	if nodes > 0 {
		domains, what = nodes, "nodes"
		line += ", none on the serving worker's node"
	}
	switch others := domains - 1; {
	case workers < 2:
		line += "; with 1 worker, none (no other worker to hold it)"
	case others < 1:
		line += "; with 1 node, one copy, on another worker of that node (it survives the serving worker, not the node)"
	case others < r:
		line += fmt.Sprintf("; with %d %s, at most %d (placements short of %d counted in lumen_controller_checkpoint_replicas_short_total)", domains, what, others, r)
	}
	return line
}

// maxDevGateways caps -gateways: each is a process on this machine.
const maxDevGateways = 8

// interrupted says so when the start failed because the user stopped it.
func interrupted(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted while starting; stopped what had started (%w)", ctx.Err())
	}
	return err
}

// cleanDevDir removes what an earlier dev cluster wrote in dir, and only
// that: a -dir pointed at a folder of other things loses none of them. The
// names alone do not prove a folder is a dev cluster's (a user's own
// worker-1/ matches them), so it removes them only where a dev cluster
// left its mark: the state file, or a controller's raft.db. Otherwise it
// refuses, naming what it would have removed.
func cleanDevDir(dir string) error {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var ours []string
	for _, e := range ents {
		if devEntry.MatchString(e.Name()) {
			ours = append(ours, e.Name())
		}
	}
	if len(ours) == 0 {
		return nil
	}
	if !isDevDir(dir) {
		return fmt.Errorf("%w: %s holds %s but no %s or controller raft.db; choose another -dir, or remove them yourself",
			ErrNotDevDir, dir, strings.Join(ours, ", "), DevStateFile)
	}
	for _, name := range ours {
		if err := os.RemoveAll(filepath.Join(dir, name)); err != nil {
			return fmt.Errorf("devcluster: start fresh: %w", err)
		}
	}
	return nil
}

// isDevDir says whether a dev cluster ran in dir: it wrote its state file
// there, or a controller's Raft log.
func isDevDir(dir string) bool {
	if _, err := os.Stat(filepath.Join(dir, DevStateFile)); err == nil {
		return true
	}
	dbs, _ := filepath.Glob(filepath.Join(dir, "ctl[0-9]*", "raft.db"))
	if len(dbs) > 0 {
		return true
	}
	// -cells: each cell's quorum in its own folder.
	states, _ := filepath.Glob(filepath.Join(dir, "cell-[0-9]*", DevStateFile))
	return len(states) > 0
}

// loadDevState reads the addresses a kept cluster must come back on; a
// directory with no cluster in it starts fresh.
func loadDevState(dir string) ([]ControllerAddrs, error) {
	b, err := os.ReadFile(filepath.Join(dir, DevStateFile))
	if errors.Is(err, fs.ErrNotExist) {
		if _, err := os.Stat(filepath.Join(dir, ControllerID(0))); err == nil {
			return nil, fmt.Errorf("%w: %s holds a dev cluster's data but no %s (an older lumen wrote it); run without -keep-state to start fresh",
				ErrNoDevState, dir, DevStateFile)
		}
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var st devState
	if err := json.Unmarshal(b, &st); err != nil || len(st.Controllers) != 3 {
		return nil, fmt.Errorf("%w: %s is not a record of 3 controllers (%v); run without -keep-state to start fresh",
			ErrNoDevState, filepath.Join(dir, DevStateFile), err)
	}
	return st.Controllers, nil
}

func saveDevState(dir string, st devState) error {
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, DevStateFile), append(b, '\n'), 0o644)
}
