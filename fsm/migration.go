package fsm

import (
	"fmt"
	"sort"
	"strings"

	"google.golang.org/protobuf/proto"

	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Live migration (Llumnix) in the tables.
//
// A RUNNING placement at epoch e goes MIGRATING towards a destination
// (MigrateCmd, Migration STARTED): its source keeps serving it while the
// pages copy, and its epoch stays e. FinishMigrationCmd then either commits
// (the placement moves to the destination at epoch e+1, RUNNING, Migration
// COMMITTED and PlacementMoved) or aborts (RUNNING on the source at epoch e,
// Migration ABORTED). The tables end a migration themselves when one of its
// ends goes:
//   - the destination leaves FULL_SERVICE (fails, drains, leaves, restarts):
//     abort, the request stays on its source untouched;
//   - the source fails: the ordinary recovery plan, in which under the lumen
//     strategy the destination reuses the pages copied so far
//     (RecoveryAssignment.migration_copy); when the plan puts the request
//     elsewhere, Migration ABORTED follows the plan so the destination frees
//     its copy;
//   - the request completes (Complete, or its session ends): the placement
//     goes as any does, and Migration ABORTED tells the destination.

// The reasons the tables and the leader give a migration's end, or the
// words they start with; MigrationCause sorts reasons by them.
const (
	// ReasonOperator is the reason of an operator's migration.
	ReasonOperator = "operator"
	// ReasonTimeout starts the reason of the leader's stage-timeout abort.
	ReasonTimeout = "stage timeout"
	// The request ended while it migrated.
	ReasonCompleted        = "request completed"
	ReasonSessionExpired   = "session expired"
	ReasonSessionDestroyed = "session destroyed"
	// reasonDestination and reasonSource start the reasons of the aborts
	// the tables make when a migration's destination leaves full service
	// or its source fails.
	reasonDestination = "destination left: "
	reasonSource      = "source failed: "
)

// MigrationCause sorts a Migration event by its reason, for metrics.
// STARTED: balance, drain, operator or other. COMMITTED: committed.
// ABORTED: timeout (the leader's stage timeout), destination (it left full
// service), source_failed, finished (the request completed or its session
// ended), or worker (an abort a worker asked for: the destination ran out of
// pages, the copy failed).
func MigrationCause(m *pb.Migration) string {
	r := m.Reason
	switch m.Stage {
	case pb.Migration_STAGE_STARTED:
		for _, c := range []string{policy.ReasonBalance, policy.ReasonDrain, ReasonOperator} {
			if strings.HasPrefix(r, c) {
				return c
			}
		}
		return "other"
	case pb.Migration_STAGE_COMMITTED:
		return "committed"
	case pb.Migration_STAGE_ABORTED:
		switch {
		case strings.HasPrefix(r, ReasonTimeout):
			return "timeout"
		case strings.HasPrefix(r, reasonDestination):
			return "destination"
		case strings.HasPrefix(r, reasonSource):
			return "source_failed"
		case r == ReasonCompleted || r == ReasonSessionExpired || r == ReasonSessionDestroyed:
			return "finished"
		}
		return "worker"
	}
	return "unknown"
}

// migrating reports whether p is MIGRATING.
func migrating(p *pb.Placement) bool { return p.State == pb.PlacementState_PLACEMENT_STATE_MIGRATING }

// clearMigration returns a copy of p, RUNNING or in state st, without a
// migration target.
func clearMigration(p *pb.Placement, st pb.PlacementState) *pb.Placement {
	np := clonePlacement(p)
	np.State = st
	np.MigrationTarget, np.MigrationTargetIncarnation, np.MigrationStartedUnixNano = "", 0, 0
	return np
}

// migrationEvent emits a Migration event for placement p (the row as the
// command left it) of the migration that was from from/fromInc to
// to/toInc.
func (s *state) migrationEvent(evs eventSink, idx uint64, stage pb.Migration_Stage, p *pb.Placement,
	from string, fromInc uint64, to string, toInc uint64, reason string) {
	s.emit(evs, idx, &pb.Event{Body: &pb.Event_Migration{Migration: &pb.Migration{
		Stage: stage, Placement: p, FromWorker: from, FromIncarnation: fromInc,
		ToWorker: to, ToIncarnation: toInc, Reason: reason}}})
}

func (s *state) migrate(c *pb.MigrateCmd, idx uint64, evs eventSink) Result {
	if c.RequestId == "" || c.ToWorker == "" {
		return Result{Err: fmt.Errorf("%w: a migration needs a request id and a destination (request %q, to %q)", ErrInvalid, c.RequestId, c.ToWorker)}
	}
	p, err := s.placementFor(c.RequestId, c.Epoch)
	if err != nil {
		return Result{Err: err}
	}
	if migrating(p) && p.MigrationTarget == c.ToWorker && p.MigrationTargetIncarnation == c.ToIncarnation {
		return Result{Placement: p} // a retried command
	}
	if p.State != pb.PlacementState_PLACEMENT_STATE_RUNNING {
		what := phaseOf(p)
		if migrating(p) {
			what += " to " + p.MigrationTarget
		}
		return Result{Err: fmt.Errorf("%w: request %q is %s; only a RUNNING placement migrates", ErrPlacementState, c.RequestId, what)}
	}
	if c.ToWorker == p.WorkerId {
		return Result{Err: fmt.Errorf("%w: request %q already runs on %s, the destination named", ErrInvalid, c.RequestId, c.ToWorker)}
	}
	w, ok := s.workers[c.ToWorker]
	switch {
	case !ok:
		return Result{Err: fmt.Errorf("%w: destination %q", ErrUnknownWorker, c.ToWorker)}
	case w.Incarnation != c.ToIncarnation:
		return Result{Err: fmt.Errorf("%w: destination %s incarnation %d, table has %d", ErrStaleIncarnation, c.ToWorker, c.ToIncarnation, w.Incarnation)}
	case !eligible(w):
		return Result{Err: fmt.Errorf("%w: destination %s is %s; a migration goes to a worker in FULL_SERVICE", ErrNotEligible, c.ToWorker, phaseName(w.Phase))}
	}
	np := proto.Clone(p).(*pb.Placement)
	np.State = pb.PlacementState_PLACEMENT_STATE_MIGRATING
	np.MigrationTarget, np.MigrationTargetIncarnation = w.Id, w.Incarnation
	np.MigrationStartedUnixNano = s.lastStamp
	s.placements[np.RequestId] = np
	addTo(s.incoming, w.Id, np.RequestId)
	s.migrationEvent(evs, idx, pb.Migration_STAGE_STARTED, np, p.WorkerId, p.WorkerIncarnation, w.Id, w.Incarnation, c.Reason)
	return Result{Placement: np}
}

func (s *state) finishMigration(c *pb.FinishMigrationCmd, idx uint64, evs eventSink) Result {
	if c.RequestId == "" || c.ToWorker == "" {
		return Result{Err: fmt.Errorf("%w: finishing a migration needs the request id and the destination (request %q, to %q)", ErrInvalid, c.RequestId, c.ToWorker)}
	}
	p, ok := s.placements[c.RequestId]
	if ok && c.Commit && p.Epoch == c.Epoch+1 && p.WorkerId == c.ToWorker && p.WorkerIncarnation == c.ToIncarnation &&
		p.State != pb.PlacementState_PLACEMENT_STATE_RECOVERING {
		// A retried commit: the placement moved to this destination at the
		// next epoch, and only a commit leaves a move RUNNING (or
		// MIGRATING on) there; a recovery leaves it RECOVERING.
		return Result{Placement: p}
	}
	p, err := s.placementFor(c.RequestId, c.Epoch)
	if err != nil {
		return Result{Err: err}
	}
	if !c.Commit && p.State == pb.PlacementState_PLACEMENT_STATE_RUNNING {
		return Result{Placement: p} // already aborted (a retry), or never started
	}
	if !migrating(p) {
		return Result{Err: fmt.Errorf("%w: request %q is %s, not MIGRATING", ErrPlacementState, c.RequestId, phaseOf(p))}
	}
	if p.MigrationTarget != c.ToWorker || p.MigrationTargetIncarnation != c.ToIncarnation {
		return Result{Err: fmt.Errorf("%w: request %q migrates to %s incarnation %d at epoch %d, not to %s incarnation %d (an earlier migration's)",
			ErrStaleMigration, c.RequestId, p.MigrationTarget, p.MigrationTargetIncarnation, p.Epoch, c.ToWorker, c.ToIncarnation)}
	}
	if !c.Commit {
		return Result{Placement: s.abortMigration(p, c.Reason, idx, evs)}
	}
	return Result{Placement: s.commitMigration(p, c.Reason, idx, evs)}
}

// placementFor returns request id's placement when it is at epoch, or the
// error that says why not.
func (s *state) placementFor(id string, epoch uint64) (*pb.Placement, error) {
	p, ok := s.placements[id]
	if !ok {
		if _, done := s.completedSet[id]; done {
			return nil, fmt.Errorf("%w: %q", ErrCompleted, id)
		}
		return nil, fmt.Errorf("%w: %q", ErrUnknownPlacement, id)
	}
	if p.Epoch != epoch {
		return nil, fmt.Errorf("%w: request %q is at epoch %d on %s, the command names epoch %d", ErrStaleEpoch, id, p.Epoch, p.WorkerId, epoch)
	}
	return p, nil
}

func phaseOf(p *pb.Placement) string {
	return pb.PlacementState_name[int32(p.State)][len("PLACEMENT_STATE_"):]
}

// abortMigration puts MIGRATING placement p back to RUNNING on its source.
func (s *state) abortMigration(p *pb.Placement, reason string, idx uint64, evs eventSink) *pb.Placement {
	np := clearMigration(p, pb.PlacementState_PLACEMENT_STATE_RUNNING)
	s.placements[np.RequestId] = np
	removeFrom(s.incoming, p.MigrationTarget, p.RequestId)
	s.migrationEvent(evs, idx, pb.Migration_STAGE_ABORTED, np, p.WorkerId, p.WorkerIncarnation,
		p.MigrationTarget, p.MigrationTargetIncarnation, reason)
	return np
}

// commitMigration moves MIGRATING placement p to its destination, at the
// next epoch. The checkpoint holders stay (their pages are the same prefix)
// unless one is the destination itself, which cannot hold its own request's
// checkpoint, or on the destination's node (issue 24: a copy never shares
// its serving worker's failure domain), or there was none: then the
// strategy's rule (h(r) under lumen) chooses every copy anew for the new
// serving worker.
func (s *state) commitMigration(p *pb.Placement, reason string, idx uint64, evs eventSink) *pb.Placement {
	dest := p.MigrationTarget
	np := clearMigration(p, pb.PlacementState_PLACEMENT_STATE_RUNNING)
	removeFrom(s.incoming, dest, p.RequestId)
	removeFrom(s.serving, p.WorkerId, p.RequestId)
	np.WorkerId, np.WorkerIncarnation = dest, p.MigrationTargetIncarnation
	np.Epoch++
	if np.HolderId == "" || s.copyNear(np, dest) {
		s.dropHolder(np)
		s.placeHolder(np, sort.SearchStrings(s.ids, dest))
	}
	addTo(s.serving, dest, np.RequestId)
	s.placements[np.RequestId] = np
	// The destination runs one more request than its last report says.
	// Its pages are not added: it allocated them before the commit, and
	// its reports count them.
	s.view(dest).PendingRequests++
	s.migrationEvent(evs, idx, pb.Migration_STAGE_COMMITTED, np, p.WorkerId, p.WorkerIncarnation, dest, np.WorkerIncarnation, reason)
	s.emit(evs, idx, &pb.Event{Body: &pb.Event_PlacementMoved{PlacementMoved: &pb.PlacementMoved{
		Placement: np, FromWorker: p.WorkerId, Reason: "migration"}}})
	return np
}

// copyNear reports whether a copy of p's checkpoint is on worker dest or
// in its failure domain.
func (s *state) copyNear(p *pb.Placement, dest string) bool {
	dv := s.view(dest)
	near := func(id string) bool {
		if id == dest {
			return true
		}
		v := s.view(id)
		return dv != nil && v != nil && policy.SameDomain(v, dv)
	}
	if near(p.HolderId) {
		return true
	}
	for _, id := range p.ReplicaHolders {
		if near(id) {
			return true
		}
	}
	return false
}

// abortIncoming aborts every migration into worker w, which is leaving
// FULL_SERVICE (going to phase): the requests stay on their sources.
func (s *state) abortIncoming(w *pb.Worker, phase pb.WorkerPhase, reason string, idx uint64, evs eventSink) {
	why := fmt.Sprintf("%s%s went %s", reasonDestination, w.Id, phaseName(phase))
	if reason != "" {
		why += ": " + reason
	}
	for _, id := range sortedKeys(s.incoming[w.Id]) {
		s.abortMigration(s.placements[id], why, idx, evs)
	}
}

// finishedMigrating tells the destination of MIGRATING placement p, which
// is being completed, that the migration is over.
func (s *state) finishedMigrating(p *pb.Placement, reason string, idx uint64, evs eventSink) {
	removeFrom(s.incoming, p.MigrationTarget, p.RequestId)
	s.migrationEvent(evs, idx, pb.Migration_STAGE_ABORTED, p, p.WorkerId, p.WorkerIncarnation,
		p.MigrationTarget, p.MigrationTargetIncarnation, reason)
}

// --- queries for the leader's migration loop and the operator ---

// Migration reports whether live migration for balance is on
// (SetStrategyCmd.migration). Drains migrate whatever it says.
func (f *FSM) Migration() bool {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.migration
}

// PlannedMigration is a migration the leader should propose.
type PlannedMigration struct {
	Cmd *pb.MigrateCmd
	// Drain: the source is DRAINING (otherwise the move is for balance).
	Drain bool
	// Redispatch: the request is queued at its source, no KV to copy
	// (policy.Migration.Redispatch).
	Redispatch bool
}

// PlanMigrations runs policy.PlanMigrations over the tables: drains always,
// balance when migration is on. order is the policy's request order (nil:
// shortest first). The answer reflects the applied index returned; Apply
// checks each command again when it commits.
func (f *FSM) PlanMigrations(order func(a, b *policy.Placed) int) ([]PlannedMigration, uint64) {
	return f.planMigrations(order, true)
}

// PlanDrains is PlanMigrations without balance: the drains alone (nil when
// no worker is DRAINING). The leader runs it as soon as it sees a worker
// go DRAINING, between its rounds (controller.DrainInterval).
func (f *FSM) PlanDrains(order func(a, b *policy.Placed) int) ([]PlannedMigration, uint64) {
	return f.planMigrations(order, false)
}

// Draining returns the ids of the DRAINING workers, sorted.
func (f *FSM) Draining() []string {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out []string
	for i := range f.st.views {
		if f.st.views[i].Draining {
			out = append(out, f.st.views[i].ID)
		}
	}
	return out
}

func (f *FSM) planMigrations(order func(a, b *policy.Placed) int, balance bool) ([]PlannedMigration, uint64) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	s := f.st
	draining := false
	for i := range s.views {
		draining = draining || s.views[i].Draining
	}
	balance = balance && s.migration
	if !balance && !draining {
		return nil, f.applied.get()
	}
	// The requests each worker's last report lists as queued (no KV
	// cache there yet).
	queued := map[string]bool{}
	for _, l := range s.loads {
		for _, id := range l.Queued {
			queued[id] = true
		}
	}
	ps := make([]policy.Placed, 0, len(s.placements))
	for _, p := range s.placements {
		pl := policy.Placed{RequestID: p.RequestId, Worker: p.WorkerId, PromptTokens: p.PromptTokens,
			MaxTokens: p.MaxTokens, Epoch: p.Epoch, MigrationTarget: p.MigrationTarget, High: policy.HighPriority(p.Priority)}
		switch p.State {
		case pb.PlacementState_PLACEMENT_STATE_RUNNING:
			pl.State = policy.PlacedRunning
		case pb.PlacementState_PLACEMENT_STATE_MIGRATING:
			pl.State = policy.PlacedMigrating
		default:
			pl.State = policy.PlacedRecovering
		}
		// A request left on an earlier incarnation of its worker's id is
		// not the current one's to move.
		if w := s.workers[p.WorkerId]; w == nil || w.Incarnation != p.WorkerIncarnation {
			pl.State = policy.PlacedRecovering
		}
		// Queued: listed so in its worker's last report, or dispatched
		// there since (both are leader stamps), or no report yet. A
		// placement moved in (a commit, a recovery) keeps its creation
		// stamp, so only a move of a request created after the report is
		// taken for queued: too cautious, never wrong about a cache.
		if l := s.loads[p.WorkerId]; queued[p.RequestId] || l == nil || p.CreatedUnixNano >= l.ReportUnixNano {
			pl.Queued = true
		}
		ps = append(ps, pl)
	}
	link := make([]uint64, len(s.ids))
	for i, id := range s.ids {
		link[i] = policy.DrainLinkPages(s.workers[id].GetCapacity().GetKvBytesPerToken())
	}
	plan := policy.PlanMigrations(s.views, ps, policy.MigrationParams{Balance: balance, Order: order, LinkPages: link, GrowthPages: policy.DefaultGrowthPages})
	out := make([]PlannedMigration, len(plan))
	for i, m := range plan {
		to := s.workers[s.ids[m.To]]
		out[i] = PlannedMigration{Drain: m.Drain, Redispatch: m.Redispatch, Cmd: &pb.MigrateCmd{RequestId: m.RequestID, Epoch: m.Epoch,
			ToWorker: to.Id, ToIncarnation: to.Incarnation, Reason: m.Reason(s.views)}}
	}
	return out, f.applied.get()
}

// MigrationsStartedBefore returns an abort for every MIGRATING placement
// whose migration started (by its leader stamp) before cutoff, sorted by
// request id: the leader's stage timeout.
func (f *FSM) MigrationsStartedBefore(cutoff int64, reason string) []*pb.FinishMigrationCmd {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var out []*pb.FinishMigrationCmd
	for _, reqs := range f.st.incoming {
		for id := range reqs {
			p := f.st.placements[id]
			if p.MigrationStartedUnixNano < cutoff {
				out = append(out, &pb.FinishMigrationCmd{RequestId: id, Epoch: p.Epoch, ToWorker: p.MigrationTarget,
					ToIncarnation: p.MigrationTargetIncarnation, Reason: reason})
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].RequestId < out[j].RequestId })
	return out
}

// OperatorMigration builds the command for an operator's migration of
// request id to worker to; to empty picks the freest eligible worker other
// than the request's (policy.MigrationDestination). Apply checks the rest.
func (f *FSM) OperatorMigration(id, to string) (*pb.MigrateCmd, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	s := f.st
	p, ok := s.placements[id]
	if !ok {
		if _, done := s.completedSet[id]; done {
			return nil, fmt.Errorf("%w: %q", ErrCompleted, id)
		}
		return nil, fmt.Errorf("%w: %q", ErrUnknownPlacement, id)
	}
	if to == "" {
		from := sort.SearchStrings(s.ids, p.WorkerId)
		d := policy.MigrationDestination(s.views, from)
		if d < 0 {
			return nil, fmt.Errorf("%w: no worker other than %s is in full service to migrate %q to", ErrNotEligible, p.WorkerId, id)
		}
		to = s.ids[d]
	}
	var inc uint64
	if w := s.workers[to]; w != nil {
		inc = w.Incarnation
	}
	return &pb.MigrateCmd{RequestId: id, Epoch: p.Epoch, ToWorker: to, ToIncarnation: inc, Reason: ReasonOperator}, nil
}
