package sim

import (
	"testing"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// drainRun drains worker 0 of the migration configuration at drainAt,
// balance off (a drain migrates whatever the switch says), and returns the
// time from the drain to the last request leaving worker 0 (its core holds
// nothing, no migration out of it is under way), with the migration
// counters of that span. The run then goes on to its end: every request
// ends once, its tokens the reference's (onToken checks each), and Check
// finds nothing left.
func drainRun(t *testing.T, seed uint64, drainAt time.Duration) (took time.Duration, during MigrationStats, moved int) {
	t.Helper()
	cfg := migrationConfig(t, seed, 12*time.Second)
	// Room to drain into: the destinations' batches are not full (at 32
	// the bursts fill every batch, and a drain waits for slots).
	cfg.MaxRunning = 64
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if r := s.apply(&pb.Command{Body: &pb.Command_SetStrategy{SetStrategy: &pb.SetStrategyCmd{
		Migration: pb.MigrationMode_MIGRATION_MODE_OFF}}}); r.Err != nil {
		t.Fatal(r.Err)
	}
	if !s.advance(func() bool { return s.now >= drainAt }) {
		t.Fatalf("the run ended before %s (%v)", drainAt, s.err)
	}
	w := s.workers[0]
	moved = w.core.Running() + w.core.Waiting()
	before := s.res.Migrations
	start := s.now
	s.setPhase(w, pb.WorkerPhase_WORKER_PHASE_DRAINING)
	empty := func() bool {
		if !w.core.Idle() || w.core.Stopped() > 0 {
			return false
		}
		for _, m := range s.migs {
			if m.src == w {
				return false
			}
		}
		return true
	}
	if !s.advance(empty) {
		t.Fatalf("worker %s never drained (%v)", w.id, s.err)
	}
	took = s.now - start
	during = s.res.Migrations
	during.Started -= before.Started
	during.Committed -= before.Committed
	during.Aborted -= before.Aborted
	during.Queued -= before.Queued
	during.Downtimes = during.Downtimes[len(before.Downtimes):]
	s.Run()
	if s.err != nil {
		t.Fatal(s.err)
	}
	if err := s.Check(); err != nil {
		t.Fatal(err)
	}
	if r := &s.res; r.Ended != len(cfg.Arrivals) || r.Failed != 0 || r.RecomputedTokens != 0 {
		t.Fatalf("%d of %d ended, %d failed, %d tokens recomputed", r.Ended, len(cfg.Arrivals), r.Failed, r.RecomputedTokens)
	}
	return took, during, moved
}

// TestMigrationDrainSpeed: a drain moves the requests of a worker with
// dozens of them within about one round of the leader's (500 ms) plus the
// copies on its link — not one migration per destination per round (with
// three destinations, ten rounds for thirty requests) — its queued
// requests by re-dispatch, nothing recomputed.
func TestMigrationDrainSpeed(t *testing.T) {
	for _, seed := range []uint64{5, 6} {
		t.Logf("seed %d", seed)
		took, m, moved := drainRun(t, seed, 6200*time.Millisecond)
		t.Logf("seed %d: drained %d requests in %s: %d migrations started, %d committed (%d re-dispatched from the queue), aborted %v; downtime p50 %.1f ms",
			seed, moved, took, m.Started, m.Committed, m.Queued, m.AbortCauses, percentileMs(m.Downtimes, 0.5))
		if moved < 20 {
			t.Fatalf("seed %d: only %d requests on the drained worker: no test of the drain's speed", seed, moved)
		}
		if m.Committed < moved/2 || m.Aborted > m.Started/10 {
			t.Fatalf("seed %d: %d requests drained by %d migrations started, %d committed, aborted %v", seed, moved, m.Started, m.Committed, m.AbortCauses)
		}
		if took > 1500*time.Millisecond {
			t.Fatalf("seed %d: the drain of %d requests took %s; want within the first rounds", seed, moved, took)
		}
	}
}
