package fsm

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/lumen-project/lumen/internal/placer"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func dispatchOn(id, workerID string, inc uint64, prompt uint32) *pb.Command {
	c := dispatch(id, prompt, 16)
	c.GetDispatch().WorkerId, c.GetDispatch().WorkerIncarnation = workerID, inc
	return c
}

// A gateway-chosen worker is taken while its incarnation is alive, in any
// phase but DRAINING, FAILED and LEFT; otherwise the Dispatch fails
// ErrWorkerUnavailable naming the worker, the incarnation and why.
func TestDispatchChosenWorker(t *testing.T) {
	h := newHarness(t)
	for _, id := range []string{"w1", "w2", "w3"} {
		if r := h.one(worker(id, 1<<30)); r.Err != nil {
			t.Fatal(r.Err)
		}
	}
	// Apply would pick the freest; the gateway named w3.
	h.apply(load("w1", 1, 0, 0), load("w2", 1, 0, 0), load("w3", 1, 5, 900))
	r := h.one(dispatchOn("r1", "w3", 1, 160))
	if r.Err != nil {
		t.Fatal(r.Err)
	}
	p := r.Dispatch.Placement
	if p.WorkerId != "w3" || p.WorkerIncarnation != 1 {
		t.Fatalf("placed on %s/%d, want the chosen w3/1", p.WorkerId, p.WorkerIncarnation)
	}
	if p.HolderId == "" || p.HolderId == "w3" {
		t.Fatalf("holder %q: h(r) is still Apply's, on another worker", p.HolderId)
	}
	views, _ := h.f.LoadViews()
	if v := views[2]; v.ID != "w3" || v.PendingRequests != 1 || v.PendingPages == 0 {
		t.Fatalf("w3's view after the dispatch: %+v: want it pending there", v)
	}
	// Idempotent: a retry (even naming another worker) returns the placement.
	if r := h.one(dispatchOn("r1", "w1", 1, 160)); r.Err != nil || r.Dispatch.Placement.WorkerId != "w3" {
		t.Fatalf("retried dispatch: %v %v", r.Dispatch, r.Err)
	}
	// Draining: refused (defect 13 of issue 21): its Generate refuses new
	// requests, so the placement would hold nothing that runs and the
	// drain would propose a migration of it every round.
	if r := h.one(setPhase("w2", 1, pb.WorkerPhase_WORKER_PHASE_DRAINING)); r.Err != nil {
		t.Fatal(r.Err)
	}
	h.one(markFailed("w1", 1))
	for _, c := range []struct {
		cmd  *pb.Command
		want []string
	}{
		{dispatchOn("r2", "w2", 1, 10), []string{"w2", "incarnation 1", "DRAINING", "FULL_SERVICE"}},
		{dispatchOn("r3", "w1", 1, 10), []string{"w1", "incarnation 1", "FAILED"}},
		{dispatchOn("r4", "w3", 2, 10), []string{"w3", "incarnation 2", "table has incarnation 1"}},
		{dispatchOn("r5", "w9", 1, 10), []string{"w9", "not in the table"}},
	} {
		r := h.one(c.cmd)
		if !errors.Is(r.Err, ErrWorkerUnavailable) {
			t.Fatalf("%v: err %v, want ErrWorkerUnavailable", c.cmd, r.Err)
		}
		for _, w := range c.want {
			if !strings.Contains(r.Err.Error(), w) {
				t.Errorf("error %q does not say %q", r.Err, w)
			}
		}
		if pl, _ := h.f.Placement(c.cmd.GetDispatch().RequestId); pl != nil {
			t.Fatalf("a refused dispatch left a placement: %v", pl)
		}
	}
	// A completed id is refused, chosen worker or not.
	h.one(complete("r1"))
	if r := h.one(dispatchOn("r1", "w3", 1, 10)); !errors.Is(r.Err, ErrCompleted) {
		t.Fatalf("dispatch of a completed id: %v", r.Err)
	}
}

// placer.View of every row of LoadTable equals the FSM's own view of the
// worker (the fields PickServing reads), on random logs.
func TestLoadTableMatchesViews(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	for trial := 0; trial < 20; trial++ {
		h := newHarness(t)
		var lastVer uint64
		var last, lastCopy *pb.LoadTable
		for step, entry := range randomLog(rng, 300) {
			h.apply(entry...)
			if step%7 != 0 {
				continue
			}
			table, ver := h.f.LoadTable()
			// The tables share the rows that did not change, and a new
			// table leaves the ones handed out before as they were.
			if last != nil {
				if !proto.Equal(last, lastCopy) {
					t.Fatalf("trial %d step %d: building a table changed the last one", trial, step)
				}
				for i, row := range table.Workers {
					if i < len(last.Workers) && row != last.Workers[i] && proto.Equal(row, last.Workers[i]) {
						t.Fatalf("trial %d step %d: row %d is unchanged but not shared", trial, step, i)
					}
				}
			}
			last, lastCopy = table, proto.Clone(table).(*pb.LoadTable)
			views, applied := h.f.LoadViews()
			if table.AppliedIndex != applied {
				t.Fatalf("trial %d step %d: table at %d, views at %d", trial, step, table.AppliedIndex, applied)
			}
			if len(table.Workers) != len(views) {
				t.Fatalf("trial %d step %d: %d rows, %d views", trial, step, len(table.Workers), len(views))
			}
			for i, row := range table.Workers {
				if got := placer.View(row); got != views[i] {
					t.Fatalf("trial %d step %d: row %d\n view(row) %+v\n fsm view  %+v", trial, step, i, got, views[i])
				}
				if w := h.f.Worker(row.WorkerId); w.Incarnation != row.Incarnation || w.Phase != row.Phase {
					t.Fatalf("trial %d step %d: row %s says %d/%s, table %d/%s", trial, step, row.WorkerId, row.Incarnation, row.Phase, w.Incarnation, w.Phase)
				}
			}
			if ver < lastVer {
				t.Fatalf("version went back from %d to %d", lastVer, ver)
			}
			lastVer = ver
			// Unchanged rows: same version, even at a later index.
			h.apply(noop())
			if t2, v2 := h.f.LoadTable(); v2 != ver || t2.AppliedIndex != h.index {
				t.Fatalf("a no-op changed the version (%d to %d) or the table is at %d, not %d", ver, v2, t2.AppliedIndex, h.index)
			}
		}
	}
}

// The completed ids are a ring of completedKept: past it the oldest are
// forgotten (a Dispatch of one places it anew), the rest refused; a
// snapshot keeps them oldest first, so a restored replica agrees.
func TestCompletedRing(t *testing.T) {
	h := newHarness(t)
	h.one(worker("w1", 1<<40))
	const total = 69_000 // in entries of 1,000
	first := total - completedKept
	for start := 0; start < total; start += 1000 {
		var cmds []*pb.Command
		var ids []string
		for i := start; i < start+1000; i++ {
			id := fmt.Sprintf("r%d", i)
			cmds = append(cmds, dispatch(id, 1, 1))
			ids = append(ids, id)
		}
		h.apply(append(cmds, complete(ids...))...)
	}
	data, err := h.f.MarshalSnapshot()
	if err != nil {
		t.Fatal(err)
	}
	var snap pb.Snapshot
	if err := proto.Unmarshal(data, &snap); err != nil {
		t.Fatal(err)
	}
	if len(snap.Completed) != completedKept || snap.Completed[0] != fmt.Sprintf("r%d", first) || snap.Completed[completedKept-1] != fmt.Sprintf("r%d", total-1) {
		t.Fatalf("snapshot keeps %d completed ids, %s..%s", len(snap.Completed), snap.Completed[0], snap.Completed[len(snap.Completed)-1])
	}
	g := New()
	if err := g.Restore(io.NopCloser(bytes.NewReader(data))); err != nil {
		t.Fatal(err)
	}
	h1, _, _ := h.f.StateHash()
	h2, _, _ := g.StateHash()
	if h1 != h2 {
		t.Fatal("the restored replica's state differs")
	}
	if r := h.one(dispatch(fmt.Sprintf("r%d", first-1), 1, 1)); r.Err != nil {
		t.Fatalf("a forgotten id: %v", r.Err)
	}
	if r := h.one(dispatch(fmt.Sprintf("r%d", first), 1, 1)); !errors.Is(r.Err, ErrCompleted) {
		t.Fatalf("a remembered id: %v", r.Err)
	}
}

// TestLoadTableSessions: the table names the live gateway sessions alone
// (a bench or jepsen client's session takes no share), the newest of each
// owner (a gateway that restarted under its name replaces its old session
// at once, not after its TTL), in the order of the owners' names, not the
// ids' (a gateway's share comes from its place among them); a change is a
// new version.
func TestLoadTableSessions(t *testing.T) {
	h := newHarness(t)
	gw := func(id, owner string) *pb.Command {
		c := createSession(id, 2*time.Second)
		c.GetCreateSession().Owner, c.GetCreateSession().Gateway = owner, true
		return c
	}
	h.one(worker("w1", 1<<30))
	_, v0 := h.f.LoadTable()
	h.one(gw("s9", "gw-a"))
	h.one(gw("s1", "gw-b"))
	h.one(createSession("s0", 2*time.Second)) // a client's, not a gateway's
	tab, v1 := h.f.LoadTable()
	if !slices.Equal(tab.Sessions, []string{"s9", "s1"}) || v1 == v0 {
		t.Fatalf("sessions %v at version %d (before: %d), want [s9 s1] (gw-a's, gw-b's) at a new version", tab.Sessions, v1, v0)
	}
	// gw-a restarts: its new session takes its place.
	h.one(gw("s5", "gw-a"))
	tab, v2 := h.f.LoadTable()
	if !slices.Equal(tab.Sessions, []string{"s5", "s1"}) || v2 == v1 {
		t.Fatalf("after gw-a restarted: sessions %v at version %d (before: %d), want [s5 s1]", tab.Sessions, v2, v1)
	}
	h.advance(1500 * time.Millisecond)
	h.one(renewSession("s5"))
	h.advance(1500 * time.Millisecond)
	h.one(noop()) // s9, s1 and s0 expire
	tab, v3 := h.f.LoadTable()
	if !slices.Equal(tab.Sessions, []string{"s5"}) || v3 == v2 {
		t.Fatalf("after gw-b expired: sessions %v at version %d (before: %d)", tab.Sessions, v3, v2)
	}
	if ss, _ := h.f.Session("s5"); !ss.Gateway {
		t.Fatalf("session row %v: not marked a gateway's", ss)
	}
}
