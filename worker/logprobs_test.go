package worker

import (
	"context"
	"fmt"
	"io"
	"math/rand"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// referenceLogprobs is the engine's own run of a prompt, alone, token by
// token: each token's logprobs with k alternatives, as GenerateResponses.
func referenceLogprobs(t *testing.T, prompt []int32, n, k int) []*pb.GenerateResponse {
	t.Helper()
	reference(t, prompt[:1], 1) // builds refEng
	refMu.Lock()
	defer refMu.Unlock()
	e := refEng
	defer e.Release(1)
	var out []*pb.GenerateResponse
	in := prompt
	for len(out) < n {
		slot := make([]engine.Logprobs, 1)
		got, err := e.Forward(context.Background(), []engine.Chunk{{Seq: 1, Tokens: in, Sample: 1, OutIndex: len(out), Logprobs: slot, TopLogprobs: k}})
		if err != nil {
			t.Fatal(err)
		}
		r := &pb.GenerateResponse{Token: got[0][0], Logprob: slot[0].Logprob}
		for _, tl := range slot[0].Top {
			r.TopLogprobs = append(r.TopLogprobs, &pb.TokenLogprob{Token: tl.Token, Logprob: tl.Logprob})
		}
		out = append(out, r)
		in = got[0]
	}
	return out
}

// generateLogprobs runs a request to the end and returns its responses.
func (h *harness) generateLogprobs(ctx context.Context, req *pb.GenerateRequest) ([]*pb.GenerateResponse, error) {
	stream, err := h.cl.Generate(ctx, req)
	if err != nil {
		return nil, err
	}
	var out []*pb.GenerateResponse
	for {
		r, err := stream.Recv()
		if err == io.EOF {
			return out, fmt.Errorf("stream ended without done")
		}
		if err != nil {
			return out, err
		}
		if int(r.Index) != len(req.Generated)+len(out) {
			return out, fmt.Errorf("index %d after %d tokens", r.Index, len(req.Generated)+len(out))
		}
		out = append(out, r)
		if r.Done {
			return out, nil
		}
	}
}

// sameLogprobs compares tokens and logprobs bit for bit.
func sameLogprobs(got, want []*pb.GenerateResponse) error {
	if len(got) != len(want) {
		return fmt.Errorf("%d tokens, want %d", len(got), len(want))
	}
	for i := range got {
		g := &pb.GenerateResponse{Token: got[i].Token, Logprob: got[i].Logprob, TopLogprobs: got[i].TopLogprobs}
		if !proto.Equal(g, want[i]) {
			return fmt.Errorf("token %d: %v, reference %v", i, g, want[i])
		}
	}
	return nil
}

// TestLogprobsSurviveResumeAndPreemption: concurrent requests asking for
// logprobs, in a cache too small for them (preempted and recomputed) with
// chunked prefills, get every token's logprobs equal, bit for bit, to the
// request's failure-free run alone; and a resumed call (the tokens so far
// in Generated, as after its worker failed: the history is prefilled anew)
// continues with the reference's logprobs.
func TestLogprobsSurviveResumeAndPreemption(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	h := start(t, 14, func(c *Config) { c.TokenBudget = 32 })
	type job struct {
		prompt []int32
		n, k   int
	}
	jobs := make([]job, 6)
	for i := range jobs {
		jobs[i] = job{randomPrompt(rng, 5+rng.Intn(40)), 40 + rng.Intn(10), rng.Intn(engine.MaxTopLogprobs + 1)}
	}
	got := make([][]*pb.GenerateResponse, len(jobs))
	errs := make([]error, len(jobs))
	var wg sync.WaitGroup
	for i, j := range jobs {
		wg.Go(func() {
			got[i], errs[i] = h.generateLogprobs(context.Background(), &pb.GenerateRequest{RequestId: fmt.Sprintf("lp%d", i),
				Prompt: j.prompt, MaxTokens: uint32(j.n), Logprobs: true, TopLogprobs: uint32(j.k)})
		})
	}
	wg.Wait()
	for i, j := range jobs {
		if errs[i] != nil {
			t.Fatalf("seed %d request %d: %v", seed, i, errs[i])
		}
		want := referenceLogprobs(t, j.prompt, j.n, j.k)
		if err := sameLogprobs(got[i], want); err != nil {
			t.Fatalf("seed %d request %d (top %d): %v", seed, i, j.k, err)
		}
		if i == 0 {
			// Resumed after 12 tokens.
			res, err := h.generateLogprobs(context.Background(), &pb.GenerateRequest{RequestId: "lp-resume", Prompt: j.prompt,
				Generated: tokens(want[:12]), MaxTokens: uint32(j.n), Logprobs: true, TopLogprobs: uint32(j.k)})
			if err != nil {
				t.Fatal(err)
			}
			if err := sameLogprobs(res, want[12:]); err != nil {
				t.Fatalf("seed %d: resumed after 12 tokens: %v", seed, err)
			}
		}
	}
	if pre := counterValue(h.w.metrics.preemptions); pre == 0 {
		t.Fatal("a 14-page cache for 6 requests of 3+ pages never preempted: the test does not exercise recomputation")
	}
	// Without logprobs the responses carry none.
	out, err := h.generateLogprobs(context.Background(), &pb.GenerateRequest{RequestId: "plain", Prompt: jobs[0].prompt, MaxTokens: 3})
	if err != nil || out[0].Logprob != 0 || len(out[0].TopLogprobs) != 0 {
		t.Fatalf("a request without logprobs got %v (%v)", out, err)
	}
}

func tokens(rs []*pb.GenerateResponse) []int32 {
	out := make([]int32, len(rs))
	for i, r := range rs {
		out[i] = r.Token
	}
	return out
}

// TestLogprobLimits: top_logprobs above 20, or without logprobs, is
// refused naming the limit.
func TestLogprobLimits(t *testing.T) {
	h := start(t, 16, nil)
	for _, c := range []struct {
		req  *pb.GenerateRequest
		want string
	}{
		{&pb.GenerateRequest{RequestId: "a", Prompt: []int32{1}, MaxTokens: 2, Logprobs: true, TopLogprobs: 21}, "top_logprobs 21: at most 20"},
		{&pb.GenerateRequest{RequestId: "b", Prompt: []int32{1}, MaxTokens: 2, TopLogprobs: 2}, "top_logprobs 2 needs logprobs or prompt_logprobs set"},
	} {
		_, err := h.generateLogprobs(context.Background(), c.req)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want %q", c.req, err, c.want)
		}
	}
}
