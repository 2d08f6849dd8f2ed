package bench

import (
	"encoding/xml"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/recoverystudy"
	"github.com/lumen-project/lumen/internal/servingstats"
)

// TestTimeSeries: requests are binned by arrival (mean TTFT of those with
// a first token), the queue by sample time, the failure kept.
func TestTimeSeries(t *testing.T) {
	ms := time.Millisecond
	o := &runOutcome{
		recs: []*servingstats.Record{
			{Arrival: 100 * ms, Chunks: []time.Duration{300 * ms}},  // 200 ms
			{Arrival: 900 * ms, Chunks: []time.Duration{1300 * ms}}, // 400 ms
			{Arrival: 2100 * ms, Chunks: []time.Duration{3100 * ms}},
			{Arrival: 2200 * ms}, // no token: not in the mean
		},
		queue:  []servingstats.Sample{{At: 250 * ms, Waiting: 2}, {At: 750 * ms, Waiting: 4}, {At: 2500 * ms, Waiting: 1}},
		failAt: 1500 * ms,
	}
	s := timeSeries(o, time.Second)
	if len(s.TS) != 3 || s.FailAtS != 1.5 || s.BinS != 1 {
		t.Fatalf("series %+v: want 3 bins of 1 s, failure at 1.5 s", s)
	}
	if s.Arrivals[0] != 2 || s.TTFTMeanMs[0] != 300 || s.Waiting[0] != 3 {
		t.Errorf("bin 0: %d arrivals, TTFT %g, queue %g; want 2, 300, 3", s.Arrivals[0], s.TTFTMeanMs[0], s.Waiting[0])
	}
	if s.Arrivals[1] != 0 || s.TTFTMeanMs[1] != 0 || s.Waiting[1] != 0 {
		t.Errorf("bin 1 should be empty: %+v", s)
	}
	if s.Arrivals[2] != 1 || s.TTFTMeanMs[2] != 1000 || s.Waiting[2] != 1 {
		t.Errorf("bin 2: %d arrivals, TTFT %g, queue %g; want 1, 1000, 1", s.Arrivals[2], s.TTFTMeanMs[2], s.Waiting[2])
	}
}

// TestWriteJSONPlots: every benchmark's JSON gets its SVG next to it.
func TestWriteJSONPlots(t *testing.T) {
	path := filepath.Join(t.TempDir(), "recovery.json")
	o := &runOutcome{recs: []*servingstats.Record{{Arrival: 0, Chunks: []time.Duration{time.Second}}}}
	figs := map[string]map[string]*recoveryFigures{"w4": {
		"lumen":            {Figures: recoverystudy.Figures{TTFTMeanMs: 200, TTFTP99Ms: 900, RecoveryS: 12}, Series: timeSeries(o, time.Second)},
		"stop-and-restart": {Figures: recoverystudy.Figures{TTFTMeanMs: 260, TTFTP99Ms: 1200, RecoveryS: 25}, Series: timeSeries(o, time.Second)},
	}}
	if err := writeJSON(path, figs); err != nil {
		t.Fatal(err)
	}
	svg, err := os.ReadFile(strings.TrimSuffix(path, ".json") + ".svg")
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		XMLName xml.Name
	}
	if err := xml.Unmarshal(svg, &doc); err != nil || doc.XMLName.Local != "svg" {
		t.Fatalf("not an SVG document (%v, root %q)", err, doc.XMLName.Local)
	}
	if !strings.Contains(string(svg), "w4: TTFT of the requests arriving") {
		t.Error("no time-series panel")
	}
}
