package devcluster

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"

	"github.com/lumen-project/lumen/policy"
)

func touch(t *testing.T, path string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// A fresh start removes what a dev cluster wrote and nothing else.
func TestCleanDevDirRemovesOnlyItsOwn(t *testing.T) {
	dir := t.TempDir()
	for _, p := range []string{"ctl1/raft/raft.db", "ctl1.log", "ctl3/x", "worker-2/ckpt/p", "worker-2.log",
		"gateway.log", "gateway-2.log", DevStateFile, "notes.txt", "ctlx/keep", "worker-a.log", "mine/ctl1.log"} {
		touch(t, filepath.Join(dir, p))
	}
	if err := cleanDevDir(dir); err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(dir)
	var left []string
	for _, e := range ents {
		left = append(left, e.Name())
	}
	sort.Strings(left)
	if want := []string{"ctlx", "mine", "notes.txt", "worker-a.log"}; !reflect.DeepEqual(left, want) {
		t.Fatalf("left %v, want %v", left, want)
	}
	if err := cleanDevDir(filepath.Join(dir, "absent")); err != nil {
		t.Fatalf("a directory not there yet: %v", err)
	}
}

// A folder no dev cluster ran in keeps its worker-1/ and ctl1.log: a fresh
// start refuses rather than guess from names.
func TestCleanDevDirRefusesAForeignFolder(t *testing.T) {
	dir := t.TempDir()
	for _, p := range []string{"worker-1/mine.txt", "ctl1.log", "notes.txt"} {
		touch(t, filepath.Join(dir, p))
	}
	err := cleanDevDir(dir)
	if !errors.Is(err, ErrNotDevDir) {
		t.Fatalf("cleanDevDir = %v, want ErrNotDevDir", err)
	}
	for _, p := range []string{"worker-1/mine.txt", "ctl1.log", "notes.txt"} {
		if _, err := os.Stat(filepath.Join(dir, p)); err != nil {
			t.Fatalf("%s was removed: %v", p, err)
		}
	}
	// A controller's raft.db marks a dev cluster's folder (an older lumen
	// wrote no state file).
	touch(t, filepath.Join(dir, "ctl1", "raft.db"))
	if err := cleanDevDir(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "worker-1")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("worker-1 survived the clean of a dev cluster's folder: %v", err)
	}
}

func TestDevStateRoundTrip(t *testing.T) {
	dir := t.TempDir()
	// Nothing there: a kept start is a fresh one.
	if addrs, err := loadDevState(dir); err != nil || addrs != nil {
		t.Fatalf("empty dir: %v %v", addrs, err)
	}
	st := devState{Controllers: []ControllerAddrs{
		{Raft: "127.0.0.1:1", GRPC: "127.0.0.1:2", Serf: "127.0.0.1:3", HTTP: "127.0.0.1:4"},
		{Raft: "127.0.0.1:5", GRPC: "127.0.0.1:6", Serf: "127.0.0.1:7", HTTP: "127.0.0.1:8"},
		{Raft: "127.0.0.1:9", GRPC: "127.0.0.1:10", Serf: "127.0.0.1:11", HTTP: "127.0.0.1:12"},
	}}
	if err := saveDevState(dir, st); err != nil {
		t.Fatal(err)
	}
	got, err := loadDevState(dir)
	if err != nil || !reflect.DeepEqual(got, st.Controllers) {
		t.Fatalf("got %v %v, want %v", got, err, st.Controllers)
	}
	// Prepare puts them where Launch starts the controllers.
	c, err := Prepare(Options{Bin: "/bin/true", Dir: dir, Addrs: got})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c.ControllerAddrs(), st.Controllers) {
		t.Fatalf("prepared %v", c.ControllerAddrs())
	}
}

// Kept state without its addresses is refused, with what to do.
func TestKeepStateRefusesUnrecordedState(t *testing.T) {
	dir := t.TempDir()
	touch(t, filepath.Join(dir, "ctl1", "raft", "raft.db"))
	if _, err := loadDevState(dir); !errors.Is(err, ErrNoDevState) {
		t.Fatalf("got %v, want ErrNoDevState", err)
	}
	touch(t, filepath.Join(dir, DevStateFile)) // "x": not JSON
	if _, err := loadDevState(dir); !errors.Is(err, ErrNoDevState) {
		t.Fatalf("garbage state file: got %v, want ErrNoDevState", err)
	}
}

// TestDevNode: workers fill the nodes in order, ⌈workers/nodes⌉ each.
func TestDevNode(t *testing.T) {
	var got []string
	for i := 1; i <= 5; i++ {
		got = append(got, DevNode(i, 5, 2))
	}
	if want := "node-1 node-1 node-1 node-2 node-2"; strings.Join(got, " ") != want {
		t.Fatalf("5 workers on 2 nodes: %v, want %s", got, want)
	}
	if DevNode(1, 4, 0) != "" {
		t.Fatal("no nodes: a label")
	}
}

// TestCheckReplicas: -checkpoint-replicas takes 1 … policy.MaxCheckpointReplicas,
// and the error names the value and the limit.
func TestCheckReplicas(t *testing.T) {
	for r := 1; r <= policy.MaxCheckpointReplicas; r++ {
		if err := CheckReplicas(r); err != nil {
			t.Fatalf("R = %d refused: %v", r, err)
		}
	}
	for _, r := range []int{0, -1, policy.MaxCheckpointReplicas + 1} {
		err := CheckReplicas(r)
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("-checkpoint-replicas %d:", r)) ||
			!strings.Contains(err.Error(), fmt.Sprintf("between 1 and %d", policy.MaxCheckpointReplicas)) {
			t.Fatalf("R = %d: %v", r, err)
		}
	}
	if err := RunDev(context.Background(), DevConfig{Dir: t.TempDir(), Workers: 2, CheckpointReplicas: 9}); err == nil ||
		!strings.Contains(err.Error(), "-checkpoint-replicas 9") {
		t.Fatalf("RunDev with R = 9 started: %v", err)
	}
}

// TestReplicasLine: what `lumen dev` prints of the copies a request gets,
// with fewer other domains than R.
func TestReplicasLine(t *testing.T) {
	for _, c := range []struct {
		r, workers, nodes int
		want, not         string
	}{
		{1, 2, 0, "1 copy of each request's checkpoint", ";"},
		{2, 6, 3, "2 copies of each request's checkpoint, none on the serving worker's node", ";"},
		{3, 6, 3, "with 3 nodes, at most 2 (placements short of 3 counted in lumen_controller_checkpoint_replicas_short_total)", ""},
		{2, 2, 0, "with 2 workers, at most 1", ""},
		{2, 4, 1, "with 1 node, one copy, on another worker of that node", ""},
		{1, 1, 0, "with 1 worker, none", ""},
	} {
		got := ReplicasLine(c.r, c.workers, c.nodes)
		if !strings.Contains(got, c.want) || c.not != "" && strings.Contains(got, c.not) {
			t.Errorf("R %d, %d workers, %d nodes: %q, want %q", c.r, c.workers, c.nodes, got, c.want)
		}
	}
}

// TestDevPrefixRoutingArgs: the prefix cache starts the workers with
// -prefix-cache on (alone: the gateways route by freeness), routing the
// gateways with -prefix-routing on; off adds neither.
func TestDevPrefixRoutingArgs(t *testing.T) {
	cfg := DevConfig{Workers: 2, Engine: "synthetic", Profile: "none", TimeScale: "1", ModelDir: "m"}
	if a, g := strings.Join(cfg.workerArgs(1), " "), cfg.gatewayArgs(); strings.Contains(a, "prefix") || g != nil {
		t.Fatalf("off: worker flags %q, gateway flags %q", a, g)
	}
	cfg.PrefixCache = true
	if a, g := strings.Join(cfg.workerArgs(2), " "), cfg.gatewayArgs(); !strings.HasSuffix(a, "-prefix-cache on") || g != nil {
		t.Fatalf("cache on, routing off: worker flags %q, gateway flags %q", a, g)
	}
	cfg.PrefixRouting = true
	if a := strings.Join(cfg.workerArgs(2), " "); !strings.HasSuffix(a, "-prefix-cache on") {
		t.Fatalf("on: worker flags %q, want -prefix-cache on", a)
	}
	if g := strings.Join(cfg.gatewayArgs(), " "); g != "-prefix-routing on" {
		t.Fatalf("on: gateway flags %q, want -prefix-routing on", g)
	}
	cfg.KVPages = 400
	if a := strings.Join(cfg.workerArgs(1), " "); !strings.HasSuffix(a, "-prefix-cache on -kv-pages 400") {
		t.Fatalf("-kv-pages 400: worker flags %q", a)
	}
}
