package gateway

// The gateway's session with the controller (Consul-style): every placement
// the gateway dispatches belongs to it, and the controller completes them
// all when the session expires — the gateway died, or was cut off from the
// quorum for longer than the TTL — so a lost gateway leaks no placement and
// no checkpoint reservation. It is marked a gateway's session, so that the
// load table lists it and the gateway gets its share of the workers
// (internal/placer's shares) by its name's place among the gateways'. The
// gateway renews the session every TTL/3
// from the last renewal that went through, retries a failed one at once
// (with backoff) until one does, opens a new one when the controller says it expired, and destroys it on
// Close.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/lumen-project/lumen/internal/ctlclient"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// DefaultSessionTTL is how long the controller keeps a gateway's session
// without a renewal. The gateway renews every third of it and retries a
// failed renewal with a short backoff; when it runs out, the gateway's placements are
// completed and their checkpoint reservations freed.
const DefaultSessionTTL = 10 * time.Second

// errNoSession: the gateway has no session yet (no controller answered).
var errNoSession = errors.New("gateway: no controller session")

// session keeps the gateway's session alive. One goroutine, run, owns the
// renewals; dispatches read the current id.
type session struct {
	ctl   *ctlclient.Client
	log   hclog.Logger
	owner string
	ttl   time.Duration

	// renew is signalled (buffered 1) when a dispatch found the session
	// expired: run opens a new one at once.
	renew chan struct{}

	// changed, when set, is told each new id ("" when the session is
	// gone), outside mu: the load table's share depends on it, and a
	// table that listed the session before its id was known would
	// otherwise go unread until the table changes again (an idle cluster
	// sends none).
	changed func(id string)

	// up says whether the last renewal (or creation) went through: a
	// gateway over several cells (cells.go) places new requests only in
	// cells whose quorum answers.
	up atomic.Bool

	mu sync.Mutex // guards id and ready
	id string
	// ready is closed when id is set; replaced when id is cleared.
	ready chan struct{}
}

func newSession(ctl *ctlclient.Client, log hclog.Logger, owner string, ttl time.Duration) *session {
	return &session{ctl: ctl, log: log.Named("session"), owner: owner, ttl: ttl,
		renew: make(chan struct{}, 1), ready: make(chan struct{})}
}

// current returns the session id, waiting for one while ctx allows.
func (s *session) current(ctx context.Context) (string, error) {
	for {
		s.mu.Lock()
		id, ready := s.id, s.ready
		s.mu.Unlock()
		if id != "" {
			return id, nil
		}
		select {
		case <-ready:
		case <-ctx.Done():
			return "", fmt.Errorf("%w: %w", errNoSession, context.Cause(ctx))
		}
	}
}

// expired forgets id (when it is still the current one) and has run open a
// new session.
func (s *session) expired(id string) {
	s.mu.Lock()
	gone := s.id == id
	if gone {
		s.id = ""
		s.ready = make(chan struct{})
	}
	s.mu.Unlock()
	if gone && s.changed != nil {
		s.changed("")
	}
	select {
	case s.renew <- struct{}{}:
	default:
	}
}

// idNow returns the session id, "" while there is none.
func (s *session) idNow() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.id
}

func (s *session) set(id string) {
	s.mu.Lock()
	s.id = id
	close(s.ready)
	s.mu.Unlock()
	if s.changed != nil {
		s.changed(id)
	}
}

// Renewal retries: after a failed renewal or creation the next try comes
// after this backoff (doubling up to TTL/10, at most renewRetryMax), not a
// whole period later, for as long as it fails.
const (
	renewRetryMin = 50 * time.Millisecond
	renewRetryMax = time.Second
)

// errRenewFailed: a renewal failed for another reason than expiry (no
// controller answered); the session may still be alive.
var errRenewFailed = errors.New("gateway: session renewal failed")

// run opens the session and renews it until stop closes. Renewals are due
// every TTL/3 from the last one that succeeded; one that fails is retried
// with a short backoff, so an outage shorter than the TTL less the
// reconnect costs the gateway nothing: a failed attempt ending at
// last+2TTL/3 must not leave the next until last+TTL, the deadline.
func (s *session) run(stop <-chan struct{}) {
	period := s.ttl / 3
	maxRetry := min(s.ttl/10, renewRetryMax)
	retry := renewRetryMin
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-stop:
			return
		case <-timer.C:
		case <-s.renew:
		}
		started := time.Now()
		var wait time.Duration
		err := s.keep(stop)
		s.up.Store(err == nil)
		if err != nil {
			wait, retry = retry, min(2*retry, maxRetry)
		} else {
			// Due a period after this renewal was sent: the controller
			// stamped it no earlier.
			wait, retry = time.Until(started.Add(period)), renewRetryMin
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(max(wait, 0))
	}
}

// keep renews the current session, or opens one when there is none or it
// expired. It fails when the renewal or the creation did not go through.
func (s *session) keep(stop <-chan struct{}) error {
	ctx, cancel := context.WithTimeout(context.Background(), s.ttl/3)
	defer cancel()
	go func() {
		select {
		case <-stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	s.mu.Lock()
	id := s.id
	s.mu.Unlock()
	if id != "" {
		_, err := s.ctl.RenewSession(ctx, &pb.RenewSessionRequest{SessionId: id})
		if err == nil {
			return nil
		}
		if ctlclient.Reason(err) != ctlclient.ReasonSessionExpired {
			s.log.Warn("session renewal failed; retrying before the TTL runs out", "session", id, "error", err)
			return fmt.Errorf("%w: %w", errRenewFailed, err)
		}
		s.log.Warn("session expired: its placements were completed; opening a new one", "session", id)
		s.expired(id)
	}
	resp, err := s.ctl.CreateSession(ctx, &pb.CreateSessionRequest{Owner: s.owner, TtlMs: uint32(s.ttl.Milliseconds()), Gateway: true})
	if err != nil {
		s.log.Warn("cannot open a controller session", "error", err)
		return err
	}
	s.log.Info("opened session", "session", resp.Session.Id, "ttl", s.ttl)
	s.set(resp.Session.Id)
	return nil
}

// destroy ends the session, completing its remaining placements: the
// gateway is closing.
func (s *session) destroy(ctx context.Context) {
	s.mu.Lock()
	id := s.id
	s.mu.Unlock()
	if id == "" {
		return
	}
	if _, err := s.ctl.DestroySession(ctx, &pb.DestroySessionRequest{SessionId: id}); err != nil {
		s.log.Warn("cannot destroy the session; it expires after its TTL", "session", id, "error", err)
	}
}

// dispatch places a request in the gateway's session with send (the Place
// stream's dispatch). When the controller says the session expired, it
// waits for the new one and tries once more.
func (s *session) dispatch(ctx context.Context, req *pb.DispatchRequest,
	send func(context.Context, *pb.DispatchRequest) (*pb.DispatchResponse, error)) (*pb.DispatchResponse, error) {
	for attempt := 0; ; attempt++ {
		id, err := s.current(ctx)
		if err != nil {
			return nil, err
		}
		req.SessionId = id
		resp, err := send(ctx, req)
		if err == nil || attempt > 0 || ctlclient.Reason(err) != ctlclient.ReasonSessionExpired {
			return resp, err
		}
		s.expired(id)
	}
}
