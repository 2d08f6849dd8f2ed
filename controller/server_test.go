package controller

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// TestLeadershipLostDuringReportUnreachable: the leader loses leadership
// while it probes a worker reported unreachable, between leaderOp's check
// and the handler's proposal. The handler used to look the leader state up a
// second time, find none and dereference nil, crashing the replica; with the
// checked state passed in, the proposal fails errNotLeader and the call is
// retried on the new leader, which marks the worker failed.
func TestLeadershipLostDuringReportUnreachable(t *testing.T) {
	c := newCluster(t, 3, func(cfg *Config) { cfg.ProbeTimeout = 10 * time.Second })
	leader := c.waitLeader()

	// The worker's address: the first gRPC probe (a connection that sends
	// bytes; the probe's bare dial sends none) is held open until the
	// leader has stepped down, then closed, so the probe fails.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var conns sync.WaitGroup
	defer conns.Wait()
	defer lis.Close()
	var once sync.Once
	stepDown := make(chan error, 1)
	conns.Go(func() {
		for {
			conn, err := lis.Accept()
			if err != nil {
				return
			}
			conns.Go(func() {
				defer conn.Close()
				if _, err := conn.Read(make([]byte, 1)); err != nil {
					return
				}
				once.Do(func() { stepDown <- loseLeadership(leader) })
			})
		}
	})

	if _, err := c.client(leader).RegisterWorker(ctxT(t, 5*time.Second), &pb.RegisterWorkerRequest{Worker: &pb.Worker{
		Id: "w", Incarnation: 1, GrpcAddr: lis.Addr().String(),
		Capacity: &pb.Capacity{KvPagesTotal: 100, KvBytesPerToken: 1, CheckpointBudgetBytes: 1 << 20}}}); err != nil {
		t.Fatal(err)
	}
	r, err := c.client(leader).ReportUnreachable(ctxT(t, 20*time.Second), &pb.ReportUnreachableRequest{WorkerId: "w", Reporter: "test"})
	select {
	case serr := <-stepDown:
		if serr != nil {
			t.Fatalf("the leader did not step down during the probe: %v", serr)
		}
	default:
		t.Fatal("the probe never reached the worker's address")
	}
	if err != nil {
		t.Fatalf("ReportUnreachable across a leadership change: %v", err)
	}
	if !r.MarkedFailed {
		t.Fatalf("the worker was not marked failed: %v", r)
	}
	next := c.waitLeader()
	if next == leader {
		t.Fatal("leadership did not move")
	}
	if w := next.FSM().Worker("w"); w.Phase != pb.WorkerPhase_WORKER_PHASE_FAILED {
		t.Fatalf("worker is %v", w.Phase)
	}
}

// loseLeadership transfers n's leadership away and waits until n has
// dropped its leader state.
func loseLeadership(n *Node) error {
	if err := n.raft.LeadershipTransfer().Error(); err != nil {
		return err
	}
	deadline := time.Now().Add(10 * time.Second)
	for n.leaderStateOrNil() != nil {
		if time.Now().After(deadline) {
			return errors.New("leader state still set 10 s after the transfer")
		}
		time.Sleep(5 * time.Millisecond)
	}
	return nil
}

// panickyHealth is a health service whose handlers panic when asked about
// the service "panic".
type panickyHealth struct {
	healthpb.UnimplementedHealthServer
}

func (panickyHealth) Check(_ context.Context, req *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	if req.Service == "panic" {
		var m map[string]int
		m["boom"]++ // a nil-map write: a real runtime panic
	}
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

func (panickyHealth) Watch(req *healthpb.HealthCheckRequest, s grpc.ServerStreamingServer[healthpb.HealthCheckResponse]) error {
	if req.Service == "panic" {
		panic("watch panicked")
	}
	return s.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING})
}

// TestHandlerPanicIsInternalAndServerKeepsServing: with the controller's
// recovery interceptors, a panicking unary or streaming handler answers
// Internal, the panic is logged with its stack and counted, and the server
// answers the next calls.
func TestHandlerPanicIsInternalAndServerKeepsServing(t *testing.T) {
	var logged syncBuffer
	log := hclog.New(&hclog.LoggerOptions{Output: &logged, Level: hclog.Info})
	var panics atomic.Int32
	srv := grpc.NewServer(recoveryOptions(log, func() { panics.Add(1) })...)
	healthpb.RegisterHealthServer(srv, panickyHealth{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var serving sync.WaitGroup
	serving.Go(func() { _ = srv.Serve(lis) })
	defer serving.Wait()
	defer srv.Stop()
	cc, err := grpc.NewClient(lis.Addr().String(), DialOptions(nil)...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	hc := healthpb.NewHealthClient(cc)

	for i := 0; i < 2; i++ {
		_, err := hc.Check(ctxT(t, 5*time.Second), &healthpb.HealthCheckRequest{Service: "panic"})
		if status.Code(err) != codes.Internal {
			t.Fatalf("panicking unary call: %v, want Internal", err)
		}
		resp, err := hc.Check(ctxT(t, 5*time.Second), &healthpb.HealthCheckRequest{})
		if err != nil || resp.Status != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("the server stopped serving after a panic: %v %v", resp, err)
		}
	}
	ws, err := hc.Watch(ctxT(t, 5*time.Second), &healthpb.HealthCheckRequest{Service: "panic"})
	if err == nil {
		_, err = ws.Recv()
	}
	if status.Code(err) != codes.Internal {
		t.Fatalf("panicking stream: %v, want Internal", err)
	}
	ws, err = hc.Watch(ctxT(t, 5*time.Second), &healthpb.HealthCheckRequest{})
	if err == nil {
		_, err = ws.Recv()
	}
	if err != nil {
		t.Fatalf("the server stopped serving streams after a panic: %v", err)
	}
	if got := panics.Load(); got != 3 {
		t.Fatalf("%d panics counted, want 3", got)
	}
	out := logged.String()
	for _, want := range []string{PanicLogMessage, "assignment to entry in nil map", "panickyHealth", "watch panicked"} {
		if !strings.Contains(out, want) {
			t.Fatalf("the log lacks %q:\n%s", want, out)
		}
	}
}

// syncBuffer is a bytes.Buffer safe for the server's goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	return len(p), nil
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}
