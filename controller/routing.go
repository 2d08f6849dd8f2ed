package controller

// Routing: which replica serves a call. Writes and linearizable reads run on
// the ready leader, or are forwarded to it.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/raft"
	"github.com/hashicorp/serf/serf"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/gossip"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// forwardedKey marks a call a follower forwarded to the leader; the receiver
// never forwards it again.
const forwardedKey = "x-lumen-forwarded"

// write proposes cmd on the leader (forwarding when this replica is not it)
// and turns the FSM's result into the response.
func write[T any](ctx context.Context, n *Node, method string, cmd *pb.Command, resp func(proposalResult) T,
	remote func(context.Context, *grpc.ClientConn) (T, error)) (T, error) {
	return leaderOp(ctx, n, method, func(ctx context.Context, ls *leaderState) (T, error) {
		var zero T
		r, err := ls.proposer.propose(ctx, cmd)
		if err != nil {
			return zero, err
		}
		if r.res.Err != nil {
			return zero, toStatus(r.res.Err)
		}
		return resp(r), nil
	}, remote)
}

// read serves a query: stale ones locally; linearizable ones on the leader
// after a read round, or forwarded to it.
func read[T any](ctx context.Context, n *Node, method string, c pb.Consistency, serve func() (T, error),
	remote func(context.Context, *grpc.ClientConn) (T, error)) (T, error) {
	if c == pb.Consistency_CONSISTENCY_STALE {
		return serve()
	}
	if c != pb.Consistency_CONSISTENCY_LINEARIZABLE {
		var zero T
		return zero, status.Errorf(codes.InvalidArgument, "consistency %d unknown: use linearizable or stale", c)
	}
	return leaderOp(ctx, n, method, func(ctx context.Context, ls *leaderState) (T, error) {
		if err := ls.reads.read(ctx); err != nil {
			var zero T
			return zero, err
		}
		return serve()
	}, remote)
}

func (n *Node) leaderStateOrNil() *leaderState {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.leader
}

// leaderOp runs local on this replica while it is the ready leader, or calls
// remote on the leader. It retries across leader changes until the call's
// budget runs out, then fails Unavailable: never a hang past the deadline.
//
// local gets the leader state leaderOp checked, and must use that one: a
// second lookup may find none, leadership having gone meanwhile. A stale
// state is harmless: its proposer and read batcher answer errNotLeader once
// its stop channel is closed, and leaderOp retries on the new leader.
func leaderOp[T any](ctx context.Context, n *Node, method string, local func(context.Context, *leaderState) (T, error),
	remote func(context.Context, *grpc.ClientConn) (T, error)) (T, error) {
	var zero T
	ctx, cancel := n.budget(ctx)
	defer cancel()
	forwarded := false
	if md, ok := metadata.FromIncomingContext(ctx); ok && len(md.Get(forwardedKey)) > 0 {
		forwarded = true
	}
	backoff := 2 * time.Millisecond
	var last error
	for {
		if ls := n.leaderStateOrNil(); ls != nil {
			select {
			case <-ls.ready:
				v, err := local(ctx, ls)
				if err == nil || !retryable(err) {
					return v, toStatus(err)
				}
				last = err
			case <-ls.stop:
			case <-ctx.Done():
			}
		} else if forwarded {
			return zero, status.Errorf(codes.Unavailable, "controller %s: not the leader", n.cfg.NodeID)
		} else if cc, err := n.leaderConn(ctx); err != nil {
			last = err
		} else {
			n.metrics.forwarded.WithLabelValues(method).Inc()
			v, err := remote(metadata.AppendToOutgoingContext(ctx, forwardedKey, n.cfg.NodeID), cc)
			if status.Code(err) != codes.Unavailable {
				return v, err
			}
			last = err
		}
		select {
		case <-ctx.Done():
			if errors.Is(context.Cause(ctx), errBudget) || errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return zero, status.Errorf(codes.Unavailable, "controller: no leader with a quorum answered in time (last error: %v)", last)
			}
			return zero, status.FromContextError(ctx.Err()).Err()
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 100*time.Millisecond)
	}
}

func timeLeft(ctx context.Context) time.Duration {
	if d, ok := ctx.Deadline(); ok {
		return time.Until(d)
	}
	return 0
}

var errBudget = errors.New("controller: request budget spent")

// budget returns ctx bounded so the call answers before its caller's
// deadline (or within RequestTimeout when the caller set none).
func (n *Node) budget(ctx context.Context) (context.Context, context.CancelFunc) {
	d, ok := ctx.Deadline()
	if !ok {
		return context.WithTimeoutCause(ctx, n.cfg.RequestTimeout, errBudget)
	}
	left := time.Until(d)
	margin := min(left/10, 100*time.Millisecond)
	return context.WithDeadlineCause(ctx, d.Add(-margin), errBudget)
}

// leaderConn returns a connection to the leader's gRPC server, waiting for
// a leader to be known.
func (n *Node) leaderConn(ctx context.Context) (*grpc.ClientConn, error) {
	backoff := 2 * time.Millisecond
	for {
		_, id := n.raft.LeaderWithID()
		if id != "" && string(id) != n.cfg.NodeID {
			if addr := n.grpcAddrOf(string(id)); addr != "" {
				return n.peers.get(addr)
			}
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("controller: no leader known: %w", ctx.Err())
		case <-n.shutdownCh:
			return nil, raft.ErrRaftShutdown
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 50*time.Millisecond)
	}
}

// grpcAddrOf returns a controller's gRPC address from its Serf tags.
func (n *Node) grpcAddrOf(id string) string {
	if id == n.cfg.NodeID {
		return n.GRPCAddr()
	}
	for _, m := range n.serf.Members() {
		if m.Name == id && m.Tags[gossip.TagRole] == gossip.RoleController && m.Status != serf.StatusLeft {
			return m.Tags[gossip.TagGRPCAddr]
		}
	}
	return ""
}

func (n *Node) term() uint64 {
	var t uint64
	fmt.Sscan(n.raft.Stats()["term"], &t)
	return t
}
