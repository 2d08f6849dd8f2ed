package controller

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/lumen-project/lumen/internal/tlsconf"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// writeCerts writes a CA and one certificate it signs, and returns the files.
func writeCerts(t *testing.T) tlsconf.Files {
	t.Helper()
	dir := t.TempDir()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "lumen test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true,
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "lumen node"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	caCert, _ := x509.ParseCertificate(caDER)
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalECPrivateKey(key)
	f := tlsconf.Files{Cert: filepath.Join(dir, "node.pem"), Key: filepath.Join(dir, "node-key.pem"), CA: filepath.Join(dir, "ca.pem")}
	for path, block := range map[string]*pem.Block{
		f.CA: {Type: "CERTIFICATE", Bytes: caDER}, f.Cert: {Type: "CERTIFICATE", Bytes: der},
		f.Key: {Type: "EC PRIVATE KEY", Bytes: keyDER}} {
		if err := os.WriteFile(path, pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

func TestMutualTLSAndGossipEncryption(t *testing.T) {
	files := writeCerts(t)
	key := []byte("0123456789abcdef")
	c := newCluster(t, 3, func(cfg *Config) {
		cfg.TLS = files
		cfg.GossipKey = key
	})
	_, clientTLS, err := files.Load()
	if err != nil {
		t.Fatal(err)
	}
	// With the certificate: writes replicate over TLS'd Raft and forward
	// over TLS'd gRPC.
	f := c.follower()
	cc, err := grpc.NewClient(f.GRPCAddr(), DialOptions(clientTLS)...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	if _, err := pb.NewControllerClient(cc).RegisterWorker(ctxT(t, 5*time.Second), &pb.RegisterWorkerRequest{Worker: &pb.Worker{
		Id: "w1", Incarnation: 1, GrpcAddr: "127.0.0.1:1", Capacity: &pb.Capacity{KvPagesTotal: 1, KvBytesPerToken: 1}}}); err != nil {
		t.Fatalf("write over mutual TLS via a follower: %v", err)
	}
	waitFor(t, 5*time.Second, "every replica to apply the write", func() bool {
		for _, n := range c.nodes {
			if n.FSM().Worker("w1") == nil {
				return false
			}
		}
		return true
	})
	// Without a certificate the server refuses.
	plain, err := grpc.NewClient(f.GRPCAddr(), DialOptions(nil)...)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if _, err := pb.NewOperatorClient(plain).ClusterStatus(ctxT(t, time.Second), &pb.ClusterStatusRequest{}); err == nil {
		t.Fatal("a plaintext client was served by a TLS controller")
	}
}

func TestTLSConfigErrors(t *testing.T) {
	if _, _, err := (tlsconf.Files{Cert: "x"}).Load(); err == nil {
		t.Fatal("partial TLS configuration accepted")
	}
	cfg := DefaultConfig()
	cfg.GossipKey = []byte("short")
	if err := cfg.Validate(); err == nil {
		t.Fatal("5-byte gossip key accepted")
	}
}
