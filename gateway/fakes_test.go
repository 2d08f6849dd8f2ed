package gateway

// The stand-ins below let a test decide what the controller says and when a
// worker sends each token: a late event from a lagging replica, a worker
// that pauses mid-stream or a replica cut off from its quorum cannot be
// produced on cue by the real processes. The gateway under test is the
// real one, over real gRPC and HTTP.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/liveness"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// waitFor polls cond until it holds or timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// serveGRPC serves register's services on a loopback port until the test ends.
func serveGRPC(t *testing.T, register func(*grpc.Server)) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(liveness.ServerOptions()...)
	register(s)
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Serve(lis) }()
	t.Cleanup(func() { s.Stop(); <-done })
	return lis.Addr().String()
}

// fakeController is the controller's state as the gateway sees it: the
// placements, the workers table and the event log. Its replicas serve it.
type fakeController struct {
	mu         sync.Mutex
	placements map[string]*pb.Placement
	workers    []*pb.Worker
	events     []*pb.Event
	changed    chan struct{} // closed and replaced when events grow
	dispatchTo string

	getPlacements atomic.Int32
	completes     atomic.Int32
	reports       atomic.Int32
	// completeGate, when set, holds every Complete (and ReportUnreachable
	// when reportGate) until it is closed or the call's context ends.
	completeGate chan struct{}
	reportGate   chan struct{}
	// compacted, once set (compact), is the index up to which the event
	// log is no longer kept: a watch from before it gets OutOfRange, and
	// ClusterStatus reports the applied index (under mu).
	compacted uint64
	// watching counts the event streams open.
	watching atomic.Int32
	// placeGate, when set before the gateway starts, holds the
	// Unimplemented answer to Place until it is closed.
	placeGate chan struct{}
	// nextEpoch, when set, makes GetPlacement bump the epoch on every call.
	nextEpoch bool
	// dispatched and completed are the ids Dispatch placed and Complete
	// was given, in order (under mu).
	dispatched, completed []string
	// onDispatch, when set, runs in Dispatch after the placement is made
	// and before the answer; a non-nil error is the answer.
	onDispatch func(ctx context.Context, pl *pb.Placement) error
	// strategy is what ClusterStatus says the cluster's strategy is.
	strategy atomic.Int32
}

// completedIDs returns the ids Complete was given so far.
func (fc *fakeController) completedIDs() []string {
	fc.mu.Lock()
	defer fc.mu.Unlock()
	return append([]string(nil), fc.completed...)
}

// dispatchedIDs returns the ids Dispatch placed so far.
func (fc *fakeController) dispatchedIDs() []string {
	fc.mu.Lock()
	defer fc.mu.Unlock()
	return append([]string(nil), fc.dispatched...)
}

// forget drops a placement, as the end of its session does.
func (fc *fakeController) forget(id string) {
	fc.mu.Lock()
	defer fc.mu.Unlock()
	delete(fc.placements, id)
}

func newFakeController(dispatchTo string) *fakeController {
	return &fakeController{placements: map[string]*pb.Placement{}, changed: make(chan struct{}), dispatchTo: dispatchTo}
}

func (fc *fakeController) addWorker(id, addr string) {
	fc.mu.Lock()
	defer fc.mu.Unlock()
	fc.workers = append(fc.workers, &pb.Worker{Id: id, GrpcAddr: addr, Phase: pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE})
}

// setPlacement changes where GetPlacement says a request is.
func (fc *fakeController) setPlacement(pl *pb.Placement) {
	fc.mu.Lock()
	defer fc.mu.Unlock()
	fc.placements[pl.RequestId] = pl
}

// publish appends an event at the next index and returns the index.
func (fc *fakeController) publish(ev *pb.Event) uint64 {
	fc.mu.Lock()
	defer fc.mu.Unlock()
	ev.Index = uint64(len(fc.events) + 1)
	fc.events = append(fc.events, ev)
	close(fc.changed)
	fc.changed = make(chan struct{})
	return ev.Index
}

// compact drops the event log up to its last index, as a controller's
// snapshot does: a watch that missed those events starts again from now.
func (fc *fakeController) compact() {
	fc.mu.Lock()
	defer fc.mu.Unlock()
	fc.compacted = uint64(len(fc.events))
}

func moved(pl *pb.Placement) *pb.Event {
	return &pb.Event{Body: &pb.Event_PlacementMoved{PlacementMoved: &pb.PlacementMoved{Placement: pl, Reason: "test"}}}
}

// replica serves fakeController; a stalled replica is one cut off from its
// quorum: it knows no leader and its event stream delivers nothing.
type replica struct {
	pb.UnimplementedControllerServer
	fc      *fakeController
	stalled atomic.Bool
}

type operator struct {
	pb.UnimplementedOperatorServer
	r *replica
}

func (fc *fakeController) serve(t *testing.T) (*replica, string) {
	r := &replica{fc: fc}
	return r, serveGRPC(t, func(s *grpc.Server) {
		pb.RegisterControllerServer(s, r)
		pb.RegisterOperatorServer(s, &operator{r: r})
	})
}

func (r *replica) Dispatch(ctx context.Context, req *pb.DispatchRequest) (*pb.DispatchResponse, error) {
	pl := &pb.Placement{RequestId: req.RequestId, WorkerId: r.fc.dispatchTo, Epoch: 1}
	r.fc.setPlacement(pl)
	r.fc.mu.Lock()
	r.fc.dispatched = append(r.fc.dispatched, req.RequestId)
	hook := r.fc.onDispatch
	r.fc.mu.Unlock()
	if hook != nil {
		if err := hook(ctx, pl); err != nil {
			return nil, err
		}
	}
	return &pb.DispatchResponse{Placement: pl}, nil
}

func (r *replica) GetPlacement(_ context.Context, req *pb.GetPlacementRequest) (*pb.GetPlacementResponse, error) {
	r.fc.getPlacements.Add(1)
	r.fc.mu.Lock()
	defer r.fc.mu.Unlock()
	pl, ok := r.fc.placements[req.RequestId]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "no placement for %s", req.RequestId)
	}
	if r.fc.nextEpoch {
		pl = &pb.Placement{RequestId: pl.RequestId, WorkerId: pl.WorkerId, Epoch: pl.Epoch + 1}
		r.fc.placements[req.RequestId] = pl
	}
	return &pb.GetPlacementResponse{Placement: pl}, nil
}

func (r *replica) GetPlacements(_ context.Context, req *pb.GetPlacementsRequest) (*pb.GetPlacementsResponse, error) {
	if len(req.RequestIds) == 0 || len(req.RequestIds) > ctlclient.MaxGetPlacements {
		return nil, status.Errorf(codes.InvalidArgument, "fake: %d ids", len(req.RequestIds))
	}
	r.fc.mu.Lock()
	defer r.fc.mu.Unlock()
	resp := &pb.GetPlacementsResponse{AppliedIndex: uint64(len(r.fc.events))}
	for _, id := range req.RequestIds {
		if pl, ok := r.fc.placements[id]; ok {
			resp.Placements = append(resp.Placements, pl)
		} else {
			resp.NotFound = append(resp.NotFound, id)
		}
	}
	return resp, nil
}

func (r *replica) ListWorkers(context.Context, *pb.ListWorkersRequest) (*pb.ListWorkersResponse, error) {
	r.fc.mu.Lock()
	defer r.fc.mu.Unlock()
	return &pb.ListWorkersResponse{Workers: r.fc.workers}, nil
}

func gate(ctx context.Context, g chan struct{}) error {
	if g == nil {
		return nil
	}
	select {
	case <-g:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (r *replica) Complete(ctx context.Context, req *pb.CompleteRequest) (*pb.CompleteResponse, error) {
	r.fc.completes.Add(1)
	if err := gate(ctx, r.fc.completeGate); err != nil {
		return nil, err
	}
	r.fc.mu.Lock()
	r.fc.completed = append(r.fc.completed, req.RequestIds...)
	r.fc.mu.Unlock()
	return &pb.CompleteResponse{Completed: uint32(len(req.RequestIds))}, nil
}

func (r *replica) ReportUnreachable(ctx context.Context, _ *pb.ReportUnreachableRequest) (*pb.ReportUnreachableResponse, error) {
	r.fc.reports.Add(1)
	if err := gate(ctx, r.fc.reportGate); err != nil {
		return nil, err
	}
	return &pb.ReportUnreachableResponse{}, nil
}

func (r *replica) WatchEvents(req *pb.WatchEventsRequest, stream grpc.ServerStreamingServer[pb.Event]) error {
	r.fc.watching.Add(1)
	defer r.fc.watching.Add(-1)
	from := req.FromIndex
	r.fc.mu.Lock()
	compacted := r.fc.compacted
	r.fc.mu.Unlock()
	if from < compacted {
		return status.Errorf(codes.OutOfRange, "fake: events up to %d are no longer kept", compacted)
	}
	for {
		r.fc.mu.Lock()
		var evs []*pb.Event
		if !r.stalled.Load() && int(from) < len(r.fc.events) {
			evs = r.fc.events[from:]
		}
		changed := r.fc.changed
		r.fc.mu.Unlock()
		for _, ev := range evs {
			if err := stream.Send(ev); err != nil {
				return err
			}
			from = ev.Index
		}
		select {
		case <-changed:
		case <-stream.Context().Done():
			return stream.Context().Err()
		}
	}
}

func (o *operator) ClusterStatus(context.Context, *pb.ClusterStatusRequest) (*pb.ClusterStatusResponse, error) {
	st := &pb.ClusterStatusResponse{LeaderId: "ctl1", NodeId: "fake", Strategy: pb.Strategy(o.r.fc.strategy.Load())}
	o.r.fc.mu.Lock()
	if o.r.fc.compacted > 0 {
		st.AppliedIndex = uint64(len(o.r.fc.events))
	}
	o.r.fc.mu.Unlock()
	if o.r.stalled.Load() {
		st.LeaderId = ""
	}
	return st, nil
}

// fakeWorker hands each Generate call to the test, which sends its tokens.
type fakeWorker struct {
	pb.UnimplementedInferenceServer
	id    string
	calls chan *call
	// breakAll ends every call at once with Unavailable.
	breakAll atomic.Bool
	// fast, when set, records SetHolder calls (fastpath_test.go).
	fast *fastState
	// kv, when set, serves WatchKV streams the test scripts
	// (kvwatch_test.go).
	kv *kvFake
}

// call is one Generate call in progress.
type call struct {
	req  *pb.GenerateRequest
	ctx  context.Context
	out  chan *pb.GenerateResponse
	sent chan error
	end  chan error // ends the call with this error
}

// fail ends the call with err, as a worker that died does.
func (c *call) fail(err error) { c.end <- err }

func newFakeWorker(t *testing.T, id string) (*fakeWorker, string) {
	w := &fakeWorker{id: id, calls: make(chan *call, 16)}
	return w, serveGRPC(t, func(s *grpc.Server) { pb.RegisterInferenceServer(s, w) })
}

func (w *fakeWorker) Generate(req *pb.GenerateRequest, stream grpc.ServerStreamingServer[pb.GenerateResponse]) error {
	c := &call{req: req, ctx: stream.Context(), out: make(chan *pb.GenerateResponse), sent: make(chan error), end: make(chan error, 1)}
	if w.breakAll.Load() {
		return status.Error(codes.Unavailable, "the worker is failing")
	}
	w.calls <- c
	for {
		select {
		case <-c.ctx.Done():
			return c.ctx.Err()
		case err := <-c.end:
			return err
		case r := <-c.out:
			err := stream.Send(r)
			c.sent <- err
			if err != nil || r.Done || r.Moved != nil {
				return err
			}
		}
	}
}

// next waits for the worker's next call.
func (w *fakeWorker) next(t *testing.T) *call {
	t.Helper()
	select {
	case c := <-w.calls:
		return c
	case <-time.After(30 * time.Second):
		t.Fatalf("worker %s got no call", w.id)
		return nil
	}
}

// send streams the token at index idx; it fails the test when the gateway
// cut the call first.
func (c *call) send(t *testing.T, idx uint32, tok int32, done bool) {
	t.Helper()
	c.sendLogprob(t, idx, tok, 0, done)
}

// sendLogprob is send with the token's logprob.
func (c *call) sendLogprob(t *testing.T, idx uint32, tok int32, lp float32, done bool) {
	t.Helper()
	r := &pb.GenerateResponse{Token: tok, Index: idx, Done: done, Logprob: lp}
	if done {
		r.FinishReason = pb.FinishReason_FINISH_REASON_LENGTH
	}
	select {
	case c.out <- r:
		if err := <-c.sent; err != nil {
			t.Fatalf("sending token %d: %v", idx, err)
		}
	case <-c.ctx.Done():
		t.Fatalf("the gateway cut the call (epoch %d) before token %d: %v", c.req.Epoch, idx, c.ctx.Err())
	}
}

// move ends the call as a source does after its request's migration
// committed: the last message names the placement it continues at.
func (c *call) move(t *testing.T, to *pb.Placement) {
	t.Helper()
	select {
	case c.out <- &pb.GenerateResponse{Moved: to}:
		if err := <-c.sent; err != nil {
			t.Fatalf("sending the move: %v", err)
		}
	case <-c.ctx.Done():
		t.Fatalf("the gateway cut the call (epoch %d) before the move: %v", c.req.Epoch, c.ctx.Err())
	}
}

// rig is a gateway in front of a fake controller and fake workers.
type rig struct {
	fc  *fakeController
	g   *Gateway
	w   map[string]*fakeWorker
	rep []*replica
}

// newRig starts workers w1 and w2 (w1 reached through addr1 when given),
// replicas fake controller replicas, and a gateway; requests go to w1.
func newRig(t *testing.T, replicas int, tweak func(*Config), addr1 func(string) string) *rig {
	t.Helper()
	return newRigThen(t, replicas, tweak, addr1, nil)
}

// newRigThen is newRig with pre run on the rig before the gateway starts.
func newRigThen(t *testing.T, replicas int, tweak func(*Config), addr1 func(string) string, pre func(*rig)) *rig {
	t.Helper()
	r := &rig{fc: newFakeController("w1"), w: map[string]*fakeWorker{}}
	for _, id := range []string{"w1", "w2"} {
		w, addr := newFakeWorker(t, id)
		if id == "w1" && addr1 != nil {
			addr = addr1(addr)
		}
		r.w[id] = w
		r.fc.addWorker(id, addr)
	}
	cfg := DefaultConfig()
	cfg.Addr, cfg.Logger = "127.0.0.1:0", hclog.NewNullLogger()
	if testing.Verbose() {
		cfg.Logger = hclog.New(&hclog.LoggerOptions{Name: "gateway", Level: hclog.Debug, Output: testWriter{t}})
	}
	for i := 0; i < replicas; i++ {
		rep, addr := r.fc.serve(t)
		r.rep = append(r.rep, rep)
		cfg.Controllers = append(cfg.Controllers, addr)
	}
	if tweak != nil {
		tweak(&cfg)
	}
	if pre != nil {
		pre(r)
	}
	g, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	r.g = g
	return r
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// sse is a streaming completion as the client reads it.
type sse struct {
	text   strings.Builder
	errMsg string
	code   string
	done   bool
	err    error
}

// complete posts a streaming completion of n tokens and reads it to its
// end on the returned channel.
func (r *rig) complete(t *testing.T, n int) <-chan *sse {
	return r.completePrompt(t, "x", n)
}

// completePrompt is complete with the prompt's text.
func (r *rig) completePrompt(t *testing.T, prompt string, n int) <-chan *sse {
	out := make(chan *sse, 1)
	body := fmt.Sprintf(`{"model":"lumen-tiny","prompt":%q,"max_tokens":%d,"stream":true}`, prompt, n)
	go func() {
		res := &sse{}
		defer func() { out <- res }()
		client := &http.Client{Timeout: 60 * time.Second}
		resp, err := client.Post("http://"+r.g.Addr()+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			res.err = err
			return
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			b, _ := io.ReadAll(resp.Body)
			res.err = fmt.Errorf("status %d: %s", resp.StatusCode, b)
			return
		}
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			line, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			if line == "[DONE]" {
				res.done = true
				return
			}
			var ev struct {
				Choices []struct {
					Text string `json:"text"`
				} `json:"choices"`
				Error *struct {
					Message string `json:"message"`
					Code    string `json:"code"`
				} `json:"error"`
			}
			if err := json.Unmarshal([]byte(line), &ev); err != nil {
				res.err = err
				return
			}
			if ev.Error != nil {
				res.errMsg, res.code = ev.Error.Message, ev.Error.Code
				return
			}
			for _, c := range ev.Choices {
				res.text.WriteString(c.Text)
			}
		}
		res.err = sc.Err()
	}()
	return out
}

func wait(t *testing.T, ch <-chan *sse) *sse {
	t.Helper()
	select {
	case res := <-ch:
		return res
	case <-time.After(60 * time.Second):
		t.Fatal("the completion did not end")
		return nil
	}
}

// pauser is a TCP proxy that can stop forwarding, as a paused (SIGSTOP)
// process does: connections stay open and nothing comes back.
type pauser struct {
	lis    net.Listener
	target string
	paused chan struct{} // closed when paused
	once   sync.Once
	mu     sync.Mutex
	conns  []net.Conn
	wg     sync.WaitGroup
}

func newPauser(t *testing.T, target string) *pauser {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &pauser{lis: lis, target: target, paused: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *pauser) accept() {
	defer p.wg.Done()
	for {
		c, err := p.lis.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
		p.wg.Add(2)
		go p.pipe(c, up)
		go p.pipe(up, c)
	}
}

// pipe copies from src to dst until paused or closed.
func (p *pauser) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		select {
		case <-p.paused:
			// Swallow everything from now on, never answer.
			for err == nil {
				_, err = src.Read(buf)
			}
			return
		default:
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *pauser) pause() { p.once.Do(func() { close(p.paused) }) }

func (p *pauser) close() {
	p.lis.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// The gateway holds a controller session for its placements; the fake keeps
// one that never expires.

func (r *replica) CreateSession(_ context.Context, req *pb.CreateSessionRequest) (*pb.CreateSessionResponse, error) {
	return &pb.CreateSessionResponse{Session: &pb.Session{Id: "s-" + req.Owner, Owner: req.Owner, TtlNanos: int64(req.TtlMs) * 1e6}}, nil
}

func (r *replica) RenewSession(_ context.Context, req *pb.RenewSessionRequest) (*pb.RenewSessionResponse, error) {
	return &pb.RenewSessionResponse{Session: &pb.Session{Id: req.SessionId}}, nil
}

func (r *replica) DestroySession(context.Context, *pb.DestroySessionRequest) (*pb.DestroySessionResponse, error) {
	return &pb.DestroySessionResponse{Destroyed: true}, nil
}
