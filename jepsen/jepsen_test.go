package jepsen

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// lumenBin is the binary under test, built once by TestMain.
var lumenBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "lumen-jepsen-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	lumenBin = filepath.Join(dir, "lumen")
	build := exec.Command("go", "build", "-o", lumenBin, "../cmd/lumen")
	build.Stdout, build.Stderr = os.Stdout, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building lumen:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// TestShortMixedRun is the minute of faults `make test` runs: one seeded
// mixed nemesis over 3 controllers, 3 transformer workers and two
// gateways, every checker on the histories. Killed workers recover
// progressively (assist-kill strikes during a recovery); kill-uncommitted
// kills a worker running requests whose placements cannot commit yet
// (issue 16). (`make jepsen` runs the full
// matrix.) A killed gateway's session lives 3 s here, so the end-of-run
// leak check need not wait the default 10 s for it to expire.
func TestShortMixedRun(t *testing.T) {
	if testing.Short() {
		t.Skip("a minute of fault injection; run without -short")
	}
	seed := time.Now().UnixNano() % 1_000_000
	// Partitions are made with network namespaces where they can be (CI
	// runs as root), else with per-link TCP proxies.
	nemeses := []string{"kill-leader", "kill-worker", "pause-worker", "kill-holder", "partition-halves", "gateway-kill", "assist-kill", "migrate", "kill-uncommitted"}
	dir, err := os.MkdirTemp("", "lumen-jepsen-")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("seed %d, results in %s", seed, dir)
	rep, err := Run(context.Background(), Config{Name: "short-mixed", Bin: lumenBin, Dir: dir, Seed: seed,
		Controllers: 3, Workers: 3, Duration: 45 * time.Second, Nemeses: nemeses, Interval: 4 * time.Second,
		PlacementClients: 4, ServingClients: 2, SessionTTL: 3 * time.Second, ShortStreams: true, Log: testLog{t}})
	if err != nil {
		t.Fatalf("seed %d: %v (logs in %s)", seed, err, dir)
	}
	faults := 0
	for _, n := range rep.Faults {
		faults += n
	}
	t.Logf("\n%s", Summary([]*Report{rep}))
	if !rep.OK() {
		t.Fatalf("seed %d: violations found; histories and logs in %s", seed, dir)
	}
	if faults == 0 || rep.Ops == 0 || rep.Streams == 0 {
		t.Fatalf("seed %d: %d faults, %d operations, %d streams: the run exercised nothing", seed, faults, rep.Ops, rep.Streams)
	}
	os.RemoveAll(dir)
}

type testLog struct{ t *testing.T }

func (l testLog) Write(p []byte) (int, error) {
	l.t.Log(string(p[:len(p)-1]))
	return len(p), nil
}
