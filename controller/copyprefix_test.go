package controller

import (
	"context"
	"net"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// prefixWorker answers CheckpointPrefixes with a fixed prefix per request,
// or, while hang is set, not at all.
type prefixWorker struct {
	pb.UnimplementedInferenceServer
	tokens uint32
	hang   atomic.Bool
	asked  atomic.Int32
}

func (w *prefixWorker) CheckpointPrefixes(ctx context.Context, req *pb.CheckpointPrefixesRequest) (*pb.CheckpointPrefixesResponse, error) {
	w.asked.Add(1)
	if w.hang.Load() {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	out := &pb.CheckpointPrefixesResponse{}
	for range req.RequestIds {
		out.Tokens = append(out.Tokens, w.tokens)
	}
	return out, nil
}

// TestLeaderAsksHoldersForCopyPrefixes: before it proposes a MarkFailed,
// the leader asks the live holders of the failed worker's replicated
// requests what each holds, over gRPC, and gives up on a holder that does
// not answer within copyPrefixTimeout, which then has no entry.
func TestLeaderAsksHoldersForCopyPrefixes(t *testing.T) {
	c := newCluster(t, 3, nil)
	defer c.close()
	leader := c.waitLeader()
	fakes := map[string]*prefixWorker{}
	for i, id := range []string{"w1", "w2", "w3", "w4"} {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		f := &prefixWorker{tokens: uint32(16 * (i + 1))}
		srv := grpc.NewServer()
		pb.RegisterInferenceServer(srv, f)
		go srv.Serve(lis)
		t.Cleanup(srv.Stop)
		fakes[id] = f
		if _, err := c.client(leader).RegisterWorker(ctxT(t, 5*time.Second), &pb.RegisterWorkerRequest{Worker: &pb.Worker{
			Id: id, Incarnation: 1, GrpcAddr: lis.Addr().String(), Node: "node-" + id,
			Capacity: &pb.Capacity{KvPagesTotal: 1000, CheckpointBudgetBytes: 1 << 40, KvBytesPerToken: 1024,
				MaxContextTokens: 8192, H2DBytesPerSec: 25e9}}}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pb.NewOperatorClient(c.conn(leader)).SetStrategy(ctxT(t, 5*time.Second), &pb.SetStrategyRequest{CheckpointReplicas: 2}); err != nil {
		t.Fatal(err)
	}
	resp, err := c.client(leader).Dispatch(ctxT(t, 5*time.Second), &pb.DispatchRequest{RequestId: "r1", PromptTokens: 100, MaxTokens: 50})
	if err != nil {
		t.Fatal(err)
	}
	p := resp.Placement
	copies := append([]string{p.HolderId}, p.ReplicaHolders...)
	if len(copies) != 2 {
		t.Fatalf("r1's copies %v, want 2", copies)
	}
	slices.Sort(copies)
	got := leader.copyPrefixes(context.Background(), p.WorkerId)
	var want []*pb.CopyPrefix
	for _, h := range copies {
		want = append(want, &pb.CopyPrefix{RequestId: "r1", Holder: h, Tokens: fakes[h].tokens})
	}
	if !slices.EqualFunc(got, want, func(a, b *pb.CopyPrefix) bool {
		return a.RequestId == b.RequestId && a.Holder == b.Holder && a.Tokens == b.Tokens
	}) {
		t.Fatalf("the leader gathered %v, want %v", got, want)
	}
	if n := fakes[p.WorkerId].asked.Load(); n != 0 {
		t.Fatalf("the failed worker itself was asked %d times", n)
	}
	// A holder that does not answer: the MarkFailed goes on without it.
	fakes[copies[0]].hang.Store(true)
	start := time.Now()
	got = leader.copyPrefixes(context.Background(), p.WorkerId)
	if took := time.Since(start); took > 10*copyPrefixTimeout {
		t.Fatalf("the leader waited %s for a silent holder (limit %s)", took, copyPrefixTimeout)
	}
	if len(got) != 1 || got[0].Holder != copies[1] {
		t.Fatalf("with %s silent the leader gathered %v, want %s's entry alone", copies[0], got, copies[1])
	}
}
