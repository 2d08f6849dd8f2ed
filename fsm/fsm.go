package fsm

import (
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"sort"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Errors returned in Results. The controller maps them to gRPC codes.
var (
	// ErrNoWorker: no worker is in full service, so nothing can be placed.
	ErrNoWorker = errors.New("fsm: no worker in full service")
	// ErrCompleted: the request id belongs to a request that already completed.
	ErrCompleted = errors.New("fsm: request already completed")
	// ErrUnknownWorker: the command names a worker the table does not hold.
	ErrUnknownWorker = errors.New("fsm: unknown worker")
	// ErrStaleIncarnation: the command names an older incarnation of a worker.
	ErrStaleIncarnation = errors.New("fsm: stale worker incarnation")
	// ErrIncarnationFailed: the worker's current incarnation was marked
	// failed (or left); the process, still running, must register anew.
	ErrIncarnationFailed = errors.New("fsm: worker incarnation is out of service")
	// ErrInvalid: the command is malformed (the controller validates first;
	// this guards the log).
	ErrInvalid = errors.New("fsm: invalid command")
	// ErrSessionExpired: the session named expired (no renewal within its
	// TTL), was destroyed or never existed; its placements are completed.
	// The gateway creates a new session.
	ErrSessionExpired = errors.New("fsm: session expired or unknown")
	// ErrUnknownPlacement: no placement for the request id (and it is not
	// among the recently completed).
	ErrUnknownPlacement = errors.New("fsm: no placement for the request")
	// ErrStaleEpoch: the command names an epoch the placement has left (it
	// moved, by recovery or migration, since the caller read it). Read the
	// placement again.
	ErrStaleEpoch = errors.New("fsm: stale placement epoch")
	// ErrPlacementState: the placement is not in the state the command
	// needs (RUNNING to start a migration, MIGRATING to commit one).
	ErrPlacementState = errors.New("fsm: placement in the wrong state")
	// ErrNotEligible: the worker named is not in FULL_SERVICE, so it may not
	// take a request.
	ErrNotEligible = errors.New("fsm: worker not in full service")
	// ErrStaleMigration: the command is about an earlier migration of the
	// placement (another destination, or an earlier incarnation of it).
	ErrStaleMigration = errors.New("fsm: stale migration")
	// ErrWorkerUnavailable: the Dispatch named the serving worker (the
	// gateway chose it) and that worker incarnation is not in the table, or
	// is FAILED or LEFT. The request did not get a placement; the gateway
	// places it again elsewhere with its token history.
	ErrWorkerUnavailable = errors.New("fsm: chosen worker unavailable")
)

const (
	// DefaultLambda weighs the restore delay in h(r).
	DefaultLambda = 1.0
	// completedKept is how many completed request ids are remembered so a
	// retried Dispatch of a finished request is answered, not re-placed.
	completedKept = 1 << 16
	// recoveriesKept is how many recovery plans the recovery table keeps.
	recoveriesKept = 256
)

// Result is what applying one command returns.
type Result struct {
	Dispatch *pb.DispatchResponse
	Complete *pb.CompleteResponse
	Worker   *pb.Worker
	Previous pb.Strategy
	// Session is the row a CreateSession or RenewSession left.
	Session *pb.Session
	// Destroyed answers DestroySession.
	Destroyed *pb.DestroySessionResponse
	// Placement is the row a Migrate or FinishMigration left.
	Placement *pb.Placement
	Err       error
}

// FSM implements raft.BatchingFSM.
type FSM struct {
	// mu guards st. Apply takes it for writing; queries for reading.
	// applied and events are changed only under mu held for writing, so a
	// reader holding mu sees the state, the applied index and the events of
	// the same log index (they have locks of their own for readers that
	// do not take mu: Applied, WaitApplied, Events).
	mu sync.RWMutex
	st *state

	applied appliedIndex
	events  *EventLog

	// load caches the load table (LoadTable).
	load loadCache

	// observe, when set, is told how long each command took to apply.
	observe func(command string, d time.Duration)
}

// ObserveApply has fn told, after each command is applied, the command's
// type (its field name in Command's body: "dispatch", "mark_failed", …) and
// how long applying it took, under the FSM lock: recovery planning runs
// there. Set it before the FSM is given to Raft; fn must be quick and must
// not call the FSM.
func (f *FSM) ObserveApply(fn func(command string, d time.Duration)) { f.observe = fn }

var commandBody = (&pb.Command{}).ProtoReflect().Descriptor().Oneofs().ByName("body")

// CommandType names a command by its body's field name ("dispatch",
// "create_session", …), or "empty".
func CommandType(c *pb.Command) string {
	if fd := c.ProtoReflect().WhichOneof(commandBody); fd != nil {
		return string(fd.Name())
	}
	return "empty"
}

// New returns an empty FSM with the LUMEN strategy.
func New() *FSM {
	return &FSM{st: newState(), events: NewEventLog(1 << 16)}
}

// Events is the log of events derived from applied commands.
func (f *FSM) Events() *EventLog { return f.events }

// Applied returns the index of the last log entry applied.
func (f *FSM) Applied() uint64 { return f.applied.get() }

// WaitApplied returns a channel closed once the applied index reaches idx.
func (f *FSM) WaitApplied(idx uint64) <-chan struct{} { return f.applied.wait(idx) }

// Apply applies one log entry.
func (f *FSM) Apply(l *raft.Log) interface{} {
	return f.ApplyBatch([]*raft.Log{l})[0]
}

// ApplyBatch applies committed log entries in order. Each command entry's
// response is a []Result, one per command in the entry.
func (f *FSM) ApplyBatch(logs []*raft.Log) []interface{} {
	out := make([]interface{}, len(logs))
	var evs []*pb.Event
	f.mu.Lock()
	for i, l := range logs {
		if l.Type != raft.LogCommand {
			continue
		}
		var entry pb.LogEntry
		if err := proto.Unmarshal(l.Data, &entry); err != nil {
			panic(fmt.Sprintf("fsm: log entry %d does not decode: %v", l.Index, err))
		}
		res := make([]Result, len(entry.Commands))
		f.st.failingTogether(entry.Commands)
		for j, c := range entry.Commands {
			if f.observe == nil {
				res[j] = f.st.apply(c, l.Index, &evs)
				continue
			}
			// The clock is read for the metric only; it never reaches
			// the state.
			start := time.Now()
			res[j] = f.st.apply(c, l.Index, &evs)
			f.observe(CommandType(c), time.Since(start))
		}
		f.st.endTogether()
		out[i] = res
	}
	// The applied index and the events are published before the lock is
	// released: a reader that sees the new state sees its index (a state
	// hash is never labelled with the index before it), and a watcher that
	// sees an event finds the tables that produced it.
	if len(logs) > 0 {
		f.events.append(evs)
		f.applied.set(logs[len(logs)-1].Index)
	}
	f.mu.Unlock()
	return out
}

// Snapshot captures the tables. Rows are immutable once stored, so this copies
// pointers only; Persist sorts and encodes.
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return &snapshot{s: f.st.capture(f.applied.get())}, nil
}

// Restore replaces the whole state with a snapshot's.
func (f *FSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	data, err := io.ReadAll(rc)
	if err != nil {
		return fmt.Errorf("fsm: read snapshot: %w", err)
	}
	var s pb.Snapshot
	if err := proto.Unmarshal(data, &s); err != nil {
		return fmt.Errorf("fsm: decode snapshot: %w", err)
	}
	st, err := restoreState(&s)
	if err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.st = st
	f.events.reset(s.AppliedIndex)
	f.applied.set(s.AppliedIndex)
	return nil
}

// MarshalSnapshot encodes the current state the way Persist does.
func (f *FSM) MarshalSnapshot() ([]byte, error) {
	f.mu.RLock()
	s := f.st.capture(f.applied.get())
	f.mu.RUnlock()
	return marshalSnapshot(s)
}

// StateHash returns a hash of the whole state (its snapshot encoding) and
// the applied index it is at: replicas that applied the same log agree.
func (f *FSM) StateHash() (uint64, uint64, error) {
	f.mu.RLock()
	s := f.st.capture(f.applied.get())
	f.mu.RUnlock()
	data, err := marshalSnapshot(s)
	if err != nil {
		return 0, 0, err
	}
	h := fnv.New64a()
	h.Write(data)
	return h.Sum64(), s.AppliedIndex, nil
}

type snapshot struct{ s *pb.Snapshot }

func marshalSnapshot(s *pb.Snapshot) ([]byte, error) {
	sortSnapshot(s)
	return proto.MarshalOptions{Deterministic: true}.Marshal(s)
}

func (s *snapshot) Persist(sink raft.SnapshotSink) error {
	data, err := marshalSnapshot(s.s)
	if err == nil {
		_, err = sink.Write(data)
	}
	if err != nil {
		_ = sink.Cancel()
		return fmt.Errorf("fsm: persist snapshot: %w", err)
	}
	return sink.Close()
}

func (s *snapshot) Release() {}

func sortSnapshot(s *pb.Snapshot) {
	sort.Slice(s.Workers, func(i, j int) bool { return s.Workers[i].Id < s.Workers[j].Id })
	sort.Slice(s.Loads, func(i, j int) bool { return s.Loads[i].WorkerId < s.Loads[j].WorkerId })
	sort.Slice(s.Placements, func(i, j int) bool { return s.Placements[i].RequestId < s.Placements[j].RequestId })
	sort.Slice(s.Pending, func(i, j int) bool { return s.Pending[i].WorkerId < s.Pending[j].WorkerId })
	sort.Slice(s.Sessions, func(i, j int) bool { return s.Sessions[i].Id < s.Sessions[j].Id })
	sort.Slice(s.SessionPlacements, func(i, j int) bool {
		return s.SessionPlacements[i].RequestId < s.SessionPlacements[j].RequestId
	})
}

// appliedIndex is the applied log index with waiters.
type appliedIndex struct {
	mu      sync.Mutex
	idx     uint64
	waiters []waiter
}

type waiter struct {
	idx uint64
	ch  chan struct{}
}

func (a *appliedIndex) get() uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.idx
}

func (a *appliedIndex) set(idx uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if idx < a.idx && idx != 0 {
		// Restore to an older snapshot never happens in raft; keep the max.
		return
	}
	a.idx = idx
	kept := a.waiters[:0]
	for _, w := range a.waiters {
		if w.idx <= idx {
			close(w.ch)
		} else {
			kept = append(kept, w)
		}
	}
	a.waiters = kept
}

func (a *appliedIndex) wait(idx uint64) <-chan struct{} {
	ch := make(chan struct{})
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.idx >= idx {
		close(ch)
		return ch
	}
	a.waiters = append(a.waiters, waiter{idx, ch})
	return ch
}
