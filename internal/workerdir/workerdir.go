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

	mu     sync.Mutex                  // guards addrs, conns, closed
	addrs  map[string]string           // worker id → gRPC address
	conns  map[string]*grpc.ClientConn // address → connection
	closed bool
}

// New returns a directory that reads the table through list and dials with
// opts (plaintext when none are given).
func New(list Lister, opts ...grpc.DialOption) *Directory {
	if len(opts) == 0 {
		opts = []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	}
	return &Directory{list: list, opts: opts, addrs: map[string]string{}, conns: map[string]*grpc.ClientConn{}}
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
// A connection whose worker died sits in TRANSIENT_FAILURE between
// attempts, gRPC's backoff growing to two minutes, and a call made then
// fails at once without trying. A worker that comes back on the same
// address (a restarted process, a container restarted in its pod) would
// be found only at the next attempt: measured on real processes, a
// gateway sent none of four restarted workers' new requests for 10–40 s
// after they registered, and re-placed the requests their failed calls
// cost, each a second or more late (docs/benchmarks.md, issue 22). The
// caller asks for a worker it holds alive, so Conn tries at once: it
// resets the backoff and waits, at most ReconnectWait, for the attempt
// to leave TRANSIENT_FAILURE (connecting, the call then waits for it as
// for any connection; refused again, the call fails as before).
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
	d.mu.Unlock()
	if cc.GetState() == connectivity.TransientFailure {
		cc.ResetConnectBackoff()
		wctx, cancel := context.WithTimeout(ctx, ReconnectWait)
		cc.WaitForStateChange(wctx, connectivity.TransientFailure)
		cancel()
	}
	return cc, nil
}

// ReconnectWait bounds Conn's wait for a new attempt at a connection in
// TRANSIENT_FAILURE: a refused connection on a local network fails in
// well under a millisecond, an accepted one is ready in a round trip.
const ReconnectWait = 200 * time.Millisecond

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
