package controller

import (
	"crypto/tls"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// streamLayer is Raft's TCP stream layer, optionally with mutual TLS. It
// tracks every connection so Close can end them: raft's NetworkTransport
// closes neither its pooled outgoing connections nor the accepted ones, and
// their reader goroutines would otherwise outlive the node.
type streamLayer struct {
	net.Listener
	advertise net.Addr
	clientTLS *tls.Config

	mu     sync.Mutex // guards conns and closed
	conns  map[*trackedConn]struct{}
	closed bool
}

type trackedConn struct {
	net.Conn
	layer *streamLayer
}

func (c *trackedConn) Close() error {
	c.layer.mu.Lock()
	delete(c.layer.conns, c)
	c.layer.mu.Unlock()
	return c.Conn.Close()
}

func (s *streamLayer) track(c net.Conn) (net.Conn, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		c.Close()
		return nil, net.ErrClosed
	}
	tc := &trackedConn{Conn: c, layer: s}
	s.conns[tc] = struct{}{}
	return tc, nil
}

// Accept returns the next inbound connection, tracked.
func (s *streamLayer) Accept() (net.Conn, error) {
	c, err := s.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return s.track(c)
}

// Close stops listening and closes every connection.
func (s *streamLayer) Close() error {
	err := s.Listener.Close()
	s.mu.Lock()
	s.closed = true
	conns := s.conns
	s.conns = map[*trackedConn]struct{}{}
	s.mu.Unlock()
	for c := range conns {
		c.Conn.Close()
	}
	return err
}

func newStreamLayer(addr string, serverTLS, clientTLS *tls.Config) (*streamLayer, error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("controller: listen raft on %s: %w", addr, err)
	}
	adv, err := net.ResolveTCPAddr("tcp", addr)
	if err != nil {
		lis.Close()
		return nil, err
	}
	if adv.Port == 0 {
		adv = lis.Addr().(*net.TCPAddr)
	}
	if serverTLS != nil {
		lis = tls.NewListener(lis, serverTLS)
	}
	return &streamLayer{Listener: lis, advertise: adv, clientTLS: clientTLS, conns: map[*trackedConn]struct{}{}}, nil
}

func (s *streamLayer) Addr() net.Addr { return s.advertise }

func (s *streamLayer) Dial(addr raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := &net.Dialer{Timeout: timeout}
	var c net.Conn
	var err error
	if s.clientTLS != nil {
		c, err = tls.DialWithDialer(d, "tcp", string(addr), s.clientTLS)
	} else {
		c, err = d.Dial("tcp", string(addr))
	}
	if err != nil {
		return nil, err
	}
	return s.track(c)
}

// peerAddrs is Config.RaftPeerAddrs as raft's ServerAddressProvider: the
// transport asks it for each RPC's target, and an error makes it use the
// address in the configuration.
type peerAddrs map[string]string

func (p peerAddrs) ServerAddr(id raft.ServerID) (raft.ServerAddress, error) {
	if a, ok := p[string(id)]; ok {
		return raft.ServerAddress(a), nil
	}
	return "", fmt.Errorf("controller: no address override for %s", id)
}

// DialOptions returns the gRPC dial options for a client of lumen's servers.
func DialOptions(clientTLS *tls.Config) []grpc.DialOption {
	creds := insecure.NewCredentials()
	if clientTLS != nil {
		creds = credentials.NewTLS(clientTLS)
	}
	return []grpc.DialOption{grpc.WithTransportCredentials(creds)}
}

// peerConns caches gRPC connections to other replicas.
type peerConns struct {
	tls   *tls.Config
	mu    sync.Mutex // guards conns
	conns map[string]*grpc.ClientConn
}

func newPeerConns(t *tls.Config) *peerConns {
	return &peerConns{tls: t, conns: map[string]*grpc.ClientConn{}}
}

func (p *peerConns) get(addr string) (*grpc.ClientConn, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if cc, ok := p.conns[addr]; ok {
		return cc, nil
	}
	cc, err := grpc.NewClient(addr, DialOptions(p.tls)...)
	if err != nil {
		return nil, err
	}
	p.conns[addr] = cc
	return cc, nil
}

func (p *peerConns) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, cc := range p.conns {
		cc.Close()
	}
	p.conns = map[string]*grpc.ClientConn{}
}
