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
