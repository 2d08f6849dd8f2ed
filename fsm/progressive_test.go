package fsm

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Progressive recovery: the phases a restarted worker walks and the drafter
// pairing.

const (
	loadingDraft = pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT
	assist       = pb.WorkerPhase_WORKER_PHASE_ASSIST
	hotswap      = pb.WorkerPhase_WORKER_PHASE_HOTSWAP
	fullService  = pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE
	draining     = pb.WorkerPhase_WORKER_PHASE_DRAINING
	failed       = pb.WorkerPhase_WORKER_PHASE_FAILED
	left         = pb.WorkerPhase_WORKER_PHASE_LEFT
)

// registerIn registers incarnation inc of id in phase.
func registerIn(id string, inc uint64, phase pb.WorkerPhase) *pb.Command {
	c := worker(id, 1<<30)
	c.GetRegisterWorker().Worker.Incarnation = inc
	c.GetRegisterWorker().Worker.Phase = phase
	return c
}

func setPhase(id string, inc uint64, phase pb.WorkerPhase) *pb.Command {
	return &pb.Command{Body: &pb.Command_SetPhase{SetPhase: &pb.SetPhaseCmd{WorkerId: id, Incarnation: inc, Phase: phase, Reason: "test"}}}
}

func leave(id string, inc uint64) *pb.Command {
	return &pb.Command{Body: &pb.Command_Leave{Leave: &pb.LeaveCmd{WorkerId: id, Incarnation: inc}}}
}

// describe is an event in a line, for comparing sequences.
func describe(ev *pb.Event) string {
	switch b := ev.Body.(type) {
	case *pb.Event_PhaseChanged:
		return fmt.Sprintf("phase %s %s>%s", b.PhaseChanged.WorkerId, phaseName(b.PhaseChanged.From), phaseName(b.PhaseChanged.To))
	case *pb.Event_Paired:
		p := b.Paired
		if p.Paired {
			return fmt.Sprintf("pair %s/%d>%s/%d", p.DrafterId, p.DrafterIncarnation, p.TargetId, p.TargetIncarnation)
		}
		return fmt.Sprintf("unpair %s/%d>%s/%d: %s", p.DrafterId, p.DrafterIncarnation, p.TargetId, p.TargetIncarnation, p.Reason)
	case *pb.Event_RecoveryPlan:
		return "plan " + b.RecoveryPlan.FailedWorker
	case *pb.Event_PlacementMoved:
		return fmt.Sprintf("move %s>%s", b.PlacementMoved.Placement.RequestId, b.PlacementMoved.Placement.WorkerId)
	case *pb.Event_Migration:
		m := b.Migration
		out := fmt.Sprintf("%s %s %s/%d>%s/%d", strings.TrimPrefix(m.Stage.String(), "STAGE_"), m.Placement.GetRequestId(),
			m.FromWorker, m.FromIncarnation, m.ToWorker, m.ToIncarnation)
		if m.Stage == pb.Migration_STAGE_ABORTED {
			out += ": " + m.Reason
		}
		return out
	}
	return fmt.Sprintf("%T", ev.Body)
}

// step applies one command and returns its result and the events of its
// entry, described.
func (h *harness) step(c *pb.Command) (Result, []string) {
	r := h.one(c)
	evs, _, err := h.f.Events().Since(h.index - 1)
	if err != nil {
		h.t.Fatal(err)
	}
	out := []string{}
	for _, ev := range evs {
		out = append(out, describe(ev))
	}
	return r, out
}

func (h *harness) expect(c *pb.Command, want ...string) Result {
	h.t.Helper()
	r, got := h.step(c)
	if r.Err != nil {
		h.t.Fatalf("%v: %v", c, r.Err)
	}
	if want == nil {
		want = []string{}
	}
	if !reflect.DeepEqual(got, want) {
		h.t.Fatalf("events:\n  %s\nwant:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
	checkPairing(h.t, h.f.st)
	return r
}

// partners returns each named worker's paired_worker.
func (h *harness) partners(ids ...string) map[string]string {
	out := map[string]string{}
	for _, id := range ids {
		out[id] = h.f.Worker(id).GetPairedWorker()
	}
	return out
}

func (h *harness) wantPartners(want map[string]string) {
	h.t.Helper()
	ids := make([]string, 0, len(want))
	for id := range want {
		ids = append(ids, id)
	}
	if got := h.partners(ids...); !reflect.DeepEqual(got, want) {
		h.t.Fatalf("paired workers %v, want %v", got, want)
	}
}

// checkPairing checks the pairing invariants: symmetric rows, drafters in
// ASSIST paired with FULL_SERVICE targets of the same table, and no drafter
// left waiting while a full-service worker has none.
func checkPairing(t testing.TB, s *state) {
	t.Helper()
	waiting, free := "", ""
	for _, id := range s.ids {
		w := s.workers[id]
		if w.PairedWorker == "" {
			switch w.Phase {
			case assist:
				waiting = id
			case fullService:
				free = id
			}
			continue
		}
		p := s.workers[w.PairedWorker]
		if p == nil || p.PairedWorker != id {
			t.Fatalf("%s is paired with %s, whose row says %v", id, w.PairedWorker, p)
		}
		if !(w.Phase == assist && p.Phase == fullService || w.Phase == fullService && p.Phase == assist) {
			t.Fatalf("%s (%s) paired with %s (%s)", id, phaseName(w.Phase), p.Id, phaseName(p.Phase))
		}
	}
	if waiting != "" && free != "" {
		t.Fatalf("drafter %s waits while %s has no drafter", waiting, free)
	}
}

// restart fails incarnation 1 of id and registers incarnation 2 in
// LOADING_DRAFT.
func (h *harness) restart(id string) {
	h.t.Helper()
	if r := h.one(markFailed(id, 1)); r.Err != nil {
		h.t.Fatal(r.Err)
	}
	r := h.expect(registerIn(id, 2, loadingDraft), fmt.Sprintf("phase %s FAILED>LOADING_DRAFT", id))
	if r.Worker.Phase != loadingDraft || r.Worker.Incarnation != 2 {
		h.t.Fatalf("restart registered %v", r.Worker)
	}
}

func TestProgressiveRecoveryWalk(t *testing.T) {
	h := newHarness(t)
	h.apply(worker("a", 1<<30), worker("b", 1<<30), worker("d", 1<<30))
	h.restart("d")
	// d reports load (it runs); a is the busiest, b the freest.
	h.apply(load("a", 1, 9, 500), load("b", 1, 1, 100), load("d", 2, 0, 0))
	for i := 0; i < 10; i++ {
		p := h.one(dispatch(fmt.Sprintf("r%d", i), 100, 28)).Dispatch.Placement
		if p.WorkerId == "d" || p.HolderId == "d" {
			t.Fatalf("LOADING_DRAFT worker serves or holds: %v", p)
		}
	}

	r := h.expect(setPhase("d", 2, assist), "phase d LOADING_DRAFT>ASSIST", "pair d/2>a/1")
	if r.Worker.PairedWorker != "a" || r.Worker.Phase != assist {
		t.Fatalf("SetPhase ASSIST answered %v, want the row paired with a", r.Worker)
	}
	h.wantPartners(map[string]string{"a": "d", "b": "", "d": "a"})
	evs, _, _ := h.f.Events().Since(h.index - 1)
	if p := evs[1].GetPaired(); !strings.Contains(p.Reason, "highest q_w") || !strings.Contains(p.Reason, "9.0 ms") {
		t.Fatalf("pairing reason %q", p.Reason)
	}
	for i := 10; i < 20; i++ {
		p := h.one(dispatch(fmt.Sprintf("r%d", i), 100, 28)).Dispatch.Placement
		if p.WorkerId == "d" || p.HolderId == "d" {
			t.Fatalf("ASSIST worker serves or holds: %v", p)
		}
	}
	// A retried SetPhase changes nothing.
	h.expect(setPhase("d", 2, assist))

	h.expect(setPhase("d", 2, hotswap), "phase d ASSIST>HOTSWAP", "unpair d/2>a/1: drafter d went HOTSWAP: test")
	h.wantPartners(map[string]string{"a": "", "d": ""})
	p := h.one(dispatch("r-hotswap", 100, 28)).Dispatch.Placement
	if p.WorkerId == "d" || p.HolderId == "d" {
		t.Fatalf("HOTSWAP worker serves or holds: %v", p)
	}

	h.expect(setPhase("d", 2, fullService), "phase d HOTSWAP>FULL_SERVICE")
	if !h.f.st.view("d").Eligible {
		t.Fatal("d in FULL_SERVICE is not eligible")
	}
	// Now d is the freest: it serves.
	h.apply(load("a", 1, 9, 900), load("b", 1, 1, 900))
	if p := h.one(dispatch("r-full", 100, 28)).Dispatch.Placement; p.WorkerId != "d" {
		t.Fatalf("d in FULL_SERVICE did not get the request: %v", p)
	}
}

func TestPhaseOnlyForward(t *testing.T) {
	cases := []struct {
		walk  []pb.WorkerPhase // from LOADING_DRAFT
		to    pb.WorkerPhase
		names []string // in the refusal; nil: allowed
	}{
		{[]pb.WorkerPhase{assist}, loadingDraft, []string{"ASSIST", "LOADING_DRAFT"}},
		{[]pb.WorkerPhase{hotswap}, assist, []string{"HOTSWAP", "ASSIST"}},
		{[]pb.WorkerPhase{assist, hotswap}, loadingDraft, []string{"HOTSWAP", "LOADING_DRAFT"}},
		{[]pb.WorkerPhase{fullService}, hotswap, []string{"FULL_SERVICE", "HOTSWAP"}},
		{[]pb.WorkerPhase{assist, fullService}, assist, []string{"FULL_SERVICE", "ASSIST"}},
		{[]pb.WorkerPhase{draining}, assist, []string{"DRAINING", "ASSIST"}},
		{nil, fullService, nil},
		{nil, hotswap, nil},
		{[]pb.WorkerPhase{assist}, fullService, nil},
		{[]pb.WorkerPhase{assist}, draining, nil},
		{[]pb.WorkerPhase{hotswap}, failed, nil},
		{[]pb.WorkerPhase{assist}, left, nil},
		{[]pb.WorkerPhase{draining}, fullService, nil},
	}
	for _, c := range cases {
		h := newHarness(t)
		h.one(worker("a", 1<<30))
		h.one(registerIn("d", 1, loadingDraft))
		for _, p := range c.walk {
			if r := h.one(setPhase("d", 1, p)); r.Err != nil {
				t.Fatalf("walk %v: %v", c.walk, r.Err)
			}
		}
		before := h.f.Worker("d")
		r, evs := h.step(setPhase("d", 1, c.to))
		if c.names == nil {
			if r.Err != nil || h.f.Worker("d").Phase != c.to {
				t.Errorf("%v then %s: %v, row %v", c.walk, phaseName(c.to), r.Err, h.f.Worker("d"))
			}
			continue
		}
		if !errors.Is(r.Err, ErrInvalid) {
			t.Errorf("%v then %s: %v, want ErrInvalid", c.walk, phaseName(c.to), r.Err)
			continue
		}
		for _, n := range c.names {
			if !strings.Contains(r.Err.Error(), n) {
				t.Errorf("%v then %s: %q does not name %s", c.walk, phaseName(c.to), r.Err, n)
			}
		}
		if h.f.Worker("d") != before || len(evs) != 0 {
			t.Errorf("%v then %s: refused, yet the row changed to %v, events %v", c.walk, phaseName(c.to), h.f.Worker("d"), evs)
		}
	}
}

func TestRegisterPhase(t *testing.T) {
	h := newHarness(t)
	for _, p := range []pb.WorkerPhase{pb.WorkerPhase_WORKER_PHASE_JOINING, assist, hotswap, draining, failed, left} {
		r := h.one(registerIn("x", 1, p))
		if !errors.Is(r.Err, ErrInvalid) || !strings.Contains(r.Err.Error(), phaseName(p)) {
			t.Fatalf("registration in %s: %v, want ErrInvalid naming it", phaseName(p), r.Err)
		}
		if h.f.Worker("x") != nil {
			t.Fatalf("registration in %s refused, yet stored %v", phaseName(p), h.f.Worker("x"))
		}
	}
	// A LOADING_DRAFT worker is neither dispatched to nor a holder.
	r := h.one(registerIn("d", 1, loadingDraft))
	if r.Err != nil || r.Worker.Phase != loadingDraft {
		t.Fatalf("registration in LOADING_DRAFT: %+v", r)
	}
	if r := h.one(dispatch("r0", 10, 10)); !errors.Is(r.Err, ErrNoWorker) {
		t.Fatalf("dispatch with only a LOADING_DRAFT worker: %v", r.Err)
	}
	h.one(worker("a", 1<<30))
	h.apply(load("a", 1, 0, 900), load("d", 1, 0, 0))
	r = h.one(dispatch("r1", 10, 10))
	if p := r.Dispatch.Placement; p.WorkerId != "a" || p.HolderId != "" || r.Dispatch.NoHolderReason == "" {
		t.Fatalf("dispatch beside a LOADING_DRAFT worker: %+v", r.Dispatch)
	}
	// UNSPECIFIED is FULL_SERVICE; a paired_worker in a registration is
	// ignored (pairing is the controller's).
	c := registerIn("u", 1, pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED)
	c.GetRegisterWorker().Worker.PairedWorker = "a"
	if r := h.one(c); r.Err != nil || r.Worker.Phase != fullService || r.Worker.PairedWorker != "" {
		t.Fatalf("registration without a phase: %+v", r)
	}
}

// Neither recovery plans nor orphans go to a worker in a recovery phase, and
// the requests an incarnation left when nothing could take them are planned
// once something can, the restarted worker included.
func TestRecoveringWorkerNotATarget(t *testing.T) {
	h := newHarness(t)
	h.apply(worker("a", 1<<30), worker("b", 1<<30), registerIn("d", 1, loadingDraft))
	h.apply(load("a", 1, 0, 0), load("b", 1, 5, 900), load("d", 1, 0, 0))
	for i := 0; i < 6; i++ {
		h.one(dispatch(fmt.Sprintf("r%d", i), 100, 28))
	}
	h.one(setPhase("d", 1, assist))
	h.one(markFailed("a", 1))
	recs := h.f.Recoveries()
	if len(recs) != 1 || len(recs[0].Assignments) != 6 {
		t.Fatalf("recoveries %v", recs)
	}
	for _, a := range recs[0].Assignments {
		if a.TargetWorker != "b" || a.NewHolder == "d" {
			t.Fatalf("assignment %v", a)
		}
	}
	// b fails too: nothing eligible, the requests wait on b, then go to d
	// when it reaches FULL_SERVICE.
	h.one(markFailed("b", 1))
	if p, _ := h.f.Placement("r0"); p.WorkerId != "b" || p.State != pb.PlacementState_PLACEMENT_STATE_RECOVERING {
		t.Fatalf("orphan %v", p)
	}
	h.one(setPhase("d", 1, hotswap))
	if p, _ := h.f.Placement("r0"); p.WorkerId != "b" {
		t.Fatalf("orphan planned onto a HOTSWAP worker: %v", p)
	}
	h.one(setPhase("d", 1, fullService))
	if p, _ := h.f.Placement("r0"); p.WorkerId != "d" || p.Epoch != 2 {
		t.Fatalf("orphan not planned onto d in FULL_SERVICE: %v", p)
	}
}

// A worker alone in the cluster fails with requests and restarts in
// LOADING_DRAFT: its old incarnation's requests wait, RECOVERING, until a
// worker is eligible: another one joining, or itself in FULL_SERVICE.
func TestLeftoverOfRestartedWorker(t *testing.T) {
	for _, joiner := range []bool{true, false} {
		h := newHarness(t)
		h.one(worker("x", 1<<30))
		h.one(dispatch("r", 10, 10))
		h.one(markFailed("x", 1))
		h.one(registerIn("x", 2, loadingDraft))
		if p, _ := h.f.Placement("r"); p.WorkerId != "x" || p.WorkerIncarnation != 1 || p.State != pb.PlacementState_PLACEMENT_STATE_RECOVERING {
			t.Fatalf("leftover %v", p)
		}
		h.one(setPhase("x", 2, assist))
		if joiner {
			h.one(worker("y", 1<<30))
			p, _ := h.f.Placement("r")
			if p.WorkerId != "y" || p.Epoch != 1 {
				t.Fatalf("leftover not planned onto the worker that joined: %v", p)
			}
			if got := h.f.Recoveries()[0]; got.FailedWorker != "x" || got.FailedIncarnation != 1 {
				t.Fatalf("plan %v", got)
			}
			// and x, the drafter, is paired with y
			h.wantPartners(map[string]string{"x": "y", "y": "x"})
			continue
		}
		h.one(setPhase("x", 2, fullService))
		p, _ := h.f.Placement("r")
		if p.WorkerId != "x" || p.WorkerIncarnation != 2 || p.Epoch != 1 {
			t.Fatalf("leftover not planned when x reached FULL_SERVICE: %v", p)
		}
	}
}

// pairingCluster has a (q_w 1), b (9), c (5) in full service and drafters d1,
// d2 restarted in LOADING_DRAFT.
func pairingCluster(t *testing.T) *harness {
	h := newHarness(t)
	h.apply(worker("a", 1<<30), worker("b", 1<<30), worker("c", 1<<30), worker("d1", 1<<30), worker("d2", 1<<30))
	h.restart("d1")
	h.restart("d2")
	h.apply(load("a", 1, 1, 0), load("b", 1, 9, 0), load("c", 1, 5, 0))
	return h
}

func TestPairingHighestQueueWaitOneToOne(t *testing.T) {
	h := pairingCluster(t)
	h.expect(setPhase("d1", 2, assist), "phase d1 LOADING_DRAFT>ASSIST", "pair d1/2>b/1")
	h.expect(setPhase("d2", 2, assist), "phase d2 LOADING_DRAFT>ASSIST", "pair d2/2>c/1")
	h.wantPartners(map[string]string{"a": "", "b": "d1", "c": "d2", "d1": "b", "d2": "c"})
	// Load changes do not move a pairing.
	h.one(load("a", 1, 50, 0))
	h.wantPartners(map[string]string{"a": "", "b": "d1", "c": "d2"})

	// Each command pairs as it applies: of two in one entry, the first
	// takes the busiest worker.
	h = pairingCluster(t)
	h.apply(setPhase("d2", 2, assist), setPhase("d1", 2, assist))
	h.wantPartners(map[string]string{"a": "", "b": "d2", "c": "d1", "d1": "c", "d2": "b"})
	checkPairing(t, h.f.st)
}

// Drafters that wait for a target take one in id order.
func TestPairingDraftersInIDOrder(t *testing.T) {
	h := newHarness(t)
	h.apply(worker("d1", 1<<30), worker("d2", 1<<30))
	h.restart("d1")
	h.restart("d2")
	h.expect(setPhase("d2", 2, assist), "phase d2 LOADING_DRAFT>ASSIST")
	h.expect(setPhase("d1", 2, assist), "phase d1 LOADING_DRAFT>ASSIST")
	h.expect(worker("e", 1<<30), "phase e UNSPECIFIED>FULL_SERVICE", "pair d1/2>e/1")
	h.expect(worker("f", 1<<30), "phase f UNSPECIFIED>FULL_SERVICE", "pair d2/2>f/1")
}

func TestPairingWaitsForATarget(t *testing.T) {
	h := newHarness(t)
	h.apply(worker("a", 1<<30), worker("d1", 1<<30), worker("d2", 1<<30))
	h.restart("d1")
	h.restart("d2")
	h.expect(setPhase("d1", 2, assist), "phase d1 LOADING_DRAFT>ASSIST", "pair d1/2>a/1")
	h.expect(setPhase("d2", 2, assist), "phase d2 LOADING_DRAFT>ASSIST")
	// A worker entering FULL_SERVICE (here: registering) takes the drafter
	// that waits.
	h.expect(worker("e", 1<<30), "phase e UNSPECIFIED>FULL_SERVICE", "pair d2/2>e/1")
	h.wantPartners(map[string]string{"a": "d1", "d1": "a", "d2": "e", "e": "d2"})
}

func TestPairingPartnerFails(t *testing.T) {
	h := pairingCluster(t)
	h.apply(setPhase("d1", 2, assist), setPhase("d2", 2, assist)) // d1-b, d2-c
	// b fails: d1 pairs again, with a, the only one left without a drafter.
	h.expect(markFailed("b", 1), "phase b FULL_SERVICE>FAILED", "unpair d1/2>b/1: target b went FAILED: marked failed", "pair d1/2>a/1")
	h.wantPartners(map[string]string{"a": "d1", "b": "", "c": "d2", "d1": "a", "d2": "c"})
	// c drains: nothing is left for d2.
	h.expect(setPhase("c", 1, draining), "phase c FULL_SERVICE>DRAINING", "unpair d2/2>c/1: target c went DRAINING: test")
	h.wantPartners(map[string]string{"c": "", "d2": ""})
	// a leaves: d1 waits too.
	h.expect(leave("a", 1), "phase a FULL_SERVICE>FAILED", "unpair d1/2>a/1: target a went FAILED: left", "phase a FAILED>LEFT")
	h.wantPartners(map[string]string{"a": "", "d1": ""})
	// c back in service: d1 first.
	h.expect(setPhase("c", 1, fullService), "phase c DRAINING>FULL_SERVICE", "pair d1/2>c/1")
}

func TestPairingDrafterEnds(t *testing.T) {
	h := newHarness(t)
	h.apply(worker("b", 1<<30), worker("d1", 1<<30), worker("d2", 1<<30))
	h.restart("d1")
	h.restart("d2")
	h.apply(setPhase("d1", 2, assist), setPhase("d2", 2, assist)) // d1-b, d2 waits
	h.wantPartners(map[string]string{"b": "d1", "d1": "b", "d2": ""})
	// The drafter fails: its target is free, and the drafter that waited
	// takes it.
	h.expect(markFailed("d1", 2), "phase d1 ASSIST>FAILED", "unpair d1/2>b/1: drafter d1 went FAILED: marked failed", "pair d2/2>b/1")
	h.wantPartners(map[string]string{"b": "d2", "d1": "", "d2": "b"})
	// The drafter restarts again (a new incarnation): the old one is gone,
	// and so is its pairing.
	h.expect(registerIn("d2", 3, loadingDraft),
		"phase d2 ASSIST>FAILED", "unpair d2/2>b/1: drafter d2 went FAILED: restarted with a new incarnation", "phase d2 FAILED>LOADING_DRAFT")
	h.wantPartners(map[string]string{"b": "", "d2": ""})
	// Straight to FULL_SERVICE from ASSIST ends the pairing too.
	h.apply(setPhase("d2", 3, assist))
	h.wantPartners(map[string]string{"b": "d2", "d2": "b"})
	r := h.expect(setPhase("d2", 3, fullService), "phase d2 ASSIST>FULL_SERVICE", "unpair d2/3>b/1: drafter d2 went FULL_SERVICE: test")
	if r.Worker.PairedWorker != "" {
		t.Fatalf("SetPhase answered %v", r.Worker)
	}
	h.wantPartners(map[string]string{"b": "", "d2": ""})
}

func TestPairingSnapshotRoundTrip(t *testing.T) {
	h := pairingCluster(t)
	h.apply(setPhase("d1", 2, assist), setPhase("d2", 2, assist))
	var s sink
	snap, _ := h.f.Snapshot()
	if err := snap.Persist(&s); err != nil {
		t.Fatal(err)
	}
	restored := newHarness(t)
	restored.index, restored.stamp = h.index, h.stamp
	if err := restored.f.Restore(io.NopCloser(bytes.NewReader(s.Bytes()))); err != nil {
		t.Fatal(err)
	}
	restored.wantPartners(map[string]string{"a": "", "b": "d1", "c": "d2", "d1": "b", "d2": "c"})
	// Both go on identically: b fails, d1 re-pairs with a.
	for _, x := range []*harness{h, restored} {
		x.expect(markFailed("b", 1), "phase b FULL_SERVICE>FAILED", "unpair d1/2>b/1: target b went FAILED: marked failed", "pair d1/2>a/1")
	}
	s1, _ := h.f.MarshalSnapshot()
	s2, _ := restored.f.MarshalSnapshot()
	if !bytes.Equal(s1, s2) {
		t.Fatal("snapshots differ after the same entries")
	}
	w1, w2 := h.f.Worker("d1"), restored.f.Worker("d1")
	if !proto.Equal(w1, w2) || w1.PairedWorker != "a" {
		t.Fatalf("d1: %v vs %v", w1, w2)
	}
}
