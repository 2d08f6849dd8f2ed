// Package workerdir is the worker-address directory: it maps worker ids to
// gRPC connections to their Inference service, reading addresses from the
// controller's workers table. The gateway dials serving workers through it
// and a serving worker dials its requests' checkpoint holders.
//
// Addresses come from stale reads (any replica answers; an address is not a
// decision). An unknown id refreshes the table once; a known id is served
// from the cache until the next refresh names a new address for it, so a
// worker that restarts on another port is found again after one refresh.
package workerdir

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Errors of a lookup.
var (
	// ErrUnknownWorker: the workers table has no row for the id, even
	// after a refresh.
	ErrUnknownWorker = errors.New("workerdir: worker is not in the workers table")
	// ErrClosed: the directory was closed.
	ErrClosed = errors.New("workerdir: directory closed")
)

// Lister reads the workers table; *ctlclient.Client is one.
type Lister interface {
	ListWorkers(ctx context.Context, req *pb.ListWorkersRequest) (*pb.ListWorkersResponse, error)
}

// Directory maps worker ids to connections. It is safe for concurrent use.
type Directory struct {
	list Lister
	opts []grpc.DialOption

	mu     sync.Mutex                  // guards addrs, conns, probes, closed
	addrs  map[string]string           // worker id → gRPC address
	conns  map[string]*grpc.ClientConn // address → connection
	probes map[string]*probe           // address → its reachability probe (retry)
	closed bool

	// reconnectWait bounds a probe and the reconnection after it
	// (ReconnectWait; tests lengthen it).
	reconnectWait time.Duration
}

// probe is the last reachability probe of an address whose connection was
// in TRANSIENT_FAILURE: one caller at a time probes (mu, tried without
// waiting), at most every probeEvery.
type probe struct {
	mu sync.Mutex
	at time.Time
}

// New returns a directory that reads the table through list and dials with
// opts (plaintext when none are given).
func New(list Lister, opts ...grpc.DialOption) *Directory {
	if len(opts) == 0 {
		opts = []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	}
	return &Directory{list: list, opts: opts, addrs: map[string]string{}, conns: map[string]*grpc.ClientConn{},
		probes: map[string]*probe{}, reconnectWait: ReconnectWait}
}

// Refresh reads the workers table (a stale read), records every worker's
// address, and returns the rows for callers that want more of them (the
// gateway's readiness check and context limit).
func (d *Directory) Refresh(ctx context.Context) ([]*pb.Worker, error) {
	if d.list == nil {
		return nil, fmt.Errorf("workerdir: no controller to read the workers table from")
	}
	resp, err := d.list.ListWorkers(ctx, &pb.ListWorkersRequest{Consistency: pb.Consistency_CONSISTENCY_STALE})
	if err != nil {
		return nil, fmt.Errorf("workerdir: list workers: %w", err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, w := range resp.Workers {
		if w.GrpcAddr != "" {
			d.addrs[w.Id] = w.GrpcAddr
		}
	}
	return resp.Workers, nil
}

// Addr returns the address recorded for a worker, refreshing the table once
// when the id is unknown.
func (d *Directory) Addr(ctx context.Context, id string) (string, error) {
	d.mu.Lock()
	addr, ok := d.addrs[id]
	d.mu.Unlock()
	if ok {
		return addr, nil
	}
	if _, err := d.Refresh(ctx); err != nil {
		return "", err
	}
	d.mu.Lock()
	addr, ok = d.addrs[id]
	d.mu.Unlock()
	if !ok {
		return "", fmt.Errorf("%w: %q", ErrUnknownWorker, id)
	}
	return addr, nil
}

// Conn returns a connection to a worker's Inference service. Connections are
// shared per address and live until Close.
//
// A connection whose worker died sits in TRANSIENT_FAILURE, gRPC's
// backoff between attempts growing to two minutes, and a call made then
// fails at once without trying, until an attempt succeeds. A worker that
// comes back on the same address (a restarted process, a container
// restarted in its pod) was found only at the next attempt: measured on
// real processes, a gateway sent none of four restarted workers' new
// requests for 13–39 s after they registered, and re-placed the requests
// their failed calls cost, each a second or more late (docs/benchmarks.md,
// issue 22). So Conn, finding the connection in TRANSIENT_FAILURE, probes
// the address (retry): a worker back there gets its connection at once.
func (d *Directory) Conn(ctx context.Context, id string) (*grpc.ClientConn, error) {
	addr, err := d.Addr(ctx, id)
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil, ErrClosed
	}
	cc, ok := d.conns[addr]
	if !ok {
		cc, err = grpc.NewClient(addr, d.opts...)
		if err != nil {
			d.mu.Unlock()
			return nil, fmt.Errorf("workerdir: dial %s at %s: %w", id, addr, err)
		}
		d.conns[addr] = cc
	}
	p := d.probes[addr]
	if p == nil {
		p = &probe{}
		d.probes[addr] = p
	}
	wait := d.reconnectWait
	d.mu.Unlock()
	if cc.GetState() == connectivity.TransientFailure {
		retry(ctx, addr, cc, p, wait)
	}
	return cc, nil
}

// retry probes addr, whose connection cc is in TRANSIENT_FAILURE, with a
// plain TCP connect bounded by wait. Refused (the worker is still down, the
// usual case) it returns at once, and the call fails as it did, without
// waiting. Accepted, it resets cc's backoff and waits, at most wait again,
// until cc is READY: the channel answers calls with its last failure
// until a connection is ready, so the call would fail without the wait.
// One caller probes at a time, at most every probeEvery; the others,
// meanwhile, go on with cc as it is.
func retry(ctx context.Context, addr string, cc *grpc.ClientConn, p *probe, wait time.Duration) {
	if !p.mu.TryLock() {
		return
	}
	defer p.mu.Unlock()
	if time.Since(p.at) < probeEvery {
		return
	}
	p.at = time.Now()
	if _, _, err := net.SplitHostPort(addr); err != nil {
		// Not a host:port (a gRPC target with a scheme): no probe, only
		// the connection's next attempt brought forward.
		cc.ResetConnectBackoff()
		return
	}
	dctx, cancel := context.WithTimeout(ctx, wait)
	c, err := (&net.Dialer{}).DialContext(dctx, "tcp", addr)
	cancel()
	if err != nil {
		return
	}
	c.Close()
	cc.ResetConnectBackoff()
	wctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	for st := cc.GetState(); st != connectivity.Ready; st = cc.GetState() {
		if st == connectivity.Shutdown || !cc.WaitForStateChange(wctx, st) {
			return
		}
	}
}

// ReconnectWait bounds a probe of a connection in TRANSIENT_FAILURE and the
// reconnection after an accepted one: on a datacenter network a refused
// connection fails in well under a millisecond and an accepted one is
// ready in a round trip or two (a TLS handshake).
const ReconnectWait = 500 * time.Millisecond

// probeEvery spaces the probes of one address: a dead worker's address is
// probed at most ten times a second, however many calls ask for it.
const probeEvery = 100 * time.Millisecond

// Close closes every connection; later Conn calls fail with ErrClosed.
// Idempotent.
func (d *Directory) Close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	for addr, cc := range d.conns {
		cc.Close()
		delete(d.conns, addr)
	}
}
