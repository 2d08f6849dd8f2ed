package sim

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/lumen-project/lumen/fsm"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// cellsConfig is 16 workers in 4 cells behind 2 gateways (partition-fill),
// lumen, at 60 requests/s (about 60% of what 16 workers saturate at) for d.
func cellsConfig(t *testing.T, seed uint64, d time.Duration) Config {
	t.Helper()
	cfg := smallConfig(t, seed, policy.Lumen, 16, 60, d)
	cfg.Cells, cfg.Gateways, cfg.GatewayChoice = 4, 2, ChoosePartitionFill
	return cfg
}

// checkInCells checks, for every request with a live call, that its call's
// worker is in its cell, that its cell's fsm holds its placement there,
// with every checkpoint holder in that cell, and that no other cell's fsm
// knows it.
func checkInCells(s *Sim) error {
	for _, r := range s.reqs {
		if r == nil || r.ended > 0 || r.call == nil {
			continue
		}
		if w := s.worker(r.worker); w == nil || w.cell != r.cell {
			return fmt.Errorf("request %s runs on %s, not in its cell %d", r.id, r.worker, r.cell.idx+1)
		}
		for _, c := range s.cells {
			pl, _ := c.fsm.Placement(r.id)
			if c != r.cell {
				if pl != nil {
					return fmt.Errorf("request %s of cell %d is placed in cell %d too", r.id, r.cell.idx+1, c.idx+1)
				}
				continue
			}
			if pl == nil {
				continue // its Dispatch is not applied yet (a gateway's placement commits in parallel)
			}
			for _, id := range append([]string{pl.WorkerId, pl.HolderId}, pl.ReplicaHolders...) {
				if w := s.worker(id); id != "" && (w == nil || w.cell != c) {
					return fmt.Errorf("request %s of cell %d: placement %s/%s, holder %q outside the cell", r.id, c.idx+1, pl.WorkerId, pl.HolderId, id)
				}
			}
		}
	}
	return nil
}

// TestCellsPlaceWithinCells: 16 workers as 4 cells, failure-free. Every
// 200th event, every running request's worker, placement and checkpoint
// holders are in its one cell and no other cell's fsm knows it (the
// simulator also fails a run that ships a checkpoint page across cells);
// the gateways spread the placements over every cell (each at least 15%
// of them, a quarter being even); each cell's Raft log carries its own
// workers' reports and its own placements, and the cells' counts add up
// to the whole stream's.
func TestCellsPlaceWithinCells(t *testing.T) {
	seed := uint64(7)
	t.Logf("seed %d", seed)
	cfg := cellsConfig(t, seed, 12*time.Second)
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	checks := 0
	for s.advance(func() bool { return s.steps%200 == 0 }) {
		if err := checkInCells(s); err != nil {
			t.Fatalf("at %s: %v", s.now, err)
		}
		checks++
	}
	s.Run()
	if s.err != nil {
		t.Fatal(s.err)
	}
	if err := s.Check(); err != nil {
		t.Fatal(err)
	}
	res := &s.res
	if res.Ended != res.Requests || res.Failed != 0 {
		t.Fatalf("%d of %d ended, %d failed", res.Ended, res.Requests, res.Failed)
	}
	if len(res.Cells) != 4 {
		t.Fatalf("%d cells in the result, want 4", len(res.Cells))
	}
	t.Logf("%d requests, %d checks; placed by cell: %d %d %d %d", res.Requests, checks, res.Cells[0].Placed, res.Cells[1].Placed, res.Cells[2].Placed, res.Cells[3].Placed)
	sum := map[string]RaftCount{}
	placed := 0
	for i, c := range res.Cells {
		placed += c.Placed
		if c.Workers != 4 || c.Placed < res.Requests*15/100 {
			t.Errorf("cell %d: %d workers, %d of %d requests placed", i+1, c.Workers, c.Placed, res.Requests)
		}
		if c.Raft["report_load"].Commands == 0 || c.Raft["dispatch"].Commands == 0 {
			t.Errorf("cell %d's log: %+v", i+1, c.Raft)
		}
		for typ, rc := range c.Raft {
			x := sum[typ]
			x.Commands += rc.Commands
			x.Bytes += rc.Bytes
			sum[typ] = x
		}
	}
	if placed < res.Requests {
		t.Errorf("%d placements over the cells for %d requests", placed, res.Requests)
	}
	for typ, rc := range res.Raft {
		if typ != fsm.CommandType(&pb.Command{Body: &pb.Command_SetStrategy{}}) && sum[typ] != rc {
			t.Errorf("%s: the cells' logs count %+v, the stream %+v", typ, sum[typ], rc)
		}
	}
}

// TestCellsRecoverInsideCell: 16 workers as 4 cells; worker-6 (cell 2) is
// killed at 4 s and restarts. Every request it was serving resumes on a
// worker of cell 2 (checked after every event, from the plan on),
// restoring checkpoint pages its holders in cell 2 kept; only cell 2's
// fsm made a recovery plan; nothing fails, every token equals the
// failure-free reference's (onToken), conservation holds, and the run is
// deterministic.
func TestCellsRecoverInsideCell(t *testing.T) {
	seed := uint64(7)
	t.Logf("seed %d", seed)
	run := func() (*Result, *Sim) {
		cfg := cellsConfig(t, seed, 12*time.Second)
		cfg.Failures = []Failure{{Worker: 5, At: 4 * time.Second, Restart: true}}
		s, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		failed := s.workers[5]
		if failed.cell != s.cells[1] {
			t.Fatalf("worker-6 is in cell %d, want 2", failed.cell.idx+1)
		}
		resumed := map[string]string{}
		var planned map[string]bool
		for s.advance(func() bool { return s.now >= 4*time.Second }) {
			if planned == nil && len(failed.cell.fsm.Recoveries()) > 0 {
				planned = map[string]bool{}
				for _, rp := range failed.cell.fsm.Recoveries() {
					for _, a := range rp.Assignments {
						planned[a.RequestId] = true
					}
				}
			}
			for _, r := range s.reqs {
				// The requests the plan moved, under the ids it moved
				// (one that had streamed nothing may be dispatched
				// afresh, anywhere, under a new id: it has nothing to
				// recover).
				if r == nil || !planned[r.id] || r.call == nil || r.worker == failed.id {
					continue
				}
				if w := s.worker(r.worker); w.cell != failed.cell {
					t.Fatalf("at %s: interrupted request %s resumed on %s, in cell %d", s.now, r.id, r.worker, w.cell.idx+1)
				}
				resumed[r.id] = r.worker
			}
			if s.now > 4*time.Second && s.steps%200 == 0 {
				if err := checkInCells(s); err != nil {
					t.Fatalf("at %s: %v", s.now, err)
				}
			}
		}
		s.Run()
		if s.err != nil {
			t.Fatal(s.err)
		}
		if err := s.Check(); err != nil {
			t.Fatal(err)
		}
		for i, c := range s.cells {
			if n := len(c.fsm.Recoveries()); (i == 1) != (n > 0) {
				t.Errorf("cell %d's fsm made %d recovery plans", i+1, n)
			}
		}
		if len(resumed) == 0 {
			t.Fatal("no interrupted request resumed: the test tests nothing")
		}
		t.Logf("%d interrupted, %d resumed in cell 2 (%v)", s.res.Interrupted, len(resumed), resumed)
		return &s.res, s
	}
	res, _ := run()
	if res.Failed != 0 || res.Ended != res.Requests {
		t.Fatalf("%d of %d ended, %d failed", res.Ended, res.Requests, res.Failed)
	}
	if res.Restored == 0 || res.RestoredPages == 0 {
		t.Errorf("no interrupted request restored a checkpoint (%d requests, %d pages)", res.Restored, res.RestoredPages)
	}
	a, _ := json.Marshal(res.Records)
	res2, _ := run()
	b, _ := json.Marshal(res2.Records)
	if string(a) != string(b) {
		t.Fatal("two runs of the same config differ")
	}
}

// TestCellsConfig: the cells' limits are refused with what was wrong.
func TestCellsConfig(t *testing.T) {
	for name, mod := range map[string]func(*Config){
		"uneven":      func(c *Config) { c.Cells = 3 },
		"no gateways": func(c *Config) { c.Gateways = 0 },
		"node spans":  func(c *Config) { c.GPUsPerNode = 8 },
		"migration":   func(c *Config) { c.Migration = true },
		"negative":    func(c *Config) { c.Cells = -1 },
		"round-robin": func(c *Config) { c.RoundRobin = true },
	} {
		cfg := cellsConfig(t, 1, time.Second)
		mod(&cfg)
		if _, err := New(cfg); err == nil {
			t.Errorf("%s: accepted", name)
		} else {
			t.Logf("%s: %v", name, err)
		}
	}
	cfg := cellsConfig(t, 1, time.Second)
	cfg.GPUsPerNode = 2
	if _, err := New(cfg); err != nil {
		t.Errorf("4 cells of 4 workers on nodes of 2: %v", err)
	}
}
