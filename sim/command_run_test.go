package sim

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]map[string]*Figures
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatal(err)
	}
	if len(got["w4"]) != len(Columns) || got["w4"]["lumen"].Requests == 0 {
		t.Fatalf("JSON %s", data)
	}
	for _, want := range []string{"w4 (4 workers, qwen3-32b-h100, 1 failed; simulated)", "lumen vs stop-and-restart:", "Apply(Dispatch) p99 ms"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("no %q in\n%s", want, out.String())
		}
	}
}
