package core

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/lumen-project/lumen/internal/kvpage"
	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/engine"
)

// Errors a request can end with. The worker maps them to gRPC codes.
var (
	// ErrQueueFull: the waiting queue is at MaxWaiting.
	ErrQueueFull = errors.New("worker: waiting queue full")
	// ErrTooLarge refuses a call, at Submit, whose prompt and output
	// (every position up to its last token: MaxPages) need more KV pages
	// than the engine has (Config.TotalPages): alone, it would run out of
	// pages before its last token and be preempted forever.
	ErrTooLarge = errors.New("worker: request does not fit in the KV cache")
	// ErrSuperseded ends a call whose request id came in again on a new
	// call.
	ErrSuperseded = errors.New("worker: a newer call for this request id took it over")
	// ErrStaleEpoch refuses a call whose placement epoch is older than the
	// one the request runs under here: it comes from before a move (a
	// gateway that read a lagging replica) and must not take over.
	ErrStaleEpoch = errors.New("worker: stale call: the request runs here under a newer placement epoch")
	// ErrPromptUnscored ends a request that asked for its prompt's
	// logprobs and reached its first token without every prompt position
	// scored (a prefill that skipped some: none should).
	ErrPromptUnscored = errors.New("worker: the prompt's logprobs were not all computed")
)

// Config is a Core's fixed parameters.
type Config struct {
	// Self is this worker's id: a request whose holder is Self is not
	// checkpointed.
	Self string
	// TokenBudget caps the tokens one step computes (prefill chunks plus
	// decodes). MaxRunning caps the running requests, MaxWaiting the
	// waiting queue. All >= 1.
	TokenBudget, MaxRunning, MaxWaiting int
	// TotalPages is the engine's KV pages: Submit refuses a call whose
	// MaxPages exceed them (ErrTooLarge). 0: unknown, nothing is refused
	// at Submit (a head that cannot fit even when the Core holds nothing
	// is refused by Next).
	TotalPages int
	// Live migration (migrate.go): a stage is the last (stop-and-copy)
	// when at most MigrationStopPages pages are left to send (default 16)
	// or at stage MigrationMaxStages (default 3); a destination's
	// pre-allocation that gets no stage for MigrationTimeout (and, after
	// the last, no call) is reclaimed (default 5 s). Zero takes the default.
	MigrationStopPages int
	MigrationMaxStages int
	MigrationTimeout   time.Duration
	// MigrationHoldTokens is the most tokens a destination decodes for a
	// migrated request after its last stage, before its call arrives (the
	// held pre-step; default DefaultMigrationHoldTokens, negative: none).
	MigrationHoldTokens int
	// Preemption is what a running request whose next chunk gets no KV
	// page does (Next): PreemptWait, lumen's default, or PreemptVLLM.
	Preemption Preemption
	// PrefixCache turns on automatic prefix caching (prefixcache.go):
	// full pages shared by prefix hash across requests, kept when
	// unreferenced and evicted least recently released first. Only for an
	// engine that shares pages between sequences (the simulator's).
	PrefixCache bool
}

// Preemption is a rule for a running request short of a KV page.
type Preemption int

const (
	// PreemptWait is lumen's rule: the request sits the step out, its
	// cache kept, while the older requests run; the newest running
	// request is preempted (by recompute) only when none of them can
	// run. On Qwen3-32B/H100, where the KV cache binds at about 19
	// requests, it sustains 20–25% more throughput than vLLM's rule
	// (docs/calibration.md, "Engine defaults"): a victim of vLLM's is
	// usually the newest request, still prefilling a long prompt, whose
	// thousands of tokens are computed again.
	PreemptWait Preemption = iota
	// PreemptVLLM is vLLM's scheduler's: the request preempts the newest
	// running request, by recompute, until its chunk fits or it is itself
	// the newest (Next).
	PreemptVLLM
)

// ParsePreemption reads a rule's name: wait or vllm.
func ParsePreemption(s string) (Preemption, error) {
	switch s {
	case "wait":
		return PreemptWait, nil
	case "vllm":
		return PreemptVLLM, nil
	}
	return 0, fmt.Errorf("preemption %q: wait (a request short of a page sits the step out; lumen's) or vllm (it preempts the newest running request, by recompute)", s)
}

// String is the rule's name.
func (p Preemption) String() string {
	if p == PreemptVLLM {
		return "vllm"
	}
	return "wait"
}

// Store is the worker's checkpoint store as the Core sees it: the pages it
// holds of other workers' requests, by prefix hash.
type Store interface {
	// Prefix returns the pages of the longest run of hashes, from the
	// first, that the store holds. The Core only counts them; the caller
	// imports them.
	Prefix(hashes []uint64) [][]byte
	// Holds reports whether the store holds pages of request id: this
	// worker is its checkpoint holder, so a call for it resumes an
	// interrupted request, even one that had produced no token yet (its
	// worker failed while prefilling the prompt).
	Holds(id string) bool
}

// Request is one Generate call. The caller fills the exported fields and
// hands it to Submit; after that only the Core changes it.
type Request struct {
	ID    string
	Epoch uint64 // the placement epoch the call was made for
	// History is the prompt, then every output token so far (a resumed
	// call arrives with the tokens already generated).
	History   []int32
	Prompt    int // prompt length
	MaxTokens int // total output tokens
	Params    engine.Sampling
	Stop      map[int32]bool
	// Logprobs asks for each token's log probabilities (Event.Logprobs),
	// with the TopLogprobs most likely tokens at its position.
	Logprobs    bool
	TopLogprobs int
	// PromptLogprobs asks for the prompt's logprobs (echo with logprobs):
	// each prompt token's log probability at its position, with the
	// TopLogprobs most likely tokens, on the first token's Event. The
	// prompt is then prefilled in full by this call: no restore from a
	// checkpoint, and no migration out before its first token.
	PromptLogprobs bool
	// Priority orders the request against the others here (issue 23),
	// vLLM's convention: a lower value is more urgent, 0 the default. The
	// waiting queue is in priority order (within one priority, resumes
	// first, then arrival), the running set too (within one priority, in
	// admission order), so the most urgent are admitted and stepped first,
	// the victims of a preemption are the newest of the least urgent, and
	// a waiting request may take the place of less urgent running ones
	// (makeRoom). Outputs do not depend on it.
	Priority int32
	// Holder is the checkpoint holder ("" for none) and Reserved the
	// request's reserved footprint there.
	Holder   string
	Reserved uint64
	Arrived  time.Time
	// Sink is the caller's handle for the request's stream; the Core never
	// looks at it.
	Sink any

	outStart int // output tokens that arrived already generated
	// resume: the call continues an interrupted request (Submit): it came
	// with output tokens, or this worker holds its checkpoint.
	resume       bool
	seq          engine.SeqID
	fed          int // history tokens in the KV cache
	started      time.Time
	lastToken    time.Time
	hashes       []uint64 // prefix hash of each full page in the cache
	ckptSent     int      // pages queued for the holder
	restoreTried bool
	// Drafts offered for history positions draftBase, draftBase+1, …
	// (speculation); verifyBuf is the verification chunk's tokens.
	draftBase int
	drafts    []int32
	verifyBuf []int32
	lpBuf     []engine.Logprobs // the engine's logprob slots (Logprobs)
	// promptLPs[p] is prompt token p's logprobs (PromptLogprobs; slot 0,
	// the first token's, stays empty); scoredTo the prompt positions
	// scored from the first on: the targets of positions 0 … scoredTo−1.
	promptLPs []engine.Logprobs
	scoredTo  int
	out       *outgoing // its migration out (migrate.go), or nil
	// A destination's held pre-step (migrate.go): holding is the
	// pre-allocation whose request this is, until its call adopts it or
	// the pre-step ends; held marks such a request for good.
	holding *incoming
	held    bool
	// The prefix cache (prefixcache.go): hashes[:cached] are pages the
	// request references in it; lookup the hashes of History[:len−1]
	// its admission looks up.
	cached int
	lookup []uint64
	// queuedPages is the pages r needs to start, set as it enters the
	// waiting queue (QueuedPages).
	queuedPages int
}

// logprobSlots returns n slots for the engine to fill with r's logprobs,
// or nil when r does not ask for them.
func (r *Request) logprobSlots(n int) []engine.Logprobs {
	if !r.Logprobs || n == 0 {
		return nil
	}
	r.lpBuf = slices.Grow(r.lpBuf[:0], n)[:n]
	clear(r.lpBuf)
	return r.lpBuf
}

// MaxPages is the KV pages the request holds at its longest: every
// position up to its last token, which is sampled but never fed (nor are
// drafts past it verified).
func (r *Request) MaxPages() int {
	return PagesFor(max(len(r.History), r.Prompt+r.MaxTokens-1))
}

// Outputs is the number of output tokens so far.
func (r *Request) Outputs() int { return len(r.History) - r.Prompt }

// Seq is the engine sequence the request's KV cache lives in.
func (r *Request) Seq() engine.SeqID { return r.seq }

// Fed is how many history tokens are in the KV cache.
func (r *Request) Fed() int { return r.fed }

// Finish says why a request's last token was its last.
type Finish int

// Finish reasons.
const (
	FinishNone   Finish = iota // more tokens come
	FinishStop                 // a stop token
	FinishLength               // MaxTokens reached
)

// Event is one message to a request's stream: a token, or a terminal error.
type Event struct {
	Req    *Request
	Err    error // terminal: the request ended with it; nothing else is set
	Token  int32
	Index  int // output index of Token
	Finish Finish
	// First is set on the first token this call produced; Latency is the
	// time since arrival for it (TTFT), since the previous token otherwise.
	First   bool
	Latency time.Duration
	// At is when the token was committed: the end of the step that
	// sampled it (Done's now; AdvanceRow's step times).
	At time.Time
	// Logprobs are Token's log probabilities when the request asks for
	// them (Request.Logprobs), computed in the step that produced it.
	Logprobs *engine.Logprobs
	// PromptLogprobs, on the first token of a request that asks for them
	// (Request.PromptLogprobs), are prompt tokens 1 … Prompt−1's.
	PromptLogprobs []engine.Logprobs
}

// CheckpointPage is a full KV page to ship to a request's holder.
type CheckpointPage struct {
	Req      *Request
	Holder   string
	Reserved uint64
	Seq      engine.SeqID
	Page     int
	Hash     uint64
}

// CheckpointRelease asks a holder to drop a request's pages; Req is the
// call that sent them (the daemon's further copies hang off its Sink).
type CheckpointRelease struct {
	Holder, RequestID string
	Req               *Request
}

// Wait is one request's wait from arrival to its first prefill chunk.
type Wait struct {
	At   time.Time
	Wait time.Duration
}

// Restore is a checkpointed prefix to import into a request's new, empty
// sequence before the step runs.
type Restore struct {
	Req    *Request
	Seq    engine.SeqID
	Pages  [][]byte // as the Store returned them
	Hashes []uint64
	// Cached is the pages Seq starts with from the prefix cache (its
	// Output's Shares): Pages follow them (engine.AppendPages).
	Cached int
}

// Step is one engine call: Batch[i] is Reqs[i]'s chunk. Its slices are
// valid until the next call to Next.
type Step struct {
	Restores []Restore
	Batch    []engine.Chunk
	Reqs     []*Request
}

// Shape is what the step costs on a GPU: decoding rows, the widest
// verification (drafts per row) and prefill tokens (engine.BatchShape). On
// a GPU the fused pass runs every decoding row at K+1 positions, padding
// the rows without drafts (their outputs discarded); the CPU engine skips
// the padding, the timing model charges it.
func (st Step) Shape() (rows, specK, prefill int) { return engine.BatchShape(st.Batch) }

// Output is what the Core's state changes ask the caller to do, in order.
// Its slices are valid until the next call into the Core.
type Output struct {
	// Release are engine sequences to free, before anything else.
	Release []engine.SeqID
	// Truncates cut sequences back to the positions that hold accepted
	// tokens (a verification's rejected drafts), before any checkpoint
	// page is exported.
	Truncates []Truncate
	// Events go to the requests' streams.
	Events []Event
	// Checkpoints are pages to queue for holders; CheckpointReleases tell
	// holders to drop a request's pages.
	Checkpoints        []CheckpointPage
	CheckpointReleases []CheckpointRelease
	// Waits are the prefill-start waits recorded (for q_w).
	Waits []Wait
	// Counters since the last Output. ResumeCachedPages: pages a resumed
	// request found in the prefix cache (reused as restored pages are,
	// and not imported).
	Preemptions, Completed, RestoredPages, RecomputedTokens, ResumeCachedPages int
	// Speculation: drafts verified and accepted, verification rows.
	DraftTokens, AcceptedTokens, Verifications int
	// MigrationsEnded are migrations out the Core ended (the request left):
	// abort them with the destination and the controller.
	MigrationsEnded []MigrationEnd
	// Live migration: stages taken and pages in them (out), pages accepted
	// (in), migrations committed out and adopted in, pre-allocations
	// reclaimed.
	MigrationStages, MigrationPagesOut, MigrationPagesIn, MigratedOut, MigratedIn, MigrationsReclaimed int
	// HeldTokens: tokens the held pre-step sampled for migrations in.
	HeldTokens int
	// The prefix cache (Config.PrefixCache): the hashes of the pages
	// that entered it and of those evicted from it (KV events, in order),
	// and the history tokens of the requests admitted with an empty
	// cache and how many of them the cache held (vLLM's prefix cache
	// queries and hits).
	KVStored, KVRemoved              []uint64
	CacheQueryTokens, CacheHitTokens int
	// For an engine that keeps cached pages itself (the daemon):
	// KVStoredAt[i] is the sequence and page index KVStored[i] was filled
	// in (the sequence is alive until this Output's Release is applied),
	// Adopts are pages a request filled while another's copy entered the
	// cache first (both prefilled the same prefix at once): the request
	// gives its copy up for the cached one, which the accounting counts
	// once. Shares are the requests admitted with a hit, whose new, empty
	// sequences must start with the cached pages by reference before the
	// step runs. Apply the stores, then the adopts, then the shares, then
	// the removals, then Release.
	KVStoredAt []PageAt
	Adopts     []Adopt
	Shares     []Share
}

// Adopt asks that page Page of sequence Seq, filled with the prefix the
// page cached under Hash holds, be replaced by the cached page.
type Adopt struct {
	Seq  engine.SeqID
	Page int
	Hash uint64
}

// PageAt is page Page of sequence Seq.
type PageAt struct {
	Seq  engine.SeqID
	Page int
}

// Share asks that the new sequence Seq start with the cached pages whose
// hashes are Hashes, in order (its history's first len(Hashes) pages).
type Share struct {
	Seq    engine.SeqID
	Hashes []uint64
}

// Truncate cuts sequence Seq back to its first Len positions.
type Truncate struct {
	Seq engine.SeqID
	Len int
}

// Core is the scheduling state of one worker. It is not safe for
// concurrent use.
type Core struct {
	cfg   Config
	store Store

	waiting []*Request
	running []*Request // in admission order
	byID    map[string]*Request
	// stopped are requests whose migration out took its last stage: they
	// hold their sequence until the commit (migrate.go).
	stopped []*Request
	// incoming are the destination's pre-allocations, in arrival order;
	// held the requests of those that decode before their call (the held
	// pre-step), in the order their last stages arrived.
	incoming []*incoming
	held     []*Request
	nextSeq  engine.SeqID
	noAdmit  bool // the last step ran out of pages: rebuild without admitting
	stalled  bool // the last Next admitted and built nothing (Stalled)
	pending  Step // the step Next returned, until Done or StepFailed
	spec     spec // speculative verification (spec.go)

	// Buffers a Step's slices are cut from.
	batchBuf   []engine.Chunk
	reqsBuf    []*Request
	restoreBuf []Restore
	availBuf   []int // specK's drafts per row, reused

	out Output
	// lastOut is what the last Output returned, by length, and lastStep
	// the last Step's (their elements are zeroed when reused: Output).
	lastOut  outLens
	lastStep [3]int
	one      [1]*Request // AdvanceRow's checkpoint list

	// pc is the prefix cache (nil: off); released the pages requests
	// outside it freed during this Next.
	pc       *prefixCache
	released int
}

// New returns an empty Core. store may be nil (nothing is restorable).
func New(cfg Config, store Store) *Core {
	c := &Core{cfg: cfg, store: store, byID: map[string]*Request{}}
	if cfg.PrefixCache {
		c.pc = newPrefixCache()
	}
	return c
}

// PagesFor is the KV pages n tokens need.
func PagesFor(n int) int { return kvpage.Pages(n) }

// PageHashes returns the prefix hash of each full page of tokens: hash i
// covers tokens[0 : 16(i+1)], chained page by page (FNV-1a). prev, the
// hashes of a shorter prefix of the same tokens, is extended.
func PageHashes(tokens []int32, prev []uint64) []uint64 {
	out := prev
	if n := len(tokens)/kvpage.Tokens - len(prev); n > 0 {
		out = slices.Grow(out, n)
	}
	for i := len(prev); (i+1)*kvpage.Tokens <= len(tokens); i++ {
		// FNV-1a over the previous page's hash (8 bytes, little endian)
		// and each token (4 bytes, little endian): hash/fnv's New64a fed
		// those bytes, without a hasher and an interface call a token.
		h := uint64(fnvOffset64)
		if i > 0 {
			h = fnvBytes(h, out[i-1], 8)
		}
		for _, t := range tokens[i*kvpage.Tokens : (i+1)*kvpage.Tokens] {
			h = fnvBytes(h, uint64(uint32(t)), 4)
		}
		out = append(out, h)
	}
	return out
}

const (
	fnvOffset64 = 14695981039346656037
	fnvPrime64  = 1099511628211
)

// fnvBytes is FNV-1a of h over the n low bytes of x, least significant
// first (binary.LittleEndian's order).
func fnvBytes(h, x uint64, n int) uint64 {
	for range n {
		h ^= x & 0xff
		h *= fnvPrime64
		x >>= 8
	}
	return h
}

// Running, Waiting: the queue lengths.
func (c *Core) Running() int { return len(c.running) }

// Waiting is the length of the waiting queue.
func (c *Core) Waiting() int { return len(c.waiting) }

// Idle reports whether nothing runs, waits, or decodes held for its call
// (a migration in's pre-step).
func (c *Core) Idle() bool { return len(c.running) == 0 && len(c.waiting) == 0 && len(c.held) == 0 }

// HeadPages is the KV pages the head of the waiting queue needs (0 when
// nothing waits).
func (c *Core) HeadPages() int {
	if len(c.waiting) == 0 {
		return 0
	}
	return PagesFor(len(c.waiting[0].History))
}

// QueuedPages is the KV pages the waiting requests need, each its whole
// history (HeadPages summed over the queue) less, with the prefix cache,
// the pages of it the cache holds now: an admission references those
// instead of allocating them (takeHit). Counted whole, a queue of
// requests sharing a long cached context (llm-d's workload: 450 pages a
// prompt, 375 of them cached) read as several times the demand it is,
// and prefix-aware dispatch turned away from the worker that caches the
// context (docs/benchmarks.md, "Issue 25").
//
// The cached part is looked up when the request enters the queue
// (queuedDemand), not at every report: the cache changes at every step,
// and a look-up of hundreds of waiting requests' pages at every report
// made the simulator's prefix figure fifteen times slower.
func (c *Core) QueuedPages() int {
	n := 0
	for _, r := range c.waiting {
		n += r.queuedPages
	}
	return n
}

// queuedDemand sets r's queuedPages as it enters the waiting queue.
func (c *Core) queuedDemand(r *Request) {
	hit, _ := c.lookupHit(r)
	r.queuedPages = PagesFor(len(r.History)) - hit
}

// CachedPages is the KV pages the running requests' caches hold: what an
// engine that allocates a page per 16 positions has in use. With the
// prefix cache a page requests share counts once, and the unreferenced
// cached pages not at all (EvictablePages).
func (c *Core) CachedPages() int {
	n := c.sharedPages()
	for _, r := range c.running {
		n += PagesFor(r.fed) - r.cached
	}
	for _, r := range c.stopped {
		n += PagesFor(r.fed) - r.cached
	}
	for _, in := range c.incoming {
		n += in.pages
	}
	return n
}

// AppendQueued appends to dst the ids of the waiting requests that hold no
// KV cache here (new, or preempted: their migration would copy nothing),
// in queue order, at most max of them, and returns it: the load report's
// queued list (policy.Placed.Queued).
func (c *Core) AppendQueued(dst []string, max int) []string {
	for _, r := range c.waiting {
		if len(dst) >= max {
			break
		}
		if r.fed == 0 {
			dst = append(dst, r.ID)
		}
	}
	return dst
}

// HighPriority is the running and waiting requests of high priority
// (policy.HighPriority): the load report's count, each of which reserves
// headroom in the worker's freeness.
func (c *Core) HighPriority() int {
	n := 0
	for _, q := range [][]*Request{c.running, c.waiting} {
		for _, r := range q {
			if policy.HighPriority(r.Priority) {
				n++
			}
		}
	}
	return n
}

// Requests returns the requests running and waiting, running first.
func (c *Core) Requests() []*Request {
	return append(slices.Clone(c.running), c.waiting...)
}

// Lookup returns the request under id, or nil.
func (c *Core) Lookup(id string) *Request { return c.byID[id] }

// Output returns what the state changes since the last call ask for, and
// starts a new Output. The slices are reused: they are valid until the next
// call into the Core.
//
// The elements the previous Output returned that this one does not
// overwrite are zeroed first: the backing arrays are reused, and an
// Event or a CheckpointPage left in one would keep its Request — its
// whole history — alive after the request ended (at 2,000 simulated
// workers, 86 MB of histories after every request had ended).
func (c *Core) Output() Output {
	o := c.out
	p := &c.lastOut
	clearTail(o.Events, p.Events)
	clearTail(o.Checkpoints, p.Checkpoints)
	clearTail(o.CheckpointReleases, p.CheckpointReleases)
	clearTail(o.Waits, p.Waits)
	clearTail(o.MigrationsEnded, p.MigrationsEnded)
	clearTail(o.Shares, p.Shares)
	*p = outLens{Events: len(o.Events), Checkpoints: len(o.Checkpoints), CheckpointReleases: len(o.CheckpointReleases),
		Waits: len(o.Waits), MigrationsEnded: len(o.MigrationsEnded), Shares: len(o.Shares)}
	c.out = Output{Release: o.Release[:0], Truncates: o.Truncates[:0], Events: o.Events[:0], Checkpoints: o.Checkpoints[:0],
		CheckpointReleases: o.CheckpointReleases[:0], Waits: o.Waits[:0], MigrationsEnded: o.MigrationsEnded[:0],
		KVStored: o.KVStored[:0], KVRemoved: o.KVRemoved[:0], KVStoredAt: o.KVStoredAt[:0], Adopts: o.Adopts[:0], Shares: o.Shares[:0]}
	return o
}

// outLens are the lengths of the slices with pointers the last Output
// returned.
type outLens struct {
	Events, Checkpoints, CheckpointReleases, Waits, MigrationsEnded, Shares int
}

// clearTail zeroes s's elements from its length up to n, the length its
// backing array was used to before (nothing when s grew past it).
func clearTail[T any](s []T, n int) {
	if n > len(s) {
		clear(s[len(s):n])
	}
}

// Submit queues a new call. It refuses (an Event with the error) a call
// that can never fit the KV cache (ErrTooLarge), one of an older epoch
// than the request runs under here (ErrStaleEpoch), and a new request that
// finds the queue full (ErrQueueFull).
//
// A resume is not held to MaxWaiting: a call that arrives with output
// tokens already generated (its worker failed, or it moved), or one that
// takes over a request this Core holds. Its client is already streaming,
// and a refusal would leave the gateway waiting mid-stream for a queue. The
// queue stays bounded: a resume comes only from a request some worker
// accepted under its caps (a gateway resumes only what it placed, and each
// request at most once at a time), so the resumes waiting are bounded by
// the requests admitted and in flight, and new requests still stop at
// MaxWaiting.
func (c *Core) Submit(r *Request) {
	r.outStart = r.Outputs()
	// A request interrupted before its first token arrives as a new one
	// would, its prompt alone; the checkpoint this worker holds of it
	// tells it apart, so that it restores its prefilled pages and waits
	// with the resumes, not behind every new request.
	r.resume = r.outStart > 0 || c.store != nil && !r.PromptLogprobs && c.store.Holds(r.ID)
	if r.lastToken.IsZero() {
		r.lastToken = r.Arrived
	}
	if need := r.MaxPages(); c.cfg.TotalPages > 0 && need > c.cfg.TotalPages {
		// Refused before it takes the id over: a call that cannot run
		// must not end the one that runs.
		c.event(Event{Req: r, Err: fmt.Errorf("%w: a prompt of %d tokens and max_tokens %d need %d KV pages of %d tokens; the engine has %d (at most %d tokens in all)",
			ErrTooLarge, r.Prompt, r.MaxTokens, need, engine.PageTokens, c.cfg.TotalPages, c.cfg.TotalPages*engine.PageTokens+1)})
		return
	}
	old, resume := c.byID[r.ID]
	if resume {
		// A call made for an older placement epoch comes from before a
		// move (a gateway that read a lagging replica): it is refused and
		// the request runs on.
		if r.Epoch < old.Epoch {
			c.event(Event{Req: r, Err: fmt.Errorf("%w: request %q runs under epoch %d, this call carries epoch %d",
				ErrStaleEpoch, r.ID, old.Epoch, r.Epoch)})
			return
		}
		// The gateway calls again for a request only when it has given
		// up on its previous call (the stream broke on its side, or the
		// controller moved the request and back): the latest call of an
		// equal or newer epoch wins.
		// Refusing it made a race into a client-visible error: the old
		// call's cancellation can reach the scheduler after the new call.
		c.drop(old, ErrSuperseded, true)
	}
	// A call under a newer epoch than a migration in of its request comes
	// after the move: it adopts the pre-filled sequence.
	if i, in := c.findIncoming(r.ID); in != nil && r.Epoch > in.epoch {
		c.byID[r.ID] = r // adopt may end r, and ending deletes it
		if c.adopt(r, i, in) {
			return
		}
		delete(c.byID, r.ID) // queued below, or refused
	}
	resume = resume || r.resume
	if len(c.waiting) >= c.cfg.MaxWaiting && !resume {
		c.event(Event{Req: r, Err: fmt.Errorf("%w: %d requests wait, at its limit of %d (MaxWaiting, the worker's -max-waiting)", ErrQueueFull, len(c.waiting), c.cfg.MaxWaiting)})
		return
	}
	c.nextSeq++
	r.seq = c.nextSeq
	c.byID[r.ID] = r
	if r.resume {
		// A resumed request (its worker failed, or it moved) goes ahead of
		// new ones of its priority, behind earlier resumes: its client is
		// already waiting mid-stream, and a failure should cost it a
		// delay, not a queue.
		c.enqueue(r, true)
	} else {
		c.enqueue(r, false)
	}
}

// enqueue puts r in the waiting queue behind every more urgent request and
// those of its priority that go first: the resumes when behindResumes is
// set (r is a resume, or a new request displaced by one), every one
// otherwise (r is new). With a single priority it is the queue's old
// order: a resume behind the resumes, a new request at the end.
func (c *Core) enqueue(r *Request, behindResumes bool) {
	c.queuedDemand(r)
	i := 0
	for i < len(c.waiting) {
		w := c.waiting[i]
		if w.Priority > r.Priority || (w.Priority == r.Priority && behindResumes && !w.resume) {
			break
		}
		i++
	}
	c.waiting = slices.Insert(c.waiting, i, r)
}

// requeueFront puts r back at the head of the requests of its priority in
// the waiting queue (a preemption's victim, a migration given up), behind
// the more urgent ones.
func (c *Core) requeueFront(r *Request) {
	c.queuedDemand(r)
	i := 0
	for i < len(c.waiting) && c.waiting[i].Priority < r.Priority {
		i++
	}
	c.waiting = slices.Insert(c.waiting, i, r)
}

// addRunning puts r in the running set behind every request of its
// priority or a more urgent one (admission order within a priority), so
// the set's last is the newest of the least urgent: the first victim.
func (c *Core) addRunning(r *Request) {
	i := len(c.running)
	for i > 0 && c.running[i-1].Priority > r.Priority {
		i--
	}
	c.running = slices.Insert(c.running, i, r)
}

// Cancel drops r when it is still the request under its id (a newer call
// may have taken the id over): its client went away. No event is sent.
func (c *Core) Cancel(r *Request) {
	if cur, ok := c.byID[r.ID]; ok && cur == r {
		c.drop(r, nil, true)
	}
}

// HandBack ends every request with err and keeps their checkpoints: they
// resume elsewhere (a shutdown; an incarnation the controller marked
// failed). Requests end in id order.
func (c *Core) HandBack(err error) {
	ids := make([]string, 0, len(c.byID))
	for id := range c.byID {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		c.drop(c.byID[id], err, false)
	}
}

func (c *Core) event(e Event) { c.out.Events = append(c.out.Events, e) }

// drop removes a request wherever it is and frees its pages; err, when not
// nil, is sent to its stream. releaseCkpt asks its holder to drop its pages.
func (c *Core) drop(r *Request, err error, releaseCkpt bool) {
	why := "the call was cancelled"
	if err != nil {
		why = err.Error()
	}
	// A request stopped for its migration's commit may continue at the
	// destination (its call here is cut when the gateway switches): its
	// holder keeps its pages, and reconciles them if it does not.
	if r.out != nil && r.out.stopped {
		releaseCkpt = false
	}
	c.endOut(r, why)
	delete(c.byID, r.ID)
	c.unref(r)
	c.out.Release = append(c.out.Release, r.seq)
	c.waiting = remove(c.waiting, r)
	c.running = remove(c.running, r)
	if releaseCkpt {
		c.releaseCheckpoint(r)
	}
	if err != nil {
		c.event(Event{Req: r, Err: err})
	}
}

func remove(q []*Request, r *Request) []*Request {
	for i, x := range q {
		if x == r {
			return slices.Delete(q, i, i+1) // zeroes the freed slot
		}
	}
	return q
}

// Next builds the next step given the engine's free pages: first the
// running requests, oldest admitted first, each its next chunk under the
// token budget — a decode, or the next chunk of its prefill — then, when no
// request was preempted, waiting requests while the budget, the slots and
// the KV pages allow, and last the verifications of drafts with what is
// left (verify). An empty Step means nothing can run now: see Stalled.
//
// A running request whose chunk gets no page follows Config.Preemption.
// Under PreemptWait (lumen's default) it sits the step out, its cache
// kept, while the older requests run; when none of them can run, the
// newest is preempted by recompute and the step is built again without
// admitting, so a victim is never re-admitted into the same squeeze.
// PreemptVLLM is vLLM's scheduler (V1 Scheduler.schedule; V0's recompute
// preemption):
//
// Preemption by recompute. A prefill chunk shrinks to the pages that are
// free, as it does to the token budget. A running request whose chunk gets
// no token at all — its next position starts a new page and none is free
// (a decode, or a prefill chunk at a page boundary) — preempts the most
// recently admitted running request: its cache is dropped, it goes back to
// the head of the waiting queue with a new sequence, to be recomputed (its
// prompt and the outputs it had: the same tokens follow), and the pages it
// held are counted free; the chunk is tried again, preempting the next
// newest, until it fits or the request is itself the newest, and then it is
// preempted itself. The rows already in the step are older than every
// victim, so they stay. Requests stopped for their migration's commit and
// migrations in are not in the running set: they hold their pages and are
// never victims. A step that preempted admits nobody (vLLM schedules no
// waiting request in a step with preemptions): a victim is not re-admitted
// in the step that preempted it, and nobody is admitted into pages the
// running requests are short of.
//
// Where PreemptVLLM differs from vLLM: vLLM allocates a running request's whole
// chunk (min(remaining prompt, budget)) or preempts; here a prefill chunk
// first shrinks to the free pages. The chunk's length is the scheduler's
// choice either way, and the shorter chunk makes progress without
// discarding a cache — under vLLM's rule the victim is usually the
// prefilling request itself, the newest, which then recomputes what it had
// prefilled. A verification takes only what is left: drafts never
// preempt.
//
// A waiting request is refused (ErrTooLarge) only when it cannot be
// admitted although the Core holds nothing — no request runs, stands
// stopped for its migration's commit or migrates in — so that free is all
// the engine has. Pages and slots that are merely held (an idle
// destination may have given every free page to a migration in) make the
// queue wait: they come back at the commit, the abort or the expiry.
func (c *Core) Next(now time.Time, free int) Step {
	admit := !c.noAdmit
	c.noAdmit = false
	c.stalled = false
	// The prefix cache's unreferenced pages count as free; the step's
	// build evicts what it needs of them (prefixcache.go).
	engineFree := free
	c.released = 0
	free += c.EvictablePages()
	if admit {
		free = c.makeRoom(free)
	}
	hold := true
	for {
		st, preempted := c.build(now, free, admit, hold)
		if len(st.Batch) == 0 && hold && !preempted {
			// Holding back the less urgent prefills left nothing to run:
			// they run (the urgent request waits for pages or a slot).
			hold = false
			continue
		}
		if len(st.Batch) > 0 {
			if c.pc != nil {
				c.evictFor(stepDemand(st), engineFree+c.released)
			}
			c.pending = st
			return st
		}
		switch {
		case len(c.running) > 0:
			// PreemptWait: every running request waits for a page (under
			// PreemptVLLM one always has a chunk or preempts down to
			// itself).
			free += c.preempt()
			admit = false
			continue
		case !admit || preempted || len(c.waiting) == 0:
			// The call after a squeeze admits.
		case len(c.stopped) == 0 && len(c.incoming) == 0:
			// The head cannot fit even alone, in every free page: it
			// never will (Submit refuses such a call when it knows the
			// engine's pages).
			head := c.waiting[0]
			c.drop(head, fmt.Errorf("%w: it needs %d KV pages to start, %d are free and nothing else holds any", ErrTooLarge,
				PagesFor(min(len(head.History), c.cfg.TokenBudget)), free), true)
		default:
			c.stalled = true
		}
		c.pending = Step{}
		return Step{}
	}
}

// Stalled reports whether the last Next admitted and built nothing while
// requests wait: the pages or slots they need are held by requests stopped
// for their migration's commit or by migrations in. Nothing can run until
// an input releases them (CommitOut, AbortOut, AbortIn, Expire, the
// adopting Submit) or changes the queue (Submit, Cancel): the caller waits
// for one instead of calling Next again. After any other empty Step (the
// first call after a squeeze does not admit), call Next again.
func (c *Core) Stalled() bool { return c.stalled && len(c.running) == 0 && len(c.waiting) > 0 }

// build takes each running request's next chunk while the token budget
// lasts (a prefill chunk shrinks to the pages there are), preempting the
// newest running requests for a chunk that gets no page (Next), then, when
// admit is set and nobody was preempted, waiting requests whose first chunk
// — after the checkpoint pages they will import — fits. It reports whether
// it preempted.
//
// Admission leaves a page of headroom per running request for its coming
// decodes. vLLM V1 keeps none (V0 kept a watermark of 1% of the blocks):
// the headroom stays because preemption is by recompute, and a request
// admitted into the last pages would be the newest, the first victim of
// the next decode that crosses a page boundary — its prefill thrown away a
// step after it ran. At vLLM's batch cap it is 256 pages, 1.6% of
// Qwen3-14B's 16,212 on an H100: the order of V0's watermark. makeRoom and
// a migration in (AcceptStage) count the same headroom.
//
// Execution priority (Request.Priority): when hold is set and a request
// has its prefill to run — a running one, or the queue's head when admit
// is set — every less urgent request runs only its decode in the step, and
// no less urgent one is admitted: the step is as long as the urgent
// prefill and the decodes, not the prefill chunks of a burst of normal
// requests (a step's time grows with its prefill tokens). With a single
// priority nothing is held.
func (c *Core) build(now time.Time, free int, admit, hold bool) (st Step, preempted bool) {
	budget := c.cfg.TokenBudget
	top := int32(math.MaxInt32) // prefills less urgent than top are held
	if hold {
		for _, r := range c.running {
			if len(r.History)-r.fed > 1 {
				top = min(top, r.Priority)
			}
		}
		if admit && len(c.waiting) > 0 {
			top = min(top, c.waiting[0].Priority)
		}
	}
	// The step's slices are the Core's, reused: valid until the next Next.
	st = Step{Batch: c.batchBuf[:0], Reqs: c.reqsBuf[:0], Restores: c.restoreBuf[:0]}
	defer func() {
		// The last step's rows this one does not overwrite are zeroed:
		// a chunk's tokens and a row's request would keep a finished
		// request's history alive.
		clearTail(st.Batch, c.lastStep[0])
		clearTail(st.Reqs, c.lastStep[1])
		clearTail(st.Restores, c.lastStep[2])
		c.lastStep = [3]int{len(st.Batch), len(st.Reqs), len(st.Restores)}
		c.batchBuf, c.reqsBuf, c.restoreBuf = st.Batch, st.Reqs, st.Restores
	}()
	// add takes up to n tokens of r's pending history, as far as free
	// pages allow, and reports whether it took any.
	add := func(r *Request, n int) bool {
		pending := r.History[r.fed:]
		n = min(n, len(pending), budget)
		held := PagesFor(r.fed)
		n = min(n, (held+free)*engine.PageTokens-r.fed)
		if n <= 0 {
			return false
		}
		sample := 0
		if n == len(pending) {
			sample = 1
		}
		ch := engine.Chunk{Seq: r.seq, Tokens: pending[:n], Sample: sample, Params: r.Params, OutIndex: r.Outputs(),
			Logprobs: r.logprobSlots(sample), TopLogprobs: r.TopLogprobs}
		if r.PromptLogprobs && r.fed < r.Prompt-1 && r.Outputs() == r.outStart {
			// Prompt positions in the chunk score the prompt's next
			// token (a recompute scores them again, to the same values).
			if len(r.promptLPs) != r.Prompt {
				r.promptLPs = make([]engine.Logprobs, r.Prompt)
			}
			m := min(n, r.Prompt-1-r.fed)
			ch.Targets, ch.Scores = r.History[r.fed+1:r.fed+1+m], r.promptLPs[r.fed+1:r.fed+1+m]
		}
		st.Batch = append(st.Batch, ch)
		st.Reqs = append(st.Reqs, r)
		budget -= n
		free -= PagesFor(r.fed+n) - held
		return true
	}
	// By index: a preemption shortens c.running from its end.
	for i := 0; i < len(c.running); i++ {
		r := c.running[i]
		if budget == 0 {
			break
		}
		if r.Priority > top && len(r.History)-r.fed > 1 {
			continue // a less urgent prefill, held
		}
		// A running request always has a token to feed; add fails only
		// for want of a page.
		for r.fed < len(r.History) && !add(r, budget) {
			if c.cfg.Preemption != PreemptVLLM {
				break // PreemptWait: it sits the step out
			}
			v := c.running[len(c.running)-1]
			free += c.preempt()
			preempted = true
			if v == r {
				break // it was the newest: nobody after it runs
			}
		}
	}
	// The held pre-steps of migrations in (migrate.go) run as the
	// running requests do, after them; one that gets no page ends (its
	// call computes the token).
	for i := 0; i < len(c.held) && budget > 0; {
		if r := c.held[i]; !add(r, budget) {
			c.unhold(r.holding)
			continue
		}
		i++
	}
	if !admit || preempted {
		c.verify(&st, budget, free)
		return st, preempted
	}
	// A page of headroom per running request for its coming decodes; a
	// verification may use it (its accepted positions are those decodes).
	headroom := len(c.running)
	free -= headroom
	// A request migrating in holds a running slot from its first stage,
	// one stopped for its migration's commit until the commit.
	for len(c.waiting) > 0 && budget > 0 && c.slots() < c.cfg.MaxRunning {
		r := c.waiting[0]
		if r.Priority > top {
			break // less urgent than a prefill of the step
		}
		pages, hashes := c.restorable(r)
		// A prefix the cache holds is in the KV cache already: a
		// checkpoint no longer than it is dropped, a longer one imports
		// only its pages past it.
		hit, idle := c.lookupHit(r)
		useHit := hit > 0 && hit >= len(pages)
		if useHit {
			if PagesFor(min(len(r.History), hit*engine.PageTokens+budget))-hit > free-idle {
				break
			}
		} else if PagesFor(min(len(r.History), len(pages)*engine.PageTokens+budget))-hit > free-idle {
			break
		}
		c.waiting[0] = nil // the backing array outlives the slot
		c.waiting = c.waiting[1:]
		c.addRunning(r)
		if useHit {
			c.takeHit(r, hit)
			free -= idle
		} else {
			if c.pc != nil {
				c.takeHit(r, hit)
			}
			if rs, ok := c.restore(r, pages, hashes); ok {
				st.Restores = append(st.Restores, rs)
			}
			free -= PagesFor(r.fed) - hit + idle
		}
		if r.started.IsZero() {
			r.started = now
			c.out.Waits = append(c.out.Waits, Wait{At: now, Wait: now.Sub(r.Arrived)})
		}
		add(r, budget)
	}
	c.verify(&st, budget, free+headroom)
	return st, false
}

// preempt sends the most recently admitted running request of the least
// urgent priority (the running set's last) back to the head of its
// priority's waiting requests, its cache dropped, and returns the pages it
// held.
func (c *Core) preempt() int {
	victim := c.running[len(c.running)-1]
	c.running[len(c.running)-1] = nil
	c.running = c.running[:len(c.running)-1]
	c.endOut(victim, "the request was preempted")
	c.out.Release = append(c.out.Release, victim.seq)
	freed := c.freed(victim)
	c.nextSeq++
	victim.seq, victim.fed, victim.ckptSent, victim.hashes = c.nextSeq, 0, 0, nil
	c.requeueFront(victim)
	c.out.Preemptions++
	return freed
}

// makeRoom lets a resumed request at the head of the queue take the place
// of new requests, youngest first, as vLLM preempts for its own: its
// client is already mid-stream and its history is expensive to recompute
// elsewhere. Only a new request whose cache is no longer than the resumed
// request's history is displaced (it waits again, behind the resumes, and
// recomputes no more than the resume would have), so each resume displaces
// a bounded set and no resume displaces another.
//
// A head more urgent than running requests (Request.Priority) takes the
// place of the less urgent ones, the newest of the least urgent first,
// whatever their cache, as vLLM's priority scheduling preempts: they wait
// again behind it. A request displaces only less urgent ones, so none is
// displaced back. With a single priority it is the rule above alone. It
// returns the free pages after.
func (c *Core) makeRoom(free int) int {
	for len(c.waiting) > 0 {
		r := c.waiting[0]
		urgent := len(c.running) > 0 && c.running[len(c.running)-1].Priority > r.Priority
		if !r.resume && !urgent {
			return free
		}
		pages, _ := c.restorable(r)
		need := PagesFor(min(len(r.History), len(pages)*engine.PageTokens+c.cfg.TokenBudget))
		if need <= free-len(c.running) && c.slots() < c.cfg.MaxRunning {
			return free
		}
		vi := -1
		for i := len(c.running) - 1; i >= 0; i-- {
			v := c.running[i]
			if v.Priority > r.Priority || (v.Priority == r.Priority && r.resume && !v.resume && v.fed <= len(r.History)) {
				vi = i
				break
			}
		}
		if vi < 0 {
			return free
		}
		v := c.running[vi]
		c.running = slices.Delete(c.running, vi, vi+1)
		free += c.requeue(v)
	}
	return free
}

// requeue drops a running request's cache and puts it back in the queue
// behind the more urgent requests and the resumed ones of its priority, to
// be recomputed; it returns the pages freed.
func (c *Core) requeue(v *Request) int {
	c.endOut(v, "the request was preempted")
	c.out.Release = append(c.out.Release, v.seq)
	freed := c.freed(v)
	c.nextSeq++
	v.seq, v.fed, v.ckptSent, v.hashes = c.nextSeq, 0, 0, nil
	c.enqueue(v, true)
	c.out.Preemptions++
	return freed
}

// restorable returns the longest prefix of a newly admitted request's pages
// that the checkpoint store holds (this worker was the request's holder),
// and their hashes; nil for a new request or one already tried.
func (c *Core) restorable(r *Request) ([][]byte, []uint64) {
	if c.store == nil || r.restoreTried || r.fed > 0 || !r.resume || r.PromptLogprobs {
		return nil, nil // a new request: nothing was checkpointed
	}
	// At least one token must be left to compute the next one.
	hashes := PageHashes(r.History[:len(r.History)-1], nil)
	pages := c.store.Prefix(hashes)
	return pages, hashes[:len(pages)]
}

// restore counts the pages restorable found as in the cache, so only the
// rest of the request's history is prefilled; the caller imports them
// before the step runs.
func (c *Core) restore(r *Request, pages [][]byte, hashes []uint64) (Restore, bool) {
	if r.restoreTried && r.fed == 0 || r.fed > 0 && r.fed != r.cached*engine.PageTokens {
		return Restore{}, false
	}
	r.restoreTried = true
	if !r.resume {
		return Restore{}, false
	}
	var rs Restore
	// Pages the cache gave r (takeHit) are not imported again.
	cached := r.fed / engine.PageTokens
	ok := len(pages) > cached
	if ok {
		r.fed = len(pages) * engine.PageTokens
		r.hashes = hashes
		c.out.RestoredPages += len(pages) - cached
		rs = Restore{Req: r, Seq: r.seq, Pages: pages[cached:], Hashes: hashes[cached:], Cached: cached}
	}
	if cached > 0 {
		// takeHit counted the tokens past the cache as recomputed.
		c.out.RecomputedTokens -= r.fed - cached*engine.PageTokens
	} else {
		c.out.RecomputedTokens += len(r.History) - r.fed
	}
	return rs, ok
}

// RestoreFailed says the caller could not import r's pages: r is
// recomputed from its first token instead. The step Next returned is void;
// call Next again.
func (c *Core) RestoreFailed(r *Request) {
	if r.fed == 0 {
		return
	}
	c.endOut(r, "its checkpoint could not be restored")
	c.out.RestoredPages -= len(r.hashes) - r.cached
	c.out.RecomputedTokens += r.fed
	c.out.Release = append(c.out.Release, r.seq)
	if r.cached > 0 {
		// The pages the cache gave it are let go with the sequence
		// (none of the imported ones entered the cache).
		r.fed = r.cached * engine.PageTokens
		c.unref(r)
	}
	c.nextSeq++
	r.seq, r.fed, r.hashes, r.ckptSent = c.nextSeq, 0, nil, 0
	c.pending = Step{}
}

// StepFailed says the step Next returned failed with err. When the engine
// ran out of pages and something runs, a request is preempted and it
// returns true: call Next again (it will not admit). Otherwise every
// request of the step ends with the error, and the rest go on.
func (c *Core) StepFailed(err error) (retry bool) {
	st := c.pending
	c.pending = Step{}
	if errors.Is(err, engine.ErrOutOfPages) && len(c.running) > 0 {
		c.preempt()
		c.noAdmit = true
		return true
	}
	for _, r := range st.Reqs {
		if cur, ok := c.byID[r.ID]; ok && cur == r {
			c.drop(r, fmt.Errorf("worker: engine: %w", err), true)
		}
	}
	return false
}

// Done delivers the step's sampled tokens (out[i] for Batch[i]) at time
// now, ends the requests that finished, and queues the pages that filled
// for the requests' holders.
func (c *Core) Done(now time.Time, out [][]int32) {
	st := c.pending
	c.pending = Step{}
	for i, ch := range st.Batch {
		r := st.Reqs[i]
		if r.held {
			// A held pre-step's row; one whose pre-allocation went
			// meanwhile (only the simulator ends one mid-step) is void.
			if r.holding != nil {
				r.fed += len(ch.Tokens)
				c.heldDone(r, out[i][0])
			}
			continue
		}
		if ch.Sample > 1 {
			c.verified(now, r, ch, out[i])
			continue
		}
		if len(ch.Targets) > 0 && r.scoredTo == r.fed {
			r.scoredTo = r.fed + len(ch.Targets)
		}
		r.fed += len(ch.Tokens)
		if len(out[i]) == 0 {
			continue
		}
		c.commit(now, r, out[i][0], chunkLogprobs(ch, 0))
	}
	c.checkpoint(st.Reqs)
	if c.pc != nil {
		for _, r := range st.Reqs {
			if cur, live := c.byID[r.ID]; live && cur == r {
				c.register(r)
			}
		}
	}
}

// chunkLogprobs is a copy of the logprobs the engine computed for a
// chunk's j-th sampled token, or nil when none were asked for.
func chunkLogprobs(ch engine.Chunk, j int) *engine.Logprobs {
	if j >= len(ch.Logprobs) {
		return nil
	}
	lp := ch.Logprobs[j]
	return &lp
}

// commit appends tok to r's history and sends it, with its logprobs lp
// (nil: not asked for); when it was r's last token r ends, and commit
// reports true.
func (c *Core) commit(now time.Time, r *Request, tok int32, lp *engine.Logprobs) (ended bool) {
	r.History = append(r.History, tok)
	idx := r.Outputs() - 1
	ev := Event{Req: r, Token: tok, Index: idx, Logprobs: lp, At: now}
	if idx == r.outStart {
		ev.First, ev.Latency = true, now.Sub(r.Arrived)
		if r.PromptLogprobs {
			if r.scoredTo < r.Prompt-1 {
				// Only a prefill that skipped prompt positions leaves
				// them unscored; nothing does for such a request.
				c.drop(r, fmt.Errorf("%w: %d of the prompt's %d positions were scored for its logprobs", ErrPromptUnscored, r.scoredTo, r.Prompt-1), true)
				return true
			}
			ev.PromptLogprobs = slices.Clone(r.promptLPs[min(1, r.Prompt):])
		}
	} else {
		ev.Latency = now.Sub(r.lastToken)
	}
	r.lastToken = now
	switch {
	case r.Stop[tok]:
		ev.Finish = FinishStop
	case r.Outputs() >= r.MaxTokens:
		ev.Finish = FinishLength
	}
	c.event(ev)
	if ev.Finish == FinishNone {
		return false
	}
	c.endOut(r, "the request finished")
	delete(c.byID, r.ID)
	c.unref(r)
	c.out.Release = append(c.out.Release, r.seq)
	c.running = remove(c.running, r)
	c.out.Completed++
	c.releaseCheckpoint(r)
	return true
}

// checkpoint queues the pages that filled in this step for the holder.
func (c *Core) checkpoint(reqs []*Request) {
	for _, r := range reqs {
		if r.Holder == "" || r.Holder == c.cfg.Self {
			continue
		}
		if r.fed/engine.PageTokens <= len(r.hashes) && r.ckptSent == len(r.hashes) {
			continue // no page filled this step, none behind
		}
		if cur, live := c.byID[r.ID]; !live || cur != r {
			continue
		}
		r.hashes = PageHashes(r.History[:r.fed], r.hashes)
		for ; r.ckptSent < len(r.hashes); r.ckptSent++ {
			c.out.Checkpoints = append(c.out.Checkpoints, CheckpointPage{Req: r, Holder: r.Holder, Reserved: r.Reserved,
				Seq: r.seq, Page: r.ckptSent, Hash: r.hashes[r.ckptSent]})
		}
	}
}

// SetHolder gives request id, running under epoch with no holder yet, its
// checkpoint holder and its reserved footprint there: the gateway started
// the request before its placement committed (issue 16) and learns the
// holder Apply chose only then. The request's next step exports every full
// page it has, from page 0, and each page that fills after. It reports
// false — and changes nothing — when the core does not run id, runs it
// under another epoch, or it already has a holder.
func (c *Core) SetHolder(id string, epoch uint64, holder string, reserved uint64) bool {
	r := c.byID[id]
	if r == nil || r.Epoch != epoch || r.Holder != "" || holder == "" {
		return false
	}
	r.Holder, r.Reserved = holder, reserved
	// Pages the request restored from this worker's store (or adopted)
	// count as sent only to a holder that had them: this one did not.
	r.ckptSent = 0
	return true
}

// CheckpointBehind says the holder's queue refused page `page` of r (and
// so the ones after it): they are queued again after the next step.
func (c *Core) CheckpointBehind(r *Request, page int) {
	if page < r.ckptSent {
		r.ckptSent = page
	}
}

func (c *Core) releaseCheckpoint(r *Request) {
	if r.Holder != "" && r.Holder != c.cfg.Self && r.ckptSent > 0 {
		c.out.CheckpointReleases = append(c.out.CheckpointReleases, CheckpointRelease{Holder: r.Holder, RequestID: r.ID, Req: r})
	}
}

// WaitWindow is the sliding window of prefill-start waits that q_w is the
// mean of.
type WaitWindow struct {
	waits []Wait
}

// Add records waits.
func (w *WaitWindow) Add(ws ...Wait) { w.waits = append(w.waits, ws...) }

// Mean drops the waits recorded before now−window and returns the mean of
// the rest in milliseconds (0 for none): q_w.
func (w *WaitWindow) Mean(now time.Time, window time.Duration) float64 {
	cut := now.Add(-window)
	kept := w.waits[:0]
	var sum time.Duration
	for _, x := range w.waits {
		if x.At.After(cut) {
			kept = append(kept, x)
			sum += x.Wait
		}
	}
	w.waits = kept
	if len(kept) == 0 {
		return 0
	}
	return float64(sum.Microseconds()) / 1000 / float64(len(kept))
}

// KeepsPages is the holder's rule when it reconciles its checkpoint store
// with the placement table: worker self keeps a request's pages when it is
// the request's holder, or when the request was moved here by a recovery
// (not running yet) and may import them when its call arrives (a reuse
// recovery targets the holder, which then consumes the pages).
func KeepsPages(holder, serving string, recovering bool, self string) bool {
	return holder == self || (serving == self && recovering)
}
