package sim

import (
	"time"

	"github.com/lumen-project/lumen/internal/placer"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
)

// Prefix caching and prefix-aware placement (issue 25) in the simulator:
// the workers' cores cache pages by prefix hash (Config.PrefixCache), each
// core's KV events feed an index of what each worker holds, and with
// Config.PrefixRouting the dispatch names the worker placer.PickPrefix
// chooses from the fsm's load views and that index. The index is updated
// the moment the core reports (a real gateway's lags by its event stream).

// prefixIndex returns the index, made on first use.
func (s *Sim) prefixIndex() *placer.PrefixIndex {
	if s.pidx == nil {
		s.pidx = placer.NewPrefixIndex()
	}
	return s.pidx
}

// cacheEvents takes a core Output's KV events into the index and its hit
// counters into the result.
func (s *Sim) cacheEvents(w *simWorker, o *core.Output) {
	s.res.CacheQueryTokens += o.CacheQueryTokens
	s.res.CacheHitTokens += o.CacheHitTokens
	if o.CacheQueryTokens > 0 {
		k := int(s.now / time.Second)
		for len(s.res.CacheQueries) <= k {
			s.res.CacheQueries = append(s.res.CacheQueries, 0)
			s.res.CacheHits = append(s.res.CacheHits, 0)
		}
		s.res.CacheQueries[k] += o.CacheQueryTokens
		s.res.CacheHits[k] += o.CacheHitTokens
	}
	if len(o.KVStored) > 0 || len(o.KVRemoved) > 0 {
		s.prefixIndex().Apply(w.id, o.KVStored, o.KVRemoved)
	}
}

// prefixRoute names d's serving worker: the eligible worker of the fsm's
// load views with the best placer.PrefixScore for r's prompt.
func (s *Sim) prefixRoute(r *simRequest, d *pb.DispatchCmd) {
	views, _ := s.fsm.LoadViews()
	if len(views) == 0 {
		return
	}
	p := r.w.AppendPrompt(make([]int32, 0, r.w.PromptLen()))
	hashes := core.PageHashes(p, nil)
	s.overlapBuf = s.prefixIndex().Overlaps(views, hashes, s.overlapBuf)
	i := placer.PickPrefix(views, s.overlapBuf)
	if i < 0 {
		return // Apply refuses it as it would any dispatch
	}
	w := s.worker(views[i].ID)
	if w == nil {
		return
	}
	d.WorkerId, d.WorkerIncarnation = w.id, w.inc
}
