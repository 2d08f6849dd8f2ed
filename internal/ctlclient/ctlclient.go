// Package ctlclient is a client of the controller quorum that survives the
// loss of any replica: it holds a connection to every replica it was given
// and moves on to the next when one is unreachable. Any replica accepts any
// call (followers forward to the leader), so no leader tracking is needed.
package ctlclient

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/liveness"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// ErrorDomain and the reasons below are the ErrorInfo details the
// controller puts on refusals a client acts on.
const (
	ErrorDomain = "lumen.controller"
	// ReasonIncarnationFailed: the worker incarnation named was marked
	// failed or left; a worker still running must register a new one.
	ReasonIncarnationFailed = "INCARNATION_FAILED"
	// ReasonSessionExpired: the session named expired, was destroyed or
	// never existed (its placements are completed); create a new one.
	ReasonSessionExpired = "SESSION_EXPIRED"
	// ReasonStaleEpoch: the placement has left the epoch named (it moved
	// by recovery or migration); read it again.
	ReasonStaleEpoch = "STALE_EPOCH"
	// ReasonStaleMigration: the migration named is not the one in flight
	// (another destination, or an earlier incarnation of it).
	ReasonStaleMigration = "STALE_MIGRATION"
	// ReasonPlacementState: the placement is not in the state the call
	// needs (RUNNING to migrate, MIGRATING to commit).
	ReasonPlacementState = "PLACEMENT_STATE"
	// ReasonCompleted: the request completed.
	ReasonCompleted = "REQUEST_COMPLETED"
	// ReasonWorkerUnavailable: the Dispatch named the serving worker (the
	// gateway chose it) and that incarnation is gone, FAILED or LEFT: the
	// request has no placement; place it again elsewhere.
	ReasonWorkerUnavailable = "WORKER_UNAVAILABLE"
	// ReasonNotLeader: a leader-only stream (Place) reached a replica that
	// does not lead, or lost leadership. The ErrorInfo's metadata names the
	// leader when the replica knows it: MetaLeaderID and MetaLeaderAddr
	// (its gRPC address).
	ReasonNotLeader = "NOT_LEADER"
	MetaLeaderID    = "leader_id"
	MetaLeaderAddr  = "leader_addr"
)

// LeaderHint returns the leader's gRPC address a NOT_LEADER refusal named,
// or "".
func LeaderHint(err error) string {
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.Domain == ErrorDomain && info.Reason == ReasonNotLeader {
			return info.Metadata[MetaLeaderAddr]
		}
	}
	return ""
}

// MigrationOver reports whether err, from FinishMigration, says the
// migration named is no longer in flight — aborted, overtaken by a recovery
// or a later migration, or its request completed — so it did not commit
// and never will: the destination frees its pages.
func MigrationOver(err error) bool {
	switch Reason(err) {
	case ReasonStaleEpoch, ReasonStaleMigration, ReasonPlacementState, ReasonCompleted:
		return true
	}
	return status.Code(err) == codes.NotFound
}

// Reason returns the ErrorInfo reason the controller gave err, or "".
func Reason(err error) string {
	for _, d := range status.Convert(err).Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.Domain == ErrorDomain {
			return info.Reason
		}
	}
	return ""
}

// reconnect is how a connection to a replica that went away is retried:
// soon and at most ReconnectMax apart, rather than gRPC's default of backing
// off up to two minutes. A gateway must renew its session within the TTL
// once the controller is back; a few dials a second to a dead replica cost
// nothing.
var reconnect = grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: ReconnectMax},
	MinConnectTimeout: 2 * time.Second,
}

// ReconnectMax is the longest a connection to an unreachable replica waits
// between dials.
const ReconnectMax = time.Second

// ErrNoAddress: the client was given no controller address.
var ErrNoAddress = errors.New("ctlclient: no controller address given")

// Client calls the controller quorum.
type Client struct {
	addrs []string
	conns []*grpc.ClientConn
	next  atomic.Uint32
	creds credentials.TransportCredentials

	// extra holds connections to leader addresses that are not among
	// addrs (a NOT_LEADER hint naming a replica by another address).
	extraMu sync.Mutex
	extra   map[string]*grpc.ClientConn
	// AttemptTimeout bounds one attempt on one replica before the next is
	// tried (default 2 s); the caller's context bounds the whole call.
	AttemptTimeout time.Duration
}

// New connects (lazily) to every address. clientTLS may be nil.
func New(addrs []string, clientTLS *tls.Config) (*Client, error) {
	var clean []string
	for _, a := range addrs {
		for _, s := range strings.Split(a, ",") {
			if s = strings.TrimSpace(s); s != "" {
				clean = append(clean, s)
			}
		}
	}
	if len(clean) == 0 {
		return nil, ErrNoAddress
	}
	creds := insecure.NewCredentials()
	if clientTLS != nil {
		creds = credentials.NewTLS(clientTLS)
	}
	c := &Client{addrs: clean, AttemptTimeout: 2 * time.Second, creds: creds}
	for _, a := range clean {
		cc, err := grpc.NewClient(a, c.dialOptions()...)
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("ctlclient: %s: %w", a, err)
		}
		c.conns = append(c.conns, cc)
	}
	return c, nil
}

// dialOptions are every controller connection's: the fast reconnect, and
// keepalive pings, so that a replica that stops answering (SIGSTOPped, or
// behind a link that drops packets without a reset) breaks the streams on
// its connection instead of leaving them waiting forever. Streams that
// must notice sooner than the keepalive does probe as well (Placer).
func (c *Client) dialOptions() []grpc.DialOption {
	return []grpc.DialOption{grpc.WithTransportCredentials(c.creds), grpc.WithConnectParams(reconnect),
		liveness.DialOption(liveness.DefaultTime, liveness.DefaultTimeout)}
}

// indexOf returns addr's place among the replicas' addresses, or -1.
func (c *Client) indexOf(addr string) int {
	for i, a := range c.addrs {
		if a == addr {
			return i
		}
	}
	return -1
}

// Close closes every connection.
func (c *Client) Close() {
	for _, cc := range c.conns {
		cc.Close()
	}
	c.extraMu.Lock()
	for _, cc := range c.extra {
		cc.Close()
	}
	c.extra = nil
	c.extraMu.Unlock()
}

// connTo returns the connection to addr: one of the replicas', or a new
// one kept until Close.
func (c *Client) connTo(addr string) (*grpc.ClientConn, error) {
	if i := c.indexOf(addr); i >= 0 {
		return c.conns[i], nil
	}
	c.extraMu.Lock()
	defer c.extraMu.Unlock()
	if cc, ok := c.extra[addr]; ok {
		return cc, nil
	}
	cc, err := grpc.NewClient(addr, c.dialOptions()...)
	if err != nil {
		return nil, err
	}
	if c.extra == nil {
		c.extra = map[string]*grpc.ClientConn{}
	}
	c.extra[addr] = cc
	return cc, nil
}

// Addrs returns the controller addresses.
func (c *Client) Addrs() []string { return c.addrs }

// Do runs call against one replica after another until one answers with
// anything but Unavailable or DeadlineExceeded of its own attempt, or ctx
// ends. The error then names every replica tried.
func (c *Client) Do(ctx context.Context, call func(ctx context.Context, cc *grpc.ClientConn) error) error {
	start := int(c.next.Load())
	var errs []string
	for attempt := 0; ; attempt++ {
		i := (start + attempt) % len(c.conns)
		actx, cancel := context.WithTimeout(ctx, c.AttemptTimeout)
		err := call(actx, c.conns[i])
		cancel()
		code := status.Code(err)
		if err == nil || (code != codes.Unavailable && code != codes.DeadlineExceeded) {
			c.next.Store(uint32(i))
			return err
		}
		if ctx.Err() != nil {
			if len(errs) == 0 {
				errs = append(errs, fmt.Sprintf("%s: %v", c.addrs[i], status.Convert(err).Message()))
			}
			return status.Errorf(codes.Unavailable, "no controller answered in time; last errors: %s", strings.Join(errs, "; "))
		}
		errs = append(errs, fmt.Sprintf("%s: %v", c.addrs[i], status.Convert(err).Message()))
		if len(errs) > len(c.conns) {
			errs = errs[1:]
		}
		if (attempt+1)%len(c.conns) == 0 {
			select {
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
}

// call runs one Controller method with failover, e.g.
// call(c, ctx, req, pb.ControllerClient.Dispatch).
func call[Req, Resp any](c *Client, ctx context.Context, req Req,
	method func(pb.ControllerClient, context.Context, Req, ...grpc.CallOption) (Resp, error)) (resp Resp, err error) {
	err = c.Do(ctx, func(ctx context.Context, cc *grpc.ClientConn) (e error) {
		resp, e = method(pb.NewControllerClient(cc), ctx, req)
		return e
	})
	return resp, err
}

// Dispatch places a request.
func (c *Client) Dispatch(ctx context.Context, req *pb.DispatchRequest) (*pb.DispatchResponse, error) {
	return call(c, ctx, req, pb.ControllerClient.Dispatch)
}

// Complete ends requests.
func (c *Client) Complete(ctx context.Context, req *pb.CompleteRequest) (*pb.CompleteResponse, error) {
	return call(c, ctx, req, pb.ControllerClient.Complete)
}

// GetPlacement reads a placement.
func (c *Client) GetPlacement(ctx context.Context, req *pb.GetPlacementRequest) (*pb.GetPlacementResponse, error) {
	return call(c, ctx, req, pb.ControllerClient.GetPlacement)
}

// RegisterWorker registers a worker.
func (c *Client) RegisterWorker(ctx context.Context, req *pb.RegisterWorkerRequest) (*pb.RegisterWorkerResponse, error) {
	return call(c, ctx, req, pb.ControllerClient.RegisterWorker)
}

// ReportLoad sends a load record.
func (c *Client) ReportLoad(ctx context.Context, req *pb.ReportLoadRequest) (*pb.ReportLoadResponse, error) {
	return call(c, ctx, req, pb.ControllerClient.ReportLoad)
}

// ListWorkers lists workers and their loads.
func (c *Client) ListWorkers(ctx context.Context, req *pb.ListWorkersRequest) (*pb.ListWorkersResponse, error) {
	return call(c, ctx, req, pb.ControllerClient.ListWorkers)
}

// ClusterStatus asks one replica for its view; it moves on when that
// replica is unreachable.
func (c *Client) ClusterStatus(ctx context.Context) (resp *pb.ClusterStatusResponse, err error) {
	err = c.Do(ctx, func(ctx context.Context, cc *grpc.ClientConn) (e error) {
		resp, e = pb.NewOperatorClient(cc).ClusterStatus(ctx, &pb.ClusterStatusRequest{})
		return e
	})
	return resp, err
}

// Operator runs an operator call with failover.
func (c *Client) Operator(ctx context.Context, call func(ctx context.Context, op pb.OperatorClient) error) error {
	return c.Do(ctx, func(ctx context.Context, cc *grpc.ClientConn) error {
		return call(ctx, pb.NewOperatorClient(cc))
	})
}

// Conn returns the connection to replica i, for callers that pin one.
func (c *Client) Conn(i int) *grpc.ClientConn { return c.conns[i%len(c.conns)] }

// SetWorkerPhase moves a worker to a phase.
func (c *Client) SetWorkerPhase(ctx context.Context, req *pb.SetWorkerPhaseRequest) (*pb.SetWorkerPhaseResponse, error) {
	return call(c, ctx, req, pb.ControllerClient.SetWorkerPhase)
}

// WatchEvents opens the event stream on one replica (the first that
// answers), from index from.
func (c *Client) WatchEvents(ctx context.Context, from uint64) (grpc.ServerStreamingClient[pb.Event], error) {
	var stream grpc.ServerStreamingClient[pb.Event]
	var lastErr error
	for i := range c.conns {
		s, err := pb.NewControllerClient(c.conns[(int(c.next.Load())+i)%len(c.conns)]).WatchEvents(ctx, &pb.WatchEventsRequest{FromIndex: from})
		if err == nil {
			return s, nil
		}
		lastErr = err
	}
	return stream, lastErr
}

// ReportUnreachable tells the leader a worker's stream broke.
func (c *Client) ReportUnreachable(ctx context.Context, req *pb.ReportUnreachableRequest) (*pb.ReportUnreachableResponse, error) {
	return call(c, ctx, req, pb.ControllerClient.ReportUnreachable)
}

// CreateSession opens a session for a gateway.
func (c *Client) CreateSession(ctx context.Context, req *pb.CreateSessionRequest) (*pb.CreateSessionResponse, error) {
	return call(c, ctx, req, pb.ControllerClient.CreateSession)
}

// RenewSession keeps a session alive for another TTL.
func (c *Client) RenewSession(ctx context.Context, req *pb.RenewSessionRequest) (*pb.RenewSessionResponse, error) {
	return call(c, ctx, req, pb.ControllerClient.RenewSession)
}

// FinishMigration commits or aborts a live migration (workers call it).
func (c *Client) FinishMigration(ctx context.Context, req *pb.FinishMigrationRequest) (*pb.FinishMigrationResponse, error) {
	return call(c, ctx, req, pb.ControllerClient.FinishMigration)
}

// Migrate starts a live migration of one request (an operator's).
func (c *Client) Migrate(ctx context.Context, req *pb.MigrateRequest) (resp *pb.MigrateResponse, err error) {
	err = c.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) (e error) {
		resp, e = op.Migrate(ctx, req)
		return e
	})
	return resp, err
}

// DestroySession ends a session and completes its placements.
func (c *Client) DestroySession(ctx context.Context, req *pb.DestroySessionRequest) (*pb.DestroySessionResponse, error) {
	return call(c, ctx, req, pb.ControllerClient.DestroySession)
}
