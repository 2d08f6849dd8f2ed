package core

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/lumen-project/lumen/worker/engine"
)

// modelDir holds the default transformer model and its draft, written once
// by TestMain.
var modelDir string

var specSeed = flag.Uint64("spec.seed", 0, "seed of the speculation oracles (0: from the clock)")

func TestMain(m *testing.M) {
	flag.Parse()
	dir, err := os.MkdirTemp("", "lumen-core-test-")
	if err != nil {
		panic(err)
	}
	modelDir = dir
	if _, _, err := engine.InitModel(dir, engine.DefaultSeed); err != nil {
		panic(err)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// testSeed is -spec.seed, or the clock's; it is logged either way.
func testSeed(t testing.TB) uint64 {
	s := *specSeed
	if s == 0 {
		s = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d (rerun with -spec.seed=%d)", s, s)
	return s
}

// newTransformer loads the default target (draft: its early-exit draft).
func newTransformer(t testing.TB, draft bool, pages int) *engine.Transformer {
	t.Helper()
	file := engine.TargetFile
	if draft {
		file = engine.DraftFile
	}
	e, err := engine.NewTransformer(engine.TransformerConfig{Path: filepath.Join(modelDir, file), Pages: pages})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func newSynthetic(t testing.TB, pages int) *engine.Synthetic {
	t.Helper()
	e, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: pages})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// specReq is one request of an oracle run and what it must produce.
type specReq struct {
	id     string
	prompt []int32
	max    int
	params engine.Sampling
	stop   map[int32]bool
	at     int     // arrival tick
	ref    []int32 // the reference run's max tokens
	want   []int32 // ref up to its first stop token
	pages  [][]byte
	hashes []uint64 // of the reference's full pages
	// logprobs asks for each token's logprobs with top alternatives;
	// refLP are the reference run's.
	logprobs bool
	top      int
	refLP    []engine.Logprobs
}

// referenceRun decodes every request without speculation on e, all in one
// batch (the engines' own oracle shows batching changes no token), and
// keeps each request's tokens and full KV pages.
func referenceRun(t testing.TB, e engine.Engine, reqs []*specReq) {
	t.Helper()
	ctx := context.Background()
	const base = engine.SeqID(1 << 40)
	batch := make([]engine.Chunk, len(reqs))
	for i, q := range reqs {
		batch[i] = engine.Chunk{Seq: base + engine.SeqID(i), Tokens: q.prompt, Sample: 1, Params: q.params}
		if q.logprobs {
			batch[i].Logprobs, batch[i].TopLogprobs = make([]engine.Logprobs, 1), q.top
		}
		q.ref, q.refLP = nil, nil
	}
	for len(batch) > 0 {
		out, err := e.Forward(ctx, batch)
		if err != nil {
			t.Fatalf("reference: %v", err)
		}
		next := batch[:0]
		for i, ch := range batch {
			q := reqs[ch.Seq-base]
			q.ref = append(q.ref, out[i][0])
			if q.logprobs {
				q.refLP = append(q.refLP, ch.Logprobs[0])
			}
			if len(q.ref) < q.max {
				c := engine.Chunk{Seq: ch.Seq, Tokens: q.ref[len(q.ref)-1:], Sample: 1, Params: q.params, OutIndex: len(q.ref)}
				if q.logprobs {
					c.Logprobs, c.TopLogprobs = make([]engine.Logprobs, 1), q.top
				}
				next = append(next, c)
			}
		}
		batch = next
	}
	for i, q := range reqs {
		seq := base + engine.SeqID(i)
		q.pages = nil
		for p := 0; (p+1)*engine.PageTokens <= e.Len(seq); p++ {
			data, err := e.ExportPage(seq, p)
			if err != nil {
				t.Fatal(err)
			}
			q.pages = append(q.pages, data)
		}
		q.hashes = PageHashes(slices.Concat(q.prompt, q.ref)[:e.Len(seq)], nil)
		e.Release(seq)
		q.setWant()
	}
}

// setWant cuts the reference at the first stop token.
func (q *specReq) setWant() {
	q.want = q.ref
	for j, tok := range q.ref {
		if q.stop[tok] {
			q.want = q.ref[:j+1]
			break
		}
	}
}

// specFaults are what goes wrong, at random, in an oracle run; the zero
// value is a perfect link and a drafter that keeps up.
type specFaults struct {
	updateDelay, draftDelay int     // ticks, at most
	dropDraft, reorderDraft float64 // per draft sent
	midStepUpdate           float64 // per draft step: updates land between Next and Done
	reset, midStepReset     float64 // per tick, per draft step: the pairing ends and a new one starts
	changeK                 float64 // per tick: the target's SpecConfig changes
	supersede, cancel       float64 // per tick: a request's call is taken over / its client leaves
	draftSteps              int     // draft steps per target step, at most (0: until the drafter settles)
}

// specRig runs a target Core and a Drafter in one loop over real engines:
// the mirror updates go one way, the drafts the other, each over a link
// that may delay, drop or reorder them (drafts) or delay them (the ordered
// mirror stream), as faults say.
type specRig struct {
	t      testing.TB
	rng    *rand.Rand
	faults specFaults

	c        *Core
	tgt      engine.Engine
	tgtPages int
	holder   string // the requests' checkpoint holder ("": none)
	// store, when set, is the holder's: the checkpoint pages exported go
	// in, and the Core (built over it) restores a new call's prefix.
	store     memStore
	importing int // pages of the step's restores, not imported yet

	dr       *Drafter // nil: no drafter
	dft      engine.Engine
	dftPages int
	// agree, when set, overrides the draft engine (the synthetic one): a
	// draft on the reference's path equals the target's next token with
	// this probability, and differs from it otherwise — the same for
	// greedy and sampled requests.
	agree float64
	// beforeStep, when set, runs before each target step (tests that
	// offer drafts themselves).
	beforeStep func()
	mirror     Mirror
	specCfgs   []SpecConfig // what changeK picks from

	tick      int
	now       time.Time
	toDrafter []mirrorBatch
	toTarget  []sentDraft

	reqs       map[string]*specReq
	calls      map[string]*Request // the current call of each id
	superseded map[*Request]bool
	canceled   map[string]bool
	out        map[string][]int32
	finished   map[string]Finish

	// Counters.
	total                   Output
	steps, decodeSteps      int
	modelled                time.Duration // the target's steps on a GPU profile
	profile                 *engine.Profile
	targetTime              time.Duration // wall time in the target's engine and core
	draftSteps, resets      int
	kChanges, supersessions int
	comparedPages           int
	ksum                    int // sum of the K of decode steps
	tokens                  int // tokens streamed
	// Decode steps alone (no prefill in the batch; with fullRows set,
	// only those of fullRows rows): wall time, tokens committed, rows,
	// the GPU profile's time.
	fullRows        int
	cpuClock        bool          // also count the target's thread CPU time
	decodeCPU       time.Duration // the target's thread CPU time in them
	decodeTime      time.Duration
	decodeTokens    int
	decodeRows      int
	decodeModelled  time.Duration
	rejections      int // verifications that rejected a draft
	sampledAccepted int // drafts accepted for requests that sample
}

type mirrorBatch struct {
	due int
	ups []MirrorUpdate
	k   int
}

type sentDraft struct {
	due int
	d   Draft
}

func newSpecRig(t testing.TB, rng *rand.Rand, c *Core, tgt engine.Engine) *specRig {
	return &specRig{t: t, rng: rng, c: c, tgt: tgt, tgtPages: tgt.Info().TotalPages, now: time.Unix(1000, 0),
		reqs: map[string]*specReq{}, calls: map[string]*Request{}, superseded: map[*Request]bool{},
		canceled: map[string]bool{}, out: map[string][]int32{}, finished: map[string]Finish{}}
}

func (g *specRig) withDrafter(d *Drafter, dft engine.Engine) {
	g.dr, g.dft, g.dftPages = d, dft, dft.Info().TotalPages
}

func (g *specRig) chance(p float64) bool { return p > 0 && g.rng != nil && g.rng.Float64() < p }

func (g *specRig) upTo(n int) int {
	if n <= 0 || g.rng == nil {
		return 0
	}
	return g.rng.IntN(n + 1)
}

func (g *specRig) submit(q *specReq) {
	generated := g.out[q.id]
	r := &Request{ID: q.id, History: slices.Concat(q.prompt, generated), Prompt: len(q.prompt), MaxTokens: q.max,
		Params: q.params, Stop: q.stop, Holder: g.holder, Reserved: 1 << 40, Arrived: g.now, Logprobs: q.logprobs, TopLogprobs: q.top}
	if old := g.calls[q.id]; old != nil {
		g.superseded[old] = true
	}
	g.calls[q.id] = r
	g.c.Submit(r)
	g.applyTarget()
}

// applyTarget carries out the Core's Output on the target engine and checks
// every token and every checkpoint page against the reference.
func (g *specRig) applyTarget() {
	t := g.t
	t.Helper()
	o := g.c.Output()
	for _, s := range o.Release {
		g.tgt.Release(s)
	}
	for _, tr := range o.Truncates {
		if err := g.tgt.Truncate(tr.Seq, tr.Len); err != nil {
			t.Fatalf("tick %d: truncate: %v", g.tick, err)
		}
	}
	for _, ev := range o.Events {
		id := ev.Req.ID
		if ev.Err != nil {
			if errors.Is(ev.Err, ErrSuperseded) && g.superseded[ev.Req] {
				continue
			}
			t.Fatalf("tick %d: request %s: %v", g.tick, id, ev.Err)
		}
		if ev.Index != len(g.out[id]) {
			t.Fatalf("tick %d: request %s: token index %d after %d tokens", g.tick, id, ev.Index, len(g.out[id]))
		}
		g.out[id] = append(g.out[id], ev.Token)
		g.tokens++
		q := g.reqs[id]
		if n := len(g.out[id]); n > len(q.want) || g.out[id][n-1] != q.want[n-1] {
			t.Fatalf("tick %d: request %s: token %d is %d, the reference %v", g.tick, id, n-1, ev.Token, q.want)
		}
		// Its logprobs are the reference's, bit for bit, whether it was
		// decoded, verified as an accepted draft, or computed after a
		// restore or a preemption.
		if n := len(g.out[id]); q.logprobs != (ev.Logprobs != nil) {
			t.Fatalf("tick %d: request %s: token %d's logprobs %v; asked for: %v", g.tick, id, n-1, ev.Logprobs, q.logprobs)
		} else if q.logprobs && !reflect.DeepEqual(*ev.Logprobs, q.refLP[n-1]) {
			t.Fatalf("tick %d: request %s: token %d's logprobs %+v, the reference's %+v", g.tick, id, n-1, *ev.Logprobs, q.refLP[n-1])
		}
		if ev.Finish != FinishNone {
			g.finished[id] = ev.Finish
		}
	}
	for _, p := range o.Checkpoints {
		q := g.reqs[p.Req.ID]
		data, err := g.tgt.ExportPage(p.Seq, p.Page)
		if err != nil {
			t.Fatalf("tick %d: export page %d of %s: %v", g.tick, p.Page, q.id, err)
		}
		if p.Page >= len(q.pages) || !bytes.Equal(data, q.pages[p.Page]) || p.Hash != q.hashes[p.Page] {
			t.Fatalf("tick %d: request %s: checkpoint page %d differs from the reference run's", g.tick, q.id, p.Page)
		}
		g.comparedPages++
		if g.store != nil {
			g.store[p.Hash] = data // the holder keeps it; a new call restores it
		}
	}
	g.total.RestoredPages += o.RestoredPages
	g.total.Preemptions += o.Preemptions
	g.total.Completed += o.Completed
	g.total.DraftTokens += o.DraftTokens
	g.total.AcceptedTokens += o.AcceptedTokens
	g.total.Verifications += o.Verifications
	if free, used := g.tgt.FreePages(), g.c.CachedPages(); free != g.tgtPages-used+g.importing {
		t.Fatalf("tick %d: target engine has %d free pages, the core counts %d of %d in use (%d to import)", g.tick, free, used, g.tgtPages, g.importing)
	}
	for _, r := range g.c.running {
		if n := g.tgt.Len(r.seq); n != r.fed && g.importing == 0 {
			t.Fatalf("tick %d: request %s: the target cache holds %d positions, the core counts %d", g.tick, r.ID, n, r.fed)
		}
	}
}

// targetStep runs one target step; false when there was nothing to run.
func (g *specRig) targetStep() bool {
	t := g.t
	t.Helper()
	start, tokens := time.Now(), g.tokens
	var cpu0 time.Duration
	if g.cpuClock {
		cpu0, _ = threadCPU()
	}
	var decode bool
	defer func() {
		d := time.Since(start)
		g.targetTime += d
		if decode {
			g.decodeTime += d
			g.decodeTokens += g.tokens - tokens
			if g.cpuClock {
				cpu1, _ := threadCPU()
				g.decodeCPU += cpu1 - cpu0
			}
		}
	}()
	st := g.c.Next(g.now, g.tgt.FreePages())
	for _, rs := range st.Restores {
		g.importing += len(rs.Pages)
	}
	g.applyTarget()
	if len(st.Batch) == 0 {
		return false
	}
	for _, rs := range st.Restores {
		if err := g.tgt.ImportPages(rs.Seq, rs.Pages); err != nil {
			// The core counts the pages exactly: an import always fits.
			t.Fatalf("tick %d: import %d pages of %s: %v", g.tick, len(rs.Pages), rs.Req.ID, err)
		}
	}
	g.importing = 0
	rows, k, prefill := st.Shape()
	decode = prefill == 0 && (g.fullRows == 0 || rows == g.fullRows)
	if decode {
		g.decodeSteps++
		g.decodeRows += rows
		g.ksum += k
	}
	if g.profile != nil {
		d := g.profile.StepTimeK(rows, k, prefill)
		g.modelled += d
		if decode {
			g.decodeModelled += d
		}
	}
	out, err := g.tgt.Forward(context.Background(), st.Batch)
	if err != nil {
		// The core counts pages exactly: the engine never runs out.
		t.Fatalf("tick %d: target step: %v", g.tick, err)
	}
	g.steps++
	for i, ch := range st.Batch {
		if d := ch.Tokens[1:]; ch.Sample > 1 {
			m := 0
			for m < len(d) && d[m] == out[i][m] {
				m++
			}
			if m < len(d) {
				g.rejections++
			}
			if ch.Params.Temperature > 0 {
				g.sampledAccepted += m
			}
		}
	}
	g.now = g.now.Add(10 * time.Millisecond)
	g.c.Done(g.now, out)
	g.applyTarget()
	return true
}

// mirrorStep sends the drafter what changed, over the ordered stream.
func (g *specRig) mirrorStep() {
	if g.dr == nil {
		return
	}
	ups := g.mirror.Updates(g.c)
	due := g.tick + g.upTo(g.faults.updateDelay)
	if n := len(g.toDrafter); n > 0 {
		due = max(due, g.toDrafter[n-1].due)
	}
	wire := make([]MirrorUpdate, len(ups))
	for i, u := range ups {
		wire[i] = MirrorUpdate{ID: u.ID, From: u.From, Tokens: slices.Clone(u.Tokens), Ended: u.Ended}
	}
	g.toDrafter = append(g.toDrafter, mirrorBatch{due: due, ups: wire, k: g.c.SpecK()})
}

// deliverUpdates hands the drafter the mirror batches due (all: flush).
func (g *specRig) deliverUpdates(flush bool) {
	for len(g.toDrafter) > 0 && (flush || g.toDrafter[0].due <= g.tick) {
		b := g.toDrafter[0]
		g.toDrafter = g.toDrafter[1:]
		for _, u := range b.ups {
			g.dr.Apply(u)
		}
		g.dr.SetK(b.k)
	}
}

// applyDrafter carries out the Drafter's Output on the draft engine and
// sends its drafts.
func (g *specRig) applyDrafter() {
	t := g.t
	t.Helper()
	o := g.dr.Output()
	for _, s := range o.Release {
		g.dft.Release(s)
	}
	for _, tr := range o.Truncates {
		if err := g.dft.Truncate(tr.Seq, tr.Len); err != nil {
			t.Fatalf("tick %d: draft truncate: %v (the engine holds %d positions; output %+v)", g.tick, err, g.dft.Len(tr.Seq), o)
		}
	}
	for _, d := range o.Drafts {
		if g.chance(g.faults.dropDraft) {
			continue
		}
		g.toTarget = append(g.toTarget, sentDraft{due: g.tick + g.upTo(g.faults.draftDelay), d: d})
	}
	if free, used := g.dft.FreePages(), g.dr.CachedPages(); free != g.dftPages-used {
		t.Fatalf("tick %d: draft engine has %d free pages, the drafter counts %d of %d in use", g.tick, free, used, g.dftPages)
	}
	for _, r := range g.dr.reqs {
		if n := g.dft.Len(r.seq); n != r.fed {
			t.Fatalf("tick %d: draft of %s: the cache holds %d positions, the drafter counts %d", g.tick, r.id, n, r.fed)
		}
	}
}

// refNext is the target's token at history position pos of request id
// when the drafter's line up to it is the reference's.
func (g *specRig) refNext(id string, pos int) (int32, bool) {
	q, r := g.reqs[id], g.dr.reqs[id]
	idx := pos - len(q.prompt)
	if r == nil || idx < 0 || idx >= len(q.ref) || len(r.line) < pos ||
		!slices.Equal(r.line[:len(q.prompt)], q.prompt) || !slices.Equal(r.line[len(q.prompt):pos], q.ref[:idx]) {
		return 0, false
	}
	return q.ref[idx], true
}

// deliverDrafts offers the target the drafts due, in the order sent unless
// a fault swaps two.
func (g *specRig) deliverDrafts() {
	var due []Draft
	kept := g.toTarget[:0]
	for _, s := range g.toTarget {
		if s.due <= g.tick {
			due = append(due, s.d)
		} else {
			kept = append(kept, s)
		}
	}
	g.toTarget = kept
	for i := 1; i < len(due); i++ {
		if g.chance(g.faults.reorderDraft) {
			due[i-1], due[i] = due[i], due[i-1]
		}
	}
	for _, d := range due {
		g.c.OfferDrafts(d.ID, d.Base, d.Tokens)
	}
}

// resetPairing ends the pairing and starts a new one: the drafter drops
// everything, the mirror starts over, the old stream's updates are lost;
// drafts already on their way still arrive (stale).
func (g *specRig) resetPairing() {
	g.dr.Reset()
	g.mirror.Reset()
	g.toDrafter = nil
	g.resets++
}

// draftSteps runs the drafter's steps for one target step.
func (g *specRig) drafterSteps() {
	if g.dr == nil {
		return
	}
	n := g.faults.draftSteps
	if n > 0 {
		n = g.upTo(n)
	} else {
		n = 1 << 20 // until it settles
	}
	for i := 0; i < n; i++ {
		g.deliverUpdates(false)
		g.applyDrafter()
		st := g.dr.Next(g.dft.FreePages())
		if len(st.Batch) == 0 {
			return
		}
		if g.chance(g.faults.midStepUpdate) {
			g.deliverUpdates(false) // queued until Done
		}
		if g.chance(g.faults.midStepReset) {
			g.resetPairing()
		}
		out, err := g.dft.Forward(context.Background(), st.Batch)
		if err != nil {
			g.t.Fatalf("tick %d: draft step: %v", g.tick, err)
		}
		if g.agree > 0 {
			for i, o := range out {
				if tok, ok := g.refNext(st.IDs[i], st.Pos[i]); ok && len(o) == 1 {
					if o[0] = tok; !g.chance(g.agree) {
						o[0] = (tok-32+1+int32(g.rng.IntN(94)))%95 + 32
					}
				}
			}
		}
		g.dr.Done(out)
		g.applyDrafter()
		g.draftSteps++
	}
}

// faultsTick applies this tick's random events.
func (g *specRig) faultsTick() {
	if g.dr != nil && g.chance(g.faults.reset) {
		g.resetPairing()
		g.applyDrafter()
	}
	if len(g.specCfgs) > 0 && g.chance(g.faults.changeK) {
		g.c.SetSpec(g.specCfgs[g.rng.IntN(len(g.specCfgs))])
		g.kChanges++
	}
	reqs := g.c.Requests()
	if len(reqs) > 0 && g.chance(g.faults.supersede) {
		r := reqs[g.rng.IntN(len(reqs))]
		g.submit(g.reqs[r.ID])
		g.supersessions++
	}
	if len(reqs) > 0 && g.chance(g.faults.cancel) {
		r := g.c.Requests()[0]
		g.canceled[r.ID] = true
		g.c.Cancel(r)
		g.applyTarget()
	}
}

// run drives everything to the end, then checks every request's tokens and
// that every page of both engines is free.
func (g *specRig) run(reqs []*specReq) {
	t := g.t
	t.Helper()
	for _, q := range reqs {
		g.reqs[q.id] = q
	}
	arrivals := slices.Clone(reqs)
	slices.SortStableFunc(arrivals, func(a, b *specReq) int { return a.at - b.at })
	for g.tick = 0; ; g.tick++ {
		if g.tick > 100000 {
			t.Fatal("no end after 100000 ticks")
		}
		for len(arrivals) > 0 && arrivals[0].at <= g.tick {
			g.submit(arrivals[0])
			arrivals = arrivals[1:]
		}
		g.faultsTick()
		g.deliverDrafts()
		if g.beforeStep != nil {
			g.beforeStep()
		}
		if !g.targetStep() && len(arrivals) == 0 && g.c.Idle() {
			break
		}
		g.mirrorStep()
		g.drafterSteps()
	}
	if g.dr != nil {
		g.mirrorStep()
		g.deliverUpdates(true)
		g.applyDrafter()
		if n := g.dr.Requests(); n != 0 {
			t.Errorf("the drafter follows %d requests after the target finished", n)
		}
		if free := g.dft.FreePages(); free != g.dftPages {
			t.Errorf("draft engine: %d of %d pages free at the end", free, g.dftPages)
		}
	}
	if free := g.tgt.FreePages(); free != g.tgtPages || g.c.CachedPages() != 0 {
		t.Errorf("target engine: %d of %d pages free at the end (core: %d cached)", free, g.tgtPages, g.c.CachedPages())
	}
	for _, q := range reqs {
		got := g.out[q.id]
		if g.canceled[q.id] {
			if len(got) > len(q.want) || !slices.Equal(got, q.want[:len(got)]) {
				t.Errorf("canceled request %s: %v is not a prefix of the reference %v", q.id, got, q.want)
			}
			continue
		}
		if !slices.Equal(got, q.want) {
			t.Errorf("request %s (%+v): got\n %v\nwant\n %v", q.id, q.params, got, q.want)
		}
		wantFinish := FinishLength
		if len(q.want) < len(q.ref) || q.stop[q.want[len(q.want)-1]] {
			wantFinish = FinishStop
		}
		if g.finished[q.id] != wantFinish {
			t.Errorf("request %s finished %v, want %v", q.id, g.finished[q.id], wantFinish)
		}
	}
}

func (g *specRig) String() string {
	return fmt.Sprintf("%d steps (%d decode), %d verifications, %d/%d drafts accepted (%d sampling), %d draft steps, %d preemptions, %d resets, %d K changes, %d supersessions, %d pages compared, %d restored",
		g.steps, g.decodeSteps, g.total.Verifications, g.total.AcceptedTokens, g.total.DraftTokens, g.sampledAccepted, g.draftSteps,
		g.total.Preemptions, g.resets, g.kChanges, g.supersessions, g.comparedPages, g.total.RestoredPages)
}

// randomSpecReqs makes n requests with varied lengths, half of them with
// seeded sampling, some with a stop token taken from their reference.
func randomSpecReqs(rng *rand.Rand, n, maxPrompt, maxOut, spread int) []*specReq {
	var reqs []*specReq
	for i := range n {
		q := &specReq{id: fmt.Sprintf("r%02d", i), max: 1 + rng.IntN(maxOut), at: rng.IntN(spread + 1),
			logprobs: i%3 == 0, top: i % (engine.MaxTopLogprobs + 1)}
		q.prompt = make([]int32, 1+rng.IntN(maxPrompt))
		for j := range q.prompt {
			q.prompt[j] = 32 + int32(rng.IntN(95))
		}
		if rng.IntN(2) == 1 {
			q.params = engine.Sampling{Temperature: 0.3 + rng.Float32(), TopP: 0.5 + rng.Float32()/2, Seed: rng.Uint64()}
		}
		reqs = append(reqs, q)
	}
	return reqs
}

// addStops gives some requests a stop token from their reference.
func addStops(rng *rand.Rand, reqs []*specReq) {
	for _, q := range reqs {
		if len(q.ref) > 1 && rng.IntN(3) == 0 {
			q.stop = map[int32]bool{q.ref[rng.IntN(len(q.ref))]: true}
			q.setWant()
		}
	}
}
