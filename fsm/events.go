package fsm

import (
	"errors"
	"fmt"
	"sync"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// ErrCompacted: the events a watcher asked for are no longer kept; it should
// re-read the tables and watch from the current index.
var ErrCompacted = errors.New("fsm: events compacted")

// EventLog keeps the most recent events derived from applied commands, for
// WatchEvents. It is per replica and not part of snapshots: after a restore,
// events before the snapshot's index are gone (ErrCompacted).
type EventLog struct {
	mu sync.Mutex // guards all fields
	// buf is a ring of the last len(buf) events; next is the slot to write.
	buf  []*pb.Event
	next int
	n    int
	// floor is the highest log index whose events may have been dropped.
	floor uint64
	// last is the index of the last applied entry the log has seen.
	last uint64
	// changed is closed and replaced whenever events are appended.
	changed chan struct{}
}

// NewEventLog returns an EventLog that keeps size events.
func NewEventLog(size int) *EventLog {
	return &EventLog{buf: make([]*pb.Event, size), changed: make(chan struct{})}
}

func (e *EventLog) append(evs []*pb.Event) {
	if len(evs) == 0 {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, ev := range evs {
		if e.n == len(e.buf) {
			dropped := e.buf[e.next]
			if dropped.Index > e.floor {
				e.floor = dropped.Index
			}
		} else {
			e.n++
		}
		e.buf[e.next] = ev
		e.next = (e.next + 1) % len(e.buf)
		e.last = ev.Index
	}
	close(e.changed)
	e.changed = make(chan struct{})
}

func (e *EventLog) reset(floor uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.n, e.next, e.floor, e.last = 0, 0, floor, floor
	close(e.changed)
	e.changed = make(chan struct{})
}

// Since returns the events with an index greater than from, and a channel
// closed when more arrive. It fails with ErrCompacted when some of those
// events were dropped.
func (e *EventLog) Since(from uint64) ([]*pb.Event, <-chan struct{}, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if from < e.floor {
		return nil, nil, fmt.Errorf("%w: events up to index %d are gone, asked from %d", ErrCompacted, e.floor, from)
	}
	var out []*pb.Event
	start := (e.next - e.n + len(e.buf)) % len(e.buf)
	for k := 0; k < e.n; k++ {
		ev := e.buf[(start+k)%len(e.buf)]
		if ev.Index > from {
			out = append(out, ev)
		}
	}
	return out, e.changed, nil
}
