package controller

import (
	"context"
	"strconv"
	"time"

	"github.com/hashicorp/raft"
	"github.com/hashicorp/serf/serf"

	"github.com/lumen-project/lumen/fsm"
	"github.com/lumen-project/lumen/internal/gossip"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// reconcileInterval is how often the leader re-reads Serf's members, in case
// an event was missed.
const reconcileInterval = 5 * time.Second

// monitorLeadership starts the leader's work when this replica gains
// leadership and stops it when it loses it.
func (n *Node) monitorLeadership() {
	for {
		select {
		case isLeader := <-n.leaderNotify:
			if isLeader {
				n.startLeading()
			} else {
				n.stopLeading()
			}
		case <-n.shutdownCh:
			return
		}
	}
}

func (n *Node) startLeading() {
	n.mu.Lock()
	if n.leader != nil {
		n.mu.Unlock()
		return
	}
	ls := &leaderState{ready: make(chan struct{}), stop: make(chan struct{})}
	ls.proposer = newProposer(n.raft, n.cfg.BatchMax, n.cfg.BatchInflight, n.metrics, ls.stop)
	ls.reads = newReadBatcher(n, ls)
	// Add before publishing: stopLeading (Shutdown) may take ls the moment
	// the lock is released and Wait on it.
	ls.done.Add(3)
	n.leader = ls
	n.mu.Unlock()
	n.metrics.elections.Inc()
	n.log.Info("gained leadership", "term", n.raft.Stats()["term"])
	go func() { defer ls.done.Done(); ls.proposer.run() }()
	go func() { defer ls.done.Done(); ls.reads.run() }()
	go func() { defer ls.done.Done(); n.leaderLoop(ls) }()
}

func (n *Node) stopLeading() {
	n.mu.Lock()
	ls := n.leader
	n.leader = nil
	n.mu.Unlock()
	if ls == nil {
		return
	}
	close(ls.stop)
	ls.done.Wait()
	n.log.Info("lost leadership")
}

// leaderLoop runs leader-only work: it first waits for a Barrier, so the FSM
// holds every entry of earlier terms, and commits a no-op command so the
// FSM's applied index reaches the commit index; then it serves, turns
// Serf's view of workers into Raft commands, expires sessions, and runs the
// migration rounds (migration.go).
func (n *Node) leaderLoop(ls *leaderState) {
	for {
		if err := n.raft.Barrier(n.cfg.RequestTimeout).Error(); err == nil {
			break
		} else {
			n.log.Warn("barrier failed", "error", err)
		}
		select {
		case <-ls.stop:
			return
		case <-time.After(100 * time.Millisecond):
		}
	}
	for {
		ctx, cancel := context.WithTimeout(context.Background(), n.cfg.RequestTimeout)
		// It also forgives the sessions and the migrations the time
		// no leader stamped (fsm's NoopCmd.new_leader): no gateway could
		// renew and no migration could commit, and this replica's clock
		// may be ahead of the last leader's.
		_, err := ls.proposer.propose(ctx, fsm.NewLeaderCmd())
		cancel()
		if err == nil {
			break
		}
		select {
		case <-ls.stop:
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
	close(ls.ready)
	n.log.Info("leader ready", "applied", n.fsm.Applied())

	ticker := time.NewTicker(reconcileInterval)
	defer ticker.Stop()
	sessions := time.NewTicker(sessionCheckInterval)
	defer sessions.Stop()
	migrations := time.NewTicker(n.cfg.MigrationInterval)
	defer migrations.Stop()
	drains := time.NewTicker(min(DrainInterval, n.cfg.MigrationInterval))
	defer drains.Stop()
	draining := map[string]bool{}
	n.reconcile(ls)
	for {
		select {
		case <-ls.stop:
			return
		case <-n.memberCh:
			n.reconcile(ls)
		case <-ticker.C:
			n.reconcile(ls)
		case <-sessions.C:
			n.expireSessions(ls)
		case <-migrations.C:
			n.migrationRound(ls)
		case <-drains.C:
			n.drainStarts(ls, draining)
		}
	}
}

// sessionCheckInterval is how often the leader looks for a session past its
// deadline: a session expires at most this long after its TTL runs out,
// even when nothing else is written.
const sessionCheckInterval = 250 * time.Millisecond

// stampInterval is the longest the leader leaves the applied stamps behind
// its clock while a migration is in flight, and the least it waits while
// only sessions exist: a new leader forgives the time from the last stamp
// to its own (fsm's NoopCmd.new_leader), so without it an idle term would
// count for nothing and elections more often than once per TTL would keep
// a dead gateway's session forever.
const stampInterval = 2 * sessionCheckInterval

// stampLimit is how old the last stamp may get before the leader commits a
// no-op to move it: stampInterval while a migration is in flight, half the
// shortest session TTL (at least stampInterval) while only sessions exist,
// none otherwise (0). Half the TTL, not a fixed 500 ms (issue 26): a live
// gateway renews every third of its TTL, so an idle cluster's stamps move
// with the renewals and the leader writes nothing of its own (it wrote 2
// no-ops a second); an election forgives at most half a TTL of the term
// before it, so a dead gateway's session still expires while terms last
// longer than that.
func stampLimit(minTTL int64, migrating bool) time.Duration {
	switch {
	case migrating:
		return stampInterval
	case minTTL > 0:
		return max(stampInterval, time.Duration(minTTL)/2)
	}
	return 0
}

// expireSessions commits a no-op once a session's deadline has passed on the
// leader's clock, or once the last stamp is older than stampLimit. Apply
// decides expiry by the stamps of the commands it applies; the no-op
// carries a stamp past the deadline, so an idle cluster expires the
// sessions of dead gateways too.
func (n *Node) expireSessions(ls *leaderState) {
	now := time.Now().UnixNano()
	due := n.fsm.NextSessionExpiry()
	age, minTTL, migrating := n.fsm.StampAge(now)
	limit := stampLimit(minTTL, migrating)
	if (due == 0 || now <= due) && (limit == 0 || age < int64(limit)) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), n.cfg.RequestTimeout)
	defer cancel()
	if _, err := ls.proposer.propose(ctx, &pb.Command{Body: &pb.Command_Noop{Noop: &pb.NoopCmd{}}}); err != nil {
		n.log.Warn("session expiry no-op not committed", "error", err)
	}
}

// reconcile brings Raft in line with Serf: failed or departed workers are
// marked failed, new controllers become voters, departed ones are removed.
func (n *Node) reconcile(ls *leaderState) {
	cfgFuture := n.raft.GetConfiguration()
	if err := cfgFuture.Error(); err != nil {
		return
	}
	voters := map[raft.ServerID]bool{}
	for _, s := range cfgFuture.Configuration().Servers {
		voters[s.ID] = true
	}
	for _, m := range n.serf.Members() {
		switch m.Tags[gossip.TagRole] {
		case gossip.RoleWorker:
			if m.Status == serf.StatusFailed || m.Status == serf.StatusLeft {
				n.markWorkerFailed(ls, m)
			}
		case gossip.RoleController:
			id := raft.ServerID(m.Name)
			switch {
			case m.Status == serf.StatusAlive && !voters[id] && m.Tags[gossip.TagRaftAddr] != "":
				n.log.Info("adding controller as voter", "id", id)
				if err := n.raft.AddVoter(id, raft.ServerAddress(m.Tags[gossip.TagRaftAddr]), 0, n.cfg.RequestTimeout).Error(); err != nil {
					n.log.Warn("add voter failed", "id", id, "error", err)
				}
			case m.Status == serf.StatusLeft && voters[id] && id != raft.ServerID(n.cfg.NodeID):
				n.log.Info("removing departed controller", "id", id)
				if err := n.raft.RemoveServer(id, 0, n.cfg.RequestTimeout).Error(); err != nil {
					n.log.Warn("remove server failed", "id", id, "error", err)
				}
			}
		}
	}
}

func (n *Node) markWorkerFailed(ls *leaderState, m serf.Member) {
	inc, _ := strconv.ParseUint(m.Tags[gossip.TagIncarnation], 10, 64)
	w := n.fsm.Worker(m.Name)
	if w == nil || w.Incarnation != inc {
		return
	}
	if w.Phase == pb.WorkerPhase_WORKER_PHASE_FAILED || w.Phase == pb.WorkerPhase_WORKER_PHASE_LEFT {
		return
	}
	reason := "serf: member " + m.Status.String()
	n.log.Info("marking worker failed", "worker", m.Name, "incarnation", inc, "reason", reason)
	ctx, cancel := context.WithTimeout(context.Background(), n.cfg.RequestTimeout)
	defer cancel()
	if _, err := ls.proposer.propose(ctx, &pb.Command{Body: &pb.Command_MarkFailed{MarkFailed: &pb.MarkFailedCmd{
		WorkerId: m.Name, Incarnation: inc, Reason: reason, Checkpointed: n.copyPrefixes(ctx, m.Name)}}}); err != nil {
		n.log.Warn("mark failed not committed", "worker", m.Name, "error", err)
	}
}

// handleSerfEvents bootstraps when enough controllers appear and wakes the
// leader loop on membership changes.
func (n *Node) handleSerfEvents() {
	for {
		select {
		case ev := <-n.serfEvents:
			if _, ok := ev.(serf.MemberEvent); !ok {
				continue
			}
			n.maybeBootstrap()
			select {
			case n.memberCh <- struct{}{}:
			default:
			}
		case <-n.shutdownCh:
			return
		}
	}
}

// observe keeps the Raft gauges current.
func (n *Node) observe() {
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			n.metrics.raftState.Set(float64(n.raft.State()))
			n.metrics.applied.Set(float64(n.fsm.Applied()))
			n.metrics.commit.Set(float64(n.raft.CommitIndex()))
			n.metrics.term.Set(float64(n.raft.CurrentTerm()))
		case <-n.shutdownCh:
			return
		}
	}
}
