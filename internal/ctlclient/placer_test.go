package ctlclient

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/lumen-project/lumen/internal/liveness"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// checkLeaks fails t if a goroutine it started outlives it (checked
// after every cleanup registered later, the replicas' and proxies').
func checkLeaks(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, ignore) })
}

// fakePlaceReplica is a controller replica that serves Place and ClusterStatus
// only: it accepts every Place stream and answers each dispatch with a
// placement on a worker named after itself.
type fakePlaceReplica struct {
	pb.UnimplementedControllerServer
	pb.UnimplementedOperatorServer
	id   string
	addr string
	srv  *grpc.Server
	// leader, when set, is the replica this one says leads (id, address);
	// by default it says it leads itself.
	leader atomic.Pointer[[2]string]
	// hold: Place batches are read and never answered.
	hold atomic.Bool
}

func startPlaceReplica(t *testing.T, id string) *fakePlaceReplica {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &fakePlaceReplica{id: id, addr: lis.Addr().String(), srv: grpc.NewServer(liveness.ServerOptions()...)}
	pb.RegisterControllerServer(f.srv, f)
	pb.RegisterOperatorServer(f.srv, f)
	go func() { _ = f.srv.Serve(lis) }()
	t.Cleanup(f.srv.Stop)
	return f
}

func (f *fakePlaceReplica) Place(stream grpc.BidiStreamingServer[pb.PlaceBatch, pb.PlaceResults]) error {
	if err := stream.SendHeader(metadata.Pairs(AcceptedHeader, f.id)); err != nil {
		return err
	}
	for {
		b, err := stream.Recv()
		if err != nil {
			return nil
		}
		if f.hold.Load() {
			continue
		}
		res := &pb.PlaceResults{Seq: b.Seq}
		for _, d := range b.Dispatches {
			res.Dispatches = append(res.Dispatches, &pb.PlaceResult{Response: &pb.DispatchResponse{
				Placement: &pb.Placement{RequestId: d.RequestId, WorkerId: "worker-of-" + f.id}}})
		}
		if err := stream.Send(res); err != nil {
			return err
		}
	}
}

func (f *fakePlaceReplica) ClusterStatus(context.Context, *pb.ClusterStatusRequest) (*pb.ClusterStatusResponse, error) {
	st := &pb.ClusterStatusResponse{NodeId: f.id, LeaderId: f.id, LeaderGrpcAddr: f.addr}
	if l := f.leader.Load(); l != nil {
		st.LeaderId, st.LeaderGrpcAddr = l[0], l[1]
	}
	return st, nil
}

// stallProxy forwards TCP to a target until stalled; then it forwards
// nothing more in either direction and closes nothing, as a SIGSTOPped
// process (its kernel still holds the connection) or a link that drops
// packets without a reset does.
type stallProxy struct {
	lis    net.Listener
	target string

	mu      sync.Mutex // guards stalled, closed, conns; cond waits on it
	cond    *sync.Cond
	stalled bool
	closed  bool
	conns   []net.Conn
	wg      sync.WaitGroup
}

func startProxy(t *testing.T, target string) *stallProxy {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &stallProxy{lis: lis, target: target}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

func (p *stallProxy) addr() string { return p.lis.Addr().String() }

func (p *stallProxy) accept() {
	for {
		c, err := p.lis.Accept()
		if err != nil {
			return
		}
		d, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			c.Close()
			d.Close()
			return
		}
		p.conns = append(p.conns, c, d)
		p.mu.Unlock()
		p.wg.Go(func() { p.pipe(d, c) })
		p.wg.Go(func() { p.pipe(c, d) })
	}
}

func (p *stallProxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		p.mu.Lock()
		for p.stalled && !p.closed {
			p.cond.Wait()
		}
		closed := p.closed
		p.mu.Unlock()
		if closed {
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			dst.Close()
			return
		}
	}
}

func (p *stallProxy) stall() {
	p.mu.Lock()
	p.stalled = true
	p.mu.Unlock()
}

func (p *stallProxy) close() {
	p.mu.Lock()
	p.closed = true
	conns := p.conns
	p.cond.Broadcast()
	p.mu.Unlock()
	p.lis.Close()
	for _, c := range conns {
		c.Close()
	}
	p.wg.Wait()
}

// dispatchOn dispatches id and returns the worker its placement names.
func dispatchOn(t *testing.T, p *Placer, id string, within time.Duration) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	resp, err := p.Dispatch(ctx, &pb.DispatchRequest{RequestId: id, PromptTokens: 1, MaxTokens: 1})
	if err != nil {
		return "", err
	}
	return resp.Placement.WorkerId, nil
}

// TestPlacerLeavesSilentLeader: the Place stream's replica stops
// answering without closing the connection (issue 21, defect 1). The
// Placer must notice within its probe interval and place on the next
// replica, well before a gateway's dispatch deadline; before the probe it
// waited on the dead stream until every Dispatch timed out.
func TestPlacerLeavesSilentLeader(t *testing.T) {
	checkLeaks(t)
	a, b := startPlaceReplica(t, "a"), startPlaceReplica(t, "b")
	pa := startProxy(t, a.addr)
	c, err := New([]string{pa.addr(), b.addr}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	p := c.NewPlacer(PlacerOptions{ProbeInterval: 100 * time.Millisecond})
	defer p.Close(context.Background())

	if w, err := dispatchOn(t, p, "r1", 5*time.Second); err != nil || w != "worker-of-a" {
		t.Fatalf("first dispatch: worker %q, error %v; want it on a, the first replica", w, err)
	}
	pa.stall()
	// The deadline stands for the gateway's DispatchTimeout (10 s by
	// default): far above two probe intervals, far below the keepalive's
	// 15 s, so only the probe can save it.
	start := time.Now()
	w, err := dispatchOn(t, p, "r2", 3*time.Second)
	if err != nil {
		t.Fatalf("dispatch after the leader went silent: %v (the Placer stayed on the dead stream)", err)
	}
	if w != "worker-of-b" {
		t.Fatalf("dispatch after the leader went silent placed on %q, want b", w)
	}
	t.Logf("placed on b %s after a went silent", time.Since(start).Round(time.Millisecond))
}

// TestPlacerFollowsProbedLeader: the stream's replica answers its probe
// but no longer leads: the Placer moves to the leader it names.
func TestPlacerFollowsProbedLeader(t *testing.T) {
	checkLeaks(t)
	a, b := startPlaceReplica(t, "a"), startPlaceReplica(t, "b")
	c, err := New([]string{a.addr, b.addr}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	p := c.NewPlacer(PlacerOptions{ProbeInterval: 50 * time.Millisecond})
	defer p.Close(context.Background())
	if w, err := dispatchOn(t, p, "r1", 5*time.Second); err != nil || w != "worker-of-a" {
		t.Fatalf("first dispatch: worker %q, error %v; want it on a", w, err)
	}
	// a is deposed and holds what it is sent, as a replica that lost
	// leadership does not answer; it names b.
	a.hold.Store(true)
	a.leader.Store(&[2]string{"b", b.addr})
	if w, err := dispatchOn(t, p, "r2", 3*time.Second); err != nil || w != "worker-of-b" {
		t.Fatalf("dispatch after a was deposed: worker %q, error %v; want b", w, err)
	}
}

// TestPlacerBoundsCompletes: while no leader answers, the completes
// waiting for an acknowledgement stop at MaxCompletes (issue 21, defect
// 1: they piled up without bound, under the gateway's flusher, whose own
// bound never held); once a leader answers they drain and Complete takes
// ids again.
func TestPlacerBoundsCompletes(t *testing.T) {
	checkLeaks(t)
	a, b := startPlaceReplica(t, "a"), startPlaceReplica(t, "b")
	// a leads (it answers its probes) and answers no batch: a leader that
	// cannot commit.
	a.hold.Store(true)
	c, err := New([]string{a.addr, b.addr}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	p := c.NewPlacer(PlacerOptions{ProbeInterval: 50 * time.Millisecond})
	defer p.Close(context.Background())
	ids := func(from, n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprintf("c%d", from+i)
		}
		return out
	}
	if err := p.Complete(ids(0, DefaultMaxCompletes)...); err != nil {
		t.Fatalf("Complete of the limit's worth with none waiting: %v", err)
	}
	err = p.Complete(ids(DefaultMaxCompletes, 1)...)
	if !errors.Is(err, ErrCompletesFull) {
		t.Fatalf("Complete past the limit: error %v, want ErrCompletesFull", err)
	}
	if _, n := p.Pending(); n != DefaultMaxCompletes {
		t.Fatalf("%d completes unacknowledged, want the limit %d", n, DefaultMaxCompletes)
	}
	// b takes over: everything is acknowledged there, and Complete takes
	// ids again.
	a.leader.Store(&[2]string{"b", b.addr})
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, n := p.Pending()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d completes still unacknowledged after a leader answered", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := p.Complete(ids(DefaultMaxCompletes, 1)...); err != nil {
		t.Fatalf("Complete once drained: %v", err)
	}
}
