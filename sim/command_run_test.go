package sim

import (
	"bytes"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/workload"
)

// A flag that does not apply to what runs is refused, not ignored; so are
// the removed prototypes' choices and biases.
func TestCommandRefuses(t *testing.T) {
	for _, c := range []struct {
		tweak func(*Command)
		want  string
	}{
		{func(c *Command) { c.Figure, c.CV, c.Given["cv"] = "load", 2, true }, "-cv and -kv-pages apply to -figure burst only"},
		{func(c *Command) { c.Figure, c.Given["gateways"] = "load", true }, "not to -figure load"},
		{func(c *Command) { c.GatewayChoice = "fill" }, "one of freest, partition-fill"},
		{func(c *Command) { c.GatewayBias = 0.3 }, "placer.ShareBias"},
		{func(c *Command) { c.Setups, c.Workers = "w4", 4 }, "-setups and -workers"},
		{func(c *Command) { c.Migration = "maybe" }, "on or off"},
		{func(c *Command) { c.Figure, c.Given["spec-k"] = "spec-k", true }, "do not apply"},
		{func(c *Command) { c.PrefixRouting = "yes" }, "-prefix-routing \"yes\": on or off"},
		{func(c *Command) { c.Figure, c.Given["prefix-routing"] = "load", true }, "-prefix-routing applies to the studies and to -figure prefix"},
		{func(c *Command) { c.PrefixRouting, c.Gateways = "on", 2 }, "does not run with -gateways 2"},
		{func(c *Command) { c.Figure, c.Given["xs"] = PrefixFigureName, true }, "runs llm-d's load ladder"},
		{func(c *Command) { c.Figure, c.Given["fail-at"] = PrefixFigureName, true }, "-fail-at and -no-restart go with -fail"},
		{func(c *Command) { c.Figure, c.Fail, c.Given["fail"] = PrefixFigureName, 8, true }, "8 failed workers of 8: at least one must survive"},
		{func(c *Command) { c.Figure, c.Saturated, c.Given["saturated"] = "burst", 5, true }, "not to -figure burst"},
		{func(c *Command) { c.Figure, c.CalibrationWorkers, c.Given["calibration-workers"] = "load", 8, true }, "not to -figure load"},
		{func(c *Command) { c.Setups, c.Saturated, c.Given["saturated"] = "w4,w8", 5, true }, "studies of one setup"},
		{func(c *Command) { c.Setups, c.CalibrationWorkers, c.Given["calibration-workers"] = "w4,w8", 2, true }, "studies of one setup"},
		{func(c *Command) { c.CalibrationWorkers, c.Given["calibration-workers"] = 2, true }, "studies of one setup"},
	} {
		cmd := DefaultCommand()
		cmd.Out, cmd.Errs = &bytes.Buffer{}, &bytes.Buffer{}
		c.tweak(&cmd)
		if err := cmd.Run(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("got %v, want an error with %q", err, c.want)
		}
	}
}

// `lumen sim -setups w4 -quick -apply-timing=false -json` through the
// command writes what RunStudies returns, and the table.
func TestCommandStudies(t *testing.T) {
	path := filepath.Join(t.TempDir(), "w4.json")
	var out bytes.Buffer
	cmd := DefaultCommand()
	cmd.Setups, cmd.Quick, cmd.ApplyTiming, cmd.JSONPath, cmd.Out, cmd.Errs = "w4", true, false, path, &out, &out
	var got map[string]map[string]*Figures
	data := runJSON(t, &cmd, &got)
	if len(got["w4"]) != len(Columns) || got["w4"]["lumen"].Requests == 0 {
		t.Fatalf("JSON %s", data)
	}
	for _, want := range []string{"w4 (4 workers, qwen3-32b-h100, 1 failed; simulated)", "lumen vs stop-and-restart:", "Apply(Dispatch) p99 ms"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("no %q in\n%s", want, out.String())
		}
	}
}

// -calibration-workers calibrates on fewer workers and scales the rate to
// the setup's; -saturated skips the calibration: what a study at 10,000
// workers needs (a calibration at full size costs a column).
func TestCommandCalibrationSize(t *testing.T) {
	run := func(tweak func(*Command)) *Figures {
		t.Helper()
		path := filepath.Join(t.TempDir(), "c.json")
		var out bytes.Buffer
		cmd := DefaultCommand()
		cmd.Workers, cmd.Duration, cmd.Columns, cmd.ApplyTiming, cmd.JSONPath, cmd.Out, cmd.Errs = 8, 8*time.Second, "lumen-no-failure", false, path, &out, &out
		tweak(&cmd)
		var got map[string]map[string]*Figures
		runJSON(t, &cmd, &got)
		return got["custom"]["lumen-no-failure"]
	}
	small := Study{Setup: CustomSetup(4, "qwen3-14b-h100", 1, 32, 80e9), Timeline: Timeline{Duration: 8 * time.Second, Calibration: 4 * time.Second, ReloadScale: 1},
		Seed: 1, Timing: DefaultTiming()}
	want, _, err := small.Calibrate()
	if err != nil {
		t.Fatal(err)
	}
	scaled := run(func(c *Command) { c.CalibrationWorkers, c.Given["calibration-workers"] = 4, true })
	if scaled.SaturatedPerSec != 2*want {
		t.Fatalf("calibrated on 4 of 8 workers: saturated %g/s, want twice the 4 workers' %g/s", scaled.SaturatedPerSec, want)
	}
	given := run(func(c *Command) { c.Saturated, c.Given["saturated"] = 123.5, true })
	load := DefaultCommand().Load
	if given.SaturatedPerSec != 123.5 || given.ArrivalRatePerSec != load*123.5 {
		t.Fatalf("-saturated 123.5: saturated %g/s, offered %g/s", given.SaturatedPerSec, given.ArrivalRatePerSec)
	}
}

// The Raft write stream's JSON keys (issue 26's contract): raft_entries_per_s
// and raft_bytes_per_s by command type and "total", per second of the span
// from the warm-up to the end of the arrivals, and with cells each cell's
// part, which add up to the whole. Failure-free with Apply's dispatch,
// every arrival of the span is one dispatch entry applied in it.
func TestRaftJSONKeys(t *testing.T) {
	for _, cells := range []int{1, 2} {
		path := filepath.Join(t.TempDir(), "r.json")
		var out bytes.Buffer
		cmd := DefaultCommand()
		cmd.Workers, cmd.Duration, cmd.Columns, cmd.ApplyTiming, cmd.JSONPath, cmd.Out, cmd.Errs = 8, 12*time.Second, "lumen-no-failure", false, path, &out, &out
		cmd.Saturated, cmd.Given["saturated"] = 50, true
		if cells > 1 {
			cmd.Cells, cmd.Gateways, cmd.Given["cells"], cmd.Given["gateways"] = cells, 2, true, true
		}
		var raw map[string]map[string]map[string]any
		runJSON(t, &cmd, &raw)
		col := raw["custom"]["lumen-no-failure"]
		entries, ok1 := col["raft_entries_per_s"].(map[string]any)
		bytesPerS, ok2 := col["raft_bytes_per_s"].(map[string]any)
		if !ok1 || !ok2 {
			t.Fatalf("cells %d: no raft_entries_per_s or raft_bytes_per_s in %v", cells, col)
		}
		var sumE, sumB float64
		for _, typ := range []string{"dispatch", "complete", "report_load", "register_worker", "set_strategy"} {
			sumE += num(entries[typ])
			sumB += num(bytesPerS[typ])
		}
		for _, typ := range []string{"dispatch", "complete", "report_load", "total"} {
			e, b := num(entries[typ]), num(bytesPerS[typ])
			if e <= 0 || b < 10*e || b > 200*e {
				t.Errorf("cells %d: %s: %g entries/s, %g bytes/s", cells, typ, e, b)
			}
		}
		if len(entries) != len(bytesPerS) || math.Abs(sumE-num(entries["total"])) > 1e-6 || math.Abs(sumB-num(bytesPerS["total"])) > 1e-3 {
			t.Errorf("cells %d: the types %v do not add up to the total", cells, entries)
		}
		// Every arrival of [warm-up, end) is one Dispatch applied in the
		// span: at its arrival (Apply), or CommitDelay later (gateways).
		tm := 12 * time.Second
		warm := tm / 12
		reqs, err := workload.GenerateLazy(workload.Config{Seed: 1, Rate: 0.7 * 50, Duration: tm, Trace: workload.AzureConversation})
		if err != nil {
			t.Fatal(err)
		}
		lag := time.Duration(0)
		if cells > 1 {
			lag = DefaultTiming().CommitDelay
		}
		n := 0
		for _, r := range reqs {
			if at := r.At + lag; at >= warm && at < tm {
				n++
			}
		}
		if got := num(entries["dispatch"]) * (tm - warm).Seconds(); math.Abs(got-float64(n)) > 1e-6 {
			t.Errorf("cells %d: %g dispatch entries in the span, %d arrivals", cells, got, n)
		}
		if cells > 1 {
			cs, _ := col["cells"].([]any)
			if len(cs) != cells {
				t.Fatalf("cells %d: %d cells in the JSON", cells, len(cs))
			}
			var e, b float64
			for _, c := range cs {
				m := c.(map[string]any)
				e += num(m["raft_entries_per_s"].(map[string]any)["total"])
				b += num(m["raft_bytes_per_s"].(map[string]any)["total"])
			}
			// SetStrategy goes to every cell's log: the cells' sum counts it
			// once a cell (it is applied before the span: not counted).
			if math.Abs(e-num(entries["total"])) > 1e-6 || math.Abs(b-num(bytesPerS["total"])) > 1e-3 {
				t.Errorf("the cells' %g entries/s and %g bytes/s are not the whole's %g and %g", e, b, num(entries["total"]), num(bytesPerS["total"]))
			}
		}
	}
}

func num(v any) float64 {
	f, _ := v.(float64)
	return f
}

// runJSON runs cmd and decodes the JSON it wrote (cmd.JSONPath) into v,
// returning the file's bytes.
func runJSON(t *testing.T, cmd *Command, v any) []byte {
	t.Helper()
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(cmd.JSONPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, v); err != nil {
		t.Fatal(err)
	}
	return data
}
