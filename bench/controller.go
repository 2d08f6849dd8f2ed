package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"net/http"
	"os"
	"runtime"
	"runtime/pprof"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	"github.com/lumen-project/lumen/internal/placer"
	"github.com/lumen-project/lumen/internal/progress"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// ControllerConfig is `lumen bench controller`.
type ControllerConfig struct {
	// Quick is a short run (under a minute) with the same keys.
	Quick bool
	// CPUProfileLeader, when set, is where a CPU profile of the leader
	// (and, with ".follower" appended, of a follower) is saved during the
	// 256-caller run.
	CPUProfileLeader string
	// JSONPath, when set, receives the figures as JSON.
	JSONPath string
	// ControllerArgs are extra flags for every controller.
	ControllerArgs []string
	// Dir keeps data and logs; empty means a temporary directory, removed.
	Dir string
}

type controllerBench struct {
	cluster *devcluster.Cluster
	conns   []*grpc.ClientConn // to the leader
	seq     atomic.Uint64
}

type loadResult struct {
	ops      int
	errors   int
	firstErr error
	elapsed  time.Duration
	lat      []time.Duration
}

func (r loadResult) perSec() float64 { return float64(r.ops) / r.elapsed.Seconds() }

func (r loadResult) pct(p float64) float64 { return percentileMs(r.lat, p) }

// dispatchFigures puts the Dispatch figures of a run with callers under
// their JSON keys.
func dispatchFigures(out map[string]float64, prefix string, callers int, r loadResult) {
	out[fmt.Sprintf("%sdispatch_per_s_%d", prefix, callers)] = r.perSec()
	out[fmt.Sprintf("%sdispatch_p50_ms_%d", prefix, callers)] = r.pct(0.50)
	out[fmt.Sprintf("%sdispatch_p99_ms_%d", prefix, callers)] = r.pct(0.99)
}

// failoverFigures sorts fo (seconds from each kill of the leader to the
// next write), puts its median, max and min under their JSON keys, and
// returns its line of the table.
func failoverFigures(out map[string]float64, fo []float64) controllerRow {
	sort.Float64s(fo)
	out["failover_median_s"] = fo[len(fo)/2]
	out["failover_max_s"] = fo[len(fo)-1]
	out["failover_min_s"] = fo[0]
	return controllerRow{fmt.Sprintf("failover, %d kills of the leader", len(fo)),
		fmt.Sprintf("median %.3f s  max %.3f s  min %.3f s", fo[len(fo)/2], fo[len(fo)-1], fo[0]), "median <= 1 s, max <= 2 s"}
}

// controllerRow is one line of the controller table.
type controllerRow struct{ name, value, goal string }

// printControllerTable prints the table `lumen bench controller` ends with.
func printControllerTable(w io.Writer, rows []controllerRow) {
	fmt.Fprintf(w, "\n%-44s %-58s %s\n", "measure", "result", "goal")
	for _, r := range rows {
		fmt.Fprintf(w, "%-44s %-58s %s\n", r.name, r.value, r.goal)
	}
}

// runCallers starts callers that each loop op until d has passed.
func runCallers(callers int, d time.Duration, op func(ctx context.Context, caller, i int) error) loadResult {
	var mu sync.Mutex
	var res loadResult
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(d)
	for c := 0; c < callers; c++ {
		wg.Go(func() {
			lat := make([]time.Duration, 0, 4096)
			errs := 0
			var first error
			for i := 0; time.Now().Before(deadline); i++ {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				t0 := time.Now()
				err := op(ctx, c, i)
				cancel()
				if err != nil {
					if first == nil {
						first = err
					}
					errs++
					continue
				}
				lat = append(lat, time.Since(t0))
			}
			mu.Lock()
			res.lat = append(res.lat, lat...)
			res.errors += errs
			if res.firstErr == nil {
				res.firstErr = first
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	res.elapsed = time.Since(start)
	res.ops = len(res.lat)
	return res
}

// dispatchLoad is a gateway-like writer: Dispatch a new request, and every
// 32 dispatches Complete them in one batch, so the tables stay bounded.
func (b *controllerBench) dispatchLoad(callers int, d time.Duration, call func(ctx context.Context, req *pb.DispatchRequest) error,
	complete func(ctx context.Context, ids []string) error) loadResult {
	pending := make([][]string, callers)
	return runCallers(callers, d, func(ctx context.Context, c, i int) error {
		id := fmt.Sprintf("b%d", b.seq.Add(1))
		if err := call(ctx, &pb.DispatchRequest{RequestId: id, PromptTokens: 1000, MaxTokens: 200}); err != nil {
			return err
		}
		pending[c] = append(pending[c], id)
		if len(pending[c]) >= 32 {
			_ = complete(ctx, pending[c])
			pending[c] = pending[c][:0]
		}
		return nil
	})
}

func (b *controllerBench) leaderDispatch(ctx context.Context, req *pb.DispatchRequest) error {
	_, err := pb.NewControllerClient(b.conns[b.seq.Load()%uint64(len(b.conns))]).Dispatch(ctx, req)
	return err
}

func (b *controllerBench) leaderComplete(ctx context.Context, ids []string) error {
	_, err := pb.NewControllerClient(b.conns[0]).Complete(ctx, &pb.CompleteRequest{RequestIds: ids})
	return err
}

// Controller measures a 3-replica quorum. The request path of issue 16
// first: 4 gateway-like clients, each with its Place stream, its session
// and its replica of the load table (WatchLoad), choose the worker and
// commit placements at 64 and 256 callers in all; linearizable
// GetPlacements batches; then the per-call unary Dispatch and GetPlacement
// for comparison (keys unary_*); failover after kill -9 of the leader.
func Controller(cfg ControllerConfig) error {
	phase, stable, failovers := 10*time.Second, 60*time.Second, 10
	if cfg.Quick {
		phase, stable, failovers = 3*time.Second, 8*time.Second, 3
	}
	if cfg.Dir == "" {
		d, err := os.MkdirTemp("", "lumen-bench-controller-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(d)
		cfg.Dir = d
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	fmt.Printf("starting 3 controller processes under %s\n", cfg.Dir)
	// Progress: the phases below (2 Place loads, reads, 3 unary loads,
	// unary reads, failover), with an estimate of the time left.
	meter := progress.New("bench controller", "phases", 8)
	defer meter.Finish("")
	step := 0
	next := func(note string) { meter.Set(float64(step), note); step++ }
	cl, err := devcluster.Start(ctx, devcluster.Options{Dir: cfg.Dir, Controllers: 3, Args: append([]string{"-log-level", "warn"}, cfg.ControllerArgs...)})
	if err != nil {
		return err
	}
	defer cl.Stop()
	b := &controllerBench{cluster: cl}
	leader, err := cl.WaitLeader(ctx)
	if err != nil {
		return err
	}
	for i := 0; i < 8; i++ {
		cc, err := grpc.NewClient(cl.Controllers[leader].GRPCAddr, grpcInsecure())
		if err != nil {
			return err
		}
		defer cc.Close()
		b.conns = append(b.conns, cc)
	}
	client, err := ctlclient.New(cl.GRPCAddrs(), nil)
	if err != nil {
		return err
	}
	defer client.Close()
	for w := 0; w < 16; w++ {
		_, err := client.RegisterWorker(ctx, &pb.RegisterWorkerRequest{Worker: &pb.Worker{
			Id: fmt.Sprintf("w%02d", w), Incarnation: 1, GrpcAddr: fmt.Sprintf("127.0.0.1:%d", 9000+w),
			Capacity: &pb.Capacity{KvPagesTotal: 8192, CheckpointBudgetBytes: 80 << 30, KvBytesPerToken: 160 << 10,
				MaxContextTokens: 32768, H2DBytesPerSec: 25e9}}})
		if err != nil {
			return fmt.Errorf("register worker: %w", err)
		}
	}
	out := map[string]float64{}
	var rows []controllerRow
	// The machine is shared: its load says how much of it the run had.
	out["loadavg_1m_start"] = loadAvg()

	gws, err := b.startGateways(4)
	if err != nil {
		return err
	}
	defer func() {
		for _, g := range gws {
			g.close()
		}
	}()
	for _, callers := range []int{64, 256} {
		d := phase
		if callers == 256 {
			d = stable // the no-fault stability run is the 256-caller run
		}
		before, _ := cl.Status(ctx, leader)
		fmt.Printf("Place streams: 4 clients, %d callers in all, for %s ...\n", callers, d)
		next(fmt.Sprintf("Place, %d callers", callers))
		var profiles sync.WaitGroup
		if callers == 256 && cfg.CPUProfileLeader != "" {
			profiles.Go(func() { saveProfile(cl.Controllers[leader].HTTPAddr, d-time.Second, cfg.CPUProfileLeader) })
			profiles.Go(func() {
				saveProfile(cl.Controllers[(leader+1)%3].HTTPAddr, d-time.Second, cfg.CPUProfileLeader+".follower")
			})
			// And the benchmark's own process: the gateway-like clients.
			if f, err := os.Create(cfg.CPUProfileLeader + ".client"); err == nil {
				if pprof.StartCPUProfile(f) == nil {
					defer f.Close()
					profiles.Go(func() { time.Sleep(d - time.Second); pprof.StopCPUProfile() })
				} else {
					f.Close()
				}
			}
		}
		follower := cl.Controllers[(leader+1)%3].HTTPAddr
		entries0, cmds0 := batchCounts(cl.Controllers[leader].HTTPAddr)
		lw0, fw0 := readRaftWrites(cl.Controllers[leader].HTTPAddr), readRaftWrites(follower)
		r := b.placeLoad(gws, callers, d)
		lw1, fw1 := readRaftWrites(cl.Controllers[leader].HTTPAddr), readRaftWrites(follower)
		entries1, cmds1 := batchCounts(cl.Controllers[leader].HTTPAddr)
		profiles.Wait()
		if entries1 > entries0 {
			// How well group commit batched: log entries (each one bbolt
			// commit, two fdatasyncs, on every replica) per second, and
			// commands per entry.
			out[fmt.Sprintf("entries_per_s_%d", callers)] = (entries1 - entries0) / r.elapsed.Seconds()
			out[fmt.Sprintf("commands_per_entry_%d", callers)] = (cmds1 - cmds0) / (entries1 - entries0)
		}
		dispatchFigures(out, "", callers, r)
		goal := ""
		if callers == 256 {
			goal = ">= 20000/s, p99 <= 30 ms"
			after, err := cl.Status(context.Background(), leader)
			if err == nil && before != nil {
				out["elections_without_faults"] = float64(after.Term - before.Term)
			} else {
				out["elections_without_faults"] = -1
			}
		}
		if r.errors > r.ops/100 {
			return fmt.Errorf("Place with %d callers: %d errors for %d successes (first: %v)", callers, r.errors, r.ops, r.firstErr)
		}
		rows = append(rows, controllerRow{fmt.Sprintf("placements over Place, %d callers", callers),
			fmt.Sprintf("%.0f/s  p50 %.2f ms  p99 %.2f ms  (%d errors)", r.perSec(), r.pct(0.5), r.pct(0.99), r.errors), goal})
		rows = append(rows, controllerRow{"  log entries committed, commands per entry",
			fmt.Sprintf("%.0f/s, %.1f", out[fmt.Sprintf("entries_per_s_%d", callers)], out[fmt.Sprintf("commands_per_entry_%d", callers)]), ""})
		rows = append(rows, raftWriteFigures(out, callers, lw0, lw1, fw0, fw1, r.elapsed)...)
	}
	rows = append(rows, controllerRow{fmt.Sprintf("elections in the %s run at 256 callers", stable), fmt.Sprintf("%.0f", out["elections_without_faults"]), "0"})

	// The read set: 5,000 placements that exist.
	ids := make([]string, 0, 5000)
	for i := 0; i < 5000; i++ {
		ids = append(ids, fmt.Sprintf("read-%d", i))
	}
	if err := b.placeReadSet(gws, ids); err != nil {
		return err
	}
	fmt.Printf("linearizable GetPlacements: %d callers, %d ids a call, for %s ...\n", readers, readBatch, phase)
	next("GetPlacements")
	rr := runCallers(readers, phase, func(ctx context.Context, c, i int) error {
		req := &pb.GetPlacementsRequest{RequestIds: make([]string, readBatch)}
		for k := range req.RequestIds {
			req.RequestIds[k] = ids[(c*7919+i*readBatch+k)%len(ids)]
		}
		resp, err := pb.NewControllerClient(b.conns[(c+i)%len(b.conns)]).GetPlacements(ctx, req)
		if err == nil && len(resp.Placements) != readBatch {
			err = fmt.Errorf("read %d placements of %d", len(resp.Placements), readBatch)
		}
		return err
	})
	// Throughput counts placements read; latency is per call.
	rr.ops *= readBatch
	out["read_per_s"], out["read_p50_ms"], out["read_p99_ms"] = rr.perSec(), rr.pct(0.5), rr.pct(0.99)
	if rr.errors > len(rr.lat)/100 {
		return fmt.Errorf("linearizable GetPlacements: %d errors for %d successes (first: %v)", rr.errors, len(rr.lat), rr.firstErr)
	}
	rows = append(rows, controllerRow{fmt.Sprintf("linearizable GetPlacements, %d callers x %d ids", readers, readBatch),
		fmt.Sprintf("%.0f/s  p50 %.2f ms  p99 %.2f ms  (%d errors)", rr.perSec(), rr.pct(0.5), rr.pct(0.99), rr.errors), ">= 50000/s, p99 <= 5 ms"})

	// The per-call paths, for comparison.
	for _, callers := range []int{1, 64, 256} {
		fmt.Printf("unary Dispatch: %d callers for %s ...\n", callers, phase)
		next(fmt.Sprintf("unary Dispatch, %d callers", callers))
		r := b.dispatchLoad(callers, phase, b.leaderDispatch, b.leaderComplete)
		dispatchFigures(out, "unary_", callers, r)
		if r.errors > r.ops/100 {
			return fmt.Errorf("unary dispatch with %d callers: %d errors for %d successes (first: %v)", callers, r.errors, r.ops, r.firstErr)
		}
		rows = append(rows, controllerRow{fmt.Sprintf("unary Dispatch, %d callers", callers),
			fmt.Sprintf("%.0f/s  p50 %.2f ms  p99 %.2f ms  (%d errors)", r.perSec(), r.pct(0.5), r.pct(0.99), r.errors), ""})
	}
	fmt.Printf("unary linearizable GetPlacement: 256 callers for %s ...\n", phase)
	next("unary GetPlacement")
	ur := runCallers(256, phase, func(ctx context.Context, c, i int) error {
		id := ids[(c*7919+i)%len(ids)]
		_, err := pb.NewControllerClient(b.conns[(c+i)%len(b.conns)]).GetPlacement(ctx, &pb.GetPlacementRequest{RequestId: id})
		return err
	})
	out["unary_read_per_s"], out["unary_read_p50_ms"], out["unary_read_p99_ms"] = ur.perSec(), ur.pct(0.5), ur.pct(0.99)
	rows = append(rows, controllerRow{"unary linearizable GetPlacement, 256 callers",
		fmt.Sprintf("%.0f/s  p50 %.2f ms  p99 %.2f ms  (%d errors)", ur.perSec(), ur.pct(0.5), ur.pct(0.99), ur.errors), ""})

	// Failover under load: kill -9 the leader, time the next write that
	// started after the kill.
	fmt.Printf("failover: kill -9 the leader %d times under load ...\n", failovers)
	next("failover")
	for _, g := range gws {
		g.close()
	}
	gws = nil
	fo, err := b.failover(failovers)
	if err != nil {
		return err
	}
	rows = append(rows, failoverFigures(out, fo))

	out["loadavg_1m_end"] = loadAvg()
	rows = append(rows, controllerRow{"machine load average (1 min), start / end",
		fmt.Sprintf("%.1f / %.1f on %d CPUs", out["loadavg_1m_start"], out["loadavg_1m_end"], runtime.NumCPU()), ""})
	printControllerTable(os.Stdout, rows)
	if cfg.JSONPath != "" {
		if err := writeJSON(cfg.JSONPath, out); err != nil {
			return err
		}
		fmt.Printf("\nwrote %s\n", cfg.JSONPath)
	}
	return nil
}

// The read run: readers callers (one per gateway-like client), each
// reading readBatch placements a call.
const readers, readBatch = 4, 64

// benchGateway is a gateway-like client of the quorum: its own connections,
// session, Place stream and replica of the load table.
type benchGateway struct {
	cl      *ctlclient.Client
	p       *ctlclient.Placer
	r       *placer.Replica
	session string
	stop    context.CancelFunc
	done    sync.WaitGroup
	closed  bool
}

// startGateways starts n gateway-like clients and waits until each holds a
// load table.
func (b *controllerBench) startGateways(n int) ([]*benchGateway, error) {
	var gws []*benchGateway
	for i := 0; i < n; i++ {
		cl, err := ctlclient.New(b.cluster.GRPCAddrs(), nil)
		if err != nil {
			return nil, err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		s, err := cl.CreateSession(ctx, &pb.CreateSessionRequest{Owner: fmt.Sprintf("bench-gw-%d", i), TtlMs: 30_000})
		cancel()
		if err != nil {
			cl.Close()
			return nil, fmt.Errorf("gateway %d: create session: %w", i, err)
		}
		wctx, stop := context.WithCancel(context.Background())
		g := &benchGateway{cl: cl, p: cl.NewPlacer(ctlclient.PlacerOptions{}), r: placer.New(), session: s.Session.Id, stop: stop}
		g.done.Go(func() { _ = cl.WatchLoad(wctx, 10*time.Millisecond, 0, g.r.Update) })
		g.done.Go(func() {
			t := time.NewTicker(5 * time.Second)
			defer t.Stop()
			for {
				select {
				case <-wctx.Done():
					return
				case <-t.C:
					rctx, cancel := context.WithTimeout(wctx, 5*time.Second)
					_, _ = cl.RenewSession(rctx, &pb.RenewSessionRequest{SessionId: g.session})
					cancel()
				}
			}
		})
		gws = append(gws, g)
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, g := range gws {
		for {
			if _, tables := g.r.Applied(); tables > 0 {
				break
			}
			if time.Now().After(deadline) {
				return gws, errors.New("a gateway got no load table within 10 s")
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	return gws, nil
}

func (g *benchGateway) close() {
	if g.closed {
		return
	}
	g.closed = true
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	_ = g.p.Close(ctx)
	_, _ = g.cl.DestroySession(ctx, &pb.DestroySessionRequest{SessionId: g.session})
	cancel()
	g.stop()
	g.done.Wait()
	g.cl.Close()
}

// place is the gateway's request path, less the worker: choose the worker
// from the replica, commit the placement over the Place stream, complete
// it (fire-and-forget: the next batch carries it).
func (g *benchGateway) place(ctx context.Context, id string, prompt uint32, complete bool) error {
	w, inc, ok := g.r.Take(id, prompt)
	if !ok {
		return errors.New("no eligible worker in the load table")
	}
	resp, err := g.p.Dispatch(ctx, &pb.DispatchRequest{RequestId: id, PromptTokens: prompt, MaxTokens: 200,
		SessionId: g.session, WorkerId: w, WorkerIncarnation: inc})
	if err != nil {
		g.r.Forget(id)
		return err
	}
	g.r.Committed(id, resp.Placement.WorkerId, resp.Index)
	if complete {
		g.p.Complete(id)
	}
	return nil
}

// placeLoad runs callers (spread over the gateways) placing and completing
// new requests for d; the latency is the Dispatch's, to its commit.
func (b *controllerBench) placeLoad(gws []*benchGateway, callers int, d time.Duration) loadResult {
	return runCallers(callers, d, func(ctx context.Context, c, i int) error {
		return gws[c%len(gws)].place(ctx, fmt.Sprintf("p%d", b.seq.Add(1)), 1000, true)
	})
}

// placeReadSet places ids (not completed) through the gateways.
func (b *controllerBench) placeReadSet(gws []*benchGateway, ids []string) error {
	var wg sync.WaitGroup
	var failed atomic.Int64
	var first atomic.Value
	for c := 0; c < 64; c++ {
		wg.Go(func() {
			for i := c; i < len(ids); i += 64 {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				if err := gws[c%len(gws)].place(ctx, ids[i], 100, false); err != nil {
					failed.Add(1)
					first.CompareAndSwap(nil, err)
				}
				cancel()
			}
		})
	}
	wg.Wait()
	if n := failed.Load(); n > 0 {
		return fmt.Errorf("placing the read set: %d of %d Dispatches failed (first: %v)", n, len(ids), first.Load())
	}
	return nil
}

// failover kills the leader n times while 64 callers write through clients
// that know every replica, and returns, per kill, the seconds from the kill
// to the first successful write issued after it.
func (b *controllerBench) failover(n int) ([]float64, error) {
	cl := b.cluster
	client, err := ctlclient.New(cl.GRPCAddrs(), nil)
	if err != nil {
		return nil, err
	}
	defer client.Close()
	client.AttemptTimeout = time.Second
	var killedAt atomic.Int64 // unix nanos of the last kill; 0 = none pending
	firstOK := make(chan time.Time, 1)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for c := 0; c < 64; c++ {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				start := time.Now()
				_, err := client.Dispatch(ctx, &pb.DispatchRequest{RequestId: fmt.Sprintf("f%d", b.seq.Add(1)), PromptTokens: 10, MaxTokens: 10})
				cancel()
				k := killedAt.Load()
				if err == nil && k != 0 && start.UnixNano() >= k {
					select {
					case firstOK <- time.Now():
					default:
					}
				}
			}
		})
	}
	defer func() { close(stop); wg.Wait() }()
	var out []float64
	rng := rand.New(rand.NewSource(1))
	for k := 0; k < n; k++ {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		leader, err := cl.WaitLeader(ctx)
		cancel()
		if err != nil {
			return nil, err
		}
		// Let the load settle on the current leader.
		time.Sleep(time.Duration(300+rng.Intn(300)) * time.Millisecond)
		select {
		case <-firstOK:
		default:
		}
		t := time.Now()
		cl.Kill(leader)
		killedAt.Store(t.UnixNano())
		select {
		case ok := <-firstOK:
			out = append(out, ok.Sub(t).Seconds())
		case <-time.After(20 * time.Second):
			return nil, fmt.Errorf("no write succeeded within 20 s of killing %s", cl.Controllers[leader].ID)
		}
		killedAt.Store(0)
		fmt.Printf("  kill %d: %s was leader; next write after %.3f s\n", k+1, cl.Controllers[leader].ID, out[len(out)-1])
		if err := cl.Restart(leader); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func saveProfile(httpAddr string, d time.Duration, path string) {
	resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", httpAddr, int(d.Seconds())))
	if err != nil {
		fmt.Fprintln(os.Stderr, "profile:", err)
		return
	}
	defer resp.Body.Close()
	f, err := os.Create(path)
	if err != nil {
		return
	}
	defer f.Close()
	_, _ = io.Copy(f, resp.Body)
}

// loadAvg is the machine's 1-minute load average, or -1 where it cannot
// be read.
func loadAvg() float64 {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return -1
	}
	var l float64
	if _, err := fmt.Sscan(string(data), &l); err != nil {
		return -1
	}
	return l
}

// batchCounts reads the leader's group-commit histogram
// (lumen_controller_batch_commands): log entries proposed and the commands
// in them; zeros when it cannot be read.
func batchCounts(httpAddr string) (entries, commands float64) {
	resp, err := http.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		return 0, 0
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		var v float64
		switch {
		case strings.HasPrefix(line, "lumen_controller_batch_commands_count "):
			fmt.Sscan(strings.TrimPrefix(line, "lumen_controller_batch_commands_count "), &v)
			entries = v
		case strings.HasPrefix(line, "lumen_controller_batch_commands_sum "):
			fmt.Sscan(strings.TrimPrefix(line, "lumen_controller_batch_commands_sum "), &v)
			commands = v
		}
	}
	return entries, commands
}
