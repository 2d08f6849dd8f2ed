package bench

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/recoverystudy"
	"github.com/lumen-project/lumen/internal/workload"
)

// TestRecoveryConditions: `lumen bench recovery`'s conditions are checked
// before anything starts, -max-running overrides every setup's cap, and
// the workers get the reload and decode flags.
func TestRecoveryConditions(t *testing.T) {
	cfg := DefaultRecoveryConfig()
	if err := cfg.Validate(); err != nil {
		t.Fatalf("the defaults: %v", err)
	}
	cfg.Load = 0.95
	if err := cfg.Validate(); err != nil {
		t.Fatalf("-load 0.95: %v", err)
	}
	for _, c := range []struct {
		tweak func(*RecoveryConfig)
		want  string
	}{
		{func(c *RecoveryConfig) { c.Load = 1.6 }, "-load"},
		{func(c *RecoveryConfig) { c.Reload = "tepid" }, "-reload"},
		{func(c *RecoveryConfig) { c.DecodeContext = "yes" }, "-decode-context"},
		{func(c *RecoveryConfig) { c.Detect = "2s" }, "-detect"},
		{func(c *RecoveryConfig) { c.MaxRunning = -1 }, "-max-running"},
		{func(c *RecoveryConfig) { c.TokenBudget = -1 }, "-token-budget"},
	} {
		bad := DefaultRecoveryConfig()
		c.tweak(&bad)
		if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error naming %s", bad, err, c.want)
		}
	}
	cfg.Setups = "w4-mild,w8_f4-mild"
	s, err := cfg.setups()
	if err != nil || s[0].MaxRunning != 64 || s[1].MaxRunning != 32 {
		t.Fatalf("the setups' own caps: %+v, %v", s, err)
	}
	cfg.MaxRunning = 256
	if s, err = cfg.setups(); err != nil || s[0].MaxRunning != 256 || s[1].MaxRunning != 256 {
		t.Fatalf("-max-running 256: %+v, %v", s, err)
	}
	cfg.TokenBudget = 8192
	if s, err = cfg.setups(); err != nil || s[0].StepTokens() != 8192 || s[1].StepTokens() != 8192 {
		t.Fatalf("-token-budget 8192: %+v, %v", s, err)
	}
	if w4, _ := recoverystudy.Lookup("w4-mild"); w4.MaxRunning != 64 || w4.StepTokens() != 2048 {
		t.Fatalf("the override changed the setup itself: %+v", w4)
	}
	cfg.Reload, cfg.DecodeContext, cfg.Detect = "cold", "on", "hang"
	cond, err := cfg.conditions()
	if err != nil || !cond.hang {
		t.Fatalf("conditions %+v, %v", cond, err)
	}
	if got, want := cond.workerArgs(), []string{"-reload", "cold", "-decode-context=true"}; !slices.Equal(got, want) {
		t.Fatalf("worker args %q, want %q", got, want)
	}
	def, _ := DefaultRecoveryConfig().conditions()
	if got, want := def.workerArgs(), []string{"-reload", "warm", "-decode-context=false"}; !slices.Equal(got, want) || def.hang {
		t.Fatalf("default worker args %q (hang %v), want %q", got, def.hang, want)
	}
}

// TestBenchArrivals: without a trace the bench generates what lumen sim
// generates; with one it takes the trace's arrivals rescaled, as lumen sim
// does, with the prompts' ids for the request bodies.
func TestBenchArrivals(t *testing.T) {
	var tm benchTiming
	gen, err := tm.arrivals(3, 5, 10*time.Second)
	want, _ := workload.Generate(workload.Config{Seed: 3, Rate: 5, Duration: 10 * time.Second, Trace: workload.AzureConversation})
	if err != nil || len(gen) != len(want) || gen[4].At != want[4].At || !slices.Equal(gen[4].Prompt, want[4].Prompt) {
		t.Fatalf("generated: %d requests (%v), want %d", len(gen), err, len(want))
	}
	csv := "TIMESTAMP,ContextTokens,GeneratedTokens\n"
	for i := range 40 {
		csv += fmt.Sprintf("2023-11-16 18:15:%02d.0000000,%d,%d\n", i, 100+i, 10+i)
	}
	tm.trace, err = workload.ReadAzureTrace(strings.NewReader(csv), 1)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tm.arrivals(1, 2, 10*time.Second) // twice the native rate
	if err != nil || len(got) != 20 || got[19].At != 9500*time.Millisecond {
		t.Fatalf("trace: %d requests, %v", len(got), err)
	}
	if len(got[3].Prompt) != 103 || got[3].Output != 13 {
		t.Fatalf("request 3: %d prompt ids, %d output tokens", len(got[3].Prompt), got[3].Output)
	}
	if _, err := tm.arrivals(1, 2, 0); !errors.Is(err, workload.ErrTrace) {
		t.Fatalf("no arrival in the span: %v", err)
	}
}
