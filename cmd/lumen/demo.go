package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/serf/serf"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	"github.com/lumen-project/lumen/internal/gossip"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func init() {
	register("demo", "start a local cluster, inject failures, show the recovery", runDemo)
}

// standInWorker is a worker as the controller sees it: a Serf member with
// worker tags and a registration. It serves no tokens; the real worker
// process replaces it.
type standInWorker struct {
	id   string
	serf *serf.Serf
}

func runDemo(args []string) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	dir := fs.String("dir", "", "data and log directory (default: a temporary one, removed afterwards)")
	nWorkers := fs.Int("workers", 4, "workers")
	nReq := fs.Int("requests", 24, "requests to place")
	if err := fs.Parse(args); err != nil {
		return err
	}
	keep := *dir != ""
	if !keep {
		d, err := os.MkdirTemp("", "lumen-demo-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(d)
		*dir = d
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	step("1. controller quorum: 3 replicas as separate processes (Raft on bbolt, fsync'd)")
	cl, err := devcluster.Start(ctx, devcluster.Options{Dir: *dir, Controllers: 3, Args: []string{"-log-level", "warn"}})
	if err != nil {
		return err
	}
	defer cl.Stop()
	leader, err := cl.WaitLeader(ctx)
	if err != nil {
		return err
	}
	for i, c := range cl.Controllers {
		role := "follower"
		if i == leader {
			role = "leader"
		}
		fmt.Printf("   %s  pid %-7d grpc %s  %s\n", c.ID, c.Pid(), c.GRPCAddr, role)
	}
	client, err := ctlclient.New(cl.GRPCAddrs(), nil)
	if err != nil {
		return err
	}
	defer client.Close()
	client.AttemptTimeout = time.Second

	step(fmt.Sprintf("2. %d workers join Serf and register (stand-ins: the controller's view of a worker)", *nWorkers))
	var workers []*standInWorker
	defer func() {
		for _, w := range workers {
			w.serf.Shutdown()
		}
	}()
	for i := 0; i < *nWorkers; i++ {
		id := fmt.Sprintf("worker-%d", i+1)
		s, err := gossip.Start(gossip.Config{NodeName: id, BindAddr: "127.0.0.1:0",
			Tags: map[string]string{gossip.TagRole: gossip.RoleWorker, gossip.TagIncarnation: "1"}})
		if err != nil {
			return err
		}
		workers = append(workers, &standInWorker{id: id, serf: s})
		if _, err := s.Join([]string{cl.Controllers[0].SerfAddr}, true); err != nil {
			return err
		}
		// Qwen3-14B on an H100: 160 KiB of KV per token; 80 GB host budget.
		if _, err := client.RegisterWorker(ctx, &pb.RegisterWorkerRequest{Worker: &pb.Worker{
			Id: id, Incarnation: 1, GrpcAddr: "127.0.0.1:1", SerfAddr: gossip.Addr(s), ModelId: "qwen3-14b",
			Capacity: &pb.Capacity{KvPagesTotal: 2400, CheckpointBudgetBytes: 80e9, KvBytesPerToken: 160 << 10,
				MaxContextTokens: 32768, H2DBytesPerSec: 25e9, PageTokens: 16}}}); err != nil {
			return fmt.Errorf("register %s: %w", id, err)
		}
		if _, err := client.ReportLoad(ctx, &pb.ReportLoadRequest{Load: &pb.LoadRecord{WorkerId: id, Incarnation: 1,
			QueueWaitMs: float64(5 * i), KvPagesTotal: 2400, KvPagesUsed: uint64(100 * i)}}); err != nil {
			return err
		}
	}
	fmt.Printf("   %d workers in FULL_SERVICE\n", *nWorkers)

	step(fmt.Sprintf("3. place %d requests: serving worker by freeness, checkpoint holder by h(r) = argmin q_w + λ·p_w(r)", *nReq))
	placed := map[string]*pb.Placement{}
	for i := 0; i < *nReq; i++ {
		id := fmt.Sprintf("req-%02d", i)
		r, err := client.Dispatch(ctx, &pb.DispatchRequest{RequestId: id, PromptTokens: uint32(200 + 97*i%1800), MaxTokens: 256})
		if err != nil {
			return err
		}
		placed[id] = r.Placement
	}
	printPlacementSummary(placed)

	step("4. kill -9 the controller leader while placements continue")
	old := cl.Controllers[leader]
	t0 := time.Now()
	cl.Kill(leader)
	fmt.Printf("   killed %s (pid gone)\n", old.ID)
	var firstWrite time.Duration
	for i := 0; ; i++ {
		wctx, wcancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := client.Dispatch(wctx, &pb.DispatchRequest{RequestId: fmt.Sprintf("after-kill-%d", i), PromptTokens: 100, MaxTokens: 64})
		wcancel()
		if err == nil {
			firstWrite = time.Since(t0)
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("no write after the leader died: %w", err)
		}
	}
	newLeader, err := cl.WaitLeader(ctx)
	if err != nil {
		return err
	}
	fmt.Printf("   new leader %s; first write committed %d ms after the kill\n", cl.Controllers[newLeader].ID, firstWrite.Milliseconds())
	lost := 0
	for id := range placed {
		if _, err := client.GetPlacement(ctx, &pb.GetPlacementRequest{RequestId: id}); err != nil {
			lost++
		}
	}
	fmt.Printf("   linearizable read of all %d placements: %d lost\n", len(placed), lost)
	if err := cl.Restart(leader); err != nil {
		return err
	}
	fmt.Printf("   %s restarted from its data directory and rejoined\n", old.ID)

	victim := busiestWorker(placed)
	step(fmt.Sprintf("5. %s crashes (no goodbye): Serf notices, the leader commits MarkFailed, Apply plans recovery", victim))
	stream, err := pb.NewControllerClient(client.Conn(newLeader)).WatchEvents(ctx, &pb.WatchEventsRequest{})
	if err != nil {
		return err
	}
	var victimSerf *serf.Serf
	for _, w := range workers {
		if w.id == victim {
			victimSerf = w.serf
		}
	}
	t1 := time.Now()
	victimSerf.Shutdown()
	var plan *pb.RecoveryPlan
	for plan == nil {
		ev, err := stream.Recv()
		if err != nil {
			return fmt.Errorf("watch events: %w", err)
		}
		plan = ev.GetRecoveryPlan()
	}
	fmt.Printf("   failure detected and plan committed %d ms after the crash (plan %d, log index %d)\n",
		time.Since(t1).Milliseconds(), plan.Id, plan.Index)
	sort.Slice(plan.Assignments, func(i, j int) bool { return plan.Assignments[i].RequestId < plan.Assignments[j].RequestId })
	reuse := 0
	for _, a := range plan.Assignments {
		mode := "recompute"
		if a.Mode == pb.RecoveryMode_RECOVERY_MODE_REUSE {
			mode, reuse = "reuse the checkpoint", reuse+1
		}
		note := ""
		if a.Rebalanced {
			note = " (rebalanced off an overloaded holder)"
		}
		fmt.Printf("   %s -> %-9s %s%s; new holder %s\n", a.RequestId, a.TargetWorker, mode, note, orNone(a.NewHolder))
	}
	fmt.Printf("   %d interrupted requests: %d resume from their checkpoint holder, %d recompute\n",
		len(plan.Assignments), reuse, len(plan.Assignments)-reuse)

	step("6. check")
	ws, err := client.ListWorkers(ctx, &pb.ListWorkersRequest{})
	if err != nil {
		return err
	}
	phase := map[string]pb.WorkerPhase{}
	for _, w := range ws.Workers {
		phase[w.Id] = w.Phase
	}
	bad := 0
	for id := range placed {
		r, err := client.GetPlacement(ctx, &pb.GetPlacementRequest{RequestId: id})
		if err != nil || phase[r.Placement.WorkerId] != pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE ||
			(r.Placement.HolderId != "" && phase[r.Placement.HolderId] != pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE) {
			bad++
		}
	}
	fmt.Printf("   %s is %s; every one of %d placements is on a live worker with a live holder: %v\n",
		victim, strings.TrimPrefix(phase[victim].String(), "WORKER_PHASE_"), len(placed), bad == 0 && lost == 0)
	fmt.Printf("\ndone in %.1f s", time.Since(start).Seconds())
	if keep {
		fmt.Printf("; logs in %s", *dir)
	}
	fmt.Println()
	if bad > 0 || lost > 0 {
		return fmt.Errorf("%d placements lost, %d on dead workers", lost, bad)
	}
	return nil
}

func step(s string) { fmt.Printf("\n%s\n", s) }

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}

func busiestWorker(placed map[string]*pb.Placement) string {
	count := map[string]int{}
	for _, p := range placed {
		count[p.WorkerId]++
	}
	best := ""
	for w, c := range count {
		if best == "" || c > count[best] || (c == count[best] && w < best) {
			best = w
		}
	}
	return best
}

func printPlacementSummary(placed map[string]*pb.Placement) {
	serving, holding := map[string]int{}, map[string]int{}
	for _, p := range placed {
		serving[p.WorkerId]++
		holding[p.HolderId]++
	}
	var ids []string
	for w := range serving {
		ids = append(ids, w)
	}
	for w := range holding {
		if _, ok := serving[w]; !ok && w != "" {
			ids = append(ids, w)
		}
	}
	sort.Strings(ids)
	for _, w := range ids {
		fmt.Printf("   %-9s serves %2d, holds checkpoints of %2d\n", w, serving[w], holding[w])
	}
	if n := holding[""]; n > 0 {
		fmt.Printf("   %d placements have no holder\n", n)
	}
	_ = strconv.Itoa
}
