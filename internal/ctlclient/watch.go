package ctlclient

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/go-hclog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// The controller's streams of its applied state — the event log
// (WatchEvents) and the load table (WatchLoad) — are served by every
// replica from its own state, so a watcher follows any one of them. What a
// watcher must survive is the same for both: a replica that dies (the
// stream breaks), one that is paused or whose connection drops silently
// (the stream stays open and says nothing), and one cut off from the
// quorum (it knows no leader and applies nothing more). Watch is that loop,
// once: the gateway's move watch, the worker's event watch and the load
// watch all run it.

// DefaultProbeInterval is how often a watch probes its replica when
// Watch.ProbeInterval is 0.
const DefaultProbeInterval = 2 * time.Second

// ErrNoLeader: the replica a watch follows knows no leader; it is cut off
// from the quorum, and what it streams would go stale. The watch moves on.
var ErrNoLeader = errors.New("ctlclient: the watched controller replica knows no leader")

// Backoff of a watch between rounds of replicas none of which held.
const (
	watchBackoffMin = 50 * time.Millisecond
	watchBackoffMax = ReconnectMax
)

// Watch follows a stream of messages of type T (a protobuf message
// struct: pb.Event, pb.LoadTable) that every controller
// replica serves from its applied state. It follows one replica at a time
// and moves on to the next when the stream breaks, when the replica does
// not answer its probe (ClusterStatus) within ProbeInterval, or when the
// replica knows no leader. After a round of replicas none of which held it
// waits, doubling the wait up to a second.
//
// An indexed stream (Index set: the event log) resumes on the next replica
// after the last log index whose messages were all delivered: messages of
// the index in progress may be delivered again, so Deliver must take a
// repeat as a no-op. The first stream starts from the replica's applied
// index ("now"), and so does one after a replica answered OutOfRange (the
// messages asked for are no longer kept): Started is the caller's chance
// to read the state those messages would have changed.
type Watch[T any] struct {
	// Conns are the connections to the replicas, one each. Start is the
	// index of the one followed first.
	Conns []*grpc.ClientConn
	Start int
	// From, when positive, is the log index the first stream of an
	// indexed watch starts after (default: the replica's applied index).
	From uint64
	// ProbeInterval is how often the followed replica is asked whether it
	// still knows a leader, and how long it has to answer (default
	// DefaultProbeInterval). It bounds how long a paused replica or a
	// silently dropped connection goes unnoticed.
	ProbeInterval time.Duration
	// Open opens the stream on a replica: from is the log index after
	// which an indexed stream starts (0 for one without an index).
	Open func(ctx context.Context, cc *grpc.ClientConn, from uint64) (grpc.ServerStreamingClient[T], error)
	// Index returns a message's log index; nil for a stream of whole
	// states (the load table), which starts afresh on every replica.
	Index func(*T) uint64
	// Started, when set, runs each time a stream opened on a replica,
	// before its first message is delivered, with that replica's
	// connection: it reads what the stream starts after (the replica's
	// state is at least as new as the stream's start). An error leaves the
	// replica for the next.
	Started func(ctx context.Context, cc *grpc.ClientConn) error
	// Deliver gets every message, in order, on Run's goroutine; it must
	// not block long.
	Deliver func(*T)
	// Logger logs each move to another replica at debug level (default:
	// none).
	Logger hclog.Logger
}

// Run follows the stream until ctx ends, and returns ctx's error.
func (w *Watch[T]) Run(ctx context.Context) error {
	if len(w.Conns) == 0 {
		return ErrNoAddress
	}
	log := w.Logger
	if log == nil {
		log = hclog.NewNullLogger()
	}
	// from is the index the next stream starts after, unless now: then
	// it starts from the replica's applied index.
	from, now := w.From, w.From == 0
	backoff, failed := watchBackoffMin, 0
	for i := w.Start; ; i++ {
		cc := w.Conns[i%len(w.Conns)]
		held, err := w.follow(ctx, cc, &from, &now)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if status.Code(err) == codes.OutOfRange {
			now = true // too far behind: start from now
		}
		log.Debug("controller stream ended; moving to the next replica", "controller", cc.Target(), "error", err)
		if held {
			backoff, failed = watchBackoffMin, 0
			continue // straight to the next replica
		}
		if failed++; failed%len(w.Conns) != 0 {
			continue
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		backoff = min(2*backoff, watchBackoffMax)
	}
}

func (w *Watch[T]) probeInterval() time.Duration {
	if w.ProbeInterval > 0 {
		return w.ProbeInterval
	}
	return DefaultProbeInterval
}

// follow follows the stream on one replica from *from (or from the
// replica's applied index, when *now), advancing it, until the stream
// breaks or the replica fails its probe. held says the stream was healthy
// for a while (it delivered, or passed a probe after opening).
func (w *Watch[T]) follow(ctx context.Context, cc *grpc.ClientConn, from *uint64, now *bool) (held bool, err error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	op := pb.NewOperatorClient(cc)
	applied, err := w.probe(ctx, op)
	if err != nil {
		return false, err
	}
	if w.Index != nil && *now {
		*from, *now = applied, false
	}
	stream, err := w.Open(ctx, cc, *from)
	if err != nil {
		return false, err
	}
	if w.Started != nil {
		if err := w.Started(ctx, cc); err != nil {
			return false, fmt.Errorf("ctlclient: watch start on %s: %w", cc.Target(), err)
		}
	}
	probed := make(chan struct{})
	passed := make(chan struct{}, 1) // a probe passed since the stream opened
	go func() {                      // owned here: it ends with ctx, and follow waits for it
		defer close(probed)
		t := time.NewTicker(w.probeInterval())
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if _, err := w.probe(ctx, op); err != nil {
					cancel(err)
					return
				}
				select {
				case passed <- struct{}{}:
				default:
				}
			}
		}
	}()
	defer func() {
		cancel(nil)
		<-probed
		select {
		case <-passed:
			held = true
		default:
		}
	}()
	var last uint64
	for {
		m, err := stream.Recv()
		if err != nil {
			if cause := context.Cause(ctx); ctx.Err() != nil && cause != nil && !errors.Is(cause, context.Canceled) {
				err = cause // the probe failed: say why
			}
			return held, err
		}
		held = true
		if w.Index != nil {
			idx := w.Index(m)
			if idx > last && last > 0 {
				// Every message of index last has arrived: a new stream
				// starts after it.
				*from = last
			}
			last = idx
		}
		w.Deliver(m)
	}
}

// probe asks the replica for its status within the probe interval, and
// returns its applied index. A replica that does not answer, or knows no
// leader, fails.
func (w *Watch[T]) probe(ctx context.Context, op pb.OperatorClient) (uint64, error) {
	st, err := Probe(ctx, op, w.probeInterval())
	if err != nil {
		return 0, err
	}
	return st.AppliedIndex, nil
}

// Probe asks a replica for its status within timeout: the liveness check
// of every long-lived stream to the controllers (the watches here and the
// Placer's Place stream). A replica that does not answer in time, or that
// knows no leader (ErrNoLeader), fails; the caller leaves it for the next.
func Probe(ctx context.Context, op pb.OperatorClient, timeout time.Duration) (*pb.ClusterStatusResponse, error) {
	pctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	st, err := op.ClusterStatus(pctx, &pb.ClusterStatusRequest{})
	if err != nil {
		return nil, err
	}
	if st.LeaderId == "" {
		return st, fmt.Errorf("%w (replica %s)", ErrNoLeader, st.NodeId)
	}
	return st, nil
}

// WatchEventsOn opens the event stream on one replica, for Watch.Open.
func WatchEventsOn(ctx context.Context, cc *grpc.ClientConn, from uint64) (grpc.ServerStreamingClient[pb.Event], error) {
	return pb.NewControllerClient(cc).WatchEvents(ctx, &pb.WatchEventsRequest{FromIndex: from})
}

// EventIndex is an event's log index, for Watch.Index.
func EventIndex(ev *pb.Event) uint64 { return ev.Index }

// EventWatch returns a Watch of the event log on the client's replicas,
// starting with the one that last answered a call.
func (c *Client) EventWatch(probe time.Duration, deliver func(*pb.Event)) *Watch[pb.Event] {
	return &Watch[pb.Event]{Conns: c.conns, Start: int(c.next.Load()), ProbeInterval: probe,
		Open: WatchEventsOn, Index: EventIndex, Deliver: deliver}
}

// FollowDrain follows the drain of incarnation inc of worker id from log
// index from: show gets every event of its migrations (out and in) and of
// its phase, until the phase is no longer DRAINING — it left, failed, or a
// new incarnation registered — and FollowDrain returns that phase, or ctx
// ends (it returns ctx's error). Every time its watch starts it also reads
// the worker's row, so it ends even when the event that would have ended
// it is not seen (a watch that starts again from now).
func (c *Client) FollowDrain(ctx context.Context, id string, inc, from uint64, show func(*pb.Event)) (pb.WorkerPhase, error) {
	ctx, end := context.WithCancel(ctx)
	defer end()
	final := pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED
	over := func(p pb.WorkerPhase) {
		if final == pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED {
			final = p
		}
		end()
	}
	w := c.EventWatch(0, func(ev *pb.Event) {
		if ctx.Err() != nil {
			return
		}
		if m := ev.GetMigration(); m != nil && (m.FromWorker == id || m.ToWorker == id) {
			show(ev)
		}
		if pc := ev.GetPhaseChanged(); pc != nil && pc.WorkerId == id {
			show(ev)
			if pc.To != pb.WorkerPhase_WORKER_PHASE_DRAINING || pc.Incarnation != inc {
				over(pc.To)
			}
		}
	})
	w.From = from
	w.Started = func(sctx context.Context, cc *grpc.ClientConn) error {
		resp, err := pb.NewControllerClient(cc).ListWorkers(sctx, &pb.ListWorkersRequest{Consistency: pb.Consistency_CONSISTENCY_STALE})
		if err != nil {
			return err
		}
		for _, row := range resp.Workers {
			if row.Id == id && (row.Incarnation != inc || row.Phase != pb.WorkerPhase_WORKER_PHASE_DRAINING) {
				over(row.Phase)
			}
		}
		return nil
	}
	err := w.Run(ctx)
	if final != pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED {
		return final, nil
	}
	return final, err
}
