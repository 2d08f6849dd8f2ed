package sim

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/lumen-project/lumen/policy"
)

// TestInterruptedRecords: the records say which requests a failure
// interrupted — the recovery plans' requests, some of them arrived before
// the failure — and each of them that completed has its recovery, the
// failure to its next token, after the failure and no later than its last
// token.
func TestInterruptedRecords(t *testing.T) {
	seed := uint64(5)
	t.Logf("seed %d", seed)
	failAt := 4 * time.Second
	for _, strategy := range []policy.Strategy{policy.Lumen, policy.FixedCheckpoint, policy.StopAndRestart} {
		t.Run(strategy.String(), func(t *testing.T) {
			cfg := smallConfig(t, seed, strategy, 4, 12, 10*time.Second)
			cfg.Failures = []Failure{{Worker: 0, At: failAt, Restart: true}}
			res, err := Run(cfg)
			if err != nil {
				t.Fatal(err)
			}
			marked, before := 0, 0
			for _, r := range res.Records {
				if !r.Interrupted {
					continue
				}
				marked++
				if len(r.Chunks) == 0 {
					t.Fatalf("%s: interrupted, completed, and no token", r.ID)
				}
				if r.Arrival < failAt {
					before++
				}
				if last := r.Chunks[len(r.Chunks)-1]; last <= failAt {
					t.Errorf("%s: interrupted, its last token at %s is before the failure", r.ID, last)
				}
			}
			if marked == 0 || marked != res.Interrupted || before == 0 {
				t.Fatalf("%d records marked interrupted (%d arrived before the failure), %d interrupted", marked, before, res.Interrupted)
			}
			if len(res.Recoveries) != marked {
				t.Fatalf("%d recoveries of %d interrupted requests", len(res.Recoveries), marked)
			}
			i := 0
			for _, r := range res.Records {
				if !r.Interrupted {
					continue
				}
				d := res.Recoveries[i]
				i++
				if d <= 0 || failAt+d > r.Chunks[len(r.Chunks)-1] {
					t.Errorf("%s: recovery %s, last token at %s", r.ID, d, r.Chunks[len(r.Chunks)-1])
				}
			}
		})
	}
}

// TestFailureFiguresKeys: every column of a short study has the failure's
// keys, and they agree: a failed column's affected requests are at least
// its interrupted ones, their window runs from the failure for the cluster
// recovery, its interrupted requests took time to recover, and the
// failure cost them against the failure-free reference on the same
// requests; a failure-free column counts the requests affected in every
// failed column measured against it; every column has the same requests
// in common.
func TestFailureFiguresKeys(t *testing.T) {
	seed := uint64(1)
	t.Logf("seed %d", seed)
	failAt := 8 * time.Second
	custom := []Setup{CustomSetup(4, "qwen3-14b-h100", 1, 32, 80e9)}
	out, err := RunStudies(Options{Setups: custom, Duration: 30 * time.Second, FailAt: failAt, Seed: seed, Load: 0.8, Timing: DefaultTiming()})
	if err != nil {
		t.Fatal(err)
	}
	figs := out["custom"]
	keys := []string{"affected_ttft_mean_ms", "affected_ttft_p99_ms", "affected_tpot_mean_ms", "interrupted_recovery_mean_s",
		"interrupted_recovery_p99_s", "cluster_recovery_s", "affected_requests", "affected_from_s", "affected_to_s",
		"common_affected_ttft_mean_ms", "common_affected_ttft_p99_ms", "common_affected_tpot_mean_ms", "common_affected_requests",
		"ttft_mean_ms", "recovery_s", "resume_mean_ms"}
	for _, col := range Columns {
		f := figs[col.Name]
		b, err := json.Marshal(f)
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		for _, k := range keys {
			if _, ok := m[k]; !ok {
				t.Errorf("%s: key %s missing", col.Name, k)
			}
		}
		// The same requests in every column: those of every failed one.
		if f.CommonRequests != figs["lumen"].CommonRequests || (col.Fail && f.CommonRequests < f.AffectedRequests) || f.CommonTTFTMeanMs <= 0 {
			t.Errorf("%s: %d requests in common (lumen's %d), %d of its own, TTFT mean %v", col.Name, f.CommonRequests,
				figs["lumen"].CommonRequests, f.AffectedRequests, f.CommonTTFTMeanMs)
		}
		if !col.Fail {
			if f.InterruptedRecoveryMeanS != 0 || f.ClusterRecoveryS != 0 || f.AffectedRequests == 0 {
				t.Errorf("%s (failure-free): interrupted recovery %v s, cluster recovery %v s, %d affected",
					col.Name, f.InterruptedRecoveryMeanS, f.ClusterRecoveryS, f.AffectedRequests)
			}
			for _, c := range Columns {
				if c.Fail && c.Ref == col.Name {
					if g := figs[c.Name]; f.AffectedRequests < g.AffectedRequests || f.AffectedFromS > g.AffectedFromS || f.AffectedToS < g.AffectedToS {
						t.Errorf("%s counts %d affected in %.2f-%.2f s, fewer than %s's %d in %.2f-%.2f s", col.Name, f.AffectedRequests,
							f.AffectedFromS, f.AffectedToS, c.Name, g.AffectedRequests, g.AffectedFromS, g.AffectedToS)
					}
				}
			}
			continue
		}
		if f.Interrupted == 0 || f.AffectedRequests < f.Interrupted || f.AffectedRequests > f.Requests {
			t.Errorf("%s: %d affected of %d requests, %d interrupted", col.Name, f.AffectedRequests, f.Requests, f.Interrupted)
		}
		if f.ClusterRecoveryS != f.RecoveryS || f.ClusterRecoveryS <= 0 || f.AffectedFromS != failAt.Seconds() ||
			f.AffectedToS != f.AffectedFromS+f.ClusterRecoveryS {
			t.Errorf("%s: window %v-%v s, cluster recovery %v s, recovery %v s", col.Name, f.AffectedFromS, f.AffectedToS, f.ClusterRecoveryS, f.RecoveryS)
		}
		if f.InterruptedRecoveryMeanS <= 0 || f.InterruptedRecoveryP99S < f.InterruptedRecoveryMeanS {
			t.Errorf("%s: interrupted recovery mean %v s, p99 %v s", col.Name, f.InterruptedRecoveryMeanS, f.InterruptedRecoveryP99S)
		}
		if f.AffectedTTFTP99Ms < f.AffectedTTFTMeanMs || f.ReferenceTTFTMeanMs <= 0 || f.AffectedTTFTMeanMs <= f.ReferenceTTFTMeanMs {
			t.Errorf("%s: affected TTFT mean %v p99 %v, the reference's on the same requests %v", col.Name,
				f.AffectedTTFTMeanMs, f.AffectedTTFTP99Ms, f.ReferenceTTFTMeanMs)
		}
	}
}
