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

	"github.com/hashicorp/go-hclog"

	"github.com/lumen-project/lumen/controller"
	"github.com/lumen-project/lumen/internal/gossip"
)

func init() {
	register("controller", "run one controller replica (Raft + Serf + gRPC API)", runController)
}

func runController(args []string) error {
	cfg := controller.DefaultConfig()
	fs := flag.NewFlagSet("controller", flag.ContinueOnError)
	fs.StringVar(&cfg.NodeID, "id", "", "replica id, stable across restarts (required)")
	fs.StringVar(&cfg.DataDir, "data-dir", "", "directory for raft.db and snapshots (required)")
	fs.StringVar(&cfg.RaftAddr, "raft-addr", "127.0.0.1:7300", "Raft transport host:port")
	fs.StringVar(&cfg.GRPCAddr, "grpc-addr", "127.0.0.1:7100", "gRPC API host:port")
	fs.StringVar(&cfg.SerfAddr, "serf-addr", "127.0.0.1:7200", "Serf gossip host:port (TCP and UDP)")
	fs.StringVar(&cfg.HTTPAddr, "http-addr", "", "host:port for /metrics, /healthz, /readyz (empty: off)")
	fs.IntVar(&cfg.BootstrapExpect, "bootstrap-expect", 0, "bootstrap a new cluster once this many controllers see each other")
	join := fs.String("join", "", "comma-separated Serf addresses of members to join (retried until one answers)")
	peerAddrs := fs.String("raft-peer-addrs", "", "comma-separated id=host:port: dial these peers' Raft transports there instead of their configured addresses (a NAT, a proxy)")
	fs.Float64Var(&cfg.RaftMultiplier, "raft-multiplier", cfg.RaftMultiplier, "scale Raft timeouts (1 = 300 ms heartbeat/election timeout)")
	fs.Uint64Var(&cfg.SnapshotThreshold, "snapshot-threshold", cfg.SnapshotThreshold, "log entries between snapshots")
	fs.IntVar(&cfg.BatchInflight, "batch-inflight", cfg.BatchInflight, "log entries proposed but not applied before commands wait to join the next entry")
	fs.IntVar(&cfg.BatchMax, "batch-max", cfg.BatchMax, "most commands coalesced into one log entry")
	fs.DurationVar(&cfg.MigrationInterval, "migration-interval", cfg.MigrationInterval, "how often the leader schedules live migrations (balance when on, drains always)")
	fs.DurationVar(&cfg.MigrationTimeout, "migration-timeout", cfg.MigrationTimeout, "the leader aborts a live migration not committed this long after it started")
	gossipKey := fs.String("gossip-key", os.Getenv("LUMEN_GOSSIP_KEY"), "base64 key (16, 24 or 32 bytes) encrypting Serf traffic (env LUMEN_GOSSIP_KEY, which keeps it off the command line)")
	fs.StringVar(&cfg.TLS.Cert, "tls-cert", "", "PEM certificate for gRPC and Raft (mutual TLS)")
	fs.StringVar(&cfg.TLS.Key, "tls-key", "", "PEM private key")
	fs.StringVar(&cfg.TLS.CA, "tls-ca", "", "PEM CA certificate that signs every peer")
	leave := fs.Bool("leave-on-terminate", false, "on SIGTERM/SIGINT leave the quorum for good instead of stopping (restartable)")
	level := fs.String("log-level", "info", "trace, debug, info, warn or error")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *join != "" {
		cfg.Join = strings.Split(*join, ",")
	}
	if *peerAddrs != "" {
		cfg.RaftPeerAddrs = map[string]string{}
		for _, kv := range strings.Split(*peerAddrs, ",") {
			id, addr, ok := strings.Cut(kv, "=")
			if !ok {
				return fmt.Errorf("-raft-peer-addrs: %q is not id=host:port", kv)
			}
			cfg.RaftPeerAddrs[id] = addr
		}
	}
	k, err := gossip.ParseKey(*gossipKey)
	if err != nil {
		return err
	}
	cfg.GossipKey = k
	cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: "controller", Level: hclog.LevelFromString(*level), Output: os.Stderr})
	n, err := controller.New(cfg)
	if err != nil {
		return err
	}
	cfg.Logger.Info("controller running", "id", cfg.NodeID, "grpc", n.GRPCAddr(), "raft", n.RaftAddr(), "serf", n.SerfAddr())
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	s := <-sig
	cfg.Logger.Info("stopping", "signal", s.String(), "leave", *leave)
	if *leave {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return n.Leave(ctx)
	}
	return n.Shutdown()
}
