// Package gossip starts the Serf agent that controllers and workers share.
// Membership is gossip; decisions are not: the controller leader turns a
// failed member into a Raft command.
package gossip

import (
	"encoding/base64"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/memberlist"
	"github.com/hashicorp/serf/serf"
)

// Tag keys.
const (
	TagRole        = "role"   // RoleController or RoleWorker
	TagRaftAddr    = "raft"   // controllers: Raft transport address
	TagGRPCAddr    = "grpc"   // gRPC address
	TagExpect      = "expect" // controllers: -bootstrap-expect
	TagIncarnation = "inc"    // workers: incarnation
)

// Roles.
const (
	RoleController = "controller"
	RoleWorker     = "worker"
)

// Config configures a Serf agent.
type Config struct {
	NodeName string
	// BindAddr is host:port for gossip (TCP and UDP). Port 0 picks one.
	BindAddr string
	Tags     map[string]string
	// Key encrypts gossip when set (16, 24 or 32 bytes).
	Key    []byte
	Logger hclog.Logger
	// EventCh receives Serf's events; nil drops them.
	EventCh chan<- serf.Event
}

// MemberlistConfig returns memberlist's LAN configuration tuned so a dead
// member is declared failed in about a second: probe every 200 ms with a
// 100 ms timeout, gossip every 100 ms, and a short suspicion timeout.
func MemberlistConfig() *memberlist.Config {
	c := memberlist.DefaultLANConfig()
	c.ProbeInterval = 200 * time.Millisecond
	c.ProbeTimeout = 100 * time.Millisecond
	c.GossipInterval = 100 * time.Millisecond
	c.SuspicionMult = 2
	c.SuspicionMaxTimeoutMult = 3
	c.PushPullInterval = 5 * time.Second
	c.TCPTimeout = 2 * time.Second
	return c
}

// Start creates the Serf agent.
func Start(cfg Config) (*serf.Serf, error) {
	host, portStr, err := net.SplitHostPort(cfg.BindAddr)
	if err != nil {
		return nil, fmt.Errorf("gossip: bind address %q: %w", cfg.BindAddr, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, fmt.Errorf("gossip: bind port %q: %w", portStr, err)
	}
	if port == 0 {
		// memberlist wants a concrete port for TCP and UDP alike.
		if port, err = freePort(host); err != nil {
			return nil, err
		}
	}
	ml := MemberlistConfig()
	ml.Name = cfg.NodeName
	ml.BindAddr, ml.BindPort = host, port
	ml.AdvertiseAddr, ml.AdvertisePort = host, port
	if len(cfg.Key) > 0 {
		ml.SecretKey = cfg.Key
	}
	sc := serf.DefaultConfig()
	sc.NodeName = cfg.NodeName
	sc.Tags = cfg.Tags
	sc.MemberlistConfig = ml
	sc.EventCh = cfg.EventCh
	sc.ReconnectTimeout = 10 * time.Minute
	sc.TombstoneTimeout = 10 * time.Minute
	sc.EnableNameConflictResolution = false
	logger := cfg.Logger
	if logger == nil {
		logger = hclog.NewNullLogger()
	}
	std := logger.StandardLogger(&hclog.StandardLoggerOptions{InferLevels: true})
	sc.Logger = std
	ml.Logger = std
	s, err := serf.Create(sc)
	if err != nil {
		return nil, fmt.Errorf("gossip: start serf on %s: %w", cfg.BindAddr, err)
	}
	return s, nil
}

// Addr returns the agent's gossip address.
func Addr(s *serf.Serf) string {
	m := s.LocalMember()
	return net.JoinHostPort(m.Addr.String(), strconv.Itoa(int(m.Port)))
}

func freePort(host string) (int, error) {
	for i := 0; i < 20; i++ {
		l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			return 0, fmt.Errorf("gossip: pick a port on %s: %w", host, err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		u, err := net.ListenPacket("udp", net.JoinHostPort(host, strconv.Itoa(port)))
		if err == nil {
			u.Close()
			return port, nil
		}
	}
	return 0, fmt.Errorf("gossip: no port free for both TCP and UDP on %s", host)
}

// ParseKey decodes a -gossip-key: base64 of 16, 24 or 32 bytes (an
// AES-128, -192 or -256 key, as `consul keygen` prints one). Empty is no
// key.
func ParseKey(s string) ([]byte, error) {
	if s == "" {
		return nil, nil
	}
	k, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("-gossip-key is not base64: %w", err)
	}
	if n := len(k); n != 16 && n != 24 && n != 32 {
		return nil, fmt.Errorf("-gossip-key is %d bytes; it must be 16, 24 or 32", n)
	}
	return k, nil
}
