package controller

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/placer"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func (c *cluster) session(t *testing.T) string {
	t.Helper()
	s, err := c.client(c.anyNode()).CreateSession(ctxT(t, 5*time.Second), &pb.CreateSessionRequest{Owner: "gw", TtlMs: 30_000})
	if err != nil {
		t.Fatal(err)
	}
	return s.Session.Id
}

func (c *cluster) ctlClient(t *testing.T) *ctlclient.Client {
	t.Helper()
	var addrs []string
	for _, n := range c.nodes {
		if n != nil {
			addrs = append(addrs, n.GRPCAddr())
		}
	}
	cl, err := ctlclient.New(addrs, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	return cl
}

// A Place stream on a follower ends at once with Unavailable naming the
// leader's gRPC address, in the message and in the NOT_LEADER ErrorInfo.
func TestPlaceOnFollowerNamesLeader(t *testing.T) {
	c := newCluster(t, 3, nil)
	var f *Node
	// On a loaded machine leadership may move between choosing the
	// follower and its answer: then try again with the new roles.
	for attempt := 0; ; attempt++ {
		leader := c.waitLeader()
		f = c.follower()
		// The follower may learn who leads a moment after the leader is ready.
		waitFor(t, 5*time.Second, "the follower knowing the leader", func() bool {
			_, id := f.raft.LeaderWithID()
			return string(id) == leader.ID()
		})
		err := placeOnFollower(t, c, f, leader)
		if err == nil {
			break
		}
		if attempt == 4 || leader.IsLeader() {
			t.Fatal(err)
		}
		t.Logf("attempt %d, leadership moved: %v", attempt, err)
	}
	// The Placer, given only the follower, finds the leader by the hint.
	cl, err := ctlclient.New([]string{f.GRPCAddr()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	p := cl.NewPlacer(ctlclient.PlacerOptions{})
	defer p.Close(ctxT(t, 5*time.Second))
	c.addWorker("w1", 1, 1<<30)
	c.addWorker("w2", 1, 1<<30)
	resp, err := p.Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "r1", PromptTokens: 10, MaxTokens: 10,
		SessionId: c.session(t), WorkerId: "w1", WorkerIncarnation: 1})
	if err != nil || resp.Placement.WorkerId != "w1" {
		t.Fatalf("dispatch through a Placer given a follower: %v %v", resp, err)
	}
}

// placeOnFollower opens a Place stream on f and checks it is refused
// naming leader.
func placeOnFollower(t *testing.T, c *cluster, f, leader *Node) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	stream, err := c.client(f).Place(ctx)
	if err != nil {
		return err
	}
	_, err = stream.Recv()
	if status.Code(err) != codes.Unavailable {
		return fmt.Errorf("Place on a follower: %v, want Unavailable", err)
	}
	if msg := status.Convert(err).Message(); !strings.Contains(msg, leader.GRPCAddr()) || !strings.Contains(msg, leader.ID()) {
		return fmt.Errorf("message %q does not name the leader %s at %s", msg, leader.ID(), leader.GRPCAddr())
	}
	if ctlclient.Reason(err) != ctlclient.ReasonNotLeader || ctlclient.LeaderHint(err) != leader.GRPCAddr() {
		return fmt.Errorf("reason %q hint %q, want NOT_LEADER and %s", ctlclient.Reason(err), ctlclient.LeaderHint(err), leader.GRPCAddr())
	}
	return nil
}

// Batches are answered in order, seq echoed, each dispatch with its own
// outcome as the unary Dispatch would give it; a malformed batch ends the
// stream with InvalidArgument naming the limit.
func TestPlaceBatchesInOrder(t *testing.T) {
	c := newCluster(t, 3, nil)
	c.addWorker("w1", 1, 1<<30)
	c.addWorker("w2", 1, 1<<30)
	sid := c.session(t)
	var stream grpc.BidiStreamingClient[pb.PlaceBatch, pb.PlaceResults]
	// A loaded machine may lose leadership mid-test: the stream then ends
	// NOT_LEADER, and the test starts over on the new leader.
	for attempt := 0; ; attempt++ {
		s, err := placeBatchesInOrder(t, c, sid, attempt)
		if err == nil {
			stream = s
			break
		}
		if ctlclient.Reason(err) != ctlclient.ReasonNotLeader || attempt == 4 {
			t.Fatal(err)
		}
		t.Logf("attempt %d: %v", attempt, err)
	}
	// Over the limit: the stream ends, naming it.
	big := &pb.PlaceBatch{Seq: 999, Completes: make([]string, MaxPlaceBatch+1)}
	for i := range big.Completes {
		big.Completes[i] = fmt.Sprintf("x%d", i)
	}
	if err := stream.Send(big); err != nil {
		t.Fatal(err)
	}
	_, err := stream.Recv()
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), fmt.Sprint(MaxPlaceBatch)) {
		t.Fatalf("over-limit batch: %v", err)
	}
}

func placeBatchesInOrder(t *testing.T, c *cluster, sid string, attempt int) (grpc.BidiStreamingClient[pb.PlaceBatch, pb.PlaceResults], error) {
	leader := c.waitLeader()
	stream, err := c.client(leader).Place(ctxT(t, 10*time.Second))
	if err != nil {
		return nil, err
	}
	const batches, per = 20, 50
	for b := 1; b <= batches; b++ {
		msg := &pb.PlaceBatch{Seq: uint64(100 + b)}
		for i := 0; i < per; i++ {
			w := fmt.Sprintf("w%d", 1+i%2)
			msg.Dispatches = append(msg.Dispatches, &pb.DispatchRequest{RequestId: fmt.Sprintf("a%d-b%d-%d", attempt, b, i),
				PromptTokens: 10, MaxTokens: 10, SessionId: sid, WorkerId: w, WorkerIncarnation: 1})
		}
		// One without a session, one with a bad token count.
		msg.Dispatches = append(msg.Dispatches,
			&pb.DispatchRequest{RequestId: fmt.Sprintf("a%d-nosession-%d", attempt, b), PromptTokens: 10, MaxTokens: 10},
			&pb.DispatchRequest{RequestId: fmt.Sprintf("a%d-bad-%d", attempt, b), PromptTokens: 0, MaxTokens: 10, SessionId: sid})
		if b > 1 {
			// Complete the previous batch's first dispatch: after its
			// answer, as a gateway does, but sent before reading it.
			msg.Completes = []string{fmt.Sprintf("a%d-b%d-0", attempt, b-1)}
		}
		if err := stream.Send(msg); err != nil {
			// The stream ended; Recv says why, after the answers the
			// server sent before it ended.
			for {
				if _, err = stream.Recv(); err != nil {
					return nil, err
				}
			}
		}
	}
	var lastIndex uint64
	for b := 1; b <= batches; b++ {
		res, err := stream.Recv()
		if err != nil {
			return nil, err
		}
		if res.Seq != uint64(100+b) || len(res.Dispatches) != per+2 {
			t.Fatalf("answer %d: seq %d with %d results, want seq %d with %d", b, res.Seq, len(res.Dispatches), 100+b, per+2)
		}
		for i := 0; i < per; i++ {
			r := res.Dispatches[i]
			p := r.GetResponse().GetPlacement()
			if r.Code != 0 || p.GetRequestId() != fmt.Sprintf("a%d-b%d-%d", attempt, b, i) || p.WorkerId != fmt.Sprintf("w%d", 1+i%2) {
				t.Fatalf("batch %d dispatch %d: %v", b, i, r)
			}
			if r.Response.Index < lastIndex {
				t.Fatalf("batch %d dispatch %d committed at %d, before an earlier one at %d", b, i, r.Response.Index, lastIndex)
			}
			lastIndex = r.Response.Index
		}
		for _, r := range res.Dispatches[per:] {
			if codes.Code(r.Code) != codes.InvalidArgument || r.Response != nil {
				t.Fatalf("batch %d: malformed dispatch answered %v", b, r)
			}
		}
		if !strings.Contains(res.Dispatches[per].Message, "session_id") || !strings.Contains(res.Dispatches[per+1].Message, "prompt_tokens") {
			t.Fatalf("batch %d: messages %q, %q", b, res.Dispatches[per].Message, res.Dispatches[per+1].Message)
		}
		if b > 1 && res.GetComplete().GetCompleted() != 1 {
			t.Fatalf("batch %d: complete %v", b, res.Complete)
		}
	}
	return stream, nil
}

// A worker the gateway chose that has failed is refused WORKER_UNAVAILABLE
// (as the unary Dispatch refuses it), and nothing is placed.
func TestPlaceChosenWorkerFailed(t *testing.T) {
	c := newCluster(t, 3, nil)
	c.addWorker("w1", 1, 1<<30)
	c.addWorker("w2", 1, 1<<30)
	sid := c.session(t)
	if _, err := c.client(c.anyNode()).SetWorkerPhase(ctxT(t, 5*time.Second), &pb.SetWorkerPhaseRequest{
		WorkerId: "w1", Incarnation: 1, Phase: pb.WorkerPhase_WORKER_PHASE_FAILED, Reason: "test"}); err != nil {
		t.Fatal(err)
	}
	cl := c.ctlClient(t)
	p := cl.NewPlacer(ctlclient.PlacerOptions{})
	defer p.Close(ctxT(t, 5*time.Second))
	req := &pb.DispatchRequest{RequestId: "r1", PromptTokens: 10, MaxTokens: 10, SessionId: sid, WorkerId: "w1", WorkerIncarnation: 1}
	_, err := p.Dispatch(ctxT(t, 5*time.Second), req)
	if status.Code(err) != codes.FailedPrecondition || ctlclient.Reason(err) != ctlclient.ReasonWorkerUnavailable {
		t.Fatalf("dispatch to a failed worker: %v (reason %q)", err, ctlclient.Reason(err))
	}
	for _, want := range []string{"w1", "incarnation 1", "FAILED"} {
		if !strings.Contains(status.Convert(err).Message(), want) {
			t.Fatalf("message %q does not say %q", status.Convert(err).Message(), want)
		}
	}
	// The unary path says the same.
	_, uerr := cl.Dispatch(ctxT(t, 5*time.Second), req)
	if ctlclient.Reason(uerr) != ctlclient.ReasonWorkerUnavailable || status.Convert(uerr).Message() != status.Convert(err).Message() {
		t.Fatalf("unary: %v; stream: %v", uerr, err)
	}
	got, err := cl.GetPlacements(ctxT(t, 5*time.Second), &pb.GetPlacementsRequest{RequestIds: []string{"r1"}})
	if err != nil || len(got.Placements) != 0 || len(got.NotFound) != 1 {
		t.Fatalf("a refused dispatch left a placement: %v %v", got, err)
	}
	// Placed again on another worker, it goes through.
	req.WorkerId = "w2"
	if r, err := p.Dispatch(ctxT(t, 5*time.Second), req); err != nil || r.Placement.WorkerId != "w2" {
		t.Fatalf("redispatch: %v %v", r, err)
	}
	// A DRAINING worker is refused the same way (issue 21, defect 13): its
	// Generate refused the request, which the gateway places elsewhere.
	c.addWorker("w3", 1, 1<<30)
	if _, err := c.client(c.anyNode()).SetWorkerPhase(ctxT(t, 5*time.Second), &pb.SetWorkerPhaseRequest{
		WorkerId: "w3", Incarnation: 1, Phase: pb.WorkerPhase_WORKER_PHASE_DRAINING, Reason: "test"}); err != nil {
		t.Fatal(err)
	}
	dreq := &pb.DispatchRequest{RequestId: "r2", PromptTokens: 10, MaxTokens: 10, SessionId: sid, WorkerId: "w3", WorkerIncarnation: 1}
	_, err = p.Dispatch(ctxT(t, 5*time.Second), dreq)
	if ctlclient.Reason(err) != ctlclient.ReasonWorkerUnavailable || !strings.Contains(status.Convert(err).Message(), "DRAINING") {
		t.Fatalf("dispatch to a draining worker: %v (reason %q), want WORKER_UNAVAILABLE naming DRAINING", err, ctlclient.Reason(err))
	}
}

// Leadership moves while a Placer streams: unanswered batches are sent
// again on the new leader, every Dispatch is answered, and every id has
// exactly one placement, the one its Dispatch returned.
func TestPlaceLeaderChangeResends(t *testing.T) {
	t.Run("transfer", func(t *testing.T) { placeLeaderChange(t, false) })
	t.Run("kill", func(t *testing.T) { placeLeaderChange(t, true) })
}

// placeLeaderChange moves leadership away from the leader mid-stream: by a
// transfer, or by stopping the leader's process (kill).
func placeLeaderChange(t *testing.T, kill bool) {
	c := newCluster(t, 3, nil)
	c.addWorker("w1", 1, 1<<30)
	c.addWorker("w2", 1, 1<<30)
	sid := c.session(t)
	cl := c.ctlClient(t)
	var breaks sync.Map
	p := cl.NewPlacer(ctlclient.PlacerOptions{OnError: func(addr string, err error) { breaks.Store(addr, err) }})
	const callers = 16
	var mu sync.Mutex
	got := map[string]*pb.Placement{}
	var ids []string
	var afterMove atomic.Int64
	var moved, stop atomic.Bool
	var wg sync.WaitGroup
	errs := make(chan error, callers)
	// The callers dispatch without pause until 200 Dispatches succeeded
	// after the move: the move happens with batches in flight.
	for g := 0; g < callers; g++ {
		wg.Go(func() {
			for i := 0; !stop.Load(); i++ {
				id := fmt.Sprintf("g%d-%d", g, i)
				r, err := p.Dispatch(ctxT(t, 20*time.Second), &pb.DispatchRequest{RequestId: id, PromptTokens: 10, MaxTokens: 10,
					SessionId: sid, WorkerId: fmt.Sprintf("w%d", 1+i%2), WorkerIncarnation: 1})
				if err != nil {
					errs <- fmt.Errorf("%s: %w", id, err)
					return
				}
				mu.Lock()
				got[id] = r.Placement
				ids = append(ids, id)
				mu.Unlock()
				if i%5 == 4 {
					p.Complete(fmt.Sprintf("g%d-%d", g, i-4))
				}
				if moved.Load() && afterMove.Add(1) >= 200 {
					stop.Store(true)
				}
			}
		})
	}
	waitFor(t, 10*time.Second, "dispatches under way", func() bool { mu.Lock(); defer mu.Unlock(); return len(ids) > 100 })
	old := c.waitLeader()
	oldAddr := old.GRPCAddr()
	if kill {
		c.stop(c.index(old))
	} else if err := loseLeadership(old); err != nil && !errors.Is(err, raft.ErrNotLeader) {
		// On a loaded machine leadership may have moved already: that is
		// the change this test wants too.
		t.Fatal(err)
	}
	moved.Store(true)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := p.Close(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	nl := c.waitLeader()
	if nl == old {
		t.Fatal("leadership did not move")
	}
	if err, ok := breaks.Load(oldAddr); !ok {
		t.Fatal("the Placer's stream to the old leader never broke")
	} else {
		t.Logf("stream to the old leader ended: %v", err)
	}
	completed := 0
	for _, id := range ids {
		var g, i int
		fmt.Sscanf(id, "g%d-%d", &g, &i)
		if _, ok := got[fmt.Sprintf("g%d-%d", g, i+4)]; ok && i%5 == 0 {
			completed++
		}
	}
	read, err := cl.GetPlacements(ctxT(t, 5*time.Second), &pb.GetPlacementsRequest{RequestIds: ids})
	if err != nil {
		t.Fatal(err)
	}
	if len(read.Placements) != len(ids)-completed || len(read.NotFound) != completed {
		t.Fatalf("%d placements and %d not found, want %d and %d", len(read.Placements), len(read.NotFound), len(ids)-completed, completed)
	}
	for _, pl := range read.Placements {
		if g := got[pl.RequestId]; g.CreatedIndex != pl.CreatedIndex || g.WorkerId != pl.WorkerId {
			t.Fatalf("%s: dispatch answered %v, the table has %v", pl.RequestId, g, pl)
		}
	}
	if _, placements := nl.fsm.Counts(); placements != len(ids)-completed {
		t.Fatalf("the FSM holds %d placements, want %d", placements, len(ids)-completed)
	}
	t.Logf("%d dispatches, %d completed, %d after the move", len(ids), completed, afterMove.Load())
}

// WatchLoad sends a snapshot at once, on any replica, then a table when a
// row changed; its rows are the FSM's views.
func TestWatchLoad(t *testing.T) {
	c := newCluster(t, 3, nil)
	c.addWorker("w1", 1, 1<<30)
	c.addWorker("w2", 1, 1<<30)
	f := c.follower()
	waitFor(t, 5*time.Second, "the follower applying both workers", func() bool { n, _ := f.fsm.Counts(); return n == 2 })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, err := c.client(f).WatchLoad(ctx, &pb.WatchLoadRequest{IntervalMs: 1})
	if err != nil {
		t.Fatal(err)
	}
	first, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if first.ControllerId != f.ID() || first.Leader || len(first.Workers) != 2 || first.AppliedIndex == 0 {
		t.Fatalf("snapshot %v", first)
	}
	r := placer.New()
	r.Update(first)
	w, inc, ok := r.Take("r1", 100)
	if !ok {
		t.Fatal("the replica chose no worker from the snapshot")
	}
	if _, err := c.client(c.anyNode()).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "r1", PromptTokens: 100, MaxTokens: 10,
		WorkerId: w, WorkerIncarnation: inc}); err != nil {
		t.Fatal(err)
	}
	// The follower applies the dispatch; a table counting it arrives.
	for {
		t2, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if t2.AppliedIndex <= first.AppliedIndex {
			t.Fatalf("table at %d after one at %d", t2.AppliedIndex, first.AppliedIndex)
		}
		var pending uint32
		for _, row := range t2.Workers {
			if row.WorkerId == w {
				pending = row.PendingRequests
			}
		}
		if pending == 1 {
			views, _ := f.fsm.LoadViews()
			for i, row := range t2.Workers {
				if v := placer.View(row); v.ID == w && v != views[i] {
					t.Fatalf("row %+v, view %+v", v, views[i])
				}
			}
			break
		}
	}
	// The stream ends with the server.
	c.stop(c.index(f))
	if _, err := stream.Recv(); err == nil {
		// A table sent before the shutdown may still be in flight.
		if _, err = stream.Recv(); err == nil {
			t.Fatal("WatchLoad went on after the replica stopped")
		}
	}

	// ctlclient.WatchLoad goes on across replicas.
	cl := c.ctlClient(t)
	wctx, wcancel := context.WithCancel(context.Background())
	tables := make(chan *pb.LoadTable, 64)
	done := make(chan error, 1)
	go func() {
		done <- cl.WatchLoad(wctx, time.Millisecond, 0, func(t *pb.LoadTable) {
			select {
			case tables <- t:
			default:
			}
		})
	}()
	if tb := <-tables; len(tb.Workers) != 2 {
		t.Fatalf("table %v", tb)
	}
	wcancel()
	if err := <-done; err != context.Canceled {
		t.Fatalf("WatchLoad returned %v", err)
	}
}

// GetPlacements: a linearizable read on a follower right after a
// Dispatch's acknowledgement sees it; ids without a placement are listed;
// the limits are enforced.
func TestGetPlacements(t *testing.T) {
	c := newCluster(t, 3, nil)
	c.addWorker("w1", 1, 1<<30)
	sid := c.session(t)
	cl := c.ctlClient(t)
	p := cl.NewPlacer(ctlclient.PlacerOptions{})
	defer p.Close(ctxT(t, 5*time.Second))
	f := c.follower()
	for i := 0; i < 20; i++ {
		id := fmt.Sprintf("r%d", i)
		r, err := p.Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: id, PromptTokens: 10, MaxTokens: 10, SessionId: sid, WorkerId: "w1", WorkerIncarnation: 1})
		if err != nil {
			t.Fatal(err)
		}
		got, err := c.client(f).GetPlacements(ctxT(t, 5*time.Second), &pb.GetPlacementsRequest{RequestIds: []string{"nope", id}})
		if err != nil {
			t.Fatal(err)
		}
		if len(got.Placements) != 1 || got.Placements[0].RequestId != id || got.Placements[0].CreatedIndex != r.Index ||
			len(got.NotFound) != 1 || got.NotFound[0] != "nope" || got.AppliedIndex < r.Index {
			t.Fatalf("read after dispatch %s at %d: %v", id, r.Index, got)
		}
	}
	// Stale, on the follower, converges.
	waitFor(t, 5*time.Second, "a stale read on the follower", func() bool {
		got, err := c.client(f).GetPlacements(ctxT(t, time.Second), &pb.GetPlacementsRequest{RequestIds: []string{"r19"}, Consistency: pb.Consistency_CONSISTENCY_STALE})
		return err == nil && len(got.Placements) == 1
	})
	ids := make([]string, MaxGetPlacements+1)
	for i := range ids {
		ids[i] = fmt.Sprintf("x%d", i)
	}
	for _, bad := range [][]string{nil, ids, {"ok", "has space"}} {
		_, err := c.client(f).GetPlacements(ctxT(t, 5*time.Second), &pb.GetPlacementsRequest{RequestIds: bad})
		if status.Code(err) != codes.InvalidArgument {
			t.Fatalf("%d ids: %v", len(bad), err)
		}
	}
	// The client splits long lists.
	got, err := cl.GetPlacements(ctxT(t, 5*time.Second), &pb.GetPlacementsRequest{RequestIds: append(ids, "r0")})
	if err != nil || len(got.Placements) != 1 || len(got.NotFound) != len(ids) {
		t.Fatalf("split read: %d found, %d not found, %v", len(got.GetPlacements()), len(got.GetNotFound()), err)
	}
}

// metricValue sums a counter's (or a histogram's sample count's) series on
// n whose labels include want.
func metricValue(t *testing.T, n *Node, name string, want map[string]string) float64 {
	t.Helper()
	fams, err := n.metrics.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			for k, v := range want {
				found := false
				for _, l := range m.GetLabel() {
					found = found || (l.GetName() == k && l.GetValue() == v)
				}
				if !found {
					continue series
				}
			}
			switch {
			case m.GetCounter() != nil:
				sum += m.GetCounter().GetValue()
			case m.GetHistogram() != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			case m.GetGauge() != nil:
				sum += m.GetGauge().GetValue()
			}
		}
	}
	return sum
}

// The three calls' metrics count what they served.
func TestPlaceMetrics(t *testing.T) {
	c := newCluster(t, 1, func(cfg *Config) { cfg.BootstrapExpect = 1 })
	n := c.nodes[0]
	c.addWorker("w1", 1, 1<<30)
	sid := c.session(t)
	cl := c.ctlClient(t)
	p := cl.NewPlacer(ctlclient.PlacerOptions{})
	for i := 0; i < 10; i++ {
		if _, err := p.Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: fmt.Sprintf("r%d", i), PromptTokens: 1, MaxTokens: 1,
			SessionId: sid, WorkerId: "w1", WorkerIncarnation: 1}); err != nil {
			t.Fatal(err)
		}
	}
	_, err := p.Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "x", PromptTokens: 1, MaxTokens: 1, SessionId: sid, WorkerId: "w9", WorkerIncarnation: 1})
	if ctlclient.Reason(err) != ctlclient.ReasonWorkerUnavailable {
		t.Fatal(err)
	}
	p.Complete("r0", "r1")
	if err := p.Close(ctxT(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.GetPlacements(ctxT(t, 5*time.Second), &pb.GetPlacementsRequest{RequestIds: []string{"r2", "r3"}}); err != nil {
		t.Fatal(err)
	}
	stream, err := c.client(n).WatchLoad(ctxT(t, 5*time.Second), &pb.WatchLoadRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	for _, m := range []struct {
		name   string
		labels map[string]string
		min    float64
	}{
		{"lumen_controller_place_dispatches_total", map[string]string{"outcome": "placed"}, 10},
		{"lumen_controller_place_dispatches_total", map[string]string{"outcome": ctlclient.ReasonWorkerUnavailable}, 1},
		{"lumen_controller_place_completes_total", nil, 2},
		{"lumen_controller_place_batches_total", nil, 1},
		{"lumen_controller_place_batch_seconds", nil, 1},
		{"lumen_controller_get_placements_ids", nil, 1},
		{"lumen_controller_watch_load_tables_total", nil, 1},
		{"lumen_controller_watch_load_streams", nil, 1},
	} {
		if v := metricValue(t, n, m.name, m.labels); v < m.min {
			t.Errorf("%s%v = %v, want at least %v", m.name, m.labels, v, m.min)
		}
	}
}

// TestWatchLoadSendsGatewaySessions (issue 21, defect 2): over gRPC, from a
// follower, the table carries every field of the FSM's (LoadTableMessage),
// the gateway sessions among them: only gateways', in their owners' order;
// each gateway's replica computes its share from it. WatchLoad used to
// leave the list out, and every gateway chose alone.
func TestWatchLoadSendsGatewaySessions(t *testing.T) {
	c := newCluster(t, 3, nil)
	c.addWorker("w1", 1, 1<<30)
	c.addWorker("w2", 1, 1<<30)
	cl := c.client(c.anyNode())
	open := func(owner string, gateway bool) string {
		s, err := cl.CreateSession(ctxT(t, 5*time.Second), &pb.CreateSessionRequest{Owner: owner, TtlMs: 30_000, Gateway: gateway})
		if err != nil {
			t.Fatal(err)
		}
		return s.Session.Id
	}
	b := open("gw-b", true)
	open("bench-client", false) // holds a session, takes no share
	a := open("gw-a", true)
	f := c.follower()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := c.client(f).WatchLoad(ctx, &pb.WatchLoadRequest{IntervalMs: 1})
	if err != nil {
		t.Fatal(err)
	}
	for {
		tab, err := stream.Recv()
		if err != nil {
			t.Fatalf("no table listing both gateways' sessions came: %v", err)
		}
		if len(tab.Workers) < 2 || len(tab.Sessions) < 2 {
			continue
		}
		if !slices.Equal(tab.Sessions, []string{a, b}) {
			t.Fatalf("sessions %v, want gw-a's and gw-b's [%s %s]", tab.Sessions, a, b)
		}
		// Every field of the FSM's table, once the follower is there.
		waitFor(t, 5*time.Second, "the follower at the table's index", func() bool { return f.fsm.Applied() >= tab.AppliedIndex })
		if ft, _ := f.fsm.LoadTable(); ft.AppliedIndex == tab.AppliedIndex {
			if want := LoadTableMessage(ft, f.ID(), false); !proto.Equal(tab, want) {
				t.Fatalf("received %v\nwant %v", tab, want)
			}
		}
		for i, sid := range []string{a, b} {
			r := placer.New()
			r.SetSelf(sid)
			r.Update(tab)
			if g, G := r.Share(); g != i || G != 2 {
				t.Fatalf("gateway %d's share: %d of %d, want %d of 2", i, g, G, i)
			}
		}
		return
	}
}
