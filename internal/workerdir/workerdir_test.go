package workerdir

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// table is a workers table the test edits, standing in for the controller's
// (the directory reads nothing else of it).
type table struct {
	mu    sync.Mutex // guards rows, reads
	rows  map[string]string
	reads int
}

func (t *table) ListWorkers(context.Context, *pb.ListWorkersRequest) (*pb.ListWorkersResponse, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.reads++
	resp := &pb.ListWorkersResponse{}
	for id, addr := range t.rows {
		resp.Workers = append(resp.Workers, &pb.Worker{Id: id, GrpcAddr: addr})
	}
	return resp, nil
}

func (t *table) set(id, addr string) {
	t.mu.Lock()
	t.rows[id] = addr
	t.mu.Unlock()
}

func (t *table) readCount() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.reads
}

func TestDirectory(t *testing.T) {
	ctx := context.Background()
	tab := &table{rows: map[string]string{"w1": "127.0.0.1:1001"}}
	d := New(tab)
	defer d.Close()

	cc, err := d.Conn(ctx, "w1")
	if err != nil {
		t.Fatal(err)
	}
	if cc.Target() != "127.0.0.1:1001" {
		t.Fatalf("dialled %s", cc.Target())
	}
	again, err := d.Conn(ctx, "w1")
	if err != nil || again != cc {
		t.Fatalf("a known worker got a new connection (%v)", err)
	}
	if n := tab.readCount(); n != 1 {
		t.Fatalf("%d table reads for one unknown id", n)
	}

	if _, err := d.Conn(ctx, "w2"); !errors.Is(err, ErrUnknownWorker) {
		t.Fatalf("unknown worker: %v", err)
	}
	tab.set("w2", "127.0.0.1:1002")
	if cc2, err := d.Conn(ctx, "w2"); err != nil || cc2.Target() != "127.0.0.1:1002" {
		t.Fatalf("a worker that registered since: %v", err)
	}

	// A worker restarted on another port is found after a refresh.
	tab.set("w1", "127.0.0.1:2001")
	if _, err := d.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if cc, err := d.Conn(ctx, "w1"); err != nil || cc.Target() != "127.0.0.1:2001" {
		t.Fatalf("after a refresh w1 is at %v (%v)", cc.Target(), err)
	}

	d.Close()
	d.Close()
	if _, err := d.Conn(ctx, "w1"); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: %v", err)
	}
}

// TestConnTriesAWorkerBackAtOnce: a worker that died and came back on the
// same address is reached by the next call through Conn, however long the
// connection's backoff had grown (here a minute: without Conn's probe the
// call fails at once, the connection in TRANSIENT_FAILURE); while it is
// still down, Conn does not wait for it. A restarted
// worker's address is the old one in lumen bench recovery and in a pod
// whose container restarted.
func TestConnTriesAWorkerBackAtOnce(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	serve := func(lis net.Listener) *grpc.Server {
		s := grpc.NewServer()
		healthpb.RegisterHealthServer(s, health.NewServer())
		go func() { _ = s.Serve(lis) }()
		return s
	}
	srv := serve(lis)
	tab := &table{rows: map[string]string{"w1": addr}}
	d := New(tab, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.Config{BaseDelay: time.Minute, Multiplier: 1, MaxDelay: time.Minute},
			MinConnectTimeout: 5 * time.Second}))
	defer d.Close()
	check := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		cc, err := d.Conn(ctx, "w1")
		if err != nil {
			return err
		}
		_, err = healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	}
	if err := check(); err != nil {
		t.Fatalf("the worker up: %v", err)
	}
	cc, _ := d.Conn(context.Background(), "w1")
	srv.Stop() // the worker dies
	// waitFor waits until the connection is in state want.
	waitFor := func(want connectivity.State) {
		t.Helper()
		for st := cc.GetState(); st != want; st = cc.GetState() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			if !cc.WaitForStateChange(ctx, st) {
				cancel()
				t.Fatalf("the connection stayed %v, waiting for %v", st, want)
			}
			cancel()
		}
	}
	waitFor(connectivity.Idle) // the transport closed
	// Calls to it (a request placed before the table said so) fail, the
	// first one's attempt leaving the connection in TRANSIENT_FAILURE, its
	// next attempt a minute away.
	for range 2 {
		if err := check(); err == nil {
			t.Fatal("a call to the dead worker succeeded")
		}
	}
	waitFor(connectivity.TransientFailure)
	// The worker still down, Conn does not wait for it: its probe is
	// refused at once (were it to wait for the connection, a minute here,
	// the context would end first).
	d.mu.Lock()
	d.reconnectWait = time.Minute
	d.mu.Unlock()
	for range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		if _, err := d.Conn(ctx, "w1"); err != nil || ctx.Err() != nil {
			t.Fatalf("Conn to the dead worker: %v (context: %v)", err, ctx.Err())
		}
		cancel()
		d.mu.Lock()
		p := d.probes[addr]
		d.mu.Unlock()
		p.mu.Lock()
		p.at = time.Time{} // the next Conn probes again
		p.mu.Unlock()
	}
	if st := cc.GetState(); st != connectivity.TransientFailure {
		t.Fatalf("the connection to the dead worker is %v", st)
	}
	lis, err = net.Listen("tcp", addr) // back on its address
	if err != nil {
		t.Fatal(err)
	}
	srv = serve(lis)
	defer srv.Stop()
	if err := check(); err != nil {
		t.Fatalf("the worker back on %s: %v (connection %v)", addr, err, cc.GetState())
	}
}
