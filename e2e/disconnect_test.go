package e2e

import (
	"bufio"
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/worker/engine"
)

// TestClientDisconnectCancelsOnWorker: a client that goes away mid-stream
// frees its request on the worker.
func TestClientDisconnectCancelsOnWorker(t *testing.T) {
	modelDir := t.TempDir()
	if _, _, err := engine.InitModel(modelDir, engine.DefaultSeed); err != nil {
		t.Fatal(err)
	}
	cl := startQuorum(t)
	w, err := cl.AddWorker("w1", "-model-dir", modelDir, "-kv-pages", "512", "-profile", "qwen3-14b-h100", "-emulate-load=false")
	if err != nil {
		t.Fatal(err)
	}
	gw, err := cl.StartGateway("")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := gw.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	rctx, rcancel := context.WithCancel(ctx)
	req, _ := http.NewRequestWithContext(rctx, "POST", "http://"+gw.Addr+"/v1/completions",
		strings.NewReader(`{"model":"lumen-tiny","prompt":"a long one","max_tokens":1500,"temperature":0,"stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() && !strings.HasPrefix(sc.Text(), "data: ") {
	}
	url := "http://" + w.HTTPAddr + "/metrics"
	// The worker publishes its gauges after the step that produced the
	// token the client just read: wait for them to catch up.
	for start := time.Now(); metricValue(t, url, "lumen_worker_num_requests_running") != 1; time.Sleep(10 * time.Millisecond) {
		if time.Since(start) > 10*time.Second {
			t.Fatal("the worker is not running the request")
		}
	}
	rcancel()
	resp.Body.Close()
	deadline := time.Now().Add(10 * time.Second)
	for metricValue(t, url, "lumen_worker_num_requests_running") != 0 || metricValue(t, url, "lumen_worker_kv_pages_used") != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("after the client left: running %v, KV pages used %v", metricValue(t, url, "lumen_worker_num_requests_running"),
				metricValue(t, url, "lumen_worker_kv_pages_used"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}
