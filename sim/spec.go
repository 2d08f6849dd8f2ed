package sim

import (
	"fmt"
	"io"
	"slices"
	"sort"
	"time"

	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// Progressive recovery with speculation assist (Config.Speculation): the
// phases of a restarted worker, the pairing the fsm decides, and the Assist
// stream between a drafter and its target, each side running the worker's
// own state machine (core.Core's SetSpec, OfferDrafts and Mirror on the
// target, core.Drafter on the drafter). doc.go says the timeline and the
// draft model.

// DefaultDraftProfile is the draft model's timing profile.
const DefaultDraftProfile = "qwen3-0.6b-h100"

// SpecOptions parameterise speculation.
type SpecOptions struct {
	// Alpha is the probability that a draft token equals the target's
	// token at its position (0: core.PriorAcceptance, docs/calibration.md's
	// 0.6–0.75 for a small draft of the same family).
	Alpha float64
	// K > 0 fixes the drafts verified per request per step; 0 chooses K
	// adaptively (core.ChooseK over the measured acceptance and the
	// profile's StepTimeK, up to core.DefaultKMax); −1 fixes K = 0 (paired,
	// nothing drafted or verified: the baseline of the spec-k figure).
	K int
	// Seed seeds the draft-agreement draws.
	Seed uint64
	// Draft is the draft model's profile (zero: DefaultDraftProfile).
	Draft engine.Profile
	// AssistOnly makes the last AssistOnly workers drafters from the
	// start: registered in LOADING_DRAFT and at once in ASSIST, they never
	// load the target model (the spec-k figure).
	AssistOnly int
}

func (c *Config) validateSpec() []error {
	var errs []error
	sp := c.Spec
	if sp.Alpha < 0 || sp.Alpha > 1 {
		errs = append(errs, fmt.Errorf("Spec.Alpha (%g) must be in [0, 1]", sp.Alpha))
	}
	if sp.K != -1 {
		if err := core.CheckSpecK(sp.K); err != nil {
			errs = append(errs, fmt.Errorf("Spec.K (−1 fixes K = 0): %w", err))
		}
	}
	if sp.AssistOnly < 0 || sp.AssistOnly >= max(c.Workers, 1) {
		errs = append(errs, fmt.Errorf("Spec.AssistOnly (%d) must leave at least one of the %d workers in full service", sp.AssistOnly, c.Workers))
	}
	if c.Speculation && c.Strategy != policy.Lumen {
		errs = append(errs, fmt.Errorf("Speculation is lumen's: strategy %s has no progressive recovery", c.Strategy))
	}
	if sp.AssistOnly > 0 && !c.Speculation {
		errs = append(errs, fmt.Errorf("Spec.AssistOnly (%d) needs Speculation", sp.AssistOnly))
	}
	if d := sp.Draft; d.DecodeBaseMs < 0 || d.DecodeBaseMs > 0 && d.PrefillTokensPerSec <= 0 {
		errs = append(errs, fmt.Errorf("Spec.Draft: a profile with step times is required (%q)", d.Name))
	}
	return errs
}

// SpecStats are the speculation counters of a run.
type SpecStats struct {
	// Summed over the targets' cores (core.Output): draft tokens verified,
	// accepted, and verification rows.
	DraftTokens, AcceptedTokens, Verifications int
	// KSum is the K of its step summed over the verification rows (KSum /
	// KRows: the K chosen, per row).
	KSum, KRows int
	// Drafted and DraftSteps are the drafters' tokens and draft-model
	// steps.
	Drafted, DraftSteps int
}

// Pairing is one drafter's assistance to one target.
type Pairing struct {
	Drafter, Target string
	From, To        time.Duration
	// Tokens the target committed while paired; Drafted the drafter's
	// draft tokens.
	Tokens, Drafted int
}

// PhaseSpan is one restart's phases: the kill, then when the fsm applied
// the new incarnation's registration (LOADING_DRAFT) and each phase
// change; 0 for a phase not reached (killed again, or the run ended).
type PhaseSpan struct {
	Worker                                  string
	Kill, Registered, Assist, Hotswap, Full time.Duration
}

// Reload is a restarted worker's timeline with speculation, from the
// kill, each part scaled by Timing.ReloadScale (doc.go).
type Reload struct {
	// Draft: the draft model loaded (its profile's LoadTime), ASSIST from
	// then. Disk: the target's weights read into host memory, from the
	// restart, alongside the draft's load; Init: the target's engine
	// initialisation after it. H2D: the host-to-GPU copy, the whole of
	// HOTSWAP.
	Draft, Disk, Init, H2D time.Duration
	// Hotswap and Full are the phase changes: max(Draft, Disk+Init), then
	// H2D later — the moment the plain reload, Profile.LoadTime, ends.
	Hotswap, Full time.Duration
}

// ReloadTimeline computes a restart's timeline for target p and draft d at
// scale.
func ReloadTimeline(p, d engine.Profile, scale float64) Reload {
	sc := func(x time.Duration) time.Duration { return time.Duration(float64(x) * scale) }
	sec := func(x float64) time.Duration { return time.Duration(x * float64(time.Second)) }
	r := Reload{Draft: sc(d.LoadTime()), Disk: sc(sec(float64(p.WeightBytes) / p.DiskBytesPerSec)), Init: sc(p.EngineInit),
		H2D: sc(sec(float64(p.WeightBytes) / p.H2DBytesPerSec))}
	// Full service when the plain reload would serve again (the sum of
	// the parts rounds a nanosecond apart), unless the draft outlasts the
	// target's disk read and initialisation.
	r.Full = max(sc(p.LoadTime()), r.Draft+r.H2D)
	r.Hotswap = r.Full - r.H2D
	return r
}

// restart walks a killed worker's new incarnation through the phases: it
// registers in LOADING_DRAFT once the failure is detected (a new
// incarnation fails the old one, and registering earlier would detect the
// failure sooner than the plain reload's run does), then ASSIST, HOTSWAP
// and FULL_SERVICE at the timeline's moments from the kill.
func (s *Sim) restart(w *simWorker, detected time.Duration) {
	gen, kill := w.gen, s.now
	tl := ReloadTimeline(s.cfg.Profile, s.draftProf, s.cfg.Timing.ReloadScale)
	span := &PhaseSpan{Worker: w.id, Kill: kill}
	// The MarkFailed of the kill is scheduled at detected already: the
	// registration runs after it.
	s.at(detected, func() {
		if w.gen != gen || w.alive {
			return
		}
		span.Registered = s.now
		w.span = span
		s.register(w, pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT)
	})
	phase := func(at time.Duration, ph pb.WorkerPhase, mark *time.Duration) {
		s.at(max(at, detected), func() {
			if w.gen != gen || !w.alive {
				return
			}
			*mark = s.now
			s.setPhase(w, ph)
			if ph == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
				s.endSpan(w)
			}
		})
	}
	phase(kill+tl.Draft, pb.WorkerPhase_WORKER_PHASE_ASSIST, &span.Assist)
	phase(kill+tl.Hotswap, pb.WorkerPhase_WORKER_PHASE_HOTSWAP, &span.Hotswap)
	phase(kill+tl.Full, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, &span.Full)
}

func (s *Sim) endSpan(w *simWorker) {
	if w.span != nil {
		s.res.Phases = append(s.res.Phases, *w.span)
		w.span = nil
	}
}

var phaseReason = map[pb.WorkerPhase]string{
	pb.WorkerPhase_WORKER_PHASE_ASSIST:       "draft model loaded",
	pb.WorkerPhase_WORKER_PHASE_HOTSWAP:      "weights in host memory, engine initialised",
	pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE: "weights on the GPU",
}

// setPhase commits a phase change of w's incarnation, then follows the
// pairings it made or ended.
func (s *Sim) setPhase(w *simWorker, ph pb.WorkerPhase) {
	w.phase = ph
	w.reporter.Eager(ph == pb.WorkerPhase_WORKER_PHASE_DRAINING) // as the worker's drain does
	res := s.apply(&pb.Command{Body: &pb.Command_SetPhase{SetPhase: &pb.SetPhaseCmd{WorkerId: w.id, Incarnation: w.inc,
		Phase: ph, Reason: phaseReason[ph]}}})
	if res.Err != nil {
		s.fail("%s: phase %s: %v", w.id, ph, res.Err)
		return
	}
	if ph == pb.WorkerPhase_WORKER_PHASE_DRAINING {
		s.drainStart()
	}
	s.relink()
}

// --- pairing ---

// assist is one pairing: a drafter (a restarted worker in ASSIST) drafting
// for its target over the Assist stream.
type assist struct {
	target, drafter *simWorker
	d               *core.Drafter
	mirror          core.Mirror
	busy            bool // a draft step is running
	closed          bool
	from            time.Duration
	tokens          int // the target's committed tokens when paired
	drafted         int
	out             [][]int32 // a draft step's tokens, reused
	tok             []int32
}

// relink makes the simulated pairings those of the fsm's worker rows: a
// drafter in ASSIST whose row names a live target in full service (whose
// row names it back) is linked to it; a link the rows no longer show ends.
// Called after every command that can pair or unpair (registration, phase
// change, MarkFailed).
func (s *Sim) relink() {
	if !s.cfg.Speculation {
		return
	}
	for _, w := range s.workers {
		if !w.alive || w.phase != pb.WorkerPhase_WORKER_PHASE_ASSIST {
			if a := w.as; a != nil && a.drafter == w {
				s.unpair(a)
			}
			continue
		}
		t := s.partner(w)
		if a := w.as; a != nil && a.target != t {
			s.unpair(a)
		}
		if w.as == nil && t != nil {
			if t.as != nil {
				s.unpair(t.as)
			}
			s.pair(w, t)
		}
	}
}

// partner is the live target the fsm paired drafter w's incarnation with,
// or nil.
func (s *Sim) partner(w *simWorker) *simWorker {
	row := w.cell.fsm.Worker(w.id)
	if row == nil || row.Incarnation != w.inc {
		return nil
	}
	t := s.byWorker[row.PairedWorker]
	if t == nil || !t.alive || t.phase != pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
		return nil
	}
	if tr := t.cell.fsm.Worker(t.id); tr == nil || tr.Incarnation != t.inc || !core.Paired(row, tr) {
		return nil
	}
	return t
}

// pair links drafter d to target t: speculation on at the target, its
// running requests mirrored to a new Drafter.
func (s *Sim) pair(d, t *simWorker) {
	s.sync(t) // the mirror reads its rows
	a := &assist{target: t, drafter: d, d: core.NewDrafter(0), from: s.now, tokens: t.tokens}
	d.as, t.as = a, a
	t.core.SetSpec(s.specConfig())
	s.mirror(a)
}

// specConfig is target c's speculation, as a worker's (core.TargetSpec):
// a fixed K, or adaptive K over the profile's fused step cost
// (core.ChooseK is pipeline-aware).
func (s *Sim) specConfig() core.SpecConfig {
	return core.TargetSpec(s.cfg.Spec.K, &s.cfg.Profile, 0)
}

// unpair ends a pairing: speculation off at the target (its Mirror goes
// with the pairing), the drafter's state dropped; messages in flight are
// void.
func (s *Sim) unpair(a *assist) {
	if a.closed {
		return
	}
	a.closed = true
	if t := a.target; t.alive && t.core != nil {
		t.core.SetSpec(core.SpecConfig{})
	}
	a.mirror.Reset()
	a.d.Reset()
	a.d.Output()
	a.target.as, a.drafter.as = nil, nil
	s.res.Pairings = append(s.res.Pairings, Pairing{Drafter: a.drafter.id, Target: a.target.id, From: a.from, To: s.now,
		Tokens: a.target.tokens - a.tokens, Drafted: a.drafted})
}

// --- the Assist stream ---

// mirror sends the target's progress since the last call (new history of
// each running request, the requests that left) and its K to the drafter,
// arriving LinkLatency later.
func (s *Sim) mirror(a *assist) {
	ups := a.mirror.Updates(a.target.core)
	for i := range ups {
		// The core's histories grow in place: the message carries a copy.
		ups[i].Tokens = slices.Clone(ups[i].Tokens)
	}
	k := a.target.core.SpecK()
	s.at(s.now+s.cfg.Timing.LinkLatency, func() {
		if a.closed {
			return
		}
		for _, u := range ups {
			a.d.Apply(u)
		}
		a.d.SetK(k)
		s.draft(a)
	})
}

// draft runs the drafter's next draft step, if it has work and none runs:
// the draft model's step time for its shape (Draft.StepTime), then each
// sampled position gets its draft token (draftToken), and the drafts go to
// the target.
func (s *Sim) draft(a *assist) {
	if a.busy || a.closed {
		return
	}
	free := s.draftProf.KVPages() - a.d.CachedPages()
	st := a.d.Next(free)
	if len(st.Batch) == 0 {
		return
	}
	a.busy = true
	rows, _, prefill := engine.BatchShape(st.Batch)
	s.at(s.now+s.draftProf.StepTime(rows, prefill), func() {
		if a.closed {
			return
		}
		n := len(st.Batch)
		if cap(a.out) < n {
			a.out, a.tok = make([][]int32, n), make([]int32, n)
		}
		out, tok := a.out[:n], a.tok[:n]
		for i, ch := range st.Batch {
			out[i] = nil
			if ch.Sample > 0 {
				tok[i] = s.draftToken(st.IDs[i], st.Pos[i])
				out[i] = tok[i : i+1]
			}
		}
		a.d.Done(out)
		o := a.d.Output()
		a.drafted += o.Drafted
		s.res.Spec.Drafted += o.Drafted
		s.res.Spec.DraftSteps += o.DraftSteps
		a.busy = false
		if len(o.Drafts) > 0 {
			drafts := o.Drafts
			s.at(s.now+s.cfg.Timing.LinkLatency, func() {
				if a.closed {
					return
				}
				for _, d := range drafts {
					a.target.core.OfferDrafts(d.ID, d.Base, d.Tokens)
				}
			})
		}
		s.draft(a)
	})
}

// draftToken is the draft model's token at history position pos of the
// request dispatched as id: the target's own token there with probability
// Alpha, decided by a hash of (seed, request, position) — the same
// whenever the position is drafted again, so a replay never gets a second
// chance — else another token.
func (s *Sim) draftToken(id string, pos int) int32 {
	r := s.byID[id]
	if r == nil {
		return 0 // the request is gone: the draft is never verified
	}
	i := pos - r.w.PromptLen()
	if i < 0 {
		return 0
	}
	t := token(r.idx, i)
	if agrees(s.cfg.Spec.Seed, r.idx, pos, s.alpha()) {
		return t
	}
	return 32 + (t-32+1)%95 // token's range is 32 … 126
}

func (s *Sim) alpha() float64 {
	if a := s.cfg.Spec.Alpha; a > 0 {
		return a
	}
	return core.PriorAcceptance
}

// agrees draws, from (seed, request, position) alone, whether the draft
// agrees with the target there: a splitmix64 of the three, uniform in
// [0, 1), below alpha.
func agrees(seed uint64, req, pos int, alpha float64) bool {
	x := seed ^ uint64(req)*0x9e3779b97f4a7c15 ^ uint64(pos)*0xd1b54a32d192ed03
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	x ^= x >> 31
	return float64(x>>11)/(1<<53) < alpha
}

// --- figures ---

// specFigures fills the lumen column's speculation figures from its run
// and the ablation's (noSpec, the same arrivals with the plain reload).
func specFigures(f *Figures, res, noSpec *Result, failAt time.Duration) {
	sp := res.Spec
	f.DraftTokens, f.AcceptedTokens, f.Verifications, f.Drafted = sp.DraftTokens, sp.AcceptedTokens, sp.Verifications, sp.Drafted
	if sp.DraftTokens > 0 {
		f.AcceptRate = float64(sp.AcceptedTokens) / float64(sp.DraftTokens)
	}
	if sp.KRows > 0 {
		f.SpecKMean = float64(sp.KSum) / float64(sp.KRows)
	}
	var n float64
	for _, ph := range res.Phases {
		if ph.Full == 0 {
			continue
		}
		n++
		f.PhaseLoadingDraftS += (ph.Assist - ph.Registered).Seconds()
		f.PhaseAssistS += (ph.Hotswap - ph.Assist).Seconds()
		f.PhaseHotswapS += (ph.Full - ph.Hotswap).Seconds()
	}
	if n > 0 {
		f.PhaseLoadingDraftS /= n
		f.PhaseAssistS /= n
		f.PhaseHotswapS /= n
	}
	var paired time.Duration
	var tokens, before, ablation float64
	for _, p := range res.Pairings {
		d := p.To - p.From
		if d <= 0 {
			continue
		}
		i := workerIndex(p.Target)
		paired += d
		tokens += float64(p.Tokens)
		before += d.Seconds() * tokenRate(res, i, failAt-10*time.Second, failAt)
		if noSpec != nil {
			ablation += d.Seconds() * tokenRate(noSpec, i, p.From, p.To)
		}
	}
	f.AssistS = paired.Seconds()
	if paired > 0 {
		f.PairedDecodeTokS = tokens / paired.Seconds()
		f.PairedDecodeBeforeTokS = before / paired.Seconds()
		f.PairedDecodeNoSpecTokS = ablation / paired.Seconds()
	}
}

// workerIndex is the index of "worker-N".
func workerIndex(id string) int {
	var n int
	if _, err := fmt.Sscanf(id, "worker-%d", &n); err != nil {
		return -1
	}
	return n - 1
}

// tokenRate is worker i's committed tokens per second between the token
// samples nearest to from and to (Config.TokenSeries); 0 without them.
func tokenRate(res *Result, i int, from, to time.Duration) float64 {
	at := func(t time.Duration) (int, time.Duration) {
		// The last sample at or before t.
		k := sort.Search(len(res.WorkerTokens), func(k int) bool { return res.Queue[k].At > t }) - 1
		if k < 0 || i < 0 || i >= len(res.WorkerTokens[k]) {
			return 0, 0
		}
		return res.WorkerTokens[k][i], res.Queue[k].At
	}
	a, ta := at(max(from, 0))
	b, tb := at(to)
	if tb <= ta {
		return 0
	}
	return float64(b-a) / (tb - ta).Seconds()
}

// PrintSpec writes the lumen column's speculation figures.
func PrintSpec(out io.Writer, f *Figures) {
	if f == nil || f.AssistS == 0 && f.DraftTokens == 0 && f.PhaseAssistS == 0 {
		return
	}
	fmt.Fprintf(out, "lumen's phases per restart: LOADING_DRAFT %.2f s, ASSIST %.2f s, HOTSWAP %.2f s; drafters paired %.1f s in all\n",
		f.PhaseLoadingDraftS, f.PhaseAssistS, f.PhaseHotswapS, f.AssistS)
	fmt.Fprintf(out, "lumen's assist: %d tokens drafted, %d verified, %d accepted (%.1f%%), K %.2f per verifying row (%d rows)\n",
		f.Drafted, f.DraftTokens, f.AcceptedTokens, 100*f.AcceptRate, f.SpecKMean, f.Verifications)
	fmt.Fprintf(out, "the paired workers decoded %.0f tokens/s while assisted; %.0f in the 10 s before the failure; %.0f over the same spans in lumen-no-spec (%s)\n\n",
		f.PairedDecodeTokS, f.PairedDecodeBeforeTokS, f.PairedDecodeNoSpecTokS, Gain(f.PairedDecodeTokS, f.PairedDecodeNoSpecTokS))
}
