package deploy

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/lumen-project/lumen/internal/completions"
	"github.com/lumen-project/lumen/internal/devcluster"
)

// live is a running cluster of real processes, shared by the tests that
// ask processes what they serve and export: one controller, two workers on
// the synthetic engine paced like Qwen3-14B on an H100, a gateway. Started
// by the first test that needs it, stopped by TestMain.
var live struct {
	once sync.Once
	dir  string
	cl   *devcluster.Cluster
	err  error
	// migrations: the cluster was taken through a drain (the binary has
	// `worker drain`).
	migrations bool
	// seen: what the processes exported at the end of each step (a
	// drained worker is gone by the end).
	seen exported
}

func stopLive() {
	if live.cl != nil {
		live.cl.Stop()
	}
	if live.dir != "" {
		os.RemoveAll(live.dir)
	}
}

// workerArgs: paced, so a stream is still running when its worker dies; no
// emulated model load, so a restart recovers within a second.
var workerArgs = []string{"-engine", "synthetic", "-profile", "qwen3-14b-h100", "-time-scale", "1", "-emulate-load=false", "-kv-pages", "1024"}

// liveCluster starts the cluster and takes it through what makes every
// metric family appear — labelled families are exported only once a label
// value is used: a stream whose worker is killed (the gateway resumes it
// elsewhere from the checkpoint: lumen_gateway_resumes_total, the
// controller's mark_failed), the killed worker's restart (progressive
// recovery: lumen_worker_recovery_phase_seconds) and, where the binary has
// live migration, a drain (lumen_controller_migrations_total).
func liveCluster(t *testing.T) *devcluster.Cluster {
	t.Helper()
	live.once.Do(func() { live.err = startLive(t.Logf, commands(t)["worker drain"]) })
	if live.err != nil {
		t.Fatalf("the live cluster: %v (logs in %s)", live.err, live.dir)
	}
	return live.cl
}

func startLive(logf func(string, ...any), drain bool) error {
	var err error
	if live.dir, err = os.MkdirTemp("", "lumen-deploy-live-"); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cl, err := devcluster.Start(ctx, devcluster.Options{Bin: lumenBin, Dir: live.dir, Controllers: 1, Args: []string{"-log-level", "warn"}})
	if err != nil {
		return err
	}
	live.cl = cl
	for _, id := range []string{"w1", "w2"} {
		if _, err := cl.AddWorkerContext(ctx, id, workerArgs...); err != nil {
			return err
		}
	}
	gw, err := cl.StartGatewayContext(ctx, "")
	if err != nil {
		return err
	}
	if err := gw.WaitReady(ctx); err != nil {
		return err
	}

	// A stream, and its worker killed under it.
	victim, res, err := streamAndDo(ctx, cl, func(w *devcluster.Worker) error {
		logf("kill -9 %s mid-stream", w.ID)
		cl.KillWorker(w)
		return nil
	})
	if err != nil {
		return err
	}
	if !res.Done {
		return fmt.Errorf("the stream whose worker was killed did not complete")
	}
	// Its restart: the data directory's run marker says it failed, so it
	// recovers progressively.
	if err := cl.StartWorker(victim); err != nil {
		return err
	}
	if err := waitFor(ctx, func() bool {
		fams, err := scrape(ctx, "http://"+victim.HTTPAddr+"/metrics")
		return err == nil && gaugeWith(fams, "lumen_worker_phase", "phase", "FULL_SERVICE") == 1 &&
			fams["lumen_worker_recovery_phase_seconds"] != nil
	}); err != nil {
		return fmt.Errorf("%s back in FULL_SERVICE after a progressive recovery: %w", victim.ID, err)
	}
	live.seen = exported{}
	if err := live.seen.scrapeAll(ctx, cl); err != nil {
		return err
	}
	if drain {
		live.migrations = true
		ctlHTTP := "http://" + cl.Controllers[0].HTTPAddr + "/metrics"
		_, _, err := streamAndDo(ctx, cl, func(w *devcluster.Worker) error {
			logf("lumen worker drain %s mid-stream", w.ID)
			out, err := exec.CommandContext(ctx, lumenBin, "worker", "drain", w.ID, "-addr", strings.Join(cl.GRPCAddrs(), ",")).CombinedOutput()
			if err != nil {
				return fmt.Errorf("lumen worker drain %s: %v: %s", w.ID, err, out)
			}
			return waitFor(ctx, func() bool {
				fams, err := scrape(ctx, ctlHTTP)
				return err == nil && fams["lumen_controller_migrations_total"] != nil
			})
		})
		if err != nil {
			return err
		}
		if err := live.seen.scrapeAll(ctx, cl); err != nil {
			return err
		}
	}
	return nil
}

// scrapeAll adds what every running process exports.
func (e exported) scrapeAll(ctx context.Context, cl *devcluster.Cluster) error {
	httpAddrs, _ := endpoints(cl)
	for _, sub := range []string{"controller", "worker", "gateway"} {
		for _, addr := range httpAddrs[sub] {
			fams, err := scrape(ctx, "http://"+addr+"/metrics")
			if err != nil {
				return fmt.Errorf("lumen %s: %w", sub, err)
			}
			e.add(fams)
		}
	}
	return nil
}

// streamAndDo streams a long completion through the gateway, runs do on the
// worker serving it once tokens flow, and waits for the stream's end.
func streamAndDo(ctx context.Context, cl *devcluster.Cluster, do func(*devcluster.Worker) error) (*devcluster.Worker, completions.Result, error) {
	flowing := make(chan struct{})
	var once sync.Once
	type result struct {
		res completions.Result
		err error
	}
	done := make(chan result, 1)
	go func() {
		chunks := 0
		res, err := completions.Stream(ctx, http.DefaultClient, cl.Gateway.Addr, completions.Body("a stream to break", 400, false),
			func(completions.Chunk) {
				if chunks++; chunks == 5 {
					once.Do(func() { close(flowing) })
				}
			})
		done <- result{res, err}
	}()
	select {
	case <-flowing:
	case r := <-done:
		return nil, r.res, fmt.Errorf("the stream ended before its fifth chunk: %v", r.err)
	case <-ctx.Done():
		return nil, completions.Result{}, ctx.Err()
	}
	var serving *devcluster.Worker
	for _, w := range cl.Workers {
		if !w.Running() {
			continue
		}
		fams, err := scrape(ctx, "http://"+w.HTTPAddr+"/metrics")
		if err == nil && gaugeWith(fams, "lumen_worker_num_requests_running", "", "") > 0 {
			serving = w
		}
	}
	if serving == nil {
		return nil, completions.Result{}, fmt.Errorf("no worker reports the stream running")
	}
	if err := do(serving); err != nil {
		return serving, completions.Result{}, err
	}
	r := <-done
	if r.err != nil {
		return serving, r.res, fmt.Errorf("the stream: %w", r.err)
	}
	return serving, r.res, nil
}

// waitFor polls cond until it holds or ctx ends.
func waitFor(ctx context.Context, cond func() bool) error {
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return nil
}

var scrapeClient = &http.Client{Timeout: 5 * time.Second}

// scrape reads a Prometheus text endpoint into its metric families.
func scrape(ctx context.Context, url string) (map[string]*dto.MetricFamily, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := scrapeClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: HTTP %d", url, resp.StatusCode)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	return p.TextToMetricFamilies(resp.Body)
}

// gaugeWith is the value of the family's gauge (or untyped or counter)
// sample whose label has value; label "" takes the first sample. -1 when
// there is none.
func gaugeWith(fams map[string]*dto.MetricFamily, name, label, value string) float64 {
	f := fams[name]
	if f == nil {
		return -1
	}
	for _, m := range f.Metric {
		match := label == ""
		for _, lp := range m.Label {
			match = match || (lp.GetName() == label && lp.GetValue() == value)
		}
		if !match {
			continue
		}
		switch {
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Untyped != nil:
			return m.Untyped.GetValue()
		}
	}
	return -1
}

// endpoints are the running processes' HTTP and gRPC addresses by command.
func endpoints(cl *devcluster.Cluster) (httpAddrs, grpcAddrs map[string][]string) {
	httpAddrs, grpcAddrs = map[string][]string{}, map[string][]string{}
	for _, c := range cl.Controllers {
		httpAddrs["controller"] = append(httpAddrs["controller"], c.HTTPAddr)
		grpcAddrs["controller"] = append(grpcAddrs["controller"], c.GRPCAddr)
	}
	for _, w := range cl.Workers {
		if w.Running() {
			httpAddrs["worker"] = append(httpAddrs["worker"], w.HTTPAddr)
			grpcAddrs["worker"] = append(grpcAddrs["worker"], w.GRPCAddr)
		}
	}
	for _, g := range cl.Gateways {
		if g.Running() {
			httpAddrs["gateway"] = append(httpAddrs["gateway"], g.Addr)
		}
	}
	return httpAddrs, grpcAddrs
}

// TestProbesServed asks running processes what the manifests' probes ask:
// each HTTP path answers 200 on the command's HTTP address in a healthy
// cluster, each gRPC health check answers SERVING.
func TestProbesServed(t *testing.T) {
	targets := probeTargets(procs(t))
	cl := liveCluster(t)
	httpAddrs, grpcAddrs := endpoints(cl)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, pt := range targets {
		if pt.path == "grpc" {
			for _, addr := range grpcAddrs[pt.sub] {
				if err := grpcHealth(ctx, addr, pt.service); err != nil {
					t.Errorf("lumen %s at %s: gRPC health %q: %v", pt.sub, addr, pt.service, err)
				}
			}
			continue
		}
		if len(httpAddrs[pt.sub]) == 0 {
			t.Errorf("no running lumen %s to probe", pt.sub)
		}
		for _, addr := range httpAddrs[pt.sub] {
			resp, err := scrapeClient.Get("http://" + addr + pt.path)
			if err != nil {
				t.Errorf("lumen %s: GET %s: %v", pt.sub, pt.path, err)
				continue
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Errorf("lumen %s at %s: GET %s: HTTP %d in a healthy cluster", pt.sub, addr, pt.path, resp.StatusCode)
			}
		}
	}
}

// probeTargets lists what the containers' probes ask, once each.
func probeTargets(ps []*proc) []probeTarget {
	seen := map[probeTarget]bool{}
	var out []probeTarget
	for _, p := range ps {
		for _, pr := range []*corev1.Probe{p.c.StartupProbe, p.c.LivenessProbe, p.c.ReadinessProbe} {
			var pt probeTarget
			switch {
			case pr == nil:
				continue
			case pr.HTTPGet != nil:
				pt = probeTarget{sub: p.sub, path: pr.HTTPGet.Path}
			case pr.GRPC != nil:
				pt = probeTarget{sub: p.sub, path: "grpc"}
				if pr.GRPC.Service != nil {
					pt.service = *pr.GRPC.Service
				}
			}
			if !seen[pt] {
				seen[pt] = true
				out = append(out, pt)
			}
		}
	}
	return out
}

func grpcHealth(ctx context.Context, addr, service string) error {
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer cc.Close()
	resp, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{Service: service})
	if err != nil {
		return err
	}
	if resp.Status != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("status %s", resp.Status)
	}
	return nil
}
