package gateway

import (
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// regenerated is how many regenerated tokens the gateway counted with the
// result given (matched, mismatched).
func regenerated(g *Gateway, result string) float64 {
	var m dto.Metric
	if err := g.metrics.regenerated.WithLabelValues(result).Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}

// Under stop-and-restart a recovered request runs again from its prompt:
// the resumed call carries no output, the worker decodes the tokens the
// client has again, and the gateway suppresses them, so the client gets
// exactly the reference tokens, none repeated, none missing. Under
// recompute the same resume carries the journal and the worker continues
// at the next token. The gateway learns the strategy from the replica
// whose events it follows (stop-and-restart) or from a StrategyChanged
// event (recompute).
func TestStopAndRestartRegenerates(t *testing.T) {
	for _, c := range []struct {
		name     string
		strategy pb.Strategy
		byEvent  bool
	}{
		{"stop-and-restart", pb.Strategy_STRATEGY_STOP_AND_RESTART, false},
		{"recompute", pb.Strategy_STRATEGY_RECOMPUTE, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newRigThen(t, 1, nil, nil, func(r *rig) {
				if !c.byEvent {
					r.fc.strategy.Store(int32(c.strategy))
				}
			})
			if c.byEvent {
				r.fc.publish(&pb.Event{Body: &pb.Event_StrategyChanged{StrategyChanged: &pb.StrategyChanged{
					From: pb.Strategy_STRATEGY_LUMEN, To: c.strategy}}})
			}
			waitFor(t, 10*time.Second, "the gateway to learn the strategy", func() bool { return pb.Strategy(r.g.strategy.Load()) == c.strategy })
			res := r.complete(t, 5)
			c1 := r.w["w1"].next(t)
			id := c1.req.RequestId
			c1.send(t, 0, 'a', false)
			c1.send(t, 1, 'b', false)
			c1.send(t, 2, 'c', false)
			waitFor(t, 10*time.Second, "three tokens to reach the client", func() bool { return tokensOut(r.g) >= 3 })

			// w1 fails; the recovery plan moves the request to w2.
			r.fc.setPlacement(&pb.Placement{RequestId: id, WorkerId: "w2", Epoch: 2})
			c1.fail(status.Error(codes.Unavailable, "the worker was killed"))
			c2 := r.w["w2"].next(t)
			if string(int32s(c2.req.Prompt)) != string(int32s(c1.req.Prompt)) || c2.req.Epoch != 2 {
				t.Fatalf("resumed call: prompt %v epoch %d; want the prompt %v at epoch 2", c2.req.Prompt, c2.req.Epoch, c1.req.Prompt)
			}
			if c.strategy == pb.Strategy_STRATEGY_STOP_AND_RESTART {
				if len(c2.req.Generated) != 0 {
					t.Fatalf("stop-and-restart resumed with history %q; want the prompt alone", string(int32s(c2.req.Generated)))
				}
				c2.send(t, 0, 'a', false)
				c2.send(t, 1, 'b', false)
				c2.send(t, 2, 'c', false)
				if n := tokensOut(r.g); n != 3 {
					t.Fatalf("the gateway delivered %v tokens after the regeneration, want the 3 the client had", n)
				}
			} else if string(int32s(c2.req.Generated)) != "abc" {
				t.Fatalf("recompute resumed with history %q, want \"abc\"", string(int32s(c2.req.Generated)))
			}
			c2.send(t, 3, 'd', false)
			c2.send(t, 4, 'e', true)
			got := wait(t, res)
			if got.err != nil || !got.done || got.text.String() != "abcde" {
				t.Fatalf("client got %q done=%v err=%v %s; want \"abcde\"", got.text.String(), got.done, got.err, got.errMsg)
			}
			wantMatched := 0.0
			if c.strategy == pb.Strategy_STRATEGY_STOP_AND_RESTART {
				wantMatched = 3
			}
			if m, mm := regenerated(r.g, "matched"), regenerated(r.g, "mismatched"); m != wantMatched || mm != 0 {
				t.Fatalf("regenerated tokens: %v matched, %v mismatched; want %v, 0", m, mm, wantMatched)
			}
		})
	}
}

// A regenerated token that differs from the one the client has (decoding
// that is not deterministic) is counted and logged, never shown: the call
// is cut and the request continues from the journal on the same worker.
func TestStopAndRestartMismatchContinuesFromJournal(t *testing.T) {
	r := newRigThen(t, 1, nil, nil, func(r *rig) { r.fc.strategy.Store(int32(pb.Strategy_STRATEGY_STOP_AND_RESTART)) })
	waitFor(t, 10*time.Second, "the gateway to learn the strategy", func() bool { return r.g.regenerates() })
	res := r.complete(t, 4)
	c1 := r.w["w1"].next(t)
	id := c1.req.RequestId
	c1.send(t, 0, 'a', false)
	c1.send(t, 1, 'b', false)
	waitFor(t, 10*time.Second, "two tokens to reach the client", func() bool { return tokensOut(r.g) >= 2 })
	r.fc.publish(moved(&pb.Placement{RequestId: id, WorkerId: "w2", Epoch: 2}))
	c2 := r.w["w2"].next(t)
	if len(c2.req.Generated) != 0 {
		t.Fatalf("stop-and-restart resumed with history %q", string(int32s(c2.req.Generated)))
	}
	c2.send(t, 0, 'a', false)
	c2.send(t, 1, 'x', false) // the client has 'b' there
	c3 := r.w["w2"].next(t)
	if c3.req.Epoch != 2 || string(int32s(c3.req.Generated)) != "ab" {
		t.Fatalf("after the mismatch: epoch %d, history %q; want epoch 2 and the journal \"ab\"", c3.req.Epoch, string(int32s(c3.req.Generated)))
	}
	c3.send(t, 2, 'c', false)
	c3.send(t, 3, 'd', true)
	got := wait(t, res)
	if got.err != nil || !got.done || got.text.String() != "abcd" {
		t.Fatalf("client got %q done=%v err=%v %s; want \"abcd\"", got.text.String(), got.done, got.err, got.errMsg)
	}
	if m, mm := regenerated(r.g, "matched"), regenerated(r.g, "mismatched"); m != 1 || mm != 1 {
		t.Fatalf("regenerated tokens: %v matched, %v mismatched; want 1, 1", m, mm)
	}
}
