package ui_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/lumen-project/lumen/controller"
	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/ui"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Process-wide singletons of raft's metrics library.
		goleak.IgnoreTopFunction("github.com/hashicorp/go-metrics.(*InmemSignal).run"),
		goleak.IgnoreTopFunction("github.com/armon/go-metrics.(*InmemSignal).run"),
		goleak.IgnoreTopFunction("github.com/hashicorp/go-metrics.(*InmemSink).run"),
		goleak.IgnoreTopFunction("github.com/armon/go-metrics.(*InmemSink).run"),
	)
}

// logWriter routes the replicas' logs to t.Log until the test ends.
type logWriter struct {
	t    testing.TB
	done atomic.Bool
}

func (w *logWriter) Write(p []byte) (int, error) {
	if !w.done.Load() {
		w.t.Log(strings.TrimSpace(string(p)))
	}
	return len(p), nil
}

// quorum is n in-process controller replicas on loopback, each serving
// HTTP (and so the dashboard).
type quorum struct {
	nodes []*controller.Node
	http  []string
	cl    *ctlclient.Client
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func startQuorum(t *testing.T, n int) *quorum {
	t.Helper()
	q := &quorum{}
	logw := &logWriter{t: t}
	var seed string
	for i := 0; i < n; i++ {
		cfg := controller.DefaultConfig()
		cfg.NodeID = fmt.Sprintf("c%d", i+1)
		cfg.DataDir = t.TempDir()
		cfg.RaftAddr, cfg.GRPCAddr, cfg.SerfAddr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
		cfg.HTTPAddr = freeAddr(t)
		cfg.BootstrapExpect = n
		cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: "controller", Level: hclog.Warn, Output: logw})
		if seed != "" {
			cfg.Join = []string{seed}
		}
		node, err := controller.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if seed == "" {
			seed = node.SerfAddr()
		}
		q.nodes = append(q.nodes, node)
		q.http = append(q.http, cfg.HTTPAddr)
	}
	t.Cleanup(func() {
		for _, node := range q.nodes {
			node.Shutdown()
		}
		logw.done.Store(true)
	})
	var addrs []string
	for _, node := range q.nodes {
		addrs = append(addrs, node.GRPCAddr())
	}
	var err error
	if q.cl, err = ctlclient.New(addrs, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(q.cl.Close)
	q.leader(t)
	return q
}

// leader waits for a ready leader among the running replicas.
func (q *quorum) leader(t *testing.T) int {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		for i, node := range q.nodes {
			if node.IsLeader() {
				return i
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("no leader after 15 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (q *quorum) follower(t *testing.T) int {
	return (q.leader(t) + 1) % len(q.nodes)
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// addWorker registers a worker that answers nothing (its address is
// closed), so a probe of it fails.
func (q *quorum) addWorker(t *testing.T, id string) {
	t.Helper()
	_, err := q.cl.RegisterWorker(ctxT(t, 5*time.Second), &pb.RegisterWorkerRequest{Worker: &pb.Worker{
		Id: id, Incarnation: 7, GrpcAddr: "127.0.0.1:1",
		Capacity: &pb.Capacity{KvPagesTotal: 1000, CheckpointBudgetBytes: 1 << 30, KvBytesPerToken: 1024,
			MaxContextTokens: 8192, H2DBytesPerSec: 25e9}}})
	if err != nil {
		t.Fatal(err)
	}
}

func getState(t *testing.T, addr string) ui.State {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/ui/api/state")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st ui.State
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	return st
}

// waitState polls a replica's state until ok accepts it.
func waitState(t *testing.T, addr, what string, ok func(ui.State) bool) ui.State {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		st := getState(t, addr)
		if ok(st) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s; last state: %+v", what, st)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// sse is one server-sent event.
type sse struct {
	event, id, data string
}

// stream is an open /ui/api/stream.
type stream struct {
	events chan sse
	done   chan struct{} // closed when the stream ends
	cancel context.CancelFunc
}

func openStream(t *testing.T, addr, lastEventID string) *stream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+addr+"/ui/api/stream", nil)
	if lastEventID != "" {
		req.Header.Set("Last-Event-ID", lastEventID)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("stream Content-Type %q", ct)
	}
	s := &stream{events: make(chan sse, 1024), done: make(chan struct{}), cancel: cancel}
	go func() {
		defer close(s.done)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 1<<20), 16<<20)
		var cur sse
		for sc.Scan() {
			line := sc.Text()
			switch {
			case line == "":
				select {
				case s.events <- cur:
				case <-ctx.Done():
					return
				}
				cur = sse{}
			case strings.HasPrefix(line, "event: "):
				cur.event = strings.TrimPrefix(line, "event: ")
			case strings.HasPrefix(line, "id: "):
				cur.id = strings.TrimPrefix(line, "id: ")
			case strings.HasPrefix(line, "data: "):
				cur.data = strings.TrimPrefix(line, "data: ")
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-s.done })
	return s
}

// next returns the first event match accepts, failing the test after
// timeout; events it passes over are gone.
func (s *stream) next(t *testing.T, what string, timeout time.Duration, match func(sse) bool) sse {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case ev := <-s.events:
			if match(ev) {
				return ev
			}
		case <-s.done:
			t.Fatalf("the stream ended waiting for %s", what)
		case <-deadline:
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
	}
}

// controllerEvent matches an "ev" event whose lumenpb.Event match accepts.
func controllerEvent(t *testing.T, match func(*pb.Event) bool) func(sse) bool {
	return func(e sse) bool {
		if e.event != "ev" {
			return false
		}
		var ev pb.Event
		if err := protojson.Unmarshal([]byte(e.data), &ev); err != nil {
			t.Errorf("an ev event is not a lumenpb.Event: %v: %s", err, e.data)
			return false
		}
		return match(&ev)
	}
}

func TestServesThePageAndItsAssets(t *testing.T) {
	q := startQuorum(t, 1)
	for path, want := range map[string]string{
		"/ui":           `<script src="app.js">`, // redirected to /ui/
		"/ui/":          `<script src="app.js">`,
		"/ui/app.js":    "new EventSource('api/stream')",
		"/ui/style.css": "--bg:",
	} {
		resp, err := http.Get("http://" + q.http[0] + path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(b), want) {
			t.Errorf("GET %s: %s, want a body with %q", path, resp.Status, want)
		}
	}
}

// TestStreamAndStateFollowARecovery: a follower's page sees a worker fail,
// the recovery plan of its requests with each one's target and mode, the
// requests in recovery until they complete, and the quorum; a page that
// reconnects resumes after the last event it got.
func TestStreamAndStateFollowARecovery(t *testing.T) {
	q := startQuorum(t, 3)
	f := q.follower(t)
	addr := q.http[f]
	s := openStream(t, addr, "")
	first := s.next(t, "the first state", 5*time.Second, func(e sse) bool { return e.event == "state" })
	var st ui.State
	if err := json.Unmarshal([]byte(first.data), &st); err != nil {
		t.Fatal(err)
	}
	if st.Node != q.nodes[f].ID() || st.NodeState != "Follower" || st.History == nil {
		t.Fatalf("first state: node %q (%s), %d samples; want %s, a follower, with its history", st.Node, st.NodeState, len(st.History), q.nodes[f].ID())
	}

	q.addWorker(t, "w1")
	q.addWorker(t, "w2")
	s.next(t, "w2 registered", 5*time.Second, controllerEvent(t, func(ev *pb.Event) bool {
		pc := ev.GetPhaseChanged()
		return pc != nil && pc.WorkerId == "w2" && pc.To == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE
	}))
	var onW1 []string
	for i := 0; i < 8; i++ {
		resp, err := q.cl.Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: fmt.Sprintf("r%d", i), PromptTokens: 100, MaxTokens: 50})
		if err != nil {
			t.Fatal(err)
		}
		if resp.Placement.WorkerId == "w1" {
			onW1 = append(onW1, resp.Placement.RequestId)
		}
	}
	if len(onW1) == 0 {
		t.Fatal("no request placed on w1")
	}
	// w1 answers nothing: the leader's probe fails and it is marked FAILED.
	if _, err := q.cl.ReportUnreachable(ctxT(t, 5*time.Second), &pb.ReportUnreachableRequest{WorkerId: "w1", Reporter: "test"}); err != nil {
		t.Fatal(err)
	}
	s.next(t, "w1 FAILED", 5*time.Second, controllerEvent(t, func(ev *pb.Event) bool {
		pc := ev.GetPhaseChanged()
		return pc != nil && pc.WorkerId == "w1" && pc.To == pb.WorkerPhase_WORKER_PHASE_FAILED
	}))
	var plan *pb.RecoveryPlan
	planEv := s.next(t, "w1's recovery plan", 5*time.Second, controllerEvent(t, func(ev *pb.Event) bool {
		plan = ev.GetRecoveryPlan()
		return plan != nil && plan.FailedWorker == "w1"
	}))
	if len(plan.Assignments) != len(onW1) {
		t.Fatalf("plan moves %d requests, w1 had %d", len(plan.Assignments), len(onW1))
	}
	for _, a := range plan.Assignments {
		if a.TargetWorker != "w2" || a.Mode == pb.RecoveryMode_RECOVERY_MODE_UNSPECIFIED {
			t.Errorf("request %s → %s in mode %s; want w2, a mode", a.RequestId, a.TargetWorker, a.Mode)
		}
	}

	st = waitState(t, addr, "the requests in recovery in a sample", func(st ui.State) bool { return st.Sample.Recovering == len(onW1) })
	if st.Sample.InFlight != 8 {
		t.Errorf("%d requests in flight, want 8", st.Sample.InFlight)
	}
	phases := map[string]string{}
	for _, w := range st.Workers {
		phases[w.ID] = w.Phase
	}
	if phases["w1"] != "FAILED" || phases["w2"] != "FULL_SERVICE" {
		t.Errorf("worker phases %v", phases)
	}
	if len(st.Plans) != 1 || st.Plans[0].FailedWorker != "w1" || len(st.Plans[0].Assignments) != len(onW1) {
		t.Fatalf("plans %+v", st.Plans)
	}
	for _, a := range st.Plans[0].Assignments {
		if a.Target != "w2" || !a.InFlight || (a.Mode != "REUSE" && a.Mode != "RECOMPUTE") {
			t.Errorf("assignment %+v", a)
		}
	}
	leaders := 0
	for _, r := range st.Quorum {
		if !r.Reachable {
			t.Errorf("replica %s unreachable: %s", r.ID, r.Error)
		}
		if r.State == "Leader" {
			leaders++
		}
	}
	if len(st.Quorum) != 3 || leaders != 1 {
		t.Errorf("quorum %+v: want 3 replicas, one leader", st.Quorum)
	}

	if _, err := q.cl.Complete(ctxT(t, 5*time.Second), &pb.CompleteRequest{RequestIds: onW1}); err != nil {
		t.Fatal(err)
	}
	st = waitState(t, addr, "no request in recovery", func(st ui.State) bool { return st.Sample.Recovering == 0 })
	for _, a := range st.Plans[0].Assignments {
		if a.InFlight {
			t.Errorf("completed request %s still in flight", a.RequestID)
		}
	}

	// A page that reconnects after the plan gets only what followed it.
	s.cancel()
	q.addWorker(t, "w3")
	again := openStream(t, addr, planEv.id)
	ev := again.next(t, "an event after the plan", 5*time.Second, func(e sse) bool { return e.event == "ev" })
	var got pb.Event
	if err := protojson.Unmarshal([]byte(ev.data), &got); err != nil {
		t.Fatal(err)
	}
	if got.GetRecoveryPlan() != nil || got.GetPhaseChanged().GetWorkerId() == "w1" {
		t.Errorf("resumed after %s, got %s again", planEv.id, ev.data)
	}
}

// TestStreamFollowsTheLeader: a page on a replica that stays sees the
// leader change, and the old leader unreachable once it is gone.
func TestStreamFollowsTheLeader(t *testing.T) {
	q := startQuorum(t, 3)
	old := q.leader(t)
	f := (old + 1) % 3
	s := openStream(t, q.http[f], "")
	oldID := q.nodes[old].ID()
	waitState(t, q.http[f], "the quorum", func(st ui.State) bool { return len(st.Quorum) == 3 && st.Leader == oldID })
	if err := q.nodes[old].Shutdown(); err != nil {
		t.Log(err)
	}
	var lc ui.LeaderChange
	s.next(t, "a new leader", 15*time.Second, func(e sse) bool {
		if e.event != "leader" {
			return false
		}
		if err := json.Unmarshal([]byte(e.data), &lc); err != nil {
			t.Fatal(err)
		}
		return lc.Leader != "" && lc.Leader != oldID
	})
	// The test itself sees the new leader ready, as the quorum's cleanup
	// needs: controller.Node's Shutdown waits for the leader's goroutines
	// with nothing ordering that wait after the WaitGroup's Add but a
	// caller's IsLeader (the race detector says so otherwise).
	if n := q.leader(t); q.nodes[n].ID() != lc.Leader {
		t.Errorf("the page says %s leads, %s does", lc.Leader, q.nodes[n].ID())
	}
	st := waitState(t, q.http[f], "the old leader unreachable", func(st ui.State) bool {
		for _, r := range st.Quorum {
			if r.ID == oldID {
				return !r.Reachable
			}
		}
		return false
	})
	if st.Leader != lc.Leader || st.Term < lc.Term {
		t.Errorf("state says leader %s term %d, the leader event %s term %d", st.Leader, st.Term, lc.Leader, lc.Term)
	}
}

// TestStreamEndsAtShutdown: open pages do not hold a replica's shutdown.
func TestStreamEndsAtShutdown(t *testing.T) {
	q := startQuorum(t, 1)
	s := openStream(t, q.http[0], "")
	s.next(t, "the first state", 5*time.Second, func(e sse) bool { return e.event == "state" })
	start := time.Now()
	q.nodes[0].Shutdown()
	select {
	case <-s.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the stream is still open 5 s after the shutdown")
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("shutdown with an open page took %s", d)
	}
}
