package plot

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// wellFormed parses svg as XML and returns the text of its <text> elements.
func wellFormed(t *testing.T, svg []byte) []string {
	t.Helper()
	d := xml.NewDecoder(bytes.NewReader(svg))
	var texts []string
	inText, root := false, ""
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("not well-formed XML: %v", err)
		}
		switch el := tok.(type) {
		case xml.StartElement:
			if root == "" {
				root = el.Name.Local
			}
			inText = el.Name.Local == "text"
		case xml.CharData:
			if inText {
				texts = append(texts, strings.TrimSpace(string(el)))
			}
		case xml.EndElement:
			inText = false
		}
	}
	if root != "svg" {
		t.Fatalf("root element %q, want svg", root)
	}
	return texts
}

func contains(texts []string, want string) bool {
	for _, s := range texts {
		if s == want {
			return true
		}
	}
	return false
}

// excessValue matches an excess_vs_oracle with a number for its mean.
var excessValue = regexp.MustCompile(`"excess_vs_oracle":\s*\{\s*"ttft_mean":\s*-?[0-9]`)

// TestCommittedResults plots every JSON under bench-results/ (what
// docs/benchmarks.md shows) and checks each SVG is well-formed XML naming
// the series it was given.
func TestCommittedResults(t *testing.T) {
	files, err := filepath.Glob("../../bench-results/*.json")
	if err != nil || len(files) == 0 {
		t.Fatalf("no bench-results: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			svg, err := Render(data)
			if err != nil {
				t.Fatal(err)
			}
			texts := wellFormed(t, svg)
			var want []string
			base := filepath.Base(f)
			switch {
			case strings.HasPrefix(base, "recovery-"), strings.HasPrefix(base, "sim-setups"),
				strings.HasPrefix(base, "sim-failures"), strings.HasPrefix(base, "sim-proportional"), strings.HasPrefix(base, "sim-load"):
				want = []string{"lumen", "stop-and-restart", "fixed-checkpoint"}
			case strings.HasPrefix(base, "sim-custom-w10000"):
				// issue 26's recovery at 10,000 workers: lumen-no-spec
				// and its failure-free reference alone (-columns).
				want = []string{"custom", "lumen-no-spec", "lumen-no-failure"}
			case strings.HasPrefix(base, "sim-issue24"):
				want = []string{"lumen", "stop-and-restart", "fixed-checkpoint", "restored fraction", "node R=1", "node+1 R=2", "2 workers R=2"}
			case strings.HasPrefix(base, "migration-llumnix"):
				want = []string{"infaas++ (real)", "lumen (real)", "infaas++ (sim)", "lumen (sim)"}
			case strings.HasPrefix(base, "sim-cells"):
				want = []string{"TTFT mean", "TTFT p99", "Dispatch", "one quorum's placements (quiet)"}
			case strings.HasPrefix(base, "sim-prefix"):
				want = []string{"freeness", "prefix-aware", "prefix caching, llm-d: TTFT p90 (s)"}
			case strings.HasPrefix(base, "migration-"):
				want = []string{"client-visible gap", "one decode step", "off", "on", "8192"}
			case strings.HasPrefix(base, "sim-burst"):
				want = []string{"off", "on"}
			case strings.HasPrefix(base, "sim-llumnix-priority"):
				want = []string{"infaas++", "lumen", "lumen+priority", "high-priority floor"}
			case strings.HasPrefix(base, "sim-llumnix"):
				want = []string{"round-robin", "infaas++", "lumen"}
			case strings.HasPrefix(base, "sim-degradation"):
				want = []string{"the seed: 4.0x", "the seed: 1.6x"}
				for _, line := range []string{"w4, warm reload (", "w4, cold reload (", "w8, warm reload (", "w8, cold reload ("} {
					found := false
					for _, s := range texts {
						found = found || strings.HasPrefix(s, line)
					}
					if !found {
						t.Errorf("no line %q… in the SVG (texts: %q)", line, texts)
					}
				}
			case strings.HasPrefix(base, "sim-spec-k"):
				want = []string{"batch 32, fixed K", "batch 32, adaptive"}
			case strings.HasPrefix(base, "controller"):
				want = []string{"dispatch", "dispatch_p99", "read", "read_p99", "failover_median", "unary_dispatch"}
			case strings.HasPrefix(base, "gateway"):
				want = []string{"added_ttft_p99", "throughput_loss", "direct_ttft_p99", "gateway_ttft_p99"}
			default:
				t.Fatalf("no expectation for %s: add one", base)
			}
			// A JSON with the oracle (issue 27) gets its column and the
			// panels of excess vs the oracle, the goal marked, where an
			// excess has a value (a run whose oracle saw no excess over
			// the failure-free run, as 1,024 workers losing one, has
			// nulls and no panels).
			if excessValue.Match(data) {
				want = append(want, "oracle", "goal: 1.2x")
			}
			for _, w := range want {
				if !contains(texts, w) {
					t.Errorf("no text %q in the SVG (texts: %q)", w, texts)
				}
			}
		})
	}
}

// TestFigureExcessVsOracle: a figure's excess_vs_oracle gets a panel per
// statistic, a line for each column that has one (not the oracle, not a
// failure-free column), the floor and the goal marked; a figure without
// it gets none.
func TestFigureExcessVsOracle(t *testing.T) {
	fig := `{"name": "failures", "x_label": "failed workers", "points": [
	  {"x": 1, "columns": {"lumen": {"ttft_mean_ms": 10, "excess_vs_oracle": {"ttft_mean": 1.1, "ttft_p99": 1.3}},
	    "stop-and-restart": {"ttft_mean_ms": 20, "excess_vs_oracle": {"ttft_mean": 2.5, "ttft_p99": null}},
	    "oracle": {"ttft_mean_ms": 9}, "lumen-no-failure": {"ttft_mean_ms": 5}}},
	  {"x": 4, "columns": {"lumen": {"ttft_mean_ms": 30, "excess_vs_oracle": {"ttft_mean": 1.05, "ttft_p99": 1.0}},
	    "stop-and-restart": {"ttft_mean_ms": 60, "excess_vs_oracle": {"ttft_mean": 3, "ttft_p99": 2}},
	    "oracle": {"ttft_mean_ms": 28}, "lumen-no-failure": {"ttft_mean_ms": 5}}}]}`
	svg, err := Render([]byte(fig))
	if err != nil {
		t.Fatal(err)
	}
	texts := wellFormed(t, svg)
	for _, w := range []string{"failures: TTFT mean excess vs the oracle's (x)", "failures: TTFT p99 excess vs the oracle's (x)",
		"goal: 1.2x", "the floor (oracle)", "oracle"} {
		if !contains(texts, w) {
			t.Errorf("no text %q in the SVG (texts: %q)", w, texts)
		}
	}
	count := func(texts []string, w string) int {
		n := 0
		for _, s := range texts {
			if s == w {
				n++
			}
		}
		return n
	}
	// lumen's legend: the three panels of every figure, the two of the
	// excess; the failure-free column only in the three.
	if got := count(texts, "lumen"); got != 5 {
		t.Errorf("lumen in %d legends, want 5 (3 panels + 2 excess panels)", got)
	}
	if got := count(texts, "lumen-no-failure"); got != 3 {
		t.Errorf("lumen-no-failure in %d legends, want 3 (it has no excess vs the oracle)", got)
	}
	old := `{"name": "failures", "x_label": "failed workers", "points": [{"x": 1, "columns": {"lumen": {"ttft_mean_ms": 10}, "stop-and-restart": {"ttft_mean_ms": 20}}}]}`
	svg, err = Render([]byte(old))
	if err != nil {
		t.Fatal(err)
	}
	if texts := wellFormed(t, svg); contains(texts, "goal: 1.2x") {
		t.Errorf("a figure without excess_vs_oracle got its panels (texts: %q)", texts)
	}
}

// TestSeries: a recovery JSON carrying time series gets TTFT and queue
// panels with the failure marked; so does the simulator's CSV.
func TestSeries(t *testing.T) {
	s := &Series{BinS: 1, FailAtS: 2.5, TS: []float64{0, 1, 2, 3, 4}, Arrivals: []int{3, 0, 4, 5, 2},
		TTFTMeanMs: []float64{100, 0, 110, 400, 120}, Waiting: []float64{0, 1, 0, 7, 2}}
	in := map[string]map[string]any{"w4": {
		"lumen":            map[string]any{"ttft_mean_ms": 1.0, "ttft_p99_ms": 2.0, "recovery_s": 3.0, "series": s},
		"stop-and-restart": map[string]any{"ttft_mean_ms": 1.5, "ttft_p99_ms": 2.5, "recovery_s": 9.0, "series": s},
	}}
	data, err := json.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	svg, err := Render(data)
	if err != nil {
		t.Fatal(err)
	}
	texts := wellFormed(t, svg)
	for _, w := range []string{"w4: TTFT of the requests arriving", "w4: requests waiting at live workers", "failure", "lumen", "stop-and-restart"} {
		if !contains(texts, w) {
			t.Errorf("no text %q in %q", w, texts)
		}
	}
	csv := seriesCSVHeader + "\nw8,lumen,0,3,100,0\nw8,lumen,1,2,120,1\nw8,fixed-checkpoint,0,3,100,0\nw8,fixed-checkpoint,1,0,0,4\n"
	svg, err = Render([]byte(csv))
	if err != nil {
		t.Fatal(err)
	}
	texts = wellFormed(t, svg)
	for _, w := range []string{"w8: TTFT of the requests arriving", "fixed-checkpoint", "lumen"} {
		if !contains(texts, w) {
			t.Errorf("csv: no text %q in %q", w, texts)
		}
	}
}

// TestWriteNextTo writes the SVG beside the JSON, and refuses what it
// cannot plot with an error naming the file.
func TestWriteNextTo(t *testing.T) {
	dir := t.TempDir()
	in := filepath.Join(dir, "controller.json")
	if err := os.WriteFile(in, []byte(`{"read_per_s": 51000, "read_p99_ms": 1.2, "failover_median_s": 0.9, "elections_without_faults": 0}`), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := WriteNextTo(in)
	if err != nil {
		t.Fatal(err)
	}
	if out != filepath.Join(dir, "controller.svg") {
		t.Fatalf("wrote %s", out)
	}
	svg, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	texts := wellFormed(t, svg)
	for _, w := range []string{"read", "read_p99", "failover_median"} {
		if !contains(texts, w) {
			t.Errorf("no bar %q in %q", w, texts)
		}
	}
	gw := filepath.Join(dir, "gateway.json")
	if err := os.WriteFile(gw, []byte(`{"direct_ttft_p99_ms_1": 20, "gateway_ttft_p99_ms_1": 21, "direct_ttft_p99_ms_100": 40, "gateway_ttft_p99_ms_100": 45, "gateway_tokens_per_s_100": 9000}`), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err = WriteNextTo(gw)
	if err != nil {
		t.Fatal(err)
	}
	if svg, err = os.ReadFile(out); err != nil {
		t.Fatal(err)
	}
	texts = wellFormed(t, svg)
	for _, w := range []string{"direct_ttft_p99", "gateway_ttft_p99", "100", "gateway_tokens"} {
		if !contains(texts, w) {
			t.Errorf("gateway: no %q in %q", w, texts)
		}
	}
	bad := filepath.Join(dir, "bad.json")
	if err := os.WriteFile(bad, []byte(`{"note": "nothing numeric"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := WriteNextTo(bad); !errors.Is(err, ErrUnknown) || !strings.Contains(err.Error(), "bad.json") {
		t.Fatalf("err = %v, want ErrUnknown naming bad.json", err)
	}
}

// Every column of the recovery comparison has a colour no other has, and
// the strategies sort as the tables show them, baselines first.
func TestStrategyColoursAndOrder(t *testing.T) {
	cols := []string{"lumen", "no-checkpoint-no-failure", "recompute", "lumen-no-failure", "fixed-checkpoint", "stop-and-restart", "lumen-no-spec", "oracle"}
	seen := map[any]string{}
	for i, c := range cols {
		k := colour(c, i)
		if other, dup := seen[k]; dup {
			t.Errorf("%s and %s share a colour", c, other)
		}
		seen[k] = c
	}
	want := "stop-and-restart recompute fixed-checkpoint lumen-no-spec lumen oracle lumen-no-failure no-checkpoint-no-failure"
	if got := strings.Join(strategyOrder(cols), " "); got != want {
		t.Errorf("order %q, want %q", got, want)
	}
}
