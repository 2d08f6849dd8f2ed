package core

import (
	"slices"

	"github.com/lumen-project/lumen/worker/engine"
)

// Drafter is the drafter's side of progressive recovery as a deterministic
// state machine: it keeps, for each request its target mirrors, the
// committed history, a line of draft tokens beyond it and a draft-model
// sequence caching the line; it runs the draft model one token at a time
// ahead of the target, and truncates its cache at the first draft the
// target did not commit, then replays from the target's token.
//
// The protocol mirrors Core's: Apply mirror updates and SetK; Next(free)
// returns a batch for the draft engine (one chunk per request that wants
// more drafts, sampling one token); run it; Done(out); then Output():
// sequences to release and truncate, and the drafts to send.
//
// Drafts never hold the target up: the target verifies whatever drafts have
// arrived when its step starts. The drafter keeps a lookahead of 2K+1
// tokens, so that after a step that accepts everything the next step still
// finds K drafts (the K accepted, the target's own token, then K more).
type Drafter struct {
	reqs    map[string]*draftReq
	ids     []string // sorted
	k       int
	budget  int
	maxCtx  int // the draft engine's context (0: unbounded)
	nextSeq engine.SeqID

	pending []*draftReq
	queued  []MirrorUpdate // updates that came while a step ran
	batch   []engine.Chunk
	out     DrafterOutput
}

// DraftBudget caps the tokens one draft step feeds (a new request's
// history is prefilled into the draft cache in chunks of it).
const DraftBudget = 2048

// draftReq is one request the drafter follows. Its line is the committed
// history, as mirrored, then the drafts beyond it; updates and drafts
// extend it in place (a request's updates cost what they carry, not its
// history's length).
type draftReq struct {
	id   string
	line []int32 // line[:n] committed, line[n:] drafts
	n    int
	seq  engine.SeqID
	fed  int // positions of line in the draft cache
}

func (r *draftReq) hist() []int32   { return r.line[:r.n] }
func (r *draftReq) drafts() []int32 { return r.line[r.n:] }

// Draft is a drafter's proposal for request ID: tokens for history
// positions Base, Base+1, … (what Core.OfferDrafts takes).
type Draft struct {
	ID     string
	Base   int
	Tokens []int32
}

// DraftStep is one draft-engine call: Batch[i] is request IDs[i]'s chunk;
// Pos[i] the history position of the token it samples.
type DraftStep struct {
	Batch []engine.Chunk
	IDs   []string
	Pos   []int
}

// DrafterOutput is what the Drafter's state changes ask of the caller, in
// order: release and truncate draft sequences, send the drafts.
type DrafterOutput struct {
	Release   []engine.SeqID
	Truncates []Truncate
	Drafts    []Draft
	// DraftSteps and Drafted count the draft engine's work.
	DraftSteps, Drafted int
}

// NewDrafter returns an empty Drafter drafting k tokens per request.
func NewDrafter(k int) *Drafter {
	d := &Drafter{reqs: map[string]*draftReq{}, budget: DraftBudget}
	d.SetK(k)
	return d
}

// SetK sets the drafts the target verifies per step (0: stop drafting),
// at most MaxSpecK: the target takes no longer line.
func (d *Drafter) SetK(k int) { d.k = min(max(k, 0), MaxSpecK) }

// SetMaxContext sets the draft engine's context (engine.Info.MaxContext):
// a request drafts no position beyond it. The target's requests fit its
// own context, but the lookahead runs up to 2K+1 positions past their
// history: a step that went past the draft's context would fail, and with
// it the drafts of every request in it, at every retry. 0: unbounded.
func (d *Drafter) SetMaxContext(n int) { d.maxCtx = max(n, 0) }

// K is the drafts per step the target asked for.
func (d *Drafter) K() int { return d.k }

// Requests is how many requests the drafter follows.
func (d *Drafter) Requests() int { return len(d.reqs) }

// Output returns what the changes since the last call ask for.
func (d *Drafter) Output() DrafterOutput {
	o := d.out
	d.out = DrafterOutput{}
	return o
}

// Apply takes one mirror update from the target. While a draft step runs
// (between Next and Done) updates wait and apply at Done.
func (d *Drafter) Apply(u MirrorUpdate) {
	if len(d.pending) > 0 {
		u.Tokens = slices.Clone(u.Tokens)
		d.queued = append(d.queued, u)
		return
	}
	r := d.reqs[u.ID]
	if u.Ended {
		if r != nil {
			d.drop(r)
		}
		return
	}
	known := 0
	if r != nil {
		known = r.n
	}
	if u.From > known {
		return // a gap: cannot happen on one ordered stream; ignore
	}
	if r == nil {
		d.nextSeq++
		r = &draftReq{id: u.ID, seq: d.nextSeq}
		d.reqs[u.ID] = r
		i, _ := slices.BinarySearch(d.ids, u.ID)
		d.ids = slices.Insert(d.ids, i, u.ID)
	}
	// The new history is line[:From] then the update's tokens; p is the
	// longest prefix of the line it agrees with.
	hist := u.From + len(u.Tokens)
	p := u.From
	for p < hist && p < len(r.line) && u.Tokens[p-u.From] == r.line[p] {
		p++
	}
	// What of the cache stays valid: all of the line when the target
	// committed a prefix of it (the drafts past it stand), else the tokens
	// up to the first the target did not commit.
	valid := len(r.line)
	if p < hist {
		r.line = append(r.line[:p], u.Tokens[p-u.From:]...)
		valid = p
	}
	r.n = hist
	if r.fed > valid {
		r.fed = valid
		d.out.Truncates = append(d.out.Truncates, Truncate{Seq: r.seq, Len: valid})
	}
}

func (d *Drafter) drop(r *draftReq) {
	delete(d.reqs, r.id)
	if i, ok := slices.BinarySearch(d.ids, r.id); ok {
		d.ids = slices.Delete(d.ids, i, i+1)
	}
	d.out.Release = append(d.out.Release, r.seq)
	// A cut queued for it names a sequence the release frees first.
	d.out.Truncates = slices.DeleteFunc(d.out.Truncates, func(t Truncate) bool { return t.Seq == r.seq })
}

// Reset drops every request (the pairing ended), with the updates of the
// old pairing's stream still queued behind a running step. Called between
// Next and Done, the step's sequences are released too: apply Output after
// Done, when the engine has run the step.
func (d *Drafter) Reset() {
	for _, id := range slices.Clone(d.ids) {
		d.drop(d.reqs[id])
	}
	d.queued = nil
}

// lookahead is the drafts kept beyond the committed history: at most
// MaxDraftTokens.
func (d *Drafter) lookahead() int {
	if d.k == 0 {
		return 0
	}
	return 2*d.k + 1
}

// Next returns the next draft step: for each request (in id order) with
// fewer drafts than the lookahead, its unfed tokens (a prefill of the
// history, or the last draft), sampling the next draft — as far as the
// token budget and free pages go. An empty step: nothing to draft.
func (d *Drafter) Next(free int) DraftStep {
	st := DraftStep{Batch: d.batch[:0]}
	d.pending = d.pending[:0]
	if len(d.queued) > 0 { // a step was abandoned (the caller's engine failed)
		q := d.queued
		d.queued = nil
		for _, u := range q {
			d.Apply(u)
		}
	}
	budget := d.budget
	want := d.lookahead()
	for _, id := range d.ids {
		r := d.reqs[id]
		if r.n == 0 || len(r.line)-r.n >= want {
			continue
		}
		n := len(r.line) - r.fed
		if n <= 0 || (d.maxCtx > 0 && len(r.line) > d.maxCtx) {
			continue // drafted up to the context
		}
		n = min(n, budget)
		need := PagesFor(r.fed+n) - PagesFor(r.fed)
		if n <= 0 || need > free {
			continue
		}
		sample := 0
		if r.fed+n == len(r.line) {
			sample = 1
		}
		st.Batch = append(st.Batch, engine.Chunk{Seq: r.seq, Tokens: r.line[r.fed : r.fed+n], Sample: sample})
		st.IDs = append(st.IDs, id)
		st.Pos = append(st.Pos, r.fed+n)
		d.pending = append(d.pending, r)
		budget -= n
		free -= need
		if budget == 0 {
			break
		}
	}
	d.batch = st.Batch
	return st
}

// Done takes the draft engine's tokens for the step Next returned.
func (d *Drafter) Done(out [][]int32) {
	d.out.DraftSteps++
	for i, r := range d.pending {
		if d.reqs[r.id] != r {
			continue // dropped meanwhile
		}
		r.fed += len(d.batch[i].Tokens)
		if len(out[i]) == 0 {
			continue
		}
		r.line = append(r.line, out[i][0])
		d.out.Drafted++
		d.out.Drafts = append(d.out.Drafts, Draft{ID: r.id, Base: r.n, Tokens: slices.Clone(r.drafts())})
	}
	d.pending = d.pending[:0]
	q := d.queued
	d.queued = nil
	for _, u := range q {
		d.Apply(u)
	}
}

// CachedPages is the draft cache's pages in use.
func (d *Drafter) CachedPages() int {
	n := 0
	for _, r := range d.reqs {
		n += PagesFor(r.fed)
	}
	return n
}
