package ctlclient

import (
	"context"
	"errors"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeLog is the replicated state the fake replicas serve: an event log
// whose events at or below floor are gone, and a load table.
type fakeLog struct {
	mu      sync.Mutex // guards every field
	events  []*pb.Event
	floor   uint64
	applied uint64
	table   *pb.LoadTable
	row     *pb.Worker    // the worker table
	changed chan struct{} // closed and replaced on every change
}

func newFakeLog() *fakeLog { return &fakeLog{changed: make(chan struct{})} }

func (l *fakeLog) changedLocked() {
	close(l.changed)
	l.changed = make(chan struct{})
}

// publish appends n events at the next index and returns it.
func (l *fakeLog) publish(n int) uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.applied++
	for k := 0; k < n; k++ {
		l.events = append(l.events, &pb.Event{Index: l.applied, Body: &pb.Event_PhaseChanged{PhaseChanged: &pb.WorkerPhaseChanged{
			WorkerId: "other", Incarnation: uint64(k)}}})
	}
	l.changedLocked()
	return l.applied
}

// compact drops every event so far, as a replica restored from a snapshot
// does.
func (l *fakeLog) compact() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.floor = l.applied
	l.changedLocked()
}

// setRow replaces the worker table by one row.
func (l *fakeLog) setRow(w *pb.Worker) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.row = w
}

func (l *fakeLog) setTable(t *pb.LoadTable) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.table = t
	l.changedLocked()
}

// fakeReplica serves fakeLog. A replica without a leader (cut off from its
// quorum) streams nothing more and says so; a paused one (SIGSTOP, or a
// connection dropped without a reset) streams nothing and answers nothing.
type fakeReplica struct {
	pb.UnimplementedControllerServer
	log      *fakeLog
	noLeader atomic.Bool
	paused   atomic.Bool
	// breakAfter, when positive, ends the next event stream after that
	// many events.
	breakAfter atomic.Int32
	// kicked ends the open event streams once (kick).
	kicked chan struct{}
	mu     sync.Mutex
	froms  []uint64 // the FromIndex of every WatchEvents
}

// kick ends the event streams open now.
func (r *fakeReplica) kick() {
	r.mu.Lock()
	defer r.mu.Unlock()
	close(r.kicked)
	r.kicked = make(chan struct{})
}

type fakeOperator struct {
	pb.UnimplementedOperatorServer
	r *fakeReplica
}

func (r *fakeReplica) silent() bool { return r.noLeader.Load() || r.paused.Load() }

func (r *fakeReplica) fromIndexes() []uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.froms)
}

func (r *fakeReplica) WatchEvents(req *pb.WatchEventsRequest, stream grpc.ServerStreamingServer[pb.Event]) error {
	r.mu.Lock()
	r.froms = append(r.froms, req.FromIndex)
	kicked := r.kicked
	r.mu.Unlock()
	from, sent, limit := req.FromIndex, int32(0), r.breakAfter.Swap(0)
	for {
		l := r.log
		l.mu.Lock()
		if from < l.floor {
			l.mu.Unlock()
			return status.Errorf(codes.OutOfRange, "events up to %d are gone", l.floor)
		}
		var evs []*pb.Event
		if !r.silent() {
			for _, ev := range l.events {
				if ev.Index > from {
					evs = append(evs, ev)
				}
			}
		}
		changed := l.changed
		l.mu.Unlock()
		for _, ev := range evs {
			if limit > 0 && sent == limit {
				return status.Error(codes.Unavailable, "the replica went away")
			}
			if err := stream.Send(ev); err != nil {
				return err
			}
			sent++
		}
		if len(evs) > 0 {
			from = evs[len(evs)-1].Index
		}
		select {
		case <-changed:
		case <-kicked:
			return status.Error(codes.Unavailable, "the replica went away")
		case <-stream.Context().Done():
			return stream.Context().Err()
		}
	}
}

func (r *fakeReplica) WatchLoad(_ *pb.WatchLoadRequest, stream grpc.ServerStreamingServer[pb.LoadTable]) error {
	var last *pb.LoadTable
	for {
		l := r.log
		l.mu.Lock()
		t, changed := l.table, l.changed
		l.mu.Unlock()
		if t != nil && t != last && !r.silent() {
			if err := stream.Send(t); err != nil {
				return err
			}
			last = t
		}
		select {
		case <-changed:
		case <-stream.Context().Done():
			return stream.Context().Err()
		}
	}
}

func (r *fakeReplica) ListWorkers(context.Context, *pb.ListWorkersRequest) (*pb.ListWorkersResponse, error) {
	r.log.mu.Lock()
	defer r.log.mu.Unlock()
	resp := &pb.ListWorkersResponse{AppliedIndex: r.log.applied}
	if r.log.row != nil {
		resp.Workers = []*pb.Worker{r.log.row}
	}
	return resp, nil
}

func (o *fakeOperator) ClusterStatus(ctx context.Context, _ *pb.ClusterStatusRequest) (*pb.ClusterStatusResponse, error) {
	if o.r.paused.Load() {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	o.r.log.mu.Lock()
	defer o.r.log.mu.Unlock()
	st := &pb.ClusterStatusResponse{NodeId: "fake", LeaderId: "c0", AppliedIndex: o.r.log.applied}
	if o.r.noLeader.Load() {
		st.LeaderId = ""
	}
	return st, nil
}

// serveReplicas serves n replicas of l on loopback until the test ends.
func serveReplicas(t *testing.T, l *fakeLog, n int) ([]*fakeReplica, []string) {
	t.Helper()
	var reps []*fakeReplica
	var addrs []string
	for range n {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		r := &fakeReplica{log: l, kicked: make(chan struct{})}
		s := grpc.NewServer()
		pb.RegisterControllerServer(s, r)
		pb.RegisterOperatorServer(s, &fakeOperator{r: r})
		done := make(chan struct{})
		go func() { defer close(done); _ = s.Serve(lis) }()
		t.Cleanup(func() { s.Stop(); <-done })
		reps, addrs = append(reps, r), append(addrs, lis.Addr().String())
	}
	return reps, addrs
}

func dialAll(t *testing.T, addrs []string) []*grpc.ClientConn {
	t.Helper()
	var ccs []*grpc.ClientConn
	for _, a := range addrs {
		cc, err := grpc.NewClient(a, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		ccs = append(ccs, cc)
	}
	return ccs
}

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

// eventWatch runs a Watch of l's events over ccs until the test ends; it
// returns the events delivered so far and the number of starts.
func eventWatch(t *testing.T, ccs []*grpc.ClientConn) (got func() []*pb.Event, starts *atomic.Int32) {
	t.Helper()
	var mu sync.Mutex
	var evs []*pb.Event
	starts = &atomic.Int32{}
	w := &Watch[pb.Event]{Conns: ccs, ProbeInterval: 50 * time.Millisecond, Open: WatchEventsOn, Index: EventIndex,
		Started: func(context.Context, *grpc.ClientConn) error { starts.Add(1); return nil },
		Deliver: func(ev *pb.Event) { mu.Lock(); evs = append(evs, ev); mu.Unlock() }}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run returned %v, want context.Canceled", err)
		}
	})
	return func() []*pb.Event { mu.Lock(); defer mu.Unlock(); return slices.Clone(evs) }, starts
}

// lastIndex is the index of the last event delivered, 0 for none.
func lastIndex(evs []*pb.Event) uint64 {
	if len(evs) == 0 {
		return 0
	}
	return evs[len(evs)-1].Index
}

// checkWhole fails unless evs is every event of l after from, in order,
// where a stream that broke may be followed by the events of the index it
// broke in again, from that index's first.
func checkWhole(t *testing.T, l *fakeLog, from uint64, evs []*pb.Event) {
	t.Helper()
	l.mu.Lock()
	var want []*pb.Event
	for _, ev := range l.events {
		if ev.Index > from {
			want = append(want, ev)
		}
	}
	l.mu.Unlock()
	pos := 0
	for k, ev := range evs {
		if pos < len(want) && proto.Equal(ev, want[pos]) {
			pos++
			continue
		}
		first := slices.IndexFunc(want, func(e *pb.Event) bool { return e.Index == ev.Index })
		if first < 0 || first >= pos || !proto.Equal(want[first], ev) {
			t.Fatalf("delivered event %d (index %d) is neither the next one (%d of %d) nor a repeat of an index from its start", k, ev.Index, pos, len(want))
		}
		pos = first + 1
	}
	if pos != len(want) {
		t.Fatalf("delivered %d of the %d events after index %d", pos, len(want), from)
	}
}

// A stream that breaks in the middle of an index resumes on the next
// replica after the last whole index: nothing is lost, and only the index
// in progress is delivered again.
func TestWatchResumesAfterLastWholeIndex(t *testing.T) {
	l := newFakeLog()
	base := l.publish(1)
	reps, addrs := serveReplicas(t, l, 2)
	reps[0].breakAfter.Store(4)
	got, starts := eventWatch(t, dialAll(t, addrs))
	waitFor(t, 10*time.Second, "the first stream", func() bool { return starts.Load() == 1 })
	l.publish(2)
	l.publish(3) // the first replica breaks after 2 of these 3
	waitFor(t, 10*time.Second, "every event", func() bool { return lastIndex(got()) == base+2 && len(got()) >= 5 })
	checkWhole(t, l, base, got())
	if f := reps[1].fromIndexes(); len(f) != 1 || f[0] != base+1 {
		t.Fatalf("the second replica was asked from %v, want [%d] (the last whole index)", f, base+1)
	}
	if n := len(got()); n != 7 {
		t.Fatalf("%d events delivered, want 7 (the 2 of the broken index again)", n)
	}
}

// A replica that goes silent — cut off from its quorum (it knows no leader)
// or paused (it answers nothing) — is left within the probe interval, and
// the events it does not send arrive from the next.
func TestWatchLeavesSilentReplica(t *testing.T) {
	for _, tc := range []struct {
		name    string
		silence func(*fakeReplica)
	}{
		{"no leader", func(r *fakeReplica) { r.noLeader.Store(true) }},
		{"paused", func(r *fakeReplica) { r.paused.Store(true) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newFakeLog()
			base := l.publish(1)
			reps, addrs := serveReplicas(t, l, 2)
			got, starts := eventWatch(t, dialAll(t, addrs))
			waitFor(t, 10*time.Second, "the first stream", func() bool { return starts.Load() == 1 })
			tc.silence(reps[0])
			idx := l.publish(1)
			waitFor(t, 10*time.Second, "the event from the second replica", func() bool { return lastIndex(got()) == idx })
			checkWhole(t, l, base, got())
			if f := reps[1].fromIndexes(); len(f) != 1 || f[0] != base {
				t.Fatalf("the second replica was asked from %v, want [%d]", f, base)
			}
		})
	}
}

// A replica that no longer keeps the events asked for (OutOfRange: it was
// restored from a snapshot) makes the watch start again from now, and
// Started runs for that start: the caller reads what it missed.
func TestWatchRestartsFromNowAfterOutOfRange(t *testing.T) {
	l := newFakeLog()
	reps, addrs := serveReplicas(t, l, 1)
	got, starts := eventWatch(t, dialAll(t, addrs))
	waitFor(t, 10*time.Second, "the first stream", func() bool { return starts.Load() == 1 })
	l.publish(1)
	two := l.publish(1)
	waitFor(t, 10*time.Second, "the events", func() bool { return lastIndex(got()) == two })
	l.compact() // the open stream still serves; the next asks from index 1: gone
	reps[0].kick()
	waitFor(t, 10*time.Second, "a start from now", func() bool {
		f := reps[0].fromIndexes()
		return len(f) >= 3 && f[len(f)-1] == two
	})
	if f := reps[0].fromIndexes(); f[1] != two-1 {
		t.Fatalf("the stream after the break asked from %d, want %d (the last whole index)", f[1], two-1)
	}
	if n := starts.Load(); n < 3 {
		t.Fatalf("Started ran %d times, want one per stream (3)", n)
	}
	three := l.publish(1)
	waitFor(t, 10*time.Second, "an event after the restart", func() bool { return lastIndex(got()) == three })
}

// FollowDrain (lumen worker drain -follow) ends when the worker's phase
// leaves DRAINING: on the event, or — when the watch missed it and starts
// again from now — on the worker's row read at that start.
func TestFollowDrainEnds(t *testing.T) {
	for _, missed := range []bool{false, true} {
		t.Run(map[bool]string{false: "event", true: "missed event"}[missed], func(t *testing.T) {
			l := newFakeLog()
			l.setRow(&pb.Worker{Id: "w", Incarnation: 1, Phase: pb.WorkerPhase_WORKER_PHASE_DRAINING})
			from := l.publish(1)
			reps, addrs := serveReplicas(t, l, 1)
			c, err := New(addrs, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			var shown atomic.Int32
			type result struct {
				phase pb.WorkerPhase
				err   error
			}
			done := make(chan result, 1)
			go func() {
				p, err := c.FollowDrain(ctx, "w", 1, from, func(*pb.Event) { shown.Add(1) })
				done <- result{p, err}
			}()
			waitFor(t, 10*time.Second, "the watch to start", func() bool { return len(reps[0].fromIndexes()) == 1 })
			l.setRow(&pb.Worker{Id: "w", Incarnation: 1, Phase: pb.WorkerPhase_WORKER_PHASE_LEFT})
			if missed {
				l.publish(1) // some other event, then the LEFT one is compacted away
				l.compact()
				reps[0].kick()
			} else {
				l.mu.Lock()
				l.applied++
				l.events = append(l.events, &pb.Event{Index: l.applied, Body: &pb.Event_PhaseChanged{PhaseChanged: &pb.WorkerPhaseChanged{
					WorkerId: "w", Incarnation: 1, From: pb.WorkerPhase_WORKER_PHASE_DRAINING, To: pb.WorkerPhase_WORKER_PHASE_LEFT}}})
				l.changedLocked()
				l.mu.Unlock()
			}
			res := <-done
			if res.err != nil || res.phase != pb.WorkerPhase_WORKER_PHASE_LEFT {
				t.Fatalf("FollowDrain returned %s, %v; want LEFT", res.phase, res.err)
			}
		})
	}
}
