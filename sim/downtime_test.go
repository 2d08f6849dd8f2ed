package sim

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// downtimeLengths are the contexts, at the migration, of the downtime
// phase of `lumen bench migration`.
var downtimeLengths = []int{256, 1024, 4096, 8192}

// downtimeRun is the simulator's counterpart of that phase: two workers
// each decoding 8 long background streams (a decode step at batch 9), and
// reps requests per context length, one at a time, each migrated to the
// other worker (as Operator.Migrate) once its client has 16 tokens. It
// returns each migrated client's gap across its switch, by length, and
// the decode step at batch 9.
func downtimeRun(t *testing.T, reps int) (map[int][]time.Duration, time.Duration) {
	t.Helper()
	rng := rand.New(rand.NewPCG(9, 0))
	prompt := func(n int) []int32 {
		p := make([]int32, n)
		for i := range p {
			p[i] = int32(rng.IntN(32000))
		}
		return p
	}
	var arr []workload.Request
	for range 16 {
		arr = append(arr, workload.Request{At: 0, Prompt: prompt(100), Output: 3000})
	}
	type target struct {
		id  string
		ctx int
	}
	var targets []target
	at := time.Second
	for range reps {
		for _, n := range downtimeLengths {
			targets = append(targets, target{fmt.Sprintf("r%07d", len(arr)), n})
			arr = append(arr, workload.Request{At: at, Prompt: prompt(n - 16), Output: 64})
			at += 2 * time.Second
		}
	}
	timing := DefaultTiming()
	p := engine.Profiles["qwen3-14b-h100"]
	cfg := Config{Workers: 2, Profile: p, Strategy: policy.Lumen, TokenBudget: 2048, MaxRunning: 32, MaxWaiting: 4096,
		CheckpointBudget: 80e9, Arrivals: arr, Timing: timing, Migration: true}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Balance off: only the operator's migrations move.
	if r := s.apply(&pb.Command{Body: &pb.Command_SetStrategy{SetStrategy: &pb.SetStrategyCmd{
		Migration: pb.MigrationMode_MIGRATION_MODE_OFF}}}); r.Err != nil {
		t.Fatal(r.Err)
	}
	gaps := map[int][]time.Duration{}
	for _, tg := range targets {
		var r *simRequest
		if !s.advance(func() bool { r = s.byID[tg.id]; return r != nil && r.out >= 16 }) {
			t.Fatalf("%s never reached 16 tokens (%v)", tg.id, s.err)
		}
		cmd, err := s.fsm.OperatorMigration(tg.id, "")
		if err != nil {
			t.Fatal(err)
		}
		res := s.apply(&pb.Command{Body: &pb.Command_Migrate{Migrate: cmd}})
		if res.Err != nil {
			t.Fatal(res.Err)
		}
		s.startMigration(cmd, res.Placement)
		n := len(s.res.Migrations.Downtimes)
		if !s.advance(func() bool { return len(s.res.Migrations.Downtimes) > n }) {
			t.Fatalf("%s: no switch (%v)", tg.id, s.err)
		}
		gaps[tg.ctx] = append(gaps[tg.ctx], s.res.Migrations.Downtimes[n])
	}
	s.Run()
	if s.err != nil {
		t.Fatal(s.err)
	}
	if err := s.Check(); err != nil {
		t.Fatal(err)
	}
	if r := &s.res; r.Ended != len(arr) || r.Failed != 0 || r.RecomputedTokens != 0 || r.Migrations.Committed != len(targets) {
		t.Fatalf("%d of %d ended, %d failed, %d tokens recomputed, %d of %d migrations committed", r.Ended, len(arr), r.Failed,
			r.RecomputedTokens, r.Migrations.Committed, len(targets))
	}
	return gaps, p.StepTime(9, 0)
}

// TestMigrationDowntime: with the destination decoding a migrated request
// from its last stage on (the held pre-step), the client's gap across the
// switch is the last stage's copy, the wait for a step boundary at the
// destination and one step there — at most two decode steps, flat in the
// context — not the 2.5 of a call that waits for the step in progress and
// then the next one.
func TestMigrationDowntime(t *testing.T) {
	gaps, step := downtimeRun(t, 4)
	var all []time.Duration
	for _, n := range downtimeLengths {
		g := gaps[n]
		all = append(all, g...)
		t.Logf("context %d: client gap median %.1f ms (%.2f steps), max %.1f ms: %v", n, percentileMs(g, 0.5),
			percentileMs(g, 0.5)/ms(step), percentileMs(g, 1), g)
	}
	t.Logf("decode step at batch 9 (model): %.2f ms", ms(step))
	if m := slices.Max(all); m > 2*step {
		t.Errorf("a client waited %s across its switch, over two decode steps (%s)", m, 2*step)
	}
}
