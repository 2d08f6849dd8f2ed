package worker

import (
	"slices"
	"sync"

	"google.golang.org/grpc"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// The daemon's automatic prefix caching (issue 25; Config.PrefixCache, the
// -prefix-cache flag). The core decides (worker/core/prefixcache.go): which
// full pages enter the cache under their prefix hash, which requests start
// with cached pages, which unreferenced pages are evicted. The scheduler
// carries it out on the engine (engine.PageSharer): each cached page is
// kept by a holder sequence of its own that holds that one page by
// reference, taken from the request's sequence the page was filled in
// (Output.KVStoredAt) before that sequence is released; a request that
// filled a copy of a page cached meanwhile gives its copy up for the
// cached one (Output.Adopts); a hit shares the holders' pages into the
// request's new, empty sequence (Output.Shares), which computes only the
// rest; an eviction releases the holder, freeing the page once nothing
// else holds it. No KV
// is copied or recomputed, so a hit's tokens and logprobs are those of a
// request computed from scratch, bit for bit (the engines' attention reads
// the same KV in the same order).
//
// The pages cached and every change to them are published to WatchKV's
// streams (kvHub), off the consensus path.

// holderBase is the first holder sequence id: far above the core's (which
// count up from 1).
const holderBase engine.SeqID = 1 << 62

// prefixHolders is the scheduler's holder sequences, by page hash. Owned by
// the scheduler goroutine.
type prefixHolders struct {
	sharer engine.PageSharer
	seqs   map[uint64]engine.SeqID // the holder of each cached page: a sequence of that one page
	next   engine.SeqID
	from   []engine.PageRef // scratch for a share's pages
}

// applyCache carries out o's prefix-cache changes on the engine: the
// stores (while the sequences they were filled in are alive), the adopts,
// then the shares, then the removals. The caller applies o.Release after
// it.
//
// Each holder keeps exactly its one page, so the engine's pages are the
// core's account: a cached page is one engine page whoever filled it, and
// an eviction frees it (unless a request still reads it, which the core
// never evicts).
func (s *scheduler) applyCache(o core.Output) {
	if s.holders == nil {
		return
	}
	h := s.holders
	for i, hash := range o.KVStored {
		at := o.KVStoredAt[i]
		if h.seqs[hash] != 0 {
			continue
		}
		h.next++
		id := holderBase + h.next
		if err := h.sharer.SharePages(id, []engine.PageRef{{Seq: at.Seq, Page: at.Page}}); err != nil {
			s.w.log.Error("could not keep a cached page", "hash", hash, "seq", at.Seq, "page", at.Page, "error", err)
			continue
		}
		h.seqs[hash] = id
	}
	for _, a := range o.Adopts {
		src, ok := h.seqs[a.Hash]
		if !ok {
			s.w.log.Error("a page filled twice has no holder", "hash", a.Hash, "seq", a.Seq, "page", a.Page)
			continue
		}
		if err := h.sharer.AdoptPage(a.Seq, a.Page, engine.PageRef{Seq: src}); err != nil {
			s.w.log.Error("could not give up a page filled twice", "hash", a.Hash, "seq", a.Seq, "page", a.Page, "error", err)
		}
	}
	for _, sh := range o.Shares {
		h.from = h.from[:0]
		for _, hash := range sh.Hashes {
			src, ok := h.seqs[hash]
			if !ok {
				s.w.log.Error("a cache hit's page has no holder", "hash", hash, "seq", sh.Seq)
				break
			}
			h.from = append(h.from, engine.PageRef{Seq: src})
		}
		if len(h.from) < len(sh.Hashes) {
			continue
		}
		if err := h.sharer.SharePages(sh.Seq, h.from); err != nil {
			s.w.log.Error("could not share cached pages", "seq", sh.Seq, "pages", len(sh.Hashes), "error", err)
		}
	}
	for _, hash := range o.KVRemoved {
		if id, ok := h.seqs[hash]; ok {
			s.eng.Release(id)
			delete(h.seqs, hash)
		}
	}
	s.w.metrics.cacheQueries.Add(float64(o.CacheQueryTokens))
	s.w.metrics.cacheHits.Add(float64(o.CacheHitTokens))
	s.w.kv.publish(o.KVStored, o.KVRemoved)
}

// kvWatchBuffer is the messages a WatchKV stream may fall behind by before
// its deltas are dropped for a fresh snapshot.
const kvWatchBuffer = 256

// kvHub is the cached page hashes and the WatchKV streams watching them.
// publish never blocks: a stream whose buffer is full loses its deltas and
// is sent a snapshot (reset) instead.
type kvHub struct {
	mu       sync.Mutex // guards everything below
	cached   map[uint64]struct{}
	watchers map[*kvWatcher]struct{}
}

type kvWatcher struct {
	notify  chan struct{} // cap 1
	pending []kvDelta     // guarded by kvHub.mu
	lost    bool          // a snapshot is due (guarded by kvHub.mu)
}

type kvDelta struct{ stored, removed []uint64 }

func newKVHub() *kvHub {
	return &kvHub{cached: map[uint64]struct{}{}, watchers: map[*kvWatcher]struct{}{}}
}

// publish records stored and removed hashes (in that order) and queues
// them to every watcher.
func (k *kvHub) publish(stored, removed []uint64) {
	if len(stored) == 0 && len(removed) == 0 {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, h := range stored {
		k.cached[h] = struct{}{}
	}
	for _, h := range removed {
		delete(k.cached, h)
	}
	if len(k.watchers) == 0 {
		return
	}
	d := kvDelta{slices.Clone(stored), slices.Clone(removed)}
	for w := range k.watchers {
		if !w.lost {
			if len(w.pending) >= kvWatchBuffer {
				w.pending, w.lost = nil, true
			} else {
				w.pending = append(w.pending, d)
			}
		}
		select {
		case w.notify <- struct{}{}:
		default:
		}
	}
}

// snapshot returns every hash cached now, sorted.
func (k *kvHub) snapshotLocked() []uint64 {
	out := make([]uint64, 0, len(k.cached))
	for h := range k.cached {
		out = append(out, h)
	}
	slices.Sort(out)
	return out
}

// WatchKV implements Inference.WatchKV: a snapshot, then the deltas in
// order; seq numbers this stream's messages from 1 (the snapshot) and
// starts again at 1 with a new incarnation's snapshot. A stream that fell
// more than kvWatchBuffer deltas behind is sent a new snapshot instead of
// them.
func (s *inferenceServer) WatchKV(_ *pb.WatchKVRequest, stream grpc.ServerStreamingServer[pb.KVEvents]) error {
	k := s.w.kv
	wt := &kvWatcher{notify: make(chan struct{}, 1), lost: true}
	k.mu.Lock()
	k.watchers[wt] = struct{}{}
	k.mu.Unlock()
	defer func() {
		k.mu.Lock()
		delete(k.watchers, wt)
		k.mu.Unlock()
	}()
	var seq, inc uint64
	for {
		k.mu.Lock()
		cur := s.w.Incarnation()
		var msgs []*pb.KVEvents
		if wt.lost || cur != inc {
			if cur != inc {
				seq = 0
			}
			inc = cur
			msgs = append(msgs, &pb.KVEvents{Reset_: true, Stored: k.snapshotLocked()})
			wt.lost, wt.pending = false, nil
		}
		for _, d := range wt.pending {
			msgs = append(msgs, &pb.KVEvents{Stored: d.stored, Removed: d.removed})
		}
		wt.pending = nil
		k.mu.Unlock()
		for _, m := range msgs {
			seq++
			m.WorkerId, m.Incarnation, m.Seq, m.PageTokens = s.w.cfg.ID, inc, seq, engine.PageTokens
			if err := stream.Send(m); err != nil {
				return err
			}
		}
		select {
		case <-wt.notify:
		case <-stream.Context().Done():
			return stream.Context().Err()
		case <-s.w.stop:
			return nil
		}
	}
}
