package sim

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestPrototypeSetupsQuick is `lumen sim -setups w4-mild,w8-mild,w8_f4-mild -quick -json`:
// the JSON has every setup and column, with the benchmark's keys.
func TestPrototypeSetupsQuick(t *testing.T) {
	path, csvPath := filepath.Join(t.TempDir(), "sim.json"), filepath.Join(t.TempDir(), "sim.csv")
	mild, err := ParseSetups("w4-mild,w8-mild,w8_f4-mild")
	if err != nil {
		t.Fatal(err)
	}
	o := Options{Setups: mild, Quick: true, Seed: 1, Load: 0.7, Timing: DefaultTiming(), JSONPath: path, CSVPath: csvPath}
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
		"tokens_recomputed", "requests", "failed_requests", "apply_markfailed_p99_ms", "apply_dispatch_p99_ms",
		"affected_ttft_mean_ms", "affected_ttft_p99_ms", "affected_tpot_mean_ms", "interrupted_recovery_mean_s",
		"interrupted_recovery_p99_s", "cluster_recovery_s", "restored_fraction", "checkpoint_bytes_sent"}
	for _, s := range []string{"w4-mild", "w8-mild", "w8_f4-mild"} {
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
		// The lumen column says what its assist did; the ablation has none.
		for _, k := range []string{"accept_rate", "draft_tokens", "accepted_tokens", "assist_s", "spec_k_mean",
			"phase_loading_draft_s", "phase_assist_s", "phase_hotswap_s", "paired_decode_tok_s", "paired_decode_before_tok_s", "paired_decode_no_spec_tok_s"} {
			if v, ok := got[s]["lumen"][k].(float64); !ok || v <= 0 {
				t.Errorf("%s/lumen: %s = %v", s, k, got[s]["lumen"][k])
			}
			if _, ok := got[s]["lumen-no-spec"][k]; ok {
				t.Errorf("%s/lumen-no-spec has %s", s, k)
			}
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

// A failure time at or past the arrivals' end is refused, naming both;
// one inside moves the kill (the interrupted requests then differ).
func TestFailAt(t *testing.T) {
	custom := []Setup{CustomSetup(4, "qwen3-14b-h100", 1, 32, 0)}
	_, err := RunStudies(Options{Setups: custom, Duration: 20 * time.Second, FailAt: 20 * time.Second, Seed: 1, Load: 0.7, Timing: DefaultTiming()})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "20s") {
		t.Fatalf("FailAt at the end: %v, want ErrInvalid naming 20s", err)
	}
	interrupted := func(at time.Duration) int {
		out, err := RunStudies(Options{Setups: custom, Duration: 20 * time.Second, FailAt: at, Seed: 1, Load: 0.7, Timing: DefaultTiming()})
		if err != nil {
			t.Fatal(err)
		}
		return out["custom"]["lumen"].Interrupted
	}
	if a, b := interrupted(2*time.Second), interrupted(12*time.Second); a == b {
		t.Logf("seed 1: %d interrupted at 2 s and at 12 s", a)
		t.Fatal("moving the failure changed nothing")
	}
}
