package sim

import (
	"testing"
	"time"
)

// smallPrefix is a small, seed-pinned prefix figure: 4 workers whose KV
// caches hold about a fifth of the groups' contexts each.
func smallPrefix(seed uint64, workloads ...string) PrefixOptions {
	o := DefaultPrefixOptions()
	o.Workers, o.KVPages, o.Seed, o.Workloads = 4, 2048, seed, workloads
	o.Shared = SharedPrefix{Groups: 24, Users: 3, System: 1536, Question: 256, Output: 64}
	o.Chat = Chat{Turns: 4, Message: 200, Output: 64, Gap: 5 * time.Second}
	o.Stages = []Stage{{8, 20 * time.Second}, {6, 20 * time.Second}, {14, 20 * time.Second}}
	return o
}

// TestPrefixFigureDirection: on the shared-prefix workload prefix-aware
// placement hits the cache more, delivers more and starts sooner than
// freeness alone on the same arrivals; with no reuse it places exactly as
// freeness alone.
func TestPrefixFigureDirection(t *testing.T) {
	const seed = 7
	t.Logf("seed %d", seed)
	f, err := RunPrefix(smallPrefix(seed, WorkloadLLMD, WorkloadNoReuse))
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
	if *none[ColFreeness] != *none[ColPrefixAware] {
		t.Fatalf("no reuse: prefix-aware %+v, freeness %+v: with no overlap anywhere the placements must be the same", *none[ColPrefixAware], *none[ColFreeness])
	}
}

type testWriter struct{ t *testing.T }

func (w *testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p))
	return len(p), nil
}
