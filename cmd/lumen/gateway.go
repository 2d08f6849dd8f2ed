package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/hashicorp/go-hclog"

	"github.com/lumen-project/lumen/gateway"
)

func init() {
	register("gateway", "serve the OpenAI-compatible API in front of the cluster", runGateway)
}

func runGateway(args []string) error {
	cfg := gateway.DefaultConfig()
	fs := flag.NewFlagSet("gateway", flag.ContinueOnError)
	fs.StringVar(&cfg.Addr, "http", cfg.Addr, "HTTP listen address")
	controllers := fs.String("controllers", "127.0.0.1:7100", "comma-separated controller gRPC addresses")
	fs.StringVar(&cfg.Model, "model", cfg.Model, "model name clients ask for")
	fs.IntVar(&cfg.MaxContext, "max-context", cfg.MaxContext, "context length until a worker reports one")
	keys := fs.String("api-keys", os.Getenv("LUMEN_API_KEYS"), "comma-separated bearer tokens to accept (env LUMEN_API_KEYS; empty: no auth)")
	fs.StringVar(&cfg.TLSCert, "tls-cert", "", "serve HTTPS with this certificate")
	fs.StringVar(&cfg.TLSKey, "tls-key", "", "and this key")
	fs.StringVar(&cfg.ClusterTLS.Cert, "cluster-tls-cert", "", "PEM certificate for the gateway's gRPC calls to controllers and workers (mutual TLS; the CA of their -tls-ca signs it)")
	fs.StringVar(&cfg.ClusterTLS.Key, "cluster-tls-key", "", "its PEM private key")
	fs.StringVar(&cfg.ClusterTLS.CA, "cluster-tls-ca", "", "PEM CA certificate that signs the controllers' and workers' certificates")
	fs.Int64Var(&cfg.MaxBodyBytes, "max-body-bytes", cfg.MaxBodyBytes, "largest request body")
	fs.IntVar(&cfg.MaxConcurrent, "max-concurrent", cfg.MaxConcurrent, "requests in flight before 429")
	fs.StringVar(&cfg.Name, "name", "", "the name of the gateway's controller session, for operators (default host@listen-address)")
	fs.DurationVar(&cfg.SessionTTL, "session-ttl", cfg.SessionTTL, "how long the controller keeps this gateway's placements after it stops renewing its session (1s..1h)")
	fs.DurationVar(&cfg.ResumeTimeout, "resume-timeout", cfg.ResumeTimeout, "how long a request whose worker stream broke may take to resume (finding where it continues, the calls there, each further break) before the client gets a resume_timeout error; wall time, so raise it for recoveries that take longer (a cold restart of a large model, or a slowed emulation: lumen bench recovery gives its gateways the run's scaled length)")
	fs.Var(onOff{&cfg.PrefixRouting}, "prefix-routing", "on or off (issue 25): on follows every worker's prefix-cache events (WatchKV; the workers run -prefix-cache on) and places each new request by its cached prefix against the worker's freeness (internal/placer's prefix score); off: freeness alone")
	fs.BoolVar(&cfg.Pprof, "pprof", false, "serve Go's profiles under /debug/pprof/ on the HTTP address")
	level := fs.String("log-level", "info", "trace, debug, info, warn or error")
	var cells []gateway.Cell
	fs.Func("cell", "NAME=ADDR[,ADDR...]: a cell (a controller quorum and its workers) to place into; repeat for each cell, in place of -controllers (issue 26: each request lives in the cell of the freest worker)", func(v string) error {
		c, err := gateway.ParseCell(v)
		if err == nil {
			cells = append(cells, c)
		}
		return err
	})
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg.Controllers = strings.Split(*controllers, ",")
	controllersSet := false
	fs.Visit(func(f *flag.Flag) { controllersSet = controllersSet || f.Name == "controllers" })
	if len(cells) > 0 && controllersSet {
		return fmt.Errorf("-controllers and -cell: give one; with cells each -cell names its controllers")
	}
	if *keys != "" {
		cfg.APIKeys = strings.Split(*keys, ",")
	}
	cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: "gateway", Level: hclog.LevelFromString(*level), Output: os.Stderr})
	var g interface {
		Addr() string
		Close()
	}
	var err error
	if len(cells) > 0 {
		g, err = gateway.NewCells(cfg, cells)
	} else {
		g, err = gateway.New(cfg)
	}
	if err != nil {
		return err
	}
	scheme := "http"
	if cfg.TLSCert != "" {
		scheme = "https"
	}
	cfg.Logger.Info("gateway running", "url", fmt.Sprintf("%s://%s/v1", scheme, g.Addr()), "model", cfg.Model, "cells", len(cells))
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
	g.Close()
	return nil
}
