package controller

import (
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// reservedBytes is the checkpoint footprint the leader's table reserves on
// all workers.
func reservedBytes(t *testing.T, c *cluster) uint64 {
	t.Helper()
	resp, err := c.client(c.anyNode()).ListWorkers(ctxT(t, 5*time.Second), &pb.ListWorkersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var sum uint64
	for _, r := range resp.Reservations {
		sum += r.ReservedBytes
	}
	return sum
}

// TestSessionExpiryFreesPlacements: a gateway's session that stops being
// renewed (the gateway died) expires on its own — the leader commits a no-op
// past the deadline, nothing else is written — and its placements are gone
// and their holders' reservations freed on every replica. Renewing or
// dispatching in it afterwards is refused with the SESSION_EXPIRED reason.
func TestSessionExpiryFreesPlacements(t *testing.T) {
	c := newCluster(t, 3, nil)
	c.addWorker("w1", 1, 1<<30)
	c.addWorker("w2", 1, 1<<30)
	f := c.follower()

	sess, err := c.client(f).CreateSession(ctxT(t, 5*time.Second), &pb.CreateSessionRequest{Owner: "gw-test", TtlMs: 1000})
	if err != nil {
		t.Fatal(err)
	}
	id := sess.Session.Id
	for i, n := range c.nodes {
		if _, err := c.client(n).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{
			RequestId: fmt.Sprintf("s%d", i), PromptTokens: 100, MaxTokens: 100, SessionId: id}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.client(f).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "loose", PromptTokens: 100, MaxTokens: 100}); err != nil {
		t.Fatal(err)
	}
	all := reservedBytes(t, c)
	if all == 0 {
		t.Fatal("no reservations: the test would check nothing")
	}
	// A renewal through any replica moves the deadline.
	r, err := c.client(c.nodes[2]).RenewSession(ctxT(t, 5*time.Second), &pb.RenewSessionRequest{SessionId: id})
	if err != nil || r.Session.RenewedUnixNano <= sess.Session.RenewedUnixNano {
		t.Fatalf("renew: %v %v", r, err)
	}

	// The gateway stops renewing.
	waitFor(t, 10*time.Second, "the session to expire on every replica", func() bool {
		for _, n := range c.nodes {
			if ss, _ := n.FSM().Session(id); ss != nil {
				return false
			}
		}
		return true
	})
	for _, n := range c.nodes {
		for i := range c.nodes {
			if p, _ := n.FSM().Placement(fmt.Sprintf("s%d", i)); p != nil {
				t.Fatalf("%s: placement s%d survives its session", n.ID(), i)
			}
		}
		if p, _ := n.FSM().Placement("loose"); p == nil {
			t.Fatalf("%s: the placement of no session was completed", n.ID())
		}
	}
	if got := reservedBytes(t, c); got != all/4 {
		t.Fatalf("%d bytes reserved after expiry, want %d (the loose placement's)", got, all/4)
	}

	_, err = c.client(f).RenewSession(ctxT(t, 5*time.Second), &pb.RenewSessionRequest{SessionId: id})
	if status.Code(err) != codes.FailedPrecondition || ctlclient.Reason(err) != ctlclient.ReasonSessionExpired {
		t.Fatalf("renewing an expired session: %v (reason %q)", err, ctlclient.Reason(err))
	}
	_, err = c.client(f).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "late", PromptTokens: 1, MaxTokens: 1, SessionId: id})
	if ctlclient.Reason(err) != ctlclient.ReasonSessionExpired {
		t.Fatalf("dispatching in an expired session: %v", err)
	}

	if st, err := pb.NewOperatorClient(c.conn(f)).ClusterStatus(ctxT(t, 5*time.Second), &pb.ClusterStatusRequest{}); err != nil || st.Sessions != 0 {
		t.Fatalf("cluster status after expiry: %v %v", st, err)
	}
	// Destroy ends a session at once.
	s2, err := c.client(f).CreateSession(ctxT(t, 5*time.Second), &pb.CreateSessionRequest{Owner: "gw-2", TtlMs: 60000})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.client(f).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "d", PromptTokens: 1, MaxTokens: 1, SessionId: s2.Session.Id}); err != nil {
		t.Fatal(err)
	}
	d, err := c.client(f).DestroySession(ctxT(t, 5*time.Second), &pb.DestroySessionRequest{SessionId: s2.Session.Id})
	if err != nil || !d.Destroyed || d.Completed != 1 {
		t.Fatalf("destroy: %v %v", d, err)
	}
}

func TestSessionBadInput(t *testing.T) {
	c := newCluster(t, 1, nil)
	cl := c.client(c.nodes[0])
	for name, req := range map[string]*pb.CreateSessionRequest{
		"no owner":  {TtlMs: 10000},
		"short ttl": {Owner: "g", TtlMs: 10},
		"long ttl":  {Owner: "g", TtlMs: 5 * 3600 * 1000},
		"bad owner": {Owner: "a b", TtlMs: 10000},
	} {
		if _, err := cl.CreateSession(ctxT(t, time.Second), req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: %v", name, err)
		}
	}
	if _, err := cl.RenewSession(ctxT(t, time.Second), &pb.RenewSessionRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("renew without id: %v", err)
	}
	if _, err := cl.Dispatch(ctxT(t, time.Second), &pb.DispatchRequest{RequestId: "r", PromptTokens: 1, MaxTokens: 1, SessionId: "a\x01"}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("dispatch with a bad session id: %v", err)
	}
}

// TestSessionSurvivesLeaderlessOutage: while there is no leader no gateway
// can renew; the next leader's first command renews every session, so an
// outage longer than the TTL does not end them all at once.
func TestSessionSurvivesLeaderlessOutage(t *testing.T) {
	c := newCluster(t, 1, nil)
	sess, err := c.client(c.nodes[0]).CreateSession(ctxT(t, 5*time.Second), &pb.CreateSessionRequest{Owner: "gw", TtlMs: 1000})
	if err != nil {
		t.Fatal(err)
	}
	c.stop(0)
	deadline := time.Unix(0, sess.Session.RenewedUnixNano+sess.Session.TtlNanos)
	waitFor(t, 10*time.Second, "the session's deadline to pass while there is no leader", func() bool {
		return time.Now().After(deadline.Add(200 * time.Millisecond))
	})
	c.restart(0)
	leader := c.waitLeader()
	ss, _ := leader.FSM().Session(sess.Session.Id)
	if ss == nil {
		t.Fatal("the new leader's first command expired the session: nobody could have renewed it")
	}
	if ss.RenewedUnixNano <= deadline.UnixNano() {
		t.Fatalf("session not renewed by the new leader: %v", ss)
	}
}

// TestElectionsExpireDeadSession (issue 21, defect 11): a session nobody
// renews (a dead gateway's) expires even when the leader changes more often
// than once per TTL. Each new leader's first command used to renew every
// session in full, and a 900-ms term never reached the 1-s deadline; now a
// new leader forgives only the time from the last stamp to its own, and the
// leader stamps at least every stampLimit (half the TTL here: 500 ms) while a session exists, so
// each term counts.
func TestElectionsExpireDeadSession(t *testing.T) {
	c := newCluster(t, 1, nil)
	sess, err := c.client(c.nodes[0]).CreateSession(ctxT(t, 5*time.Second), &pb.CreateSessionRequest{Owner: "gw", TtlMs: 1000})
	if err != nil {
		t.Fatal(err)
	}
	id := sess.Session.Id
	const term = 900 * time.Millisecond // under the TTL
	for i := 0; i < 8; i++ {
		leader := c.waitLeader()
		up := time.Now()
		expired := func() bool { ss, _ := leader.FSM().Session(id); return ss == nil }
		waitFor(t, 10*time.Second, "the term to last 900 ms", func() bool { return expired() || time.Since(up) > term })
		if expired() {
			t.Logf("expired in term %d", i+1)
			return
		}
		c.stop(0)
		c.restart(0)
	}
	t.Fatal("eight terms of 900 ms each: the dead gateway's session (TTL 1 s) is still alive")
}
