package fsm

import (
	"bytes"
	"errors"
	"io"
	"reflect"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
)

// advance moves the harness's clock d ahead: the next command is stamped
// after it.
func (h *harness) advance(d time.Duration) { h.stamp += int64(d) }

func reserved(f *FSM) uint64 {
	var sum uint64
	for _, u := range f.HolderUsage() {
		sum += u[0]
	}
	return sum
}

// TestSessionExpiryCompletesPlacements: a session that is not renewed within
// its TTL expires at the first command stamped past its deadline; its
// placements are completed and their holders' reservations freed, and
// renewing or dispatching in it is refused. A placement of no session stays.
func TestSessionExpiryCompletesPlacements(t *testing.T) {
	h := newHarness(t)
	for _, id := range []string{"w1", "w2", "w3"} {
		h.one(worker(id, 1<<30))
	}
	if r := h.one(createSession("gw", 2*time.Second)); r.Err != nil || r.Session.RenewedUnixNano != h.stamp {
		t.Fatalf("create: %+v", r)
	}
	for _, id := range []string{"a", "b", "c"} {
		if r := h.one(dispatchIn("gw", id, 100, 100)); r.Err != nil || r.Dispatch.Placement.HolderId == "" {
			t.Fatalf("dispatch %s: %+v", id, r)
		}
	}
	if r := h.one(dispatch("loose", 100, 100)); r.Err != nil {
		t.Fatal(r.Err)
	}
	looseBytes := reserved(h.f) / 4
	if _, reqs := h.f.Session("gw"); !reflect.DeepEqual(reqs, []string{"a", "b", "c"}) {
		t.Fatalf("session holds %v", reqs)
	}

	// Renewed in time: it lives past its first deadline.
	h.advance(1500 * time.Millisecond)
	if r := h.one(renewSession("gw")); r.Err != nil {
		t.Fatal(r.Err)
	}
	h.advance(1500 * time.Millisecond)
	h.one(noop())
	if ss, _ := h.f.Session("gw"); ss == nil {
		t.Fatal("a renewed session expired")
	}

	// Not renewed: the first command stamped past the deadline ends it.
	h.advance(2 * time.Second)
	h.one(noop())
	if ss, reqs := h.f.Session("gw"); ss != nil || reqs != nil {
		t.Fatalf("session survives its deadline: %v %v", ss, reqs)
	}
	for _, id := range []string{"a", "b", "c"} {
		if p, _ := h.f.Placement(id); p != nil {
			t.Fatalf("placement %s survives its session: %v", id, p)
		}
	}
	if p, _ := h.f.Placement("loose"); p == nil {
		t.Fatal("a placement of no session was completed")
	}
	if got := reserved(h.f); got != looseBytes {
		t.Fatalf("%d bytes reserved after expiry, want %d (the loose placement's)", got, looseBytes)
	}
	if r := h.one(renewSession("gw")); !errors.Is(r.Err, ErrSessionExpired) {
		t.Fatalf("renewing an expired session: %v", r.Err)
	}
	if r := h.one(dispatchIn("gw", "d", 1, 1)); !errors.Is(r.Err, ErrSessionExpired) {
		t.Fatalf("dispatching in an expired session: %v", r.Err)
	}
	if r := h.one(dispatchIn("nope", "d", 1, 1)); !errors.Is(r.Err, ErrSessionExpired) {
		t.Fatalf("dispatching in an unknown session: %v", r.Err)
	}
	// A Complete flushed late by the gateway finds them already completed.
	if r := h.one(complete("a")); len(r.Complete.AlreadyCompleted) != 1 {
		t.Fatalf("late complete: %v", r.Complete)
	}

	// Destroy completes at once, and is idempotent.
	h.one(createSession("gw2", time.Minute))
	h.one(dispatchIn("gw2", "e", 10, 10))
	if r := h.one(destroySession("gw2")); !r.Destroyed.Destroyed || r.Destroyed.Completed != 1 {
		t.Fatalf("destroy: %v", r.Destroyed)
	}
	if r := h.one(destroySession("gw2")); r.Destroyed.Destroyed {
		t.Fatalf("second destroy: %v", r.Destroyed)
	}
	if p, _ := h.f.Placement("e"); p != nil {
		t.Fatalf("placement of a destroyed session: %v", p)
	}
	if got := reserved(h.f); got != looseBytes {
		t.Fatalf("%d bytes reserved after destroy, want %d", got, looseBytes)
	}
	// TTLs out of bounds are refused.
	for _, ttl := range []time.Duration{0, time.Millisecond, 2 * time.Hour} {
		if r := h.one(createSession("bad", ttl)); !errors.Is(r.Err, ErrInvalid) {
			t.Fatalf("ttl %s: %v", ttl, r.Err)
		}
	}
}

// TestSessionsSnapshotRoundTrip: the sessions table (rows and which
// placements belong to which session) survives Persist and Restore, and the
// restored replica expires the same sessions at the same command.
func TestSessionsSnapshotRoundTrip(t *testing.T) {
	h := newHarness(t)
	h.one(worker("w1", 1<<30))
	h.one(worker("w2", 1<<30))
	h.one(createSession("short", time.Second))
	h.one(createSession("long", time.Hour))
	h.one(createSession("empty", time.Second))
	h.apply(dispatchIn("short", "s1", 10, 10), dispatchIn("short", "s2", 10, 10), dispatchIn("long", "l1", 10, 10), dispatch("none", 10, 10))

	snap, err := h.f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	var s sink
	if err := snap.Persist(&s); err != nil {
		t.Fatal(err)
	}
	restored := newHarness(t)
	restored.index, restored.stamp = h.index, h.stamp
	if err := restored.f.Restore(io.NopCloser(bytes.NewReader(s.Bytes()))); err != nil {
		t.Fatal(err)
	}
	compareSessions(t, h.f, restored.f)
	if restored.f.NextSessionExpiry() != h.f.NextSessionExpiry() {
		t.Fatalf("next expiry %d vs %d", restored.f.NextSessionExpiry(), h.f.NextSessionExpiry())
	}
	checkSessions(t, restored.f.st)

	h.advance(2 * time.Second)
	restored.advance(2 * time.Second)
	h.one(noop())
	restored.one(noop())
	for _, f := range []*FSM{h.f, restored.f} {
		if ss, _ := f.Session("short"); ss != nil {
			t.Fatal("short session did not expire")
		}
		if p, _ := f.Placement("s1"); p != nil {
			t.Fatal("s1 survived its session")
		}
		if p, _ := f.Placement("l1"); p == nil {
			t.Fatal("l1 was completed with the wrong session")
		}
	}
	s1, _ := h.f.MarshalSnapshot()
	s2, _ := restored.f.MarshalSnapshot()
	if !bytes.Equal(s1, s2) {
		t.Fatal("snapshots differ after the same expiry")
	}
}

// compareSessions requires two FSMs to hold the same sessions table.
func compareSessions(t *testing.T, a, b *FSM) {
	t.Helper()
	if a.Sessions() != b.Sessions() {
		t.Fatalf("%d vs %d sessions", a.Sessions(), b.Sessions())
	}
	a.mu.RLock()
	ids := sortedKeys(func() map[string]struct{} {
		m := map[string]struct{}{}
		for id := range a.st.sessions {
			m[id] = struct{}{}
		}
		return m
	}())
	a.mu.RUnlock()
	for _, id := range ids {
		s1, r1 := a.Session(id)
		s2, r2 := b.Session(id)
		if !proto.Equal(s1, s2) || !reflect.DeepEqual(r1, r2) {
			t.Fatalf("session %s: %v %v vs %v %v", id, s1, r1, s2, r2)
		}
	}
	// The gateway list (the shares) is derived from the rows: the same.
	ta, _ := a.LoadTable()
	tb, _ := b.LoadTable()
	if !reflect.DeepEqual(ta.Sessions, tb.Sessions) {
		t.Fatalf("gateway sessions %v vs %v", ta.Sessions, tb.Sessions)
	}
}

// TestObserveApply: every applied command is timed under its type's name.
func TestObserveApply(t *testing.T) {
	h := newHarness(t)
	var got []string
	h.f.ObserveApply(func(command string, d time.Duration) {
		if d < 0 {
			t.Errorf("%s took %s", command, d)
		}
		got = append(got, command)
	})
	h.apply(worker("w1", 1<<20), worker("w2", 1<<20), createSession("s", time.Second))
	h.apply(dispatchIn("s", "r", 1, 1), markFailed("w1", 1), noop())
	want := []string{"register_worker", "register_worker", "create_session", "dispatch", "mark_failed", "noop"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("observed %v, want %v", got, want)
	}
}

// TestNewLeaderRenewsSessions: a new leader's first command (a no-op with
// renew_sessions) renews every session before expiry is checked, so an
// outage without a leader that outlasts the TTL does not end every gateway's
// session; the sessions then expire normally if nobody renews them.
func TestNewLeaderRenewsSessions(t *testing.T) {
	h := newHarness(t)
	h.one(worker("w1", 1<<30))
	h.one(worker("w2", 1<<30))
	h.one(createSession("gw", time.Second))
	h.one(dispatchIn("gw", "r", 10, 10))
	h.advance(5 * time.Second) // no leader for five TTLs
	ready := noop()
	ready.GetNoop().RenewSessions = true
	h.one(ready)
	ss, reqs := h.f.Session("gw")
	if ss == nil || len(reqs) != 1 || ss.RenewedUnixNano != h.stamp {
		t.Fatalf("after a new leader: %v %v", ss, reqs)
	}
	h.advance(2 * time.Second)
	h.one(noop())
	if ss, _ := h.f.Session("gw"); ss != nil {
		t.Fatal("an unrenewed session outlived its TTL after the renewal")
	}
}

// TestElectionsDoNotKeepDeadSessions (issue 21, defect 11): a new leader
// forgives the sessions the time no leader stamped, not what elapsed under
// the leaders before it, so a dead gateway's session expires after its TTL
// of stamped time even when the leader changes more often than once per
// TTL (a full renewal on each election kept it forever), while the live
// gateway's, renewed each term, stays.
func TestElectionsDoNotKeepDeadSessions(t *testing.T) {
	h := newHarness(t)
	h.one(worker("w1", 1<<30))
	h.one(createSession("dead", 2*time.Second))
	h.one(createSession("live", 2*time.Second))
	h.one(dispatchIn("dead", "r", 10, 10))
	for term := 0; term < 10; term++ {
		// A term of 800 ms (less than half the TTL), then 3 s with no leader
		// (more than the TTL) and a new one whose clock is ahead.
		h.advance(800 * time.Millisecond)
		h.one(renewSession("live"))
		h.advance(3 * time.Second)
		h.one(NewLeaderCmd())
		if ss, _ := h.f.Session("live"); ss == nil {
			t.Fatalf("term %d: the live gateway's session expired across an election", term)
		}
		if ss, _ := h.f.Session("dead"); ss == nil {
			if term < 2 {
				t.Fatalf("term %d: the dead session expired after %d ms of stamped time, under its TTL", term, 800*(term+1))
			}
			if p, _ := h.f.Placement("r"); p != nil {
				t.Fatal("the dead session's placement outlived it")
			}
			return
		}
	}
	t.Fatal("ten elections, 8 s of stamped time: the dead gateway's session is still alive (TTL 2 s)")
}

// StampAge says how old the last stamp is and what runs a clock on the
// stamps (the shortest session TTL, a migration), for the leader's
// keep-stamping no-op.
func TestStampAge(t *testing.T) {
	h := newHarness(t)
	h.one(worker("w1", 1<<30))
	if _, ttl, migrating := h.f.StampAge(h.stamp); ttl != 0 || migrating {
		t.Fatalf("ttl %d migrating %v with no session and no migration", ttl, migrating)
	}
	h.one(createSession("gw", 3*time.Second))
	h.one(createSession("gw2", time.Second))
	if age, ttl, migrating := h.f.StampAge(h.stamp + int64(time.Second)); age != int64(time.Second) || ttl != int64(time.Second) || migrating {
		t.Fatalf("age %d ttl %d migrating %v, want 1 s, 1 s (the shorter TTL) and false", age, ttl, migrating)
	}
}
