package sim

import (
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/engine"
)

// A request interrupted after it sent n tokens, resumed alone on an idle
// worker: under stop-and-restart its next token comes after the prompt's
// prefill and the n tokens decoded again, one step each (the seed's
// baseline re-runs it from scratch); under recompute after one prefill of
// the prompt and the n tokens (Dynamo's). Both recompute prompt + n tokens.
func TestStopAndRestartResumeCost(t *testing.T) {
	const prompt, output, sent = 500, 40, 24
	p := engine.Profiles["qwen3-14b-h100"]
	for _, c := range []struct {
		strategy policy.Strategy
		want     time.Duration
	}{
		{policy.StopAndRestart, p.StepTime(0, prompt) + sent*p.StepTime(1, 0)},
		{policy.RecomputeHistory, p.StepTime(0, prompt+sent)},
	} {
		t.Run(c.strategy.String(), func(t *testing.T) {
			ids := make([]int32, prompt)
			for i := range ids {
				ids[i] = int32(32 + i%90)
			}
			cfg := Config{Workers: 2, Profile: p, Strategy: c.strategy, TokenBudget: 2048, MaxRunning: 32, MaxWaiting: 64,
				CheckpointBudget: 80e9, Arrivals: []workload.Request{{Prompt: ids, Output: output}}, Timing: DefaultTiming(), keepRequests: true}
			s, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			r := func() *simRequest { return s.reqs[0] }
			if !s.advance(func() bool { return r() != nil && r().out == sent }) {
				t.Fatalf("the request did not reach %d tokens: %v", sent, s.err)
			}
			s.kill(s.worker(r().worker), false)
			if !s.advance(func() bool { return r().call != nil }) {
				t.Fatalf("the request was not resumed: %v", s.err)
			}
			called, survivor := s.now, r().worker
			if !s.advance(func() bool { return r().out == sent+1 }) {
				t.Fatalf("no new token after the resume: %v", s.err)
			}
			if got := s.now - called; got != c.want {
				t.Errorf("the resume at %s took %s to its next new token, want %s", survivor, got, c.want)
			}
			s.Run()
			if s.err != nil {
				t.Fatal(s.err)
			}
			if err := s.Check(); err != nil {
				t.Fatal(err)
			}
			if r().out != output || s.res.Failed != 0 || s.res.Interrupted != 1 {
				t.Fatalf("the client got %d tokens of %d (%d failed, %d interrupted)", r().out, output, s.res.Failed, s.res.Interrupted)
			}
			if s.res.RecomputedTokens != prompt+sent || s.res.RestoredPages != 0 {
				t.Errorf("recomputed %d tokens, restored %d pages; want %d, 0", s.res.RecomputedTokens, s.res.RestoredPages, prompt+sent)
			}
		})
	}
}
