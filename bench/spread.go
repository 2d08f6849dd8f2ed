package bench

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/lumen-project/lumen/internal/completions"
	"github.com/lumen-project/lumen/internal/devcluster"
)

// SpreadConfig is `lumen bench spread`: the real-process counterpart of the
// simulator's gateways figure (`lumen sim -figure gateways`, whose
// running_cv it measures the same way). Each gateway count runs on a fresh
// cluster: 3 controllers, Workers synthetic workers, the gateways; Poisson
// arrivals at Rate, arrival i sent to gateway i mod G.
type SpreadConfig struct {
	// Gateways lists the gateway counts to run, one cluster each.
	Gateways []int
	// Workers is the number of synthetic workers.
	Workers int
	// Rate is the arrival rate over all gateways, requests per second.
	Rate float64
	// Warmup is the time before the samples start; Duration the time
	// they are taken over (arrivals stop at its end).
	Warmup, Duration time.Duration
	// Profile is the workers' timing profile (time scale 1).
	Profile string
	// PromptLen is each request's prompt; its output is uniform in
	// 1..MaxTokens.
	PromptLen, MaxTokens int
	// Seed draws the arrivals and the lengths (the same for every count).
	Seed uint64
	// Bin is the lumen binary the processes run (empty: this one), so
	// one benchmark measures another commit's cluster.
	Bin string
	// JSONPath, when set, receives the figures as JSON.
	JSONPath string
}

// DefaultSpreadConfig is `lumen bench spread` without flags.
func DefaultSpreadConfig() SpreadConfig {
	return SpreadConfig{Gateways: []int{1, 2, 4}, Workers: 8, Rate: 80, Warmup: 5 * time.Second, Duration: 30 * time.Second,
		Profile: "qwen3-14b-h100", PromptLen: 64, MaxTokens: 128, Seed: 1}
}

// spreadSampleEvery is the sampling period of the running counts (the
// simulator's).
const spreadSampleEvery = 250 * time.Millisecond

// spreadStats is the mean over samples of the coefficient of variation
// (population standard deviation / mean) of the running requests across
// workers, and of max − min; samples with no request running are skipped.
func spreadStats(samples [][]float64) (cv, maxMin, mean float64, n int) {
	for _, s := range samples {
		if len(s) == 0 {
			continue
		}
		var sum, lo, hi = 0.0, math.Inf(1), math.Inf(-1)
		for _, v := range s {
			sum += v
			lo, hi = min(lo, v), max(hi, v)
		}
		m := sum / float64(len(s))
		if m == 0 {
			continue
		}
		var ss float64
		for _, v := range s {
			ss += (v - m) * (v - m)
		}
		cv += math.Sqrt(ss/float64(len(s))) / m
		maxMin += hi - lo
		mean += m
		n++
	}
	if n == 0 {
		return 0, 0, 0, 0
	}
	return cv / float64(n), maxMin / float64(n), mean / float64(n), n
}

// scrapeGauge reads the first sample of a gauge from a Prometheus text
// endpoint; ok is false when the endpoint or the gauge is missing.
func scrapeGauge(httpc *http.Client, addr, name string) (float64, bool) {
	resp, err := httpc.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name) || len(line) > len(name) && line[len(name)] != ' ' && line[len(name)] != '{' {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		return v, err == nil
	}
	return 0, false
}

// spreadRow is one gateway count's figures.
type spreadRow struct {
	gateways            int
	cv, maxMin, running float64
	samples             int
	sent, failed        int64
	shares              string
	ttftP50, ttftP99    float64
}

// Spread measures the spread of running requests across workers with each
// gateway count of cfg.Gateways.
func Spread(cfg SpreadConfig) error {
	var rows []spreadRow
	out := map[string]float64{}
	for _, g := range cfg.Gateways {
		r, err := spreadRun(cfg, g)
		if err != nil {
			return fmt.Errorf("%d gateways: %w", g, err)
		}
		rows = append(rows, r)
		k := fmt.Sprintf("gateways_%d_", g)
		out[k+"running_cv"], out[k+"max_min"], out[k+"running_per_worker"] = r.cv, r.maxMin, r.running
		out[k+"ttft_p50_ms"], out[k+"ttft_p99_ms"], out[k+"failed"] = r.ttftP50, r.ttftP99, float64(r.failed)
	}
	fmt.Printf("\n%d synthetic workers (%s), %.0f requests/s Poisson, prompt %d, output 1..%d tokens, %s after %s warm-up, seed %d\n",
		cfg.Workers, cfg.Profile, cfg.Rate, cfg.PromptLen, cfg.MaxTokens, cfg.Duration, cfg.Warmup, cfg.Seed)
	fmt.Println("| gateways | running_cv | max-min | running / worker | samples | requests (failed) | TTFT p50 / p99 ms | shares (g/G each gateway) |")
	fmt.Println("| --- | --- | --- | --- | --- | --- | --- | --- |")
	for _, r := range rows {
		fmt.Printf("| %d | %.4f | %.2f | %.2f | %d | %d (%d) | %.1f / %.1f | %s |\n", r.gateways, r.cv, r.maxMin, r.running, r.samples,
			r.sent, r.failed, r.ttftP50, r.ttftP99, r.shares)
	}
	if cfg.JSONPath != "" {
		return writeJSON(cfg.JSONPath, out)
	}
	return nil
}

func spreadRun(cfg SpreadConfig, gateways int) (spreadRow, error) {
	row := spreadRow{gateways: gateways}
	dir, err := os.MkdirTemp("", "lumen-bench-spread-")
	if err != nil {
		return row, err
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cl, err := devcluster.Start(ctx, devcluster.Options{Dir: dir, Controllers: 3, Bin: cfg.Bin, Args: []string{"-log-level", "warn"}})
	if err != nil {
		return row, err
	}
	defer cl.Stop()
	for i := range cfg.Workers {
		if _, err := cl.AddWorkerContext(ctx, fmt.Sprintf("worker-%d", i+1), "-engine", "synthetic", "-profile", cfg.Profile,
			"-time-scale", "1", "-max-running", "256", "-emulate-load=false"); err != nil {
			return row, err
		}
	}
	var gws []*devcluster.Gateway
	for range gateways {
		gw, err := cl.StartGatewayContext(ctx, "", "-max-concurrent", "4096")
		if err != nil {
			return row, err
		}
		gws = append(gws, gw)
	}
	for _, gw := range gws {
		if err := gw.WaitReady(ctx); err != nil {
			return row, err
		}
	}
	httpc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024}}
	// Wait for every gateway's table to list every worker (the first
	// placements otherwise go through the controller).
	prompt := gatewayPrompt(cfg.PromptLen)
	for _, gw := range gws {
		for i := 0; i < 3; i++ {
			if _, err := completions.Stream(ctx, httpc, gw.Addr, completions.Body(prompt, 4, true), func(completions.Chunk) {}); err != nil {
				return row, fmt.Errorf("warm-up through %s: %w", gw.Name, err)
			}
		}
	}
	fmt.Printf("%d gateways: %d workers, %.0f requests/s for %s (%s warm-up) ...\n", gateways, cfg.Workers, cfg.Rate, cfg.Warmup+cfg.Duration, cfg.Warmup)

	rng := rand.New(rand.NewPCG(cfg.Seed, 21))
	var sent, failed atomic.Int64
	var mu sync.Mutex
	var ttfts []time.Duration
	var wg sync.WaitGroup
	start := time.Now()
	end := start.Add(cfg.Warmup + cfg.Duration)
	stopSampling := make(chan struct{})
	var samples [][]float64
	var sampler sync.WaitGroup
	sampler.Go(func() {
		t := time.NewTicker(spreadSampleEvery)
		defer t.Stop()
		for {
			select {
			case <-stopSampling:
				return
			case now := <-t.C:
				if now.Sub(start) < cfg.Warmup {
					continue
				}
				s := make([]float64, 0, len(cl.Workers))
				for _, w := range cl.Workers {
					if v, ok := scrapeGauge(httpc, w.HTTPAddr, "lumen_worker_num_requests_running"); ok {
						s = append(s, v)
					}
				}
				if len(s) == len(cl.Workers) {
					samples = append(samples, s)
				}
			}
		}
	})
	next := start
	for i := 0; ; i++ {
		next = next.Add(time.Duration(rng.ExpFloat64() / cfg.Rate * float64(time.Second)))
		if next.After(end) {
			break
		}
		time.Sleep(time.Until(next))
		gw := gws[i%len(gws)]
		body := completions.Body(prompt, 1+rng.IntN(cfg.MaxTokens), true)
		measured := next.Sub(start) >= cfg.Warmup
		sent.Add(1)
		wg.Go(func() {
			rctx, rcancel := context.WithTimeout(context.Background(), time.Minute)
			defer rcancel()
			t0 := time.Now()
			var ttft time.Duration
			_, err := completions.Stream(rctx, httpc, gw.Addr, body, func(completions.Chunk) {
				if ttft == 0 {
					ttft = time.Since(t0)
				}
			})
			if err != nil {
				failed.Add(1)
				return
			}
			if measured {
				mu.Lock()
				ttfts = append(ttfts, ttft)
				mu.Unlock()
			}
		})
	}
	close(stopSampling)
	sampler.Wait()
	wg.Wait()
	var shares []string
	for _, gw := range gws {
		g, okg := scrapeGauge(httpc, gw.Addr, "lumen_gateway_share_index")
		G, okG := scrapeGauge(httpc, gw.Addr, "lumen_gateway_share_gateways")
		if !okg || !okG {
			shares = append(shares, "-")
			continue
		}
		shares = append(shares, fmt.Sprintf("%.0f/%.0f", g, G))
	}
	row.cv, row.maxMin, row.running, row.samples = spreadStats(samples)
	row.sent, row.failed, row.shares = sent.Load(), failed.Load(), strings.Join(shares, " ")
	row.ttftP50, row.ttftP99 = percentileMs(ttfts, 0.5), percentileMs(ttfts, 0.99)
	return row, nil
}
