package controller

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"github.com/hashicorp/serf/serf"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"

	"github.com/lumen-project/lumen/fsm"
	"github.com/lumen-project/lumen/internal/gossip"
	"github.com/lumen-project/lumen/internal/healthz"
	"github.com/lumen-project/lumen/internal/liveness"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/ui"
)

// Node is one controller replica. Start it with New; stop it with Shutdown
// (idempotent) or Leave.
type Node struct {
	cfg Config
	log hclog.Logger

	fsm   *fsm.FSM
	raft  *raft.Raft
	store *raftboltdb.BoltStore
	trans *raft.NetworkTransport
	layer *streamLayer

	serf       *serf.Serf
	serfEvents chan serf.Event

	grpc      *grpc.Server
	grpcLis   net.Listener
	health    *health.Server
	httpSrv   *http.Server
	clientTLS *tls.Config
	metrics   *metrics

	peers *peerConns

	// leaderNotify receives Raft's leadership changes (Config.NotifyCh).
	leaderNotify chan bool
	// memberCh carries Serf membership changes to the leader loop.
	memberCh chan struct{}

	// mu guards leader and bootstrapped.
	mu           sync.Mutex
	leader       *leaderState
	bootstrapped bool

	shutdownCh   chan struct{}
	shutdownOnce sync.Once
	shutdownErr  error
	wg           sync.WaitGroup
}

// leaderState exists while this replica leads. ready closes once the first
// Barrier has completed; stop closes when leadership is lost.
type leaderState struct {
	ready    chan struct{}
	stop     chan struct{}
	proposer *proposer
	reads    *readBatcher
	done     sync.WaitGroup
}

// New starts a replica: opens (or creates) its Raft state under DataDir,
// joins Serf, and serves gRPC (and HTTP when configured).
func New(cfg Config) (n *Node, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	logger := cfg.Logger
	if logger == nil {
		logger = hclog.New(&hclog.LoggerOptions{Name: "controller", Level: hclog.Info})
	}
	logger = logger.With("node", cfg.NodeID)
	n = &Node{
		cfg:          cfg,
		log:          logger,
		fsm:          fsm.New(),
		serfEvents:   make(chan serf.Event, 256),
		leaderNotify: make(chan bool, 16),
		memberCh:     make(chan struct{}, 1),
		shutdownCh:   make(chan struct{}),
		metrics:      newMetrics(),
	}
	n.fsm.ObserveApply(n.metrics.observeApply)
	n.metrics.reg.MustRegister(newWorkerTable(n.fsm))
	// Every failed start returns (nil, err), so the cleanup must hold on to
	// the node itself rather than read the named result.
	started := n
	defer func() {
		if err != nil {
			_ = started.Shutdown()
		}
	}()
	serverTLS, clientTLS, err := cfg.TLS.Load()
	if err != nil {
		return nil, err
	}
	n.clientTLS = clientTLS
	n.peers = newPeerConns(clientTLS)
	if err := os.MkdirAll(cfg.DataDir, 0o755); err != nil {
		return nil, fmt.Errorf("controller: data dir: %w", err)
	}
	// Listen first, so ":0" resolves to the addresses Serf advertises.
	if n.grpcLis, err = net.Listen("tcp", cfg.GRPCAddr); err != nil {
		return nil, fmt.Errorf("controller: listen gRPC on %s: %w", cfg.GRPCAddr, err)
	}
	n.cfg.GRPCAddr = n.grpcLis.Addr().String()
	if err := n.setupRaft(serverTLS, clientTLS); err != nil {
		return nil, err
	}
	if err := n.setupSerf(); err != nil {
		return nil, err
	}
	if err := n.setupGRPC(serverTLS); err != nil {
		return nil, err
	}
	if cfg.HTTPAddr != "" {
		if err := n.setupHTTP(); err != nil {
			return nil, err
		}
	}
	n.goFunc(n.monitorLeadership)
	n.goFunc(n.handleSerfEvents)
	n.goFunc(n.observe)
	n.goFunc(n.countMigrations)
	if len(cfg.Join) > 0 {
		n.goFunc(n.retryJoin)
	}
	n.maybeBootstrap()
	return n, nil
}

func (n *Node) goFunc(f func()) {
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		f()
	}()
}

func (n *Node) raftConfig() *raft.Config {
	c := raft.DefaultConfig()
	c.LocalID = raft.ServerID(n.cfg.NodeID)
	c.HeartbeatTimeout = n.cfg.scaled(baseHeartbeatTimeout)
	c.ElectionTimeout = n.cfg.scaled(baseElectionTimeout)
	c.LeaderLeaseTimeout = n.cfg.scaled(baseLeaderLeaseTimeout)
	c.CommitTimeout = n.cfg.scaled(baseCommitTimeout)
	c.SnapshotThreshold = n.cfg.SnapshotThreshold
	c.TrailingLogs = n.cfg.TrailingLogs
	c.SnapshotInterval = n.cfg.SnapshotInterval
	// A replica removed from the configuration keeps running Raft, so an
	// operator (or jepsen's membership nemesis) can add it back; with the
	// default it shut down and, added back, counted as a dead voter.
	c.ShutdownOnRemove = false
	c.BatchApplyCh = true
	c.MaxAppendEntries = 256
	c.NotifyCh = n.leaderNotify
	c.Logger = n.log.Named("raft")
	return c
}

func (n *Node) setupRaft(serverTLS, clientTLS *tls.Config) error {
	store, err := raftboltdb.New(raftboltdb.Options{Path: filepath.Join(n.cfg.DataDir, "raft.db")})
	if err != nil {
		return fmt.Errorf("controller: open raft.db: %w", err)
	}
	n.store = store
	counted := newCountingStore(store, n.metrics)
	logs, err := raft.NewLogCache(512, counted)
	if err != nil {
		return err
	}
	snaps, err := raft.NewFileSnapshotStoreWithLogger(n.cfg.DataDir, 3, n.log.Named("snapshots"))
	if err != nil {
		return fmt.Errorf("controller: snapshot store: %w", err)
	}
	layer, err := newStreamLayer(n.cfg.RaftAddr, serverTLS, clientTLS)
	if err != nil {
		return err
	}
	n.layer = layer
	tc := &raft.NetworkTransportConfig{Stream: layer, MaxPool: 3, Timeout: 10 * time.Second, Logger: n.log.Named("transport")}
	if len(n.cfg.RaftPeerAddrs) > 0 {
		tc.ServerAddressProvider = peerAddrs(n.cfg.RaftPeerAddrs)
	}
	n.trans = raft.NewNetworkTransportWithConfig(tc)
	n.cfg.RaftAddr = string(n.trans.LocalAddr())
	conf := n.raftConfig()
	if err := raft.ValidateConfig(conf); err != nil {
		return fmt.Errorf("controller: raft config: %w", err)
	}
	r, err := raft.NewRaft(conf, n.fsm, logs, counted, snaps, n.trans)
	if err != nil {
		return fmt.Errorf("controller: start raft: %w", err)
	}
	n.raft = r
	existing, err := raft.HasExistingState(logs, counted, snaps)
	if err != nil {
		return err
	}
	n.bootstrapped = existing
	return nil
}

func (n *Node) setupSerf() error {
	s, err := gossip.Start(gossip.Config{
		NodeName: n.cfg.NodeID,
		BindAddr: n.cfg.SerfAddr,
		Key:      n.cfg.GossipKey,
		Logger:   n.log.Named("serf"),
		EventCh:  n.serfEvents,
		Tags: map[string]string{
			gossip.TagRole:     gossip.RoleController,
			gossip.TagRaftAddr: n.cfg.RaftAddr,
			gossip.TagGRPCAddr: n.cfg.GRPCAddr,
			gossip.TagExpect:   fmt.Sprint(n.cfg.BootstrapExpect),
		},
	})
	if err != nil {
		return err
	}
	n.serf = s
	n.cfg.SerfAddr = gossip.Addr(s)
	return nil
}

func (n *Node) setupGRPC(serverTLS *tls.Config) error {
	lis := n.grpcLis
	opts := append(liveness.ServerOptions(), recoveryOptions(n.log, n.metrics.panics.Inc)...)
	if serverTLS != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(serverTLS)))
	}
	n.grpc = grpc.NewServer(opts...)
	srv := &server{n: n}
	pb.RegisterControllerServer(n.grpc, srv)
	pb.RegisterOperatorServer(n.grpc, srv)
	n.health = health.NewServer()
	healthpb.RegisterHealthServer(n.grpc, n.health)
	reflection.Register(n.grpc)
	n.health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	n.health.SetServingStatus(pb.Controller_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)
	n.goFunc(func() {
		if err := n.grpc.Serve(lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			n.log.Error("gRPC server stopped", "error", err)
		}
	})
	return nil
}

func (n *Node) setupHTTP() error {
	lis, err := net.Listen("tcp", n.cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("controller: listen HTTP on %s: %w", n.cfg.HTTPAddr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(n.metrics.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.Handle("/ui/", ui.New(ui.Config{Replica: n, Dial: n.peers.get, Stop: n.shutdownCh, Go: n.goFunc}))
	mux.HandleFunc("/healthz", healthz.OK)
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		healthz.Stamp(w)
		if addr, id := n.raft.LeaderWithID(); addr == "" {
			http.Error(w, "no leader", http.StatusServiceUnavailable)
		} else {
			fmt.Fprintf(w, "leader %s\n", id)
		}
	})
	n.httpSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	n.goFunc(func() {
		if err := n.httpSrv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			n.log.Error("HTTP server stopped", "error", err)
		}
	})
	return nil
}

// ID returns the replica's node id.
func (n *Node) ID() string { return n.cfg.NodeID }

// GRPCAddr returns the address the API listens on.
func (n *Node) GRPCAddr() string { return n.grpcLis.Addr().String() }

// SerfAddr returns the gossip address.
func (n *Node) SerfAddr() string { return n.cfg.SerfAddr }

// RaftAddr returns the Raft transport address.
func (n *Node) RaftAddr() string { return n.cfg.RaftAddr }

// Raft exposes the Raft node (for tests and operator tooling).
func (n *Node) Raft() *raft.Raft { return n.raft }

// FSM exposes the state machine (read-only use).
func (n *Node) FSM() *fsm.FSM { return n.fsm }

// IsLeader reports whether this replica leads and has finished its first
// Barrier.
func (n *Node) IsLeader() bool {
	n.mu.Lock()
	ls := n.leader
	n.mu.Unlock()
	if ls == nil {
		return false
	}
	select {
	case <-ls.ready:
		return true
	default:
		return false
	}
}

// Shutdown stops the replica without leaving the cluster: its Raft state
// stays on disk and it rejoins as the same voter when restarted. Idempotent.
func (n *Node) Shutdown() error {
	n.shutdownOnce.Do(func() {
		close(n.shutdownCh)
		var errs []error
		if n.health != nil {
			n.health.Shutdown()
		}
		if n.grpc != nil {
			stopped := make(chan struct{})
			go func() { n.grpc.GracefulStop(); close(stopped) }()
			select {
			case <-stopped:
			case <-time.After(2 * time.Second):
				n.grpc.Stop()
			}
		} else if n.grpcLis != nil {
			n.grpcLis.Close()
		}
		if n.httpSrv != nil {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_ = n.httpSrv.Shutdown(ctx)
			cancel()
		}
		n.stopLeading()
		if n.raft != nil {
			errs = append(errs, n.raft.Shutdown().Error())
		}
		if n.serf != nil {
			errs = append(errs, n.serf.Shutdown())
		}
		if n.trans != nil {
			errs = append(errs, n.trans.Close())
		}
		if n.layer != nil {
			n.layer.Close() // closes what the transport leaves open
		}
		if n.store != nil {
			errs = append(errs, n.store.Close())
		}
		if n.peers != nil {
			n.peers.close()
		}
		n.wg.Wait()
		n.shutdownErr = errors.Join(errs...)
	})
	return n.shutdownErr
}

// Leave removes this replica from the quorum and from Serf, then shuts it
// down: a graceful, permanent departure. A leader hands leadership over first.
func (n *Node) Leave(ctx context.Context) error {
	if n.raft.State() == raft.Leader {
		if err := n.raft.LeadershipTransfer().Error(); err != nil {
			n.log.Warn("leadership transfer before leave failed", "error", err)
		}
	}
	cc, err := n.leaderConn(ctx)
	if err == nil {
		_, err = pb.NewOperatorClient(cc).RemovePeer(ctx, &pb.RemovePeerRequest{Id: n.cfg.NodeID})
	}
	if err != nil {
		n.log.Warn("could not remove self from the raft configuration", "error", err)
	}
	if lerr := n.serf.Leave(); lerr != nil {
		n.log.Warn("serf leave failed", "error", lerr)
	}
	return errors.Join(err, n.Shutdown())
}

// retryJoin joins the Serf addresses in Join, retrying every second until
// one answers: peers of a quorum start in any order.
func (n *Node) retryJoin() {
	wait := 100 * time.Millisecond
	for attempt := 0; ; attempt++ {
		if _, err := n.serf.Join(n.cfg.Join, true); err == nil {
			return
		} else if attempt%10 == 9 {
			n.log.Warn("still cannot join Serf", "addresses", n.cfg.Join, "error", err)
		}
		select {
		case <-n.shutdownCh:
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, time.Second)
	}
}

// maybeBootstrap bootstraps a new cluster once BootstrapExpect controllers
// with the same expectation see each other. Every one of them bootstraps the
// same configuration, which raft allows. A replica started with the same
// flags later (a replacement with an empty data directory) must not
// bootstrap a configuration of its own beside the running cluster's: when
// any other controller answers that it belongs to a cluster with state, this
// one waits for the leader to add it as a voter.
func (n *Node) maybeBootstrap() {
	n.mu.Lock()
	done := n.bootstrapped || n.cfg.BootstrapExpect == 0
	n.mu.Unlock()
	if done {
		return
	}
	var servers []raft.Server
	var peers []string // the others' gRPC addresses
	for _, m := range n.serf.Members() {
		if m.Status != serf.StatusAlive || m.Tags[gossip.TagRole] != gossip.RoleController {
			continue
		}
		if m.Tags[gossip.TagExpect] != fmt.Sprint(n.cfg.BootstrapExpect) {
			n.log.Warn("controller with another -bootstrap-expect", "member", m.Name, "expect", m.Tags[gossip.TagExpect])
			continue
		}
		servers = append(servers, raft.Server{ID: raft.ServerID(m.Name), Address: raft.ServerAddress(m.Tags[gossip.TagRaftAddr])})
		if m.Name != n.cfg.NodeID && m.Tags[gossip.TagGRPCAddr] != "" {
			peers = append(peers, m.Tags[gossip.TagGRPCAddr])
		}
	}
	if len(servers) < n.cfg.BootstrapExpect {
		return
	}
	if peer := n.existingCluster(peers); peer != "" {
		n.log.Info("not bootstrapping: a controller already belongs to a cluster; waiting to be added as a voter", "peer", peer)
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.bootstrapped {
		return
	}
	// A member that already joined an existing cluster leaves us nothing to
	// bootstrap: ask raft whether it has a configuration first.
	if err := n.raft.BootstrapCluster(raft.Configuration{Servers: servers}).Error(); err != nil && !errors.Is(err, raft.ErrCantBootstrap) {
		n.log.Error("bootstrap failed", "error", err)
		return
	}
	n.log.Info("bootstrapped cluster", "servers", len(servers))
	n.bootstrapped = true
}

// existingCluster asks the other controllers, at once and for at most a
// second, whether one already has a cluster with state (a leader or a commit
// index above zero), and returns the first that says so. A peer that does
// not answer says nothing: at a first start nobody has state yet.
func (n *Node) existingCluster(peers []string) string {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	found := make(chan string, len(peers))
	var wg sync.WaitGroup
	for _, addr := range peers {
		cc, err := n.peers.get(addr)
		if err != nil {
			continue
		}
		wg.Go(func() {
			st, err := pb.NewOperatorClient(cc).ClusterStatus(ctx, &pb.ClusterStatusRequest{})
			if err == nil && (st.LeaderId != "" || st.CommitIndex > 0) {
				found <- st.NodeId
			}
		})
	}
	wg.Wait()
	close(found)
	return <-found
}
