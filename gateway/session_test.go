package gateway

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"

	"github.com/lumen-project/lumen/controller"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// syncBuffer collects log output from several goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// waitUntil polls cond until it holds, failing the test after timeout.
func waitUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// startController starts a one-replica controller quorum in dir on the
// given addresses ("127.0.0.1:0" picks them) and waits for it to lead.
func startController(t *testing.T, dir, grpcAddr, raftAddr, serfAddr string) *controller.Node {
	t.Helper()
	cfg := controller.DefaultConfig()
	cfg.NodeID, cfg.DataDir, cfg.BootstrapExpect = "c0", dir, 1
	cfg.GRPCAddr, cfg.RaftAddr, cfg.SerfAddr = grpcAddr, raftAddr, serfAddr
	cfg.Logger = hclog.NewNullLogger()
	n, err := controller.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 15*time.Second, "the controller to lead", n.IsLeader)
	return n
}

func ctlClient(t *testing.T, n *controller.Node) pb.ControllerClient {
	t.Helper()
	cc, err := grpc.NewClient(n.GRPCAddr(), controller.DialOptions(nil)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return pb.NewControllerClient(cc)
}

func registerWorkers(t *testing.T, cl pb.ControllerClient) {
	t.Helper()
	for _, id := range []string{"w1", "w2"} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := cl.RegisterWorker(ctx, &pb.RegisterWorkerRequest{Worker: &pb.Worker{Id: id, Incarnation: 1, GrpcAddr: "127.0.0.1:1",
			Capacity: &pb.Capacity{KvPagesTotal: 1000, KvBytesPerToken: 1024, CheckpointBudgetBytes: 1 << 30, MaxContextTokens: 4096}}})
		cancel()
		if err != nil {
			t.Fatal(err)
		}
	}
}

// TestCompleterRetriesUntilTheControllerTakesIt: Completes flushed while
// the controller is down are kept and retried, and reach it once it is back;
// the placements are then gone. The flusher used to log the failure and drop
// the batch, leaving the placements (and their reservations) forever.
func TestCompleterRetriesUntilTheControllerTakesIt(t *testing.T) {
	dir := t.TempDir()
	ctl := startController(t, dir, "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0")
	addrs := [3]string{ctl.GRPCAddr(), ctl.RaftAddr(), ctl.SerfAddr()}
	defer func() { ctl.Shutdown() }()
	cl := ctlClient(t, ctl)
	registerWorkers(t, cl)
	ids := []string{"r1", "r2", "r3"}
	for _, id := range ids {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := cl.Dispatch(ctx, &pb.DispatchRequest{RequestId: id, PromptTokens: 10, MaxTokens: 10})
		cancel()
		if err != nil {
			t.Fatal(err)
		}
	}

	var logs syncBuffer
	g := newTestGateway(t, func(c *Config) {
		c.Controllers = []string{addrs[0]}
		c.Logger = hclog.New(&hclog.LoggerOptions{Output: &logs, Level: hclog.Warn})
		c.SessionTTL = time.Minute
	})
	// One placement through the gateway's link first: it then knows
	// whether the controller serves the Place stream (completions go
	// there, sent until acknowledged) or not (unary Completes, retried by
	// the flusher).
	waitUntil(t, 30*time.Second, "a dispatch through the gateway", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := g.session.dispatch(ctx, &pb.DispatchRequest{RequestId: "probe", PromptTokens: 10, MaxTokens: 10}, g.link.dispatch)
		return err == nil
	})
	if err := ctl.Shutdown(); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		g.done <- id
	}
	waitUntil(t, 30*time.Second, "two failed flushes, or the completions waiting on the stream", func() bool {
		if g.link.unary.Load() {
			return strings.Count(logs.String(), "complete failed") >= 2
		}
		_, n := g.link.p.Pending()
		return n >= len(ids)
	})

	ctl = startController(t, dir, addrs[0], addrs[1], addrs[2])
	waitUntil(t, 30*time.Second, "the retried Complete to remove the placements", func() bool {
		for _, id := range ids {
			if p, _ := ctl.FSM().Placement(id); p != nil {
				return false
			}
		}
		return true
	})
}

// TestSessionKeptRenewedAndDestroyed: the gateway opens a session, renews it
// past several TTLs, opens a new one when the controller has ended it (as an
// expiry would), dispatches in it — retrying once a dispatch finds the
// session gone — and destroys it on Close, completing its placements.
func TestSessionKeptRenewedAndDestroyed(t *testing.T) {
	ctl := startController(t, t.TempDir(), "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0")
	defer ctl.Shutdown()
	cl := ctlClient(t, ctl)
	registerWorkers(t, cl)
	g := newTestGateway(t, func(c *Config) {
		c.Controllers = []string{ctl.GRPCAddr()}
		c.SessionTTL = time.Second
		c.Name = "gw-test"
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	first, err := g.session.current(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ss, _ := ctl.FSM().Session(first)
	if ss == nil || ss.Owner != "gw-test" || ss.TtlNanos != int64(time.Second) {
		t.Fatalf("session row %v", ss)
	}
	created := ss.CreatedUnixNano
	waitUntil(t, 10*time.Second, "the session to live three TTLs on renewals", func() bool {
		ss, _ := ctl.FSM().Session(first)
		if ss == nil {
			t.Fatal("the session expired although the gateway renews it")
		}
		return ss.RenewedUnixNano-created > int64(3*time.Second)
	})

	// Ended under the gateway: the next renewal opens a new session.
	if _, err := cl.DestroySession(ctx, &pb.DestroySessionRequest{SessionId: first}); err != nil {
		t.Fatal(err)
	}
	var second string
	waitUntil(t, 10*time.Second, "a new session", func() bool {
		g.session.mu.Lock()
		second = g.session.id
		g.session.mu.Unlock()
		return second != "" && second != first
	})

	// A dispatch that finds its session gone opens a new one and retries.
	if _, err := cl.DestroySession(ctx, &pb.DestroySessionRequest{SessionId: second}); err != nil {
		t.Fatal(err)
	}
	resp, err := g.session.dispatch(ctx, &pb.DispatchRequest{RequestId: "q1", PromptTokens: 10, MaxTokens: 10}, g.link.dispatch)
	if err != nil {
		t.Fatalf("dispatch after the session ended: %v", err)
	}
	if resp.Placement.RequestId != "q1" {
		t.Fatalf("placement %v", resp.Placement)
	}
	g.session.mu.Lock()
	third := g.session.id
	g.session.mu.Unlock()
	if _, reqs := ctl.FSM().Session(third); fmt.Sprint(reqs) != "[q1]" {
		t.Fatalf("session %s holds %v, want [q1]", third, reqs)
	}

	g.Close()
	if n := ctl.FSM().Sessions(); n != 0 {
		t.Fatalf("%d sessions after the gateway closed", n)
	}
	if p, _ := ctl.FSM().Placement("q1"); p != nil {
		t.Fatalf("placement of a closed gateway: %v", p)
	}
}

// TestSessionSurvivesShortOutage: a gateway cut off from the controller for
// about half its session TTL, across the renewal that falls due, keeps its
// session and its placements: a failed renewal is retried at once, not a
// whole period later (which used to land on the deadline: last success +
// TTL/3 + TTL/3 for the failed attempt + TTL/3 of waiting). The leader
// stays up: a restarted or newly elected leader renews every session
// itself, so only the gateway's path is cut.
func TestSessionSurvivesShortOutage(t *testing.T) {
	const ttl = 9 * time.Second
	ctl := startController(t, t.TempDir(), "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0")
	defer ctl.Shutdown()
	cl := ctlClient(t, ctl)
	registerWorkers(t, cl)
	path := newCutter(t, ctl.GRPCAddr())
	g := newTestGateway(t, func(c *Config) {
		c.Controllers = []string{path.lis.Addr().String()}
		c.SessionTTL = ttl
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	first, err := g.session.current(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.session.dispatch(ctx, &pb.DispatchRequest{RequestId: "q1", PromptTokens: 10, MaxTokens: 10}, g.link.dispatch); err != nil {
		t.Fatal(err)
	}
	renewed := func() time.Time {
		ss, _ := ctl.FSM().Session(first)
		if ss == nil {
			return time.Time{}
		}
		return time.Unix(0, ss.RenewedUnixNano)
	}
	// Cut just before the next renewal falls due, and restore past the
	// end of a renewal attempt that started then: half the TTL.
	start := renewed()
	var last time.Time
	waitUntil(t, 10*time.Second, "a renewal", func() bool { last = renewed(); return last.After(start) })
	waitUntil(t, ttl, "the renewal to come due", func() bool { return time.Since(last) > ttl/3-ttl/12 })
	path.setCut(true)
	cutAt := time.Now()
	waitUntil(t, ttl, "half the TTL", func() bool { return time.Since(cutAt) >= ttl/2 })
	path.setCut(false)
	t.Logf("cut from last renewal + %s for %s", cutAt.Sub(last), ttl/2)
	// Past the deadline the old schedule would have missed.
	waitUntil(t, 2*ttl, "a renewal after the outage", func() bool {
		if ss, _ := ctl.FSM().Session(first); ss == nil {
			t.Fatalf("session %s expired during an outage of half its TTL", first)
		}
		return renewed().After(cutAt.Add(ttl / 2))
	})
	waitUntil(t, 2*ttl, "the old deadline to pass", func() bool { return time.Since(last) > ttl+time.Second })
	if ss, _ := ctl.FSM().Session(first); ss == nil {
		t.Fatalf("session %s expired during an outage of half its TTL", first)
	}
	g.session.mu.Lock()
	now := g.session.id
	g.session.mu.Unlock()
	if now != first {
		t.Fatalf("the gateway's session is %s, was %s", now, first)
	}
	if p, _ := ctl.FSM().Placement("q1"); p == nil {
		t.Fatal("the session's placement was completed during the outage")
	}
}

// cutter is a TCP proxy that can cut its path: while cut, connections are
// closed and new ones closed at once, as when a controller is unreachable.
type cutter struct {
	lis    net.Listener
	target string
	mu     sync.Mutex
	cut    bool
	conns  []net.Conn
	wg     sync.WaitGroup
}

func newCutter(t *testing.T, target string) *cutter {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &cutter{lis: lis, target: target}
	c.wg.Add(1)
	go c.accept()
	t.Cleanup(c.close)
	return c
}

func (c *cutter) accept() {
	defer c.wg.Done()
	for {
		in, err := c.lis.Accept()
		if err != nil {
			return
		}
		c.mu.Lock()
		if c.cut {
			c.mu.Unlock()
			in.Close()
			continue
		}
		up, err := net.Dial("tcp", c.target)
		if err != nil {
			c.mu.Unlock()
			in.Close()
			continue
		}
		c.conns = append(c.conns, in, up)
		c.wg.Add(2)
		c.mu.Unlock()
		go c.pipe(in, up)
		go c.pipe(up, in)
	}
}

func (c *cutter) pipe(dst, src net.Conn) {
	defer c.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
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

// setCut cuts (true) or restores the path.
func (c *cutter) setCut(cut bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cut = cut
	if cut {
		for _, conn := range c.conns {
			conn.Close()
		}
		c.conns = nil
	}
}

func (c *cutter) close() {
	c.lis.Close()
	c.setCut(true)
	c.wg.Wait()
}

// TestGatewaysShareTheWorkers (issue 21, defect 2): two gateways on one
// controller, beside a client that holds a session of its own (a
// benchmark's), each get their share from the load table — gateway 0 and 1
// of 2, in their names' order — and export it. WatchLoad used to send no
// session list: every gateway was 0 of 1 and chose alone.
func TestGatewaysShareTheWorkers(t *testing.T) {
	ctl := startController(t, t.TempDir(), "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0")
	defer ctl.Shutdown()
	cl := ctlClient(t, ctl)
	registerWorkers(t, cl)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := cl.CreateSession(ctx, &pb.CreateSessionRequest{Owner: "bench-gw-0", TtlMs: 30_000}); err != nil {
		t.Fatal(err)
	}
	gws := map[string]*Gateway{}
	for _, name := range []string{"gw-b", "gw-a"} {
		gws[name] = newTestGateway(t, func(c *Config) {
			c.Controllers = []string{ctl.GRPCAddr()}
			c.Name = name
		})
	}
	for i, name := range []string{"gw-a", "gw-b"} {
		g := gws[name]
		waitUntil(t, 10*time.Second, name+"'s share", func() bool {
			gi, G := g.replica.Share()
			return gi == i && G == 2
		})
		for metric, want := range map[string]float64{"lumen_gateway_share_index": float64(i), "lumen_gateway_share_gateways": 2} {
			if got := gaugeValue(t, g, metric); got != want {
				t.Errorf("%s %s = %v, want %v", name, metric, got, want)
			}
		}
	}
}

// gaugeValue reads a gauge of the gateway's registry.
func gaugeValue(t *testing.T, g *Gateway, name string) float64 {
	t.Helper()
	fams, err := g.metrics.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() == name {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}
