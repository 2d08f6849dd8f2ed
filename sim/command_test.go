package sim

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestPrototypeSetupsQuick is `lumen sim -setups w4,w8,w8_f4 -quick -json`:
// the JSON has every setup and column, with the benchmark's keys.
func TestPrototypeSetupsQuick(t *testing.T) {
	path, csvPath := filepath.Join(t.TempDir(), "sim.json"), filepath.Join(t.TempDir(), "sim.csv")
	o := Options{Setups: PrototypeSetups, Quick: true, Seed: 1, Load: 0.7, Timing: DefaultTiming(), JSONPath: path, CSVPath: csvPath}
	if _, err := RunStudies(o); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]map[string]map[string]any
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatal(err)
	}
	want := []string{"ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms", "resume_mean_ms", "recovery_s", "pages_reused",
		"tokens_recomputed", "requests", "failed_requests", "apply_markfailed_p99_ms", "apply_dispatch_p99_ms"}
	for _, s := range []string{"w4", "w8", "w8_f4"} {
		for _, c := range Columns {
			fig, ok := got[s][c.Name]
			if !ok {
				t.Fatalf("%s/%s missing", s, c.Name)
			}
			for _, k := range want {
				if _, ok := fig[k]; !ok {
					t.Errorf("%s/%s: key %s missing", s, c.Name, k)
				}
			}
		}
		if got[s]["lumen"]["failed_requests"].(float64) != 0 || got[s]["lumen"]["interrupted"].(float64) == 0 {
			t.Errorf("%s/lumen: %v", s, got[s]["lumen"])
		}
	}
	csv, err := os.ReadFile(csvPath)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(csv)), "\n")
	if lines[0]+"\n" != SeriesHeader || len(lines) < 3*len(Columns)*36 {
		t.Fatalf("CSV: header %q, %d lines", lines[0], len(lines))
	}
	if !slices.Contains(FigureNames, "failures") {
		t.Fatal("figure list")
	}
}
