package sim

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/lumen-project/lumen/policy"
)

// smallPrefix is a small, seed-pinned prefix figure: 4 workers whose KV
// caches hold about a fifth of the groups' contexts each.
func smallPrefix(seed uint64, workloads ...string) PrefixOptions {
	o := DefaultPrefixOptions()
	o.Workers, o.KVPages, o.Seed, o.Workloads = 4, 2048, seed, workloads
	o.Shared = SharedPrefix{Groups: 24, Users: 3, System: 1536, Question: 256, Output: 64}
	o.Chat = Chat{Turns: 4, Message: 200, Output: 64, Gap: 5 * time.Second}
	o.Stages = []Stage{{8, 20 * time.Second}, {30, 20 * time.Second}, {80, 20 * time.Second}}
	return o
}

// TestPrefixFigureDirection: on the shared-prefix workload prefix-aware
// placement hits the cache more, delivers more and starts sooner than
// freeness alone on the same arrivals; on multi-turn chat it hits more
// without hot-spotting; with no reuse it places exactly as freeness alone.
func TestPrefixFigureDirection(t *testing.T) {
	const seed = 7
	t.Logf("seed %d", seed)
	f, err := RunPrefix(smallPrefix(seed, WorkloadLLMD, WorkloadNoReuse, WorkloadChat))
	if err != nil {
		t.Fatal(err)
	}
	var b testWriter
	b.t = t
	f.Print(&b)
	llmd, none := f.Runs[0].Summary, f.Runs[1].Summary
	a, p := llmd[ColFreeness], llmd[ColPrefixAware]
	if p.CacheHitPct <= a.CacheHitPct || p.OutputTokensS <= a.OutputTokensS || p.TTFTP90Ms >= a.TTFTP90Ms {
		t.Fatalf("shared prefix: prefix-aware %+v against freeness %+v: want more hits and tokens, a lower TTFT p90", *p, *a)
	}
	// Multi-turn chat: more hits, and the running requests spread across
	// the workers no worse than 10% (no hot-spotting on a conversation's
	// worker).
	chat := f.Runs[2].Summary
	if c, a := chat[ColPrefixAware], chat[ColFreeness]; c.CacheHitPct <= a.CacheHitPct || c.RunningCV > 1.1*a.RunningCV {
		t.Fatalf("multi-turn: prefix-aware %+v against freeness %+v: want more hits and a running CV within 10%%", *c, *a)
	}
	if *none[ColFreeness] != *none[ColPrefixAware] {
		t.Fatalf("no reuse: prefix-aware %+v, freeness %+v: with no overlap anywhere the placements must be the same", *none[ColPrefixAware], *none[ColFreeness])
	}
}

type testWriter struct{ t *testing.T }

func (w *testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p))
	return len(p), nil
}

// TestPrefixCacheConserves runs the workers' prefix caches and prefix-aware
// placement on a shared-prefix workload through failures (checkpoints,
// restores, re-dispatches), every strategy, and live migration: every
// request ends once with every token the reference's (onToken checks
// each), no page is left held (Check), and the caches hit.
func TestPrefixCacheConserves(t *testing.T) {
	const seed = 5
	t.Logf("seed %d", seed)
	o := smallPrefix(seed)
	o.Shared.Output = 128
	o.Stages = []Stage{{12, 10 * time.Second}}
	reqs, err := PrefixArrivals(o, WorkloadLLMD)
	if err != nil {
		t.Fatal(err)
	}
	failures := map[string][]Failure{
		"one, restarts": {{Worker: 0, At: 4 * time.Second, Restart: true}},
		"two at once":   {{Worker: 0, At: 3 * time.Second, Restart: true}, {Worker: 2, At: 3 * time.Second, Restart: true}},
	}
	check := func(t *testing.T, cfg Config) *Result {
		res, err := Run(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if res.Ended != len(cfg.Arrivals) || res.Failed != 0 {
			t.Fatalf("%d of %d ended, %d failed", res.Ended, len(cfg.Arrivals), res.Failed)
		}
		if res.CacheHitTokens == 0 {
			t.Fatal("no cache hit on a shared-prefix workload")
		}
		return res
	}
	for _, strategy := range policy.Strategies {
		for name, fs := range failures {
			t.Run(strategy.String()+"/"+name, func(t *testing.T) {
				cfg := smallConfig(t, seed, strategy, 4, 1, time.Second)
				cfg.Arrivals, cfg.Failures, cfg.KVPages = reqs, fs, 2048
				cfg.PrefixCache, cfg.PrefixRouting = true, true
				res := check(t, cfg)
				if strategy.KeepsCheckpoints() && res.RestoredPages == 0 {
					t.Errorf("%s restored no checkpoint page", strategy)
				}
			})
		}
	}
	t.Run("migration", func(t *testing.T) {
		cfg := migrationConfig(t, seed, time.Second)
		cfg.Arrivals, cfg.KVPages = reqs, 2048
		cfg.PrefixCache, cfg.PrefixRouting = true, true
		res := check(t, cfg)
		if res.Migrations.Committed == 0 {
			t.Fatalf("no migration committed (%d started)", res.Migrations.Started)
		}
	})
}

// TestPrefixFigureJSONKeys: the figure's JSON carries, per rate and column,
// the contract's keys.
func TestPrefixFigureJSONKeys(t *testing.T) {
	o := smallPrefix(3, WorkloadLLMD)
	o.Stages = o.Stages[:2]
	f, err := RunPrefix(o)
	if err != nil {
		t.Fatal(err)
	}
	data, err := json.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Runs []struct {
			Points []struct {
				Rate    float64                       `json:"rate"`
				Columns map[string]map[string]float64 `json:"columns"`
			} `json:"points"`
		} `json:"runs"`
	}
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Runs) != 1 || len(got.Runs[0].Points) != 1 || got.Runs[0].Points[0].Rate != o.Stages[1].Rate {
		t.Fatalf("JSON %s", data)
	}
	for _, col := range PrefixColumns {
		c := got.Runs[0].Points[0].Columns[col]
		for _, k := range []string{"ttft_mean_ms", "ttft_p90_ms", "output_tokens_s", "cache_hit_pct"} {
			if _, ok := c[k]; !ok {
				t.Errorf("column %s has no %s: %v", col, k, c)
			}
		}
	}
}

// TestPrefixResumeByCache: with failures, prefix-aware placement places
// some recomputed resumes on a worker caching more of their history than
// the recovery plan's target (prefixResume), and the resumed calls find
// more of their histories in the caches than with every resume where the
// plan put it (PlanResumes, the same arrivals and failures); without
// prefix routing none is moved.
func TestPrefixResumeByCache(t *testing.T) {
	const seed = 7
	t.Logf("seed %d", seed)
	o := smallPrefix(seed, WorkloadLLMD)
	o.Fail, o.FailAt, o.Columns = 1, 45*time.Second, PrefixFailColumns
	f, err := RunPrefix(o)
	if err != nil {
		t.Fatal(err)
	}
	var b testWriter
	b.t = t
	f.Print(&b)
	s := f.Runs[0].Summary
	free, byCache, planned := s[ColFreeness], s[ColPrefixAware], s[ColPrefixPlanned]
	if free.PrefixResumes != 0 || planned.PrefixResumes != 0 {
		t.Fatalf("%d and %d resumes placed by prefix without prefix routing or with PlanResumes", free.PrefixResumes, planned.PrefixResumes)
	}
	if byCache.Interrupted == 0 || byCache.PrefixResumes == 0 {
		t.Fatalf("prefix-aware: %d interrupted, %d placed by their cached prefix; want some of each", byCache.Interrupted, byCache.PrefixResumes)
	}
	if byCache.ResumeCached <= planned.ResumeCached || byCache.ResumeRecomputed >= planned.ResumeRecomputed {
		t.Fatalf("resumes placed by prefix found %d tokens cached and recomputed %d; as planned %d and %d: want more found, fewer recomputed",
			byCache.ResumeCached, byCache.ResumeRecomputed, planned.ResumeCached, planned.ResumeRecomputed)
	}
}
