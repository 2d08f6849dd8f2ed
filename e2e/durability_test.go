package e2e

import (
	"context"
	"fmt"
	"math/rand"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func startQuorum(t *testing.T) *devcluster.Cluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dir := t.TempDir()
	cl, err := devcluster.Start(ctx, devcluster.Options{Bin: lumenBin, Dir: dir, Controllers: 3, Args: []string{"-log-level", "warn"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cl.Stop()
		if t.Failed() {
			for _, c := range cl.Controllers {
				if b, err := os.ReadFile(c.LogPath); err == nil {
					t.Logf("--- %s log (tail) ---\n%s", c.ID, tail(string(b), 3000))
				}
			}
		}
	})
	return cl
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

func waitLeader(t *testing.T, cl *devcluster.Cluster) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	i, err := cl.WaitLeader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return i
}

// TestKillNineKeepsAcknowledgedWrites writes continuously while a follower,
// then the leader, then all three replicas at once are killed with SIGKILL
// and restarted from disk; every Dispatch that was acknowledged must still
// be readable, linearizably, at the end.
func TestKillNineKeepsAcknowledgedWrites(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	cl := startQuorum(t)
	client, err := ctlclient.New(cl.GRPCAddrs(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	client.AttemptTimeout = time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for w := 0; w < 3; w++ {
		if _, err := client.RegisterWorker(ctx, &pb.RegisterWorkerRequest{Worker: &pb.Worker{
			Id: fmt.Sprintf("w%d", w), Incarnation: 1, GrpcAddr: "127.0.0.1:1",
			Capacity: &pb.Capacity{KvPagesTotal: 4096, CheckpointBudgetBytes: 1 << 40, KvBytesPerToken: 1 << 10, MaxContextTokens: 8192}}}); err != nil {
			t.Fatal(err)
		}
	}

	var mu sync.Mutex
	var acked []string
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for g := 0; g < 16; g++ {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				id := fmt.Sprintf("g%02d-%06d", g, i)
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
				_, err := client.Dispatch(ctx, &pb.DispatchRequest{RequestId: id, PromptTokens: 10, MaxTokens: 10})
				cancel()
				if err == nil {
					mu.Lock()
					acked = append(acked, id)
					mu.Unlock()
				}
			}
		})
	}
	count := func() int { mu.Lock(); defer mu.Unlock(); return len(acked) }
	progress := func(what string) {
		t.Helper()
		n := count()
		deadline := time.Now().Add(20 * time.Second)
		for count() < n+50 {
			if time.Now().After(deadline) {
				t.Fatalf("no progress after %s", what)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}

	progress("start")
	leader := waitLeader(t, cl)
	follower := (leader + 1 + rng.Intn(2)) % 3
	t.Logf("kill -9 follower %s", cl.Controllers[follower].ID)
	cl.Kill(follower)
	progress("killing a follower")
	if err := cl.Restart(follower); err != nil {
		t.Fatal(err)
	}
	waitLeader(t, cl)

	leader = waitLeader(t, cl)
	t.Logf("kill -9 leader %s", cl.Controllers[leader].ID)
	cl.Kill(leader)
	progress("killing the leader")
	if err := cl.Restart(leader); err != nil {
		t.Fatal(err)
	}
	waitLeader(t, cl)
	progress("restarting the old leader")

	t.Log("kill -9 all three replicas")
	for i := range cl.Controllers {
		cl.Kill(i)
	}
	close(stop)
	wg.Wait()
	for i := range cl.Controllers {
		if err := cl.Restart(i); err != nil {
			t.Fatal(err)
		}
	}
	waitLeader(t, cl)
	t.Logf("%d writes acknowledged; checking every one", len(acked))
	var missing []string
	var mmu sync.Mutex
	var cwg sync.WaitGroup
	for g := 0; g < 16; g++ {
		cwg.Go(func() {
			for i := g; i < len(acked); i += 16 {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				_, err := client.GetPlacement(ctx, &pb.GetPlacementRequest{RequestId: acked[i]})
				cancel()
				if err != nil {
					mmu.Lock()
					missing = append(missing, fmt.Sprintf("%s (%v)", acked[i], err))
					mmu.Unlock()
				}
			}
		})
	}
	cwg.Wait()
	if len(missing) > 0 {
		t.Fatalf("seed %d: %d of %d acknowledged writes lost, e.g. %v", seed, len(missing), len(acked), missing[:min(5, len(missing))])
	}
}
