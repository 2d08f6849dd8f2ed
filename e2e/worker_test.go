package e2e

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/tokenizer"
	"github.com/lumen-project/lumen/worker/engine"
)

func workerPhase(t *testing.T, cl *ctlclient.Client, id string) (pb.WorkerPhase, uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := cl.ListWorkers(ctx, &pb.ListWorkersRequest{})
	if err != nil {
		return pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED, 0
	}
	for _, w := range r.Workers {
		if w.Id == id {
			return w.Phase, w.Incarnation
		}
	}
	return pb.WorkerPhase_WORKER_PHASE_UNSPECIFIED, 0
}

func waitPhase(t *testing.T, cl *ctlclient.Client, id string, phase pb.WorkerPhase, notInc uint64) uint64 {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		p, inc := workerPhase(t, cl, id)
		if p == phase && inc != notInc {
			return inc
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is %v (incarnation %d), want %v", id, p, inc, phase)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestWorkerProcesses runs two transformer workers as processes: requests
// placed by the controller and generated on the chosen worker equal the
// engine's reference output; a worker killed with SIGKILL is marked FAILED
// (Serf → leader → MarkFailed) and its restart registers a new incarnation.
func TestWorkerProcesses(t *testing.T) {
	modelDir := t.TempDir()
	if _, _, err := engine.InitModel(modelDir, engine.DefaultSeed); err != nil {
		t.Fatal(err)
	}
	cl := startQuorum(t)
	var ws []*devcluster.Worker
	for i := 1; i <= 2; i++ {
		w, err := cl.AddWorker(fmt.Sprintf("w%d", i), "-model-dir", modelDir, "-kv-pages", "512")
		if err != nil {
			t.Fatal(err)
		}
		ws = append(ws, w)
	}
	client, err := ctlclient.New(cl.GRPCAddrs(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	incs := map[string]uint64{}
	for _, w := range ws {
		incs[w.ID] = waitPhase(t, client, w.ID, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, 0)
	}
	ref, err := engine.NewTransformer(engine.TransformerConfig{Path: filepath.Join(modelDir, engine.TargetFile), Pages: 64})
	if err != nil {
		t.Fatal(err)
	}
	var tk tokenizer.Tokenizer
	for i := 0; i < 6; i++ {
		prompt := tk.Encode(fmt.Sprintf("request %d: where does it run?", i))
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		pl, err := client.Dispatch(ctx, &pb.DispatchRequest{RequestId: fmt.Sprintf("e2e-%d", i), PromptTokens: uint32(len(prompt)), MaxTokens: 24})
		if err != nil {
			t.Fatal(err)
		}
		var addr string
		for _, w := range ws {
			if w.ID == pl.Placement.WorkerId {
				addr = w.GRPCAddr
			}
		}
		cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		stream, err := pb.NewInferenceClient(cc).Generate(ctx, &pb.GenerateRequest{RequestId: pl.Placement.RequestId, Prompt: prompt, MaxTokens: 24})
		if err != nil {
			t.Fatal(err)
		}
		var got []int32
		for {
			r, err := stream.Recv()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("generate on %s: %v", pl.Placement.WorkerId, err)
			}
			got = append(got, r.Token)
		}
		cc.Close()
		cancel()
		out, _ := ref.Forward(context.Background(), []engine.Chunk{{Seq: 1, Tokens: prompt, Sample: 1}})
		want := []int32{out[0][0]}
		for len(want) < 24 {
			out, _ = ref.Forward(context.Background(), []engine.Chunk{{Seq: 1, Tokens: want[len(want)-1:], Sample: 1}})
			want = append(want, out[0][0])
		}
		ref.Release(1)
		if !slices.Equal(got, want) {
			t.Fatalf("request %d on %s:\n got  %v\n want %v", i, pl.Placement.WorkerId, got, want)
		}
	}
	// kill -9 a worker: the controller marks it failed through Serf.
	victim := ws[0]
	killed := time.Now()
	cl.KillWorker(victim)
	waitPhase(t, client, victim.ID, pb.WorkerPhase_WORKER_PHASE_FAILED, 0)
	t.Logf("%s marked FAILED %s after kill -9", victim.ID, time.Since(killed).Round(time.Millisecond))
	// Restarted, it registers a new incarnation and serves again.
	if err := cl.StartWorker(victim); err != nil {
		t.Fatal(err)
	}
	inc := waitPhase(t, client, victim.ID, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, incs[victim.ID])
	if inc <= incs[victim.ID] {
		t.Fatalf("incarnation %d after restart, was %d", inc, incs[victim.ID])
	}
	// SIGSTOP a worker until it is marked FAILED. The process is the same
	// after SIGCONT, but its incarnation is gone: its load is refused, and
	// it registers a new incarnation instead of staying out of service.
	paused := ws[1]
	if err := cl.PauseWorker(paused); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	waitPhase(t, client, paused.ID, pb.WorkerPhase_WORKER_PHASE_FAILED, 0)
	t.Logf("%s marked FAILED %s after SIGSTOP", paused.ID, time.Since(stopped).Round(time.Millisecond))
	if err := cl.ResumeWorker(paused); err != nil {
		t.Fatal(err)
	}
	resumed := time.Now()
	rejoined := waitPhase(t, client, paused.ID, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, incs[paused.ID])
	t.Logf("%s back in FULL_SERVICE as incarnation %d %s after SIGCONT", paused.ID, rejoined, time.Since(resumed).Round(time.Millisecond))
	if rejoined <= incs[paused.ID] {
		t.Fatalf("incarnation %d after the pause, was %d", rejoined, incs[paused.ID])
	}
}
