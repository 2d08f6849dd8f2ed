package worker

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// event is one message to a request's stream.
type event struct {
	resp *pb.GenerateResponse
	err  error // terminal error
}

// mailbox carries a request's events from the scheduler to its stream
// without ever blocking the scheduler.
type mailbox struct {
	mu     sync.Mutex // guards events
	events []event
	notify chan struct{} // buffered 1
}

func newMailbox() *mailbox { return &mailbox{notify: make(chan struct{}, 1)} }

func (m *mailbox) put(e event) {
	m.mu.Lock()
	m.events = append(m.events, e)
	m.mu.Unlock()
	select {
	case m.notify <- struct{}{}:
	default:
	}
}

func (m *mailbox) take() []event {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := m.events
	m.events = nil
	return out
}

// request is a Generate call as the handler built it. The scheduler
// goroutine turns it into the core's request on submission; only it
// touches the request after that.
type request struct {
	id        string
	epoch     uint64  // the placement epoch the call was made for
	history   []int32 // prompt, then every output token
	prompt    int     // prompt length
	outStart  int     // output tokens that arrived already generated
	maxTokens int     // total output tokens
	params    engine.Sampling
	stop      map[int32]bool
	// logprobs: each token goes out with its logprobs and the
	// topLogprobs most likely tokens at its position.
	logprobs    bool
	topLogprobs int
	// promptLogprobs: the first token goes out with the prompt's
	// logprobs (echo), topLogprobs alternatives each.
	promptLogprobs bool
	priority       int32 // core.Request.Priority
	arrived        time.Time
	lastToken      time.Time
	box            *mailbox

	holder   string
	reserved uint64 // the request's reserved footprint on the holder
	// replicas are the checkpoint's further copies (issue 24): every page
	// the core exports for holder also goes to each, and so do releases.
	replicas []string

	cr *core.Request // set by the scheduler on submission
	// moved is where the request continues after its migration out
	// committed; set by the scheduler before the core ends the request.
	moved *pb.Placement

	// The preemption loss (lumen_worker_preemption_loss_seconds): kvFed
	// is the KV positions its cache held after its last step; preempted
	// when its cache was last dropped (zero: it holds what it held), and
	// fedAtPreempt what it held then.
	kvFed        int
	preempted    time.Time
	fedAtPreempt int
}

// scheduler drives the worker's scheduling core (package core) with the wall
// clock and the engine: it feeds the core the calls that arrive and end,
// runs the steps it builds, and carries out what the core asks for (stream
// events, sequence releases, checkpoint pages for holders).
type scheduler struct {
	w   *Worker
	eng engine.Engine
	cfg *Config

	submit chan *request
	cancel chan *request // a call that ended: drop its request if still its own
	reset  chan error    // end every request with this error (the worker rejoined)
	stop   chan struct{}
	done   chan struct{}
	// assist attaches and detaches a drafter's stream; drafts carries its
	// drafts (assist.go).
	assist chan assistCtl
	drafts chan draftOffer
	// calls run on the scheduler goroutine between steps (do): live
	// migration's stages (migrate.go).
	calls chan func()

	// core, sess and mirror are owned by run.
	core   *core.Core
	sess   *assistSession // the drafter assisting, or nil
	mirror core.Mirror    // what sess has been sent
	// holders keeps the prefix cache's pages (prefixcache.go); nil with
	// the cache off.
	holders *prefixHolders

	// stepEnd is when the last engine step returned, zero once the loop
	// waited for work since (lumen_worker_step_gap_seconds_total).
	stepEnd time.Time

	// stats is read by the load reporter.
	statsMu sync.Mutex // guards stats
	stats   schedStats
}

type schedStats struct {
	running, waiting int
	// stopped: requests stopped for their migration's commit; incoming:
	// pre-allocations of migrations in.
	stopped, incoming int
	queueHeadPages    int
	queuedPages       int // core.QueuedPages (LoadRecord.queued_pages)
	// highPriority: the running and waiting requests of high priority.
	highPriority int
	// queued: the waiting requests with no KV cache (core.AppendQueued).
	queued []string
	waits  core.WaitWindow // prefill-start waits
}

// storeView is the checkpoint store as the core reads it.
type storeView struct{ s *ckptStore }

func (v storeView) Prefix(hashes []uint64) [][]byte { return v.s.prefix(hashes) }

func (v storeView) Holds(id string) bool {
	_, _, ok := v.s.stored(id)
	return ok
}

func newScheduler(w *Worker) *scheduler {
	c := core.New(core.Config{Self: w.cfg.ID, TokenBudget: w.cfg.TokenBudget, MaxRunning: w.cfg.MaxRunning,
		MaxWaiting: w.cfg.MaxWaiting, TotalPages: w.cfg.Engine.Info().TotalPages, MigrationTimeout: w.cfg.MigrationTimeout,
		Preemption: w.cfg.Preemption, PrefixCache: w.cfg.PrefixCache},
		storeView{w.store})
	s := &scheduler{w: w, eng: w.cfg.Engine, cfg: &w.cfg, submit: make(chan *request, 256), cancel: make(chan *request, 256),
		reset: make(chan error), stop: make(chan struct{}), done: make(chan struct{}), assist: make(chan assistCtl),
		drafts: make(chan draftOffer, 64), calls: make(chan func(), 16), core: c}
	if w.cfg.PrefixCache {
		// Validate checked that the engine shares pages.
		s.holders = &prefixHolders{sharer: w.cfg.Engine.(engine.PageSharer), seqs: map[uint64]engine.SeqID{}}
	}
	return s
}

func (s *scheduler) run() {
	defer close(s.done)
	ctx := context.Background()
	for {
		if s.core.Idle() || s.core.Stalled() {
			// A pre-allocation for a migration in expires even when
			// nothing runs. Stalled: the queue waits for pages or slots
			// that requests stopped for their migration's commit or
			// migrations in hold; a call, a cancel or the expiry frees
			// them.
			s.stepEnd = time.Time{} // waiting for work is not the host's step time
			var expiry <-chan time.Time
			var timer *time.Timer
			if at, ok := s.core.NextExpiry(); ok {
				timer = time.NewTimer(time.Until(at))
				expiry = timer.C
			}
			select {
			case <-expiry:
			case f := <-s.calls:
				f()
			case r := <-s.submit:
				s.admit(r)
			case r := <-s.cancel:
				s.dropIfCurrent(r)
			case err := <-s.reset:
				s.failAll(err)
			case c := <-s.assist:
				s.assistControl(c)
			case o := <-s.drafts:
				s.offerDrafts(o)
			case <-s.stop:
				s.failAll(errShutdown)
				return
			}
			if timer != nil {
				timer.Stop()
			}
		}
		s.drainIntake()
		s.expire()
		s.publishStats()
		select {
		case <-s.stop:
			s.failAll(errShutdown)
			return
		default:
		}
		if s.core.Idle() {
			continue
		}
		s.step(ctx)
		s.publishStats()
	}
}

func (s *scheduler) drainIntake() {
	for {
		select {
		case r := <-s.submit:
			s.admit(r)
		case r := <-s.cancel:
			s.dropIfCurrent(r)
		case err := <-s.reset:
			s.failAll(err)
		case c := <-s.assist:
			s.assistControl(c)
		case o := <-s.drafts:
			s.offerDrafts(o)
		case f := <-s.calls:
			f()
		default:
			return
		}
	}
}

func (s *scheduler) admit(r *request) {
	r.cr = &core.Request{ID: r.id, Epoch: r.epoch, History: r.history, Prompt: r.prompt, MaxTokens: r.maxTokens,
		Params: r.params, Stop: r.stop, Logprobs: r.logprobs, TopLogprobs: r.topLogprobs, PromptLogprobs: r.promptLogprobs, Priority: r.priority, Holder: r.holder, Reserved: r.reserved, Arrived: r.arrived, Sink: r}
	s.core.Submit(r.cr)
	s.apply()
	s.w.metrics.waiting.Set(float64(s.core.Waiting()))
}

// setHolder sets the holder of the request running under id and epoch
// (core.SetHolder), with the footprint the controller reserved on the
// holder: policy.Footprint of the call's prompt and max tokens and this
// worker's capacity c, as newRequest computes it for a call that names its
// holder.
// replicasOf is the further checkpoint copies of the call r (its Sink).
func replicasOf(r *core.Request) []string {
	if r == nil {
		return nil
	}
	if rq, ok := r.Sink.(*request); ok {
		return rq.replicas
	}
	return nil
}

// queueCopies queues a page for the first copy's sender and each further
// copy's (one bounded queue per holder; never blocking), in step as the
// simulator sends them: the page goes to every copy or, while the queue of
// a copy whose stream works is full, to none — the request falls behind
// and the page is offered again after the next step — so the live copies
// hold the same prefix and the recovery plan's choice among them loses no
// pages. A copy whose holder cannot be reached (its sender's last send
// failed: it may be dead, and the controller drops its copy when it is) does
// not hold the others back: it gets the page if its queue has room. With
// one copy this is the single queue's rule: full, the page waits.
func (s *scheduler) queueCopies(first *ckptSender, replicas []string, job ckptJob) bool {
	if len(replicas) == 0 {
		select {
		case first.jobs <- job:
			return true
		default:
			return false
		}
	}
	snds := make([]*ckptSender, 0, 1+len(replicas))
	snds = append(snds, first)
	for _, h := range replicas {
		snds = append(snds, s.w.sender(h))
	}
	room := 0
	for _, snd := range snds {
		// This goroutine is every queue's only producer: room seen here
		// stays until the sends below.
		full := len(snd.jobs) == cap(snd.jobs)
		if !full {
			room++
		} else if !snd.down.Load() {
			return false
		}
	}
	if room == 0 {
		return false
	}
	for _, snd := range snds {
		select {
		case snd.jobs <- job:
		default: // an unreachable holder's full queue: its copy misses the page
			s.w.metrics.ckptDropped.Inc()
		}
	}
	return true
}

func (s *scheduler) setHolder(id string, epoch uint64, holder string, replicas []string, c *pb.Capacity) bool {
	r := s.core.Lookup(id)
	if r == nil {
		return false
	}
	reserved := policy.Footprint(uint32(r.Prompt), uint32(r.MaxTokens), c.MaxContextTokens, c.KvBytesPerToken)
	if !s.core.SetHolder(id, epoch, holder, reserved) {
		return false
	}
	if rq, ok := r.Sink.(*request); ok {
		rq.replicas = replicas
	}
	return true
}

// dropIfCurrent drops r when it is still the request under its id (a newer
// call may have taken the id over).
func (s *scheduler) dropIfCurrent(r *request) {
	if r.cr != nil {
		s.core.Cancel(r.cr)
		s.apply()
	}
}

// failAll hands every request back with err; they keep their checkpoints.
func (s *scheduler) failAll(err error) {
	s.core.HandBack(err)
	s.apply()
}

// step runs the core's next step on the engine.
func (s *scheduler) step(ctx context.Context) {
	for {
		st := s.core.Next(time.Now(), s.eng.FreePages())
		s.apply()
		if len(st.Batch) == 0 {
			return
		}
		imp := time.Now()
		if !s.restore(st) {
			if !s.stepEnd.IsZero() {
				s.stepEnd = s.stepEnd.Add(time.Since(imp)) // the failed imports are not the host's gap either
			}
			continue
		}
		start := time.Now()
		if !s.stepEnd.IsZero() {
			// The host's time since the last step (its tokens, the
			// checkpoint pages, this batch), less the KV imports, which
			// are the engine's (paced as such).
			s.w.metrics.stepGap.Add(max(imp.Sub(s.stepEnd), 0).Seconds())
		}
		out, err := s.eng.Forward(ctx, st.Batch)
		s.stepEnd = time.Now()
		if err != nil {
			if errors.Is(err, engine.ErrOutOfPages) {
				s.w.metrics.stepOutOfPages.Inc()
			}
			retry := s.core.StepFailed(err)
			s.apply()
			if retry {
				continue
			}
			return
		}
		s.w.metrics.stepSeconds.Observe(s.stepEnd.Sub(start).Seconds())
		s.w.metrics.batchRows.Observe(float64(rows(st.Batch)))
		s.core.Done(time.Now(), out)
		s.apply()
		s.refilled(st)
		s.afterStep()
		return
	}
}

// notePreempted finds the requests the core just preempted: a call whose
// cache held positions after its last step and holds none now. The loss
// runs from the first preemption until the cache holds again what it held
// (a request preempted again before that keeps its first time).
func (s *scheduler) notePreempted() {
	now := time.Now()
	for _, cr := range s.core.Requests() {
		r, ok := cr.Sink.(*request)
		if !ok || r.cr != cr || cr.Fed() != 0 || r.kvFed == 0 {
			continue
		}
		if r.preempted.IsZero() {
			r.preempted, r.fedAtPreempt = now, r.kvFed
		} else {
			r.fedAtPreempt = max(r.fedAtPreempt, r.kvFed)
		}
		r.kvFed = 0
	}
}

// refilled notes the KV positions of the step's requests and observes the
// preemption loss of those whose cache is back to what it held when they
// were preempted (Llumnix's preemption loss: the wait for the re-prefill
// plus the recompute; sim's refilled, the same rule).
func (s *scheduler) refilled(st core.Step) {
	for _, cr := range st.Reqs {
		r, ok := cr.Sink.(*request)
		if !ok || r.cr != cr {
			continue
		}
		r.kvFed = cr.Fed()
		if !r.preempted.IsZero() && r.kvFed >= r.fedAtPreempt {
			s.w.metrics.preemptionLoss.Observe(time.Since(r.preempted).Seconds())
			r.preempted = time.Time{}
		}
	}
}

// restore imports the step's checkpointed prefixes; false when one failed
// (the core recomputes that request; the step is rebuilt).
func (s *scheduler) restore(st core.Step) bool {
	for _, rs := range st.Restores {
		var err error
		if rs.Cached > 0 {
			// The sequence starts with the cached pages (shared in
			// apply): the checkpoint's follow them.
			err = s.eng.AppendPages(rs.Seq, rs.Pages, nil, 0)
		} else {
			err = s.eng.ImportPages(rs.Seq, rs.Pages)
		}
		if err != nil {
			s.core.RestoreFailed(rs.Req)
			s.apply()
			return false
		}
		s.w.store.release(rs.Req.ID) // consumed: the request runs here now
		s.w.metrics.restoredReqs.Inc()
	}
	return true
}

func rows(b []engine.Chunk) int {
	n := 0
	for _, c := range b {
		n += len(c.Tokens)
	}
	return n
}

// apply carries out what the core's last calls asked for.
func (s *scheduler) apply() {
	o := s.core.Output()
	s.applyCache(o)
	for _, seq := range o.Release {
		s.eng.Release(seq)
	}
	// A verification's rejected drafts leave the cache before any of its
	// pages is exported to a holder.
	for _, tr := range o.Truncates {
		if err := s.eng.Truncate(tr.Seq, tr.Len); err != nil {
			s.w.log.Error("could not truncate a sequence after a verification", "seq", tr.Seq, "len", tr.Len, "error", err)
		}
	}
	for _, ev := range o.Events {
		s.deliver(ev)
	}
	var behind *core.Request
	for _, p := range o.Checkpoints {
		if p.Req == behind {
			continue
		}
		job := ckptJob{req: p.Req.ID, reserved: p.Reserved, seq: p.Seq, page: p.Page, hash: p.Hash}
		if !s.queueCopies(s.w.sender(p.Holder), replicasOf(p.Req), job) {
			// A holder is slow: this checkpoint falls behind.
			s.core.CheckpointBehind(p.Req, p.Page)
			behind = p.Req
		}
	}
	for _, rel := range o.CheckpointReleases {
		s.w.sender(rel.Holder).release(rel.RequestID)
		for _, h := range replicasOf(rel.Req) {
			s.w.sender(h).release(rel.RequestID)
		}
	}
	if len(o.Waits) > 0 {
		for _, w := range o.Waits {
			s.w.metrics.queueDelay.Observe(w.Wait.Seconds())
		}
		s.statsMu.Lock()
		s.stats.waits.Add(o.Waits...)
		s.statsMu.Unlock()
	}
	for _, e := range o.MigrationsEnded {
		s.w.migrationEnded(e)
	}
	s.w.metrics.countMigrations(o)
	s.w.metrics.preemptions.Add(float64(o.Preemptions))
	if o.Preemptions > 0 {
		s.notePreempted()
	}
	s.w.metrics.completed.Add(float64(o.Completed))
	s.w.metrics.restoredPages.Add(float64(o.RestoredPages))
	s.w.metrics.resumeCached.Add(float64(o.ResumeCachedPages))
	s.w.metrics.recomputed.Add(float64(o.RecomputedTokens))
	if o.Verifications > 0 {
		s.w.metrics.specDrafts.Add(float64(o.DraftTokens))
		s.w.metrics.specAccepted.Add(float64(o.AcceptedTokens))
		s.w.metrics.specVerifies.Add(float64(o.Verifications))
	}
}

// deliver puts one core event into its request's mailbox.
func (s *scheduler) deliver(ev core.Event) {
	r := ev.Req.Sink.(*request)
	if errors.Is(ev.Err, core.ErrMigrated) && r.moved != nil {
		r.box.put(event{resp: &pb.GenerateResponse{Moved: r.moved}})
		return
	}
	if ev.Err != nil {
		r.box.put(event{err: ev.Err})
		return
	}
	if ev.First {
		// From the call's arrival to now, when the token goes out: an
		// adopted call's first tokens were computed before it came (the
		// core stamps them with its arrival) and go out at the step
		// boundary that adopts it.
		s.w.metrics.ttft.Observe(time.Since(r.arrived).Seconds())
	} else {
		s.w.metrics.tpot.Observe(ev.Latency.Seconds())
	}
	resp := &pb.GenerateResponse{Token: ev.Token, Index: uint32(ev.Index), PromptTokens: uint32(ev.Req.Prompt)}
	if lp := ev.Logprobs; lp != nil {
		resp.Logprob = lp.Logprob
		resp.TopLogprobs = make([]*pb.TokenLogprob, len(lp.Top))
		for i, t := range lp.Top {
			resp.TopLogprobs[i] = &pb.TokenLogprob{Token: t.Token, Logprob: t.Logprob}
		}
	}
	if ev.PromptLogprobs != nil {
		resp.PromptLogprobs = make([]*pb.PromptLogprob, len(ev.PromptLogprobs))
		for i, lp := range ev.PromptLogprobs {
			pl := &pb.PromptLogprob{Logprob: lp.Logprob, TopLogprobs: make([]*pb.TokenLogprob, len(lp.Top))}
			for j, t := range lp.Top {
				pl.TopLogprobs[j] = &pb.TokenLogprob{Token: t.Token, Logprob: t.Logprob}
			}
			resp.PromptLogprobs[i] = pl
		}
	}
	switch ev.Finish {
	case core.FinishStop:
		resp.Done, resp.FinishReason = true, pb.FinishReason_FINISH_REASON_STOP
	case core.FinishLength:
		resp.Done, resp.FinishReason = true, pb.FinishReason_FINISH_REASON_LENGTH
	}
	r.box.put(event{resp: resp})
}

func (s *scheduler) publishStats() {
	running, waiting, head := s.core.Running(), s.core.Waiting(), s.core.HeadPages()
	s.statsMu.Lock()
	s.stats.running, s.stats.waiting, s.stats.queueHeadPages = running, waiting, head
	s.stats.stopped, s.stats.incoming = s.core.Stopped(), s.core.Incoming()
	s.stats.highPriority = s.core.HighPriority()
	s.stats.queuedPages = s.core.QueuedPages()
	s.stats.queued = s.core.AppendQueued(s.stats.queued[:0], maxQueuedReported)
	s.statsMu.Unlock()
	s.w.metrics.migrationsLive.WithLabelValues("in").Set(float64(s.core.Incoming()))
	// The reporter checks the load after every step, as the simulator's
	// does (it reports only when the rule says so; a kick pending is not
	// queued twice): the pages a step filled count at once, not at the
	// next tick.
	s.w.kickLoad()
	s.w.metrics.running.Set(float64(running))
	s.w.metrics.waiting.Set(float64(waiting))
}

// maxQueuedReported caps LoadRecord.queued.
const maxQueuedReported = 512

// highPriority is the running and waiting requests of high priority as of
// the last publishStats (LoadRecord.high_priority).
func (s *scheduler) highPriority() int {
	s.statsMu.Lock()
	defer s.statsMu.Unlock()
	return s.stats.highPriority
}

// queuedPages is the KV pages the waiting requests need as of the last
// publishStats (LoadRecord.queued_pages).
func (s *scheduler) queuedPages() int {
	s.statsMu.Lock()
	defer s.statsMu.Unlock()
	return s.stats.queuedPages
}

// snapshot returns the load figures, q_w over the window and a copy of the
// queued ids.
func (s *scheduler) snapshot(window time.Duration) (running, waiting, headPages int, qw float64, queued []string) {
	s.statsMu.Lock()
	defer s.statsMu.Unlock()
	qw = s.stats.waits.Mean(time.Now(), window)
	return s.stats.running, s.stats.waiting, s.stats.queueHeadPages, qw, slices.Clone(s.stats.queued)
}

// do runs f on the scheduler goroutine between steps and waits for it; it
// reports false when the scheduler stopped (or ctx ended) before f ran.
func (s *scheduler) do(ctx context.Context, f func()) bool {
	ran := make(chan struct{})
	select {
	case s.calls <- func() { f(); close(ran) }:
	case <-s.done:
		return false
	case <-ctx.Done():
		return false
	}
	select {
	case <-ran:
		return true
	case <-s.done:
		// It stopped with f queued: f may have run before.
		select {
		case <-ran:
			return true
		default:
			return false
		}
	}
}

// expire reclaims the pre-allocations of migrations in whose timeout
// passed.
func (s *scheduler) expire() {
	if s.core.Incoming() == 0 {
		return
	}
	if n := s.core.Expire(time.Now()); n > 0 {
		s.w.log.Info("reclaimed the pages of migrations in that got no stage (or call) within the migration timeout",
			"migrations", n, "timeout", s.w.cfg.MigrationTimeout)
		s.apply()
	}
}

// busy is the requests that hold this worker: running, waiting, stopped
// for a migration's commit, and migrating in.
func (s *scheduler) busy() int {
	s.statsMu.Lock()
	defer s.statsMu.Unlock()
	return s.stats.running + s.stats.waiting + s.stats.stopped + s.stats.incoming
}
