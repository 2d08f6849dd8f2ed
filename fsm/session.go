package fsm

import (
	"fmt"
	"sort"

	"google.golang.org/protobuf/proto"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Sessions (Consul-style): a gateway's lease on the placements it
// dispatches. A session is created and renewed through Raft and expires in
// Apply, by the leader-stamped time alone: before a command is applied,
// every session with renewed + ttl < the command's stamp expires, oldest
// deadline first (ties by id). Expiring or destroying a session completes its
// placements, which frees their holders' reservations, so a gateway that
// crashes or loses its Complete flush leaks nothing past its TTL.
//
// Stamps only move when commands are applied; the leader proposes a no-op
// once a session's deadline has passed on its clock, so an idle cluster
// expires sessions too. A new leader's first command (NewLeaderCmd)
// forgives every session the time between the last stamp and its own:
// while there was no leader no gateway could renew, and its clock may be
// ahead of the last leader's. Time stamped under earlier leaders still
// counts, so a dead gateway's session expires however often the leader
// changes. (Older leaders renewed every session in full,
// NoopCmd.renew_sessions: elections once per TTL kept it forever.)

// Session TTL bounds, enforced by Apply as well as by the controller.
const (
	MinSessionTTLNanos = int64(1e9)        // 1 s
	MaxSessionTTLNanos = int64(3600 * 1e9) // 1 h
)

func sessionDeadline(s *pb.Session) int64 { return s.RenewedUnixNano + s.TtlNanos }

func (s *state) createSession(c *pb.CreateSessionCmd, idx uint64) Result {
	if c.Id == "" || c.TtlNanos < MinSessionTTLNanos || c.TtlNanos > MaxSessionTTLNanos {
		return Result{Err: fmt.Errorf("%w: session needs an id and a TTL of 1 s..1 h (id %q, ttl %d ns)", ErrInvalid, c.Id, c.TtlNanos)}
	}
	if old, ok := s.sessions[c.Id]; ok {
		// A retried create (the controller draws ids at random, so
		// nothing else repeats one): the first answer.
		return Result{Session: old}
	}
	ss := &pb.Session{Id: c.Id, Owner: c.Owner, TtlNanos: c.TtlNanos,
		CreatedUnixNano: s.lastStamp, RenewedUnixNano: s.lastStamp, CreatedIndex: idx, Gateway: c.Gateway}
	s.sessions[c.Id] = ss
	s.noteDeadline(ss)
	return Result{Session: ss}
}

func (s *state) renewSession(c *pb.RenewSessionCmd) Result {
	old, ok := s.sessions[c.Id]
	if !ok {
		return Result{Err: fmt.Errorf("%w: %q", ErrSessionExpired, c.Id)}
	}
	ns := renewedAt(old, s.lastStamp)
	s.sessions[c.Id] = ns
	if sessionDeadline(old) == s.nextExpiry {
		// It was (one of) the earliest: find the new earliest, so the
		// leader does not wake for a deadline that moved.
		s.nextExpiry = 0
		for _, ss := range s.sessions {
			s.noteDeadline(ss) // a minimum: map order does not matter
		}
	}
	return Result{Session: ns}
}

func (s *state) destroySession(c *pb.DestroySessionCmd, idx uint64, evs eventSink) Result {
	if _, ok := s.sessions[c.Id]; !ok {
		return Result{Destroyed: &pb.DestroySessionResponse{Index: idx}}
	}
	n := s.endSession(c.Id, ReasonSessionDestroyed, idx, evs)
	return Result{Destroyed: &pb.DestroySessionResponse{Destroyed: true, Completed: n, Index: idx}}
}

// endSession removes a session and completes its placements, in request id
// order. It returns how many it completed.
func (s *state) endSession(id, why string, idx uint64, evs eventSink) uint32 {
	reqs := sortedKeys(s.sessionReqs[id])
	for _, rid := range reqs {
		s.finish(s.placements[rid], why, idx, evs)
	}
	delete(s.sessions, id)
	delete(s.sessionReqs, id)
	return uint32(len(reqs))
}

// NewLeaderCmd is the command a new leader commits first, before it
// serves (controller/leader.go): a no-op that forgives the sessions and the
// migrations the time no leader stamped (newLeader).
func NewLeaderCmd() *pb.Command {
	return &pb.Command{Body: &pb.Command_Noop{Noop: &pb.NoopCmd{NewLeader: true}}}
}

// renewedAt returns a copy of session old renewed at stamp (rows are
// shared with readers: never modified in place).
func renewedAt(old *pb.Session, stamp int64) *pb.Session {
	ns := proto.Clone(old).(*pb.Session)
	ns.RenewedUnixNano = stamp
	return ns
}

// renewAllSessions renews every session as of the last stamp (the
// renew_sessions of an older leader's first command).
func (s *state) renewAllSessions() {
	s.nextExpiry = 0
	for id, old := range s.sessions { // each row on its own: map order does not matter
		ns := renewedAt(old, s.lastStamp)
		s.sessions[id] = ns
		s.noteDeadline(ns)
	}
}

// newLeader forgives the time no leader stamped: a new leader's first
// command (NoopCmd.new_leader) is stamped gap past the last command, and
// every session's renewal and every migration's start move forward by
// gap. What elapsed under the earlier leaders, by their stamps, still
// counts: a session expires after TTL of stamped time without a renewal
// however often the leader changes, and a migration's stage timeout runs
// on from where it was, whatever the new leader's clock says.
func (s *state) newLeader(gap int64) {
	if gap <= 0 {
		return
	}
	s.nextExpiry = 0
	for id, old := range s.sessions { // each row on its own: map order does not matter
		ns := renewedAt(old, old.RenewedUnixNano+gap)
		s.sessions[id] = ns
		s.noteDeadline(ns)
	}
	for _, reqs := range s.incoming {
		for rid := range reqs {
			np := proto.Clone(s.placements[rid]).(*pb.Placement)
			np.MigrationStartedUnixNano += gap
			s.placements[rid] = np
		}
	}
}

// gatewaySessions returns the ids of the live gateway sessions, the newest
// of each owner only, in the order of their owners (LoadTable.sessions):
// other clients' sessions do not take a share, and a gateway that
// restarted under its name replaces its old session at once.
func (s *state) gatewaySessions() []string {
	newest := map[string]*pb.Session{}
	for _, ss := range s.sessions {
		if !ss.Gateway {
			continue
		}
		// One entry may create several (group commit): the greater id
		// breaks the tie, as map order must not.
		if o := newest[ss.Owner]; o == nil || ss.CreatedIndex > o.CreatedIndex ||
			ss.CreatedIndex == o.CreatedIndex && ss.Id > o.Id {
			newest[ss.Owner] = ss
		}
	}
	owners := make([]string, 0, len(newest))
	for o := range newest {
		owners = append(owners, o)
	}
	sort.Strings(owners)
	ids := make([]string, len(owners))
	for i, o := range owners {
		ids[i] = newest[o].Id
	}
	return ids
}

// noteDeadline keeps nextExpiry at or below a session's deadline.
func (s *state) noteDeadline(ss *pb.Session) {
	if d := sessionDeadline(ss); s.nextExpiry == 0 || d < s.nextExpiry {
		s.nextExpiry = d
	}
}

// expireSessions ends every session whose deadline is before the last
// stamp. nextExpiry (derived state, never in snapshots) lets the common case
// — nothing due — cost one comparison.
func (s *state) expireSessions(idx uint64, evs eventSink) (expired int) {
	if s.nextExpiry == 0 || s.lastStamp <= s.nextExpiry {
		return 0
	}
	ids := make([]string, 0, len(s.sessions))
	for id := range s.sessions {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	var due []*pb.Session
	s.nextExpiry = 0
	for _, id := range ids {
		ss := s.sessions[id]
		if sessionDeadline(ss) < s.lastStamp {
			due = append(due, ss)
		} else {
			s.noteDeadline(ss)
		}
	}
	sort.SliceStable(due, func(i, j int) bool { return sessionDeadline(due[i]) < sessionDeadline(due[j]) })
	for _, ss := range due {
		s.endSession(ss.Id, ReasonSessionExpired, idx, evs)
	}
	return len(due)
}

// StampAge returns how far now (Unix nanoseconds, the leader's clock) is
// past the last applied stamp, and what runs a clock on the stamps: the
// shortest TTL of the sessions (0 for none) and whether a migration is in
// flight. The leader commits a no-op when the age passes an interval that
// these set (controller/leader.go), so the time a new leader forgives
// (newLeader: from the last stamp to its own) is the leaderless gap and at
// most that interval of the last term, however idle.
func (f *FSM) StampAge(now int64) (age, minTTL int64, migrating bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	for _, ss := range f.st.sessions {
		if minTTL == 0 || ss.TtlNanos < minTTL {
			minTTL = ss.TtlNanos
		}
	}
	for _, reqs := range f.st.incoming {
		migrating = migrating || len(reqs) > 0
	}
	return now - f.st.lastStamp, minTTL, migrating
}

// NextSessionExpiry returns the earliest time (Unix nanoseconds, by the
// stamps of applied commands) at which a session may expire, or 0 when there
// is none. The leader proposes a no-op once its clock passes it, so expiry
// does not wait for other traffic.
func (f *FSM) NextSessionExpiry() int64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.nextExpiry
}

// Session returns a session's row, or nil when it expired, was destroyed or
// never existed, and the request ids of its placements, sorted.
func (f *FSM) Session(id string) (*pb.Session, []string) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	ss, ok := f.st.sessions[id]
	if !ok {
		return nil, nil
	}
	return ss, sortedKeys(f.st.sessionReqs[id])
}

// Sessions returns the number of live sessions.
func (f *FSM) Sessions() int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return len(f.st.sessions)
}
