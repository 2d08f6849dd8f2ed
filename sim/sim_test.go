package sim

import (
	"bytes"
	"encoding/json"
	"github.com/lumen-project/lumen/worker/core"
	"reflect"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/engine"
)

func smallConfig(t *testing.T, seed uint64, strategy policy.Strategy, workers int, rate float64, d time.Duration) Config {
	t.Helper()
	reqs, err := workload.Generate(workload.Config{Seed: seed, Rate: rate, Duration: d, Trace: workload.AzureConversation})
	if err != nil {
		t.Fatal(err)
	}
	timing := DefaultTiming()
	timing.ReloadScale = 0.1
	return Config{Workers: workers, Profile: engine.Profiles["qwen3-14b-h100"], Strategy: strategy, TokenBudget: 2048,
		MaxRunning: 32, MaxWaiting: 4096, CheckpointBudget: 80e9, Arrivals: reqs, Timing: timing}
}

// TestConservation runs every strategy through failures — one worker that
// restarts, one that stays down, two at once — and Run's Check verifies
// that every arrival ended exactly once, no page or reservation is left and
// no budget was exceeded.
func TestConservation(t *testing.T) {
	seed := uint64(5)
	t.Logf("seed %d", seed)
	failures := map[string][]Failure{
		"none":            nil,
		"one, restarts":   {{Worker: 0, At: 4 * time.Second, Restart: true}},
		"one, stays down": {{Worker: 1, At: 4 * time.Second}},
		"two at once":     {{Worker: 0, At: 3 * time.Second, Restart: true}, {Worker: 2, At: 3 * time.Second, Restart: true}},
	}
	for _, strategy := range policy.Strategies {
		for name, fs := range failures {
			t.Run(strategy.String()+"/"+name, func(t *testing.T) {
				cfg := smallConfig(t, seed, strategy, 4, 12, 10*time.Second)
				cfg.Failures = fs
				res, err := Run(cfg)
				if err != nil {
					t.Fatal(err)
				}
				if res.Ended != len(cfg.Arrivals) || res.Failed != 0 {
					t.Fatalf("%d of %d ended, %d failed", res.Ended, len(cfg.Arrivals), res.Failed)
				}
				if fs != nil && res.Interrupted == 0 {
					t.Fatal("a failure interrupted nothing")
				}
				if fs != nil && strategy.KeepsCheckpoints() && res.RestoredPages == 0 {
					t.Errorf("%s restored no checkpoint page", strategy)
				}
				if !strategy.KeepsCheckpoints() && res.RestoredPages != 0 {
					t.Errorf("%s restored %d pages", strategy, res.RestoredPages)
				}
			})
		}
	}
}

// TestDeterminism: the same study twice gives the same bytes.
func TestDeterminism(t *testing.T) {
	seed := uint64(3)
	t.Logf("seed %d", seed)
	run := func() []byte {
		st := Study{Setup: Setup{Name: "t", Workers: 4, Profile: "qwen3-14b-h100", Failures: 1, MaxRunning: 32, Budget: 80e9},
			Timeline: Timeline{Warmup: 2 * time.Second, FailAt: 5 * time.Second, Duration: 12 * time.Second, Calibration: 6 * time.Second, ReloadScale: 0.1},
			Seed:     seed, Load: 0.7, Timing: DefaultTiming()}
		figs, err := st.Run()
		if err != nil {
			t.Fatal(err)
		}
		b, err := json.Marshal(figs)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	a, b := run(), run()
	if !bytes.Equal(a, b) {
		t.Fatalf("two runs of the same study differ:\n%s\n%s", a, b)
	}
}

// TestRetiredRequestsSameResult: letting an ended request's simRequest go
// (retire, the default) gives the Result of keeping them all, records
// included, through failures, a node of workers down, vLLM's preemption
// and a run stopped with requests open.
func TestRetiredRequestsSameResult(t *testing.T) {
	for _, stop := range []time.Duration{0, 9 * time.Second} {
		for _, strategy := range []policy.Strategy{policy.Lumen, policy.StopAndRestart} {
			cfg := smallConfig(t, 4, strategy, 6, 40, 14*time.Second)
			cfg.Timing.Preemption = core.PreemptVLLM
			cfg.KVPages = 2500 // preemptions
			cfg.StopAt = stop
			cfg.Failures = []Failure{{Worker: 0, At: 4 * time.Second, Restart: true}, {Worker: 3, At: 6 * time.Second}}
			kept := cfg
			kept.keepRequests = true
			a, err := Run(cfg)
			if err != nil {
				t.Fatal(err)
			}
			b, err := Run(kept)
			if err != nil {
				t.Fatal(err)
			}
			if a.Preemptions == 0 || a.Interrupted == 0 {
				t.Fatalf("%s: %d preemptions, %d interrupted: the case is not exercised", strategy, a.Preemptions, a.Interrupted)
			}
			if !reflect.DeepEqual(a, b) {
				t.Fatalf("%s, stop at %s: the results differ with the requests kept", strategy, stop)
			}
		}
	}
}

// TestRestoresQueuedAtTheHolderKeepTheirPages: four of eight workers fail
// at once under fixed checkpointing; the requests of worker-4 restore at
// their ring holder worker-5 behind the chain of the other three's. A
// holder that reconciled on "am I the holder" alone dropped their pages
// while they queued (the plan gives them a new holder), and nothing was
// reused; core.KeepsPages keeps them while the request is recovering here.
func TestRestoresQueuedAtTheHolderKeepTheirPages(t *testing.T) {
	cfg := smallConfig(t, 1, policy.FixedCheckpoint, 8, 34, 36*time.Second)
	cfg.Timing.ReloadScale = 0.25
	for i := range 4 {
		cfg.Failures = append(cfg.Failures, Failure{Worker: i, At: 12 * time.Second, Restart: true})
	}
	res, err := Run(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if res.RestoredPages < 500 {
		t.Fatalf("%d pages restored", res.RestoredPages)
	}
}

// TestLazyArrivals: lazy arrivals (prompt ids drawn again at each call, not
// held) give the run of the same arrivals with their ids, event for event;
// and arrivals out of order run as the same arrivals sorted would.
func TestLazyArrivals(t *testing.T) {
	cfg := smallConfig(t, 9, policy.Lumen, 4, 40, 8*time.Second)
	cfg.Failures = []Failure{{Worker: 0, At: 3 * time.Second, Restart: true}}
	run := func(c Config) (*Result, []byte) {
		res, err := Run(c)
		if err != nil {
			t.Fatal(err)
		}
		b, err := json.Marshal(res)
		if err != nil {
			t.Fatal(err)
		}
		return res, b
	}
	eager, eb := run(cfg)
	lazy, err := workload.GenerateLazy(workload.Config{Seed: 9, Rate: 40, Duration: 8 * time.Second, Trace: workload.AzureConversation})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Arrivals = lazy
	got, lb := run(cfg)
	if got.Events != eager.Events || !bytes.Equal(eb, lb) {
		t.Fatalf("lazy arrivals: %d events, eager %d; results equal: %v", got.Events, eager.Events, bytes.Equal(eb, lb))
	}
	// Reversed: the same requests under other indices, so other ids; the
	// same events and ends.
	rev := make([]workload.Request, len(lazy))
	for i := range lazy {
		rev[len(lazy)-1-i] = lazy[i]
	}
	cfg.Arrivals = rev
	r, _ := run(cfg)
	if r.Ended != eager.Ended || r.Failed != eager.Failed || r.End <= 0 {
		t.Fatalf("reversed arrivals: %d ended, %d failed; sorted %d, %d", r.Ended, r.Failed, eager.Ended, eager.Failed)
	}
}
