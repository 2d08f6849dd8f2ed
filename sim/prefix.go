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
// load views with the best placer.PrefixScore for the page hashes of
// what the call carries (callHashes).
func (s *Sim) prefixRoute(d *pb.DispatchCmd, hashes []uint64) {
	if w, _, _ := s.prefixChoice(hashes, ""); w != nil {
		d.WorkerId, d.WorkerIncarnation = w.id, w.inc
	}
}

// prefixChoice is the worker placer.PickPrefix chooses for hashes over
// the fsm's load views and the index, nil for none (Apply then refuses
// the dispatch, as it would any), with how many of hashes its cache holds
// and how many worker other's does.
func (s *Sim) prefixChoice(hashes []uint64, other string) (w *simWorker, overlap, otherOverlap int) {
	views, _ := s.fsm.LoadViews()
	if len(views) == 0 {
		return nil, 0, 0
	}
	s.overlapBuf = s.prefixIndex().Overlaps(views, hashes, s.overlapBuf)
	i := placer.PickPrefix(views, s.overlapBuf)
	if i < 0 {
		return nil, 0, 0
	}
	for j := range views {
		if views[j].ID == other {
			otherOverlap = s.overlapBuf[j]
		}
	}
	return s.worker(views[i].ID), s.overlapBuf[i], otherOverlap
}

// callHashes are the page hashes of what r's next call carries: the
// prompt and the tokens streamed so far, or the prompt alone when the
// call regenerates them (regen) or none were streamed. Over all of it,
// as the simulator's placement always was (the gateway leaves the last
// token out, as the worker's lookup does: at most one page apart, where
// the history fills its last page).
func (s *Sim) callHashes(r *simRequest, regen bool) []uint64 {
	h := r.w.AppendPrompt(make([]int32, 0, r.w.PromptLen()+r.out))
	if !regen {
		for k := range r.out {
			h = append(h, token(r.idx, k))
		}
	}
	return core.PageHashes(h, nil)
}

// prefixResume is the gateway's resumeByPrefix (gateway/kvwatch.go): an
// interrupted request that its recovery plan moved to pl in RECOMPUTE
// mode (no checkpoint restored there: the target is the freest survivor)
// is placed instead, under its next attempt id, on the worker the prefix
// score chooses for what its call carries, when that worker's cache holds
// more of it than the target's; the plan's attempt is completed. It
// reports whether it did; the caller resumes r at pl otherwise. Not with
// PlanResumes (the ablation).
func (s *Sim) prefixResume(r *simRequest, pl *pb.Placement) bool {
	if !s.cfg.PrefixRouting || s.cfg.PlanResumes || r.recomputeOn == "" || r.recomputeOn != pl.WorkerId {
		return false
	}
	regen := s.cfg.Strategy.Regenerates() && r.out > 0
	w, overlap, planned := s.prefixChoice(s.callHashes(r, regen), pl.WorkerId)
	if w == nil || w.id == pl.WorkerId || overlap <= planned {
		// Moved for no more cache than the target has, a burst of
		// resumes would pile onto the workers the score prefers (the
		// plan spreads them by freeness): the plan stands.
		return false
	}
	s.res.PrefixResumes++
	s.complete(r.id)
	delete(s.byID, r.id)
	r.attempt++
	r.recomputeOn = ""
	r.id = dispatchID(r)
	s.byID[r.id] = r
	d := &pb.DispatchCmd{RequestId: r.id, PromptTokens: uint32(r.w.PromptLen()), MaxTokens: uint32(r.w.Output), Priority: s.priority(r),
		WorkerId: w.id, WorkerIncarnation: w.inc}
	s.applyDispatch(r, d, s.resume)
	return true
}
