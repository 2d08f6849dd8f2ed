package worker

import (
	"context"
	"math/rand"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// TestPriorityOrdersTheDaemon (issue 23): a GenerateRequest's priority
// reaches the core through the daemon. On a worker whose two running
// slots hold normal requests and whose queue holds three more, a request
// that arrives last with priority -5 takes the newest running request's
// slot (one preemption, by recompute) and has its first token before any
// of the queued ones; sent with priority 0 instead, the same request is
// served behind the queue, and nobody is preempted. Every output,
// the preempted request's included, equals the request run alone.
func TestPriorityOrdersTheDaemon(t *testing.T) {
	const seed = 23
	t.Logf("seed %d", seed)
	for _, c := range []struct {
		name        string
		priority    int32
		wantFirst   bool // the late request's first token before every queued one's
		preemptions float64
	}{
		{"urgent", -5, true, 1},
		{"normal", 0, false, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			rng := rand.New(rand.NewSource(seed))
			h := start(t, 256, func(cf *Config) {
				cf.MaxRunning = 2
				cf.Engine = engine.NewPaced(cf.Engine, engine.Profiles["qwen3-14b-h100"], 1)
			})
			ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
			defer cancel()
			waitGauge := func(g prometheus.Gauge, v float64) {
				t.Helper()
				for gaugeValue(g) < v {
					if ctx.Err() != nil {
						t.Fatalf("timed out waiting for the gauge to reach %g (at %g)", v, gaugeValue(g))
					}
					time.Sleep(time.Millisecond)
				}
			}
			type call struct {
				id     string
				prompt []int32
				max    int
				pri    int32
			}
			var (
				mu    sync.Mutex
				order []string // first tokens, in the order they came
				outs  = map[string][]int32{}
				wg    sync.WaitGroup
				calls []call
			)
			send := func(cl call) {
				calls = append(calls, cl)
				wg.Go(func() {
					st, err := h.cl.Generate(ctx, &pb.GenerateRequest{RequestId: cl.id, Prompt: cl.prompt, MaxTokens: uint32(cl.max), Priority: cl.pri})
					if err != nil {
						t.Error(err)
						return
					}
					var out []int32
					for {
						r, err := st.Recv()
						if err != nil {
							t.Errorf("%s: %v", cl.id, err)
							return
						}
						if len(out) == 0 {
							mu.Lock()
							order = append(order, cl.id)
							mu.Unlock()
						}
						out = append(out, r.Token)
						if r.Done {
							break
						}
					}
					mu.Lock()
					outs[cl.id] = out
					mu.Unlock()
				})
			}
			// Two long normal requests take both slots.
			send(call{"busy1", randomPrompt(rng, 8), 60, 0})
			waitGauge(h.w.metrics.running, 1)
			send(call{"busy2", randomPrompt(rng, 8), 60, 0})
			waitGauge(h.w.metrics.running, 2)
			// Three normal requests queue behind them.
			for i, id := range []string{"q1", "q2", "q3"} {
				send(call{id, randomPrompt(rng, 8), 4, 0})
				waitGauge(h.w.metrics.waiting, float64(i+1))
			}
			before := counterValue(h.w.metrics.preemptions)
			send(call{"late", randomPrompt(rng, 8), 8, c.priority})
			wg.Wait()
			if t.Failed() {
				return
			}
			for _, cl := range calls {
				if want := reference(t, cl.prompt, cl.max); !slices.Equal(outs[cl.id], want) {
					t.Errorf("%s: output %v, want the reference %v", cl.id, outs[cl.id], want)
				}
			}
			queued := []string{"q1", "q2", "q3"}
			late := slices.Index(order, "late")
			first := true
			for _, q := range queued {
				first = first && late < slices.Index(order, q)
			}
			if first != c.wantFirst {
				t.Errorf("first tokens in order %v: the late request (priority %d) first of the queued ones %v, want %v", order, c.priority, first, c.wantFirst)
			}
			if !c.wantFirst && (late < slices.Index(order, "q1") || late < slices.Index(order, "q2")) {
				t.Errorf("first tokens in order %v: at priority 0 the late request should come after q1 and q2, admitted before it", order)
			}
			if got := counterValue(h.w.metrics.preemptions) - before; got != c.preemptions {
				t.Errorf("%g preemptions after the late request, want %g", got, c.preemptions)
			}
		})
	}
}
