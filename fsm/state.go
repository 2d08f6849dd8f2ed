package fsm

import (
	"fmt"
	"slices"
	"sort"
	"strings"

	"google.golang.org/protobuf/proto"

	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// state is the tables. Only the FSM goroutine changes it (under FSM.mu).
type state struct {
	strategy pb.Strategy
	lambda   float64
	// migration is the switch of live migration for balance.
	migration bool
	// replicas is the copies of each checkpoint (issue 24), >= 1.
	replicas uint32
	// sameDomain and shortReplicas count placements whose first copy
	// had to share the serving worker's node, and those that got fewer
	// copies than replicas (policy.HolderChoice). Counters of this
	// replica's applies since it started or restored, for metrics: not
	// snapshotted, never read by Apply.
	sameDomain, shortReplicas uint64
	holderBuf                 []int
	// together are the workers the entry being applied marks failed,
	// while it applies (failingTogether).
	together []string
	// copyPrefixes is, while a MarkFailed applies, what its leader
	// gathered of each copy's prefix (MarkFailedCmd.checkpointed).
	copyPrefixes []*pb.CopyPrefix

	workers map[string]*pb.Worker
	loads   map[string]*pb.LoadRecord
	// ids is the sorted worker ids; views[i] is policy's view of ids[i],
	// rows[i] its row (workers[ids[i]]: rows are replaced, never changed
	// in place).
	ids   []string
	views []policy.Worker
	rows  []*pb.Worker
	// holders indexes views for h(r); refresh it through touch and
	// reindex whenever a view's holder fields change.
	holders *policy.HolderIndex

	placements map[string]*pb.Placement
	// serving[w] is the set of request ids placed on worker w.
	serving map[string]map[string]struct{}
	// holding[w] is the set of request ids whose checkpoint w holds.
	holding map[string]map[string]struct{}
	// incoming[w] is the set of request ids MIGRATING to w. Derived from
	// the placements: rebuilt on restore, never snapshotted.
	incoming map[string]map[string]struct{}

	recoveries     []*pb.RecoveryPlan // oldest first, at most recoveriesKept
	nextRecoveryID uint64

	// completed is a ring of the last completed ids, at most
	// completedKept: completed[completedHead] is the oldest once full.
	// (A slice sliding forward reallocated and copied all 65,536 ids
	// every few thousand completions: 6% of the leader's CPU.)
	completed     []string
	completedHead int
	completedSet  map[string]struct{}

	sessions map[string]*pb.Session
	// sessionOf[r] is the session request r's placement belongs to;
	// sessionReqs[s] the request ids of session s's placements.
	sessionOf   map[string]string
	sessionReqs map[string]map[string]struct{}
	// nextExpiry is at or before the earliest session deadline (0: no
	// session). Derived: recomputed on restore, never snapshotted.
	nextExpiry int64

	lastStamp int64

	// pairDirty is set, while one command applies, by every change that
	// may let a drafter pair (a worker entered ASSIST or FULL_SERVICE, a
	// pairing ended); apply then runs the pairing. Always false between
	// commands: never snapshotted.
	pairDirty bool
}

func newState() *state {
	return &state{
		strategy:       pb.Strategy_STRATEGY_LUMEN,
		lambda:         DefaultLambda,
		replicas:       1,
		workers:        map[string]*pb.Worker{},
		loads:          map[string]*pb.LoadRecord{},
		placements:     map[string]*pb.Placement{},
		serving:        map[string]map[string]struct{}{},
		holding:        map[string]map[string]struct{}{},
		incoming:       map[string]map[string]struct{}{},
		completedSet:   map[string]struct{}{},
		sessions:       map[string]*pb.Session{},
		sessionOf:      map[string]string{},
		sessionReqs:    map[string]map[string]struct{}{},
		nextRecoveryID: 1,
		holders:        policy.NewHolderIndex(nil, DefaultLambda),
	}
}

// touch refreshes worker id's entry in the holder index after its view
// changed.
func (s *state) touch(id string) {
	i := sort.SearchStrings(s.ids, id)
	if i < len(s.ids) && s.ids[i] == id {
		s.holders.Update(i, &s.views[i])
	}
}

func (s *state) reindex() { s.holders.Rebuild(s.views, s.lambda) }

// eventSink collects the events one batch produces.
type eventSink = *[]*pb.Event

func (s *state) emit(evs eventSink, idx uint64, ev *pb.Event) {
	ev.Index = idx
	ev.UnixNano = s.lastStamp
	n := len(*evs)
	if n > 0 && (*evs)[n-1].Index == idx {
		ev.Seq = (*evs)[n-1].Seq + 1
	}
	*evs = append(*evs, ev)
}

func (s *state) apply(c *pb.Command, idx uint64, evs eventSink) Result {
	prev := s.lastStamp
	if c.StampedUnixNano > s.lastStamp {
		s.lastStamp = c.StampedUnixNano
	}
	// Sessions past their deadline by this command's stamp end before it
	// applies: a renewal or dispatch that comes too late finds them gone.
	// A new leader's first command first forgives the time no leader
	// stamped (older leaders renewed every session in full instead).
	if c.GetNoop().GetNewLeader() && prev != 0 {
		s.newLeader(s.lastStamp - prev)
	}
	if c.GetNoop().GetRenewSessions() {
		s.renewAllSessions()
	}
	s.expireSessions(idx, evs)
	res := s.applyBody(c, idx, evs)
	if s.pairDirty {
		s.pairDrafters(idx, evs)
		// The caller gets the row as the command left it, partner included.
		if w := res.Worker; w != nil {
			if cur := s.workers[w.Id]; cur != nil && cur.Incarnation == w.Incarnation {
				res.Worker = cur
			}
		}
	}
	return res
}

func (s *state) applyBody(c *pb.Command, idx uint64, evs eventSink) Result {
	switch b := c.Body.(type) {
	case *pb.Command_Dispatch:
		return s.dispatch(b.Dispatch, idx)
	case *pb.Command_Complete:
		return s.complete(b.Complete, idx, evs)
	case *pb.Command_ReportLoad:
		return s.reportLoad(b.ReportLoad.GetLoad())
	case *pb.Command_RegisterWorker:
		return s.registerWorker(b.RegisterWorker.GetWorker(), idx, evs)
	case *pb.Command_MarkFailed:
		return s.markFailed(b.MarkFailed, idx, evs)
	case *pb.Command_SetPhase:
		return s.setPhase(b.SetPhase, idx, evs)
	case *pb.Command_Leave:
		return s.setPhase(&pb.SetPhaseCmd{WorkerId: b.Leave.WorkerId, Incarnation: b.Leave.Incarnation,
			Phase: pb.WorkerPhase_WORKER_PHASE_LEFT, Reason: "left"}, idx, evs)
	case *pb.Command_SetStrategy:
		return s.setStrategy(b.SetStrategy, idx, evs)
	case *pb.Command_Noop:
		return Result{}
	case *pb.Command_CreateSession:
		return s.createSession(b.CreateSession, idx)
	case *pb.Command_RenewSession:
		return s.renewSession(b.RenewSession)
	case *pb.Command_DestroySession:
		return s.destroySession(b.DestroySession, idx, evs)
	case *pb.Command_Migrate:
		return s.migrate(b.Migrate, idx, evs)
	case *pb.Command_FinishMigration:
		return s.finishMigration(b.FinishMigration, idx, evs)
	default:
		// An unknown command type is from a newer version: this replica
		// cannot follow the log.
		panic(fmt.Sprintf("fsm: log entry %d holds an unknown command type %T", idx, c.Body))
	}
}

// --- workers and policy views ---

func eligible(w *pb.Worker) bool { return w.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE }

// recoveryRank orders the phases of progressive recovery, which a restarted
// worker walks forward only: LOADING_DRAFT 1, ASSIST 2, HOTSWAP 3,
// FULL_SERVICE 4; 0 for every other phase.
func recoveryRank(p pb.WorkerPhase) int {
	switch p {
	case pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT:
		return 1
	case pb.WorkerPhase_WORKER_PHASE_ASSIST:
		return 2
	case pb.WorkerPhase_WORKER_PHASE_HOTSWAP:
		return 3
	case pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE:
		return 4
	}
	return 0
}

// recovering: the worker is a new incarnation on its way to FULL_SERVICE,
// not eligible to serve or hold.
func recovering(p pb.WorkerPhase) bool {
	r := recoveryRank(p)
	return r > 0 && r < recoveryRank(pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE)
}

func phaseName(p pb.WorkerPhase) string { return strings.TrimPrefix(p.String(), "WORKER_PHASE_") }

// checkStep refuses a phase change that walks progressive recovery backward
// (HOTSWAP to ASSIST, FULL_SERVICE to LOADING_DRAFT, …) or enters it from
// outside: only a new incarnation, registering in LOADING_DRAFT, starts it.
// Skipping forward (LOADING_DRAFT to FULL_SERVICE) is allowed; changes to
// and from DRAINING, FAILED and LEFT are not its business.
func checkStep(w *pb.Worker, to pb.WorkerPhase) error {
	if to == w.Phase || !recovering(to) {
		return nil
	}
	from, toRank := recoveryRank(w.Phase), recoveryRank(to)
	switch {
	case from == 0:
		return fmt.Errorf("%w: %s incarnation %d cannot go from %s to %s: only a new incarnation enters recovery, registering in LOADING_DRAFT",
			ErrInvalid, w.Id, w.Incarnation, phaseName(w.Phase), phaseName(to))
	case toRank < from:
		return fmt.Errorf("%w: %s incarnation %d cannot go back from %s to %s: recovery goes LOADING_DRAFT, ASSIST, HOTSWAP, FULL_SERVICE",
			ErrInvalid, w.Id, w.Incarnation, phaseName(w.Phase), phaseName(to))
	}
	return nil
}

func (s *state) view(id string) *policy.Worker {
	i := sort.SearchStrings(s.ids, id)
	if i < len(s.ids) && s.ids[i] == id {
		return &s.views[i]
	}
	return nil
}

// putWorker stores a worker row and refreshes its view's static fields.
func (s *state) putWorker(w *pb.Worker) {
	_, known := s.workers[w.Id]
	if !known {
		i := sort.SearchStrings(s.ids, w.Id)
		s.ids = append(s.ids, "")
		copy(s.ids[i+1:], s.ids[i:])
		s.ids[i] = w.Id
		s.views = append(s.views, policy.Worker{})
		copy(s.views[i+1:], s.views[i:])
		s.views[i] = policy.Worker{ID: w.Id}
		s.rows = slices.Insert(s.rows, i, w)
	}
	s.workers[w.Id] = w
	s.rows[sort.SearchStrings(s.ids, w.Id)] = w
	v := s.view(w.Id)
	v.Eligible = eligible(w)
	v.Draining = w.Phase == pb.WorkerPhase_WORKER_PHASE_DRAINING
	v.Node = w.Node
	v.CheckpointBudget = w.GetCapacity().GetCheckpointBudgetBytes()
	v.H2DBytesPerSec = w.GetCapacity().GetH2DBytesPerSec()
	v.MaxRunning = w.GetCapacity().GetMaxRunning()
	if v.KVPagesTotal == 0 {
		v.KVPagesTotal = w.GetCapacity().GetKvPagesTotal()
	}
	if known {
		s.touch(w.Id)
	} else {
		s.reindex()
	}
}

// setWorkerPhase stores w in a new phase. A pairing holds only while its
// drafter is in ASSIST and its target in FULL_SERVICE, so any phase change of
// a paired worker ends its pairing.
func (s *state) setWorkerPhase(w *pb.Worker, phase pb.WorkerPhase, reason string, idx uint64, evs eventSink) *pb.Worker {
	if w.Phase == phase {
		return w
	}
	nw := proto.Clone(w).(*pb.Worker)
	nw.Phase = phase
	nw.PhaseChangedUnixNano = s.lastStamp
	nw.PairedWorker = ""
	s.putWorker(nw)
	s.emit(evs, idx, &pb.Event{Body: &pb.Event_PhaseChanged{PhaseChanged: &pb.WorkerPhaseChanged{
		WorkerId: w.Id, Incarnation: w.Incarnation, From: w.Phase, To: phase, Reason: reason}}})
	if phase != pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
		// Only a worker in full service takes a migration in.
		s.abortIncoming(w, phase, reason, idx, evs)
	}
	if w.PairedWorker != "" {
		why := fmt.Sprintf("went %s", phaseName(phase))
		if reason != "" {
			why += ": " + reason
		}
		s.endPairing(w, why, idx, evs)
	}
	if phase == pb.WorkerPhase_WORKER_PHASE_ASSIST || phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
		s.pairDirty = true
	}
	return nw
}

// --- drafter pairing (progressive recovery) ---

// endPairing ends the pairing of w (the row as it was while paired, so its
// phase says its role), whose own new row already has no partner: the
// partner's row loses w, and a WorkerPaired event with paired=false says
// why (what w did).
func (s *state) endPairing(w *pb.Worker, why string, idx uint64, evs eventSink) {
	partner := s.workers[w.PairedWorker]
	if partner != nil && partner.PairedWorker == w.Id {
		np := proto.Clone(partner).(*pb.Worker)
		np.PairedWorker = ""
		s.putWorker(np)
	} else {
		// Pairings are symmetric; a row that says otherwise is a bug, and
		// the partner's row is left as it is.
		partner = &pb.Worker{Id: w.PairedWorker}
	}
	ev := &pb.WorkerPaired{Paired: false}
	if w.Phase == pb.WorkerPhase_WORKER_PHASE_ASSIST {
		ev.DrafterId, ev.DrafterIncarnation, ev.TargetId, ev.TargetIncarnation = w.Id, w.Incarnation, partner.Id, partner.Incarnation
		ev.Reason = "drafter " + w.Id + " " + why
	} else {
		ev.DrafterId, ev.DrafterIncarnation, ev.TargetId, ev.TargetIncarnation = partner.Id, partner.Incarnation, w.Id, w.Incarnation
		ev.Reason = "target " + w.Id + " " + why
	}
	s.emit(evs, idx, &pb.Event{Body: &pb.Event_Paired{Paired: ev}})
	// The drafter may pair again, the target take another drafter.
	s.pairDirty = true
}

// pairDrafters pairs every unpaired worker in ASSIST with a full-service
// worker that has no drafter, by policy.PairDrafters, and records each
// pairing on both rows.
func (s *state) pairDrafters(idx uint64, evs eventSink) {
	s.pairDirty = false
	var drafters []string
	var paired map[string]bool
	for _, id := range s.ids {
		w := s.workers[id]
		switch {
		case w.Phase == pb.WorkerPhase_WORKER_PHASE_ASSIST && w.PairedWorker == "":
			drafters = append(drafters, id)
		case w.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE && w.PairedWorker != "":
			if paired == nil {
				paired = map[string]bool{}
			}
			paired[id] = true
		}
	}
	for _, p := range policy.PairDrafters(drafters, s.views, paired) {
		d := proto.Clone(s.workers[p.Drafter]).(*pb.Worker)
		t := proto.Clone(s.workers[p.Target]).(*pb.Worker)
		d.PairedWorker, t.PairedWorker = t.Id, d.Id
		s.putWorker(d)
		s.putWorker(t)
		s.emit(evs, idx, &pb.Event{Body: &pb.Event_Paired{Paired: &pb.WorkerPaired{
			DrafterId: d.Id, DrafterIncarnation: d.Incarnation, TargetId: t.Id, TargetIncarnation: t.Incarnation, Paired: true,
			Reason: fmt.Sprintf("highest q_w of the full-service workers without a drafter (%.1f ms)", p.TargetQueueWaitMs)}}})
	}
}

func (s *state) registerWorker(w *pb.Worker, idx uint64, evs eventSink) Result {
	if w == nil || w.Id == "" {
		return Result{Err: fmt.Errorf("%w: worker id is empty", ErrInvalid)}
	}
	switch w.Phase {
	case pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT:
	default:
		return Result{Err: fmt.Errorf("%w: worker %s registers in %s: a worker registers in FULL_SERVICE, or in LOADING_DRAFT when it restarts after a failure",
			ErrInvalid, w.Id, phaseName(w.Phase))}
	}
	old, ok := s.workers[w.Id]
	if ok {
		switch {
		case w.Incarnation < old.Incarnation:
			return Result{Err: fmt.Errorf("%w: worker %s incarnation %d < %d", ErrStaleIncarnation, w.Id, w.Incarnation, old.Incarnation)}
		case w.Incarnation == old.Incarnation:
			return Result{Worker: old} // a retried registration
		}
		// A new incarnation: the old one is gone, whether or not its
		// failure was noticed. Recover what it served and drop what it held.
		if old.Phase != pb.WorkerPhase_WORKER_PHASE_FAILED && old.Phase != pb.WorkerPhase_WORKER_PHASE_LEFT {
			s.failWorker(old, "restarted with a new incarnation", idx, evs)
		}
	}
	// Requests the old incarnation still has (RECOVERING: no worker could
	// take them when it failed) are planned once the new row is in, if it
	// is eligible; if it is recovering (LOADING_DRAFT), when some worker is
	// (recoverOrphans, or setPhase when this one gets to FULL_SERVICE).
	leftover := ok && len(s.serving[w.Id]) > 0
	nw := proto.Clone(w).(*pb.Worker)
	if nw.Phase == pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED {
		nw.Phase = pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE
	}
	// Pairing is the controller's to decide.
	nw.PairedWorker = ""
	if eligible(nw) {
		s.pairDirty = true
	}
	nw.RegisteredUnixNano = s.lastStamp
	nw.PhaseChangedUnixNano = s.lastStamp
	s.putWorker(nw)
	delete(s.loads, nw.Id)
	v := s.view(nw.Id)
	*v = policy.Worker{ID: v.ID, Node: v.Node, Eligible: v.Eligible, Draining: v.Draining, CheckpointBudget: v.CheckpointBudget,
		H2DBytesPerSec: v.H2DBytesPerSec, MaxRunning: v.MaxRunning, KVPagesTotal: nw.GetCapacity().GetKvPagesTotal()}
	s.touch(nw.Id)
	from := pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED
	if ok {
		from = pb.WorkerPhase_WORKER_PHASE_FAILED
	}
	s.emit(evs, idx, &pb.Event{Body: &pb.Event_PhaseChanged{PhaseChanged: &pb.WorkerPhaseChanged{
		WorkerId: nw.Id, Incarnation: nw.Incarnation, From: from, To: nw.Phase, Reason: "registered"}}})
	if v.Eligible {
		if leftover {
			s.recover(nw.Id, old.Incarnation, idx, evs)
		}
		s.recoverOrphans(idx, evs)
	}
	return Result{Worker: nw}
}

func (s *state) reportLoad(l *pb.LoadRecord) Result {
	if l == nil {
		return Result{Err: fmt.Errorf("%w: load record is empty", ErrInvalid)}
	}
	w, ok := s.workers[l.WorkerId]
	if !ok {
		return Result{Err: fmt.Errorf("%w: %q", ErrUnknownWorker, l.WorkerId)}
	}
	if l.Incarnation != w.Incarnation {
		return Result{Err: fmt.Errorf("%w: load of %s incarnation %d, table has %d", ErrStaleIncarnation, l.WorkerId, l.Incarnation, w.Incarnation)}
	}
	if w.Phase == pb.WorkerPhase_WORKER_PHASE_FAILED || w.Phase == pb.WorkerPhase_WORKER_PHASE_LEFT {
		// A worker that was paused or cut off long enough to be marked
		// failed is still running this incarnation: refusing its reports
		// tells it to register a new one (its requests have moved).
		return Result{Err: fmt.Errorf("%w: load of %s incarnation %d, which is %s; register a new incarnation",
			ErrIncarnationFailed, l.WorkerId, l.Incarnation, w.Phase)}
	}
	nl := proto.Clone(l).(*pb.LoadRecord)
	nl.ReportUnixNano = s.lastStamp
	s.loads[l.WorkerId] = nl
	v := s.view(l.WorkerId)
	v.QueueWaitMs = l.QueueWaitMs
	v.KVPagesTotal = l.KvPagesTotal
	v.KVPagesUsed = l.KvPagesUsed
	v.QueueHeadPages, v.QueuedPages = l.QueueHeadPages, l.QueuedPages
	v.Running = l.Running
	v.Waiting = l.Waiting
	v.HighPriority = l.HighPriority
	v.PendingRequests, v.PendingPages = 0, 0
	s.touch(l.WorkerId)
	return Result{}
}

func (s *state) setPhase(c *pb.SetPhaseCmd, idx uint64, evs eventSink) Result {
	w, ok := s.workers[c.WorkerId]
	if !ok {
		return Result{Err: fmt.Errorf("%w: %q", ErrUnknownWorker, c.WorkerId)}
	}
	if c.Incarnation != w.Incarnation {
		return Result{Err: fmt.Errorf("%w: %s incarnation %d, table has %d", ErrStaleIncarnation, c.WorkerId, c.Incarnation, w.Incarnation)}
	}
	if c.Phase == pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED {
		return Result{Err: fmt.Errorf("%w: phase is unspecified", ErrInvalid)}
	}
	if w.Phase == pb.WorkerPhase_WORKER_PHASE_FAILED || w.Phase == pb.WorkerPhase_WORKER_PHASE_LEFT {
		if c.Phase == w.Phase {
			return Result{Worker: w}
		}
		return Result{Err: fmt.Errorf("%w: %s incarnation %d is %s; register a new incarnation", ErrStaleIncarnation, c.WorkerId, w.Incarnation, w.Phase)}
	}
	if c.Phase == pb.WorkerPhase_WORKER_PHASE_FAILED || c.Phase == pb.WorkerPhase_WORKER_PHASE_LEFT {
		nw := s.failWorker(w, c.Reason, idx, evs)
		if c.Phase == pb.WorkerPhase_WORKER_PHASE_LEFT {
			nw = s.setWorkerPhase(nw, c.Phase, c.Reason, idx, evs)
		}
		return Result{Worker: nw}
	}
	if err := checkStep(w, c.Phase); err != nil {
		return Result{Err: err}
	}
	inc, left := s.leftover(w)
	nw := s.setWorkerPhase(w, c.Phase, c.Reason, idx, evs)
	if eligible(nw) {
		if left {
			s.recover(nw.Id, inc, idx, evs)
		}
		s.recoverOrphans(idx, evs)
	}
	return Result{Worker: nw}
}

func (s *state) setStrategy(c *pb.SetStrategyCmd, idx uint64, evs eventSink) Result {
	if c.Strategy != pb.Strategy_STRATEGY_UNSPECIFIED && !policy.Strategy(c.Strategy).Known() {
		return Result{Err: fmt.Errorf("%w: unknown strategy %d", ErrInvalid, c.Strategy)}
	}
	if c.Migration < pb.MigrationMode_MIGRATION_MODE_UNCHANGED || c.Migration > pb.MigrationMode_MIGRATION_MODE_OFF {
		return Result{Err: fmt.Errorf("%w: unknown migration mode %d", ErrInvalid, c.Migration)}
	}
	if c.CheckpointReplicas > policy.MaxCheckpointReplicas {
		return Result{Err: fmt.Errorf("%w: checkpoint replicas %d: at most %d", ErrInvalid, c.CheckpointReplicas, policy.MaxCheckpointReplicas)}
	}
	if c.CheckpointReplicas > 0 {
		// Placements keep the copies they have; new ones get the new count.
		s.replicas = c.CheckpointReplicas
	}
	prev := s.strategy
	if c.Strategy != pb.Strategy_STRATEGY_UNSPECIFIED {
		s.strategy = c.Strategy
	}
	if c.Migration != pb.MigrationMode_MIGRATION_MODE_UNCHANGED {
		s.migration = c.Migration == pb.MigrationMode_MIGRATION_MODE_ON
	}
	if c.Lambda > 0 && c.Lambda != s.lambda {
		s.lambda = c.Lambda
		s.reindex()
	}
	if prev != s.strategy {
		s.emit(evs, idx, &pb.Event{Body: &pb.Event_StrategyChanged{StrategyChanged: &pb.StrategyChanged{From: prev, To: s.strategy}}})
	}
	return Result{Previous: prev}
}

// --- placements ---

func addTo(m map[string]map[string]struct{}, k, v string) {
	set, ok := m[k]
	if !ok {
		set = map[string]struct{}{}
		m[k] = set
	}
	set[v] = struct{}{}
}

func removeFrom(m map[string]map[string]struct{}, k, v string) {
	if set, ok := m[k]; ok {
		delete(set, v)
		if len(set) == 0 {
			delete(m, k)
		}
	}
}

func sortedKeys(set map[string]struct{}) []string {
	out := make([]string, 0, len(set))
	for k := range set {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// reserve and release move a checkpoint footprint onto and off a holder
// (one search of the ids for the view and the index both).
func (s *state) reserve(holder string, bytes uint64) {
	if i := s.index(holder); i >= 0 {
		v := &s.views[i]
		v.Reserved += bytes
		v.Held++
		s.holders.Update(i, v)
	}
}

func (s *state) release(holder string, bytes uint64) {
	if i := s.index(holder); i >= 0 && s.views[i].Held > 0 {
		v := &s.views[i]
		v.Reserved -= min(bytes, v.Reserved)
		v.Held--
		s.holders.Update(i, v)
	}
}

// index is id's position in ids and views, -1 for none.
func (s *state) index(id string) int {
	if i := sort.SearchStrings(s.ids, id); i < len(s.ids) && s.ids[i] == id {
		return i
	}
	return -1
}

func (s *state) footprint(serving string, prompt, maxTokens uint32) uint64 {
	c := s.workers[serving].GetCapacity()
	return policy.Footprint(prompt, maxTokens, c.GetMaxContextTokens(), c.GetKvBytesPerToken())
}

func (s *state) strategyPolicy() policy.Strategy { return policy.Strategy(s.strategy) }

// placeHolder picks and reserves a holder for a request served at index
// serving (into views) and fills p's holder fields.
func (s *state) placeHolder(p *pb.Placement, serving int) policy.NoHolder {
	p.ReservedBytes = s.footprint(s.ids[serving], p.PromptTokens, p.MaxTokens)
	c := policy.ChooseHolders(s.strategyPolicy(), s.views, s.holders, serving, p.ReservedBytes, s.lambda, int(s.replicas), s.holderBuf)
	s.holderBuf = c.Holders
	p.ReplicaHolders = nil
	if len(c.Holders) == 0 {
		p.HolderId, p.ReservedBytes = "", 0
		return c.Why
	}
	if c.SameDomain {
		s.sameDomain++
	}
	if c.Short {
		s.shortReplicas++
	}
	for k, h := range c.Holders {
		id := s.ids[h]
		if k == 0 {
			p.HolderId = id
		} else {
			p.ReplicaHolders = append(p.ReplicaHolders, id)
		}
		s.reserve(id, p.ReservedBytes)
		addTo(s.holding, id, p.RequestId)
	}
	return c.Why
}

// dropHolder releases every copy of p's checkpoint (its fields stay).
func (s *state) dropHolder(p *pb.Placement) {
	if p.HolderId != "" {
		s.release(p.HolderId, p.ReservedBytes)
		removeFrom(s.holding, p.HolderId, p.RequestId)
	}
	for _, id := range p.ReplicaHolders {
		s.release(id, p.ReservedBytes)
		removeFrom(s.holding, id, p.RequestId)
	}
}

// dropCopyFields removes holder's copy of p's checkpoint from p's fields
// (p is the table's own copy, changed in place; the holder's reservation
// and holding set are the caller's): the first replica takes the holder's
// place when it was the first copy.
func dropCopyFields(p *pb.Placement, holder string) {
	if p.HolderId == holder {
		p.HolderId = ""
		if len(p.ReplicaHolders) > 0 {
			p.HolderId = p.ReplicaHolders[0]
			p.ReplicaHolders = append([]string(nil), p.ReplicaHolders[1:]...)
		}
	} else {
		rest := make([]string, 0, len(p.ReplicaHolders))
		for _, id := range p.ReplicaHolders {
			if id != holder {
				rest = append(rest, id)
			}
		}
		p.ReplicaHolders = rest
	}
	if len(p.ReplicaHolders) == 0 {
		p.ReplicaHolders = nil
	}
	if p.HolderId == "" {
		p.ReservedBytes = 0
	}
}

// HoldsCopy reports whether worker id holds a copy of p's checkpoint.
func HoldsCopy(p *pb.Placement, id string) bool {
	if id == "" {
		return false
	}
	if p.HolderId == id {
		return true
	}
	for _, h := range p.ReplicaHolders {
		if h == id {
			return true
		}
	}
	return false
}

func (s *state) dispatch(c *pb.DispatchCmd, idx uint64) Result {
	if c.RequestId == "" {
		return Result{Err: fmt.Errorf("%w: request id is empty", ErrInvalid)}
	}
	if p, ok := s.placements[c.RequestId]; ok {
		return Result{Dispatch: &pb.DispatchResponse{Placement: p, NoHolder: p.HolderId == "", Index: p.CreatedIndex}}
	}
	if _, done := s.completedSet[c.RequestId]; done {
		return Result{Err: fmt.Errorf("%w: %q", ErrCompleted, c.RequestId)}
	}
	if c.SessionId != "" {
		if _, ok := s.sessions[c.SessionId]; !ok {
			return Result{Err: fmt.Errorf("%w: %q; create a new session and dispatch in it", ErrSessionExpired, c.SessionId)}
		}
	}
	var serving int
	if c.WorkerId != "" {
		// The gateway chose the worker and the request already runs there:
		// accept while that incarnation is alive and not DRAINING (whose
		// Generate refused it). O(log n).
		i, err := s.chosen(c)
		if err != nil {
			return Result{Err: err}
		}
		serving = i
	} else if serving = policy.PickServing(s.views); serving < 0 {
		return Result{Err: ErrNoWorker}
	}
	w := s.workers[s.ids[serving]]
	p := &pb.Placement{
		RequestId: c.RequestId, WorkerId: w.Id, WorkerIncarnation: w.Incarnation,
		State: pb.PlacementState_PLACEMENT_STATE_RUNNING, PromptTokens: c.PromptTokens, MaxTokens: c.MaxTokens,
		CreatedUnixNano: s.lastStamp, CreatedIndex: idx, Priority: c.Priority,
	}
	why := s.placeHolder(p, serving)
	v := &s.views[serving]
	v.PendingRequests++
	v.PendingPages += policy.Pages(uint64(c.PromptTokens))
	s.placements[p.RequestId] = p
	addTo(s.serving, w.Id, p.RequestId)
	if c.SessionId != "" {
		s.sessionOf[p.RequestId] = c.SessionId
		addTo(s.sessionReqs, c.SessionId, p.RequestId)
	}
	return Result{Dispatch: &pb.DispatchResponse{Placement: p, NoHolder: p.HolderId == "", NoHolderReason: string(why), Index: idx}}
}

// chosen returns the index (into ids and views) of the serving worker a
// Dispatch named, or ErrWorkerUnavailable saying why it may not take it.
func (s *state) chosen(c *pb.DispatchCmd) (int, error) {
	w, ok := s.workers[c.WorkerId]
	switch {
	case !ok:
		return -1, fmt.Errorf("%w: worker %s incarnation %d is not in the table", ErrWorkerUnavailable, c.WorkerId, c.WorkerIncarnation)
	case w.Incarnation != c.WorkerIncarnation:
		return -1, fmt.Errorf("%w: worker %s incarnation %d is gone: the table has incarnation %d (%s)",
			ErrWorkerUnavailable, c.WorkerId, c.WorkerIncarnation, w.Incarnation, phaseName(w.Phase))
	case w.Phase == pb.WorkerPhase_WORKER_PHASE_FAILED || w.Phase == pb.WorkerPhase_WORKER_PHASE_LEFT:
		return -1, fmt.Errorf("%w: worker %s incarnation %d is %s", ErrWorkerUnavailable, c.WorkerId, c.WorkerIncarnation, phaseName(w.Phase))
	case w.Phase == pb.WorkerPhase_WORKER_PHASE_DRAINING:
		// Its Generate refuses new requests, so nothing runs there to
		// place, and a placement would only be a migration the drain
		// cannot make: the gateway places the request elsewhere.
		return -1, fmt.Errorf("%w: worker %s incarnation %d is DRAINING and takes no new request; place it on a worker in FULL_SERVICE",
			ErrWorkerUnavailable, c.WorkerId, c.WorkerIncarnation)
	}
	if !eligible(w) {
		if inc, left := s.leftover(w); left {
			// Requests of an earlier incarnation wait there for recovery (no
			// worker could take them); a row never mixes them with its own. An
			// eligible row never has any (becoming eligible plans them), so the
			// hot path skips the scan.
			return -1, fmt.Errorf("%w: worker %s incarnation %d (%s) still has requests of incarnation %d awaiting recovery",
				ErrWorkerUnavailable, c.WorkerId, c.WorkerIncarnation, phaseName(w.Phase), inc)
		}
	}
	i := sort.SearchStrings(s.ids, c.WorkerId)
	return i, nil
}

func (s *state) complete(c *pb.CompleteCmd, idx uint64, evs eventSink) Result {
	resp := &pb.CompleteResponse{Index: idx}
	for _, id := range c.RequestIds {
		p, ok := s.placements[id]
		if !ok {
			if _, done := s.completedSet[id]; done {
				resp.AlreadyCompleted = append(resp.AlreadyCompleted, id)
			} else {
				resp.NotFound = append(resp.NotFound, id)
			}
			continue
		}
		s.finish(p, ReasonCompleted, idx, evs)
		resp.Completed++
	}
	return Result{Complete: resp}
}

// finish completes a placement: its holder's reservation is freed, it leaves
// its worker and its session, and its id is remembered as completed. A
// migration in flight ends (why says how, for the destination).
func (s *state) finish(p *pb.Placement, why string, idx uint64, evs eventSink) {
	id := p.RequestId
	if migrating(p) {
		s.finishedMigrating(p, why, idx, evs)
	}
	s.dropHolder(p)
	removeFrom(s.serving, p.WorkerId, id)
	delete(s.placements, id)
	if sid, ok := s.sessionOf[id]; ok {
		delete(s.sessionOf, id)
		removeFrom(s.sessionReqs, sid, id)
	}
	s.rememberCompleted(id)
}

// completedOldestFirst copies the completed ids, oldest first.
func (s *state) completedOldestFirst() []string {
	out := make([]string, 0, len(s.completed))
	out = append(out, s.completed[s.completedHead:]...)
	return append(out, s.completed[:s.completedHead]...)
}

func (s *state) rememberCompleted(id string) {
	if len(s.completed) < completedKept {
		s.completed = append(s.completed, id)
	} else {
		delete(s.completedSet, s.completed[s.completedHead])
		s.completed[s.completedHead] = id
		s.completedHead = (s.completedHead + 1) % completedKept
	}
	s.completedSet[id] = struct{}{}
}

// --- failure and recovery ---

func (s *state) markFailed(c *pb.MarkFailedCmd, idx uint64, evs eventSink) Result {
	w, ok := s.workers[c.WorkerId]
	if !ok {
		return Result{Err: fmt.Errorf("%w: %q", ErrUnknownWorker, c.WorkerId)}
	}
	if c.Incarnation != w.Incarnation {
		// Gossip about an incarnation that is already gone: nothing to do.
		return Result{Err: fmt.Errorf("%w: %s incarnation %d, table has %d", ErrStaleIncarnation, c.WorkerId, c.Incarnation, w.Incarnation)}
	}
	if w.Phase == pb.WorkerPhase_WORKER_PHASE_FAILED || w.Phase == pb.WorkerPhase_WORKER_PHASE_LEFT {
		return Result{Worker: w}
	}
	reason := c.Reason
	if reason == "" {
		reason = "marked failed"
	}
	s.copyPrefixes = c.Checkpointed
	defer func() { s.copyPrefixes = nil }()
	return Result{Worker: s.failWorker(w, reason, idx, evs)}
}

// failingTogether takes out of the policy views, for the entry about to
// apply, every worker the entry marks failed (a MarkFailed of its current
// incarnation while it is eligible), when it marks more than one: workers
// that fail together — a node's, whose probes fail at once and which the
// leader commits as one entry — are then no recovery target, no live
// checkpoint and no new holder for one another's requests. Without it
// the plan of the first would send requests to its node-mates, which the
// next command of the entry fails again, and their copies there would
// count as live. endTogether puts the views back as the rows say.
func (s *state) failingTogether(cmds []*pb.Command) {
	n := 0
	for _, c := range cmds {
		if c.GetMarkFailed() != nil {
			n++
		}
	}
	if n < 2 {
		return
	}
	for _, c := range cmds {
		mf := c.GetMarkFailed()
		if mf == nil {
			continue
		}
		w, ok := s.workers[mf.WorkerId]
		if !ok || w.Incarnation != mf.Incarnation || !eligible(w) {
			continue
		}
		s.view(w.Id).Eligible = false
		s.touch(w.Id)
		s.together = append(s.together, w.Id)
	}
}

func (s *state) endTogether() {
	for _, id := range s.together {
		s.view(id).Eligible = eligible(s.workers[id])
		s.touch(id)
	}
	s.together = s.together[:0]
}

// failWorker takes a worker out of service: the checkpoints it held are lost
// (their placements run on without a holder until recovery picks new ones),
// and the requests it served are recovered by plan.
func (s *state) failWorker(w *pb.Worker, reason string, idx uint64, evs eventSink) *pb.Worker {
	nw := s.setWorkerPhase(w, pb.WorkerPhase_WORKER_PHASE_FAILED, reason, idx, evs)
	// Every copy it held goes. Each drop changes only its own placement:
	// the worker's reservation and its holding set, which a drop of one
	// copy would update, are zeroed and deleted whole below. So the
	// placements change in any order, with no sort of the set and no
	// update of the holder index per copy (h(r) concentrates copies: a
	// node of the 1,024 workers in BenchmarkApplyMarkFailedNode held 59,000,
	// and dropping them one by one was 40 ms).
	for id := range s.holding[w.Id] {
		p := clonePlacement(s.placements[id])
		dropCopyFields(p, w.Id)
		s.placements[id] = p
	}
	delete(s.holding, w.Id)
	v := s.view(w.Id)
	v.Reserved, v.Held, v.PendingRequests, v.PendingPages = 0, 0, 0, 0
	s.touch(w.Id)
	s.recover(w.Id, w.Incarnation, idx, evs)
	return nw
}

// recover plans the requests still placed on worker id, which is out of
// service. With no eligible worker they stay where they are, RECOVERING, and
// recoverOrphans plans them when a worker becomes eligible.
func (s *state) recover(id string, incarnation uint64, idx uint64, evs eventSink) {
	reqIDs := sortedKeys(s.serving[id])
	if len(reqIDs) == 0 {
		return
	}
	reqs := make([]policy.Interrupted, len(reqIDs))
	// What the MarkFailed's leader gathered of each copy's prefix, by
	// request and holder.
	var prefixes map[string]map[string]uint32
	if len(s.copyPrefixes) > 0 {
		prefixes = make(map[string]map[string]uint32)
		for _, cp := range s.copyPrefixes {
			if prefixes[cp.RequestId] == nil {
				prefixes[cp.RequestId] = make(map[string]uint32)
			}
			prefixes[cp.RequestId][cp.Holder] = cp.Tokens
		}
	}
	// The migrations the failure interrupted, as they were.
	var migrations []*pb.Placement
	for i, rid := range reqIDs {
		p := s.placements[rid]
		reqs[i] = policy.Interrupted{RequestID: rid, Holder: p.HolderId, Replicas: p.ReplicaHolders, PromptTokens: p.PromptTokens, MaxTokens: p.MaxTokens}
		if byHolder := prefixes[rid]; byHolder != nil && p.HolderId != "" {
			reqs[i].Checkpointed = make([]uint32, 1+len(p.ReplicaHolders))
			reqs[i].Checkpointed[0] = byHolder[p.HolderId]
			for k, h := range p.ReplicaHolders {
				reqs[i].Checkpointed[1+k] = byHolder[h]
			}
		}
		if migrating(p) {
			reqs[i].MigrationTarget = p.MigrationTarget
			migrations = append(migrations, p)
			removeFrom(s.incoming, p.MigrationTarget, rid)
		}
	}
	plan := policy.PlanRecovery(s.strategyPolicy(), s.views, reqs)
	if plan == nil {
		for _, rid := range reqIDs {
			if p := s.placements[rid]; p.State != pb.PlacementState_PLACEMENT_STATE_RECOVERING {
				s.placements[rid] = clearMigration(p, pb.PlacementState_PLACEMENT_STATE_RECOVERING)
			}
		}
		// Not reached while a destination is in full service (the plan
		// would take it), but a destination must always hear the end.
		for _, p := range migrations {
			s.migrationEvent(evs, idx, pb.Migration_STAGE_ABORTED, s.placements[p.RequestId], p.WorkerId, p.WorkerIncarnation,
				p.MigrationTarget, p.MigrationTargetIncarnation, reasonSource+id+"; no worker can take the request")
		}
		return
	}
	rp := &pb.RecoveryPlan{Id: s.nextRecoveryID, FailedWorker: id, FailedIncarnation: incarnation,
		FailedUnixNano: s.lastStamp, Index: idx}
	s.nextRecoveryID++
	// copied: the interrupted migrations whose destination's copy the plan
	// reuses (only those are asked about, below).
	var copied map[string]bool
	if len(migrations) > 0 {
		copied = make(map[string]bool, len(migrations))
	}
	// The assignments in one allocation: a node's plan has hundreds.
	slab := make([]pb.RecoveryAssignment, len(plan))
	rp.Assignments = make([]*pb.RecoveryAssignment, 0, len(plan))
	for k, a := range plan {
		p := clearMigration(s.placements[a.RequestID], pb.PlacementState_PLACEMENT_STATE_RECOVERING)
		target := s.workers[s.ids[a.Target]]
		if a.MigrationCopy {
			copied[a.RequestID] = true
		}
		// The old checkpoint is consumed (reuse) or useless (recompute
		// elsewhere): release it, and give the request a holder anew.
		s.dropHolder(p)
		removeFrom(s.serving, p.WorkerId, p.RequestId)
		p.WorkerId, p.WorkerIncarnation = target.Id, target.Incarnation
		p.State = pb.PlacementState_PLACEMENT_STATE_RECOVERING
		p.Epoch++
		s.placeHolder(p, a.Target)
		addTo(s.serving, target.Id, p.RequestId)
		s.placements[p.RequestId] = p
		ra := &slab[k]
		ra.RequestId, ra.TargetWorker, ra.Mode = a.RequestID, target.Id, pb.RecoveryMode(a.Mode)
		ra.CheckpointHolder, ra.Rebalanced, ra.NewHolder, ra.MigrationCopy = a.Holder, a.Rebalanced, p.HolderId, a.MigrationCopy
		ra.NewReplicas = p.ReplicaHolders
		rp.Assignments = append(rp.Assignments, ra)
	}
	s.recoveries = append(s.recoveries, rp)
	if len(s.recoveries) > recoveriesKept {
		s.recoveries = s.recoveries[len(s.recoveries)-recoveriesKept:]
	}
	s.emit(evs, idx, &pb.Event{Body: &pb.Event_RecoveryPlan{RecoveryPlan: rp}})
	// The events in three allocations, not three an assignment.
	events := make([]pb.Event, len(rp.Assignments))
	bodies := make([]pb.Event_PlacementMoved, len(rp.Assignments))
	moved := make([]pb.PlacementMoved, len(rp.Assignments))
	for k, a := range rp.Assignments {
		m := &moved[k]
		m.Placement, m.FromWorker, m.Reason = s.placements[a.RequestId], id, "recovery"
		bodies[k].PlacementMoved = m
		events[k].Body = &bodies[k]
		s.emit(evs, idx, &events[k])
	}
	// A destination whose copy the plan reuses learns it from its
	// assignment; the others free their copies.
	for _, p := range migrations {
		if !copied[p.RequestId] {
			np := s.placements[p.RequestId]
			s.migrationEvent(evs, idx, pb.Migration_STAGE_ABORTED, np, p.WorkerId, p.WorkerIncarnation,
				p.MigrationTarget, p.MigrationTargetIncarnation,
				fmt.Sprintf("%s%s; the request recovers on %s", reasonSource, id, np.WorkerId))
		}
	}
}

// recoverOrphans plans the requests left on out-of-service workers when no
// worker was eligible to take them: on FAILED and LEFT rows, and on the rows
// of new incarnations not yet eligible (a restart in LOADING_DRAFT).
func (s *state) recoverOrphans(idx uint64, evs eventSink) {
	for _, id := range s.ids {
		if len(s.serving[id]) == 0 {
			continue
		}
		w := s.workers[id]
		switch {
		case w.Phase == pb.WorkerPhase_WORKER_PHASE_FAILED || w.Phase == pb.WorkerPhase_WORKER_PHASE_LEFT:
			s.recover(id, w.Incarnation, idx, evs)
		case !eligible(w):
			if inc, ok := s.leftover(w); ok {
				s.recover(id, inc, idx, evs)
			}
		}
	}
}

// leftover says whether requests still placed on w's id belong to an earlier
// incarnation (RECOVERING: nothing was eligible when it failed), and which.
// A row is never eligible while it has such requests (becoming eligible
// plans them), and nothing is placed on a row before it is eligible, so the
// requests on a row are all left over or all its own: one tells.
func (s *state) leftover(w *pb.Worker) (uint64, bool) {
	first := ""
	for rid := range s.serving[w.Id] {
		// The smallest id, whatever the iteration order.
		if first == "" || rid < first {
			first = rid
		}
	}
	if first == "" {
		return 0, false
	}
	inc := s.placements[first].WorkerIncarnation
	return inc, inc != w.Incarnation
}

// --- snapshot ---

func (s *state) capture(applied uint64) *pb.Snapshot {
	out := &pb.Snapshot{
		AppliedIndex: applied, Strategy: s.strategy, Lambda: s.lambda, Migration: s.migration, CheckpointReplicas: s.replicas,
		NextRecoveryId: s.nextRecoveryID, LastStampUnixNano: s.lastStamp,
		Workers:    make([]*pb.Worker, 0, len(s.ids)),
		Placements: make([]*pb.Placement, 0, len(s.placements)),
		Recoveries: append([]*pb.RecoveryPlan(nil), s.recoveries...),
		Completed:  s.completedOldestFirst(),
	}
	for i, id := range s.ids {
		out.Workers = append(out.Workers, s.workers[id])
		if l, ok := s.loads[id]; ok {
			out.Loads = append(out.Loads, l)
		}
		if v := s.views[i]; v.PendingRequests > 0 || v.PendingPages > 0 {
			out.Pending = append(out.Pending, &pb.PendingDispatch{WorkerId: id, Requests: v.PendingRequests, Pages: v.PendingPages})
		}
	}
	for _, p := range s.placements {
		out.Placements = append(out.Placements, p)
	}
	for _, ss := range s.sessions {
		out.Sessions = append(out.Sessions, ss)
	}
	for rid, sid := range s.sessionOf {
		out.SessionPlacements = append(out.SessionPlacements, &pb.SessionPlacement{RequestId: rid, SessionId: sid})
	}
	return out
}

func restoreState(snap *pb.Snapshot) (*state, error) {
	s := newState()
	s.strategy, s.lambda, s.migration = snap.Strategy, snap.Lambda, snap.Migration
	if snap.CheckpointReplicas > 0 {
		s.replicas = snap.CheckpointReplicas
	}
	s.nextRecoveryID, s.lastStamp = snap.NextRecoveryId, snap.LastStampUnixNano
	for _, w := range snap.Workers {
		s.putWorker(w)
	}
	for _, l := range snap.Loads {
		v := s.view(l.WorkerId)
		if v == nil {
			return nil, fmt.Errorf("fsm: snapshot has load for unknown worker %q", l.WorkerId)
		}
		s.loads[l.WorkerId] = l
		v.QueueWaitMs, v.KVPagesTotal, v.KVPagesUsed = l.QueueWaitMs, l.KvPagesTotal, l.KvPagesUsed
		s.touch(l.WorkerId)
		v.QueueHeadPages, v.QueuedPages, v.Running, v.Waiting = l.QueueHeadPages, l.QueuedPages, l.Running, l.Waiting
		v.HighPriority = l.HighPriority
	}
	for _, pd := range snap.Pending {
		v := s.view(pd.WorkerId)
		if v == nil {
			return nil, fmt.Errorf("fsm: snapshot has pending dispatches for unknown worker %q", pd.WorkerId)
		}
		v.PendingRequests, v.PendingPages = pd.Requests, pd.Pages
	}
	for _, p := range snap.Placements {
		s.placements[p.RequestId] = p
		addTo(s.serving, p.WorkerId, p.RequestId)
		if p.HolderId != "" {
			s.reserve(p.HolderId, p.ReservedBytes)
			addTo(s.holding, p.HolderId, p.RequestId)
		}
		for _, id := range p.ReplicaHolders {
			s.reserve(id, p.ReservedBytes)
			addTo(s.holding, id, p.RequestId)
		}
		if migrating(p) {
			addTo(s.incoming, p.MigrationTarget, p.RequestId)
		}
	}
	for _, ss := range snap.Sessions {
		s.sessions[ss.Id] = ss
		s.noteDeadline(ss)
	}
	for _, sp := range snap.SessionPlacements {
		if _, ok := s.sessions[sp.SessionId]; !ok {
			return nil, fmt.Errorf("fsm: snapshot has placement %q in unknown session %q", sp.RequestId, sp.SessionId)
		}
		if _, ok := s.placements[sp.RequestId]; !ok {
			return nil, fmt.Errorf("fsm: snapshot has session %q holding unknown placement %q", sp.SessionId, sp.RequestId)
		}
		s.sessionOf[sp.RequestId] = sp.SessionId
		addTo(s.sessionReqs, sp.SessionId, sp.RequestId)
	}
	s.recoveries = snap.Recoveries
	for _, id := range snap.Completed {
		s.rememberCompleted(id)
	}
	s.reindex()
	return s, nil
}
