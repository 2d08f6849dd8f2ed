package gateway

// Prefix routing's index (issue 25), off the consensus path. With
// Config.PrefixRouting the gateway follows one WatchKV stream per live
// worker of its load table (phase neither failed nor left), dialled
// through the worker directory as Generate calls are, and keeps what each
// worker's prefix cache holds in a placer.PrefixIndex; placeFast chooses
// a new request's worker by placer's prefix-aware score over it
// (Replica.TakePrefix). Raft carries none of it.
//
// A stream's first message is the worker's snapshot (reset): it replaces
// everything the index held for the worker. Deltas follow, numbered by
// seq within the worker's incarnation; one whose seq is not the next, or
// that names another incarnation, replaces the worker's entries with the
// hashes it stored and the stream is opened again, for a fresh snapshot.
// A stream that breaks keeps the entries until the next stream's snapshot
// replaces them, and is opened again with backoff (the directory is read
// again when no message came, so a worker back on another port is found).
// A worker that leaves the table, fails, or comes back as a new
// incarnation has its entries cleared at once, and a new incarnation gets
// a new stream.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/kvpage"
	"github.com/lumen-project/lumen/internal/placer"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
)

// The backoff between attempts at a worker's stream.
const (
	kvRetryMin = 50 * time.Millisecond
	kvRetryMax = 5 * time.Second
)

// errKVResync ends a stream whose messages skipped one: the next stream's
// snapshot resyncs the worker's entries.
var errKVResync = errors.New("gateway: KV events skipped a sequence number or changed incarnation; resyncing")

// kvWatch is the gateway's index of the workers' prefix caches and the
// streams that feed it.
type kvWatch struct {
	g   *Gateway
	idx *placer.PrefixIndex

	mu      sync.Mutex // guards streams, gen; held while a stream applies to idx
	streams map[string]*kvStream
	gen     uint64

	// messages counts the KV messages applied, resyncs the snapshots and
	// gaps that replaced a worker's entries (tests wait on them).
	messages, resyncs atomic.Uint64
}

// kvStream is the stream of one incarnation of a worker.
type kvStream struct {
	id     string
	inc    uint64
	seen   uint64 // the sync generation that last found it in the table
	cancel context.CancelFunc
}

func newKVWatch(g *Gateway) *kvWatch {
	return &kvWatch{g: g, idx: placer.NewPrefixIndex(), streams: map[string]*kvStream{}}
}

// kvLive: a worker of the table whose cache the gateway follows.
func kvLive(w *pb.WorkerLoad) bool {
	switch w.Phase {
	case pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED, pb.WorkerPhase_WORKER_PHASE_FAILED, pb.WorkerPhase_WORKER_PHASE_LEFT:
		return false
	}
	return true
}

// sync follows the table: a stream for each live worker's incarnation;
// the entries of a worker that left, failed or restarted are cleared.
func (k *kvWatch) sync(t *pb.LoadTable) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.gen++
	for _, w := range t.Workers {
		if !kvLive(w) {
			continue
		}
		s := k.streams[w.WorkerId]
		if s != nil && s.inc == w.Incarnation {
			s.seen = k.gen
			continue
		}
		if s != nil {
			k.stopLocked(s) // a new incarnation: its cache starts empty
		}
		ctx, cancel := context.WithCancel(k.g.ctx)
		s = &kvStream{id: w.WorkerId, inc: w.Incarnation, seen: k.gen, cancel: cancel}
		if !k.g.goFunc(func() { k.run(ctx, s) }) {
			cancel()
			return
		}
		k.streams[w.WorkerId] = s
	}
	for _, s := range k.streams {
		if s.seen != k.gen {
			k.stopLocked(s)
		}
	}
}

// stopLocked ends a stream and clears its worker's entries; k.mu is held,
// so the stream applies nothing after.
func (k *kvWatch) stopLocked(s *kvStream) {
	delete(k.streams, s.id)
	k.idx.Reset(s.id)
	s.cancel()
}

// apply runs f on the index if s is still its worker's stream.
func (k *kvWatch) apply(s *kvStream, f func()) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.streams[s.id] != s {
		return false
	}
	f()
	return true
}

// run follows s's worker until s is stopped or the gateway closes.
func (k *kvWatch) run(ctx context.Context, s *kvStream) {
	retry := kvRetryMin
	for ctx.Err() == nil {
		got, err := k.follow(ctx, s)
		if ctx.Err() != nil {
			return
		}
		if got {
			retry = kvRetryMin
		}
		switch {
		case errors.Is(err, errKVResync):
			// Soon (got reset the backoff): the snapshot is the fix.
			k.g.log.Debug("KV events of a worker skipped a message; resyncing from a new snapshot", "worker", s.id)
		case status.Code(err) == codes.Unimplemented:
			k.g.log.Warn("the worker does not serve WatchKV (an older lumen): no prefix routing to it", "worker", s.id)
			retry = kvRetryMax
		default:
			k.g.log.Debug("KV event stream broke; reconnecting", "worker", s.id, "error", err, "retry", retry)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(retry):
		}
		if !got {
			// Nothing came: the worker may be back on another address.
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			_, _ = k.g.workers.Refresh(rctx)
			cancel()
		}
		retry = min(2*retry, kvRetryMax)
	}
}

// follow opens one stream and applies its messages until it ends; got
// says whether any message came.
func (k *kvWatch) follow(ctx context.Context, s *kvStream) (got bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	cc, err := k.g.workerConn(ctx, s.id)
	if err != nil {
		return false, err
	}
	st, err := pb.NewInferenceClient(cc).WatchKV(ctx, &pb.WatchKVRequest{})
	if err != nil {
		return false, err
	}
	synced, inc, seq := false, uint64(0), uint64(0)
	warned := false
	for {
		m, err := st.Recv()
		if err != nil {
			return got, err
		}
		got = true
		if m.PageTokens != 0 && m.PageTokens != kvpage.Tokens {
			// Hashes over other pages never match the gateway's.
			if !warned {
				warned = true
				k.g.log.Warn("a worker's KV events are over pages of another size: no prefix routing to it",
					"worker", s.id, "page_tokens", m.PageTokens, "gateway_page_tokens", kvpage.Tokens)
			}
			k.apply(s, func() { k.idx.Reset(s.id) })
			continue
		}
		gap := !m.Reset_ && (!synced || m.Incarnation != inc || m.Seq != seq+1)
		if !k.apply(s, func() {
			if m.Reset_ || gap {
				k.idx.Replace(s.id, m.Stored)
				k.resyncs.Add(1)
			} else {
				k.idx.Apply(s.id, m.Stored, m.Removed)
			}
			k.messages.Add(1)
		}) {
			return got, context.Canceled // stopped
		}
		if gap {
			return got, errKVResync
		}
		synced, inc, seq = true, m.Incarnation, m.Seq
	}
}

// promptHashes are the prefix hashes of the full pages of e's prompt the
// worker can reuse (core.PageHashes over all of it but its last token,
// which the worker always computes), made once per request.
func (e *entry) promptHashes() []uint64 {
	if e.hashes == nil && len(e.prompt) > 1 {
		e.hashes = core.PageHashes(e.prompt[:len(e.prompt)-1], nil)
	}
	return e.hashes
}

// placeHashes are the prefix hashes the worker will look up for e's next
// call: its prompt's (promptHashes) while it has streamed nothing or when
// the call regenerates its output (stop-and-restart sends the prompt
// alone), else those of the prompt and every token streamed, all but the
// last token (the worker's lookup: core.lookupHit).
func (e *entry) placeHashes() []uint64 {
	if len(e.out) == 0 || e.regen {
		return e.promptHashes()
	}
	if e.histHashes == nil || e.histOut != len(e.out) {
		h := make([]int32, 0, len(e.prompt)+len(e.out))
		h = append(append(h, e.prompt...), e.out...)
		// Extended: the history only grows.
		e.histHashes, e.histOut = core.PageHashes(h[:len(h)-1], e.histHashes), len(e.out)
	}
	return e.histHashes
}

// recoveryPlanned notes, for the requests in flight a recovery plan
// moves, whether it recomputes them (no checkpoint restore at the target:
// the target is only the freest survivor) and where.
func (g *Gateway) recoveryPlanned(rp *pb.RecoveryPlan) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, a := range rp.Assignments {
		if f := g.flights[a.RequestId]; f != nil {
			f.recomputeOn = ""
			if a.Mode == pb.RecoveryMode_RECOVERY_MODE_RECOMPUTE {
				f.recomputeOn = a.TargetWorker
			}
		}
	}
}

// recomputesAt says the recovery plan that moved e's current attempt to
// pl recomputes it there: a plan the gateway saw (its RecoveryPlan event
// came before the move was acted on) named pl's worker in RECOMPUTE mode.
func (g *Gateway) recomputesAt(e *entry, pl *pb.Placement) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	f := g.flights[e.dispatchID()]
	return f != nil && f.recomputeOn != "" && f.recomputeOn == pl.WorkerId
}

// resumeByPrefix (prefix routing) takes a recovery's move of e to
// planned: where the plan recomputes the request — it names no
// checkpoint to restore, only the freest survivor — and the worker
// Replica.TakePrefix chooses for what the resumed call carries
// (placeHashes; the failed worker excluded) caches more of it than the
// plan's target, the request is placed there instead, under its next
// attempt id, and the planned attempt is completed. Where the plan
// restores a checkpoint (REUSE, a live migration's copy), where its mode
// is not known (the move was read before the plan's event came), or where
// the prefix choice caches no more than the target, the plan stands.
func (g *Gateway) resumeByPrefix(ctx context.Context, e *entry, from string, planned *pb.Placement) (*pb.Placement, *apiError) {
	if g.kv == nil || !g.recomputesAt(e, planned) {
		return planned, nil
	}
	exclude := append(slices.Clone(e.excluded), from)
	probe := fmt.Sprintf("%s~%d", e.id, e.attempt+1)
	hashes := e.placeHashes()
	w, _, ok := g.replica.TakePrefix(probe, uint32(len(e.prompt)), hashes, g.kv.idx, exclude...)
	g.replica.Forget(probe)
	if !ok || w == planned.WorkerId {
		return planned, nil
	}
	// Only for more cache than the target has: moved for a higher score
	// alone, a burst of resumes piles onto the workers the score prefers
	// (the plan spreads them by freeness; in the simulator, resumes twice
	// as slow: docs/benchmarks.md).
	ov := g.kv.idx.Overlaps([]policy.Worker{{ID: w}, {ID: planned.WorkerId}}, hashes, nil)
	if ov[0] <= ov[1] {
		return planned, nil
	}
	left := e.dispatchID()
	settled := slices.Clone(e.unsettled)
	npl, aerr := g.redispatch(ctx, e, false, from)
	if aerr != nil {
		return nil, aerr
	}
	g.metrics.resumes.WithLabelValues("prefix").Inc()
	g.log.Debug("a recomputed resume placed by its cached prefix, not the plan's target", "request", e.id, "planned", planned.WorkerId,
		"placed", npl.WorkerId, "tokens", len(e.out))
	// The plan's placement is left: completed now (its holder's
	// reservation goes back), after the Dispatches of earlier attempts
	// have their answers, as the handler's end does (which completes it
	// again, harmlessly).
	g.goFunc(func() {
		for _, ch := range settled {
			<-ch
		}
		g.completeLater(left)
	})
	return npl, nil
}
