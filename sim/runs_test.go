package sim

import (
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/core"
)

// TestDecodeRunsSameResult: the decode runs (runs.go) change nothing a run
// measures. Each case runs with and without them and the whole Result —
// every record, series, counter and the Raft stream — must be equal:
// failures with restarts, hangs, every strategy, the oracle, speculation,
// vLLM's preemption under a small KV cache, the context-dependent step,
// gateways and cells, nodes with two checkpoint copies, a stopped run.
func TestDecodeRunsSameResult(t *testing.T) {
	cases := []struct {
		name string
		cfg  func() Config
	}{}
	for _, strategy := range policy.Strategies {
		cases = append(cases, struct {
			name string
			cfg  func() Config
		}{fmt.Sprintf("%s, failures", strategy), func() Config {
			c := smallConfig(t, 6, strategy, 6, 40, 14*time.Second)
			c.Failures = []Failure{{Worker: 0, At: 4 * time.Second, Restart: true}, {Worker: 3, At: 6 * time.Second}}
			return c
		}})
	}
	add := func(name string, f func() Config) {
		cases = append(cases, struct {
			name string
			cfg  func() Config
		}{name, f})
	}
	add("oracle", func() Config {
		c := smallConfig(t, 7, policy.Lumen, 6, 40, 14*time.Second)
		c.Oracle, c.Speculation = true, true
		c.Failures = []Failure{{Worker: 1, At: 5 * time.Second, Restart: true}}
		return c
	})
	add("speculation", func() Config {
		c := smallConfig(t, 8, policy.Lumen, 4, 30, 20*time.Second)
		c.Speculation = true
		c.Timing.ReloadScale = 0.05
		c.Failures = []Failure{{Worker: 0, At: 3 * time.Second, Restart: true}}
		return c
	})
	add("vllm preemption, small KV, hang", func() Config {
		c := smallConfig(t, 9, policy.Lumen, 5, 40, 14*time.Second)
		c.Timing.Preemption = core.PreemptVLLM
		c.KVPages = 2500
		c.Timing.Hang, c.Timing.DetectDelay = true, DefaultHangDetect
		c.Failures = []Failure{{Worker: 2, At: 5 * time.Second, Restart: true}}
		return c
	})
	add("decode context, stopped", func() Config {
		c := smallConfig(t, 10, policy.StopAndRestart, 4, 30, 14*time.Second)
		c.Timing.DecodeContext = true
		c.StopAt = 10 * time.Second
		c.Failures = []Failure{{Worker: 1, At: 4 * time.Second, Restart: true}}
		return c
	})
	add("gateways, cells", func() Config {
		c := cellsConfig(t, 11, 10*time.Second)
		c.Failures = []Failure{{Worker: 2, At: 4 * time.Second, Restart: true}}
		return c
	})
	add("gateways, slow commits", func() Config {
		// The holder reaches a worker (SetHolder) while it decodes.
		c := cellsConfig(t, 13, 10*time.Second)
		c.Cells = 1
		c.Timing.CommitDelay = 300 * time.Millisecond
		return c
	})
	add("nodes, two copies", func() Config {
		c := smallConfig(t, 12, policy.Lumen, 8, 50, 14*time.Second)
		c.GPUsPerNode, c.CheckpointReplicas = 2, 2
		c.Failures = []Failure{{Worker: 2, At: 5 * time.Second, Restart: true}, {Worker: 3, At: 5 * time.Second, Restart: true}}
		return c
	})
	for _, c := range cases {
		cfg := c.cfg()
		off := cfg
		off.NoDecodeRuns = true
		a, err := Run(cfg)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		b, err := Run(off)
		if err != nil {
			t.Fatalf("%s, without runs: %v", c.name, err)
		}
		if a.RunSteps == 0 || b.RunSteps != 0 {
			t.Fatalf("%s: %d steps ended in runs, %d without them: the case does not exercise them", c.name, a.RunSteps, b.RunSteps)
		}
		t.Logf("%s: %d of %d steps ended in decode runs", c.name, a.RunSteps, a.Steps)
		a.RunSteps = 0
		if !reflect.DeepEqual(a, b) {
			t.Fatalf("%s: the results differ with decode runs", c.name)
		}
	}
}
