package worker

import (
	"context"
	"math/rand"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// TestOlderEpochIsRejected: a call carrying an older placement epoch than the
// one a request runs under here is a stale call from before a move (a
// gateway acting on a lagging replica): it must not take the request over.
// An equal or newer epoch still does.
func TestOlderEpochIsRejected(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	h := start(t, 256, func(c *Config) {
		c.Engine = engine.NewPaced(c.Engine, engine.Profiles["qwen3-14b-h100"], 1)
	})
	prompt := randomPrompt(rng, 20)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	current, err := h.cl.Generate(ctx, &pb.GenerateRequest{RequestId: "x", Prompt: prompt, MaxTokens: 200, Epoch: 3})
	if err != nil {
		t.Fatal(err)
	}
	var got []int32
	for len(got) < 2 {
		r, err := current.Recv()
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, r.Token)
	}

	stale, err := h.cl.Generate(ctx, &pb.GenerateRequest{RequestId: "x", Prompt: prompt, Generated: got, MaxTokens: 200, Epoch: 2})
	if err != nil {
		t.Fatal(err)
	}
	_, err = stale.Recv()
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("a call with an older epoch ended %v, want FailedPrecondition", err)
	}
	if msg := status.Convert(err).Message(); !strings.Contains(msg, "epoch 2") || !strings.Contains(msg, "epoch 3") {
		t.Fatalf("the refusal %q does not name both epochs", msg)
	}
	// The request under epoch 3 runs on.
	if _, err := current.Recv(); err != nil {
		t.Fatalf("the current call after a stale one was refused: %v", err)
	}

	// The same epoch takes over, as a resume from the same gateway does.
	same, err := h.cl.Generate(ctx, &pb.GenerateRequest{RequestId: "x", Prompt: prompt, Generated: got, MaxTokens: 200, Epoch: 3})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := same.Recv(); err != nil {
		t.Fatalf("a call with the same epoch: %v", err)
	}
	for {
		if _, err := current.Recv(); err != nil {
			if status.Code(err) != codes.Aborted {
				t.Fatalf("the superseded call ended %v, want Aborted", err)
			}
			break
		}
	}
	// A newer one too.
	newer, err := h.cl.Generate(ctx, &pb.GenerateRequest{RequestId: "x", Prompt: prompt, Generated: got, MaxTokens: 200, Epoch: 4})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := newer.Recv(); err != nil {
		t.Fatalf("a call with a newer epoch: %v", err)
	}
	for {
		if _, err := same.Recv(); err != nil {
			if status.Code(err) != codes.Aborted {
				t.Fatalf("the superseded call ended %v, want Aborted", err)
			}
			break
		}
	}
}
