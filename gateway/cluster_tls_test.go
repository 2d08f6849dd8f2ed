package gateway

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/lumen-project/lumen/controller"
	"github.com/lumen-project/lumen/internal/completions"
	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/tlsconf"
	"github.com/lumen-project/lumen/internal/tlsconf/tlstest"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker"
	"github.com/lumen-project/lumen/worker/engine"
)

// TestClusterTLS: a gateway with -cluster-tls-* serves a completion through
// a controller and a worker that accept mutual TLS only, with the
// failure-free reference's output; without the certificate it is refused
// at the controllers, and a partial configuration is refused at start.
func TestClusterTLS(t *testing.T) {
	files := tlstest.Write(t)
	ccfg := controller.DefaultConfig()
	ccfg.NodeID, ccfg.DataDir, ccfg.BootstrapExpect = "c0", t.TempDir(), 1
	ccfg.RaftAddr, ccfg.GRPCAddr, ccfg.SerfAddr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	ccfg.Logger, ccfg.TLS = hclog.NewNullLogger(), files
	n, err := controller.New(ccfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Shutdown() })

	eng, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 256})
	if err != nil {
		t.Fatal(err)
	}
	wcfg := worker.DefaultConfig()
	wcfg.ID, wcfg.GRPCAddr, wcfg.Engine, wcfg.Controllers = "w1", "127.0.0.1:0", eng, []string{n.GRPCAddr()}
	wcfg.Logger, wcfg.TLS = hclog.NewNullLogger(), files
	w, err := worker.New(wcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Shutdown(context.Background()) })
	_, clientTLS, err := files.Load()
	if err != nil {
		t.Fatal(err)
	}
	ctl, err := ctlclient.New([]string{n.GRPCAddr()}, clientTLS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ctl.Close)
	waitFor(t, 20*time.Second, "w1 in full service", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		resp, err := ctl.ListWorkers(ctx, &pb.ListWorkersRequest{})
		return err == nil && len(resp.Workers) == 1 && resp.Workers[0].Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE
	})

	g := newTestGateway(t, func(c *Config) {
		c.Controllers, c.ClusterTLS, c.DispatchTimeout = []string{n.GRPCAddr()}, files, 10*time.Second
	})
	prompt := []int32{11, 12, 13, 14, 15}
	ref, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 256})
	if err != nil {
		t.Fatal(err)
	}
	want := engine.GreedyText(ref, prompt, 16)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := completions.Stream(ctx, http.DefaultClient, g.Addr(), completions.Body(prompt, 16, false), func(completions.Chunk) {})
	if err != nil {
		t.Fatalf("completion through a gateway with cluster TLS: %v", err)
	}
	if res.Text != want {
		t.Fatalf("output %q, want the reference %q", res.Text, want)
	}

	plain := newTestGateway(t, func(c *Config) { c.Controllers, c.DispatchTimeout = []string{n.GRPCAddr()}, time.Second })
	if _, err := completions.Stream(ctx, http.DefaultClient, plain.Addr(), completions.Body(prompt, 16, false), func(completions.Chunk) {}); err == nil {
		t.Fatal("a gateway without a certificate was served by TLS controllers")
	}

	cfg := DefaultConfig()
	cfg.Addr, cfg.Controllers, cfg.Logger = "127.0.0.1:0", []string{n.GRPCAddr()}, hclog.NewNullLogger()
	cfg.ClusterTLS = tlsconf.Files{Cert: files.Cert}
	if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "-cluster-tls") {
		t.Fatalf("a partial -cluster-tls configuration: %v", err)
	}
}
