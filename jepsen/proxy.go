package jepsen

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
)

// partitioner cuts and heals directed links between controllers (and, with
// to = -1, from a controller to its clients). Net (network namespaces) and
// Proxies (per-link TCP proxies) both are one.
type partitioner interface {
	Cut(from, to int) error
	Heal() error
}

// Proxies is the partition fallback for machines where network namespaces
// cannot be made (no root, no iproute2, a container without
// CAP_SYS_ADMIN). Every directed Raft link between two controllers goes
// through a TCP proxy of its own on loopback (controller i dials peer j's
// Raft transport at RaftAddr(i, j): the controller's -raft-peer-addrs), and
// every client link to controller i (workers, the gateway, the harness)
// through one more (ClientAddr(i)). A cut from a to b stops the bytes a
// sends to b on every connection of those links, in either connection
// direction, as a blackhole route does: nothing is read from the sender,
// so its socket buffers fill and its RPCs time out, and healing lets the
// stalled bytes through. New connections are accepted but carry nothing
// in the cut direction.
//
// Compared with namespaces it cuts less: Serf gossip, a follower's gRPC
// forwarding to the leader and the controllers' calls to workers do not go
// through proxies, so a partition divides Raft and the clients, not the
// gossip. Failure detection therefore still sees every node alive.
type Proxies struct {
	n int

	mu     sync.Mutex // guards cuts, conns, closed; cond waits on it
	cond   *sync.Cond
	cuts   map[[2]int]bool
	conns  map[net.Conn]struct{}
	closed bool

	lis    []net.Listener
	raft   map[[2]int]string // (from, to) -> proxy address
	client []string          // controller -> client proxy address
	wg     sync.WaitGroup
}

// NewProxies listens for every link of n controllers. raftTarget(j) and
// grpcTarget(j) give controller j's current Raft and gRPC addresses (they
// may change when a controller restarts on new ports).
func NewProxies(n int, raftTarget, grpcTarget func(j int) string) (*Proxies, error) {
	p := &Proxies{n: n, cuts: map[[2]int]bool{}, conns: map[net.Conn]struct{}{}, raft: map[[2]int]string{}}
	p.cond = sync.NewCond(&p.mu)
	listen := func(target func() string, from, to int) (string, error) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return "", fmt.Errorf("proxy %d->%d: %w", from, to, err)
		}
		p.lis = append(p.lis, l)
		p.wg.Go(func() { p.serve(l, target, from, to) })
		return l.Addr().String(), nil
	}
	for i := range n {
		for j := range n {
			if i == j {
				continue
			}
			addr, err := listen(func() string { return raftTarget(j) }, i, j)
			if err != nil {
				p.Close()
				return nil, err
			}
			p.raft[[2]int{i, j}] = addr
		}
		addr, err := listen(func() string { return grpcTarget(i) }, -1, i)
		if err != nil {
			p.Close()
			return nil, err
		}
		p.client = append(p.client, addr)
	}
	return p, nil
}

// RaftAddr is where controller from dials controller to's Raft transport.
func (p *Proxies) RaftAddr(from, to int) string { return p.raft[[2]int{from, to}] }

// ClientAddr is where clients reach controller i's gRPC API.
func (p *Proxies) ClientAddr(i int) string { return p.client[i] }

// serve accepts connections on link from -> to and relays them to target.
// The dialing side is `from` (-1: a client), the accepting side `to`.
func (p *Proxies) serve(l net.Listener, target func() string, from, to int) {
	for {
		in, err := l.Accept()
		if err != nil {
			return
		}
		out, err := net.DialTimeout("tcp", target(), 2*time.Second)
		if err != nil {
			in.Close()
			continue
		}
		if !p.track(in, out) {
			return
		}
		p.wg.Go(func() { p.pump(out, in, from, to) })
		p.wg.Go(func() { p.pump(in, out, to, from) })
	}
}

func (p *Proxies) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		for _, c := range cs {
			c.Close()
		}
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

// pump copies what node `from` sends to node `to`, holding it while that
// direction is cut. It closes both connections when either side ends.
func (p *Proxies) pump(dst, src net.Conn, from, to int) {
	defer p.untrack(dst, src)
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !p.waitOpen(from, to) {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *Proxies) untrack(cs ...net.Conn) {
	p.mu.Lock()
	for _, c := range cs {
		delete(p.conns, c)
	}
	p.mu.Unlock()
	for _, c := range cs {
		c.Close()
	}
}

// waitOpen blocks while from -> to is cut; false once the proxies close.
func (p *Proxies) waitOpen(from, to int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.cuts[[2]int{from, to}] && !p.closed {
		p.cond.Wait()
	}
	return !p.closed
}

// Cut stops what controller from sends to controller to (to = -1: to every
// client; from = -1: every client's to controller to).
func (p *Proxies) Cut(from, to int) error {
	if from == to || from < -1 || to < -1 || from >= p.n || to >= p.n {
		return fmt.Errorf("proxies: no link %d -> %d among %d controllers", from, to, p.n)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cuts[[2]int{from, to}] = true
	return nil
}

// Heal lets every link carry again, stalled bytes first.
func (p *Proxies) Heal() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cuts = map[[2]int]bool{}
	p.cond.Broadcast()
	return nil
}

// Cuts is how many directed links are cut now.
func (p *Proxies) Cuts() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.cuts)
}

// Close stops every proxy and closes every connection through them.
func (p *Proxies) Close() error {
	p.mu.Lock()
	p.closed = true
	conns := p.conns
	p.conns = map[net.Conn]struct{}{}
	p.cond.Broadcast()
	p.mu.Unlock()
	var errs []error
	for _, l := range p.lis {
		if err := l.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			errs = append(errs, err)
		}
	}
	for c := range conns {
		c.Close()
	}
	p.wg.Wait()
	return errors.Join(errs...)
}
