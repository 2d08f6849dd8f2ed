package worker

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/serf/serf"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/lumen-project/lumen/controller"
	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/tlsconf"
	"github.com/lumen-project/lumen/internal/tlsconf/tlstest"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// TestMutualTLSAndGossipKey: against a controller with mutual TLS and a
// gossip key, a worker with the same CA's certificate and the key joins
// the Serf pool, registers, and serves its Inference API over mutual TLS
// only; a worker with neither is refused by both.
func TestMutualTLSAndGossipKey(t *testing.T) {
	files := tlstest.Write(t)
	key := []byte("0123456789abcdef")
	cfg := controller.DefaultConfig()
	cfg.NodeID, cfg.DataDir, cfg.BootstrapExpect = "c0", t.TempDir(), 1
	cfg.RaftAddr, cfg.GRPCAddr, cfg.SerfAddr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.Logger = hclog.NewNullLogger()
	cfg.TLS, cfg.GossipKey = files, key
	n, err := controller.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Shutdown() })
	_, clientTLS, err := files.Load()
	if err != nil {
		t.Fatal(err)
	}
	ctl, err := ctlclient.New([]string{n.GRPCAddr()}, clientTLS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ctl.Close)

	good := start(t, 64, func(wc *Config) {
		wc.ID, wc.SerfAddr, wc.Join, wc.Controllers = "w1", "127.0.0.1:0", []string{n.SerfAddr()}, []string{n.GRPCAddr()}
		wc.TLS, wc.GossipKey = files, key
	})
	waitUntil(t, 20*time.Second, "w1 registered over mutual TLS", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		resp, err := ctl.ListWorkers(ctx, &pb.ListWorkersRequest{})
		return err == nil && len(resp.Workers) == 1 && resp.Workers[0].Id == "w1"
	})
	waitUntil(t, 20*time.Second, "w1 in the controller's Serf pool", func() bool {
		for _, m := range good.w.serf.Members() {
			if m.Name == "c0" && m.Status == serf.StatusAlive {
				return true
			}
		}
		return false
	})
	health := func(opt grpc.DialOption) error {
		cc, err := grpc.NewClient(good.w.GRPCAddr(), opt)
		if err != nil {
			return err
		}
		defer cc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err = healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	}
	if err := health(tlsconf.DialOption(clientTLS)); err != nil {
		t.Fatalf("health over mutual TLS: %v", err)
	}
	if err := health(tlsconf.DialOption(nil)); err == nil {
		t.Fatal("a plaintext client was served by a TLS worker")
	}

	bad := start(t, 64, func(wc *Config) {
		wc.ID, wc.SerfAddr, wc.Controllers = "w2", "127.0.0.1:0", []string{n.GRPCAddr()}
	})
	if _, err := bad.w.serf.Join([]string{n.SerfAddr()}, true); err == nil {
		t.Fatal("a worker without the gossip key joined an encrypted pool")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if _, err := bad.w.ctl.ListWorkers(ctx, &pb.ListWorkersRequest{}); err == nil {
		t.Fatal("a worker without a certificate was served by a TLS controller")
	}
	short := DefaultConfig()
	short.ID, short.GRPCAddr, short.Engine, short.GossipKey = "x", "127.0.0.1:0", good.eng, []byte("short")
	if err := short.Validate(); err == nil || !strings.Contains(err.Error(), "GossipKey is 5 bytes") {
		t.Fatalf("a 5-byte gossip key: %v", err)
	}
}
