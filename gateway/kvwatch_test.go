package gateway

import (
	"context"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/kvpage"
	"github.com/lumen-project/lumen/internal/placer"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
)

// The worker side of WatchKV is another package's (worker/): these fake
// workers serve the stream as its proto comment says a worker does, with
// the messages each test scripts, over real gRPC.

// kvFake is a fake worker's WatchKV service: each stream the gateway
// opens is handed to the test.
type kvFake struct {
	conns  chan *kvConn
	opened atomic.Int32
}

// kvConn is one open WatchKV stream.
type kvConn struct {
	ctx  context.Context
	out  chan *pb.KVEvents
	sent chan error
	end  chan error
}

func newKVFake() *kvFake { return &kvFake{conns: make(chan *kvConn, 16)} }

func (w *fakeWorker) WatchKV(_ *pb.WatchKVRequest, stream grpc.ServerStreamingServer[pb.KVEvents]) error {
	if w.kv == nil {
		return status.Error(codes.Unimplemented, "fake: no WatchKV")
	}
	w.kv.opened.Add(1)
	c := &kvConn{ctx: stream.Context(), out: make(chan *pb.KVEvents), sent: make(chan error), end: make(chan error, 1)}
	w.kv.conns <- c
	for {
		select {
		case <-c.ctx.Done():
			return c.ctx.Err()
		case err := <-c.end:
			return err
		case m := <-c.out:
			err := stream.Send(m)
			c.sent <- err
			if err != nil {
				return err
			}
		}
	}
}

// next waits for the gateway's next stream.
func (k *kvFake) next(t *testing.T) *kvConn {
	t.Helper()
	select {
	case c := <-k.conns:
		return c
	case <-time.After(10 * time.Second):
		t.Fatal("the gateway opened no WatchKV stream")
		return nil
	}
}

// send sends one message on the stream.
func (c *kvConn) send(t *testing.T, m *pb.KVEvents) {
	t.Helper()
	m.PageTokens = kvpage.Tokens
	select {
	case c.out <- m:
		if err := <-c.sent; err != nil {
			t.Fatalf("sending KV events: %v", err)
		}
	case <-c.ctx.Done():
		t.Fatalf("the gateway closed the stream before %v", m)
	}
}

// cut waits for the gateway to close the stream.
func (c *kvConn) cut(t *testing.T, why string) {
	t.Helper()
	select {
	case <-c.ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatalf("the gateway kept the stream open: %s", why)
	}
}

func snapshot(w string, inc, seq uint64, stored ...uint64) *pb.KVEvents {
	return &pb.KVEvents{WorkerId: w, Incarnation: inc, Seq: seq, Reset_: true, Stored: stored}
}

func delta(w string, inc, seq uint64, stored, removed []uint64) *pb.KVEvents {
	return &pb.KVEvents{WorkerId: w, Incarnation: inc, Seq: seq, Stored: stored, Removed: removed}
}

// newKVRig is a fast-path rig (w1 and w2 eligible) whose workers serve
// WatchKV, with prefix routing as given.
func newKVRig(t *testing.T, routing bool) (*rig, *fastState) {
	t.Helper()
	var st *fastState
	r := newRigThen(t, 1, func(c *Config) { c.PrefixRouting = routing }, nil, func(r *rig) {
		st = r.enableFastPath(t, "", "w1", "w2")
		for _, w := range r.w {
			w.kv = newKVFake()
		}
	})
	return r, st
}

// holds is the index's overlap of hashes with worker w.
func holds(r *rig, w string, hashes ...uint64) int {
	ws := []policy.Worker{{ID: w, Eligible: true}}
	return r.g.kv.idx.Overlaps(ws, hashes, nil)[0]
}

// waitMessages waits until the gateway applied n KV messages.
func waitMessages(t *testing.T, r *rig, n uint64) {
	t.Helper()
	waitFor(t, 10*time.Second, "the KV messages to be applied", func() bool { return r.g.kv.messages.Load() >= n })
}

// The index follows a worker's stream: the snapshot replaces what it
// held, deltas store and remove, a seq gap or another incarnation in the
// stream replaces the entries and reopens the stream for a snapshot, a
// broken stream keeps the entries until the next snapshot; from the load
// table, a new incarnation clears the worker's entries and opens a new
// stream, and a worker that fails or leaves is cleared and not followed.
func TestKVIndexFollowsWatchKV(t *testing.T) {
	r, st := newKVRig(t, true)
	waitTable(t, r.g)
	k1 := r.w["w1"].kv
	c := k1.next(t)
	c.send(t, snapshot("w1", 1, 1, 1, 2, 3))
	waitMessages(t, r, 1)
	if n, o := r.g.kv.idx.Len("w1"), holds(r, "w1", 1, 2, 3, 4); n != 3 || o != 3 {
		t.Fatalf("after the snapshot: %d hashes, overlap %d; want 3, 3", n, o)
	}
	c.send(t, delta("w1", 1, 2, []uint64{4}, []uint64{2}))
	waitMessages(t, r, 2)
	if n, o := r.g.kv.idx.Len("w1"), holds(r, "w1", 1, 2, 3, 4); n != 3 || o != 1 {
		t.Fatalf("after storing 4 and removing 2: %d hashes, overlap %d; want 3, 1", n, o)
	}
	// A gap (seq 3 missed): the entries are the message's, and the stream
	// is opened again for a snapshot.
	resyncs := r.g.kv.resyncs.Load()
	c.send(t, delta("w1", 1, 4, []uint64{7}, nil))
	waitMessages(t, r, 3)
	if n, o := r.g.kv.idx.Len("w1"), holds(r, "w1", 7); n != 1 || o != 1 || r.g.kv.resyncs.Load() != resyncs+1 {
		t.Fatalf("after a gap: %d hashes, overlap with 7 %d; want only 7", n, o)
	}
	c.cut(t, "a gap in seq")
	c = k1.next(t)
	c.send(t, snapshot("w1", 1, 5, 1, 2, 3, 4))
	waitMessages(t, r, 4)
	if n, o := r.g.kv.idx.Len("w1"), holds(r, "w1", 1, 2, 3, 4); n != 4 || o != 4 {
		t.Fatalf("after the resync's snapshot: %d hashes, overlap %d; want 4, 4", n, o)
	}
	// Another incarnation in the stream (the worker restarted between two
	// of its messages): replaced, resynced.
	c.send(t, delta("w1", 2, 1, []uint64{9}, nil))
	waitMessages(t, r, 5)
	if n, o := r.g.kv.idx.Len("w1"), holds(r, "w1", 9); n != 1 || o != 1 {
		t.Fatalf("after a new incarnation: %d hashes, overlap with 9 %d; want only 9", n, o)
	}
	c.cut(t, "a new incarnation")
	c = k1.next(t)
	c.send(t, snapshot("w1", 2, 1, 1, 2))
	waitMessages(t, r, 6)
	// A broken stream: the entries stay until the next snapshot.
	c.end <- status.Error(codes.Unavailable, "fake: the stream broke")
	c = k1.next(t)
	if n := r.g.kv.idx.Len("w1"); n != 2 {
		t.Fatalf("after the stream broke: %d hashes, want the 2 held", n)
	}
	c.send(t, snapshot("w1", 2, 3, 5))
	waitMessages(t, r, 7)
	if n, o := r.g.kv.idx.Len("w1"), holds(r, "w1", 5); n != 1 || o != 1 {
		t.Fatalf("after the new stream's snapshot: %d hashes, overlap with 5 %d; want only 5", n, o)
	}

	// w2 restarts: the table names its new incarnation.
	k2 := r.w["w2"].kv
	c2 := k2.next(t)
	c2.send(t, snapshot("w2", 1, 1, 1, 2, 3))
	waitMessages(t, r, 8)
	st.setTable(func(tbl *pb.LoadTable) { tbl.Workers[1].Incarnation = 2 })
	c2.cut(t, "w2's old incarnation")
	if n := r.g.kv.idx.Len("w2"); n != 0 {
		t.Fatalf("after w2's restart: %d hashes, want none", n)
	}
	c2 = k2.next(t)
	c2.send(t, snapshot("w2", 2, 1, 8))
	waitMessages(t, r, 9)
	if n := r.g.kv.idx.Len("w2"); n != 1 {
		t.Fatalf("w2's new incarnation: %d hashes, want 1", n)
	}
	// w1 fails; w2 leaves the table.
	st.setTable(func(tbl *pb.LoadTable) { tbl.Workers[0].Phase = pb.WorkerPhase_WORKER_PHASE_FAILED })
	c.cut(t, "w1 failed")
	st.setTable(func(tbl *pb.LoadTable) { tbl.Workers = tbl.Workers[:1] })
	c2.cut(t, "w2 left")
	if n1, n2, ws := r.g.kv.idx.Len("w1"), r.g.kv.idx.Len("w2"), r.g.kv.idx.Workers(); n1 != 0 || n2 != 0 || ws != 0 {
		t.Fatalf("after w1 failed and w2 left: %d and %d hashes, %d workers indexed; want none", n1, n2, ws)
	}
	if o1, o2 := k1.opened.Load(), k2.opened.Load(); o1 != 4 || o2 != 2 {
		t.Fatalf("%d and %d streams opened, want 4 to w1 and 2 to w2 (no stream to a failed or gone worker)", o1, o2)
	}
}

// placeOn posts a completion of prompt and returns the worker its call
// reached, finishing it.
func placeOn(t *testing.T, r *rig, prompt string) string {
	t.Helper()
	res := r.completePrompt(t, prompt, 1)
	w, c := r.nextOrEnd(t, res)
	c.send(t, 0, 'a', true)
	if got := wait(t, res); got.err != nil || !got.done {
		t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
	}
	return w
}

// setLoads gives w1 and w2 their loads (running 1 each) at a new applied
// index, which counts the gateway's earlier placements, and waits until
// the gateway holds the table and counts none of its own.
func setLoads(t *testing.T, r *rig, st *fastState, used1, used2 uint64, waiting1 uint32) {
	t.Helper()
	var want uint64
	st.setTable(func(tbl *pb.LoadTable) {
		want = tbl.AppliedIndex
		tbl.Workers[0].Load = &pb.LoadRecord{KvPagesTotal: 1000, KvPagesUsed: used1, Running: 1, Waiting: waiting1}
		tbl.Workers[1].Load = &pb.LoadRecord{KvPagesTotal: 1000, KvPagesUsed: used2, Running: 1}
	})
	waitFor(t, 10*time.Second, "the new loads", func() bool {
		i, _ := r.g.replica.Applied()
		return i == want && r.g.replica.Pending() == 0
	})
}

// prefixPrompt is a 700-token prompt (the tokenizer's bytes) and the page
// hashes the gateway looks up for it: 43 full pages.
func prefixPrompt() (string, []uint64) {
	p := strings.Repeat("the shared system prompt; ", 27)[:700]
	toks := make([]int32, len(p))
	for i := range p {
		toks[i] = int32(p[i])
	}
	return p, core.PageHashes(toks[:len(toks)-1], nil)
}

// Prefix routing sends a request whose prompt a worker's cache holds to
// that worker, though another is a little freer; once the holder is much
// more loaded (a queue discounts the hit, its freeness falls) the freer
// worker gets it: one continuous score, placer.PrefixScore.
func TestPrefixRoutingPlacesOnTheHolder(t *testing.T) {
	r, st := newKVRig(t, true)
	prompt, hashes := prefixPrompt()
	setLoads(t, r, st, 100, 90, 0)
	// Nothing cached: freeness alone, w2 (10 pages a request freer).
	if w := placeOn(t, r, prompt); w != "w2" {
		t.Fatalf("with no cache placed on %s, want w2, the freer", w)
	}
	c := r.w["w1"].kv.next(t)
	c.send(t, snapshot("w1", 1, 1, hashes...))
	waitFor(t, 10*time.Second, "w1's snapshot", func() bool { return r.g.kv.idx.Len("w1") == len(hashes) })
	setLoads(t, r, st, 100, 90, 0)
	vs := r.g.replica.Views()
	if i := placer.PickPrefix(vs, make([]int, len(vs))); vs[i].ID != "w2" {
		t.Fatalf("freeness alone chooses %s, the test wants w2", vs[i].ID)
	}
	if w := placeOn(t, r, prompt); w != "w1" {
		t.Fatalf("w1 holds the prompt's %d pages and is 10 pages a request busier: placed on %s, want w1", len(hashes), w)
	}
	// A prompt that shares nothing: the freer worker.
	if w := placeOn(t, r, strings.Repeat("z", 700)); w != "w2" {
		t.Fatalf("a prompt w1 does not hold went to %s, want w2", w)
	}
	// w1 much more loaded: 20 waiting and 800 pages used.
	setLoads(t, r, st, 800, 90, 20)
	if w := placeOn(t, r, prompt); w != "w2" {
		t.Fatalf("w1 holds the prompt but is much busier: placed on %s, want w2", w)
	}
}

// With prefix routing off the gateway keeps no index and opens no WatchKV
// stream: a request goes to the freer worker, whatever caches hold.
func TestPrefixRoutingOffIgnoresTheCaches(t *testing.T) {
	r, st := newKVRig(t, false)
	prompt, _ := prefixPrompt()
	setLoads(t, r, st, 100, 90, 0)
	for range 2 {
		if w := placeOn(t, r, prompt); w != "w2" {
			t.Fatalf("routing off placed on %s, want w2, the freer", w)
		}
		setLoads(t, r, st, 100, 90, 0)
	}
	if r.g.kv != nil {
		t.Fatal("routing off keeps a KV index")
	}
	if o1, o2 := r.w["w1"].kv.opened.Load(), r.w["w2"].kv.opened.Load(); o1+o2 != 0 {
		t.Fatalf("routing off opened %d WatchKV streams", o1+o2)
	}
}

// newKVRig3 is newKVRig with a third worker, w3, every worker eligible and
// following WatchKV, prefix routing on.
func newKVRig3(t *testing.T) (*rig, *fastState) {
	t.Helper()
	var st *fastState
	r := newRigThen(t, 1, func(c *Config) { c.PrefixRouting = true }, nil, func(r *rig) {
		w3, addr := newFakeWorker(t, "w3")
		r.w["w3"] = w3
		r.fc.addWorker("w3", addr)
		st = r.enableFastPath(t, "", "w1", "w2")
		st.table.Workers = append(st.table.Workers, &pb.WorkerLoad{WorkerId: "w3", Incarnation: 1,
			Phase: pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, Load: &pb.LoadRecord{KvPagesTotal: 1000}})
		for _, w := range r.w {
			w.kv = newKVFake()
		}
	})
	return r, st
}

// setLoads3 gives the three workers their used pages (running 1 each)
// and waits until the gateway holds the table and counts none of its own.
func setLoads3(t *testing.T, r *rig, st *fastState, used ...uint64) {
	t.Helper()
	var want uint64
	st.setTable(func(tbl *pb.LoadTable) {
		want = tbl.AppliedIndex
		for i, w := range tbl.Workers {
			w.Load = &pb.LoadRecord{KvPagesTotal: 1000, KvPagesUsed: used[i], Running: 1}
		}
	})
	waitFor(t, 10*time.Second, "the new loads", func() bool {
		i, _ := r.g.replica.Applied()
		return i == want && r.g.replica.Pending() == 0
	})
}

func recoveryPlan(failed, id, target string, mode pb.RecoveryMode) *pb.Event {
	return &pb.Event{Body: &pb.Event_RecoveryPlan{RecoveryPlan: &pb.RecoveryPlan{FailedWorker: failed,
		Assignments: []*pb.RecoveryAssignment{{RequestId: id, TargetWorker: target, Mode: mode}}}}}
}

// A request whose worker fails resumes, with prefix routing on, where the
// recovery plan restores it (REUSE: the checkpoint beats a cache); where
// the plan recomputes it on the freest survivor (w2), it is placed instead
// on the worker whose cache holds its history's prefix (w3), under a new
// attempt id whose Dispatch names w3, with the journal's tokens, and the
// plan's attempt is completed at once.
func TestRecomputedResumeGoesToTheCachedPrefix(t *testing.T) {
	r, st := newKVRig3(t)
	prompt, hashes := prefixPrompt()
	waitTable(t, r.g)
	setLoads3(t, r, st, 0, 100, 110)
	// Freeness per request: w1 1000, w2 900, w3 890; with the prompt's 43
	// pages cached w3 scores 933: under w1, over w2.
	streams := map[string]*kvConn{}
	for _, id := range []string{"w1", "w2", "w3"} {
		streams[id] = r.w[id].kv.next(t)
	}
	resume := func(mode pb.RecoveryMode) (string, *call, <-chan *sse, string) {
		t.Helper()
		before := tokensOut(r.g)
		res := r.completePrompt(t, prompt, 4)
		c1 := r.w["w1"].next(t)
		id := c1.req.RequestId
		c1.send(t, 0, 'a', false)
		c1.send(t, 1, 'b', false)
		// Sent is not taken: a plan published before the gateway reads
		// both tokens would resume with fewer, and the fakes below send
		// from index 2 on.
		waitFor(t, 10*time.Second, "two tokens through the gateway", func() bool {
			if tokensOut(r.g) < before+2 {
				return false
			}
			r.g.mu.Lock()
			defer r.g.mu.Unlock()
			return r.g.flights[id] != nil && r.g.flights[id].cancel != nil
		})
		// w1 fails; the plan moves the request to w2, the freest survivor.
		r.fc.publish(recoveryPlan("w1", id, "w2", mode))
		r.fc.publish(moved(&pb.Placement{RequestId: id, WorkerId: "w2", Epoch: 2}))
		select {
		case c := <-r.w["w2"].calls:
			return "w2", c, res, id
		case c := <-r.w["w3"].calls:
			return "w3", c, res, id
		case <-time.After(30 * time.Second):
			t.Fatal("the request did not resume")
		}
		return "", nil, nil, ""
	}
	finish := func(c *call, res <-chan *sse) {
		t.Helper()
		c.send(t, 2, 'c', false)
		c.send(t, 3, 'd', true)
		if got := wait(t, res); got.err != nil || !got.done || got.text.String() != "abcd" {
			t.Fatalf("client got %q done=%v err=%v %s", got.text.String(), got.done, got.err, got.errMsg)
		}
	}

	// Nothing cached when the first request starts: w1, the freest. Then
	// w3's cache gets the prompt.
	streams["w3"].send(t, snapshot("w3", 1, 1, hashes...))
	waitFor(t, 10*time.Second, "w3's snapshot", func() bool { return r.g.kv.idx.Len("w3") == len(hashes) })
	w, c, res, id := resume(pb.RecoveryMode_RECOVERY_MODE_REUSE)
	if w != "w2" || c.req.RequestId != id || c.req.Epoch != 2 || string(int32s(c.req.Generated)) != "ab" {
		t.Fatalf("a REUSE plan's resume went to %s as %s epoch %d with %q; want the plan's w2, %s, epoch 2, \"ab\"",
			w, c.req.RequestId, c.req.Epoch, string(int32s(c.req.Generated)), id)
	}
	finish(c, res)

	setLoads3(t, r, st, 0, 100, 110)
	w, c, res, id = resume(pb.RecoveryMode_RECOVERY_MODE_RECOMPUTE)
	if w != "w3" || c.req.RequestId != id+"~1" || string(int32s(c.req.Generated)) != "ab" {
		t.Fatalf("a RECOMPUTE plan's resume went to %s as %s with %q; want w3 (its cache holds the prefix) as %s~1 with \"ab\"",
			w, c.req.RequestId, string(int32s(c.req.Generated)), id)
	}
	waitFor(t, 10*time.Second, "the new attempt's Dispatch to name w3", func() bool { return st.named(id+"~1") == "w3" })
	waitFor(t, 10*time.Second, "the plan's attempt to be completed", func() bool { return slices.Contains(r.fc.completedIDs(), id) })
	finish(c, res)

	// Both survivors cache the prefix, and w3 is the freer: the score
	// prefers w3, but it caches no more than the plan's w2, so the plan
	// stands (moved for the score alone, a burst of resumes would pile
	// onto one worker).
	streams["w2"].send(t, snapshot("w2", 1, 1, hashes...))
	waitFor(t, 10*time.Second, "w2's snapshot", func() bool { return r.g.kv.idx.Len("w2") == len(hashes) })
	setLoads3(t, r, st, 0, 110, 100)
	w, c, res, id = resume(pb.RecoveryMode_RECOVERY_MODE_RECOMPUTE)
	if w != "w2" || c.req.RequestId != id || string(int32s(c.req.Generated)) != "ab" {
		t.Fatalf("a RECOMPUTE plan whose target caches as much as any went to %s as %s with %q; want the plan's w2 as %s with \"ab\"",
			w, c.req.RequestId, string(int32s(c.req.Generated)), id)
	}
	finish(c, res)
}

// A gateway that restarts starts with an empty index and rebuilds every
// worker's entries from the snapshot each worker's new WatchKV stream
// opens with (what a worker sends first, whatever the old gateway saw):
// nothing the old gateway held is needed, and the new one places by the
// replayed caches at once.
func TestRestartedGatewayReplaysEverySnapshot(t *testing.T) {
	r, st := newKVRig(t, true)
	prompt, hashes := prefixPrompt()
	c1, c2 := r.w["w1"].kv.next(t), r.w["w2"].kv.next(t)
	c1.send(t, snapshot("w1", 1, 1, 100, 101))
	c2.send(t, snapshot("w2", 1, 1, 200))
	c1.send(t, delta("w1", 1, 2, []uint64{102}, []uint64{100}))
	waitMessages(t, r, 3)

	// The gateway restarts: its streams end, the new one opens its own.
	cfg := r.g.cfg
	r.g.Close()
	c1.cut(t, "the old gateway closed")
	c2.cut(t, "the old gateway closed")
	cfg.Addr = "127.0.0.1:0"
	g, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	r.g = g
	if n := g.kv.idx.Workers(); n != 0 {
		t.Fatalf("a new gateway's index holds %d workers before any snapshot", n)
	}
	// Each worker's state now: w1 holds the prompt's pages and 102, w2
	// its 200 and one page more.
	c1, c2 = r.w["w1"].kv.next(t), r.w["w2"].kv.next(t)
	c1.send(t, snapshot("w1", 1, 3, append([]uint64{102}, hashes...)...))
	c2.send(t, snapshot("w2", 1, 2, 200, 201))
	waitMessages(t, r, 2)
	if n1, n2 := g.kv.idx.Len("w1"), g.kv.idx.Len("w2"); n1 != len(hashes)+1 || n2 != 2 {
		t.Fatalf("after the snapshots: w1 %d hashes, w2 %d; want %d and 2", n1, n2, len(hashes)+1)
	}
	if holds(r, "w1", 100) != 0 || holds(r, "w1", 102) != 1 || holds(r, "w2", 200, 201) != 2 || holds(r, "w1", hashes...) != len(hashes) {
		t.Fatal("the new index is not the workers' snapshots")
	}
	// And it places by them: w1 holds the prompt, though w2 is freer.
	setLoads(t, r, st, 100, 90, 0)
	if w := placeOn(t, r, prompt); w != "w1" {
		t.Fatalf("after the restart a request went to %s; w1's replayed cache holds its prompt", w)
	}
}
