package core

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/lumen-project/lumen/worker/engine"
)

// Speculative verification, the target's side of progressive recovery: a
// drafter (a restarted worker reloading its model) offers draft tokens for
// the requests this Core runs; each step verifies a decoding request's
// drafts in the same chunk as its next token (K+1 positions, sampling
// after each), and commits the longest prefix of drafts equal to what the
// target itself computes at those positions, plus the target's token after
// it.
//
// The acceptance rule is equality with the target's own choice at each
// output index — its argmax when greedy, the token its seeded sampler draws
// at that index otherwise — so the committed tokens are exactly those of a
// run without speculation. Leviathan et al.'s rejection sampling keeps the
// output distribution but not the tokens (it resamples from the residual
// distribution with fresh randomness); lumen promises the tokens.

// SpecConfig sets how a Core verifies drafts.
type SpecConfig struct {
	// K fixes the drafts verified per request per step (0: none). With
	// Adaptive, K is chosen each step instead, up to KMax, to maximise the
	// committed tokens per second that Cost predicts at the acceptance rate
	// measured so far (ChooseK).
	K        int
	Adaptive bool
	KMax     int
	// Cost is the modelled duration of a step of s.Rows decoding rows each
	// verifying s.K drafts (s.K = 0: a plain decode step) over s.Context
	// positions of KV (engine.Profile.Step's shape). Required by Adaptive.
	Cost func(s engine.StepShape) time.Duration
	// Vocab is the engine's vocabulary size (engine.Info.Vocab): drafts
	// come from another worker, and a token outside [0, Vocab) would fail
	// the engine's step and every request in it, so OfferDrafts drops the
	// drafts from the first such token on. 0: only negative tokens are
	// dropped.
	Vocab int
}

// DefaultKMax bounds adaptive K.
const DefaultKMax = 8

// MaxSpecK bounds K, fixed or adaptive, wherever it is set (a worker's
// -spec-k, the simulator's Spec.K, SpecConfig): a drafter keeps a line of
// 2K+1 drafts ahead of each request (Drafter), and the target takes at
// most MaxDraftTokens of them per request in a DraftBatch. A K past it
// would make every batch a protocol violation.
const MaxSpecK = 32

// MaxDraftTokens is the longest draft line a target takes for one request:
// the drafter's line at MaxSpecK.
const MaxDraftTokens = 2*MaxSpecK + 1

// ErrSpecK: a K outside [0, MaxSpecK].
var ErrSpecK = errors.New("speculation: K out of range")

// CheckSpecK says what is wrong with k as a K.
func CheckSpecK(k int) error {
	if k < 0 || k > MaxSpecK {
		return fmt.Errorf("%w: %d is outside [0, %d] (a drafter keeps 2K+1 drafts ahead of each request; a target takes at most %d)",
			ErrSpecK, k, MaxSpecK, MaxDraftTokens)
	}
	return nil
}

// TargetSpec is how a target verifies its drafter's drafts, the worker's
// and the simulator's alike: k > 0 fixes K; k == 0 chooses it each step
// (adaptive, up to DefaultKMax) by the profile's cost of the fused step
// (engine.Profile.StepTimeK), and turns speculation off without a profile
// (the CPU transformer has no GPU cost model to choose by); k < 0 turns it
// off. vocab is SpecConfig.Vocab.
func TargetSpec(k int, p *engine.Profile, vocab int) SpecConfig {
	switch {
	case k > 0:
		return SpecConfig{K: min(k, MaxSpecK), Vocab: vocab}
	case k < 0 || p == nil:
		return SpecConfig{}
	}
	prof := *p
	return SpecConfig{Adaptive: true, KMax: DefaultKMax, Vocab: vocab,
		Cost: func(s engine.StepShape) time.Duration { return prof.Step(s) }}
}

// PriorAcceptance is the acceptance rate assumed before any verification
// (docs/calibration.md: 0.6–0.75 for a small draft), worth priorWeight
// verifications.
const (
	PriorAcceptance = 0.7
	priorWeight     = 4
	// acceptDecay forgets old verifications: the estimate follows about
	// the last 1/(1−acceptDecay) of them.
	acceptDecay = 0.995
)

type spec struct {
	cfg SpecConfig
	// Acceptance estimate: each verification of k drafts with m accepted
	// is m successes and, when m < k, one failure (the geometric MLE).
	ok, fail float64
	k        int // K of the last step built
}

// SetSpec configures speculation for a drafter that attaches; the zero
// SpecConfig turns it off (the drafter left). The acceptance estimate
// starts again from the prior: it measures one drafter, and after a poor
// one adaptive K would be 0 — nothing verified, so nothing measured — for
// every drafter after it.
func (c *Core) SetSpec(sc SpecConfig) {
	if sc.Adaptive && sc.KMax <= 0 {
		sc.KMax = DefaultKMax
	}
	sc.K, sc.KMax = min(max(sc.K, 0), MaxSpecK), min(sc.KMax, MaxSpecK)
	c.spec.cfg = sc
	c.spec.ok, c.spec.fail = PriorAcceptance*priorWeight, (1-PriorAcceptance)*priorWeight
}

// NextK is the K the next step will choose with the requests running now
// (at least one row): what a drafter that attaches is told before any step
// verified.
func (c *Core) NextK() int {
	sc := c.spec.cfg
	if !sc.Adaptive || sc.Cost == nil {
		return sc.K
	}
	rows, ctx := c.decodeRows()
	return ChooseK(c.Acceptance(), sc.KMax, c.stepCost(max(rows, 1), ctx))
}

// Acceptance is the estimated probability that a draft token is accepted,
// given the one before it was.
func (c *Core) Acceptance() float64 {
	if c.spec.ok+c.spec.fail == 0 {
		return PriorAcceptance
	}
	return c.spec.ok / (c.spec.ok + c.spec.fail)
}

// SpecK is the K the last step was built with (what the drafter is asked
// for).
func (c *Core) SpecK() int { return c.spec.k }

// specK chooses the K of the step being built, given its token budget and
// free pages: the drafts a row may verify this step, and, in c.spec.k, the
// K the drafter is asked to draft for (SpecK). Both are sc.K when K is
// fixed. Adaptive, the drafter is asked for ChooseK's K at the rows' count
// and context, which assumes every row has its drafts; the step verifies
// the K, up to that one, whose fused pass commits the most tokens per unit
// of step time over the rows as they are (stepK).
func (c *Core) specK(budget, free int) int {
	sc := c.spec.cfg
	if !sc.Adaptive || sc.Cost == nil {
		c.spec.k = sc.K
		return sc.K
	}
	rows, ctx := c.decodeRows()
	if rows == 0 {
		c.spec.k = ChooseK(c.Acceptance(), sc.KMax, c.stepCost(1, 0))
		return 0
	}
	cost := c.stepCost(rows, ctx)
	alpha := c.Acceptance()
	ask := ChooseK(alpha, sc.KMax, cost)
	c.spec.k = ask
	return c.stepK(alpha, ask, rows, cost, budget, free)
}

// stepK is the K, at most ask, that maximises the tokens this step commits
// per unit of its modelled time. A row verifies only the drafts it holds
// (usableDrafts), and commits ExpectedTokens of them; a row without drafts
// commits one token; but every decoding row pays the fused pass for the
// step's K (engine.Profile.Step pads rows without drafts to it). When the
// drafter keeps up with few rows of a large batch, padding all of them
// costs the whole batch more than the few gain, and the step decodes
// plainly (0) or verifies fewer drafts: verification never makes a step
// commit fewer tokens per second than a plain decode would (by the model).
func (c *Core) stepK(alpha float64, ask, rows int, cost func(k int) time.Duration, budget, free int) int {
	if ask == 0 {
		return 0
	}
	c.availBuf = c.availBuf[:0]
	for _, r := range c.running {
		if n := len(c.usableDrafts(r, ask, budget, free)); n > 0 {
			c.availBuf = append(c.availBuf, n)
		}
	}
	if len(c.availBuf) == 0 {
		return 0
	}
	best, bestRate := 0, float64(rows)/float64(cost(0))
	for k := 1; k <= ask; k++ {
		committed := float64(rows - len(c.availBuf))
		for _, n := range c.availBuf {
			committed += ExpectedTokens(alpha, min(k, n))
		}
		if rate := committed / float64(cost(k)); rate > bestRate*(1+1e-9) {
			best, bestRate = k, rate
		}
	}
	return best
}

// decodeRows counts the running requests that decode (their prompt and
// output are cached but for the last token) and the KV positions a plain
// decode step of them reads.
func (c *Core) decodeRows() (rows, context int) {
	for _, r := range c.running {
		if r.fed == len(r.History)-1 {
			rows++
			context += r.fed + 1
		}
	}
	return rows, context
}

// stepCost is Cost as a function of K for rows decoding rows over context
// positions: a verification of k drafts reads k more positions per row.
func (c *Core) stepCost(rows, context int) func(k int) time.Duration {
	cost := c.spec.cfg.Cost
	return func(k int) time.Duration {
		return cost(engine.StepShape{Rows: rows, K: k, Context: context + rows*k})
	}
}

// ExpectedTokens is the tokens a verification of k drafts commits on
// average when each draft is accepted with probability alpha given the one
// before it was: (1 − α^(k+1)) / (1 − α).
func ExpectedTokens(alpha float64, k int) float64 {
	if alpha >= 1 {
		return float64(k + 1)
	}
	return (1 - math.Pow(alpha, float64(k+1))) / (1 - alpha)
}

// ChooseK returns the K in [0, kmax] that maximises committed tokens per
// unit of step time for a drafter that works one step behind the target
// (this protocol's: PipelinedTokens(alpha, K) / cost(K)); K = 0 when no
// drafting pays (the smallest K among equals).
func ChooseK(alpha float64, kmax int, cost func(k int) time.Duration) int {
	return ChooseKWith(alpha, kmax, cost, PipelinedTokens)
}

// ChooseKWith is ChooseK for a model of the tokens a row-step commits:
// ExpectedTokens when drafts are always on time, PipelinedTokens for this
// protocol's drafter.
func ChooseKWith(alpha float64, kmax int, cost func(k int) time.Duration, tokens func(alpha float64, k int) float64) int {
	best, bestRate := 0, 0.0
	for k := 0; k <= kmax; k++ {
		d := cost(k)
		if d <= 0 {
			continue
		}
		if rate := tokens(alpha, k) / float64(d); rate > bestRate*(1+1e-9) {
			best, bestRate = k, rate
		}
	}
	return best
}

// PipelinedTokens is the tokens a decoding row commits per step, on
// average, when the drafter works one step behind: a step's drafts were
// drafted from the history as it was when the step before started (they
// cover that step's tokens and K more, the drafter's lookahead of 2K+1), so
// they are usable only if the step before committed what they guessed.
// After a verification that accepted all k drafts and whose own next token
// equals the drafter's next draft (probability α^(k+1)) the row verifies
// again; otherwise its next step runs a placeholder while the drafter
// replays from the target's token, and verifies again after it only if its
// first new draft equals the token that step committed (α). The rows that
// verify are a share πD = α / (α + 1 − α^(k+1)) of the row-steps; the
// others commit one token:
//
//	T(α, k) = πD·ExpectedTokens(α, k) + 1 − πD
//
// Every step pays the fused pass for k (placeholders are padded). In the
// simulator's spec-k figure this model predicts every fixed K's rate within
// 3.5% and picks the best K; ExpectedTokens alone picks one too large at
// every α and batch (docs/benchmarks.md).
func PipelinedTokens(alpha float64, k int) float64 {
	if k == 0 || alpha <= 0 {
		return 1
	}
	e := ExpectedTokens(alpha, k)
	full := math.Pow(alpha, float64(k+1))
	pd := alpha / (alpha + 1 - full)
	return pd*e + 1 - pd
}

// OfferDrafts gives request id draft tokens for its history positions
// base, base+1, …; they replace any offered before. Drafts for a request
// that is not here, or whose committed history disagrees with them, are
// never verified, nor are those from a token outside the vocabulary on
// (SpecConfig.Vocab).
func (c *Core) OfferDrafts(id string, base int, tokens []int32) {
	r := c.byID[id]
	if r == nil || base < 0 || base > len(r.History) {
		return
	}
	for i, tok := range tokens {
		if tok < 0 || (c.spec.cfg.Vocab > 0 && int(tok) >= c.spec.cfg.Vocab) {
			tokens = tokens[:i]
			break
		}
	}
	r.draftBase = base
	r.drafts = append(r.drafts[:0], tokens...)
}

// verify turns the step's plain decodes into verifications of the drafts
// their requests hold, with the token budget and free pages the step has
// left once every running request has its chunk and the waiting requests
// that fit are admitted: a verification never takes the budget or the
// pages a prefill needs, so it buys no running request's TPOT with a
// waiting one's TTFT (vLLM's scheduler likewise counts speculative tokens
// after the running requests' own, and turns speculation off past a queue
// depth: --speculative-disable-by-batch-size). The K is specK's over
// what is left.
func (c *Core) verify(st *Step, budget, free int) {
	k := c.specK(budget, free)
	if k == 0 {
		return
	}
	for i, r := range st.Reqs {
		ch := &st.Batch[i]
		if len(ch.Tokens) != 1 || ch.Sample != 1 || r.fed != len(r.History)-1 {
			continue // a prefill chunk
		}
		// The decode holds its token of the budget and its page already.
		own := PagesFor(r.fed+1) - PagesFor(r.fed)
		d := c.usableDrafts(r, k, budget+1, free+own)
		if len(d) == 0 {
			continue
		}
		// Verify: the last committed token, then the drafts, in one
		// chunk that samples after each of them.
		r.verifyBuf = append(append(r.verifyBuf[:0], r.History[r.fed]), d...)
		ch.Tokens, ch.Sample, ch.Logprobs = r.verifyBuf, len(r.verifyBuf), r.logprobSlots(len(r.verifyBuf))
		budget -= len(d)
		free -= PagesFor(r.fed+len(r.verifyBuf)) - PagesFor(r.fed) - own
	}
}

// usableDrafts returns the drafts a decoding request can verify this step:
// those past its committed history, when the ones before agree with it, up
// to k, the token budget (one token is the request's own), its remaining
// output and the free pages.
func (c *Core) usableDrafts(r *Request, k, budget, free int) []int32 {
	if k <= 0 || len(r.drafts) == 0 || r.fed != len(r.History)-1 {
		return nil
	}
	off := len(r.History) - r.draftBase
	if off < 0 || off >= len(r.drafts) {
		return nil
	}
	if !slices.Equal(r.drafts[:off], r.History[r.draftBase:]) {
		r.drafts = r.drafts[:0] // the target went another way
		return nil
	}
	d := r.drafts[off:]
	n := min(len(d), k, budget-1, r.MaxTokens-r.Outputs()-1)
	held := PagesFor(r.fed)
	for n > 0 && PagesFor(r.fed+1+n)-held > free {
		n--
	}
	if n <= 0 {
		return nil
	}
	return d[:n]
}

// verified commits the outcome of r's verification chunk ch: the target's
// tokens out[0..m], where the first m drafts equal out[0..m-1]. The cache
// keeps the positions of the last committed token and the m accepted
// drafts; the rest is truncated.
func (c *Core) verified(now time.Time, r *Request, ch engine.Chunk, out []int32) {
	drafts := ch.Tokens[1:]
	m := 0
	for m < len(drafts) && m < len(out) && drafts[m] == out[m] {
		m++
	}
	c.out.Verifications++
	c.out.DraftTokens += len(drafts)
	c.out.AcceptedTokens += m
	c.spec.ok = c.spec.ok*acceptDecay + float64(m)
	c.spec.fail *= acceptDecay
	if m < len(drafts) {
		c.spec.fail++
	}
	r.fed += 1 + m
	for j := 0; j <= m && j < len(out); j++ {
		// An accepted draft's logprobs are the target's at that position:
		// the verification computed the same logits a decode would.
		if c.commit(now, r, out[j], chunkLogprobs(ch, j)) {
			return // ended: its sequence is released
		}
	}
	if 1+m < len(ch.Tokens) {
		c.out.Truncates = append(c.out.Truncates, Truncate{Seq: r.seq, Len: r.fed})
	}
}

// --- the mirror: what a target sends its drafter ---

// MirrorUpdate is a request's committed history from position From on, or
// (Ended) the news that it left the target.
type MirrorUpdate struct {
	ID     string
	From   int
	Tokens []int32
	Ended  bool
}

// Mirror tracks what a drafter has been sent of a Core's running
// requests. The zero value is ready; one Mirror per drafter.
type Mirror struct {
	sent map[string]mirrored
}

type mirrored struct {
	req *Request
	n   int
}

// Updates returns what changed since the last call: the new history of
// each running request (all of it for one the drafter has not seen), and
// the requests that left, in id order.
func (m *Mirror) Updates(c *Core) []MirrorUpdate {
	if m.sent == nil {
		m.sent = map[string]mirrored{}
	}
	var ups []MirrorUpdate
	for _, r := range c.running {
		prev, ok := m.sent[r.ID]
		from := prev.n
		if !ok || prev.req != r || from > len(r.History) {
			from = 0 // new to the drafter, or a new call under the id
		}
		if ok && prev.req == r && from == len(r.History) {
			continue
		}
		ups = append(ups, MirrorUpdate{ID: r.ID, From: from, Tokens: r.History[from:]})
		m.sent[r.ID] = mirrored{req: r, n: len(r.History)}
	}
	var gone []string
	for id, s := range m.sent {
		if cur := c.byID[id]; cur != s.req {
			gone = append(gone, id)
		}
	}
	slices.Sort(gone)
	for _, id := range gone {
		delete(m.sent, id)
		ups = append(ups, MirrorUpdate{ID: id, Ended: true})
	}
	return ups
}

// Reset forgets what was sent (a new drafter).
func (m *Mirror) Reset() { m.sent = nil }
