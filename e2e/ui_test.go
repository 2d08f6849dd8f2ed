package e2e

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/lumen-project/lumen/internal/devcluster"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/ui"
)

// uiScreenshot, when set, is where TestDashboard writes the page as it
// ends (docs/ui.png is made so: go test ./e2e -run TestDashboard
// -ui-screenshot $PWD/docs/ui.png).
var uiScreenshot = flag.String("ui-screenshot", "", "write TestDashboard's final screenshot (PNG) to this file")

// chromiumPath finds the browser for the dashboard's test: LUMEN_CHROMIUM,
// or Debian's chromium (`make chromium` installs it; `make test` does
// first), or a Chrome on PATH.
func chromiumPath(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("LUMEN_CHROMIUM"); p != "" {
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Fatal("no Chromium for the dashboard's browser test: `make chromium` installs Debian's (apt-get install chromium), " +
		"or set LUMEN_CHROMIUM to a Chrome or Chromium binary; `go test -short` leaves the test out")
	return ""
}

// page is a headless Chromium tab.
type page struct {
	t   *testing.T
	ctx context.Context
}

func openPage(t *testing.T, url string) *page {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromiumPath(t)),
		chromedp.WindowSize(1600, 1000),
		// The tests run as root in CI, where Chromium's sandbox will not
		// start.
		chromedp.NoSandbox,
	)
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelTab := chromedp.NewContext(actx)
	t.Cleanup(func() { cancelTab(); cancelAlloc() })
	p := &page{t: t, ctx: ctx}
	start := time.Now()
	// The browser belongs to the context it starts on: start it on the
	// test's, not on one of the timeouts below.
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("chromium (%s): %v", chromiumPath(t), err)
	}
	navCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(navCtx, chromedp.Navigate(url)); err != nil {
		t.Fatalf("chromium: open %s: %v", url, err)
	}
	t.Logf("chromium opened %s in %s", url, time.Since(start).Round(time.Millisecond))
	p.wait("the first state", 15*time.Second, `document.body.dataset.ready === "true"`)
	return p
}

// wait polls the page until the JavaScript expression is true; after
// timeout it fails the test with what the page shows, and keeps a
// screenshot among the test's artifacts.
func (p *page) wait(what string, timeout time.Duration, expr string) {
	p.t.Helper()
	start := time.Now()
	ctx, cancel := context.WithTimeout(p.ctx, timeout+5*time.Second)
	defer cancel()
	_, err := chromedp.Run(ctx, chromedp.Poll[bool](expr, chromedp.WithPollingInterval(50*time.Millisecond), chromedp.WithPollingTimeout(timeout)))
	if err != nil {
		shot := filepath.Join(p.t.ArtifactDir(), "ui-failure.png")
		p.screenshot(shot)
		p.t.Fatalf("the page did not show %s within %s (%v): `%s`\nscreenshot %s\nthe page says:\n%s", what, timeout, err, expr, shot, p.text())
	}
	p.t.Logf("the page shows %s (%s)", what, time.Since(start).Round(time.Millisecond))
}

// text is the page's text, for failure messages.
func (p *page) text() string {
	ctx, cancel := context.WithTimeout(p.ctx, 5*time.Second)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.body.innerText`))
	if err != nil {
		return err.Error()
	}
	return tail(s, 4000)
}

// eval evaluates a JavaScript expression in the page.
func (p *page) eval(expr string) string {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(p.ctx, 5*time.Second)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Evaluate[string](expr))
	if err != nil {
		p.t.Fatalf("evaluate %s: %v", expr, err)
	}
	return s
}

func (p *page) screenshot(path string) {
	ctx, cancel := context.WithTimeout(p.ctx, 10*time.Second)
	defer cancel()
	b, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err == nil {
		err = os.WriteFile(path, b, 0o644)
	}
	if err != nil {
		p.t.Logf("screenshot %s: %v", path, err)
	}
}

// TestDashboard opens a follower's /ui in headless Chromium while clients
// stream through the gateway, kills the busiest worker (SIGKILL) and
// requires the page to show it FAILED, the recovery plan with each
// request's target and mode, and the restarted worker's progressive
// recovery back to FULL_SERVICE; then kills the leader and requires the
// page to follow the new one and show the old one unreachable.
func TestDashboard(t *testing.T) {
	if testing.Short() {
		t.Skip("a browser test; make test runs it")
	}
	chromiumPath(t) // fail before starting a cluster
	env := startProgressive(t, "synthetic", 3)
	leader := waitLeader(t, env.cl)
	oldLeader := env.cl.Controllers[leader].ID
	at := (leader + 1) % len(env.cl.Controllers)
	p := openPage(t, env.cl.DashboardURL(at))
	p.wait("the quorum, every replica reachable, and "+oldLeader+" leading", 15*time.Second, fmt.Sprintf(
		`document.querySelectorAll('#quorum tr[data-reachable="true"]').length === 3 && document.getElementById('leader').dataset.leader === %q`, oldLeader))
	p.wait("three workers in FULL_SERVICE", 10*time.Second,
		`document.querySelectorAll('#workers tr[data-phase="FULL_SERVICE"]').length === 3`)

	env.stream(t, "dashboard", 24, 640)
	v, inc := env.killBusiest(t)
	p.wait(v.ID+" FAILED in the timeline", 30*time.Second, fmt.Sprintf(
		`!!document.querySelector('#timeline li[data-kind="failure"][data-worker=%q][data-incarnation="%d"]')`, v.ID, inc))
	p.wait(v.ID+" FAILED in the worker table", 10*time.Second, fmt.Sprintf(
		`!!document.querySelector('#workers tr[data-worker=%q][data-phase="FAILED"]')`, v.ID))
	ev, _ := env.events.waitFor(t, 30*time.Second, "the recovery plan of "+v.ID, -1, func(ev *pb.Event) bool {
		rp := ev.GetRecoveryPlan()
		return rp != nil && rp.FailedWorker == v.ID && rp.FailedIncarnation == inc
	})
	plan := ev.GetRecoveryPlan()
	p.wait(fmt.Sprintf("plan %d in the timeline and among the requests", plan.Id), 10*time.Second, fmt.Sprintf(
		`!!document.querySelector('#timeline li[data-kind="plan"][data-plan="%d"]') && !!document.querySelector('#plans .plan-box[data-plan="%d"]')`, plan.Id, plan.Id))
	p.wait("requests in recovery", 10*time.Second, `Number(document.getElementById('recovering').textContent) > 0`)
	entry := p.eval(fmt.Sprintf(`document.querySelector('#timeline li[data-kind="plan"][data-plan="%d"]').innerText`, plan.Id))
	table := p.eval(fmt.Sprintf(`document.querySelector('#plans .plan-box[data-plan="%d"]').innerText`, plan.Id))
	for i, a := range plan.Assignments {
		mode := strings.TrimPrefix(a.Mode.String(), "RECOVERY_MODE_")
		if want := fmt.Sprintf("%s → %s %s", a.RequestId, a.TargetWorker, mode); i < 12 && !strings.Contains(entry, want) {
			t.Errorf("the timeline's plan %d has no %q:\n%s", plan.Id, want, entry)
		}
		if i < 10 && !strings.Contains(table, a.RequestId) {
			t.Errorf("the plan table has no %s:\n%s", a.RequestId, table)
		}
	}
	t.Logf("plan %d on the page:\n%s", plan.Id, entry)

	env.restart(t, v)
	for _, ph := range []string{"LOADING_DRAFT", "ASSIST", "HOTSWAP", "FULL_SERVICE"} {
		p.wait(v.ID+" in "+ph+" in the timeline", 30*time.Second, fmt.Sprintf(
			`!!document.querySelector('#timeline li[data-worker=%q][data-to=%q]:not([data-incarnation="%d"])')`, v.ID, ph, inc))
	}
	p.wait(v.ID+" back in service in the worker table", 10*time.Second, fmt.Sprintf(
		`!!document.querySelector('#workers tr[data-worker=%q][data-phase="FULL_SERVICE"]:not([data-incarnation="%d"])')`, v.ID, inc))

	t.Logf("kill -9 the leader %s", oldLeader)
	env.cl.Kill(leader)
	t.Cleanup(func() { _ = env.cl.Restart(leader) })
	p.wait("a new leader", 30*time.Second, fmt.Sprintf(
		`(l => l !== "" && l !== %q)(document.getElementById('leader').dataset.leader)`, oldLeader))
	newLeader := p.eval(`document.getElementById('leader').dataset.leader`)
	p.wait(newLeader+"'s election in the timeline and "+oldLeader+" unreachable", 15*time.Second, fmt.Sprintf(
		`!!document.querySelector('#timeline li[data-kind="leader"][data-leader=%q]') && !!document.querySelector('#quorum tr[data-replica=%q][data-reachable="false"]') && !!document.querySelector('#quorum tr[data-replica=%q][data-state="Leader"]')`,
		newLeader, oldLeader, newLeader))
	if msg := p.eval(`document.body.dataset.error || ""`); msg != "" {
		t.Errorf("the page's script failed: %s", msg)
	}
	if *uiScreenshot != "" {
		p.screenshot(*uiScreenshot)
		t.Logf("screenshot in %s", *uiScreenshot)
	}
}

// TestDevPrintsTheDashboard: `lumen dev` prints a dashboard address that
// serves the cluster it started.
func TestDevPrintsTheDashboard(t *testing.T) {
	port, err := devcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	d := startDev(t, "-dir", t.TempDir(), "-engine", "synthetic", "-workers", "1", "-http", fmt.Sprintf("127.0.0.1:%d", port))
	d.waitLine(t, "dashboard    http://", 90*time.Second)
	url := regexp.MustCompile(`dashboard +(http://127\.0\.0\.1:\d+/ui)\s`).FindStringSubmatch(d.out.String())
	if url == nil {
		t.Fatalf("no dashboard address in:\n%s", d.out.String())
	}
	resp, err := http.Get(url[1] + "/api/state")
	if err != nil {
		t.Fatal(err)
	}
	var st ui.State
	err = json.NewDecoder(resp.Body).Decode(&st)
	resp.Body.Close()
	if err != nil || len(st.Workers) != 1 || st.Node != devcluster.ControllerID(0) {
		t.Fatalf("%s/api/state: %v, node %q with %d workers; want ctl1's, with the dev cluster's worker", url[1], err, st.Node, len(st.Workers))
	}
	d.waitLine(t, "Ctrl-C stops everything", 30*time.Second)
	d.interrupt(t, 60*time.Second)
}
