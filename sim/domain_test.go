package sim

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/policy"
)

// domainConfig is 8 workers on 4 nodes of 2, at a load that keeps every
// worker busy.
func domainConfig(t *testing.T, seed uint64, replicas int, blind bool) Config {
	cfg := smallConfig(t, seed, policy.Lumen, 8, 30, 10*time.Second)
	cfg.GPUsPerNode, cfg.CheckpointReplicas, cfg.DomainBlind = 2, replicas, blind
	return cfg
}

// sameNodeCopies runs cfg to its end and counts, every 500 events, the
// running requests with a checkpoint copy on their serving worker's node,
// and those with fewer than want copies.
func sameNodeCopies(t *testing.T, cfg Config, want int) (same, short, seen int, res *Result) {
	t.Helper()
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for s.advance(func() bool { n++; return n%500 == 0 }) {
		for id := range s.byID {
			pl, _ := s.fsm.Placement(id)
			if pl == nil || pl.HolderId == "" {
				continue
			}
			seen++
			node := s.worker(pl.WorkerId).node
			copies := append([]string{pl.HolderId}, pl.ReplicaHolders...)
			if len(copies) < want {
				short++
			}
			for _, h := range copies {
				if s.worker(h).node == node {
					same++
				}
			}
		}
	}
	if s.err != nil {
		t.Fatal(s.err)
	}
	s.res.End = s.now
	s.finish()
	if err := s.Check(); err != nil {
		t.Fatal(err)
	}
	return same, short, seen, &s.res
}

// TestCheckpointsOffTheServingNode: domain-aware, no copy ever shares its
// serving worker's node, with one copy or two (each on a node of its own);
// domain-blind, h(r) puts some there (the check can see them), and the
// outputs are the failure-free reference's either way (the simulator checks
// every token).
func TestCheckpointsOffTheServingNode(t *testing.T) {
	const seed = 3
	t.Logf("seed %d", seed)
	for _, c := range []struct {
		replicas int
		blind    bool
	}{{1, false}, {2, false}, {1, true}} {
		same, short, seen, res := sameNodeCopies(t, domainConfig(t, seed, c.replicas, c.blind), c.replicas)
		t.Logf("replicas %d blind %v: %d of %d sampled placements with a copy on the serving node, %d short; %d bytes sent",
			c.replicas, c.blind, same, seen, short, res.CheckpointBytesSent)
		if seen == 0 || res.CheckpointBytesSent == 0 {
			t.Fatalf("replicas %d blind %v: no checkpoint sampled or sent", c.replicas, c.blind)
		}
		if !c.blind && (same != 0 || short != 0) {
			t.Errorf("replicas %d: %d copies on the serving node, %d placements short of copies", c.replicas, same, short)
		}
		if c.blind && same == 0 {
			t.Errorf("domain-blind: no copy on a serving node in %d samples: the check sees nothing", seen)
		}
	}
}

// TestNodeFailureKeepsCheckpoints: a whole node fails (both its workers at
// once, restarting); domain-aware, every interrupted request's plan finds
// a live copy, and most restore from it. With two copies, a node and one
// more worker failing together leave every request a live copy too; and
// every copy is freed at the end (Check). Domain-blind, the node takes some
// copies with it.
func TestNodeFailureKeepsCheckpoints(t *testing.T) {
	const seed = 3
	t.Logf("seed %d", seed)
	kill := func(idx ...int) []Failure {
		var out []Failure
		for _, i := range idx {
			out = append(out, Failure{Worker: i, At: 4 * time.Second, Restart: true})
		}
		return out
	}
	for _, c := range []struct {
		name     string
		replicas int
		blind    bool
		failures []Failure
	}{
		{"node, R=1", 1, false, kill(0, 1)},
		{"node and one more, R=2", 2, false, kill(0, 1, 5)},
		{"node, R=1, domain-blind", 1, true, kill(0, 1)},
	} {
		cfg := domainConfig(t, seed, c.replicas, c.blind)
		cfg.Failures = c.failures
		res, err := Run(cfg)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		t.Logf("%s: %d interrupted, %d with a live copy, %d restored", c.name, res.Interrupted, res.LiveCopy, res.Restored)
		if c.blind {
			// The copies h(r) put on the failed node's other worker are lost.
			if res.Interrupted == 0 || res.LiveCopy >= res.Interrupted {
				t.Errorf("%s: %d of %d interrupted requests found a live copy: none lost with the node", c.name, res.LiveCopy, res.Interrupted)
			}
			continue
		}
		if res.Interrupted == 0 || res.LiveCopy != res.Interrupted {
			t.Errorf("%s: %d of %d interrupted requests found a live copy", c.name, res.LiveCopy, res.Interrupted)
		}
		if res.Restored == 0 || res.Restored > res.LiveCopy {
			t.Errorf("%s: %d restored of %d with a live copy", c.name, res.Restored, res.LiveCopy)
		}
	}
}

// TestReplicasCostTraffic: two copies send each page twice.
func TestReplicasCostTraffic(t *testing.T) {
	var sent [2]uint64
	for r := 1; r <= 2; r++ {
		res, err := Run(domainConfig(t, 3, r, false))
		if err != nil {
			t.Fatal(err)
		}
		sent[r-1] = res.CheckpointBytesSent
	}
	if ratio := float64(sent[1]) / float64(sent[0]); ratio < 1.9 || ratio > 2.05 {
		t.Fatalf("R=2 sent %d bytes, R=1 %d: ratio %.3f, want about 2", sent[1], sent[0], ratio)
	}
}

// TestDomainFlagsRefused: a bad issue-24 flag is refused naming the flag
// and its limit, before anything runs.
func TestDomainFlagsRefused(t *testing.T) {
	for _, c := range []struct {
		set  func(*Command)
		want string
	}{
		{func(c *Command) { c.CheckpointReplicas = 0 }, "-checkpoint-replicas 0: must be in 1 … 4"},
		{func(c *Command) { c.CheckpointReplicas = 5 }, "-checkpoint-replicas 5: must be in 1 … 4"},
		{func(c *Command) { c.FailNodes = 1 }, "-fail-nodes 1: must be >= 0, and needs -gpus-per-node"},
		{func(c *Command) { c.GPUsPerNode = -1 }, "-gpus-per-node -1: must be >= 0"},
		{func(c *Command) { c.Domains = "partial" }, `-domains "partial": aware or blind`},
		{func(c *Command) { c.Domains = "blind" }, "-domains blind needs -gpus-per-node"},
		{func(c *Command) { c.Figure = "failures"; c.GPUsPerNode = 8; c.Given["gpus-per-node"] = true }, "apply to the studies, not to -figure failures"},
	} {
		cmd := DefaultCommand()
		c.set(&cmd)
		if err := cmd.Run(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("got %v, want an error containing %q", err, c.want)
		}
	}
	// Too many failures for the cluster: the study says so.
	st := Study{Setup: CustomSetup(16, "qwen3-14b-h100", 1, 32, 80e9), GPUsPerNode: 8, FailNodes: 2}
	if _, err := st.FailedWorkers(); err == nil || !strings.Contains(err.Error(), "leave none of the 16 to recover on") {
		t.Errorf("2 nodes of 8 and one more of 16: %v", err)
	}
}

// TestFailedWorkersPick: the workers of the failed nodes, then distinct
// others drawn from the seed, the same for a seed.
func TestFailedWorkersPick(t *testing.T) {
	st := Study{Setup: CustomSetup(64, "qwen3-14b-h100", 3, 32, 80e9), GPUsPerNode: 8, FailNodes: 1, Seed: 7}
	a, err := st.FailedWorkers()
	if err != nil {
		t.Fatal(err)
	}
	b, _ := st.FailedWorkers()
	if len(a) != 11 || !slices.Equal(a, b) {
		t.Fatalf("%v, then %v: want 11, the same", a, b)
	}
	for k, i := range a {
		if k < 8 && i != k || k >= 8 && (i < 8 || k > 8 && i <= a[k-1]) {
			t.Fatalf("%v: want 0…7 then three distinct others, sorted", a)
		}
	}
}
