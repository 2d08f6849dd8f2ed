package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"

	"github.com/lumen-project/lumen/internal/devcluster"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func init() {
	register("bench gateway", "TTFT and throughput through the gateway vs straight to the worker, at 1/100/500 streams", runBenchGateway)
}

type streamResult struct {
	ttft   []time.Duration
	tokens int64
	errors int64
	wall   time.Duration
}

func (r *streamResult) pct(p float64) float64 {
	if len(r.ttft) == 0 {
		return 0
	}
	sort.Slice(r.ttft, func(i, j int) bool { return r.ttft[i] < r.ttft[j] })
	return float64(r.ttft[int(float64(len(r.ttft)-1)*p)].Microseconds()) / 1000
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

func runBenchGateway(args []string) error {
	fs := flag.NewFlagSet("bench gateway", flag.ContinueOnError)
	quick := fs.Bool("quick", false, "shorter phases")
	jsonPath := fs.String("json", "", "write the figures as JSON")
	profile := fs.String("profile", "qwen3-14b-h100", "the worker's timing profile")
	promptLen := fs.Int("prompt", 64, "prompt tokens")
	maxTokens := fs.Int("max-tokens", 64, "output tokens per request")
	if err := fs.Parse(args); err != nil {
		return err
	}
	d := 15 * time.Second
	if *quick {
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
	w, err := cl.AddWorker("bench-worker", "-engine", "synthetic", "-profile", *profile, "-time-scale", "1",
		"-max-running", "1024", "-token-budget", "8192", "-emulate-load=false")
	if err != nil {
		return err
	}
	gw, err := cl.StartGateway("", "-max-concurrent", "4096", "-max-context", "32768")
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
	prompt := make([]int32, *promptLen)
	promptIDs := make([]string, *promptLen)
	for i := range prompt {
		prompt[i] = int32('a' + i%26)
		promptIDs[i] = fmt.Sprint(prompt[i])
	}
	body := fmt.Sprintf(`{"model":"lumen-tiny","prompt":[%s],"max_tokens":%d,"temperature":0,"stream":true,"stream_options":{"include_usage":true}}`, strings.Join(promptIDs, ","), *maxTokens)
	httpc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024, MaxConnsPerHost: 0}}
	var seq atomic.Int64

	direct := func(ctx context.Context, c, i int) (time.Duration, int, error) {
		t0 := time.Now()
		st, err := worker.Generate(ctx, &pb.GenerateRequest{RequestId: fmt.Sprintf("d%d", seq.Add(1)), Prompt: prompt, MaxTokens: uint32(*maxTokens)})
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
		req, _ := http.NewRequestWithContext(ctx, "POST", "http://"+gw.Addr+"/v1/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		resp, err := httpc.Do(req)
		if err != nil {
			return 0, 0, err
		}
		defer resp.Body.Close()
		if resp.StatusCode != 200 {
			return 0, 0, fmt.Errorf("status %d", resp.StatusCode)
		}
		sc := bufio.NewScanner(resp.Body)
		var ttft time.Duration
		n := 0
		for sc.Scan() {
			line := sc.Bytes()
			if !bytes.HasPrefix(line, []byte("data: ")) {
				continue
			}
			data := line[6:]
			if bytes.Equal(data, []byte("[DONE]")) {
				return ttft, n, nil
			}
			if ttft == 0 {
				ttft = time.Since(t0) // the first chunk carries the first token
			}
			// Count tokens from usage: a chunk may carry more than one
			// token's bytes.
			if bytes.Contains(data, []byte(`"usage"`)) {
				var u struct {
					Usage struct {
						CompletionTokens int `json:"completion_tokens"`
					} `json:"usage"`
				}
				if err := json.Unmarshal(data, &u); err != nil {
					return 0, 0, err
				}
				n = u.Usage.CompletionTokens
			}
		}
		return 0, 0, fmt.Errorf("stream ended without [DONE]: %v", sc.Err())
	}

	out := map[string]float64{}
	type row struct{ name, direct, gw, diff string }
	var rows []row
	for _, n := range []int{1, 100, 500} {
		fmt.Printf("%d streams: straight to the worker for %s ...\n", n, d)
		a := load(n, d, direct)
		fmt.Printf("%d streams: through the gateway for %s ...\n", n, d)
		b := load(n, d, viaGateway)
		if a.errors > 0 || b.errors > 0 {
			fmt.Printf("  errors: direct %d, gateway %d\n", a.errors, b.errors)
		}
		added := b.pct(0.99) - a.pct(0.99)
		loss := 100 * (1 - b.tps()/a.tps())
		out[fmt.Sprintf("direct_ttft_p50_ms_%d", n)], out[fmt.Sprintf("direct_ttft_p99_ms_%d", n)] = a.pct(0.5), a.pct(0.99)
		out[fmt.Sprintf("gateway_ttft_p50_ms_%d", n)], out[fmt.Sprintf("gateway_ttft_p99_ms_%d", n)] = b.pct(0.5), b.pct(0.99)
		out[fmt.Sprintf("added_ttft_p99_ms_%d", n)] = added
		out[fmt.Sprintf("direct_tokens_per_s_%d", n)], out[fmt.Sprintf("gateway_tokens_per_s_%d", n)] = a.tps(), b.tps()
		out[fmt.Sprintf("throughput_loss_pct_%d", n)] = loss
		out[fmt.Sprintf("errors_%d", n)] = float64(a.errors + b.errors)
		rows = append(rows, row{fmt.Sprintf("%d streams", n),
			fmt.Sprintf("TTFT p50 %.1f p99 %.1f ms, %.0f tok/s", a.pct(0.5), a.pct(0.99), a.tps()),
			fmt.Sprintf("TTFT p50 %.1f p99 %.1f ms, %.0f tok/s", b.pct(0.5), b.pct(0.99), b.tps()),
			fmt.Sprintf("p99 TTFT %+.1f ms, throughput %+.1f%%", added, -loss)})
	}
	fmt.Printf("\n%-12s %-40s %-40s %s\n", "load", "straight to the worker", "through the gateway", "gateway's cost")
	for _, r := range rows {
		fmt.Printf("%-12s %-40s %-40s %s\n", r.name, r.direct, r.gw, r.diff)
	}
	fmt.Printf("(goal at 500 streams: <= 2 ms added p99 TTFT, <= 5%% throughput loss)\n")
	if *jsonPath != "" {
		b, _ := json.MarshalIndent(out, "", "  ")
		return os.WriteFile(*jsonPath, append(b, '\n'), 0o644)
	}
	return nil
}
