package controller

import (
	"context"
	"sort"
	"sync"
	"time"

	"google.golang.org/grpc"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// copyPrefixTimeout bounds the leader's questions to a failed worker's
// holders (CheckpointPrefixes): a holder that has not answered by then
// counts as holding none of the copies it was asked about, and the
// MarkFailed is proposed without waiting longer. It is the probe's order
// of time: the question is one read of a map per request.
const copyPrefixTimeout = 300 * time.Millisecond

// copyPrefixes asks the live holders of worker id's requests' checkpoint
// copies what each holds, for the requests with more than one copy
// (fsm.ReplicatedCopies), and returns the answers for the MarkFailed
// command (MarkFailedCmd.checkpointed), sorted by request and holder. A
// request whose holders all failed to answer gets no entry: its copies
// count alike. nil with no replicated request: R = 1 needs no question.
func (n *Node) copyPrefixes(ctx context.Context, id string) []*pb.CopyPrefix {
	byHolder := n.fsm.ReplicatedCopies(id)
	if len(byHolder) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, copyPrefixTimeout)
	defer cancel()
	var (
		mu  sync.Mutex
		out []*pb.CopyPrefix
		wg  sync.WaitGroup
	)
	for holder, reqs := range byHolder {
		w := n.fsm.Worker(holder)
		if w == nil || w.GrpcAddr == "" || w.Phase == pb.WorkerPhase_WORKER_PHASE_FAILED || w.Phase == pb.WorkerPhase_WORKER_PHASE_LEFT {
			continue
		}
		wg.Go(func() {
			tokens, err := askCopyPrefixes(ctx, w.GrpcAddr, reqs, DialOptions(n.clientTLS))
			if err != nil {
				n.log.Info("a holder did not say what it holds of a failed worker's requests", "holder", holder, "failed", id, "error", err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			for i, rid := range reqs {
				if i < len(tokens) {
					out = append(out, &pb.CopyPrefix{RequestId: rid, Holder: holder, Tokens: tokens[i]})
				}
			}
		})
	}
	wg.Wait()
	sort.Slice(out, func(a, b int) bool {
		if out[a].RequestId != out[b].RequestId {
			return out[a].RequestId < out[b].RequestId
		}
		return out[a].Holder < out[b].Holder
	})
	return out
}

func askCopyPrefixes(ctx context.Context, addr string, reqs []string, opts []grpc.DialOption) ([]uint32, error) {
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return nil, err
	}
	defer cc.Close()
	resp, err := pb.NewInferenceClient(cc).CheckpointPrefixes(ctx, &pb.CheckpointPrefixesRequest{RequestIds: reqs})
	if err != nil {
		return nil, err
	}
	return resp.Tokens, nil
}
