// Package liveness holds the gRPC keepalive settings lumen's long-lived
// streams rely on. A worker paused with SIGSTOP, or a controller behind a
// partition that drops packets, keeps its TCP connection open and sends
// nothing: without pings a stream to it would wait for the kernel's TCP
// timeout (minutes or never). Clients ping an idle connection and close it
// when no answer comes, which breaks its streams with Unavailable; servers
// accept those pings (gRPC's default policy answers a client that pings more
// often than every five minutes with GOAWAY "too_many_pings").
package liveness

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
)

const (
	// MinTime is gRPC's floor for a client's ping interval: a smaller
	// ClientParameters.Time is raised to it.
	MinTime = 10 * time.Second
	// DefaultTime is how long a connection is idle before the client pings.
	DefaultTime = MinTime
	// DefaultTimeout is how long the client waits for the ping's answer
	// before it closes the connection.
	DefaultTimeout = 5 * time.Second
	// serverMinTime is the most often a server lets a client ping; below
	// MinTime so that no lumen client is ever refused.
	serverMinTime = 5 * time.Second
)

// DialOption makes a client ping a connection idle for interval and close
// it when the answer takes longer than timeout. Pings run with no stream
// open too, so a dead peer is noticed before the next call is made on it.
func DialOption(interval, timeout time.Duration) grpc.DialOption {
	return grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: interval, Timeout: timeout, PermitWithoutStream: true})
}

// ServerOptions make a server accept the pings of DialOption.
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
		MinTime: serverMinTime, PermitWithoutStream: true})}
}
