// Package controller runs one replica of lumen's controller quorum: a Raft
// node (hashicorp/raft on raft-boltdb/bbolt) holding the fsm tables, a Serf
// agent watching workers, and the gRPC API that gateways, workers and
// operators call.
//
// Any replica answers any call. Followers forward writes and linearizable
// reads to the leader; stale reads are served locally. The leader coalesces
// the commands that arrive together into one log entry, serves linearizable
// reads by CommitIndex → VerifyLeader → wait for the FSM to apply it (one
// VerifyLeader round shared by every read that arrived before it began), and
// runs leader-only work — failure detection from Serf, reconciliation — after
// its first Barrier.
package controller

import (
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/lumen-project/lumen/internal/tlsconf"
)

// Base Raft timings at RaftMultiplier 1, tuned for a LAN: a follower starts an
// election after 300–600 ms without a heartbeat. Scale them up with
// RaftMultiplier on slow or busy machines, as Consul and Nomad do.
const (
	baseHeartbeatTimeout   = 300 * time.Millisecond
	baseElectionTimeout    = 300 * time.Millisecond
	baseLeaderLeaseTimeout = 150 * time.Millisecond
	baseCommitTimeout      = 20 * time.Millisecond
)

// Config configures a controller replica.
type Config struct {
	// NodeID names the replica in Raft and Serf. Required; stable across
	// restarts.
	NodeID string
	// DataDir holds raft.db (log and stable store, bbolt with fsync) and
	// snapshots/. Required.
	DataDir string
	// RaftAddr is the Raft transport's host:port. Required.
	RaftAddr string
	// GRPCAddr is the API's host:port. Required.
	GRPCAddr string
	// SerfAddr is the gossip host:port. Required.
	SerfAddr string
	// HTTPAddr serves /metrics, /healthz and /readyz; empty disables it.
	HTTPAddr string

	// BootstrapExpect, when > 0, bootstraps a new cluster once this many
	// controllers with the same expectation see each other in Serf. Ignored
	// when the data directory already holds Raft state.
	BootstrapExpect int
	// Join lists Serf addresses of existing members to join at start.
	Join []string
	// RaftPeerAddrs overrides, by replica id, the address this replica
	// dials for that peer's Raft transport instead of the one in the Raft
	// configuration: for a peer reached through a NAT or a proxy (the
	// jepsen suite's per-link proxies). Peers not named are dialed as
	// configured.
	RaftPeerAddrs map[string]string

	// RaftMultiplier scales the Raft timeouts (default 1: 300 ms heartbeat
	// and election timeouts). Range (0, 10].
	RaftMultiplier float64
	// SnapshotThreshold is how many log entries pass between snapshots
	// (default 8192); TrailingLogs how many stay after one (default 10240).
	SnapshotThreshold uint64
	TrailingLogs      uint64
	// SnapshotInterval is how often Raft checks whether to snapshot
	// (default 30 s).
	SnapshotInterval time.Duration

	// BatchMax caps the commands coalesced into one log entry (default 1024).
	BatchMax int
	// BatchInflight caps the log entries proposed but not yet applied
	// (default 4): while they are in flight, new commands accumulate into
	// the next entry (group commit).
	BatchInflight int

	// RequestTimeout bounds a call with no deadline of its own (default 5 s).
	// A call that cannot reach a quorum in time fails Unavailable.
	RequestTimeout time.Duration

	// ProbeTimeout bounds the leader's probe of a worker reported
	// unreachable (dial plus gRPC health check; default 300 ms). Longer
	// spares a slow worker; shorter answers the reporter sooner.
	ProbeTimeout time.Duration

	// MigrationInterval is how often the leader runs a round of migration
	// scheduling (default 500 ms, Llumnix's rescheduling interval): it
	// proposes the migrations policy.PlanMigrations decides — for balance
	// while migration is on, and off every DRAINING worker always — and
	// aborts those past MigrationTimeout. Shorter reacts to imbalance
	// sooner; each round reads the whole placement table.
	MigrationInterval time.Duration
	// MigrationTimeout bounds a live migration from its start (the leader
	// stamp of its MigrateCmd) to its commit (default 10 s): the leader
	// aborts one that has not committed by then, and the destination,
	// seeing Migration ABORTED, frees the pages it pre-allocated. A
	// migration of an 8k-token request copies in about 100 ms at 12.5 GB/s
	// (docs/calibration.md, "Migration arithmetic"), so 10 s only catches a
	// stuck one: a source or destination that hangs without failing, a
	// lost stream. Raise it with the emulated time scale of slow profiles.
	MigrationTimeout time.Duration

	// GossipKey encrypts Serf traffic (16, 24 or 32 bytes); empty disables.
	GossipKey []byte
	// TLS, when enabled, secures gRPC (server and client) and the Raft
	// transport with mutual TLS.
	TLS tlsconf.Files

	Logger hclog.Logger
}

// DefaultConfig returns a Config with every optional field at its default.
func DefaultConfig() Config {
	return Config{
		RaftMultiplier:    1,
		SnapshotThreshold: 8192,
		TrailingLogs:      10240,
		SnapshotInterval:  30 * time.Second,
		BatchMax:          1024,
		BatchInflight:     4,
		RequestTimeout:    5 * time.Second,
		ProbeTimeout:      300 * time.Millisecond,
		MigrationInterval: 500 * time.Millisecond,
		MigrationTimeout:  10 * time.Second,
	}
}

// Validate checks the configuration and says what is wrong.
func (c *Config) Validate() error {
	var errs []error
	for name, v := range map[string]string{"NodeID": c.NodeID, "DataDir": c.DataDir,
		"RaftAddr": c.RaftAddr, "GRPCAddr": c.GRPCAddr, "SerfAddr": c.SerfAddr} {
		if v == "" {
			errs = append(errs, fmt.Errorf("%s is required", name))
		}
	}
	if c.RaftMultiplier <= 0 || c.RaftMultiplier > 10 {
		errs = append(errs, fmt.Errorf("RaftMultiplier (%v) must be in (0, 10]", c.RaftMultiplier))
	}
	if c.BootstrapExpect < 0 || c.BootstrapExpect > 9 {
		errs = append(errs, fmt.Errorf("BootstrapExpect (%d) must be between 0 and 9", c.BootstrapExpect))
	}
	if c.BatchMax < 1 || c.BatchInflight < 1 {
		errs = append(errs, fmt.Errorf("BatchMax (%d) and BatchInflight (%d) must be at least 1", c.BatchMax, c.BatchInflight))
	}
	if c.RequestTimeout <= 0 {
		errs = append(errs, fmt.Errorf("RequestTimeout (%s) must be positive", c.RequestTimeout))
	}
	if c.ProbeTimeout <= 0 {
		errs = append(errs, fmt.Errorf("ProbeTimeout (%s) must be positive", c.ProbeTimeout))
	}
	if c.MigrationInterval <= 0 || c.MigrationTimeout <= 0 {
		errs = append(errs, fmt.Errorf("MigrationInterval (%s) and MigrationTimeout (%s) must be positive", c.MigrationInterval, c.MigrationTimeout))
	} else if c.MigrationTimeout < c.MigrationInterval {
		errs = append(errs, fmt.Errorf("MigrationTimeout (%s) cannot be shorter than MigrationInterval (%s): the leader checks it once a round", c.MigrationTimeout, c.MigrationInterval))
	}
	if n := len(c.GossipKey); n != 0 && n != 16 && n != 24 && n != 32 {
		errs = append(errs, fmt.Errorf("GossipKey is %d bytes; it must be 16, 24 or 32", n))
	}
	for id, addr := range c.RaftPeerAddrs {
		if _, _, err := net.SplitHostPort(addr); id == "" || err != nil {
			errs = append(errs, fmt.Errorf("RaftPeerAddrs: %q=%q must be a replica id and a host:port", id, addr))
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("controller: invalid config: %w", errors.Join(errs...))
	}
	return nil
}

func (c *Config) scaled(d time.Duration) time.Duration {
	return time.Duration(float64(d) * c.RaftMultiplier)
}
