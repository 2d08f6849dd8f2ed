package controller

// Live migration on the leader: the scheduling round (Llumnix's), the stage
// timeout, and the migration metrics, which every replica derives from the
// events of the log it applied.

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/lumen-project/lumen/fsm"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// migrationRound is one round of the leader's migration work: abort the
// migrations past MigrationTimeout, then propose what PlanMigrations
// decides (drains always; balance when migration is on). Apply checks every
// command again, so a decision the log overtook meanwhile is refused, not
// applied.
func (n *Node) migrationRound(ls *leaderState) {
	cutoff := time.Now().Add(-n.cfg.MigrationTimeout).UnixNano()
	aborts := n.fsm.MigrationsStartedBefore(cutoff, fmt.Sprintf("%s: not committed within %s of its start", fsm.ReasonTimeout, n.cfg.MigrationTimeout))
	cmds := make([]*pb.Command, 0, len(aborts))
	for _, c := range aborts {
		cmds = append(cmds, &pb.Command{Body: &pb.Command_FinishMigration{FinishMigration: c}})
	}
	n.proposeAll(ls, "migration timeout", cmds)

	plan, _ := n.fsm.PlanMigrations(nil)
	cmds = cmds[:0]
	for _, m := range plan {
		cmds = append(cmds, &pb.Command{Body: &pb.Command_Migrate{Migrate: m.Cmd}})
	}
	n.proposeAll(ls, "migrate", cmds)
}

// DrainInterval is how often the leader looks for a worker newly DRAINING
// between its rounds: it plans that drain at once (PlanDrains), so a drain
// starts within DrainInterval of the phase change, not up to a round
// later. What a drain could not place then (no destination with room, a
// slot or link left) waits for the rounds, as before: retrying every
// DrainInterval would turn a destination's refusals into a churn of
// commits.
const DrainInterval = 50 * time.Millisecond

// drainStarts plans the drains of the workers that went DRAINING since the
// last call (draining is the set it saw then, updated).
func (n *Node) drainStarts(ls *leaderState, draining map[string]bool) {
	now := n.fsm.Draining()
	fresh := false
	for _, id := range now {
		fresh = fresh || !draining[id]
	}
	clear(draining)
	for _, id := range now {
		draining[id] = true
	}
	if fresh {
		n.drainRound(ls)
	}
}

// drainRound proposes the migrations of the DRAINING workers' requests
// (nothing when none drains).
func (n *Node) drainRound(ls *leaderState) {
	plan, _ := n.fsm.PlanDrains(nil)
	cmds := make([]*pb.Command, 0, len(plan))
	for _, m := range plan {
		cmds = append(cmds, &pb.Command{Body: &pb.Command_Migrate{Migrate: m.Cmd}})
	}
	n.proposeAll(ls, "drain", cmds)
}

// proposeAll proposes cmds together (the proposer batches them into one
// entry) and logs the refusals: a decision made on a table the log has
// since changed is refused by Apply, and the next round decides again.
func (n *Node) proposeAll(ls *leaderState, what string, cmds []*pb.Command) {
	if len(cmds) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), n.cfg.RequestTimeout)
	defer cancel()
	var wg sync.WaitGroup
	for _, c := range cmds {
		wg.Go(func() {
			r, err := ls.proposer.propose(ctx, c)
			if err == nil {
				err = r.res.Err
			}
			if err != nil {
				n.log.Debug(what+" not applied", "command", c.String(), "error", err)
			}
		})
	}
	wg.Wait()
}

// countMigrations keeps the migration counters from the events this
// replica derives, so every replica counts every migration once, whoever
// proposed it. It runs until shutdown.
func (n *Node) countMigrations() {
	from := n.fsm.Applied()
	for {
		evs, changed, err := n.fsm.Events().Since(from)
		if err != nil {
			// Restored from a snapshot: the events before it are gone.
			from = n.fsm.Applied()
			continue
		}
		for _, ev := range evs {
			from = ev.Index
			if m := ev.GetMigration(); m != nil {
				n.metrics.migrations.WithLabelValues(migrationStage(m.Stage), fsm.MigrationCause(m)).Inc()
			}
			if rp := ev.GetRecoveryPlan(); rp != nil {
				n.metrics.countRecovery(rp)
			}
		}
		select {
		case <-changed:
		case <-n.shutdownCh:
			return
		}
	}
}

func migrationStage(s pb.Migration_Stage) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "STAGE_"))
}
