package core

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/lumen-project/lumen/worker/engine"
)

// Live migration (Llumnix), the worker's side: which pages a source sends at
// each stage and when it stops the request, and the destination's
// pre-allocated sequence that receives them and that the request's next
// call adopts. The controller decides that a request moves and commits the
// move; the daemon carries the pages; the decisions are here, so the
// simulator runs the same ones.
//
// # Source
//
// MigrateOut marks a request as migrating under its placement epoch. Each
// NextStage, called when the destination acknowledged the previous one,
// returns the pages to send: the first stage every full page in the cache,
// each next one the pages filled since, while the request keeps decoding.
// When at most Config.MigrationStopPages pages are left to send, or at stage
// Config.MigrationMaxStages, the stage is the last: the request stops (it
// leaves the running set, keeps its sequence, and gets no more steps), and
// the stage carries the rest — the pages filled since, the partial last
// page and the token history. After the commit, CommitOut frees the
// sequence and ends the request's stream with ErrMigrated (the caller tells
// its client where it continues); AbortOut lets it run on, untouched. A
// request that ends, is preempted, cancelled, superseded or handed back
// while migrating ends its migration: Output.MigrationsEnded says so, and
// the caller aborts it with the destination and the controller.
//
// # Destination
//
// AcceptStage takes each stage into a pre-allocated sequence (the first one
// creates it), counting its pages against the free pages less a page of
// headroom per running request, so a migration never squeezes the requests
// already here: a stage that does not fit is refused and the pre-allocation
// freed. A pre-allocation holds a running slot (MaxRunning) from its first
// stage. The caller appends the stage's pages to the sequence. When the
// request's call arrives under a newer placement epoch than the
// migration's (the commit moved the placement here, or a recovery did after
// the source failed), Submit adopts the sequence: after the last stage the
// call continues at once — the tokens the source generated that the call
// did not carry yet are delivered from the stage's history, and only the
// positions not in the cache (the last token) are computed — and before it
// the pages whose prefix hashes match the call's history serve as a
// restored checkpoint. A pre-allocation with no stage (and, after the last,
// no call) for Config.MigrationTimeout is reclaimed by Expire.

// Errors of live migration. The worker maps them to the Migrate stream's
// refusals.
var (
	// ErrMigrated ends a request's stream at its source once its migration
	// committed: it continues at the destination.
	ErrMigrated = errors.New("worker: the request migrated to another worker")
	// ErrNotHere: the request is not here (it ended, or never ran here),
	// or it runs under another placement epoch than the migration's.
	ErrNotHere = errors.New("worker: migration: no such request here under that epoch")
	// ErrMigrating: the request is already migrating.
	ErrMigrating = errors.New("worker: migration: the request is already migrating")
	// ErrScoringPrompt: the request's prompt logprobs are computed with
	// its first token, here; it moves only after.
	ErrScoringPrompt = errors.New("worker: migration: the request's prompt logprobs are not computed yet")
	// ErrMigrationOutOfPages: the destination cannot hold the stage's pages
	// and keep a page of headroom per running request.
	ErrMigrationOutOfPages = errors.New("worker: migration: the destination is out of KV pages")
	// ErrMigrationFull: the destination runs (or has migrating in) as many
	// requests as it may run (MaxRunning).
	ErrMigrationFull = errors.New("worker: migration: the destination runs its most requests")
	// ErrUnknownMigration: the destination holds no pre-allocation for the
	// stage (it was reclaimed after MigrationTimeout, aborted, or adopted).
	ErrUnknownMigration = errors.New("worker: migration: no pre-allocation for this request here")
	// ErrBadStage: a stage out of order, or whose pages disagree with the
	// history of the last stage.
	ErrBadStage = errors.New("worker: migration: bad stage")
	// ErrRunsHere: the destination already runs the request.
	ErrRunsHere = errors.New("worker: migration: the request already runs on the destination")
)

// Defaults of the migration parameters (Llumnix's).
const (
	DefaultMigrationStopPages = 16
	DefaultMigrationMaxStages = 3
	DefaultMigrationTimeout   = 5 * time.Second
)

func (c *Core) stopPages() int {
	if c.cfg.MigrationStopPages > 0 {
		return c.cfg.MigrationStopPages
	}
	return DefaultMigrationStopPages
}

func (c *Core) maxStages() int {
	if c.cfg.MigrationMaxStages > 0 {
		return c.cfg.MigrationMaxStages
	}
	return DefaultMigrationMaxStages
}

func (c *Core) migrationTimeout() time.Duration {
	if c.cfg.MigrationTimeout > 0 {
		return c.cfg.MigrationTimeout
	}
	return DefaultMigrationTimeout
}

// outgoing is a request's migration out.
type outgoing struct {
	epoch   uint64
	stages  int      // stages taken
	sent    int      // full pages taken: [0, sent)
	hashes  []uint64 // prefix hash of each full page, as far as taken
	stopped bool     // the last stage was taken: the request runs no more
	waited  bool     // it was waiting when it stopped
}

// MigrationStage is one stage of a migration out: pages First,
// First+1, … of sequence Seq, to export and send with their prefix hashes.
type MigrationStage struct {
	ID    string
	Epoch uint64
	Seq   engine.SeqID
	Stage int // 1, 2, …
	First int
	// Hashes[i] is the prefix hash of page First+i.
	Hashes []uint64
	// Last: the stop-and-copy. The request has stopped; the stage also
	// carries the partial last page (Tail positions: engine.ExportTail)
	// and the token history. Fed is the positions in the cache.
	Last    bool
	Tail    int
	Fed     int
	History []int32
	// Last: the request's checkpoint holder and the pages queued for it.
	Holder       string
	Checkpointed int
	// Last: what the destination needs to decode the request before its
	// call arrives (the held pre-step, AcceptStage).
	Hold Hold
}

// Hold is what a destination needs to decode a migrated request before
// its call arrives: its prompt's length and output tokens in all, its
// sampling and stop tokens, and whether it asks for logprobs. Prompt 0:
// unknown (no pre-step).
type Hold struct {
	Prompt, MaxTokens int
	Params            engine.Sampling
	Stop              []int32 // sorted
	Logprobs          bool
}

// holdOf is r's Hold.
func holdOf(r *Request) Hold {
	h := Hold{Prompt: r.Prompt, MaxTokens: r.MaxTokens, Params: r.Params, Logprobs: r.Logprobs}
	for tok, ok := range r.Stop {
		if ok {
			h.Stop = append(h.Stop, tok)
		}
	}
	slices.Sort(h.Stop)
	return h
}

// Pages is how many pages the stage sends (the tail's included).
func (s MigrationStage) Pages() int {
	n := len(s.Hashes)
	if s.Tail > 0 {
		n++
	}
	return n
}

// MigrationEnd is an outgoing migration the Core ended: the caller aborts
// it with the destination and the controller.
type MigrationEnd struct {
	ID    string
	Epoch uint64
	Why   string
}

// MigrateOut starts a migration out of request id under placement epoch
// epoch. It fails with ErrNotHere when the request is not here under that
// epoch, ErrMigrating when it already migrates.
func (c *Core) MigrateOut(id string, epoch uint64) error {
	r := c.byID[id]
	if r == nil || r.Epoch != epoch {
		return fmt.Errorf("%w: request %q, epoch %d", ErrNotHere, id, epoch)
	}
	if r.out != nil {
		return fmt.Errorf("%w: request %q since epoch %d", ErrMigrating, id, r.out.epoch)
	}
	if r.PromptLogprobs && r.Outputs() == r.outStart {
		return fmt.Errorf("%w: request %q", ErrScoringPrompt, id)
	}
	r.out = &outgoing{epoch: epoch}
	return nil
}

// NextStage takes the next stage of request id's migration out: every
// full page not sent yet, and, when it is the last, the rest (the request
// stops). Call it between steps, when the destination acknowledged the
// previous stage.
func (c *Core) NextStage(id string, epoch uint64) (MigrationStage, error) {
	r := c.byID[id]
	if r == nil || r.out == nil || r.out.epoch != epoch || r.out.stopped {
		return MigrationStage{}, fmt.Errorf("%w: request %q is not migrating under epoch %d", ErrNotHere, id, epoch)
	}
	if slices.Contains(c.pending.Reqs, r) {
		return MigrationStage{}, fmt.Errorf("core: NextStage for request %q while a step that includes it runs", id)
	}
	o := r.out
	o.stages++
	full := r.fed / engine.PageTokens
	o.hashes = PageHashes(r.History[:full*engine.PageTokens], o.hashes)
	st := MigrationStage{ID: id, Epoch: epoch, Seq: r.seq, Stage: o.stages, First: o.sent, Hashes: o.hashes[o.sent:full]}
	remain := PagesFor(r.fed) - o.sent
	o.sent = full
	if remain <= c.stopPages() || o.stages >= c.maxStages() {
		o.stopped = true
		o.waited = slices.Contains(c.waiting, r)
		c.running = remove(c.running, r)
		c.waiting = remove(c.waiting, r)
		c.stopped = append(c.stopped, r)
		st.Last, st.Tail, st.Fed, st.History = true, r.fed%engine.PageTokens, r.fed, slices.Clone(r.History)
		if r.Holder != "" && r.Holder != c.cfg.Self {
			st.Holder, st.Checkpointed = r.Holder, r.ckptSent
		}
		st.Hold = holdOf(r)
	}
	c.out.MigrationStages++
	c.out.MigrationPagesOut += st.Pages()
	return st, nil
}

// CommitOut ends request id's migration after the controller committed it:
// its sequence is freed and its stream ends with ErrMigrated. Its
// checkpoint stays with its holder (the request continues elsewhere; the
// holder reconciles). It reports false when the request is no longer
// stopped for this migration (it ended meanwhile).
func (c *Core) CommitOut(id string, epoch uint64) bool {
	r := c.byID[id]
	if r == nil || r.out == nil || r.out.epoch != epoch || !r.out.stopped {
		return false
	}
	delete(c.byID, id)
	c.stopped = remove(c.stopped, r)
	c.unref(r)
	c.out.Release = append(c.out.Release, r.seq)
	c.out.MigratedOut++
	c.event(Event{Req: r, Err: fmt.Errorf("%w (placement epoch %d)", ErrMigrated, epoch)})
	return true
}

// AbortOut ends request id's migration out without moving it: the request
// runs on as if nothing happened (a stopped one goes back where it was). It
// reports whether there was such a migration.
func (c *Core) AbortOut(id string, epoch uint64) bool {
	r := c.byID[id]
	if r == nil || r.out == nil || r.out.epoch != epoch {
		return false
	}
	if r.out.stopped {
		c.stopped = remove(c.stopped, r)
		if r.out.waited {
			c.requeueFront(r)
		} else {
			c.addRunning(r)
		}
	}
	r.out = nil
	return true
}

// Migrating reports whether request id migrates out, and whether it has
// stopped.
func (c *Core) Migrating(id string) (migrating, stopped bool) {
	r := c.byID[id]
	if r == nil || r.out == nil {
		return false, false
	}
	return true, r.out.stopped
}

// endOut ends r's migration out, if any, because r leaves (why).
func (c *Core) endOut(r *Request, why string) {
	if r.out == nil {
		return
	}
	if r.out.stopped {
		c.stopped = remove(c.stopped, r)
	}
	c.out.MigrationsEnded = append(c.out.MigrationsEnded, MigrationEnd{ID: r.ID, Epoch: r.out.epoch, Why: why})
	r.out = nil
}

// incoming is a destination's pre-allocation for a request migrating in.
type incoming struct {
	id      string
	epoch   uint64
	seq     engine.SeqID
	stages  int
	pages   int      // pages held, the tail's included
	fed     int      // positions held
	hashes  []uint64 // prefix hash of each full page held
	last    bool     // the last stage arrived
	history []int32  // the last stage's token history
	// holder has the first checkpointed pages of the request (the last
	// stage says).
	holder       string
	checkpointed int
	at           time.Time
	// redispatch: the request was queued at its source (one last stage,
	// no pages); its call queues here.
	redispatch bool
	// held decodes the request after the last stage, before its call
	// (nil: it does not, or no more).
	held *Request
}

// IncomingStage is a stage as the destination receives it (the fields of
// MigrationStage the wire carries).
type IncomingStage struct {
	ID      string
	Epoch   uint64
	Stage   int
	First   int
	Hashes  []uint64
	Last    bool
	Tail    int
	History []int32
	// Last: the source's checkpoint holder and the pages it sent there.
	Holder       string
	Checkpointed int
	// Last: the request's parameters, for the held pre-step.
	Hold Hold
}

func (s IncomingStage) pages() int {
	n := len(s.Hashes)
	if s.Tail > 0 {
		n++
	}
	return n
}

func (c *Core) findIncoming(id string) (int, *incoming) {
	for i, in := range c.incoming {
		if in.id == id {
			return i, in
		}
	}
	return -1, nil
}

// dropIncoming frees pre-allocation i.
func (c *Core) dropIncoming(i int) {
	c.unhold(c.incoming[i])
	c.out.Release = append(c.out.Release, c.incoming[i].seq)
	c.incoming = slices.Delete(c.incoming, i, i+1)
}

// AcceptStage takes a stage of a request migrating in at time now, given
// the engine's free pages, and returns the sequence to append its pages to
// (engine.AppendPages). The first stage creates the pre-allocation. A
// refused stage changes nothing, except that a stage that does not fit
// (ErrMigrationOutOfPages) or is out of order (ErrBadStage) frees the
// pre-allocation: the migration is over.
func (c *Core) AcceptStage(now time.Time, s IncomingStage, free int) (engine.SeqID, error) {
	if _, runs := c.byID[s.ID]; runs {
		return 0, fmt.Errorf("%w: request %q", ErrRunsHere, s.ID)
	}
	i, in := c.findIncoming(s.ID)
	switch {
	case in != nil && in.epoch > s.Epoch:
		return 0, fmt.Errorf("%w: request %q migrates in under epoch %d, the stage carries %d", ErrStaleEpoch, s.ID, in.epoch, s.Epoch)
	case s.Stage == 1 && in != nil:
		c.dropIncoming(i) // a migration begun again
		in = nil
	case s.Stage > 1 && in == nil:
		return 0, fmt.Errorf("%w: request %q, stage %d", ErrUnknownMigration, s.ID, s.Stage)
	case s.Stage > 1 && in.epoch != s.Epoch:
		return 0, fmt.Errorf("%w: request %q migrates in under epoch %d, the stage carries %d", ErrUnknownMigration, s.ID, in.epoch, s.Epoch)
	}
	bad := func(format string, args ...any) (engine.SeqID, error) {
		if in != nil {
			i, _ := c.findIncoming(s.ID)
			c.dropIncoming(i)
		}
		return 0, fmt.Errorf("%w: request %q: %s", ErrBadStage, s.ID, fmt.Sprintf(format, args...))
	}
	if in != nil && (in.last || s.Stage != in.stages+1 || s.First != len(in.hashes)) {
		return bad("stage %d from page %d after %d stages and %d pages", s.Stage, s.First, in.stages, len(in.hashes))
	}
	if in == nil && (s.Stage != 1 || s.First != 0) {
		return bad("the first stage is %d from page %d", s.Stage, s.First)
	}
	if s.Tail < 0 || s.Tail >= engine.PageTokens || (s.Tail > 0 && !s.Last) {
		return bad("a tail of %d positions on a stage that is last=%v", s.Tail, s.Last)
	}
	// A request queued at its source (no cache: one last stage of no
	// pages) is a re-dispatch: its call queues here as a dispatch's
	// does, and it holds no running slot meanwhile.
	redispatch := in == nil && s.Last && s.pages() == 0
	if in == nil && !redispatch && c.slots() >= c.cfg.MaxRunning {
		return 0, fmt.Errorf("%w: request %q: %d requests run, %d stand stopped for their migration out and %d migrate in, the most this worker runs is %d",
			ErrMigrationFull, s.ID, len(c.running), len(c.stopped), len(c.incoming), c.cfg.MaxRunning)
	}
	headroom := len(c.running)
	if need := s.pages(); need > free-headroom {
		if in != nil {
			i, _ := c.findIncoming(s.ID)
			c.dropIncoming(i)
		}
		return 0, fmt.Errorf("%w: stage %d of request %q needs %d pages; %d are free and %d kept for the running requests' decodes",
			ErrMigrationOutOfPages, s.Stage, s.ID, need, free, headroom)
	}
	if in == nil {
		c.nextSeq++
		in = &incoming{id: s.ID, epoch: s.Epoch, seq: c.nextSeq, redispatch: redispatch}
		c.incoming = append(c.incoming, in)
	}
	hashes := append(slices.Clip(in.hashes), s.Hashes...)
	if s.Last {
		fed := len(hashes)*engine.PageTokens + s.Tail
		if len(s.History) <= fed || !slices.Equal(PageHashes(s.History[:len(hashes)*engine.PageTokens], nil), hashes) {
			return bad("the pages do not match the history of %d tokens", len(s.History))
		}
		in.last, in.history = true, s.History
		in.holder, in.checkpointed = s.Holder, min(max(s.Checkpointed, 0), len(hashes))
	}
	in.stages++
	in.hashes = hashes
	in.pages += s.pages()
	in.fed = len(hashes)*engine.PageTokens + s.Tail
	in.at = now
	c.out.MigrationPagesIn += s.pages()
	if s.Last {
		c.hold(now, in, s.Hold)
	}
	return in.seq, nil
}

// DefaultMigrationHoldTokens is the most tokens a destination decodes for a
// migrated request before its call arrives (Config.MigrationHoldTokens).
const DefaultMigrationHoldTokens = 8

func (c *Core) holdTokens() int {
	if c.cfg.MigrationHoldTokens != 0 {
		return c.cfg.MigrationHoldTokens
	}
	return DefaultMigrationHoldTokens
}

// hold starts the held pre-step of a pre-allocation whose last stage
// arrived: the request joins the next step as a running one would, and the
// tokens it samples wait in the pre-allocation's history for the call,
// whose adoption delivers them at once (adopt). The switch then costs the
// client no step at the destination: the call, which the commit and the
// gateway bring about a step later, finds its next token computed (or
// being computed: it takes the row over). Greedy or seeded, a token is a
// function of the history and its output index, so the held tokens are
// those the source would have produced. No pre-step for a request whose
// parameters the stage did not carry (an older source), one that asks for
// logprobs (the call recomputes the tokens it lacks with theirs), one with
// no cache (a re-dispatch) or one already at its end.
func (c *Core) hold(now time.Time, in *incoming, h Hold) {
	if c.holdTokens() < 0 || h.Prompt <= 0 || h.Logprobs || in.fed == 0 || in.fed != len(in.history)-1 ||
		len(in.history)-h.Prompt >= h.MaxTokens || h.Prompt > len(in.history) {
		return
	}
	r := &Request{ID: in.id, Epoch: in.epoch, History: slices.Clone(in.history), Prompt: h.Prompt, MaxTokens: h.MaxTokens,
		Params: h.Params, Arrived: now, seq: in.seq, fed: in.fed, hashes: in.hashes, restoreTried: true, holding: in, held: true}
	if len(h.Stop) > 0 {
		r.Stop = make(map[int32]bool, len(h.Stop))
		for _, tok := range h.Stop {
			r.Stop[tok] = true
		}
		if r.Stop[r.History[len(r.History)-1]] && len(r.History) > h.Prompt {
			return // it ended at the source
		}
	}
	r.outStart = r.Outputs()
	in.held = r
	c.held = append(c.held, r)
}

// unhold ends in's pre-step, if any: the request is no longer scheduled
// here until its call.
func (c *Core) unhold(in *incoming) {
	if in.held == nil {
		return
	}
	c.held = remove(c.held, in.held)
	in.held.holding = nil
	in.held = nil
}

// heldDone takes the token a held request's step sampled into its
// pre-allocation, and ends the pre-step at the request's end or after
// holdTokens tokens.
func (c *Core) heldDone(r *Request, tok int32) {
	in := r.holding
	r.History = append(r.History, tok)
	in.history, in.fed, in.pages = r.History, r.fed, PagesFor(r.fed)
	in.hashes = PageHashes(r.History[:r.fed], in.hashes)
	r.hashes = in.hashes
	c.out.HeldTokens++
	if r.Stop[tok] || r.Outputs() >= r.MaxTokens || r.Outputs()-r.outStart >= c.holdTokens() {
		c.unhold(in)
	}
}

// AbortIn frees request id's pre-allocation (the source aborted, or the
// pages could not be appended). It reports whether there was one under
// that epoch.
func (c *Core) AbortIn(id string, epoch uint64) bool {
	i, in := c.findIncoming(id)
	if in == nil || in.epoch != epoch {
		return false
	}
	c.dropIncoming(i)
	return true
}

// Incoming is how many pre-allocations the destination holds.
func (c *Core) Incoming() int { return len(c.incoming) }

// IncomingPages is the pages the pre-allocation for request id holds.
func (c *Core) IncomingPages(id string) int {
	if _, in := c.findIncoming(id); in != nil {
		return in.pages
	}
	return 0
}

// slots is the running slots (Config.MaxRunning) taken: the running
// requests, those stopped for their migration's commit (an abort puts one
// back in the running set: its slot must still be there), and the
// pre-allocations of migrations in (the adoption puts the request in the
// running set), but for re-dispatches (a re-dispatched call queues).
func (c *Core) slots() int {
	n := len(c.running) + len(c.stopped)
	for _, in := range c.incoming {
		if !in.redispatch {
			n++
		}
	}
	return n
}

// Stopped is how many requests stand stopped for the commit of their
// migration out.
func (c *Core) Stopped() int { return len(c.stopped) }

// Expire reclaims the pre-allocations that got no stage (nor, after the
// last, their call) for MigrationTimeout before now; it returns how many.
func (c *Core) Expire(now time.Time) int {
	n := 0
	for i := 0; i < len(c.incoming); {
		if in := c.incoming[i]; !now.Before(in.at.Add(c.migrationTimeout())) {
			c.dropIncoming(i)
			c.out.MigrationsReclaimed++
			n++
			continue
		}
		i++
	}
	return n
}

// NextExpiry is when the oldest pre-allocation expires; false for none.
func (c *Core) NextExpiry() (time.Time, bool) {
	var at time.Time
	for _, in := range c.incoming {
		if t := in.at.Add(c.migrationTimeout()); at.IsZero() || t.Before(at) {
			at = t
		}
	}
	return at, !at.IsZero()
}

// adopt gives r, a call arriving under a newer epoch than in's migration,
// in's pre-filled sequence, and reports whether r runs at once. After the
// last stage, when r's history is a prefix of the migrated one, the whole
// cache is adopted and the tokens r lacks are delivered from the migrated
// history; otherwise the pages whose prefix hashes match r's history are
// kept as a restored checkpoint and the rest of it is prefilled.
func (c *Core) adopt(r *Request, i int, in *incoming) bool {
	held := in.held
	c.unhold(in)
	c.incoming = slices.Delete(c.incoming, i, i+1)
	h := r.History
	if in.last && len(h) <= len(in.history) && slices.Equal(h, in.history[:len(h)]) && in.fed > 0 {
		r.seq, r.fed, r.hashes, r.restoreTried = in.seq, in.fed, in.hashes, true
		lacking := in.history[len(h):]
		if r.Logprobs && len(lacking) > 0 {
			// The source computed the tokens r lacks, and their logprobs
			// did not travel with the cache: the cache is cut back to
			// before them and they are computed again here (the same
			// tokens: the logits are a function of the history).
			r.fed = min(in.fed, len(h)-1)
			r.hashes = in.hashes[:min(len(in.hashes), r.fed/engine.PageTokens)]
			if r.fed < in.fed {
				c.out.Truncates = append(c.out.Truncates, Truncate{Seq: in.seq, Len: r.fed})
				c.out.RecomputedTokens += in.fed - r.fed
			}
			lacking = nil
		}
		if r.Holder != "" && r.Holder == in.holder {
			r.ckptSent = min(in.checkpointed, len(r.hashes)) // the holder has them already
		}
		r.started = r.Arrived
		c.out.MigratedIn++
		c.addRunning(r)
		for _, tok := range lacking {
			if c.commit(r.Arrived, r, tok, nil) {
				return true // the held pre-step decoded the request to its end
			}
		}
		// A step in flight that computes the held request's next token
		// computes the call's: it takes the row over (the simulator's
		// calls can arrive mid-step; the worker's come between steps).
		if held != nil && slices.Equal(r.History, held.History) {
			if k := slices.Index(c.pending.Reqs, held); k >= 0 {
				c.pending.Reqs[k] = r
			}
		}
		return true
	}
	k := 0
	if len(h) > 1 {
		want := PageHashes(h[:len(h)-1], nil)
		for k < len(in.hashes) && k < len(want) && in.hashes[k] == want[k] {
			k++
		}
	}
	if k == 0 {
		c.out.Release = append(c.out.Release, in.seq)
		return false
	}
	fed := k * engine.PageTokens
	c.out.Truncates = append(c.out.Truncates, Truncate{Seq: in.seq, Len: fed})
	r.seq, r.fed, r.hashes, r.restoreTried = in.seq, fed, in.hashes[:k], true
	r.started = r.Arrived
	c.out.RestoredPages += k
	c.out.RecomputedTokens += len(h) - fed
	c.addRunning(r)
	return true
}
