package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/completions"
	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/tokenizer"
	"github.com/lumen-project/lumen/worker/engine"
)

// Progressive recovery over real processes: a worker killed with SIGKILL
// restarts (its data directory's run marker says the last run did not shut
// down cleanly) and walks LOADING_DRAFT → ASSIST → HOTSWAP → FULL_SERVICE,
// drafting for the survivor the controller pairs it with, while clients
// stream through the gateway; every output must equal the failure-free,
// speculation-free reference whatever else fails meanwhile.
//
// The workers are paced as Qwen3-14B on an H100 (-profile); they start
// with -emulate-load=false, so the cluster comes up at once, and the
// restarted worker takes the profiles' load times scaled by restartScale:
// the draft (Qwen3-0.6B) about 1 s (LOADING_DRAFT), the target's weights
// into host memory about 4.5 s from the start (ASSIST is the 3.5 s after
// the draft), the copy to the GPU (HOTSWAP) 0.17 s.

// restartScale scales the restarted worker's load times.
const restartScale = 0.2

// progEnv is a quorum, workers of one engine and a gateway.
type progEnv struct {
	cl       *devcluster.Cluster
	ctl      *ctlclient.Client
	workers  []*devcluster.Worker
	gw       *devcluster.Gateway
	engine   string // "synthetic" or "transformer"
	modelDir string
	events   *eventLog
}

func startProgressive(t *testing.T, backend string, workers int) *progEnv {
	t.Helper()
	env := &progEnv{cl: startQuorum(t), engine: backend}
	args := []string{"-engine", backend, "-profile", "qwen3-14b-h100", "-time-scale", "1", "-emulate-load=false", "-kv-pages", "2048"}
	if backend == "transformer" {
		env.modelDir = t.TempDir()
		if _, _, err := engine.InitModel(env.modelDir, engine.DefaultSeed); err != nil {
			t.Fatal(err)
		}
		args = append(args, "-model-dir", env.modelDir)
	}
	for i := 1; i <= workers; i++ {
		w, err := env.cl.AddWorker(fmt.Sprintf("w%d", i), args...)
		if err != nil {
			t.Fatal(err)
		}
		env.workers = append(env.workers, w)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, w := range env.workers {
				if b, err := os.ReadFile(w.LogPath); err == nil {
					t.Logf("--- %s log (tail) ---\n%s", w.ID, tail(string(b), 3000))
				}
			}
		}
	})
	var err error
	if env.ctl, err = ctlclient.New(env.cl.GRPCAddrs(), nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(env.ctl.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if env.gw, err = env.cl.StartGateway(""); err != nil {
		t.Fatal(err)
	}
	if err := env.gw.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	st, err := env.ctl.ClusterStatus(ctx)
	if err != nil {
		t.Fatal(err)
	}
	env.events = watchEvents(t, env.ctl, st.AppliedIndex)
	return env
}

// restart starts a killed worker again, with the profiles' load times
// scaled by restartScale: it is a restart after a failure, so it recovers
// progressively.
func (env *progEnv) restart(t *testing.T, w *devcluster.Worker) {
	env.restartScaled(t, w, restartScale)
}

// restartScaled is restart with the load times scaled by scale.
func (env *progEnv) restartScaled(t *testing.T, w *devcluster.Worker, scale float64) {
	t.Helper()
	if i := slices.Index(w.Args, "-emulate-load=true"); i >= 0 {
		w.Args = w.Args[:i]
	}
	w.Args = append(w.Args, "-emulate-load=true", "-load-scale", strconv.FormatFloat(scale, 'g', -1, 64))
	if err := env.cl.StartWorker(w); err != nil {
		t.Fatal(err)
	}
}

// reference is the failure-free, speculation-free output of a prompt, as
// the gateway renders it.
func (env *progEnv) reference(t *testing.T, prompts []string, maxTokens int) []string {
	t.Helper()
	var tk tokenizer.Tokenizer
	wants := make([]string, len(prompts))
	if env.engine == "transformer" {
		ref, err := engine.NewTransformer(engine.TransformerConfig{Path: filepath.Join(env.modelDir, engine.TargetFile), Pages: 256})
		if err != nil {
			t.Fatal(err)
		}
		for i, p := range prompts {
			wants[i], _, _ = referenceText(t, ref, tk.Encode(p), maxTokens, tokenizer.TokEOS)
		}
		return wants
	}
	p := engine.Profiles["qwen3-14b-h100"]
	for i, pr := range prompts {
		ref, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 256, MaxContext: p.MaxContext})
		if err != nil {
			t.Fatal(err)
		}
		var text []byte
		toks := tk.Encode(pr)
		for n := 0; n < maxTokens; n++ {
			out, err := ref.Forward(context.Background(), []engine.Chunk{{Seq: 1, Tokens: toks, Sample: 1, OutIndex: n}})
			if err != nil {
				t.Fatal(err)
			}
			text = append(text, tk.DecodeToken(out[0][0])...)
			toks = out[0]
		}
		wants[i] = jsonText(text)
	}
	return wants
}

// clients are streams through the gateway.
type clients struct {
	prompts []string
	wants   []string
	got     []string
	errs    []error
	wg      sync.WaitGroup
}

// stream starts n greedy streams of maxTokens each and returns once every
// one has its first token.
func (env *progEnv) stream(t *testing.T, name string, n, maxTokens int) *clients {
	t.Helper()
	c := &clients{prompts: make([]string, n), got: make([]string, n), errs: make([]error, n)}
	for i := range c.prompts {
		c.prompts[i] = fmt.Sprintf("%s: stream %d goes on", name, i)
	}
	c.wants = env.reference(t, c.prompts, maxTokens)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	started := make(chan struct{}, n)
	for i := range c.prompts {
		c.wg.Go(func() {
			signalled := false
			res, err := completions.Stream(ctx, http.DefaultClient, env.gw.Addr, completions.Body(c.prompts[i], maxTokens, false), func(ch completions.Chunk) {
				if !signalled && ch.Text != "" {
					signalled = true
					started <- struct{}{}
				}
			})
			if !signalled {
				started <- struct{}{}
			}
			c.got[i], c.errs[i] = res.Text, err
		})
	}
	for range c.prompts {
		<-started
	}
	return c
}

// check waits for every stream and compares it with the reference.
func (c *clients) check(t *testing.T) {
	t.Helper()
	c.wg.Wait()
	for i := range c.prompts {
		if c.errs[i] != nil {
			t.Errorf("stream %d ended with an error: %v", i, c.errs[i])
		} else if c.got[i] != c.wants[i] {
			t.Errorf("stream %d differs from the reference:\n got  %q\n want %q", i, c.got[i], c.wants[i])
		}
	}
}

// eventLog collects the controller's events from an index on, across
// leader changes (a broken stream reopens after the last event it got).
type eventLog struct {
	mu      sync.Mutex
	evs     []*pb.Event
	changed chan struct{} // closed and replaced at each event
}

func watchEvents(t *testing.T, ctl *ctlclient.Client, from uint64) *eventLog {
	l := &eventLog{changed: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		next := from
		for ctx.Err() == nil {
			s, err := ctl.WatchEvents(ctx, next)
			if err != nil {
				select {
				case <-ctx.Done():
				case <-time.After(50 * time.Millisecond):
				}
				continue
			}
			for {
				ev, err := s.Recv()
				if err != nil {
					break
				}
				if ev.Index < next {
					continue // replayed from the index we reopened at
				}
				l.mu.Lock()
				// Events of one index come together; reopening at it
				// replays those already seen.
				dup := false
				for i := len(l.evs) - 1; i >= 0 && l.evs[i].Index == ev.Index; i-- {
					dup = dup || l.evs[i].Seq == ev.Seq
				}
				if !dup {
					l.evs = append(l.evs, ev)
					close(l.changed)
					l.changed = make(chan struct{})
				}
				l.mu.Unlock()
				next = ev.Index
			}
		}
	}()
	return l
}

// waitFor returns the first event, after position after in the log, that
// match accepts, and its position; it fails the test after timeout.
func (l *eventLog) waitFor(t *testing.T, timeout time.Duration, what string, after int, match func(*pb.Event) bool) (*pb.Event, int) {
	t.Helper()
	deadline := time.After(timeout)
	for i := after + 1; ; {
		l.mu.Lock()
		for ; i < len(l.evs); i++ {
			if match(l.evs[i]) {
				ev := l.evs[i]
				l.mu.Unlock()
				return ev, i
			}
		}
		changed := l.changed
		l.mu.Unlock()
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
	}
}

// phase matches a phase change of worker id to phase, in an incarnation
// other than notInc.
func phase(id string, notInc uint64, to pb.WorkerPhase) func(*pb.Event) bool {
	return func(ev *pb.Event) bool {
		pc := ev.GetPhaseChanged()
		return pc != nil && pc.WorkerId == id && pc.Incarnation != notInc && pc.To == to
	}
}

// pairedEvent matches the pairing (or its end, paired false) of drafter id.
func pairedEvent(id string, paired bool) func(*pb.Event) bool {
	return func(ev *pb.Event) bool {
		p := ev.GetPaired()
		return p != nil && p.DrafterId == id && p.Paired == paired
	}
}

func (env *progEnv) byID(id string) *devcluster.Worker {
	for _, w := range env.workers {
		if w.ID == id {
			return w
		}
	}
	return nil
}

// metric reads a worker's metric.
func metric(t *testing.T, w *devcluster.Worker, name string) float64 {
	t.Helper()
	return metricValue(t, "http://"+w.HTTPAddr+"/metrics", name)
}

// killBusiest kills the worker with the most requests in flight and
// returns it and its incarnation.
func (env *progEnv) killBusiest(t *testing.T, skip ...*devcluster.Worker) (*devcluster.Worker, uint64) {
	t.Helper()
	v := busiest(t, env.workers, skip...)
	_, inc := workerPhase(t, env.ctl, v.ID)
	t.Logf("kill -9 %s (incarnation %d) with %d requests in flight", v.ID, inc, countInFlight(t, v))
	env.cl.KillWorker(v)
	return v, inc
}

// walk waits for worker id's new incarnation (not notInc) to commit the
// phases of progressive recovery in order, from event position after, and
// returns the positions of its ASSIST, HOTSWAP and FULL_SERVICE events.
func (env *progEnv) walk(t *testing.T, id string, notInc uint64, after int) (assist, hotswap, full int) {
	t.Helper()
	_, i := env.events.waitFor(t, 30*time.Second, id+" registered in LOADING_DRAFT", after, phase(id, notInc, pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT))
	_, assist = env.events.waitFor(t, 30*time.Second, id+" in ASSIST", i, phase(id, notInc, pb.WorkerPhase_WORKER_PHASE_ASSIST))
	_, hotswap = env.events.waitFor(t, 30*time.Second, id+" in HOTSWAP", assist, phase(id, notInc, pb.WorkerPhase_WORKER_PHASE_HOTSWAP))
	_, full = env.events.waitFor(t, 30*time.Second, id+" in FULL_SERVICE", hotswap, phase(id, notInc, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE))
	return assist, hotswap, full
}

// assistFigures logs and returns the drafts a target verified and
// accepted, and what the drafter proposed.
func assistFigures(t *testing.T, target, drafter *devcluster.Worker) (verified, accepted float64) {
	t.Helper()
	verified = metric(t, target, "lumen_worker_spec_draft_tokens_total")
	accepted = metric(t, target, "lumen_worker_spec_accepted_tokens_total")
	verifications := metric(t, target, "lumen_worker_spec_verifications_total")
	proposed := "? (it is dead)"
	if drafter.Running() {
		proposed = fmt.Sprint(metric(t, drafter, "lumen_worker_drafted_tokens_total"))
	}
	rate := 0.0
	if verified > 0 {
		rate = accepted / verified
	}
	t.Logf("%s verified %v drafts of %s in %v verifications and accepted %v (%.2f of the drafts verified; %.2f tokens per verification beyond its own; estimated acceptance %.2f); %s proposed %v",
		target.ID, verified, drafter.ID, verifications, accepted, rate, accepted/max(verifications, 1),
		metric(t, target, "lumen_worker_spec_acceptance"), drafter.ID, proposed)
	return verified, accepted
}

// TestProgressiveRecoveryAssists: the killed worker restarts and walks the
// phases; in ASSIST it is paired with the survivor of highest q_w and
// drafts for it, drafts are accepted, and every stream equals the
// reference.
func TestProgressiveRecoveryAssists(t *testing.T) {
	for _, backend := range []string{"synthetic", "transformer"} {
		t.Run(backend, func(t *testing.T) {
			env := startProgressive(t, backend, 3)
			c := env.stream(t, "assist", 24, 640)
			v, inc := env.killBusiest(t)
			env.restart(t, v)
			assist, _, _ := env.walk(t, v.ID, inc, -1)
			ev, _ := env.events.waitFor(t, 30*time.Second, v.ID+" paired", assist, pairedEvent(v.ID, true))
			p := ev.GetPaired()
			t.Logf("%s paired with %s: %s", v.ID, p.TargetId, p.Reason)
			c.check(t)
			target := env.byID(p.TargetId)
			if _, accepted := assistFigures(t, target, v); accepted == 0 {
				t.Errorf("%s accepted no draft of %s", target.ID, v.ID)
			}
			if got := metric(t, v, "lumen_worker_drafted_tokens_total"); got == 0 {
				t.Errorf("%s proposed no draft", v.ID)
			}
			for _, ph := range []string{"LOADING_DRAFT", "ASSIST", "HOTSWAP"} {
				s, err := devcluster.ScrapeMetric(context.Background(), "http://"+v.HTTPAddr+"/metrics",
					`lumen_worker_recovery_phase_seconds{phase="`+ph+`"}`)
				if err != nil {
					t.Fatal(err)
				}
				t.Logf("%s: %.2f s in %s", v.ID, s, ph)
			}
		})
	}
}

// waitMetric polls a worker's metric until ok accepts it.
func waitMetric(t *testing.T, w *devcluster.Worker, name, what string, ok func(float64) bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if v, err := w.Metric(context.Background(), name); err == nil && ok(v) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s (%s on %s)", what, name, w.ID)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// assisting waits until the drafter's partner has accepted drafts: the
// assist runs.
func (env *progEnv) assisting(t *testing.T, drafter string, after int) (*devcluster.Worker, int) {
	t.Helper()
	ev, i := env.events.waitFor(t, 30*time.Second, drafter+" paired", after, pairedEvent(drafter, true))
	target := env.byID(ev.GetPaired().TargetId)
	t.Logf("%s paired with %s: %s", drafter, target.ID, ev.GetPaired().Reason)
	waitMetric(t, target, "lumen_worker_spec_accepted_tokens_total", target.ID+" accepting drafts", func(v float64) bool { return v > 0 })
	return target, i
}

// TestDrafterDiesDuringAssist: the restarted worker is killed again while
// it drafts. Its partner runs on without drafts (its Assist stream ends,
// the controller ends the pairing when it marks the drafter failed), and no
// output changes.
func TestDrafterDiesDuringAssist(t *testing.T) {
	env := startProgressive(t, "synthetic", 3)
	c := env.stream(t, "drafter dies", 24, 640)
	v, inc := env.killBusiest(t)
	env.restart(t, v)
	_, assist := env.events.waitFor(t, 30*time.Second, v.ID+" in ASSIST", -1, phase(v.ID, inc, pb.WorkerPhase_WORKER_PHASE_ASSIST))
	target, paired := env.assisting(t, v.ID, assist)
	t.Logf("kill -9 the drafter %s while %s verifies its drafts", v.ID, target.ID)
	env.cl.KillWorker(v)
	waitMetric(t, target, "lumen_worker_assist_streams", "the end of the Assist stream", func(v float64) bool { return v == 0 })
	ev, _ := env.events.waitFor(t, 30*time.Second, "the end of "+v.ID+"'s pairing", paired, pairedEvent(v.ID, false))
	t.Logf("pairing ended: %s", ev.GetPaired().Reason)
	c.check(t)
	assistFigures(t, target, v)
}

// TestPartnerDiesDuringAssist: the drafter's partner is killed while it
// verifies drafts. Its requests recover as usual, on the other survivor;
// the drafter is paired again, with that survivor, still in ASSIST, and
// every output equals the reference.
func TestPartnerDiesDuringAssist(t *testing.T) {
	env := startProgressive(t, "synthetic", 3)
	c := env.stream(t, "partner dies", 24, 800)
	v, inc := env.killBusiest(t)
	// A longer ASSIST (about 7 s): it outlasts the partner's failure
	// detection and the new pairing.
	env.restartScaled(t, v, 0.4)
	_, assist := env.events.waitFor(t, 30*time.Second, v.ID+" in ASSIST", -1, phase(v.ID, inc, pb.WorkerPhase_WORKER_PHASE_ASSIST))
	partner, paired := env.assisting(t, v.ID, assist)
	_, pinc := workerPhase(t, env.ctl, partner.ID)
	t.Logf("kill -9 the partner %s", partner.ID)
	env.cl.KillWorker(partner)
	_, failed := env.events.waitFor(t, 30*time.Second, partner.ID+" marked FAILED", paired, phase(partner.ID, 0, pb.WorkerPhase_WORKER_PHASE_FAILED))
	env.events.waitFor(t, 30*time.Second, "a recovery plan for "+partner.ID+"'s requests", paired, func(ev *pb.Event) bool {
		rp := ev.GetRecoveryPlan()
		return rp != nil && rp.FailedWorker == partner.ID && rp.FailedIncarnation == pinc
	})
	ev, again := env.events.waitFor(t, 30*time.Second, v.ID+" paired again", failed, pairedEvent(v.ID, true))
	if ev.GetPaired().TargetId == partner.ID {
		t.Fatalf("%s paired again with the dead %s", v.ID, partner.ID)
	}
	t.Logf("%s paired again with %s: %s", v.ID, ev.GetPaired().TargetId, ev.GetPaired().Reason)
	_, hotswap, _ := env.walk(t, v.ID, inc, -1)
	if hotswap < again {
		t.Errorf("%s left ASSIST before it was paired again", v.ID)
	}
	c.check(t)
	survivor := env.byID(ev.GetPaired().TargetId)
	if _, accepted := assistFigures(t, survivor, v); accepted == 0 {
		t.Errorf("%s accepted no draft from %s after the new pairing", survivor.ID, v.ID)
	}
}

// TestFailureDuringHotswap: the restarted worker is killed again while it
// copies its weights to the device (HOTSWAP). The controller marks that
// incarnation failed from HOTSWAP; restarted once more it recovers
// progressively again, and no output changes.
func TestFailureDuringHotswap(t *testing.T) {
	env := startProgressive(t, "synthetic", 3)
	c := env.stream(t, "hotswap", 24, 800)
	v, inc := env.killBusiest(t)
	// HOTSWAP takes 0.25 s at this scale: long enough to be killed in.
	env.restartScaled(t, v, 0.3)
	ev, hot := env.events.waitFor(t, 60*time.Second, v.ID+" in HOTSWAP", -1, phase(v.ID, inc, pb.WorkerPhase_WORKER_PHASE_HOTSWAP))
	inc2 := ev.GetPhaseChanged().Incarnation
	t.Logf("kill -9 %s in HOTSWAP", v.ID)
	env.cl.KillWorker(v)
	ev, _ = env.events.waitFor(t, 30*time.Second, v.ID+" marked FAILED", hot, func(ev *pb.Event) bool {
		pc := ev.GetPhaseChanged()
		return pc != nil && pc.WorkerId == v.ID && pc.Incarnation == inc2 && pc.To != pb.WorkerPhase_WORKER_PHASE_HOTSWAP
	})
	if pc := ev.GetPhaseChanged(); pc.From != pb.WorkerPhase_WORKER_PHASE_HOTSWAP || pc.To != pb.WorkerPhase_WORKER_PHASE_FAILED {
		t.Fatalf("%s incarnation %d went from %s to %s after the kill in HOTSWAP", v.ID, inc2, pc.From, pc.To)
	}
	env.restart(t, v)
	env.walk(t, v.ID, inc2, hot)
	c.check(t)
}

// TestLeaderDiesDuringPhaseChange: the controller leader is killed as the
// restarted worker enters HOTSWAP, so its next phase change (to
// FULL_SERVICE, a fraction of a second later) meets an election. The
// worker retries the change until the new leader commits it, once, and no
// output changes.
func TestLeaderDiesDuringPhaseChange(t *testing.T) {
	env := startProgressive(t, "synthetic", 3)
	c := env.stream(t, "leader dies", 24, 640)
	v, inc := env.killBusiest(t)
	env.restart(t, v)
	_, hot := env.events.waitFor(t, 60*time.Second, v.ID+" in HOTSWAP", -1, phase(v.ID, inc, pb.WorkerPhase_WORKER_PHASE_HOTSWAP))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	leader, err := env.cl.WaitLeader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("kill -9 the leader %s", env.cl.Controllers[leader].ID)
	env.cl.Kill(leader)
	t.Cleanup(func() { _ = env.cl.Restart(leader) })
	_, full := env.events.waitFor(t, 30*time.Second, v.ID+" in FULL_SERVICE", hot, phase(v.ID, inc, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE))
	c.check(t)
	// Exactly one commit of each phase.
	env.events.mu.Lock()
	counts := map[pb.WorkerPhase]int{}
	for _, ev := range env.events.evs[:full+1] {
		if pc := ev.GetPhaseChanged(); pc != nil && pc.WorkerId == v.ID && pc.Incarnation != inc {
			counts[pc.To]++
		}
	}
	env.events.mu.Unlock()
	for _, p := range []pb.WorkerPhase{pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT, pb.WorkerPhase_WORKER_PHASE_ASSIST,
		pb.WorkerPhase_WORKER_PHASE_HOTSWAP, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE} {
		if counts[p] != 1 {
			t.Errorf("%s entered %s %d times", v.ID, p, counts[p])
		}
	}
	env.events.mu.Lock()
	gap := time.Duration(env.events.evs[full].UnixNano - env.events.evs[hot].UnixNano)
	env.events.mu.Unlock()
	t.Logf("HOTSWAP to FULL_SERVICE across the election: %s between the commits (the copy itself takes %s)", gap.Round(time.Millisecond),
		time.Duration(float64(engine.Profiles["qwen3-14b-h100"].HotswapTime())*restartScale).Round(time.Millisecond))
}
