package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"syscall"

	"github.com/lumen-project/lumen/internal/devcluster"
	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/engine"
)

func init() {
	register("dev", "run a whole local cluster: 3 controllers, N workers, gateways (Ctrl-C stops it)", runDev)
}

func runDev(args []string) error {
	fs := flag.NewFlagSet("dev", flag.ContinueOnError)
	dir := fs.String("dir", "lumen-dev", "data directory: each process's data and log")
	workers := fs.Int("workers", 2, "workers")
	backend := fs.String("engine", "transformer", "transformer or synthetic")
	profile := fs.String("profile", "none", "timing profile of the workers")
	scale := fs.String("time-scale", "1", "time scale of the profile")
	httpAddr := fs.String("http", "127.0.0.1:8080", "the (first) gateway's address")
	gateways := fs.Int("gateways", 1, "gateways, each with its own view of the load table (the first on -http, the others on free ports)")
	nodes := fs.Int("nodes", 0, "put the workers on this many simulated hosts, in order (failure domains: no checkpoint on its serving worker's node); 0: none")
	cells := fs.Int("cells", 1, "cells: each a quorum of 3 controllers over its share of the workers (in order), the gateways placing across them (issue 26); at most 4")
	replicas := fs.Int("checkpoint-replicas", 1, "`R` copies of each request's checkpoint (1 … "+strconv.Itoa(policy.MaxCheckpointReplicas)+"), set at the start as lumen strategy set -checkpoint-replicas does: each on a node of its own, none on the serving worker's, so it needs -nodes to mean failure domains (without -nodes each worker is a domain of its own); with fewer than R other nodes a request gets one copy per other node, the shortfall counted in lumen_controller_checkpoint_replicas_short_total")
	var prefix bool
	fs.Var(onOff{&prefix}, "prefix-routing", "on or off (issue 25): on starts the workers with -prefix-cache on and the gateways with -prefix-routing on (placement by cached prefix); off: freeness alone")
	cache := fs.String("prefix-cache", "auto", "on, off or auto (issue 25): the workers' automatic prefix caching (worker -prefix-cache); auto: on exactly when -prefix-routing is on. on with -prefix-routing off measures the cache without the routing")
	kvPages := fs.Int("kv-pages", 0, "KV cache pages of 16 tokens per worker (worker -kv-pages); 0: the worker's default (the profile's GPU, or 4096 for the transformer)")
	keep := fs.Bool("keep-state", false, "restart from the last run's data in -dir, on its recorded ports (default: start fresh)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *nodes < 0 || *nodes > *workers {
		return fmt.Errorf("-nodes %d: must be in 0 … -workers (%d)", *nodes, *workers)
	}
	if *kvPages < 0 {
		return fmt.Errorf("-kv-pages %d: must be at least 0 (0: the worker's default)", *kvPages)
	}
	if err := devcluster.CheckReplicas(*replicas); err != nil {
		return err
	}
	var prefixCache bool
	switch *cache {
	case "auto":
		prefixCache = prefix
	case "on":
		prefixCache = true
	case "off":
		if prefix {
			return fmt.Errorf("-prefix-cache off with -prefix-routing on: routing by cached prefix needs the workers' prefix caches")
		}
	default:
		return fmt.Errorf("-prefix-cache %q: want on, off or auto", *cache)
	}
	// Ctrl-C ends every wait, the start's included.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	modelDir := engine.DefaultModelDir()
	if *backend == "transformer" {
		if _, err := engine.EnsureModel(modelDir); err != nil {
			return err
		}
	}
	return devcluster.RunDev(ctx, devcluster.DevConfig{Dir: *dir, Workers: *workers, Engine: *backend, Profile: *profile,
		TimeScale: *scale, ModelDir: modelDir, HTTPAddr: *httpAddr, Gateways: *gateways, KeepState: *keep, Nodes: *nodes, Cells: *cells,
		CheckpointReplicas: *replicas, PrefixRouting: prefix, PrefixCache: prefixCache, KVPages: *kvPages, Out: os.Stdout})
}
