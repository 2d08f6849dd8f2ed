package e2e

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/devcluster"
)

// devRun is one `lumen dev` process and the lines it printed.
type devRun struct {
	cmd   *exec.Cmd
	lines chan string
	out   strings.Builder // every line, for failure messages
	done  chan error
}

func startDev(t *testing.T, args ...string) *devRun {
	t.Helper()
	d := &devRun{lines: make(chan string, 256), done: make(chan error, 1)}
	d.cmd = exec.Command(lumenBin, append([]string{"dev"}, args...)...)
	pr, pw := io.Pipe()
	d.cmd.Stdout, d.cmd.Stderr = pw, pw
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			d.lines <- sc.Text()
		}
		close(d.lines)
	}()
	go func() {
		err := d.cmd.Wait()
		pw.Close()
		d.done <- err
	}()
	t.Cleanup(func() {
		if d.cmd.ProcessState == nil {
			_ = d.cmd.Process.Kill()
		}
	})
	return d
}

// waitLine reads the run's output until a line contains want.
func (d *devRun) waitLine(t *testing.T, want string, timeout time.Duration) {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case l, ok := <-d.lines:
			if !ok {
				t.Fatalf("lumen dev exited before printing %q:\n%s", want, d.out.String())
			}
			d.out.WriteString(l + "\n")
			if strings.Contains(l, want) {
				return
			}
		case <-deadline:
			t.Fatalf("lumen dev printed no %q within %s:\n%s", want, timeout, d.out.String())
		}
	}
}

// interrupt sends SIGINT and requires the process to exit by itself (not
// killed by the signal) within timeout.
func (d *devRun) interrupt(t *testing.T, timeout time.Duration) {
	t.Helper()
	if err := d.cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	var err error
	select {
	case err = <-d.done:
	case <-time.After(timeout):
		t.Fatalf("lumen dev still runs %s after SIGINT:\n%s", timeout, d.out.String())
	}
	for l := range d.lines {
		d.out.WriteString(l + "\n")
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			t.Fatalf("lumen dev died of %v instead of stopping its cluster:\n%s", ws.Signal(), d.out.String())
		}
	}
}

// leftovers lists the processes whose command line names dir.
func leftovers(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Skip("no /proc")
	}
	var out []string
	for _, e := range ents {
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil || !strings.Contains(string(b), dir) {
			continue
		}
		out = append(out, e.Name()+": "+strings.ReplaceAll(string(b), "\x00", " "))
	}
	return out
}

// complete sends one non-streaming completion and requires text back.
func complete(t *testing.T, addr string) {
	t.Helper()
	resp, err := http.Post("http://"+addr+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"lumen-tiny","prompt":"Hello","max_tokens":8,"temperature":0}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Choices []struct {
			Text string `json:"text"`
		} `json:"choices"`
	}
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("completion at %s: HTTP %d: %s", addr, resp.StatusCode, b)
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil || len(body.Choices) == 0 || body.Choices[0].Text == "" {
		t.Fatalf("completion: %v %+v", err, body)
	}
}

// TestDevRestartsInSameDir runs `lumen dev`, stops it with Ctrl-C and runs
// it again in the same folder: the second run must elect a leader and
// serve, as the first did (issue 11, defect 7). A third run keeps the
// second's state (-keep-state) and must serve too.
func TestDevRestartsInSameDir(t *testing.T) {
	dir := t.TempDir()
	for run := 1; run <= 3; run++ {
		port, err := devcluster.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		args := []string{"-dir", dir, "-engine", "synthetic", "-workers", "1", "-http", addr}
		if run == 3 {
			args = append(args, "-keep-state")
		}
		d := startDev(t, args...)
		if run == 3 {
			d.waitLine(t, "(the kept state)", 30*time.Second)
		}
		d.waitLine(t, "Ctrl-C stops everything", 90*time.Second)
		complete(t, addr)
		d.interrupt(t, 60*time.Second)
		if l := leftovers(t, dir); len(l) > 0 {
			t.Fatalf("run %d: processes left after Ctrl-C:\n%s", run, strings.Join(l, "\n"))
		}
		t.Logf("run %d served and stopped", run)
	}
}

// TestDevTwoGateways: `lumen dev -gateways 2` starts two gateways, prints
// both addresses, and each serves completions (each with its own view of
// the load table and its own Place stream).
func TestDevTwoGateways(t *testing.T) {
	dir := t.TempDir()
	port, err := devcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	d := startDev(t, "-dir", dir, "-engine", "synthetic", "-workers", "2", "-gateways", "2", "-http", fmt.Sprintf("127.0.0.1:%d", port))
	d.waitLine(t, "Ctrl-C stops everything", 90*time.Second)
	var addrs []string
	for _, l := range strings.Split(d.out.String(), "\n") {
		if f := strings.Fields(l); len(f) >= 3 && f[0] == "gateway" && strings.HasPrefix(f[2], "http://") {
			addrs = append(addrs, strings.TrimSuffix(strings.TrimPrefix(f[2], "http://"), "/v1"))
		}
	}
	if len(addrs) != 2 || addrs[0] == addrs[1] || addrs[0] != fmt.Sprintf("127.0.0.1:%d", port) {
		t.Fatalf("want two gateway addresses, the first on -http; printed:\n%s", d.out.String())
	}
	for i := 0; i < 4; i++ {
		complete(t, addrs[i%2])
	}
	d.interrupt(t, 60*time.Second)
	if l := leftovers(t, dir); len(l) > 0 {
		t.Fatalf("processes left after Ctrl-C:\n%s", strings.Join(l, "\n"))
	}
	if _, err := os.Stat(filepath.Join(dir, "gateway-2.log")); err != nil {
		t.Fatalf("the second gateway's log: %v", err)
	}
}

// TestDevHTTPAddrInUse: an -http address another server holds (here one
// that answers every path 200, as a worker's /healthz and /readyz would)
// stops `lumen dev` with an error naming the address, instead of printing
// it as the gateway's and sending clients to the other server. CI saw the
// second: a port picked free by the caller, handed by the kernel to a
// worker's metrics server, and every completion a 404.
func TestDevHTTPAddrInUse(t *testing.T) {
	other := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go other.Serve(lis)
	defer other.Close()
	addr := lis.Addr().String()
	dir := t.TempDir()
	d := startDev(t, "-dir", dir, "-engine", "synthetic", "-workers", "1", "-http", addr)
	var runErr error
	select {
	case runErr = <-d.done:
	case <-time.After(2 * time.Minute):
		t.Fatal("lumen dev still runs on an -http address another server holds")
	}
	for l := range d.lines {
		d.out.WriteString(l + "\n")
	}
	out := d.out.String()
	if runErr == nil || strings.Contains(out, "Ctrl-C stops everything") {
		t.Fatalf("lumen dev started on an address another server holds (exit %v):\n%s", runErr, out)
	}
	if !strings.Contains(out, addr) || !strings.Contains(out, "in use") {
		t.Fatalf("the error does not name the address %s as in use:\n%s", addr, out)
	}
	if l := leftovers(t, dir); len(l) > 0 {
		t.Fatalf("processes left after the failed start:\n%s", strings.Join(l, "\n"))
	}
}

// TestDevInterruptDuringStart sends Ctrl-C while `lumen dev` waits for its
// quorum: it must stop what it started and exit promptly.
func TestDevInterruptDuringStart(t *testing.T) {
	dir := t.TempDir()
	port, err := devcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	d := startDev(t, "-dir", dir, "-engine", "synthetic", "-workers", "1", "-http", fmt.Sprintf("127.0.0.1:%d", port))
	d.waitLine(t, "starting 3 controllers", 30*time.Second)
	// Every controller spawned: the start now waits for their quorum.
	deadline := time.Now().Add(30 * time.Second)
	for {
		n := 0
		for i := 0; i < 3; i++ {
			if _, err := os.Stat(filepath.Join(dir, devcluster.ControllerID(i)+".log")); err == nil {
				n++
			}
		}
		if n == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the controllers were never spawned")
		}
		time.Sleep(5 * time.Millisecond)
	}
	t0 := time.Now()
	d.interrupt(t, 20*time.Second)
	t.Logf("exited %s after SIGINT:\n%s", time.Since(t0).Round(time.Millisecond), d.out.String())
	if l := leftovers(t, dir); len(l) > 0 {
		t.Fatalf("processes left after Ctrl-C:\n%s", strings.Join(l, "\n"))
	}
}

// TestDevKeepStateRefusesTakenPort: -keep-state brings the controllers
// back on their recorded ports; when one is taken it says so and exits,
// rather than move the controller (its Raft peers would not find it).
func TestDevKeepStateRefusesTakenPort(t *testing.T) {
	dir := t.TempDir()
	port, err := devcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"-dir", dir, "-engine", "synthetic", "-workers", "1", "-http", fmt.Sprintf("127.0.0.1:%d", port)}
	d := startDev(t, args...)
	d.waitLine(t, "Ctrl-C stops everything", 90*time.Second)
	d.interrupt(t, 60*time.Second)
	b, err := os.ReadFile(filepath.Join(dir, devcluster.DevStateFile))
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		Controllers []devcluster.ControllerAddrs `json:"controllers"`
	}
	if err := json.Unmarshal(b, &st); err != nil || len(st.Controllers) != 3 {
		t.Fatalf("%s: %v %s", devcluster.DevStateFile, err, b)
	}
	l, err := net.Listen("tcp", st.Controllers[1].GRPC)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	d = startDev(t, append(args, "-keep-state")...)
	select {
	case err = <-d.done:
	case <-time.After(60 * time.Second):
		t.Fatal("lumen dev -keep-state still runs with a recorded port taken")
	}
	for l := range d.lines {
		d.out.WriteString(l + "\n")
	}
	if err == nil || !strings.Contains(d.out.String(), "could not start on its recorded addresses") ||
		!strings.Contains(d.out.String(), st.Controllers[1].GRPC) {
		t.Fatalf("exit %v, output:\n%s", err, d.out.String())
	}
	if l := leftovers(t, dir); len(l) > 0 {
		t.Fatalf("processes left:\n%s", strings.Join(l, "\n"))
	}
}

// TestDevCells: `lumen dev -cells 2` starts two quorums, each with its
// share of the workers, and one gateway over both (issue 26); the gateway
// serves, and a second run in the same folder (-keep-state) brings both
// cells back.
func TestDevCells(t *testing.T) {
	dir := t.TempDir()
	for run := 1; run <= 2; run++ {
		port, err := devcluster.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		args := []string{"-dir", dir, "-engine", "synthetic", "-workers", "2", "-cells", "2", "-http", addr}
		if run == 2 {
			args = append(args, "-keep-state")
		}
		d := startDev(t, args...)
		d.waitLine(t, "Ctrl-C stops everything", 90*time.Second)
		for _, want := range []string{"2 cells of 3 controllers", "  cell-1 ", "  cell-2 ", "  worker-1 ", "  worker-2 "} {
			if !strings.Contains(d.out.String(), want) {
				t.Fatalf("run %d: %q not printed:\n%s", run, want, d.out.String())
			}
		}
		for range 4 {
			complete(t, addr)
		}
		d.interrupt(t, 60*time.Second)
		if l := leftovers(t, dir); len(l) > 0 {
			t.Fatalf("run %d: processes left after Ctrl-C:\n%s", run, strings.Join(l, "\n"))
		}
		for _, cell := range []string{"cell-1", "cell-2"} {
			if _, err := os.Stat(filepath.Join(dir, cell, devcluster.DevStateFile)); err != nil {
				t.Fatalf("run %d: %s's state: %v", run, cell, err)
			}
		}
	}
}

// TestDevCheckpointReplicas: `lumen dev -checkpoint-replicas 2` sets the
// strategy's replication factor at the start, so every controller's
// replicated state has R = 2 (read back from each controller's
// lumen_controller_checkpoint_replicas), and an R out of 1 … 4 is refused
// before anything starts.
func TestDevCheckpointReplicas(t *testing.T) {
	out, err := exec.Command(lumenBin, "dev", "-dir", t.TempDir(), "-checkpoint-replicas", "5").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "-checkpoint-replicas 5: must be between 1 and 4") {
		t.Fatalf("R = 5: %v\n%s", err, out)
	}
	dir := t.TempDir()
	port, err := devcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	d := startDev(t, "-dir", dir, "-engine", "synthetic", "-workers", "3", "-nodes", "3", "-checkpoint-replicas", "2",
		"-http", fmt.Sprintf("127.0.0.1:%d", port))
	d.waitLine(t, "Ctrl-C stops everything", 90*time.Second)
	if !strings.Contains(d.out.String(), "2 copies of each request's checkpoint, none on the serving worker's node") {
		t.Fatalf("no checkpoints line:\n%s", d.out.String())
	}
	// The dashboard line names every controller's HTTP address.
	var urls []string
	for _, l := range strings.Split(d.out.String(), "\n") {
		if f := strings.Fields(l); len(f) > 0 && f[0] == "dashboard" {
			for _, w := range f {
				if u, ok := strings.CutPrefix(strings.TrimSuffix(w, ","), "http://"); ok {
					urls = append(urls, "http://"+strings.TrimSuffix(strings.TrimSuffix(u, ")"), "/ui")+"/metrics")
				}
			}
		}
	}
	if len(urls) != 3 {
		t.Fatalf("want 3 controllers' addresses on the dashboard line, got %v:\n%s", urls, d.out.String())
	}
	for _, u := range urls {
		// A follower applies the entry after the leader answered.
		deadline := time.Now().Add(10 * time.Second)
		for {
			v, err := devcluster.ScrapeMetric(t.Context(), u, "lumen_controller_checkpoint_replicas")
			if err == nil && v == 2 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: lumen_controller_checkpoint_replicas = %v (%v), want 2", u, v, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	complete(t, fmt.Sprintf("127.0.0.1:%d", port))
	d.interrupt(t, 60*time.Second)
}
