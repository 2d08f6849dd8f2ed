package recoverystudy

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/servingstats"
)

func TestGain(t *testing.T) {
	for _, c := range []struct {
		a, b float64
		want string
	}{{110, 100, "+10.0%"}, {90, 100, "-10.0%"}, {5, 0, "n/a"}, {100, 100, "+0.0%"}} {
		if got := Gain(c.a, c.b); got != c.want {
			t.Errorf("Gain(%v, %v) = %q, want %q", c.a, c.b, got, c.want)
		}
	}
}

func TestParseSetups(t *testing.T) {
	got, err := ParseSetups("w8_f4, w4")
	if err != nil || len(got) != 2 || got[0].Name != "w8_f4" || got[0].Failures != 4 || got[1].Budget != 160e9 {
		t.Fatalf("%+v, %v", got, err)
	}
	if _, err := ParseSetups("w4,w16"); !errors.Is(err, ErrUnknownSetup) {
		t.Fatalf("unknown setup: %v, want ErrUnknownSetup", err)
	}
}

// The table order and the run order hold the same columns, and every
// failed column's reference is a failure-free column that runs before it.
func TestColumns(t *testing.T) {
	ran := map[string]bool{}
	for _, c := range Columns {
		if c.Fail && (ran[c.Ref] == false || c.Ref == "") {
			t.Errorf("%s: reference %q does not run before it", c.Name, c.Ref)
		}
		if !c.Fail {
			ran[c.Name] = true
		}
	}
	if len(tableOrder) != len(Columns) {
		t.Fatalf("table shows %d columns of %d", len(tableOrder), len(Columns))
	}
	for _, name := range tableOrder {
		found := false
		for _, c := range Columns {
			found = found || c.Name == name
		}
		if !found {
			t.Errorf("table column %s does not run", name)
		}
	}
}

func TestLatencies(t *testing.T) {
	ms := time.Millisecond
	recs := []*servingstats.Record{
		{Arrival: 0, Chunks: []time.Duration{100 * ms}},                                // before the warm-up: counted, not timed
		{Arrival: 2000 * ms, Chunks: []time.Duration{2050 * ms, 2060 * ms}, Tokens: 2}, // before the failure
		{Arrival: 6000 * ms, Chunks: []time.Duration{6100 * ms, 6120 * ms}, Tokens: 2},
		{Arrival: 7000 * ms, Err: errors.New("HTTP 503")},
	}
	var f Figures
	f.Latencies(recs, time.Second, 5*time.Second)
	if f.Requests != 4 || f.FailedRequests != 1 || f.TTFTMeanMs != 75 || f.PreFailureTTFTMs != 50 || f.TPOTMeanMs != 15 {
		t.Fatalf("%+v", f)
	}
}

// TestFailureFigures runs the failure's figures on made-up columns: 80
// arrivals 250 ms apart, the failure at 5 s; each failed column's
// arrivals in [5 s, 5 s + bad) wait 1 s for their first token, the others
// 100 ms, as in every failure-free column; failed column k (in Columns'
// order) interrupted request k (arrived before the failure, 100 ms TTFT).
// The recovery is then exactly bad, and the affected requests are the 4 ×
// bad/s arrivals of the window plus the interrupted one.
func TestFailureFigures(t *testing.T) {
	const n = 80
	const step = 250 * time.Millisecond
	failAt, end := 5*time.Second, 20*time.Second
	rule := servingstats.RecoveryRule{Window: time.Second, Step: step, Tolerance: 0.1, QueueSlack: 1, MinRequests: 1}
	record := func(i int, ttft time.Duration) *servingstats.Record {
		a := time.Duration(i) * step
		return &servingstats.Record{Arrival: a, Chunks: []time.Duration{a + ttft, a + ttft + 100*time.Millisecond}, Tokens: 11}
	}
	for _, c := range []struct {
		name string
		bad  func(k int) time.Duration // failed column k's
		// failed: a request of the window that failed, in every failed
		// column (-1: none).
		failed int
	}{
		{"every column recovers", func(k int) time.Duration { return time.Duration(k+1) * 500 * time.Millisecond }, -1},
		{"one never recovers", func(k int) time.Duration {
			if k == 1 {
				return end
			}
			return time.Second
		}, -1},
		{"a failed request counts, untimed", func(int) time.Duration { return 2 * time.Second }, 21},
	} {
		t.Run(c.name, func(t *testing.T) {
			runs, figs := map[string]*Run{}, map[string]*Figures{}
			bad := map[string]time.Duration{}
			k := 0
			for _, col := range Columns {
				r := &Run{End: end}
				var b time.Duration
				if col.Fail {
					b, r.FailAt = c.bad(k), failAt
					r.Recoveries = []time.Duration{time.Second, 3 * time.Second}
					bad[col.Name] = b
				}
				for i := range n {
					a := time.Duration(i) * step
					ttft := 100 * time.Millisecond
					if col.Fail && a >= failAt && a < failAt+b {
						ttft = time.Second
					}
					rec := record(i, ttft)
					if col.Fail && i == k {
						rec.Interrupted = true
					}
					if col.Fail && i == c.failed {
						rec.Err, rec.Chunks = errors.New("HTTP 503"), nil
					}
					r.Records = append(r.Records, rec)
				}
				if col.Fail {
					k++
				}
				runs[col.Name], figs[col.Name] = r, &Figures{}
			}
			FailureFigures(figs, runs, rule)
			union := map[string]map[int]bool{} // the affected indices by reference
			for _, col := range Columns {
				f := figs[col.Name]
				if !col.Fail {
					continue
				}
				b := min(bad[col.Name], end-failAt)
				if f.Recovered != (bad[col.Name] < end-failAt) || f.ClusterRecoveryS != b.Seconds() || f.RecoveryS != f.ClusterRecoveryS {
					t.Errorf("%s: recovery %v s (cluster %v s, recovered %v), want %v s", col.Name, f.RecoveryS, f.ClusterRecoveryS, f.Recovered, b.Seconds())
				}
				inWindow := int(b / step)
				timed := inWindow
				if c.failed >= 0 {
					timed--
				}
				// The interrupted request (100 ms) and the window's (1 s).
				want := (float64(timed)*1000 + 100) / float64(timed+1)
				if f.AffectedRequests != inWindow+1 || math.Abs(f.AffectedTTFTMeanMs-want) > 1e-9 || f.AffectedTTFTP99Ms != 1000 {
					t.Errorf("%s: %d affected, TTFT mean %v p99 %v; want %d, %v, 1000", col.Name, f.AffectedRequests, f.AffectedTTFTMeanMs, f.AffectedTTFTP99Ms, inWindow+1, want)
				}
				if f.AffectedTPOTMeanMs != 10 || f.AffectedFromS != 5 || f.AffectedToS != (failAt+b).Seconds() {
					t.Errorf("%s: TPOT %v, window %v-%v s", col.Name, f.AffectedTPOTMeanMs, f.AffectedFromS, f.AffectedToS)
				}
				// The reference on the very same requests: all 100 ms.
				if f.ReferenceTTFTMeanMs != 100 || f.ReferenceTTFTP99Ms != 100 || f.ReferenceTPOTMeanMs != 10 {
					t.Errorf("%s: reference %v / %v / %v", col.Name, f.ReferenceTTFTMeanMs, f.ReferenceTTFTP99Ms, f.ReferenceTPOTMeanMs)
				}
				if f.InterruptedRecoveryMeanS != 2 || f.InterruptedRecoveryP99S != 3 {
					t.Errorf("%s: interrupted recovery %v / %v s", col.Name, f.InterruptedRecoveryMeanS, f.InterruptedRecoveryP99S)
				}
				if col.Oracle {
					continue // the floor joins no union: it changes no other column's figures
				}
				if union[col.Ref] == nil {
					union[col.Ref] = map[int]bool{}
				}
				for i, r := range runs[col.Name].Records {
					if r.Interrupted || (r.Arrival >= failAt && r.Arrival < failAt+b) {
						union[col.Ref][i] = true
					}
				}
			}
			// The same requests in every column: those affected in any
			// failed column.
			all := map[int]bool{}
			for _, u := range union {
				for i := range u {
					all[i] = true
				}
			}
			for _, col := range Columns {
				f := figs[col.Name]
				var sum time.Duration
				timed := 0
				for i := range all {
					if d, ok := runs[col.Name].Records[i].TTFT(); ok && runs[col.Name].Records[i].Err == nil {
						sum += d
						timed++
					}
				}
				want := float64(sum) / float64(time.Millisecond) / float64(timed)
				if f.CommonRequests != len(all) || math.Abs(f.CommonTTFTMeanMs-want) > 1e-9 || f.CommonTPOTMeanMs != 10 {
					t.Errorf("%s: %d requests in common, TTFT mean %v, TPOT %v; want %d, %v, 10", col.Name, f.CommonRequests,
						f.CommonTTFTMeanMs, f.CommonTPOTMeanMs, len(all), want)
				}
				if col.Fail {
					if col.Oracle == (f.ExcessVsOracle != nil) {
						t.Errorf("%s: excess vs oracle %+v: want one on every failed column but the oracle", col.Name, f.ExcessVsOracle)
					}
					continue
				}
				if !f.Recovered || f.RecoveryS != 0 || f.InterruptedRecoveryMeanS != 0 || f.ReferenceTTFTMeanMs != 0 {
					t.Errorf("%s (failure-free): %+v", col.Name, f)
				}
				if f.AffectedRequests != len(union[col.Name]) || (len(union[col.Name]) > 0 && f.AffectedTTFTMeanMs != 100) {
					t.Errorf("%s (failure-free): %d affected, TTFT %v; want the %d of the failed columns against it, 100 ms",
						col.Name, f.AffectedRequests, f.AffectedTTFTMeanMs, len(union[col.Name]))
				}
			}
		})
	}
}

// TestExcessVsOracle: each failed column's excess over its reference on
// the common affected requests, over the oracle's over lumen-no-failure;
// null where the oracle has no excess; nothing without an oracle (bench).
func TestExcessVsOracle(t *testing.T) {
	figs := map[string]*Figures{}
	for _, c := range Columns {
		figs[c.Name] = &Figures{CommonTTFTMeanMs: 100, CommonTTFTP99Ms: 200}
	}
	figs["no-checkpoint-no-failure"].CommonTTFTMeanMs = 90
	figs["stop-and-restart"].CommonTTFTMeanMs, figs["stop-and-restart"].CommonTTFTP99Ms = 490, 800
	figs["lumen"].CommonTTFTMeanMs, figs["lumen"].CommonTTFTP99Ms = 150, 260
	figs[OracleColumn].CommonTTFTMeanMs, figs[OracleColumn].CommonTTFTP99Ms = 140, 200
	ExcessesVsOracle(figs)
	if x := figs["stop-and-restart"].ExcessVsOracle; x == nil || *x.TTFTMean != 10 || x.TTFTP99 != nil {
		t.Errorf("stop-and-restart: %+v, want (490-90)/(140-100) = 10 and a null p99 (the oracle's p99 excess is 0)", x)
	}
	if x := figs["lumen"].ExcessVsOracle; x == nil || *x.TTFTMean != 1.25 {
		t.Errorf("lumen: %+v, want (150-100)/(140-100) = 1.25", x)
	}
	for _, name := range []string{OracleColumn, "lumen-no-failure", "no-checkpoint-no-failure"} {
		if figs[name].ExcessVsOracle != nil {
			t.Errorf("%s has excess_vs_oracle", name)
		}
	}
	real := map[string]*Figures{}
	for _, c := range RealColumns() {
		if c.SimOnly || c.Oracle {
			t.Fatalf("RealColumns has %s", c.Name)
		}
		real[c.Name] = &Figures{}
	}
	ExcessesVsOracle(real)
	for name, f := range real {
		if f.ExcessVsOracle != nil {
			t.Errorf("%s: excess vs oracle without an oracle", name)
		}
	}
	var b strings.Builder
	(&Table{Figures: real}).Print(&b)
	if strings.Contains(b.String(), "oracle") {
		t.Errorf("a table without the oracle column mentions it:\n%s", b.String())
	}
}

// A run of some columns only (lumen bench recovery -columns) prints the
// comparisons it has and none it lacks.
func TestTableOfSomeColumns(t *testing.T) {
	figs := map[string]*Figures{"lumen-no-failure": {}, "stop-and-restart": {}, "lumen": {}}
	var b strings.Builder
	(&Table{Figures: figs}).Print(&b)
	out := b.String()
	if !strings.Contains(out, "lumen vs stop-and-restart") || strings.Contains(out, "fixed-checkpoint") || strings.Contains(out, "steady state") {
		t.Fatalf("the table of three columns:\n%s", out)
	}
}
