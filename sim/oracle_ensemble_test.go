package sim

import (
	"flag"
	"testing"

	"github.com/lumen-project/lumen/internal/recoverystudy"
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
