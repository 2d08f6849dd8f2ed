package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/lumen-project/lumen/internal/progress"
	"github.com/lumen-project/lumen/jepsen"
)

func init() {
	register("jepsen", "fault injection over real processes: nemeses, histories, linearizability and serving checkers", runJepsen)
}

func runJepsen(args []string) error {
	fs := flag.NewFlagSet("jepsen", flag.ContinueOnError)
	matrix := fs.Bool("matrix", false, "run the full matrix (every nemesis alone and the combinations that matter)")
	nemeses := fs.String("nemesis", "kill-leader,kill-worker,pause-worker,partition-halves", "comma-separated nemeses for one run: "+strings.Join(jepsen.NemesisNames(), ", "))
	duration := fs.Duration("duration", 2*time.Minute, "workload time under faults, per run")
	interval := fs.Duration("interval", 4*time.Second, "mean time between faults")
	seed := fs.Int64("seed", 0, "seed (0: from the clock); printed")
	controllers := fs.Int("controllers", 3, "controllers for a single run (3 or 5)")
	workers := fs.Int("workers", 3, "workers")
	results := fs.String("results", "jepsen-results", "directory for histories, logs and the summary")
	list := fs.Bool("list", false, "list the nemeses and exit")
	sessionTTL := fs.Duration("session-ttl", jepsen.DefaultSessionTTL, "the gateways' session TTL: after a gateway-kill, the end-of-run leak check waits this long for the dead gateway's session to expire")
	partitions := fs.String("partitions", "auto", "how partitions are made: netns (network namespaces, needs root), proxy (per-link TCP proxies), or auto (netns where possible)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *list {
		for _, n := range jepsen.NemesisNames() {
			fmt.Printf("%-22s %s\n", n, jepsen.NemesisDoc(n))
		}
		return nil
	}
	if *seed == 0 {
		*seed = time.Now().UnixNano() % 1_000_000
	}
	if *controllers != 3 && *controllers != 5 {
		return fmt.Errorf("-controllers %d: use 3 or 5", *controllers)
	}
	type runSpec struct {
		nemeses     []string
		controllers int
		partitions  string
	}
	var runs []runSpec
	if *matrix {
		for _, m := range jepsen.Matrix {
			runs = append(runs, runSpec{m.Nemeses, m.Controllers, m.Partitions})
		}
	} else {
		runs = []runSpec{{strings.Split(*nemeses, ","), *controllers, ""}}
	}
	mode := ""
	switch *partitions {
	case "auto":
		if err := jepsen.NetAvailable(); err != nil {
			fmt.Printf("network namespaces unavailable (%v): partitions go through per-link TCP proxies\n", err)
			mode = "proxy"
		}
	case "netns":
		if err := jepsen.NetAvailable(); err != nil {
			return fmt.Errorf("-partitions netns: %w", err)
		}
		mode = "netns"
	case "proxy":
		mode = "proxy"
	default:
		return fmt.Errorf("-partitions %q: use auto, netns or proxy", *partitions)
	}
	root := filepath.Join(*results, time.Now().Format("20060102-150405"))
	bin, err := os.Executable()
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	fmt.Printf("jepsen: %d run(s) of %s each, seed %d, results in %s\n", len(runs), *duration, *seed, root)
	var reports []*jepsen.Report
	failed := 0
	meter := progress.New("jepsen", "runs", float64(len(runs)))
	defer meter.Finish("")
	for k, r := range runs {
		name := strings.Join(r.nemeses, "+")
		if r.controllers != 3 {
			name += fmt.Sprintf("/%dc", r.controllers)
		}
		partitionMode := mode
		if r.partitions != "" {
			partitionMode = r.partitions
			name += "/" + r.partitions
		}
		cfg := jepsen.Config{Name: name, Bin: bin, Dir: filepath.Join(root, fmt.Sprintf("%02d-%s", k+1, strings.ReplaceAll(name, "/", "-"))),
			ModelDir: filepath.Join(root, "model"), Seed: *seed + int64(k), Controllers: r.controllers, Workers: *workers,
			Duration: *duration, Nemeses: r.nemeses, Interval: *interval, Partitions: partitionMode, PlacementClients: 6, ServingClients: 2, SessionTTL: *sessionTTL, Log: os.Stdout}
		meter.Set(float64(k), name)
		rep, err := jepsen.Run(ctx, cfg)
		if err != nil {
			return fmt.Errorf("%s: %w (logs in %s)", name, err, cfg.Dir)
		}
		reports = append(reports, rep)
		if !rep.OK() {
			failed++
		}
		meter.Set(float64(k+1), fmt.Sprintf("%s done, %d with violations", name, failed))
		if ctx.Err() != nil {
			break
		}
	}
	summary := jepsen.Summary(reports)
	fmt.Printf("\n%s", summary)
	if err := os.WriteFile(filepath.Join(root, "summary.txt"), []byte(summary), 0o644); err != nil {
		return err
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d runs found violations (histories in %s)", failed, len(reports), root)
	}
	fmt.Printf("no violations; histories in %s\n", root)
	return nil
}
