package controller

// A handler panic must cost one call, not the replica: the recovery
// interceptors turn it into codes.Internal and log the stack.

import (
	"context"
	"runtime/debug"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// PanicLogMessage is the message the recovery interceptors log a handler
// panic under; log scanners (jepsen's) look for it.
const PanicLogMessage = "gRPC handler panicked"

// recoveryOptions installs the recovery interceptors; panics (may be nil)
// is called once per recovered panic.
func recoveryOptions(log hclog.Logger, panics func()) []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(recoverUnary(log, panics)),
		grpc.ChainStreamInterceptor(recoverStream(log, panics)),
	}
}

// recoverUnary turns a panic in a unary handler into codes.Internal.
func recoverUnary(log hclog.Logger, panics func()) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
		defer func() {
			if r := recover(); r != nil {
				err = panicked(log, panics, info.FullMethod, r)
			}
		}()
		return handler(ctx, req)
	}
}

// recoverStream turns a panic in a streaming handler into codes.Internal.
func recoverStream(log hclog.Logger, panics func()) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = panicked(log, panics, info.FullMethod, r)
			}
		}()
		return handler(srv, ss)
	}
}

func panicked(log hclog.Logger, panics func(), method string, r any) error {
	log.Error(PanicLogMessage, "method", method, "panic", r, "stack", string(debug.Stack()))
	if panics != nil {
		panics()
	}
	return status.Errorf(codes.Internal, "controller: %s failed with an internal error (panic: %v); the replica keeps serving", method, r)
}
