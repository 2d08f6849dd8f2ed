package gateway

import (
	"context"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// The fake controller's side of issue 16: a load table (WatchLoad) and the
// Place stream, served only when a test sets fc.table (the other tests see
// a controller without them, Unimplemented, and the gateway's old path).

// fastState is what a fast-path test configures on the fake controller.
type fastState struct {
	mu    sync.Mutex
	table *pb.LoadTable
	// tableChanged is closed and replaced when setTable changes the
	// table: WatchLoad sends the new one.
	tableChanged chan struct{}
	// holder is the checkpoint holder Dispatch names, replicas its
	// further copies (issue 24).
	holder   string
	replicas []string
	// placedOn records the worker each Dispatch named, by request id.
	placedOn map[string]string
	// setHolders records the SetHolder calls the fake workers got.
	setHolders []*pb.SetHolderRequest
}

var fast = map[*fakeController]*fastState{}
var fastMu sync.Mutex

func fastOf(fc *fakeController) *fastState {
	fastMu.Lock()
	defer fastMu.Unlock()
	return fast[fc]
}

// newFastRig is a rig whose fake controller serves a load table with the
// workers eligible (phase FULL_SERVICE, incarnation 1) and the others
// draining, and the Place stream; Dispatch names holder as the holder.
func newFastRig(t *testing.T, holder string, eligible ...string) (*rig, *fastState) {
	t.Helper()
	var st *fastState
	r := newRigThen(t, 1, nil, nil, func(r *rig) { st = r.enableFastPath(t, holder, eligible...) })
	return r, st
}

func (r *rig) enableFastPath(t *testing.T, holder string, eligible ...string) *fastState {
	t.Helper()
	tbl := &pb.LoadTable{AppliedIndex: 1, Leader: true, ControllerId: "fake"}
	for _, id := range []string{"w1", "w2"} {
		ph := pb.WorkerPhase_WORKER_PHASE_DRAINING
		if slices.Contains(eligible, id) {
			ph = pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE
		}
		tbl.Workers = append(tbl.Workers, &pb.WorkerLoad{WorkerId: id, Incarnation: 1, Phase: ph,
			Load: &pb.LoadRecord{KvPagesTotal: 1000}})
	}
	st := &fastState{table: tbl, holder: holder, placedOn: map[string]string{}, tableChanged: make(chan struct{})}
	fastMu.Lock()
	fast[r.fc] = st
	fastMu.Unlock()
	t.Cleanup(func() { fastMu.Lock(); delete(fast, r.fc); fastMu.Unlock() })
	for _, w := range r.w {
		w.fast = st
	}
	return st
}

func (r *replica) WatchLoad(_ *pb.WatchLoadRequest, stream grpc.ServerStreamingServer[pb.LoadTable]) error {
	st := fastOf(r.fc)
	if st == nil {
		return status.Error(codes.Unimplemented, "fake: no load table")
	}
	for {
		st.mu.Lock()
		tbl, changed := st.table, st.tableChanged
		st.mu.Unlock()
		if err := stream.Send(tbl); err != nil {
			return err
		}
		select {
		case <-changed:
		case <-stream.Context().Done():
			return stream.Context().Err()
		}
	}
}

// setTable changes the load table (a copy, edited by f, at the next
// applied index) and sends it on the open WatchLoad streams.
func (st *fastState) setTable(f func(*pb.LoadTable)) {
	st.mu.Lock()
	defer st.mu.Unlock()
	tbl := proto.Clone(st.table).(*pb.LoadTable)
	tbl.AppliedIndex++
	f(tbl)
	st.table = tbl
	close(st.tableChanged)
	st.tableChanged = make(chan struct{})
}

// Place answers each batch in order: its dispatches as the unary Dispatch
// (the hook included; a named worker is honoured, at epoch 0), then its
// completions.
func (r *replica) Place(stream grpc.BidiStreamingServer[pb.PlaceBatch, pb.PlaceResults]) error {
	st := fastOf(r.fc)
	if st == nil {
		// A slow answer, for a test to act before it.
		if err := gate(stream.Context(), r.fc.placeGate); err != nil {
			return err
		}
		return status.Error(codes.Unimplemented, "fake: no place stream")
	}
	if err := stream.SendHeader(metadata.Pairs(ctlclient.AcceptedHeader, "fake")); err != nil {
		return err
	}
	for {
		b, err := stream.Recv()
		if err != nil {
			return err
		}
		res := &pb.PlaceResults{Seq: b.Seq}
		for _, d := range b.Dispatches {
			pl := &pb.Placement{RequestId: d.RequestId, WorkerId: r.fc.dispatchTo, Epoch: 1}
			if d.WorkerId != "" {
				pl.WorkerId, pl.Epoch, pl.WorkerIncarnation = d.WorkerId, 0, d.WorkerIncarnation
			}
			st.mu.Lock()
			pl.HolderId, pl.ReplicaHolders = st.holder, st.replicas
			st.placedOn[d.RequestId] = d.WorkerId
			st.mu.Unlock()
			r.fc.mu.Lock()
			r.fc.dispatched = append(r.fc.dispatched, d.RequestId)
			hook := r.fc.onDispatch
			r.fc.mu.Unlock()
			var herr error
			if hook != nil {
				herr = hook(stream.Context(), pl)
			}
			if herr != nil {
				s := status.Convert(herr)
				pr := &pb.PlaceResult{Code: uint32(s.Code()), Message: s.Message(), Reason: ctlclient.Reason(herr)}
				res.Dispatches = append(res.Dispatches, pr)
				continue
			}
			// Visible to GetPlacement once committed, as in the FSM.
			r.fc.setPlacement(pl)
			res.Dispatches = append(res.Dispatches, &pb.PlaceResult{Response: &pb.DispatchResponse{Placement: pl, Index: 2}})
		}
		if len(b.Completes) > 0 {
			r.fc.completes.Add(1)
			r.fc.mu.Lock()
			r.fc.completed = append(r.fc.completed, b.Completes...)
			r.fc.mu.Unlock()
			res.Complete = &pb.CompleteResponse{Completed: uint32(len(b.Completes))}
		}
		if err := stream.Send(res); err != nil {
			return err
		}
	}
}

func (w *fakeWorker) SetHolder(_ context.Context, req *pb.SetHolderRequest) (*pb.SetHolderResponse, error) {
	if w.fast == nil {
		return nil, status.Error(codes.Unimplemented, "fake: no SetHolder")
	}
	w.fast.mu.Lock()
	defer w.fast.mu.Unlock()
	w.fast.setHolders = append(w.fast.setHolders, req)
	return &pb.SetHolderResponse{Applied: true}, nil
}

func (st *fastState) setHolderCalls() []*pb.SetHolderRequest {
	st.mu.Lock()
	defer st.mu.Unlock()
	return slices.Clone(st.setHolders)
}

func (st *fastState) named(id string) string {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.placedOn[id]
}

// nextAny waits for the next call at any of the rig's workers.
func (r *rig) nextAny(t *testing.T) (string, *call) {
	t.Helper()
	return r.nextOrEnd(t, nil)
}

// counterVec reads one labelled counter of the gateway's registry.
func counterVec(t *testing.T, g *Gateway, name, label string) float64 {
	t.Helper()
	var cv *prometheus.CounterVec
	switch name {
	case "lumen_gateway_placement_refusals_total":
		cv = g.metrics.refusals
	case "lumen_gateway_placement_fallbacks_total":
		cv = g.metrics.fallbacks
	default:
		t.Fatalf("no counter %s", name)
	}
	var m dto.Metric
	if err := cv.WithLabelValues(label).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

func workerUnavailable(id string) error {
	s, _ := status.New(codes.FailedPrecondition, "worker "+id+" incarnation 1 failed").
		WithDetails(&errdetails.ErrorInfo{Reason: ctlclient.ReasonWorkerUnavailable, Domain: ctlclient.ErrorDomain})
	return s.Err()
}

// waitTable waits until the gateway holds the load table.
func waitTable(t *testing.T, g *Gateway) {
	t.Helper()
	waitFor(t, 10*time.Second, "the load table", func() bool { _, n := g.replica.Applied(); return n > 0 })
}

// A request starts on the worker the gateway chose from its load table
// while its Dispatch has not committed: tokens reach the client before the
// commit. The commit then tells the worker the holder Apply chose, and the
// request's completion follows its Dispatch on the stream.
func TestFastPathStreamsBeforeTheCommit(t *testing.T) {
	r, st := newFastRig(t, "w2", "w1")
	st.mu.Lock()
	st.replicas = []string{"w3"} // a second copy: SetHolder names it too
	st.mu.Unlock()
	commit := make(chan struct{})
	r.fc.setOnDispatch(func(ctx context.Context, _ *pb.Placement) error { return gate(ctx, commit) })
	waitTable(t, r.g)
	res := r.complete(t, 3)
	c := r.w["w1"].next(t)
	id := c.req.RequestId
	if c.req.Epoch != 0 || c.req.Holder != "" {
		t.Fatalf("the call carries epoch %d holder %q; a request started before its commit has epoch 0 and no holder", c.req.Epoch, c.req.Holder)
	}
	c.send(t, 0, 'a', false)
	c.send(t, 1, 'b', false) // streamed while the commit is held
	waitFor(t, 10*time.Second, "the Dispatch to name w1, where the request runs", func() bool { return st.named(id) == "w1" })
	close(commit)
	waitFor(t, 10*time.Second, "SetHolder at w1", func() bool { return len(st.setHolderCalls()) == 1 })
	if sh := st.setHolderCalls()[0]; sh.RequestId != id || sh.Holder != "w2" || sh.Epoch != 0 || !slices.Equal(sh.ReplicaHolders, []string{"w3"}) {
		t.Fatalf("SetHolder %v, want %s epoch 0 holder w2 replica w3", sh, id)
	}
	c.send(t, 2, 'c', true)
	if got := wait(t, res); got.err != nil || !got.done || got.text.String() != "abc" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
	waitFor(t, 10*time.Second, "the completion", func() bool { return slices.Contains(r.fc.completedIDs(), id) })
	// Placed from the replica: its own time to the worker is the fast
	// path's, not a commit's wait.
	checkOwn(t, r.g, map[string]uint64{"accept_to_generate": 1, "accept_to_generate_via_controller": 0, "token_to_write": 3})
	if n := r.g.replica.Pending(); n != 1 {
		// Committed at index 2 past the table's 1: counted until a table
		// counts it.
		t.Fatalf("the replica counts %d own placements, want 1", n)
	}
}

// A Dispatch refused because the chosen worker failed (WORKER_UNAVAILABLE)
// after tokens were streamed cuts the stream there; the request is placed
// again under a new attempt id on another worker with the journal's tokens:
// the client sees no error, gap or repeated token.
func TestFastPathRefusalMovesWithTheJournal(t *testing.T) {
	r, st := newFastRig(t, "", "w1", "w2")
	refuse := make(chan struct{})
	var calls atomic.Int32
	r.fc.setOnDispatch(func(ctx context.Context, pl *pb.Placement) error {
		if calls.Add(1) > 1 {
			return nil // the second attempt commits
		}
		if err := gate(ctx, refuse); err != nil {
			return err
		}
		return workerUnavailable(pl.WorkerId)
	})
	waitTable(t, r.g)
	res := r.complete(t, 4)
	w, c1 := r.nextAny(t)
	first := c1.req.RequestId
	c1.send(t, 0, 'a', false)
	c1.send(t, 1, 'b', false)
	waitFor(t, 10*time.Second, "the gateway to take both tokens", func() bool { return tokensOut(r.g) >= 2 })
	waitFor(t, 10*time.Second, "the first Dispatch", func() bool { return st.named(first) == w })
	close(refuse)
	other, c2 := r.nextAny(t)
	if other == w {
		t.Fatalf("placed again on %s, the worker that was refused", w)
	}
	if c2.req.RequestId != first+"~1" || !slices.Equal(c2.req.Generated, []int32{'a', 'b'}) {
		t.Fatalf("second call %q with generated %v, want %q with [a b]", c2.req.RequestId, c2.req.Generated, first+"~1")
	}
	select {
	case <-c1.ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the refused worker's call was not cut")
	}
	c2.send(t, 2, 'c', false)
	c2.send(t, 3, 'd', true)
	if got := wait(t, res); got.err != nil || !got.done || got.text.String() != "abcd" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
	if n := counterVec(t, r.g, "lumen_gateway_placement_refusals_total", "worker_unavailable"); n != 1 {
		t.Fatalf("%v refusals counted, want 1", n)
	}
}

// A move event that arrives before the Dispatch's answer (the worker
// failed right after the commit and a recovery moved the request) cuts the
// stream the request started on, and it continues where the event says.
func TestFastPathMoveBeforeTheAnswer(t *testing.T) {
	r, _ := newFastRig(t, "", "w1")
	started := make(chan struct{})
	r.fc.setOnDispatch(func(ctx context.Context, pl *pb.Placement) error {
		if err := gate(ctx, started); err != nil {
			return err
		}
		idx := r.fc.publish(moved(&pb.Placement{RequestId: pl.RequestId, WorkerId: "w2", Epoch: 1}))
		waitFor(t, 10*time.Second, "the watcher to handle the move", func() bool { return r.g.watched.Load() >= idx })
		return nil
	})
	waitTable(t, r.g)
	res := r.complete(t, 2)
	c1 := r.w["w1"].next(t)
	c1.send(t, 0, 'a', false)
	waitFor(t, 10*time.Second, "the gateway to take the first token", func() bool { return tokensOut(r.g) >= 1 })
	close(started)
	c2 := r.w["w2"].next(t)
	if c2.req.Epoch != 1 || !slices.Equal(c2.req.Generated, []int32{'a'}) {
		t.Fatalf("moved call at epoch %d with generated %v, want epoch 1 with [a]", c2.req.Epoch, c2.req.Generated)
	}
	c2.send(t, 1, 'b', true)
	if got := wait(t, res); got.err != nil || !got.done || got.text.String() != "ab" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
}

// With no eligible worker in the table the request waits for the
// controller's choice, as before the fast path.
func TestFastPathFallsBackWithoutAWorker(t *testing.T) {
	r, _ := newFastRig(t, "")
	waitTable(t, r.g)
	res := r.complete(t, 1)
	c := r.w["w1"].next(t)
	if c.req.Epoch != 1 {
		t.Fatalf("call at epoch %d, want the controller's placement (epoch 1)", c.req.Epoch)
	}
	c.send(t, 0, 'a', true)
	if got := wait(t, res); got.err != nil || !got.done || got.text.String() != "a" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
	if n := counterVec(t, r.g, "lumen_gateway_placement_fallbacks_total", "no_worker"); n != 1 {
		t.Fatalf("%v fallbacks counted, want 1", n)
	}
}

// Refusals accumulate exclusions: a request refused on each worker its
// table offers ends up placed by the controller, with the journal.
func TestFastPathRefusedEverywhereFallsBack(t *testing.T) {
	r, _ := newFastRig(t, "", "w1", "w2")
	r.fc.setOnDispatch(func(_ context.Context, pl *pb.Placement) error {
		if pl.Epoch == 0 { // a worker the gateway named
			return workerUnavailable(pl.WorkerId)
		}
		return nil
	})
	waitTable(t, r.g)
	res := r.complete(t, 2)
	var last *call
	for last == nil || last.req.Epoch == 0 {
		_, c := r.nextAny(t)
		last = c
	}
	if !strings.HasSuffix(last.req.RequestId, "~2") {
		t.Fatalf("the controller placed attempt %q; want the third (two refusals, one per worker)", last.req.RequestId)
	}
	last.send(t, 0, 'a', false)
	last.send(t, 1, 'b', true)
	if got := wait(t, res); got.err != nil || !got.done || got.text.String() != "ab" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
	if n := counterVec(t, r.g, "lumen_gateway_placement_refusals_total", "worker_unavailable"); n != 2 {
		t.Fatalf("%v refusals counted, want 2", n)
	}
}

// A worker that dies before the request's Dispatch commits breaks the
// stream; the placement is not there yet, so the resume places the request
// afresh, that worker excluded, with the journal: no error, gap or repeat.
func TestFastPathWorkerDiesBeforeTheCommit(t *testing.T) {
	r, _ := newFastRig(t, "", "w1", "w2")
	hold := make(chan struct{})
	var calls atomic.Int32
	r.fc.setOnDispatch(func(ctx context.Context, pl *pb.Placement) error {
		if calls.Add(1) > 1 {
			return nil
		}
		if err := gate(ctx, hold); err != nil { // the commit is slow
			return err
		}
		return workerUnavailable(pl.WorkerId)
	})
	defer close(hold)
	waitTable(t, r.g)
	res := r.complete(t, 3)
	w, c1 := r.nextAny(t)
	c1.send(t, 0, 'a', false)
	waitFor(t, 10*time.Second, "the gateway to take the first token", func() bool { return tokensOut(r.g) >= 1 })
	c1.fail(status.Error(codes.Unavailable, "worker killed"))
	other, c2 := r.nextAny(t)
	if other == w {
		t.Fatalf("resumed on %s, the worker that died", w)
	}
	if c2.req.RequestId != c1.req.RequestId+"~1" || !slices.Equal(c2.req.Generated, []int32{'a'}) {
		t.Fatalf("resumed call %q with generated %v, want %q with [a]", c2.req.RequestId, c2.req.Generated, c1.req.RequestId+"~1")
	}
	c2.send(t, 1, 'b', false)
	c2.send(t, 2, 'c', true)
	if got := wait(t, res); got.err != nil || !got.done || got.text.String() != "abc" {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
}
