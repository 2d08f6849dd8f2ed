package sim

import (
	"flag"
	"fmt"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/recoverystudy"
	"github.com/lumen-project/lumen/worker/engine"
)

var (
	oracleEnsemble = flag.Int("sim.oracle-ensemble", 0, "TestOracleEnsemble: speculation seeds per arrival seed (0: skip the measurement)")
	oracleSeeds    = flag.Int("sim.oracle-seeds", 3, "TestOracleEnsemble: arrival seeds, from 1")
	oracleQuick    = flag.Bool("sim.oracle-quick", false, "TestOracleEnsemble: the -quick timeline")
)

// TestOracleEnsemble is a measurement run by hand (docs/benchmarks.md,
// "Issue 27: the oracle"): w4 at arrival seeds 1 … -sim.oracle-seeds, each
// run -sim.oracle-ensemble times with other luck in the speculation
// (Study.SpecSeed), the same arrivals, lumen against the oracle. It logs
// lumen's excess vs the oracle's per run and over each seed's runs (the
// ratio of the means), and asserts what the oracle removes whatever the
// trajectory: its interrupted requests get their next token no later and
// recompute no more than lumen's.
//
//	go test ./sim/ -run OracleEnsemble -v -sim.oracle-ensemble 8
func TestOracleEnsemble(t *testing.T) {
	if *oracleEnsemble <= 0 {
		t.Skip("a measurement: -sim.oracle-ensemble N runs it")
	}
	setup, ok := recoverystudy.Lookup("w4")
	if !ok {
		t.Fatal("no w4 setup")
	}
	timing, err := DefaultTiming().Under(setup.Conditions)
	if err != nil {
		t.Fatal(err)
	}
	var all [3][2]float64 // lumen, oracle, reference: TTFT mean, p99
	runs := 0
	for seed := uint64(1); seed <= uint64(*oracleSeeds); seed++ {
		var sums [3][2]float64
		sat := 0.0
		for k := range uint64(*oracleEnsemble) {
			st := Study{Setup: setup, Timeline: setup.Timeline(*oracleQuick), Seed: seed, Load: setup.LoadOr(0), Timing: timing,
				Saturated: sat, Only: []string{"lumen-no-spec", "lumen", recoverystudy.OracleColumn, "lumen-no-failure"}}
			if k > 0 {
				st.SpecSeed = 1000*seed + k
			}
			figs, err := st.Run()
			if err != nil {
				t.Fatal(err)
			}
			sat = figs["lumen"].SaturatedPerSec // the calibration does not speculate: measure it once
			l, o, ref := figs["lumen"], figs[recoverystudy.OracleColumn], figs["lumen-no-failure"]
			if o.InterruptedRecoveryMeanS > l.InterruptedRecoveryMeanS || o.TokensRecomputed > l.TokensRecomputed {
				t.Errorf("seed %d, spec seed %d: the oracle's interrupted requests got their next token %.3f s after the failure and recomputed %.0f tokens, lumen's %.3f s and %.0f",
					seed, k, o.InterruptedRecoveryMeanS, o.TokensRecomputed, l.InterruptedRecoveryMeanS, l.TokensRecomputed)
			}
			x := l.ExcessVsOracle
			if x == nil || x.TTFTMean == nil || x.TTFTP99 == nil {
				t.Fatalf("seed %d, spec seed %d: lumen has no excess vs the oracle (%+v)", seed, k, x)
			}
			t.Logf("seed %d, spec seed %d: common affected TTFT mean / p99 (ms) lumen %.0f / %.0f, oracle %.0f / %.0f, failure-free %.0f / %.0f: lumen %.2fx / %.2fx the oracle's excess",
				seed, k, l.CommonTTFTMeanMs, l.CommonTTFTP99Ms, o.CommonTTFTMeanMs, o.CommonTTFTP99Ms, ref.CommonTTFTMeanMs, ref.CommonTTFTP99Ms, *x.TTFTMean, *x.TTFTP99)
			for i, f := range []*Figures{l, o, ref} {
				sums[i][0] += f.CommonTTFTMeanMs
				sums[i][1] += f.CommonTTFTP99Ms
				all[i][0] += f.CommonTTFTMeanMs
				all[i][1] += f.CommonTTFTP99Ms
			}
			runs++
		}
		t.Logf("seed %d, %d runs: lumen %.2fx / %.2fx the oracle's excess (ratio of the means)", seed, *oracleEnsemble,
			(sums[0][0]-sums[2][0])/(sums[1][0]-sums[2][0]), (sums[0][1]-sums[2][1])/(sums[1][1]-sums[2][1]))
	}
	t.Logf("all %d runs: lumen %.2fx / %.2fx the oracle's excess (ratio of the means)", runs,
		(all[0][0]-all[2][0])/(all[1][0]-all[2][0]), (all[0][1]-all[2][1])/(all[1][1]-all[2][1]))
}

var oracleTrace = flag.Bool("sim.oracle-trace", false, "TestOracleTrace: run the measurement")

// TestOracleTrace is the trace behind docs/benchmarks.md's "Why the oracle
// is not the floor at w4", run by hand: w4 at seed 1 on the full timeline,
// lumen and the oracle, every 5 s from the failure each live worker's
// running and waiting requests, KV pages in use, queue head pages and the
// freeness dispatch ranks it by (policy.Worker.Freeness, from the same
// counts), then where the arrivals of each window went and their mean
// TTFT. Conservation is checked for both runs.
//
//	go test ./sim/ -run OracleTrace -v -sim.oracle-trace
func TestOracleTrace(t *testing.T) {
	if !*oracleTrace {
		t.Skip("a measurement: -sim.oracle-trace runs it")
	}
	setup, _ := recoverystudy.Lookup("w4")
	timing, err := DefaultTiming().Under(setup.Conditions)
	if err != nil {
		t.Fatal(err)
	}
	st := Study{Setup: setup, Timeline: setup.Timeline(false), Seed: 1, Load: setup.LoadOr(0), Timing: timing}
	p, _, err := engine.LookupProfile(setup.Profile)
	if err != nil {
		t.Fatal(err)
	}
	sat, _, err := st.Calibrate()
	if err != nil {
		t.Fatal(err)
	}
	reqs, err := st.arrivals(st.Seed, st.Load*sat, st.Timeline.Duration)
	if err != nil {
		t.Fatal(err)
	}
	fail := st.Timeline.FailAt
	for _, col := range Columns {
		if col.Name != "lumen" && !col.Oracle {
			continue
		}
		cfg := st.config(p, col.Strategy, reqs)
		cfg.Speculation, cfg.Oracle = col.Progressive, col.Oracle
		cfg.Failures = []Failure{{Worker: 0, At: fail, Restart: true}}
		cfg.keepRequests = true // read after the run
		s, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		const every = 5 * time.Second
		s.nextProgress = fail
		s.cfg.Progress = func(now time.Duration, _, _ int) {
			s.syncAll() // the workers' cores as of now (runs.go)
			line := fmt.Sprintf("%s t=%4.0fs", col.Name, now.Seconds())
			for _, w := range s.workers {
				if !w.alive || w.core == nil {
					line += fmt.Sprintf(" | %s down", w.id)
					continue
				}
				c := w.core
				free := float64(s.cfg.KVPages - c.CachedPages() - c.HeadPages())
				line += fmt.Sprintf(" | %s r%d w%d kv%d head%d F%.1f", w.id, c.Running(), c.Waiting(), c.CachedPages(), c.HeadPages(),
					free/float64(max(1, c.Running()+c.Waiting())))
			}
			t.Log(line)
			s.nextProgress += every - 10*time.Second // Run adds 10 s
		}
		s.Run()
		if s.err != nil {
			t.Fatal(s.err)
		}
		if err := s.Check(); err != nil {
			t.Fatal(err)
		}
		for _, win := range [][2]time.Duration{{fail, 2 * time.Minute}, {2 * time.Minute, 285 * time.Second}, {285 * time.Second, 6 * time.Minute}} {
			line := fmt.Sprintf("%s arrivals %v-%v:", col.Name, win[0], win[1])
			for _, w := range s.workers {
				n, sum := 0, time.Duration(0)
				for _, r := range s.reqs {
					if !r.interrupted && r.arrival >= win[0] && r.arrival < win[1] && r.worker == w.id {
						n, sum = n+1, sum+r.first-r.arrival
					}
				}
				if n > 0 {
					line += fmt.Sprintf(" %s %d at TTFT %.1f s;", w.id, n, (sum / time.Duration(n)).Seconds())
				}
			}
			t.Log(line)
		}
	}
}
