package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"

	"github.com/lumen-project/lumen/internal/completions"
	"github.com/lumen-project/lumen/internal/devcluster"
	"github.com/lumen-project/lumen/internal/progress"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// GatewayConfig is `lumen bench gateway`.
type GatewayConfig struct {
	// Quick shortens each phase from 15 s to 5 s.
	Quick bool
	// JSONPath, when set, receives the figures as JSON.
	JSONPath string
	// Profile is the worker's timing profile.
	Profile string
	// PromptLen and MaxTokens are each request's prompt and output tokens.
	PromptLen, MaxTokens int
	// CPUProfile, when set, receives the gateway process's CPU profile of
	// the 500-stream phase through it.
	CPUProfile string
}

// DefaultGatewayConfig is `lumen bench gateway` without flags.
func DefaultGatewayConfig() GatewayConfig {
	return GatewayConfig{Profile: "qwen3-14b-h100", PromptLen: 64, MaxTokens: 64}
}

type streamResult struct {
	ttft   []time.Duration
	tokens int64
	errors int64
	wall   time.Duration
}

func (r *streamResult) pct(p float64) float64 { return percentileMs(r.ttft, p) }

// add pools another slice's figures into r.
func (r *streamResult) add(o *streamResult) {
	r.ttft = append(r.ttft, o.ttft...)
	r.tokens += o.tokens
	r.errors += o.errors
	r.wall += o.wall
}

func (r *streamResult) tps() float64 { return float64(r.tokens) / r.wall.Seconds() }

// load runs `streams` clients, each sending requests back to back for d.
func load(streams int, d time.Duration, one func(ctx context.Context, c, i int) (time.Duration, int, error)) *streamResult {
	var mu sync.Mutex
	res := &streamResult{}
	var tokens, errs atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for c := 0; c < streams; c++ {
		wg.Go(func() {
			var local []time.Duration
			for i := 0; time.Since(start) < d; i++ {
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				ttft, n, err := one(ctx, c, i)
				cancel()
				if err != nil {
					errs.Add(1)
					continue
				}
				local = append(local, ttft)
				tokens.Add(int64(n))
			}
			mu.Lock()
			res.ttft = append(res.ttft, local...)
			mu.Unlock()
		})
	}
	wg.Wait()
	res.wall, res.tokens, res.errors = time.Since(start), tokens.Load(), errs.Load()
	return res
}

// Gateway measures TTFT and throughput through the gateway against
// straight to the worker, at 1, 100 and 500 concurrent streams.
func Gateway(cfg GatewayConfig) error {
	d := 15 * time.Second
	if cfg.Quick {
		d = 5 * time.Second
	}
	dir, err := os.MkdirTemp("", "lumen-bench-gateway-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cl, err := devcluster.Start(ctx, devcluster.Options{Dir: dir, Controllers: 3, Args: []string{"-log-level", "warn"}})
	if err != nil {
		return err
	}
	defer cl.Stop()
	w, err := cl.AddWorker("bench-worker", "-engine", "synthetic", "-profile", cfg.Profile, "-time-scale", "1",
		"-max-running", "1024", "-token-budget", "8192", "-emulate-load=false")
	if err != nil {
		return err
	}
	gwArgs := []string{"-max-concurrent", "4096", "-max-context", "32768"}
	if cfg.CPUProfile != "" {
		gwArgs = append(gwArgs, "-pprof")
	}
	gw, err := cl.StartGateway("", gwArgs...)
	if err != nil {
		return err
	}
	if err := gw.WaitReady(ctx); err != nil {
		return err
	}
	cc, err := grpc.NewClient(w.GRPCAddr, grpcInsecure())
	if err != nil {
		return err
	}
	defer cc.Close()
	worker := pb.NewInferenceClient(cc)
	prompt := gatewayPrompt(cfg.PromptLen)
	body := completions.Body(prompt, cfg.MaxTokens, true)
	httpc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024, MaxConnsPerHost: 0}}
	var seq atomic.Int64

	direct := func(ctx context.Context, c, i int) (time.Duration, int, error) {
		t0 := time.Now()
		st, err := worker.Generate(ctx, &pb.GenerateRequest{RequestId: fmt.Sprintf("d%d", seq.Add(1)), Prompt: prompt, MaxTokens: uint32(cfg.MaxTokens)})
		if err != nil {
			return 0, 0, err
		}
		var ttft time.Duration
		n := 0
		for {
			r, err := st.Recv()
			if err != nil {
				return 0, 0, err
			}
			if n == 0 {
				ttft = time.Since(t0)
			}
			n++
			if r.Done {
				return ttft, n, nil
			}
		}
	}
	viaGateway := func(ctx context.Context, c, i int) (time.Duration, int, error) {
		t0 := time.Now()
		var ttft time.Duration
		res, err := completions.Stream(ctx, httpc, gw.Addr, body, func(completions.Chunk) {
			if ttft == 0 {
				ttft = time.Since(t0) // the first chunk carries the first token
			}
		})
		if err != nil {
			return 0, 0, err
		}
		// Count tokens from usage: a chunk may carry more than one token's
		// bytes.
		n := 0
		if res.Usage != nil {
			n = res.Usage.CompletionTokens
		}
		return ttft, n, nil
	}

	// Warm both paths (connections, the gateway's worker directory and
	// load table) so no phase pays a first request's set-up.
	for i := 0; i < 3; i++ {
		if _, _, err := direct(ctx, 0, i); err != nil {
			return fmt.Errorf("warm-up straight to the worker: %w", err)
		}
		if _, _, err := viaGateway(ctx, 0, i); err != nil {
			return fmt.Errorf("warm-up through the gateway: %w", err)
		}
	}
	out := map[string]float64{}
	var rows []gatewayRow
	// Progress: the three loads, each four half phases.
	meter := progress.New("bench gateway", "loads", 3)
	defer meter.Finish("")
	for i, n := range []int{1, 100, 500} {
		meter.Set(float64(i), fmt.Sprintf("%d streams", n))
		// Side by side: each path runs two half phases, in the order
		// direct, gateway, gateway, direct, so a drift of the machine's
		// load (other processes on the shared cores) falls on both alike.
		half := d / 2
		fmt.Printf("%d streams: straight to the worker and through the gateway, %s each, in the order d g g d ...\n", n, d)
		a, b := &streamResult{}, &streamResult{}
		a.add(load(n, half, direct))
		var profiled sync.WaitGroup
		if n == 500 && cfg.CPUProfile != "" {
			profiled.Go(func() { saveProfile(gw.Addr, max(half-time.Second, time.Second), cfg.CPUProfile) })
		}
		b.add(load(n, half, viaGateway))
		profiled.Wait()
		b.add(load(n, half, viaGateway))
		a.add(load(n, half, direct))
		if a.errors > 0 || b.errors > 0 {
			fmt.Printf("  errors: direct %d, gateway %d\n", a.errors, b.errors)
		}
		rows = append(rows, gatewayFigures(out, n, a, b))
	}
	printGatewayTable(os.Stdout, rows)
	if cfg.JSONPath != "" {
		return writeJSON(cfg.JSONPath, out)
	}
	return nil
}

// gatewayPrompt is the benchmark's prompt: n token ids cycling over 'a'..'z'.
func gatewayPrompt(n int) []int32 {
	prompt := make([]int32, n)
	for i := range prompt {
		prompt[i] = int32('a' + i%26)
	}
	return prompt
}

// gatewayRow is one line of the gateway table.
type gatewayRow struct{ name, direct, gw, diff string }

// gatewayFigures puts the figures of n streams, straight to the worker (a)
// and through the gateway (b), under their JSON keys in out, and returns
// their line of the table.
func gatewayFigures(out map[string]float64, n int, a, b *streamResult) gatewayRow {
	added := b.pct(0.99) - a.pct(0.99)
	loss := 100 * (1 - b.tps()/a.tps())
	out[fmt.Sprintf("direct_ttft_p50_ms_%d", n)], out[fmt.Sprintf("direct_ttft_p99_ms_%d", n)] = a.pct(0.5), a.pct(0.99)
	out[fmt.Sprintf("gateway_ttft_p50_ms_%d", n)], out[fmt.Sprintf("gateway_ttft_p99_ms_%d", n)] = b.pct(0.5), b.pct(0.99)
	out[fmt.Sprintf("added_ttft_p99_ms_%d", n)] = added
	out[fmt.Sprintf("direct_tokens_per_s_%d", n)], out[fmt.Sprintf("gateway_tokens_per_s_%d", n)] = a.tps(), b.tps()
	out[fmt.Sprintf("throughput_loss_pct_%d", n)] = loss
	out[fmt.Sprintf("errors_%d", n)] = float64(a.errors + b.errors)
	return gatewayRow{fmt.Sprintf("%d streams", n),
		fmt.Sprintf("TTFT p50 %.1f p99 %.1f ms, %.0f tok/s", a.pct(0.5), a.pct(0.99), a.tps()),
		fmt.Sprintf("TTFT p50 %.1f p99 %.1f ms, %.0f tok/s", b.pct(0.5), b.pct(0.99), b.tps()),
		fmt.Sprintf("p99 TTFT %+.1f ms, throughput %+.1f%%", added, -loss)}
}

// printGatewayTable prints the table `lumen bench gateway` ends with.
func printGatewayTable(w io.Writer, rows []gatewayRow) {
	fmt.Fprintf(w, "\n%-12s %-40s %-40s %s\n", "load", "straight to the worker", "through the gateway", "gateway's cost")
	for _, r := range rows {
		fmt.Fprintf(w, "%-12s %-40s %-40s %s\n", r.name, r.direct, r.gw, r.diff)
	}
	fmt.Fprintf(w, "(goal, issue 16: <= 2 ms added p99 TTFT at 1, 100 and 500 streams; <= 1%% throughput loss at 500)\n")
}
