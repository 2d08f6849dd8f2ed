package sim

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

// tinyDegradation is a sweep small enough for a test: four Qwen3-14B
// workers, one failed at 8 s of 30 s of arrivals, a 6 s reload, two
// loads.
func tinyDegradation(seed uint64) DegradationOptions {
	s := Setup{Name: "tiny", Workers: 4, Profile: "qwen3-14b-h100", Failures: 1, MaxRunning: 32, Budget: 80e9,
		Duration: 30 * time.Second, FailAt: 8 * time.Second}
	return DegradationOptions{Setups: []Setup{s}, Loads: []float64{0.6, 0.9}, Reloads: []string{"6s"}, Seed: seed, Seeds: 1, Timing: DefaultTiming()}
}

// TestDegradationRatios: each point of the figure is stop-and-restart's
// figures over its affected requests divided by
// no-checkpoint-no-failure's over the same requests — the same figures a
// Study of all the columns gives at that point, computed here by hand —
// and the JSON carries them under the figure's keys.
func TestDegradationRatios(t *testing.T) {
	seed := uint64(3)
	t.Logf("seed %d", seed)
	o := tinyDegradation(seed)
	d, err := RunDegradation(o)
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Points) != 2 {
		t.Fatalf("%d points, want 2 (one setup, one reload, two loads)", len(d.Points))
	}
	// The point at load 0.9 against a Study of every column.
	pt := d.Points[1]
	s := o.Setups[0]
	s.Reload, s.Load = "6s", 0.9
	timing, err := o.Timing.Under(s.Conditions)
	if err != nil {
		t.Fatal(err)
	}
	st := Study{Setup: s, Timeline: s.Timeline(false), Seed: seed, Load: 0.9, Timing: timing}
	figs, err := st.Run()
	if err != nil {
		t.Fatal(err)
	}
	sr, ref := figs["stop-and-restart"], figs["no-checkpoint-no-failure"]
	if sr.ReferenceTTFTMeanMs == 0 || sr.ReferenceTPOTMeanMs == 0 || sr.AffectedRequests == 0 {
		t.Fatalf("the study's stop-and-restart has no affected requests or no reference: %+v", sr.Figures)
	}
	for _, c := range []struct {
		name      string
		got, want float64
	}{
		{"ttft_mean_x", pt.TTFTMeanX, sr.AffectedTTFTMeanMs / sr.ReferenceTTFTMeanMs},
		{"ttft_p99_x", pt.TTFTP99X, sr.AffectedTTFTP99Ms / sr.ReferenceTTFTP99Ms},
		{"tpot_mean_x", pt.TPOTMeanX, sr.AffectedTPOTMeanMs / sr.ReferenceTPOTMeanMs},
		{"affected_ttft_mean_ms", pt.AffectedTTFTMeanMs, sr.AffectedTTFTMeanMs},
		{"reference_affected_ttft_mean_ms", pt.ReferenceTTFTMeanMs, sr.ReferenceTTFTMeanMs},
		{"cluster_recovery_s", pt.ClusterRecoveryS, sr.ClusterRecoveryS},
		{"affected_requests", float64(pt.AffectedRequests), float64(sr.AffectedRequests)},
		{"no_failure_ttft_mean_ms", pt.NoFailureTTFTMeanMs, ref.TTFTMeanMs},
	} {
		if math.Abs(c.got-c.want) > 1e-9*math.Max(1, math.Abs(c.want)) {
			t.Errorf("%s = %g, the study of every column gives %g", c.name, c.got, c.want)
		}
	}
	// One failed worker of four for a 6 s reload at 0.9 of saturation
	// costs stop-and-restart: the ratio says so, and it is not the
	// whole-run ratio.
	if pt.TTFTMeanX <= 1 || pt.AffectedTTFTMeanMs <= pt.TTFTMeanMs {
		t.Errorf("TTFT mean %.2fx over the affected requests (%.1f ms, the whole run %.1f ms): the failure cost nothing", pt.TTFTMeanX,
			pt.AffectedTTFTMeanMs, pt.TTFTMeanMs)
	}
	if want := 6 * DefaultTiming().ReloadScale; math.Abs(pt.ReloadS-want) > 1e-6 {
		t.Errorf("reload_s %g, want %g", pt.ReloadS, want)
	}

	data, err := json.Marshal(d)
	if err != nil {
		t.Fatal(err)
	}
	var raw struct {
		Name       string           `json:"name"`
		PaperTTFTX float64          `json:"paper_ttft_x"`
		PaperTPOTX float64          `json:"paper_tpot_x"`
		Points     []map[string]any `json:"points"`
	}
	if err := json.Unmarshal(data, &raw); err != nil {
		t.Fatal(err)
	}
	if raw.Name != "degradation" || raw.PaperTTFTX != 4.0 || raw.PaperTPOTX != 1.6 {
		t.Errorf("name %q, paper %gx / %gx", raw.Name, raw.PaperTTFTX, raw.PaperTPOTX)
	}
	for _, k := range []string{"setup", "load", "reload", "reload_s", "ttft_mean_x", "ttft_p99_x", "tpot_mean_x", "affected_requests",
		"cluster_recovery_s", "affected_ttft_mean_ms", "affected_ttft_p99_ms", "affected_tpot_mean_ms",
		"reference_affected_ttft_mean_ms", "reference_affected_ttft_p99_ms", "reference_affected_tpot_mean_ms"} {
		if _, ok := raw.Points[1][k]; !ok {
			t.Errorf("no key %q in a point: %v", k, raw.Points[1])
		}
	}
	if raw.Points[1]["setup"] != "tiny" || raw.Points[1]["load"] != 0.9 || raw.Points[1]["reload"] != "6s" {
		t.Errorf("point %v: want setup tiny, load 0.9, reload 6s", raw.Points[1])
	}

	var svg bytes.Buffer
	if err := d.WriteSVG(&svg); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"<svg", "the seed: 4.0x", "the seed: 1.6x", "tiny, 6s reload"} {
		if !strings.Contains(svg.String(), want) {
			t.Errorf("the SVG has no %q", want)
		}
	}
	var table bytes.Buffer
	d.Print(&table)
	t.Log(table.String())
	if !strings.Contains(table.String(), "tiny") || !strings.Contains(table.String(), "at or beyond the seed's TTFT 4.0x and TPOT 1.6x") {
		t.Errorf("table:\n%s", table.String())
	}
}

// TestDegradationBadReload: a reload engine.ParseReload does not read is
// refused before anything runs, by its name, from the options and from
// the command line alike.
func TestDegradationBadReload(t *testing.T) {
	o := tinyDegradation(1)
	o.Reloads = []string{"warm", "tepid"}
	_, err := RunDegradation(o)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), `"tepid"`) {
		t.Fatalf("RunDegradation with reload tepid: %v, want ErrInvalid naming it", err)
	}
	c := DefaultCommand()
	c.Figure, c.Reload, c.Given["reload"] = DegradationFigure, "tepid", true
	c.Out, c.Errs = &bytes.Buffer{}, &bytes.Buffer{}
	if err := c.Run(); err == nil || !strings.Contains(err.Error(), `"tepid"`) {
		t.Fatalf("lumen sim -figure degradation -reload tepid: %v, want an error naming it", err)
	}
	c = DefaultCommand()
	c.Figure, c.Duration, c.Given["duration"] = DegradationFigure, time.Minute, true
	if err := c.Run(); err == nil || !strings.Contains(err.Error(), "-duration") {
		t.Fatalf("lumen sim -figure degradation -duration 1m: %v, want it refused", err)
	}
}

// TestStudyOnly: a Study runs the columns Only names, each with its
// reference; one without its reference, or a name that is not a column,
// is refused.
func TestStudyOnly(t *testing.T) {
	for _, c := range []struct {
		only []string
		want string
	}{
		{[]string{"stop-and-restart"}, "no-checkpoint-no-failure"},
		{[]string{"lumen", "lumen-no-failure"}, "lumen-no-spec"},
		{[]string{"no-checkpoint-no-failure", "stop-and-rstart"}, `"stop-and-rstart"`},
	} {
		st := Study{Only: c.only}
		if _, err := st.columns(); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Only %v: %v, want ErrInvalid naming %s", c.only, err, c.want)
		}
	}
	st := Study{Only: []string{"stop-and-restart", "no-checkpoint-no-failure"}}
	cols, err := st.columns()
	if err != nil || len(cols) != 2 || cols[0].Name != "no-checkpoint-no-failure" || cols[1].Name != "stop-and-restart" {
		t.Fatalf("columns %v, %v: want no-checkpoint-no-failure then stop-and-restart, the order of Columns", cols, err)
	}
}
