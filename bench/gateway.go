package bench

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
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
	// Streams are the concurrent stream counts, one load each (default 1,
	// 100, 500; issue 26 asks for 5,000 too).
	Streams []int
}

// DefaultGatewayConfig is `lumen bench gateway` without flags.
func DefaultGatewayConfig() GatewayConfig {
	return GatewayConfig{Profile: "qwen3-14b-h100", PromptLen: 64, MaxTokens: 64, Streams: []int{1, 100, 500}}
}

type streamResult struct {
	ttft   []time.Duration
	tokens int64
	errors int64
	wall   time.Duration
	// classes counts the errors by their text (ids and addresses cut, so
	// one cause is one line).
	classes map[string]int64
}

func (r *streamResult) pct(p float64) float64 { return percentileMs(r.ttft, p) }

// add pools another slice's figures into r.
func (r *streamResult) add(o *streamResult) {
	r.ttft = append(r.ttft, o.ttft...)
	r.tokens += o.tokens
	r.errors += o.errors
	r.wall += o.wall
	for k, v := range o.classes {
		if r.classes == nil {
			r.classes = map[string]int64{}
		}
		r.classes[k] += v
	}
}

func (r *streamResult) tps() float64 { return float64(r.tokens) / r.wall.Seconds() }

// requestTimeout bounds one request of a load: at 5,000 streams a request
// waits tens of seconds for a place in the batch (TTFT p99 37 s), and the
// last of a phase ends near a minute.
const requestTimeout = 3 * time.Minute

// load runs `streams` clients, each sending requests back to back for d.
func load(streams int, d time.Duration, one func(ctx context.Context, c, i int) (time.Duration, int, error)) *streamResult {
	var mu sync.Mutex
	res := &streamResult{classes: map[string]int64{}}
	var tokens, errs atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for c := 0; c < streams; c++ {
		wg.Go(func() {
			var local []time.Duration
			for i := 0; time.Since(start) < d; i++ {
				ctx, cancel := context.WithTimeout(context.Background(), requestTimeout)
				ttft, n, err := one(ctx, c, i)
				cancel()
				if err != nil {
					errs.Add(1)
					mu.Lock()
					res.classes[errorClass(err)]++
					mu.Unlock()
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
	most := slices.Max(cfg.Streams)
	// Every client starts its stream at once, so the worker's waiting
	// queue must hold all the streams not yet running: at its default
	// (4,096) a 5,000-stream load had hundreds refused at every phase's
	// start (ResourceExhausted, 429 through the gateway), and each refused
	// client tried again at once until a place freed, thousands of errors.
	w, err := cl.AddWorker("bench-worker", "-engine", "synthetic", "-profile", cfg.Profile, "-time-scale", "1",
		"-max-running", strconv.Itoa(max(1024, most)), "-max-waiting", strconv.Itoa(max(4096, most)),
		"-token-budget", "8192", "-emulate-load=false")
	if err != nil {
		return err
	}
	gwArgs := []string{"-max-concurrent", strconv.Itoa(max(4096, 2*most)), "-max-context", "32768"}
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
	httpc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: max(1024, most), MaxConnsPerHost: 0}}
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
	meter := progress.New("bench gateway", "loads", float64(len(cfg.Streams)))
	defer meter.Finish("")
	var owns []ownRow
	for i, n := range cfg.Streams {
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
			// Over both gateway halves (each runs past its half while its
			// last requests end), whole seconds.
			profiled.Go(func() { saveProfile(gw.Addr, max(2*half-time.Second, time.Second), cfg.CPUProfile) })
		}
		// The gateway's own histograms and CPU, over its two half phases.
		before, err := scrapeOwn(httpc, gw.Addr)
		if err != nil {
			return fmt.Errorf("reading the gateway's metrics: %w", err)
		}
		b.add(load(n, half, viaGateway))
		b.add(load(n, half, viaGateway))
		profiled.Wait()
		after, err := scrapeOwn(httpc, gw.Addr)
		if err != nil {
			return fmt.Errorf("reading the gateway's metrics: %w", err)
		}
		a.add(load(n, half, direct))
		owns = append(owns, ownFigures(out, n, after.minus(before)))
		if a.errors > 0 || b.errors > 0 {
			fmt.Printf("  errors: direct %d, gateway %d\n", a.errors, b.errors)
			printClasses(os.Stdout, "direct", a.classes)
			printClasses(os.Stdout, "gateway", b.classes)
		}
		rows = append(rows, gatewayFigures(out, n, a, b))
	}
	printGatewayTable(os.Stdout, rows)
	printOwnTable(os.Stdout, owns)
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

// ownSample is the gateway's own-time histograms (lumen_gateway_own_seconds,
// cumulative buckets by phase), its CPU seconds and its requests served, at
// one scrape; minus gives a phase's share.
type ownSample struct {
	buckets  map[string][]ownBucket // phase → cumulative buckets
	cpu      float64
	requests float64
}

type ownBucket struct{ le, n float64 }

// scrapeOwn reads the gateway's own-time histograms, process CPU and
// request count from its /metrics.
func scrapeOwn(httpc *http.Client, addr string) (*ownSample, error) {
	resp, err := httpc.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, err
	}
	s := &ownSample{buckets: map[string][]ownBucket{}}
	mf, ok := mfs["lumen_gateway_own_seconds"]
	if !ok {
		return nil, fmt.Errorf("the gateway exports no lumen_gateway_own_seconds")
	}
	for _, m := range mf.GetMetric() {
		phase := ""
		for _, l := range m.GetLabel() {
			if l.GetName() == "phase" {
				phase = l.GetValue()
			}
		}
		var bs []ownBucket
		for _, b := range m.GetHistogram().GetBucket() {
			bs = append(bs, ownBucket{b.GetUpperBound(), float64(b.GetCumulativeCount())})
		}
		bs = append(bs, ownBucket{math.Inf(1), float64(m.GetHistogram().GetSampleCount())})
		s.buckets[phase] = bs
	}
	if mf, ok := mfs["go_sched_latencies_seconds"]; ok && len(mf.GetMetric()) > 0 {
		// The Go runtime's: how long goroutines waited runnable for a CPU.
		m := mf.GetMetric()[0]
		var bs []ownBucket
		for _, b := range m.GetHistogram().GetBucket() {
			bs = append(bs, ownBucket{b.GetUpperBound(), float64(b.GetCumulativeCount())})
		}
		bs = append(bs, ownBucket{math.Inf(1), float64(m.GetHistogram().GetSampleCount())})
		s.buckets[schedPhase] = bs
	}
	if mf, ok := mfs["process_cpu_seconds_total"]; ok && len(mf.GetMetric()) > 0 {
		s.cpu = mf.GetMetric()[0].GetCounter().GetValue()
	}
	if mf, ok := mfs["lumen_gateway_requests_total"]; ok {
		for _, m := range mf.GetMetric() {
			s.requests += m.GetCounter().GetValue()
		}
	}
	return s, nil
}

// schedPhase holds go_sched_latencies_seconds among an ownSample's
// histograms.
const schedPhase = "go_sched_latency"

// minus is what happened between o and s.
func (s *ownSample) minus(o *ownSample) *ownSample {
	d := &ownSample{buckets: map[string][]ownBucket{}, cpu: s.cpu - o.cpu, requests: s.requests - o.requests}
	for phase, bs := range s.buckets {
		prev := o.buckets[phase]
		out := make([]ownBucket, len(bs))
		for i, b := range bs {
			out[i] = b
			if i < len(prev) {
				out[i].n -= prev[i].n
			}
		}
		d.buckets[phase] = out
	}
	return d
}

// quantileMs is phase's q-quantile in milliseconds, interpolated within its
// bucket as Prometheus's histogram_quantile does (NaN without
// observations; the last finite bound when it falls in the +Inf bucket).
func (s *ownSample) quantileMs(phase string, q float64) float64 {
	bs := s.buckets[phase]
	if len(bs) == 0 || bs[len(bs)-1].n == 0 {
		return math.NaN()
	}
	rank := q * bs[len(bs)-1].n
	lo, prevN := 0.0, 0.0
	for _, b := range bs {
		if b.n >= rank {
			if math.IsInf(b.le, 1) {
				return lo * 1e3
			}
			if b.n == prevN {
				return b.le * 1e3
			}
			return (lo + (b.le-lo)*(rank-prevN)/(b.n-prevN)) * 1e3
		}
		lo, prevN = b.le, b.n
	}
	return lo * 1e3
}

// ownRow is one load's line of the gateway's own-time table.
type ownRow struct {
	streams                              int
	acceptP50, acceptP99, tokP50, tokP99 float64
	cpuMsPerRequest                      float64
	// schedP99 is the p99 of the gateway's goroutines' wait, runnable,
	// for a CPU (the Go runtime's go_sched_latencies_seconds).
	schedP99 float64
}

// ownFigures puts the gateway's own time of n streams under their JSON
// keys in out.
func ownFigures(out map[string]float64, n int, d *ownSample) ownRow {
	r := ownRow{streams: n,
		acceptP50: d.quantileMs("accept_to_generate", 0.5), acceptP99: d.quantileMs("accept_to_generate", 0.99),
		tokP50: d.quantileMs("token_to_write", 0.5), tokP99: d.quantileMs("token_to_write", 0.99),
		schedP99: d.quantileMs(schedPhase, 0.99)}
	if d.requests > 0 {
		r.cpuMsPerRequest = 1e3 * d.cpu / d.requests
	}
	for k, v := range map[string]float64{"own_accept_to_generate_p50_ms": r.acceptP50, "own_accept_to_generate_p99_ms": r.acceptP99,
		"own_token_to_write_p50_ms": r.tokP50, "own_token_to_write_p99_ms": r.tokP99, "own_cpu_ms_per_request": r.cpuMsPerRequest,
		"gateway_sched_latency_p99_ms": r.schedP99} {
		if !math.IsNaN(v) { // a phase with no observations has no key
			out[fmt.Sprintf("%s_%d", k, n)] = v
		}
	}
	return r
}

// printOwnTable prints the gateway's own time by load.
func printOwnTable(w io.Writer, rows []ownRow) {
	fmt.Fprintf(w, "\nthe gateway's own time (lumen_gateway_own_seconds, over its half phases):\n")
	fmt.Fprintf(w, "%-12s %-36s %-36s %-16s %s\n", "load", "accept -> Generate p50 / p99", "token received -> written p50 / p99", "CPU per request", "runnable wait p99")
	for _, r := range rows {
		fmt.Fprintf(w, "%-12s %-36s %-36s %-16s %.3f ms\n", fmt.Sprintf("%d streams", r.streams),
			fmt.Sprintf("%.3f / %.3f ms", r.acceptP50, r.acceptP99), fmt.Sprintf("%.3f / %.3f ms", r.tokP50, r.tokP99),
			fmt.Sprintf("%.2f ms", r.cpuMsPerRequest), r.schedP99)
	}
	fmt.Fprintf(w, "(runnable wait: go_sched_latencies_seconds, the gateway's goroutines' wait for a CPU)\n")
	fmt.Fprintf(w, "(goal, issue 26: p99 <= 1 ms of the gateway's own time)\n")
}

// errorClass is err's text with the digits cut (request ids, ports,
// durations), so errors of one cause count as one class.
func errorClass(err error) string {
	s := err.Error()
	var b []byte
	digits := false
	for i := 0; i < len(s) && len(b) < 200; i++ {
		if s[i] >= '0' && s[i] <= '9' {
			if !digits {
				b = append(b, '#')
			}
			digits = true
			continue
		}
		digits = false
		b = append(b, s[i])
	}
	return string(b)
}

// printClasses prints a path's error classes, most frequent first.
func printClasses(w io.Writer, path string, classes map[string]int64) {
	keys := make([]string, 0, len(classes))
	for k := range classes {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(x, y string) int { return int(classes[y] - classes[x]) })
	for _, k := range keys {
		fmt.Fprintf(w, "    %s %6d  %s\n", path, classes[k], k)
	}
}
