package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/devcluster"
	"github.com/lumen-project/lumen/internal/recoverystudy"
	"github.com/lumen-project/lumen/internal/servingstats"
	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/worker/engine"
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
	cfg.Given = map[string]bool{"reload": true, "decode-context": true, "detect": true}
	if s, err = cfg.setups(); err != nil || !s[0].cond.hang {
		t.Fatalf("conditions %+v, %v", s, err)
	}
	if got, want := s[0].cond.workerArgs(), []string{"-reload", "cold", "-decode-context=true"}; !slices.Equal(got, want) {
		t.Fatalf("worker args %q, want %q", got, want)
	}
	def, _ := DefaultRecoveryConfig().setups()
	if got, want := def[0].cond.workerArgs(), []string{"-reload", "cold", "-decode-context=true"}; !slices.Equal(got, want) || def[0].cond.hang {
		t.Fatalf("default (w4, the stress) worker args %q (hang %v), want %q", got, def[0].cond.hang, want)
	}
}

// TestRecoverySetupConditions: each setup runs under its own conditions,
// resolved as lumen sim resolves them: the headline setups under the
// stress (load 0.9, cold reload, fast detection, the context-dependent
// decode step, cap 256, their own timeline), the -mild setups under the
// flags' defaults (load 0.7, warm, fast, the fitted line) and the mild
// timeline; a flag given overrides every setup's, one not given does not
// even when its value differs from the default.
func TestRecoverySetupConditions(t *testing.T) {
	type want struct {
		load          float64
		reload        string
		decodeContext bool
		hang          bool
		maxRunning    int
	}
	cold, warm := "cold", "warm"
	for _, c := range []struct {
		name  string
		tweak func(*RecoveryConfig)
		w8    want // w8's
		mild  want // w8-mild's
	}{
		{"defaults", func(*RecoveryConfig) {}, want{0.9, cold, true, false, 256}, want{0.7, warm, false, false, 32}},
		{"values not given leave the setups'", func(c *RecoveryConfig) {
			c.Load, c.Reload, c.DecodeContext, c.Detect, c.MaxRunning = 0.5, "30s", "off", "hang", 0
		}, want{0.9, cold, true, false, 256}, want{0.5, "30s", false, true, 32}},
		{"flags given override", func(c *RecoveryConfig) {
			c.Load, c.Reload, c.DecodeContext, c.Detect, c.MaxRunning = 0.5, "warm", "off", "hang", 64
			c.Given = map[string]bool{"load": true, "reload": true, "decode-context": true, "detect": true, "max-running": true}
		}, want{0.5, warm, false, true, 64}, want{0.5, warm, false, true, 64}},
		{"-decode-context on given", func(c *RecoveryConfig) {
			c.DecodeContext, c.Given = "on", map[string]bool{"decode-context": true}
		}, want{0.9, cold, true, false, 256}, want{0.7, warm, true, false, 32}},
	} {
		cfg := DefaultRecoveryConfig()
		cfg.Setups = "w8,w8-mild"
		c.tweak(&cfg)
		if err := cfg.Validate(); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		s, err := cfg.setups()
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		for i, w := range []want{c.w8, c.mild} {
			p := s[i]
			got := want{p.load, p.cond.reload.String(), p.cond.decodeContext, p.cond.hang, p.MaxRunning}
			if got != w {
				t.Errorf("%s: %s runs under %+v, want %+v", c.name, p.Name, got, w)
			}
		}
	}
	// The timelines are the setups' own.
	cfg := DefaultRecoveryConfig()
	cfg.Setups = "w8,w8-mild"
	s, _ := cfg.setups()
	if tl := s[0].Timeline(false); tl.Duration != 360*time.Second || tl.FailAt != 60*time.Second {
		t.Errorf("w8's timeline %+v, want 360 s with the failure at 60 s", tl)
	}
	if tl := s[0].Timeline(true); tl.ReloadScale != recoverystudy.StressQuickScale {
		t.Errorf("w8's quick timeline %+v, want the reload scaled by %g", tl, recoverystudy.StressQuickScale)
	}
	if tl := s[1].Timeline(true); tl != recoverystudy.QuickTimeline() {
		t.Errorf("w8-mild's quick timeline %+v, want QuickTimeline", tl)
	}
}

// TestWallBound: the gateways' resume deadline and the run's bound are
// the run's arrivals and a reload scaled by the time scale, plus the
// slack, so that no request's resume times out before the run ends
// because the emulation is slowed.
func TestWallBound(t *testing.T) {
	tm := benchTiming{Timeline: recoverystudy.Timeline{Duration: 100 * time.Second, ReloadScale: 0.5}, reload: 120 * time.Second}
	if got, want := tm.wallBound(1), 160*time.Second+runSlack; got != want {
		t.Errorf("scale 1: %s, want %s", got, want)
	}
	if got, want := tm.wallBound(4), 640*time.Second+runSlack; got != want {
		t.Errorf("scale 4: %s, want %s", got, want)
	}
	// w8 under -quick at its cold reload: above the gateway's default 60 s
	// by far, and above the run's scaled span.
	cfg := DefaultRecoveryConfig()
	cfg.Setups = "w8"
	s, _ := cfg.setups()
	prof, _, err := engine.LookupProfile(s[0].Profile)
	if err != nil {
		t.Fatal(err)
	}
	reloaded, err := prof.WithReload(s[0].cond.reload)
	if err != nil {
		t.Fatal(err)
	}
	tm = benchTiming{Timeline: s[0].Timeline(true), reload: reloaded.LoadTime()}
	if b := tm.wallBound(4); b < 4*(tm.Duration+time.Duration(float64(tm.reload)*tm.ReloadScale)) {
		t.Errorf("w8 -quick at scale 4: bound %s shorter than the scaled run and reload", b)
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

// TestRegenerationRecomputed: stop-and-restart's tokens_recomputed counts,
// as the simulator does, per interrupted request that had streamed when
// its worker failed and was regenerated, its prompt and the output decoded
// again: the output from the gateway's counter (both results, summed, as
// scraped), the prompts from the client's records.
func TestRegenerationRecomputed(t *testing.T) {
	metrics := `# HELP lumen_gateway_regenerated_tokens_total Output tokens a stop-and-restart resume decoded again.
# TYPE lumen_gateway_regenerated_tokens_total counter
lumen_gateway_regenerated_tokens_total{result="matched"} 41
lumen_gateway_regenerated_tokens_total{result="mismatched"} 1
lumen_gateway_regenerated_total_other 99
`
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, metrics) }))
	defer srv.Close()
	regenerated, err := devcluster.ScrapeMetric(context.Background(), srv.URL+"/metrics", regeneratedMetric)
	if err != nil || regenerated != 42 {
		t.Fatalf("scraped %v, %v; want 42", regenerated, err)
	}
	at := 10 * time.Second
	recs := []*servingstats.Record{
		// Streamed 3 tokens before the failure, regenerated: its prompt.
		{Interrupted: true, Chunks: ms(9000, 9100, 9200, 12000, 12010)},
		// A token still in flight at the kill, then the pause: its prompt.
		{Interrupted: true, Chunks: ms(10005, 13000)},
		// Interrupted before its first token: a new request, nothing.
		{Interrupted: true, Chunks: ms(11000, 11010)},
		// Streamed, then failed with no token after the failure: nothing.
		{Interrupted: true, Chunks: ms(9000), Err: errors.New("resume timed out")},
		// Not interrupted: nothing.
		{Chunks: ms(9000, 12000)},
		nil,
	}
	prompts := []int{100, 200, 400, 800, 1600, 3200}
	if got, want := regenerationRecomputed(recs, prompts, at, regenerated), 42.0+100+200; got != want {
		t.Fatalf("recomputed %v, want %v", got, want)
	}
}

// TestRecoveryNodes: -nodes puts the workers on hosts and the failure
// takes node-1's, all of them; a count outside 2 … workers is refused,
// naming the flag and the limit.
func TestRecoveryNodes(t *testing.T) {
	cfg := DefaultRecoveryConfig()
	cfg.Setups, cfg.Nodes = "w8", 2
	s, err := cfg.setups()
	if err != nil {
		t.Fatal(err)
	}
	v := nodeVictims(8, 2)
	if s[0].Failures != 4 || len(v) != 4 || !v["worker-1"] || !v["worker-4"] || v["worker-5"] {
		t.Fatalf("w8 on 2 nodes: %d failures, victims %v; want worker-1 … worker-4", s[0].Failures, v)
	}
	for _, n := range []int{1, 9} {
		cfg.Nodes = n
		if _, err := cfg.setups(); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("-nodes %d: must be in 2 … 8", n)) {
			t.Errorf("-nodes %d: %v", n, err)
		}
	}
}
