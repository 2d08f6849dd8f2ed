// Package ui is the operator's dashboard that every controller replica
// serves at /ui/ on its HTTP address: the quorum, the workers, the requests
// in flight and in recovery, charts of the last minutes and a live timeline
// of the controller's events.
//
// The page is plain HTML, CSS and JavaScript embedded in the binary
// (assets/); nothing is fetched from elsewhere. It reads two endpoints:
//
//   - /ui/api/state: the whole state as JSON (also handy with curl);
//   - /ui/api/stream: server-sent events — "state" once a second (the full
//     state with the history at connection, the latest sample after), "ev"
//     for each event the replica derives from the committed log (the
//     protojson of lumenpb.Event, in the order WatchEvents sends them, with
//     "index.seq" as the event id so a reconnecting page resumes where it
//     stopped), and "leader" for each leadership change this replica sees.
//
// Tables and events are read in process from the replica's fsm, which
// applies the same committed log as the leader's: a follower shows the
// leader's view, up to its applied index. The quorum rows come from each
// replica's ClusterStatus over gRPC, polled only while someone watches.
//
// The controller knows no TTFT (the gateway measures it:
// lumen_gateway_time_to_first_token_seconds on its /metrics); the charts show what the
// controller does know: the queue (waiting and running requests, from the
// workers' load reports), q_w (the queue wait before prefill each worker
// reports, the part of TTFT that failures and recovery stretch) and the
// requests in recovery with the workers out of service.
package ui

import (
	"context"
	"embed"
	"io/fs"
	"net/http"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"

	"github.com/lumen-project/lumen/fsm"
)

//go:embed assets
var assets embed.FS

// Replica is what the dashboard reads of its controller replica;
// *controller.Node is one.
type Replica interface {
	// ID is the replica's node id.
	ID() string
	// GRPCAddr is its API's address.
	GRPCAddr() string
	// Raft is its Raft node: state, term, indexes, leadership changes.
	Raft() *raft.Raft
	// FSM is its state machine: the tables and the event log.
	FSM() *fsm.FSM
}

// Config is what New needs from the replica it runs in.
type Config struct {
	// Replica is the controller replica the page describes.
	Replica Replica
	// Dial returns a connection to a replica's gRPC address, with the
	// replica's client credentials; the caller owns and closes the
	// connections (the controller's cache of peer connections).
	Dial func(addr string) (*grpc.ClientConn, error)
	// Stop closes when the replica shuts down: open streams end and the
	// sampler stops.
	Stop <-chan struct{}
	// Go runs f on a goroutine the replica waits for when it shuts down.
	Go func(f func())
}

const (
	// sampleEvery is the period of the history's samples and of the
	// state pushed to open pages.
	sampleEvery = time.Second
	// historyLen samples make the charts' window: 10 minutes.
	historyLen = 600
	// leadersKept is how many leadership changes the timeline keeps.
	leadersKept = 64
	// watchedFor is how long after the last page or API call the quorum
	// is still polled.
	watchedFor = 15 * time.Second
	// statusTimeout bounds one replica's ClusterStatus.
	statusTimeout = 700 * time.Millisecond
	// backlog is how many recent events a page gets when it connects.
	backlog = 400
)

// Dashboard serves the page and its API. It is an http.Handler for the
// /ui/ subtree.
type Dashboard struct {
	cfg   Config
	files http.Handler
	// ctx ends when the replica stops: quorum polls in flight end too.
	ctx context.Context
	// wake asks the sampler to poll the quorum now (a page arrived after
	// nobody watched).
	wake chan struct{}

	mu sync.Mutex // guards the fields below
	// history is a ring of the last historyLen samples; next is the slot
	// to write, n how many are filled.
	history []Sample
	next, n int
	quorum  []ReplicaStatus
	// quorumAt is when quorum was polled (zero: never).
	quorumAt time.Time
	// leaders are the last leadership changes this replica saw, oldest
	// first; leaderSeq numbers them from 1.
	leaders   []LeaderChange
	leaderSeq uint64
	// watched is when a page or an API call last came; streams counts
	// the pages connected now.
	watched time.Time
	streams int
	// published is closed and replaced at each sample and leadership
	// change.
	published chan struct{}
}

// New returns the dashboard of cfg.Replica and starts its sampler on
// cfg.Go; mount it at "/ui/".
func New(cfg Config) *Dashboard {
	sub, err := fs.Sub(assets, "assets")
	if err != nil {
		panic(err) // the embedded tree has the folder
	}
	ctx, cancel := context.WithCancel(context.Background())
	d := &Dashboard{
		cfg:       cfg,
		ctx:       ctx,
		files:     http.StripPrefix("/ui/", http.FileServer(http.FS(sub))),
		wake:      make(chan struct{}, 1),
		history:   make([]Sample, historyLen),
		published: make(chan struct{}),
	}
	obs := make(chan raft.Observation, 16)
	observer := raft.NewObserver(obs, false, func(o *raft.Observation) bool {
		_, ok := o.Data.(raft.LeaderObservation)
		return ok
	})
	cfg.Replica.Raft().RegisterObserver(observer)
	cfg.Go(func() {
		<-cfg.Stop
		cancel()
	})
	cfg.Go(func() {
		defer cfg.Replica.Raft().DeregisterObserver(observer)
		d.run(obs)
	})
	return d
}

// ServeHTTP serves /ui/ (the page), its assets and /ui/api/.
func (d *Dashboard) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/ui/api/state":
		d.serveState(w, r)
	case "/ui/api/stream":
		d.serveStream(w, r)
	default:
		w.Header().Set("Cache-Control", "no-cache")
		d.files.ServeHTTP(w, r)
	}
}

// run samples the tables every sampleEvery, polls the quorum while someone
// watches, and records leadership changes, until Stop closes.
func (d *Dashboard) run(obs <-chan raft.Observation) {
	t := time.NewTicker(sampleEvery)
	defer t.Stop()
	d.record(time.Now())
	for {
		select {
		case <-t.C:
			d.record(time.Now())
		case <-d.wake:
			d.pollQuorum()
		case o := <-obs:
			lo := o.Data.(raft.LeaderObservation)
			d.leaderChanged(string(lo.LeaderID), time.Now())
		case <-d.cfg.Stop:
			return
		}
	}
}

// record appends a sample of the tables to the history, polls the quorum
// when someone watches, and tells open streams.
func (d *Dashboard) record(now time.Time) {
	s := sampleTables(d.cfg.Replica.FSM(), now)
	d.mu.Lock()
	watched := d.streams > 0 || now.Sub(d.watched) < watchedFor
	d.mu.Unlock()
	if watched {
		d.pollQuorum()
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.history[d.next] = s
	d.next = (d.next + 1) % len(d.history)
	d.n = min(d.n+1, len(d.history))
	d.publishLocked()
}

// pollQuorum asks every replica for its status.
func (d *Dashboard) pollQuorum() {
	q := pollQuorum(d.ctx, d.cfg)
	d.mu.Lock()
	defer d.mu.Unlock()
	d.quorum, d.quorumAt = q, time.Now()
	d.publishLocked()
}

func (d *Dashboard) leaderChanged(id string, now time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.leaderSeq++
	d.leaders = append(d.leaders, LeaderChange{Seq: d.leaderSeq, UnixMs: now.UnixMilli(), Leader: id, Term: term(d.cfg.Replica.Raft())})
	if len(d.leaders) > leadersKept {
		d.leaders = d.leaders[len(d.leaders)-leadersKept:]
	}
	d.publishLocked()
}

// publishLocked wakes the open streams; d.mu must be held.
func (d *Dashboard) publishLocked() {
	close(d.published)
	d.published = make(chan struct{})
}

// watch notes that someone watches (streams: one more page connected), and
// has the quorum polled at once when nobody did for a while.
func (d *Dashboard) watch(streams int) {
	d.mu.Lock()
	stale := time.Since(d.quorumAt) > 2*sampleEvery
	d.watched = time.Now()
	d.streams += streams
	d.mu.Unlock()
	if stale {
		select {
		case d.wake <- struct{}{}:
		default:
		}
	}
}

// historyLocked returns the samples, oldest first; d.mu must be held.
func (d *Dashboard) historyLocked() []Sample {
	out := make([]Sample, 0, d.n)
	for k := 0; k < d.n; k++ {
		out = append(out, d.history[(d.next-d.n+k+len(d.history))%len(d.history)])
	}
	return out
}
