package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/lumen-project/lumen/internal/devcluster"
	"github.com/lumen-project/lumen/worker/engine"
)

func init() {
	register("dev", "run a whole local cluster: 3 controllers, N workers, a gateway (Ctrl-C stops it)", runDev)
}

func runDev(args []string) error {
	fs := flag.NewFlagSet("dev", flag.ContinueOnError)
	dir := fs.String("dir", "lumen-dev", "data directory: each process's data and log")
	workers := fs.Int("workers", 2, "workers")
	backend := fs.String("engine", "transformer", "transformer or synthetic")
	profile := fs.String("profile", "none", "timing profile of the workers")
	scale := fs.String("time-scale", "1", "time scale of the profile")
	httpAddr := fs.String("http", "127.0.0.1:8080", "the gateway's address")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *workers < 1 {
		return fmt.Errorf("-workers must be at least 1")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	modelDir := engine.DefaultModelDir()
	if *backend == "transformer" {
		if _, err := engine.EnsureModel(modelDir); err != nil {
			return err
		}
	}
	fmt.Printf("starting 3 controllers, %d %s workers and a gateway under %s\n", *workers, *backend, *dir)
	cl, err := devcluster.Start(ctx, devcluster.Options{Dir: *dir, Controllers: 3, Args: []string{"-log-level", "warn"}})
	if err != nil {
		return err
	}
	defer func() {
		fmt.Println("stopping: gateway, workers (draining), controllers")
		cl.Stop()
	}()
	for i := 1; i <= *workers; i++ {
		if _, err := cl.AddWorker(fmt.Sprintf("worker-%d", i), "-engine", *backend, "-model-dir", modelDir,
			"-profile", *profile, "-time-scale", *scale); err != nil {
			return err
		}
	}
	gw, err := cl.StartGateway(*httpAddr)
	if err != nil {
		return err
	}
	if err := gw.WaitReady(ctx); err != nil {
		return err
	}
	fmt.Printf("\n  gateway      http://%s/v1   (OpenAI API; model %q)\n", gw.Addr, "lumen-tiny")
	fmt.Printf("  controllers  %s\n", strings.Join(cl.GRPCAddrs(), ","))
	for _, w := range cl.Workers {
		fmt.Printf("  %-12s %s   metrics http://%s/metrics\n", w.ID, w.GRPCAddr, w.HTTPAddr)
	}
	fmt.Printf("  logs         %s/*.log\n\n", *dir)
	fmt.Printf("try:\n  curl -s http://%s/v1/completions -H 'Content-Type: application/json' \\\n    -d '{\"model\":\"lumen-tiny\",\"prompt\":\"Hello\",\"max_tokens\":16,\"temperature\":0}'\n", gw.Addr)
	fmt.Printf("  LUMEN_ADDR=%s lumen workers\n\nCtrl-C stops everything.\n", strings.Join(cl.GRPCAddrs(), ","))
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
	return nil
}
