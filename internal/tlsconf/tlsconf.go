// Package tlsconf loads the TLS material lumen's servers and clients share:
// one certificate and key per process, and a CA that signs every peer.
// Both sides verify each other (mutual TLS).
package tlsconf

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// Files names the PEM files. All three are set, or none.
type Files struct {
	Cert string // this process's certificate
	Key  string // its private key
	CA   string // the CA that signs every peer's certificate
}

// Enabled reports whether TLS is configured.
func (f Files) Enabled() bool { return f.Cert != "" || f.Key != "" || f.CA != "" }

// Load returns the server and client configurations, or nil, nil when TLS is
// not configured.
func (f Files) Load() (server, client *tls.Config, err error) {
	if !f.Enabled() {
		return nil, nil, nil
	}
	if f.Cert == "" || f.Key == "" || f.CA == "" {
		return nil, nil, errors.New("tlsconf: -tls-cert, -tls-key and -tls-ca must be given together")
	}
	cert, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		return nil, nil, fmt.Errorf("tlsconf: load key pair %s, %s: %w", f.Cert, f.Key, err)
	}
	pem, err := os.ReadFile(f.CA)
	if err != nil {
		return nil, nil, fmt.Errorf("tlsconf: read CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, nil, fmt.Errorf("tlsconf: %s holds no PEM certificate", f.CA)
	}
	server = &tls.Config{
		Certificates: []tls.Certificate{cert},
		ClientCAs:    pool,
		ClientAuth:   tls.RequireAndVerifyClientCert,
		MinVersion:   tls.VersionTLS12,
	}
	client = &tls.Config{
		Certificates: []tls.Certificate{cert},
		RootCAs:      pool,
		MinVersion:   tls.VersionTLS12,
		// Peers are addressed by IP:port; the CA is private to the cluster,
		// so verify the chain and skip the host name.
		InsecureSkipVerify: true, //nolint:gosec // chain verified below
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			return verifyChain(raw, pool)
		},
	}
	return server, client, nil
}

func verifyChain(raw [][]byte, pool *x509.CertPool) error {
	if len(raw) == 0 {
		return errors.New("tlsconf: peer sent no certificate")
	}
	certs := make([]*x509.Certificate, len(raw))
	for i, r := range raw {
		c, err := x509.ParseCertificate(r)
		if err != nil {
			return fmt.Errorf("tlsconf: parse peer certificate: %w", err)
		}
		certs[i] = c
	}
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	_, err := certs[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
	if err != nil {
		return fmt.Errorf("tlsconf: peer certificate: %w", err)
	}
	return nil
}

// DialOption is a gRPC client's transport credentials: mutual TLS with
// client (from Load), or plaintext when client is nil.
func DialOption(client *tls.Config) grpc.DialOption {
	if client == nil {
		return grpc.WithTransportCredentials(insecure.NewCredentials())
	}
	return grpc.WithTransportCredentials(credentials.NewTLS(client))
}

// ServerOptions are a gRPC server's: mutual TLS with server (from Load), or
// none (plaintext) when server is nil.
func ServerOptions(server *tls.Config) []grpc.ServerOption {
	if server == nil {
		return nil
	}
	return []grpc.ServerOption{grpc.Creds(credentials.NewTLS(server))}
}
