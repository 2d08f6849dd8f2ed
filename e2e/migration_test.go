package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/completions"
	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Live migration over real processes: a quorum of three controllers,
// synthetic workers paced as Qwen3-14B on an H100, and a gateway; clients
// stream long prompts through the gateway while requests are migrated
// (lumen migrate, a drain, a GPU fault) and processes are killed with
// SIGKILL. Every output must equal the failure-free reference, and no
// worker may hold a KV page once its streams ended.

// migWorkerArgs are every worker's flags: paced, no model load to wait
// for, 2048 KV pages.
var migWorkerArgs = []string{"-engine", "synthetic", "-profile", "qwen3-14b-h100", "-time-scale", "1", "-emulate-load=false",
	"-kv-pages", "2048"}

// migEnv is a quorum, workers and a gateway.
type migEnv struct {
	cl      *devcluster.Cluster
	ctl     *ctlclient.Client
	workers []*devcluster.Worker
	gw      *devcluster.Gateway
	events  *eventLog
}

// startMigration starts n workers, worker i (1-based) with extra(i) added
// to migWorkerArgs.
func startMigration(t *testing.T, n int, extra func(i int) []string) *migEnv {
	t.Helper()
	env := &migEnv{cl: startQuorum(t)}
	for i := 1; i <= n; i++ {
		args := append([]string(nil), migWorkerArgs...)
		if extra != nil {
			args = append(args, extra(i)...)
		}
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

func (env *migEnv) byID(id string) *devcluster.Worker {
	for _, w := range env.workers {
		if w.ID == id {
			return w
		}
	}
	return nil
}

// migStreams are streams through the gateway; ids[i] is stream i's request
// id (the completion's id, which the gateway dispatches under).
type migStreams struct {
	prompts, wants, got []string
	ids                 []string
	errs                []error
	wg                  sync.WaitGroup
}

// longPrompt is a prompt of about n bytes (tokens: the tokenizer is
// byte-level), distinct per name and i.
func longPrompt(name string, i, n int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s, stream %d:", name, i)
	for k := 0; b.Len() < n; k++ {
		fmt.Fprintf(&b, " %s-%d-%d", name, i, k*k%997)
	}
	return b.String()[:n]
}

// stream starts n greedy streams with prompts of promptLen bytes and
// returns once each has its first token (and so its id).
func (env *migEnv) stream(t *testing.T, name string, n, promptLen, maxTokens int) *migStreams {
	t.Helper()
	s := &migStreams{prompts: make([]string, n), got: make([]string, n), ids: make([]string, n), errs: make([]error, n)}
	for i := range s.prompts {
		s.prompts[i] = longPrompt(name, i, promptLen)
	}
	s.wants = (&progEnv{engine: "synthetic"}).reference(t, s.prompts, maxTokens)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	started := make(chan struct{}, n)
	for i := range s.prompts {
		s.wg.Go(func() {
			signalled := false
			res, err := completions.Stream(ctx, http.DefaultClient, env.gw.Addr, completions.Body(s.prompts[i], maxTokens, false),
				func(ch completions.Chunk) {
					if !signalled && ch.Text != "" {
						s.ids[i] = ch.ID
						signalled = true
						started <- struct{}{}
					}
				})
			if !signalled {
				started <- struct{}{}
			}
			s.got[i], s.errs[i] = res.Text, err
		})
	}
	for range s.prompts {
		<-started
	}
	for i, id := range s.ids {
		if id == "" {
			t.Fatalf("stream %d got no token: %v", i, s.errs[i])
		}
	}
	return s
}

// check waits for every stream and compares it with the reference.
func (s *migStreams) check(t *testing.T) {
	t.Helper()
	s.wg.Wait()
	for i := range s.prompts {
		if s.errs[i] != nil {
			t.Errorf("stream %d (%s) ended with an error: %v", i, s.ids[i], s.errs[i])
		} else if s.got[i] != s.wants[i] {
			t.Errorf("stream %d (%s) differs from the reference:\n got  %q\n want %q", i, s.ids[i], s.got[i], s.wants[i])
		}
	}
}

// placement reads a request's placement, linearizably.
func (env *migEnv) placement(t *testing.T, id string) *pb.Placement {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := env.ctl.GetPlacement(ctx, &pb.GetPlacementRequest{RequestId: id, Consistency: pb.Consistency_CONSISTENCY_LINEARIZABLE})
	if err != nil {
		t.Fatalf("placement of %s: %v", id, err)
	}
	return resp.Placement
}

// migrate asks the controller to migrate request id to worker to.
func (env *migEnv) migrate(t *testing.T, id, to string) *pb.Placement {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var resp *pb.MigrateResponse
	err := env.ctl.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) (e error) {
		resp, e = op.Migrate(ctx, &pb.MigrateRequest{RequestId: id, ToWorker: to})
		return e
	})
	if err != nil {
		t.Fatalf("migrate %s to %s: %v", id, to, err)
	}
	return resp.Placement
}

// migration matches request id's migration event at stage.
func migration(id string, stage pb.Migration_Stage) func(*pb.Event) bool {
	return func(ev *pb.Event) bool {
		m := ev.GetMigration()
		return m != nil && m.Stage == stage && m.Placement.GetRequestId() == id
	}
}

// finished matches the end of request id's migration, either way.
func finished(id string) func(*pb.Event) bool {
	return func(ev *pb.Event) bool {
		m := ev.GetMigration()
		return m != nil && m.Placement.GetRequestId() == id &&
			(m.Stage == pb.Migration_STAGE_COMMITTED || m.Stage == pb.Migration_STAGE_ABORTED)
	}
}

// other returns a running worker that is not any of not.
func (env *migEnv) other(t *testing.T, not ...string) *devcluster.Worker {
	t.Helper()
	for _, w := range env.workers {
		if w.Running() && !contains(not, w.ID) {
			return w
		}
	}
	t.Fatalf("no running worker other than %v", not)
	return nil
}

func contains(s []string, x string) bool {
	for _, y := range s {
		if y == x {
			return true
		}
	}
	return false
}

// labelled is a labelled metric's name as the exposition writes it.
func labelled(name, label, value string) string { return fmt.Sprintf("%s{%s=%q}", name, label, value) }

// noPagesHeld waits until every running worker reports no KV page in use.
func (env *migEnv) noPagesHeld(t *testing.T) {
	t.Helper()
	for _, w := range env.workers {
		if w.Running() {
			waitMetric(t, w, "lumen_worker_kv_pages_used", w.ID+" holding no KV page", func(v float64) bool { return v == 0 })
		}
	}
}

// recomputed sums the tokens the running workers prefilled again.
func (env *migEnv) recomputed(t *testing.T) float64 {
	t.Helper()
	n := 0.0
	for _, w := range env.workers {
		if w.Running() {
			n += metric(t, w, "lumen_worker_resume_recomputed_tokens_total")
		}
	}
	return n
}

// downtimes reads the gateway's migration downtime histogram: count and
// mean.
func (env *migEnv) downtimes(t *testing.T) (n float64, mean time.Duration) {
	t.Helper()
	url := "http://" + env.gw.Addr + "/metrics"
	n = metricValue(t, url, "lumen_gateway_migration_downtime_seconds_count")
	if n > 0 {
		mean = time.Duration(metricValue(t, url, "lumen_gateway_migration_downtime_seconds_sum") / n * float64(time.Second))
	}
	return n, mean
}

// TestMigrationE2E: requests are migrated while they stream, each to
// another worker; every source commits and frees, every destination
// adopts the copied pages (nothing recomputed), every output equals the
// reference, and the gateway's downtime is logged.
func TestMigrationE2E(t *testing.T) {
	env := startMigration(t, 3, nil)
	s := env.stream(t, "migrate", 6, 1200, 400)
	for _, id := range s.ids {
		from := env.placement(t, id).WorkerId
		to := env.other(t, from).ID
		pl := env.migrate(t, id, to)
		ev, _ := env.events.waitFor(t, 15*time.Second, id+"'s migration to end", -1, finished(id))
		if m := ev.GetMigration(); m.Stage != pb.Migration_STAGE_COMMITTED {
			t.Fatalf("%s's migration from %s to %s ended %s: %s", id, from, to, m.Stage, m.Reason)
		}
		t.Logf("%s moved from %s to %s (epoch %d → %d)", id, from, to, pl.Epoch, pl.Epoch+1)
	}
	s.check(t)
	env.noPagesHeld(t)
	if n := env.recomputed(t); n != 0 {
		t.Errorf("%v tokens recomputed across the workers; a migration recomputes none", n)
	}
	committed, adopted, stages := 0.0, 0.0, 0.0
	for _, w := range env.workers {
		committed += metric(t, w, labelled("lumen_worker_migrations_out_total", "outcome", "committed"))
		adopted += metric(t, w, labelled("lumen_worker_migrations_in_total", "outcome", "adopted"))
		stages += metric(t, w, "lumen_worker_migration_stages_total")
	}
	if committed != 6 || adopted != 6 {
		t.Errorf("%v migrations committed at the sources and %v adopted at the destinations, want 6 and 6", committed, adopted)
	}
	n, mean := env.downtimes(t)
	t.Logf("%v migrations in %v stages; the clients' downtime averaged %v over %v switches", committed, stages, mean, n)
	if n != 6 {
		t.Errorf("the gateway recorded %v switches, want 6", n)
	}
}

// slowCopy makes a worker copy KV to another at 100 MB/s: the first stage
// of a 1200-token request (75 pages of 2.5 MiB) takes about 2 s, the
// window the abort tests act in.
var slowCopy = []string{"-interconnect", "100MB"}

// addWorker starts one more worker (after the streams are placed, so that
// none of them runs there).
func (env *migEnv) addWorker(t *testing.T, id string, extra ...string) *devcluster.Worker {
	t.Helper()
	w, err := env.cl.AddWorker(id, append(append([]string(nil), migWorkerArgs...), extra...)...)
	if err != nil {
		t.Fatal(err)
	}
	env.workers = append(env.workers, w)
	waitPhase(t, env.ctl, id, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, 0)
	return w
}

// pagesIn waits until worker w has taken a stage's pages.
func pagesIn(t *testing.T, w *devcluster.Worker) {
	t.Helper()
	waitMetric(t, w, labelled("lumen_worker_migration_pages_total", "direction", "in"), w.ID+" taking a stage", func(v float64) bool { return v > 0 })
}

// moves says whether any event moved request id.
func (env *migEnv) moves(id string) int {
	env.events.mu.Lock()
	defer env.events.mu.Unlock()
	n := 0
	for _, ev := range env.events.evs {
		if mv := ev.GetPlacementMoved(); mv != nil && mv.Placement.GetRequestId() == id {
			n++
		}
	}
	return n
}

// TestMigrationAbortPaths: each way a migration ends without a move leaves
// the request streaming on, every output equal to the reference, and no
// page held anywhere once the streams ended.
func TestMigrationAbortPaths(t *testing.T) {
	t.Run("the request finishes during the migration", func(t *testing.T) {
		env := startMigration(t, 1, func(int) []string { return slowCopy })
		s := env.stream(t, "finishes", 1, 1200, 80) // about 1 s of decoding left
		dst := env.addWorker(t, "w2")
		id := s.ids[0]
		env.migrate(t, id, dst.ID)
		ev, _ := env.events.waitFor(t, 15*time.Second, id+"'s migration to end", -1, finished(id))
		t.Logf("%s: %s (%s)", id, ev.GetMigration().Stage, ev.GetMigration().Reason)
		s.check(t)
		if ev.GetMigration().Stage != pb.Migration_STAGE_ABORTED {
			t.Errorf("the migration of a request that finished during its first stage ended %s", ev.GetMigration().Stage)
		}
		waitMetric(t, env.workers[0], labelled("lumen_worker_migrations_out_total", "outcome", "aborted"), "the source's abort",
			func(v float64) bool { return v == 1 })
		env.noPagesHeld(t)
	})

	t.Run("the destination is out of pages", func(t *testing.T) {
		env := startMigration(t, 1, nil)
		s := env.stream(t, "no room", 1, 1200, 300)
		dst := env.addWorker(t, "w2", "-kv-pages", "40") // the request needs 75
		id := s.ids[0]
		before := env.placement(t, id)
		env.migrate(t, id, dst.ID)
		ev, _ := env.events.waitFor(t, 15*time.Second, id+"'s migration to end", -1, finished(id))
		t.Logf("%s: %s (%s)", id, ev.GetMigration().Stage, ev.GetMigration().Reason)
		if ev.GetMigration().Stage != pb.Migration_STAGE_ABORTED || !strings.Contains(ev.GetMigration().Reason, "OUT_OF_PAGES") {
			t.Errorf("the migration into 40 pages ended %s: %q; want an abort for OUT_OF_PAGES", ev.GetMigration().Stage, ev.GetMigration().Reason)
		}
		if pl := env.placement(t, id); pl.WorkerId != before.WorkerId || pl.Epoch != before.Epoch {
			t.Errorf("the request moved: %s epoch %d, was %s epoch %d", pl.WorkerId, pl.Epoch, before.WorkerId, before.Epoch)
		}
		s.check(t)
		if v := metric(t, dst, labelled("lumen_worker_migrations_in_total", "outcome", "aborted")); v != 1 {
			t.Errorf("the destination counts %v refused migrations in, want 1", v)
		}
		env.noPagesHeld(t)
	})

	t.Run("the destination dies", func(t *testing.T) {
		env := startMigration(t, 1, func(int) []string { return slowCopy })
		s := env.stream(t, "dest dies", 1, 1200, 400)
		dst := env.addWorker(t, "w2")
		id := s.ids[0]
		env.migrate(t, id, dst.ID)
		pagesIn(t, dst)
		env.cl.KillWorker(dst)
		ev, _ := env.events.waitFor(t, 15*time.Second, id+"'s migration to end", -1, finished(id))
		t.Logf("%s: %s (%s)", id, ev.GetMigration().Stage, ev.GetMigration().Reason)
		s.check(t)
		if ev.GetMigration().Stage != pb.Migration_STAGE_ABORTED {
			t.Errorf("the migration to a dead destination ended %s", ev.GetMigration().Stage)
		}
		if n := env.moves(id); n != 0 {
			t.Errorf("the request moved %d times; it stays on its source, untouched", n)
		}
		if n := env.recomputed(t); n != 0 {
			t.Errorf("%v tokens recomputed", n)
		}
		env.noPagesHeld(t)
	})

	t.Run("the source dies mid-copy", func(t *testing.T) {
		env := startMigration(t, 1, func(int) []string { return slowCopy })
		s := env.stream(t, "source dies", 2, 1200, 400)
		dst := env.addWorker(t, "w2")
		id := s.ids[0]
		src := env.byID(env.placement(t, id).WorkerId)
		env.migrate(t, id, dst.ID)
		pagesIn(t, dst)
		env.cl.KillWorker(src)
		s.check(t)
		// The recovery reuses the copied pages at the destination as a
		// checkpoint when it plans the request there.
		restored := metric(t, dst, "lumen_worker_restored_pages_total")
		t.Logf("%s restored %v pages of the migration's copy and recomputed %v tokens", dst.ID, restored,
			metric(t, dst, "lumen_worker_resume_recomputed_tokens_total"))
		if restored < 75 {
			t.Errorf("the destination reused %v pages; the first stage copied 75", restored)
		}
		env.noPagesHeld(t)
	})

	t.Run("a pre-allocation with no next stage is reclaimed", func(t *testing.T) {
		env := startMigration(t, 1, func(int) []string { return slowCopy })
		s := env.stream(t, "reclaim", 1, 1200, 400)
		dst := env.addWorker(t, "w2", "-migration-timeout", "500ms")
		id := s.ids[0]
		src := env.byID(env.placement(t, id).WorkerId)
		env.migrate(t, id, dst.ID)
		pagesIn(t, dst)
		// The source hangs between stages.
		if err := env.cl.PauseWorker(src); err != nil {
			t.Fatal(err)
		}
		waitMetric(t, dst, labelled("lumen_worker_migrations_in_total", "outcome", "reclaimed"), "the destination's reclaim",
			func(v float64) bool { return v == 1 })
		waitMetric(t, dst, "lumen_worker_kv_pages_used", "the destination's pages free", func(v float64) bool { return v == 0 })
		if err := env.cl.ResumeWorker(src); err != nil {
			t.Fatal(err)
		}
		s.check(t)
		env.noPagesHeld(t)
	})

	t.Run("the controller leader dies between stages", func(t *testing.T) {
		env := startMigration(t, 1, func(int) []string { return slowCopy })
		s := env.stream(t, "leader dies", 1, 1200, 400)
		dst := env.addWorker(t, "w2")
		id := s.ids[0]
		env.migrate(t, id, dst.ID)
		pagesIn(t, dst)
		leader := waitLeader(t, env.cl)
		env.cl.Kill(leader)
		ev, _ := env.events.waitFor(t, 20*time.Second, id+"'s migration to end", -1, finished(id))
		t.Logf("%s: %s (%s) after %s died", id, ev.GetMigration().Stage, ev.GetMigration().Reason, devcluster.ControllerID(leader))
		s.check(t)
		env.noPagesHeld(t)
		if ev.GetMigration().Stage == pb.Migration_STAGE_COMMITTED {
			if n := env.recomputed(t); n != 0 {
				t.Errorf("%v tokens recomputed after a committed migration", n)
			}
		}
	})
}

// waitExit waits for a worker's process to exit on its own.
func waitExit(t *testing.T, w *devcluster.Worker, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for w.Running() {
		if time.Now().After(deadline) {
			t.Fatalf("%s did not exit within %s", w.ID, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// busiestOf is the running worker with the most requests in flight.
func (env *migEnv) busiestOf(t *testing.T) *devcluster.Worker {
	t.Helper()
	var best *devcluster.Worker
	bestN := -1
	for _, w := range env.workers {
		if n := countInFlight(t, w); w.Running() && n > bestN {
			best, bestN = w, n
		}
	}
	t.Logf("%s has %d requests in flight", best.ID, bestN)
	return best
}

// drained checks a drain's outcome: the worker's process exited after it
// committed LEFT (what its Shutdown does last), its requests moved by
// migration (nothing recomputed anywhere), every output equals the
// reference and no survivor holds a page.
func (env *migEnv) drained(t *testing.T, s *migStreams, w *devcluster.Worker, inc uint64, start time.Time) {
	t.Helper()
	waitExit(t, w, 30*time.Second)
	t.Logf("%s drained and exited %v after the drain began", w.ID, time.Since(start))
	env.events.waitFor(t, 10*time.Second, w.ID+" LEFT", -1, func(ev *pb.Event) bool {
		pc := ev.GetPhaseChanged()
		return pc != nil && pc.WorkerId == w.ID && pc.Incarnation == inc && pc.To == pb.WorkerPhase_WORKER_PHASE_LEFT
	})
	s.check(t)
	if n := env.recomputed(t); n != 0 {
		t.Errorf("%v tokens recomputed; a drain by migration recomputes none", n)
	}
	adopted := 0.0
	for _, o := range env.workers {
		if o.Running() {
			adopted += metric(t, o, labelled("lumen_worker_migrations_in_total", "outcome", "adopted"))
		}
	}
	t.Logf("the survivors adopted %v migrated requests", adopted)
	env.noPagesHeld(t)
}

// TestDrainByMigration: an operator drains the busiest worker (its phase
// DRAINING, as lumen worker drain does): every request it serves migrates
// away while streaming, then it leaves and its process exits, with zero
// recomputed tokens and every output equal to the reference.
func TestDrainByMigration(t *testing.T) {
	env := startMigration(t, 3, nil)
	s := env.stream(t, "drain", 9, 600, 400)
	w := env.busiestOf(t)
	_, inc := workerPhase(t, env.ctl, w.ID)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	if _, err := env.ctl.SetWorkerPhase(ctx, &pb.SetWorkerPhaseRequest{WorkerId: w.ID, Incarnation: inc,
		Phase: pb.WorkerPhase_WORKER_PHASE_DRAINING, Reason: "operator drain"}); err != nil {
		t.Fatal(err)
	}
	env.drained(t, s, w, inc, start)
}

// TestGPUFaultDrains: the busiest worker's GPU reports an XID (injected
// through its fault file): it marks the GPU unhealthy, drains itself by
// migration and leaves, with zero recomputed tokens.
func TestGPUFaultDrains(t *testing.T) {
	dir := t.TempDir()
	faults := func(i int) string { return fmt.Sprintf("%s/gpu-faults-w%d", dir, i) }
	env := startMigration(t, 3, func(i int) []string { return []string{"-gpu-fault-file", faults(i)} })
	s := env.stream(t, "gpu fault", 9, 600, 400)
	w := env.busiestOf(t)
	_, inc := workerPhase(t, env.ctl, w.ID)
	var i int
	fmt.Sscanf(w.ID, "w%d", &i)
	start := time.Now()
	if err := os.WriteFile(faults(i), []byte("xid 79 GPU-emulated\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	env.events.waitFor(t, 10*time.Second, w.ID+" DRAINING", -1, func(ev *pb.Event) bool {
		pc := ev.GetPhaseChanged()
		return pc != nil && pc.WorkerId == w.ID && pc.To == pb.WorkerPhase_WORKER_PHASE_DRAINING && strings.Contains(pc.Reason, "XID 79")
	})
	env.drained(t, s, w, inc, start)
}
