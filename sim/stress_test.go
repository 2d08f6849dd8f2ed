package sim

import (
	"testing"

	"github.com/lumen-project/lumen/internal/recoverystudy"
)

// TestStressLumenAhead is issue 22's stress test: the headline w4 setup (4
// × Qwen3-32B at the seed's stress: batch cap 256, the context-dependent
// decode step, a cold reload, 0.9 of saturation) on its -quick timeline.
// One failure degrades stop-and-restart at least 3× over the failure-free
// run on the requests it touched, and lumen is ahead of every baseline and
// ablation — stop-and-restart, recompute, fixed-checkpoint, lumen-no-spec —
// on TTFT mean and p99, over the whole run and over the requests affected
// in any column (the same requests in every column), at seeds 1 and 2.
// Stop-and-restart regenerates every interrupted request from its prompt;
// the simulator checks every token a client gets against the reference
// and that none comes twice (Sim.Check), so the run failing nothing is the
// oracle holding through the regeneration.
func TestStressLumenAhead(t *testing.T) {
	setup, ok := recoverystudy.Lookup("w4")
	if !ok {
		t.Fatal("no w4 setup")
	}
	for _, seed := range []uint64{1, 2} {
		timing, err := DefaultTiming().Under(setup.Conditions)
		if err != nil {
			t.Fatal(err)
		}
		st := Study{Setup: setup, Timeline: setup.Timeline(true), Seed: seed, Load: setup.LoadOr(0), Timing: timing}
		figs, err := st.Run()
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		sr := figs["stop-and-restart"]
		if sr.Interrupted == 0 || sr.FailedRequests != 0 || sr.TokensRecomputed == 0 {
			t.Fatalf("seed %d: stop-and-restart interrupted %d, failed %d, recomputed %.0f tokens: the failure must interrupt requests, all of which complete after their regeneration",
				seed, sr.Interrupted, sr.FailedRequests, sr.TokensRecomputed)
		}
		if x := sr.AffectedTTFTMeanMs / sr.ReferenceTTFTMeanMs; x < 3 {
			t.Errorf("seed %d: stop-and-restart's TTFT over the affected requests is %.2fx the failure-free run's, want >= 3x", seed, x)
		} else {
			t.Logf("seed %d: stop-and-restart degraded %.2fx (TPOT %.2fx)", seed, x, sr.AffectedTPOTMeanMs/sr.ReferenceTPOTMeanMs)
		}
		l := figs["lumen"]
		if l.FailedRequests != 0 {
			t.Errorf("seed %d: lumen failed %d requests", seed, l.FailedRequests)
		}
		for _, base := range []string{"stop-and-restart", "recompute", "fixed-checkpoint", "lumen-no-spec"} {
			b := figs[base]
			t.Logf("seed %d: lumen vs %s: TTFT mean %.0f vs %.0f ms, p99 %.0f vs %.0f; over the common affected requests mean %.0f vs %.0f, p99 %.0f vs %.0f",
				seed, base, l.TTFTMeanMs, b.TTFTMeanMs, l.TTFTP99Ms, b.TTFTP99Ms, l.CommonTTFTMeanMs, b.CommonTTFTMeanMs, l.CommonTTFTP99Ms, b.CommonTTFTP99Ms)
			for _, c := range []struct {
				what       string
				lumen, off float64
			}{
				{"TTFT mean", l.TTFTMeanMs, b.TTFTMeanMs},
				{"TTFT p99", l.TTFTP99Ms, b.TTFTP99Ms},
				{"affected TTFT mean", l.CommonTTFTMeanMs, b.CommonTTFTMeanMs},
				{"affected TTFT p99", l.CommonTTFTP99Ms, b.CommonTTFTP99Ms},
			} {
				if c.lumen >= c.off {
					t.Errorf("seed %d: lumen's %s %.1f ms is not below %s's %.1f ms", seed, c.what, c.lumen, base, c.off)
				}
			}
		}
	}
}
