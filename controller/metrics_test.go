package controller

import (
	"strings"
	"testing"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// TestApplyDurationMetric: the replica's registry has the FSM apply time by
// command type, with help text, and it counts the commands applied.
func TestApplyDurationMetric(t *testing.T) {
	c := newCluster(t, 1, nil)
	c.addWorker("w1", 1, 1<<30)
	if _, err := c.client(c.nodes[0]).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "r", PromptTokens: 1, MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	fams, err := c.nodes[0].metrics.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]uint64{}
	for _, f := range fams {
		if f.GetName() != "lumen_controller_fsm_apply_seconds" {
			continue
		}
		if !strings.Contains(f.GetHelp(), "by command type") {
			t.Fatalf("help text %q", f.GetHelp())
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "command" {
					counts[l.GetValue()] = m.GetHistogram().GetSampleCount()
				}
			}
		}
	}
	for _, cmd := range []string{"noop", "register_worker", "dispatch"} {
		if counts[cmd] == 0 {
			t.Fatalf("no apply time for %s: %v", cmd, counts)
		}
	}
}
