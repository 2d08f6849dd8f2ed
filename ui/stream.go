package ui

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/lumen-project/lumen/fsm"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// eventPos is an event's place in the stream: (index, seq) orders events
// totally.
type eventPos struct {
	index uint64
	seq   uint32
}

func (p eventPos) String() string { return fmt.Sprintf("%d.%d", p.index, p.seq) }

// parseEventPos reads a Last-Event-ID.
func parseEventPos(s string) (eventPos, bool) {
	i, q, ok := strings.Cut(s, ".")
	if !ok {
		return eventPos{}, false
	}
	index, err1 := strconv.ParseUint(i, 10, 64)
	seq, err2 := strconv.ParseUint(q, 10, 32)
	return eventPos{index, uint32(seq)}, err1 == nil && err2 == nil
}

// after reports whether ev comes after p.
func (p eventPos) after(ev *pb.Event) bool {
	return ev.Index > p.index || (ev.Index == p.index && ev.Seq > p.seq)
}

// serveStream is the page's live feed (server-sent events): the state now
// and then once a sampleEvery, the replica's events as they are applied,
// and its leadership changes. It ends when the page goes or the replica
// shuts down; the browser reconnects by itself with the last event id.
func (d *Dashboard) serveStream(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	d.watch(1)
	defer d.watch(-1)
	events := d.cfg.Replica.FSM().Events()
	pos, resumed := parseEventPos(r.Header.Get("Last-Event-ID"))
	var evs []*pb.Event
	var changed <-chan struct{}
	if resumed {
		var err error
		if evs, changed, err = sinceResume(events, pos); err != nil {
			resumed = false
		}
	}
	if !resumed {
		pos = eventPos{}
		evs, changed = recent(events, d.cfg.Replica.FSM().Applied())
	}
	d.mu.Lock()
	published := d.published
	d.mu.Unlock()
	// The leadership changes up to now go with the full state; later ones
	// as "leader" events.
	st := d.state(true)
	var leaderSeq uint64
	if len(st.Leaders) > 0 {
		leaderSeq = st.Leaders[len(st.Leaders)-1].Seq
	}
	if err := writeSSE(w, "state", "", st); err != nil {
		return
	}
	for {
		for _, ev := range evs {
			if !pos.after(ev) {
				continue
			}
			b, err := protojson.Marshal(ev)
			if err != nil {
				return
			}
			pos = eventPos{ev.Index, ev.Seq}
			if err := writeSSE(w, "ev", pos.String(), json.RawMessage(b)); err != nil {
				return
			}
		}
		if err := rc.Flush(); err != nil {
			return
		}
		select {
		case <-changed:
		case <-published:
			d.mu.Lock()
			published = d.published
			var leaders []LeaderChange
			for _, l := range d.leaders {
				if l.Seq > leaderSeq {
					leaders = append(leaders, l)
				}
			}
			leaderSeq = d.leaderSeq
			d.mu.Unlock()
			for _, l := range leaders {
				if err := writeSSE(w, "leader", "", l); err != nil {
					return
				}
			}
			if err := writeSSE(w, "state", "", d.state(false)); err != nil {
				return
			}
		case <-r.Context().Done():
			return
		case <-d.cfg.Stop:
			return
		}
		var err error
		evs, changed, err = sinceResume(events, pos)
		if err != nil {
			// The page fell more than the event log behind: it gets
			// the recent events again after a reset.
			if werr := writeSSE(w, "reset", "", err.Error()); werr != nil {
				return
			}
			evs, changed = recent(events, d.cfg.Replica.FSM().Applied())
			pos = eventPos{}
		}
	}
}

// sinceResume returns the events after pos (those of pos's index that
// follow it included).
func sinceResume(events *fsm.EventLog, pos eventPos) ([]*pb.Event, <-chan struct{}, error) {
	from := pos.index
	if from > 0 {
		from--
	}
	evs, changed, err := events.Since(from)
	if err != nil {
		return nil, nil, err
	}
	out := evs[:0:0]
	for _, ev := range evs {
		if pos.after(ev) {
			out = append(out, ev)
		}
	}
	return out, changed, nil
}

// recent returns about the last backlog events the log still has: it
// looks back further and further from the applied index while the log
// answers and holds fewer.
func recent(events *fsm.EventLog, applied uint64) ([]*pb.Event, <-chan struct{}) {
	evs, changed, _ := events.Since(applied)
	for back := uint64(64); ; back *= 4 {
		from := applied - min(back, applied)
		got, ch, err := events.Since(from)
		if err != nil {
			break // compacted: the last window that answered is all there is
		}
		evs, changed = got, ch
		if len(evs) >= backlog || from == 0 {
			break
		}
	}
	if len(evs) > backlog {
		evs = evs[len(evs)-backlog:]
	}
	return evs, changed
}

// writeSSE writes one server-sent event with v as JSON.
func writeSSE(w http.ResponseWriter, event, id string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	var sb strings.Builder
	sb.WriteString("event: " + event + "\n")
	if id != "" {
		sb.WriteString("id: " + id + "\n")
	}
	sb.WriteString("data: ")
	sb.Write(b)
	sb.WriteString("\n\n")
	_, err = w.Write([]byte(sb.String()))
	return err
}
