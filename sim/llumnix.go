package sim

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/lumen-project/lumen/internal/servingstats"
	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// Issue 23's figure: Llumnix's evaluation (OSDI'24, §6.2) reproduced. 16
// instances of LLaMA-7B on 24 GB A10s, its five generated Zipf traces at
// its request rates, 10,000 requests a run, vLLM's batch cap and
// preemption by recompute; Llumnix's migration (lumen, migration on)
// against INFaaS++ (the same freeness dispatch, no migration) and
// round-robin dispatch, every column on the same arrivals.

// LlumnixFigureName is the figure's -figure name.
const LlumnixFigureName = "llumnix"

// LlamaA10 is Llumnix's instance, LLaMA-7B on one A10: the worker's
// engine profile llama-7b-a10 (engine.LlamaA10, derived there), so that
// real paced workers (lumen worker -profile llama-7b-a10, lumen bench
// migration) run what the figure simulates.
var LlamaA10 = engine.LlamaA10

// LlumnixInterconnectBytesPerSec is Llumnix's KV copy between two LLaMA-7B
// instances over NCCL (engine.LlumnixInterconnectBytesPerSec).
const LlumnixInterconnectBytesPerSec = engine.LlumnixInterconnectBytesPerSec

// LlumnixRates are Llumnix's request rates per trace on 16 instances
// (req/s; docs/calibration.md, "Llumnix's setup", from Llumnix's OSDI'24
// evaluation, arXiv 2406.03243): each trace's range, its
// ends and middle (256-256's middle is the headline 7.8 req/s).
var LlumnixRates = map[string][]float64{
	"128-128": {32, 35, 38},
	"256-256": {7.4, 7.8, 8.0},
	"512-512": {2.6, 2.9, 3.2},
	"128-512": {4.1, 4.25, 4.4},
	"512-128": {10, 16, 22},
}

// The figure's columns, in the order they run.
const (
	ColRoundRobin = "round-robin"
	ColINFaaS     = "infaas++"
	ColLumen      = "lumen"
	// ColLumenPriority is lumen with the requests' priorities: in their
	// calls (the workers' queue order and victims), the headroom of the
	// high-priority ones in freeness, and first to migrate.
	ColLumenPriority = "lumen+priority"
)

// LlumnixColumns are the columns: round-robin dispatch, INFaaS++ (the
// freeness dispatch without migration) and lumen (the same with
// Llumnix's migration).
var LlumnixColumns = []string{ColRoundRobin, ColINFaaS, ColLumen}

// LlumnixPriorityColumns are the columns with -priority-fraction
// (Llumnix's priority experiment): INFaaS++ and lumen without priorities,
// and lumen with them, on the same marked arrivals.
var LlumnixPriorityColumns = []string{ColINFaaS, ColLumen, ColLumenPriority}

// LlumnixPriorityRates are the rates of Llumnix's priority experiment
// (docs/calibration.md, "Llumnix's setup": 128-128 at 26 req/s on 16
// instances, Gamma CV 2-8, 10% high priority; arXiv 2406.03243).
var LlumnixPriorityRates = map[string][]float64{"128-128": {26}}

// LlumnixPriorityFraction is the share of high-priority requests in
// Llumnix's priority experiment.
const LlumnixPriorityFraction = 0.1

// LlumnixPriorityTokenBudget is the step token budget of Llumnix's
// priority experiment: its artifact's max_batch_total_tokens there is
// 12,000, where its serving experiments take 12,800 (Llumnix's OSDI'24
// artifact, 64_support_for_priorities/config/serving_exp;
// docs/calibration.md).
const LlumnixPriorityTokenBudget = 12000

// LlumnixOptions are the figure's parameters.
type LlumnixOptions struct {
	// Traces are names of workload.LlumnixTraces; Rates each trace's
	// rates (nil: LlumnixRates).
	Traces []string
	Rates  map[string][]float64
	// Loads, when set, replaces the rates: each trace at these fractions
	// of the cluster's saturated rate, measured by CalibrateLlumnix.
	Loads []float64
	// Calibration is the calibration run's span (0: 600 s).
	Calibration time.Duration
	// CV is the arrivals' coefficient of variation: 0 Poisson, else Gamma.
	CV       float64
	Requests int
	Workers  int
	// MaxRunning and TokenBudget are vLLM's --max-num-seqs and Llumnix's
	// max-num-batched-tokens.
	MaxRunning, TokenBudget int
	Seed                    uint64
	Timing                  Timing
	// Filter is how the lumen column's leader uses the migration plan.
	Filter MigrationFilter
	// PriorityFraction, when > 0, is Llumnix's priority experiment: that
	// share of the requests is of high priority (workload.
	// MarkHighPriority, from Seed), the columns are
	// LlumnixPriorityColumns, the rates LlumnixPriorityRates unless Rates
	// says, and the figures are given per class too.
	PriorityFraction float64
	// Log receives the table; Progress the progress meter (nil: none).
	Log, Progress io.Writer
}

// DefaultLlumnixOptions: every trace at Llumnix's rates, Poisson, 10,000
// requests, 16 workers, batches of 256, 12,800 tokens a step, preemption
// by recompute, the context-dependent decode step, Llumnix's interconnect.
func DefaultLlumnixOptions() LlumnixOptions {
	t := DefaultTiming()
	t.Preemption = core.PreemptVLLM
	t.DecodeContext = true
	t.InterconnectBytesPerSec = LlumnixInterconnectBytesPerSec
	return LlumnixOptions{Traces: slices.Clone(workload.LlumnixTraces), Requests: 10000, Workers: 16, MaxRunning: 256, TokenBudget: 12800,
		Seed: 1, Timing: t}
}

// LlumnixFigures are one column's figures at one trace and rate.
type LlumnixFigures struct {
	// Prefill latency is the TTFT; decode latency a request's mean time
	// per output token after the first; end-to-end from the arrival to the
	// last token. Over every request of the run.
	PrefillMeanMs float64 `json:"prefill_mean_ms"`
	PrefillP99Ms  float64 `json:"prefill_p99_ms"`
	DecodeMeanMs  float64 `json:"decode_mean_ms"`
	DecodeP99Ms   float64 `json:"decode_p99_ms"`
	E2EMeanMs     float64 `json:"e2e_mean_ms"`
	E2EP99Ms      float64 `json:"e2e_p99_ms"`
	// PreemptionLossMs is the mean over the preempted requests of the
	// time from each preemption until the request's cache again held what
	// it held (its wait for the re-prefill plus the recompute);
	// PreemptionLossPerRequestMs the same loss summed and divided by every
	// request (Llumnix's average over the run).
	PreemptionLossMs           float64 `json:"preemption_loss_ms"`
	PreemptionLossPerRequestMs float64 `json:"preemption_loss_per_request_ms"`
	PreemptedRequests          int     `json:"preempted_requests"`
	Preemptions                int     `json:"preemptions"`
	// FragmentationPct: free KV pages on workers whose queue head waits
	// for more pages than they have free, as a share of the cluster's
	// pages, averaged over the run's samples (every 250 ms).
	FragmentationPct float64 `json:"fragmentation_pct"`
	// ThroughputTokS is the output tokens delivered per second while
	// requests arrive (from 0 to the last arrival's whole second);
	// MakespanS when the last request ended, OutputTokens all of them.
	ThroughputTokS      float64 `json:"throughput_tokens_s"`
	MakespanS           float64 `json:"makespan_s"`
	OutputTokens        int     `json:"output_tokens"`
	MigrationsStarted   int     `json:"migrations_started,omitempty"`
	MigrationsCommitted int     `json:"migrations_committed,omitempty"`
	MigrationsQueued    int     `json:"migrations_queued,omitempty"`
	// MigrationsRedispatched: the plan's re-dispatches of queued
	// requests (policy.Migration.Redispatch) that started.
	MigrationsRedispatched int            `json:"migrations_redispatched,omitempty"`
	AbortCauses            map[string]int `json:"abort_causes,omitempty"`
	DowntimeP50Ms          float64        `json:"downtime_p50_ms,omitempty"`
	// Why queue heads stay blocked (BlockedStats), as percentages:
	// BlockedPct of the worker-samples had a head waiting for pages (it
	// lacked BlockedDeficitPages on average); of those, RoomElsewherePct
	// had another worker with room for it; of those, SourceBusyPct had a
	// migration out under way already, DestinationsBusyPct found every
	// worker with room taking one in, and UnplannedPct neither (between
	// two rounds, or the policy planned no move from the worker).
	BlockedPct          float64 `json:"blocked_head_pct"`
	BlockedDeficitPages float64 `json:"blocked_deficit_pages"`
	RoomElsewherePct    float64 `json:"blocked_room_elsewhere_pct"`
	SourceBusyPct       float64 `json:"blocked_room_source_busy_pct"`
	DestinationsBusyPct float64 `json:"blocked_room_destinations_busy_pct"`
	UnplannedPct        float64 `json:"blocked_room_unplanned_pct"`
	// PagesPerMigration is the KV pages the committed migrations' stages
	// carried, per migration.
	PagesPerMigration float64 `json:"pages_per_migration,omitempty"`
	// Per class, with a priority fraction (LlumnixOptions.
	// PriorityFraction): the figures above over the high-priority
	// requests and over the normal ones (the rest), whatever the column
	// does with priorities.
	HighRequests        int     `json:"high_requests,omitempty"`
	HighPrefillMeanMs   float64 `json:"high_prefill_mean_ms,omitempty"`
	HighPrefillP99Ms    float64 `json:"high_prefill_p99_ms,omitempty"`
	HighDecodeMeanMs    float64 `json:"high_decode_mean_ms,omitempty"`
	HighDecodeP99Ms     float64 `json:"high_decode_p99_ms,omitempty"`
	HighE2EMeanMs       float64 `json:"high_e2e_mean_ms,omitempty"`
	HighE2EP99Ms        float64 `json:"high_e2e_p99_ms,omitempty"`
	NormalPrefillMeanMs float64 `json:"normal_prefill_mean_ms,omitempty"`
	NormalPrefillP99Ms  float64 `json:"normal_prefill_p99_ms,omitempty"`
	NormalDecodeMeanMs  float64 `json:"normal_decode_mean_ms,omitempty"`
	NormalDecodeP99Ms   float64 `json:"normal_decode_p99_ms,omitempty"`
	NormalE2EMeanMs     float64 `json:"normal_e2e_mean_ms,omitempty"`
	NormalE2EP99Ms      float64 `json:"normal_e2e_p99_ms,omitempty"`
	// HighPrefillFloorP99Ms, with a priority fraction: the P99 over the
	// high-priority requests of the step that prefills each one's prompt
	// alone (Profile.Step of its prompt and no decode): no schedule gives
	// the class a lower P99 prefill (every request's TTFT is at least its
	// own, so every order statistic is too). The same in every column.
	HighPrefillFloorP99Ms float64 `json:"high_prefill_p99_floor_ms,omitempty"`
	WallS                 float64 `json:"wall_s"`
}

// LlumnixPoint is one trace at one rate: every column on the same arrivals.
type LlumnixPoint struct {
	Trace string  `json:"trace"`
	Rate  float64 `json:"rate_per_s"`
	// Load and SaturatedPerSec, with Loads: the rate as a fraction of
	// the trace's measured saturated rate.
	Load            float64                    `json:"load,omitempty"`
	SaturatedPerSec float64                    `json:"saturated_rate_per_s,omitempty"`
	Requests        int                        `json:"requests"`
	Columns         map[string]*LlumnixFigures `json:"columns"`
	// Gains are INFaaS++'s figure over lumen's (× lower with migration),
	// ThroughputPct lumen's throughput against INFaaS++'s.
	Gains map[string]float64 `json:"gains_vs_infaas"`
	// PriorityGains, with a priority fraction: lumen+priority against
	// INFaaS++ and against lumen without priorities (llumnixPriorityGains).
	PriorityGains map[string]float64 `json:"priority_gains,omitempty"`
}

// LlumnixFigure is the figure's result.
type LlumnixFigure struct {
	Name        string `json:"name"`
	Profile     string `json:"profile"`
	Workers     int    `json:"workers"`
	KVPages     int    `json:"kv_pages"`
	MaxRunning  int    `json:"max_running"`
	TokenBudget int    `json:"token_budget"`
	Preemption  string `json:"preemption"`
	Arrivals    string `json:"arrivals"`
	Filter      string `json:"migration_filter"`
	Rates       string `json:"rates"`
	Seed        uint64 `json:"seed"`
	// PriorityFraction: LlumnixOptions.PriorityFraction (0: none).
	PriorityFraction float64        `json:"priority_fraction,omitempty"`
	Points           []LlumnixPoint `json:"points"`
}

// ParseArrivals reads -arrivals: poisson, or gamma:CV with CV in (0, 20].
func ParseArrivals(s string) (float64, error) {
	if s == "poisson" {
		return 0, nil
	}
	if v, ok := strings.CutPrefix(s, "gamma:"); ok {
		cv, err := strconv.ParseFloat(v, 64)
		if err == nil && cv > 0 && cv <= 20 {
			return cv, nil
		}
	}
	return 0, fmt.Errorf("%w: -arrivals %q: poisson or gamma:CV, the CV in (0, 20] (Llumnix's: 2, 4, 6, 8)", ErrInvalid, s)
}

// ArrivalsName is ParseArrivals' inverse.
func ArrivalsName(cv float64) string {
	if cv == 0 {
		return "poisson"
	}
	return "gamma:" + strconv.FormatFloat(cv, 'g', -1, 64)
}

// RunLlumnix runs the figure: for each trace and rate, the arrivals once,
// then every column on them.
func RunLlumnix(o LlumnixOptions) (*LlumnixFigure, error) {
	if o.Requests < 1 || o.Workers < 2 || o.MaxRunning < 1 || o.TokenBudget < 1 || len(o.Traces) == 0 {
		return nil, fmt.Errorf("%w: the llumnix figure needs traces (%v), requests >= 1 (%d), workers >= 2 (%d), a batch cap (%d) and a token budget (%d)",
			ErrInvalid, o.Traces, o.Requests, o.Workers, o.MaxRunning, o.TokenBudget)
	}
	if o.PriorityFraction < 0 || o.PriorityFraction >= 1 {
		return nil, fmt.Errorf("%w: a priority fraction of %g: must be in [0, 1) (Llumnix's: %g)", ErrInvalid, o.PriorityFraction, LlumnixPriorityFraction)
	}
	rates := o.Rates
	if rates == nil {
		rates = LlumnixRates
		if o.PriorityFraction > 0 {
			rates = LlumnixPriorityRates
		}
	}
	columns := o.columns()
	runs := 0
	for _, name := range o.Traces {
		if _, err := workload.LlumnixTrace(name); err != nil {
			return nil, fmt.Errorf("%w: -trace-mix: %w", ErrInvalid, err)
		}
		switch {
		case len(o.Loads) > 0:
			runs += len(o.Loads)*len(columns) + 1
		case len(rates[name]) == 0:
			return nil, fmt.Errorf("%w: trace %s has no request rates", ErrInvalid, name)
		default:
			runs += len(rates[name]) * len(columns)
		}
	}
	p := LlamaA10
	f := &LlumnixFigure{Name: LlumnixFigureName, Profile: p.Name, Workers: o.Workers, KVPages: p.KVPages(), MaxRunning: o.MaxRunning,
		TokenBudget: o.TokenBudget, Preemption: o.Timing.Preemption.String(), Arrivals: ArrivalsName(o.CV), Filter: o.Filter.String(), Seed: o.Seed,
		Rates: "llumnix"}
	if len(o.Loads) > 0 {
		f.Rates = "saturation"
	}
	f.PriorityFraction = o.PriorityFraction
	meter := newMeter(o.Progress, "sim -figure llumnix", float64(runs))
	defer meter.Finish("")
	for _, name := range o.Traces {
		tr, _ := workload.LlumnixTrace(name)
		points, sat := rates[name], 0.0
		if len(o.Loads) > 0 {
			start := time.Now()
			var err error
			if sat, err = CalibrateLlumnix(o, name); err != nil {
				return nil, err
			}
			meter.Add(1, fmt.Sprintf("%s: saturated at %.2f req/s (%.1fs of wall time)", name, sat, time.Since(start).Seconds()))
			points = nil
			for _, l := range o.Loads {
				points = append(points, math.Round(l*sat*100)/100)
			}
		}
		for k, rate := range points {
			reqs, err := workload.GenerateLazy(workload.Config{Seed: o.Seed, Rate: rate, Requests: o.Requests, CV: o.CV, Trace: tr})
			if err != nil {
				return nil, err
			}
			if o.PriorityFraction > 0 {
				workload.MarkHighPriority(reqs, o.PriorityFraction, o.Seed)
			}
			pt := LlumnixPoint{Trace: name, Rate: rate, Requests: len(reqs), Columns: map[string]*LlumnixFigures{}, SaturatedPerSec: sat}
			if sat > 0 {
				pt.Load = o.Loads[k]
			}
			for _, col := range columns {
				start := time.Now()
				res, err := Run(o.config(col, reqs))
				if err != nil {
					return nil, fmt.Errorf("llumnix %s at %g/s, %s: %w", name, rate, col, err)
				}
				lf := llumnixFigures(res)
				if o.PriorityFraction > 0 {
					classFigures(lf, res, reqs)
				}
				lf.WallS = math.Round(time.Since(start).Seconds()*100) / 100
				pt.Columns[col] = lf
				meter.Add(1, fmt.Sprintf("%s at %g/s, %s: p99 prefill %.0f ms", name, rate, col, lf.PrefillP99Ms))
			}
			pt.Gains = llumnixGains(pt.Columns[ColINFaaS], pt.Columns[ColLumen])
			if o.PriorityFraction > 0 {
				pt.PriorityGains = llumnixPriorityGains(pt.Columns[ColINFaaS], pt.Columns[ColLumen], pt.Columns[ColLumenPriority])
			}
			f.Points = append(f.Points, pt)
		}
	}
	if o.Log != nil {
		f.Print(o.Log)
	}
	return f, nil
}

// columns are the columns the options run.
func (o LlumnixOptions) columns() []string {
	if o.PriorityFraction > 0 {
		return LlumnixPriorityColumns
	}
	return LlumnixColumns
}

// config is one column's run of the figure on reqs.
func (o LlumnixOptions) config(col string, reqs []workload.Request) Config {
	return Config{Workers: o.Workers, Profile: LlamaA10, Strategy: policy.RecomputeHistory, TokenBudget: o.TokenBudget,
		MaxRunning: o.MaxRunning, MaxWaiting: max(o.Requests+1, 4096), Arrivals: reqs, Timing: o.Timing,
		RoundRobin: col == ColRoundRobin, Migration: col == ColLumen || col == ColLumenPriority, MigrationFilter: o.Filter,
		Priorities: col == ColLumenPriority}
}

// CalibrateLlumnix measures the cluster's saturated rate on a trace, as
// the studies' calibration does: INFaaS++ (freeness dispatch, no
// migration) under Poisson arrivals at three times Llumnix's highest rate
// for the trace (or 3 req/s a worker's share, 48 on 16 workers, without
// one) for o.Calibration, the output tokens delivered over its second
// half divided by the trace's mean output length.
func CalibrateLlumnix(o LlumnixOptions, trace string) (float64, error) {
	tr, err := workload.LlumnixTrace(trace)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	d := o.Calibration
	if d <= 0 {
		d = 600 * time.Second
	}
	rate := 3.0 * float64(o.Workers)
	if rs := LlumnixRates[trace]; len(rs) > 0 {
		rate = 3 * slices.Max(rs) * float64(o.Workers) / 16
	}
	reqs, err := workload.GenerateLazy(workload.Config{Seed: o.Seed + 1000, Rate: rate, Duration: d, Trace: tr})
	if err != nil {
		return 0, err
	}
	cal := o
	cal.Requests = len(reqs)
	cfg := cal.config(ColINFaaS, reqs)
	cfg.StopAt = d
	res, err := Run(cfg)
	if err != nil {
		return 0, fmt.Errorf("llumnix calibration of %s: %w", trace, err)
	}
	return float64(res.CalibrationTokens) / (d / 2).Seconds() / tr.MeanOutput(), nil
}

func llumnixFigures(res *Result) *LlumnixFigures {
	f := &LlumnixFigures{Preemptions: res.Preemptions, MakespanS: res.End.Seconds()}
	var prefill, decode, e2e []time.Duration
	tokens := 0
	for _, r := range res.Records {
		if r.Err != nil {
			continue
		}
		tokens += r.Tokens
		if d, ok := r.TTFT(); ok {
			prefill = append(prefill, d)
			e2e = append(e2e, r.Chunks[len(r.Chunks)-1]-r.Arrival)
		}
		if d, ok := r.TPOT(); ok {
			decode = append(decode, d)
		}
	}
	f.PrefillMeanMs, f.PrefillP99Ms = servingstats.Mean(prefill), servingstats.Percentile(prefill, 0.99)
	f.DecodeMeanMs, f.DecodeP99Ms = servingstats.Mean(decode), servingstats.Percentile(decode, 0.99)
	f.E2EMeanMs, f.E2EP99Ms = servingstats.Mean(e2e), servingstats.Percentile(e2e, 0.99)
	var loss time.Duration
	for _, d := range res.PreemptionLosses {
		loss += d
	}
	f.PreemptedRequests = len(res.PreemptionLosses)
	if n := len(res.PreemptionLosses); n > 0 {
		f.PreemptionLossMs = float64(loss) / float64(n) / 1e6
	}
	if len(res.Records) > 0 {
		f.PreemptionLossPerRequestMs = float64(loss) / float64(len(res.Records)) / 1e6
	}
	var frag float64
	n := 0
	for _, s := range res.Fragmentation {
		if s.At <= res.End {
			frag += s.Waiting
			n++
		}
	}
	if n > 0 {
		f.FragmentationPct = 100 * frag / float64(n)
	}
	// Over the arrivals' span, whole seconds: the makespan is decided by
	// the last long request alone.
	last := 0
	for _, r := range res.Records {
		last = max(last, int(r.Arrival/time.Second))
	}
	delivered := 0
	for k := 0; k < last && k < len(res.Delivered); k++ {
		delivered += res.Delivered[k]
	}
	if last > 0 {
		f.ThroughputTokS = float64(delivered) / float64(last)
	}
	f.OutputTokens = tokens
	m := res.Migrations
	f.MigrationsStarted, f.MigrationsCommitted, f.MigrationsQueued, f.AbortCauses = m.Started, m.Committed, m.Queued, m.AbortCauses
	f.MigrationsRedispatched = m.Redispatched
	f.DowntimeP50Ms = servingstats.Percentile(m.Downtimes, 0.5)
	if m.Committed > 0 {
		f.PagesPerMigration = float64(m.Pages) / float64(m.Committed)
	}
	b := res.Blocked
	pct := func(a, of int) float64 {
		if of == 0 {
			return 0
		}
		return 100 * float64(a) / float64(of)
	}
	f.BlockedPct, f.RoomElsewherePct = pct(b.Blocked, b.WorkerSamples), pct(b.RoomElsewhere, b.Blocked)
	f.SourceBusyPct, f.DestinationsBusyPct = pct(b.RoomSourceBusy, b.RoomElsewhere), pct(b.RoomDestinationsBusy, b.RoomElsewhere)
	f.UnplannedPct = pct(b.RoomElsewhere-b.RoomSourceBusy-b.RoomDestinationsBusy, b.RoomElsewhere)
	if b.Blocked > 0 {
		f.BlockedDeficitPages = float64(b.DeficitPages) / float64(b.Blocked)
	}
	return f
}

// classFigures fills f's per-class figures from res, whose Records[i] is
// reqs[i]: the high-priority requests (workload.Request.Priority below 0)
// and the rest.
func classFigures(f *LlumnixFigures, res *Result, reqs []workload.Request) {
	var prefill, decode, e2e [2][]time.Duration // [0] normal, [1] high
	for i, r := range res.Records {
		if i >= len(reqs) || r.Err != nil {
			continue
		}
		k := 0
		if policy.HighPriority(reqs[i].Priority) {
			k = 1
			f.HighRequests++
		}
		if d, ok := r.TTFT(); ok {
			prefill[k] = append(prefill[k], d)
			e2e[k] = append(e2e[k], r.Chunks[len(r.Chunks)-1]-r.Arrival)
		}
		if d, ok := r.TPOT(); ok {
			decode[k] = append(decode[k], d)
		}
	}
	p99 := func(d []time.Duration) float64 { return servingstats.Percentile(d, 0.99) }
	f.NormalPrefillMeanMs, f.NormalPrefillP99Ms = servingstats.Mean(prefill[0]), p99(prefill[0])
	f.NormalDecodeMeanMs, f.NormalDecodeP99Ms = servingstats.Mean(decode[0]), p99(decode[0])
	f.NormalE2EMeanMs, f.NormalE2EP99Ms = servingstats.Mean(e2e[0]), p99(e2e[0])
	f.HighPrefillMeanMs, f.HighPrefillP99Ms = servingstats.Mean(prefill[1]), p99(prefill[1])
	f.HighDecodeMeanMs, f.HighDecodeP99Ms = servingstats.Mean(decode[1]), p99(decode[1])
	f.HighE2EMeanMs, f.HighE2EP99Ms = servingstats.Mean(e2e[1]), p99(e2e[1])
	var floor []time.Duration
	for i := range reqs {
		if policy.HighPriority(reqs[i].Priority) {
			floor = append(floor, LlamaA10.Step(engine.StepShape{Prefill: reqs[i].PromptLen()}))
		}
	}
	f.HighPrefillFloorP99Ms = p99(floor)
}

// llumnixPriorityGains compare lumen+priority (pri) with INFaaS++ (base)
// and with lumen without priorities (nopri): the high-priority requests'
// figures as × lower (high_*_x, against INFaaS++; high_*_x_vs_lumen), the
// normal ones' as lumen+priority's change in percent (normal_*_pct,
// against INFaaS++; normal_*_pct_vs_lumen): the goals are
// high_prefill_p99_x >= 3.6 and normal_*_mean_pct <= 13. Llumnix's own
// baseline in that experiment is Llumnix without priorities (its
// artifact's "Llumnix-base": migration on, priorities off), lumen here:
// the _vs_lumen figures. high_prefill_p99_x_ceiling(_vs_lumen) is the
// most any priority policy could gain: the reference's high-class P99
// over the class's floor (LlumnixFigures.HighPrefillFloorP99Ms).
func llumnixPriorityGains(base, nopri, pri *LlumnixFigures) map[string]float64 {
	ratio := func(a, b float64) float64 {
		if b > 0 {
			return a / b
		}
		return 0 // JSON has no infinity: 0 says "no figure"
	}
	pct := func(a, b float64) float64 {
		if b == 0 {
			return 0
		}
		return 100 * (a - b) / b
	}
	g := map[string]float64{}
	for _, c := range []struct {
		suffix string
		ref    *LlumnixFigures
	}{{"", base}, {"_vs_lumen", nopri}} {
		if c.ref == nil || pri == nil {
			continue
		}
		g["high_prefill_p99_x"+c.suffix] = ratio(c.ref.HighPrefillP99Ms, pri.HighPrefillP99Ms)
		g["high_prefill_mean_x"+c.suffix] = ratio(c.ref.HighPrefillMeanMs, pri.HighPrefillMeanMs)
		g["high_decode_p99_x"+c.suffix] = ratio(c.ref.HighDecodeP99Ms, pri.HighDecodeP99Ms)
		g["high_e2e_mean_x"+c.suffix] = ratio(c.ref.HighE2EMeanMs, pri.HighE2EMeanMs)
		g["normal_prefill_mean_pct"+c.suffix] = pct(pri.NormalPrefillMeanMs, c.ref.NormalPrefillMeanMs)
		g["normal_decode_mean_pct"+c.suffix] = pct(pri.NormalDecodeMeanMs, c.ref.NormalDecodeMeanMs)
		g["normal_e2e_mean_pct"+c.suffix] = pct(pri.NormalE2EMeanMs, c.ref.NormalE2EMeanMs)
		g["high_prefill_p99_x_ceiling"+c.suffix] = ratio(c.ref.HighPrefillP99Ms, c.ref.HighPrefillFloorP99Ms)
	}
	return g
}

// LlumnixPriorityGoals are the goals for the priority experiment
// (Llumnix's: high-priority P99 prefill 3.6-10× lower; normal requests'
// mean latencies at most 13% higher).
const (
	LlumnixPriorityP99Goal    = 3.6
	LlumnixPriorityNormalGoal = 13.0
)

// llumnixGains are INFaaS++'s figures over lumen's (× lower with
// migration; Inf where lumen's is 0 and INFaaS++'s is not), the
// preemption loss as lumen's change in percent, and lumen's throughput
// against INFaaS++'s in percent.
func llumnixGains(base, lumen *LlumnixFigures) map[string]float64 {
	ratio := func(a, b float64) float64 {
		switch {
		case b > 0:
			return a / b
		case a > 0:
			return math.Inf(1)
		}
		return 1
	}
	pct := func(a, b float64) float64 {
		if b == 0 {
			return 0
		}
		return 100 * (a - b) / b
	}
	g := map[string]float64{
		"prefill_p99_x": ratio(base.PrefillP99Ms, lumen.PrefillP99Ms), "prefill_mean_x": ratio(base.PrefillMeanMs, lumen.PrefillMeanMs),
		"decode_p99_x": ratio(base.DecodeP99Ms, lumen.DecodeP99Ms), "e2e_mean_x": ratio(base.E2EMeanMs, lumen.E2EMeanMs),
		"e2e_p99_x":                   ratio(base.E2EP99Ms, lumen.E2EP99Ms),
		"preemption_loss_pct":         pct(lumen.PreemptionLossMs, base.PreemptionLossMs),
		"preemption_loss_per_req_pct": pct(lumen.PreemptionLossPerRequestMs, base.PreemptionLossPerRequestMs),
		"throughput_pct":              pct(lumen.ThroughputTokS, base.ThroughputTokS),
	}
	for k, v := range g {
		if math.IsInf(v, 0) || math.IsNaN(v) {
			g[k] = 0 // JSON has no infinity: 0 says "no figure"
		}
	}
	return g
}

// LlumnixGoals are the goals against INFaaS++ (Llumnix's largest
// reported gains): the key of Gains, the goal, and whether a larger gain
// is better.
var LlumnixGoals = []struct {
	Key, Label string
	Goal       float64
}{
	{"prefill_p99_x", "P99 prefill × lower", 14.8},
	{"prefill_mean_x", "mean prefill × lower", 7.7},
	{"e2e_mean_x", "mean end-to-end × lower", 1.5},
	{"e2e_p99_x", "P99 end-to-end × lower", 1.6},
	{"decode_p99_x", "P99 decode × lower", 2.0},
}

// Print writes the figure's table and the goals' verdicts.
func (f *LlumnixFigure) Print(out io.Writer) {
	fmt.Fprintf(out, "\nfigure llumnix: %d × %s (%d KV pages each), batches of %d, %d tokens a step, preemption %s, %s arrivals, migration plan %s, seed %d\n",
		f.Workers, f.Profile, f.KVPages, f.MaxRunning, f.TokenBudget, f.Preemption, f.Arrivals, f.Filter, f.Seed)
	fmt.Fprintf(out, "%-8s %6s %-12s %11s %11s %10s %10s %10s %9s %8s %8s %10s %11s\n", "trace", "req/s", "column",
		"prefill ms", "p99 prefill", "p99 decode", "e2e ms", "p99 e2e", "preempted", "loss ms", "frag %", "tok/s", "migrations")
	for _, p := range f.Points {
		for _, col := range append(slices.Clone(LlumnixColumns), ColLumenPriority) {
			c := p.Columns[col]
			if c == nil {
				continue
			}
			mig := ""
			if col == ColLumen || col == ColLumenPriority {
				mig = fmt.Sprintf("%d/%d", c.MigrationsCommitted, c.MigrationsStarted)
			}
			fmt.Fprintf(out, "%-8s %6g %-12s %11.0f %11.0f %10.1f %10.0f %10.0f %9d %8.0f %8.2f %10.0f %11s\n", p.Trace, p.Rate, col,
				c.PrefillMeanMs, c.PrefillP99Ms, c.DecodeP99Ms, c.E2EMeanMs, c.E2EP99Ms, c.PreemptedRequests, c.PreemptionLossMs,
				c.FragmentationPct, c.ThroughputTokS, mig)
		}
	}
	fmt.Fprintf(out, "\nlumen against infaas++ (× lower with migration; goals: Llumnix's largest gains)\n")
	fmt.Fprintf(out, "%-8s %6s %9s %9s %9s %9s %9s %11s %11s\n", "trace", "req/s", "p99 pre", "mean pre", "mean e2e", "p99 e2e", "p99 dec", "loss %", "tok/s %")
	for _, p := range f.Points {
		g := p.Gains
		fmt.Fprintf(out, "%-8s %6g %9.2f %9.2f %9.2f %9.2f %9.2f %+11.1f %+11.2f\n", p.Trace, p.Rate, g["prefill_p99_x"], g["prefill_mean_x"],
			g["e2e_mean_x"], g["e2e_p99_x"], g["decode_p99_x"], g["preemption_loss_pct"], g["throughput_pct"])
	}
	verdict := func(ok bool) string {
		if ok {
			return "met"
		}
		return "MISSED"
	}
	for _, goal := range LlumnixGoals {
		best, at := 0.0, ""
		for _, p := range f.Points {
			if v := p.Gains[goal.Key]; v > best {
				best, at = v, fmt.Sprintf("%s at %g/s", p.Trace, p.Rate)
			}
		}
		fmt.Fprintf(out, "%s: up to %.2f (%s); goal up to %g: %s\n", goal.Label, best, at, goal.Goal, verdict(best >= goal.Goal))
	}
	var loss float64
	worst := math.Inf(1)
	n := 0
	for _, p := range f.Points {
		if c := p.Columns[ColINFaaS]; c != nil && c.PreemptedRequests > 0 {
			loss += p.Gains["preemption_loss_per_req_pct"]
			n++
		}
		worst = min(worst, p.Gains["throughput_pct"])
	}
	if n > 0 {
		loss /= float64(n)
	}
	fmt.Fprintf(out, "preemption loss per request: %+.1f%% on average over %d points with preemptions; goal -70%%: %s\n", loss, n, verdict(n > 0 && loss <= -70))
	fmt.Fprintf(out, "throughput: worst %+.2f%% against infaas++; goal within 1%%: %s\n\n", worst, verdict(worst >= -1))
	if f.PriorityFraction > 0 {
		f.printPriorities(out)
	}
}

// LlumnixLoads are -rates saturation's fractions of the measured
// saturated rate.
var LlumnixLoads = []float64{0.85, 0.9, 0.95, 1}

// printPriorities writes the priority experiment's per-class table and
// its goals' verdicts.
func (f *LlumnixFigure) printPriorities(out io.Writer) {
	fmt.Fprintf(out, "priorities: %.0f%% of the requests high priority\n", 100*f.PriorityFraction)
	fmt.Fprintf(out, "%-8s %6s %-15s %6s %12s %12s %12s %12s %12s %12s\n", "trace", "req/s", "column", "high",
		"hi pre ms", "hi p99 pre", "hi e2e ms", "no pre ms", "no dec ms", "no e2e ms")
	for _, p := range f.Points {
		for _, col := range LlumnixPriorityColumns {
			c := p.Columns[col]
			if c == nil {
				continue
			}
			fmt.Fprintf(out, "%-8s %6g %-15s %6d %12.0f %12.0f %12.0f %12.0f %12.1f %12.0f\n", p.Trace, p.Rate, col, c.HighRequests,
				c.HighPrefillMeanMs, c.HighPrefillP99Ms, c.HighE2EMeanMs, c.NormalPrefillMeanMs, c.NormalDecodeMeanMs, c.NormalE2EMeanMs)
		}
	}
	verdict := func(ok bool) string {
		if ok {
			return "met"
		}
		return "MISSED"
	}
	for _, p := range f.Points {
		g := p.PriorityGains
		worst := max(g["normal_prefill_mean_pct"], g["normal_decode_mean_pct"], g["normal_e2e_mean_pct"])
		fmt.Fprintf(out, "%s at %g/s: high-priority P99 prefill %.2f× lower than lumen without priorities (Llumnix's baseline; at most %.2f× "+
			"over the class's floor of %.0f ms), %.2f× than infaas++, goal >= %g: %s; "+
			"normal means %+.1f%% prefill, %+.1f%% decode, %+.1f%% e2e against infaas++ (%+.1f%%, %+.1f%%, %+.1f%% against lumen), goal <= +%g%%: %s\n",
			p.Trace, p.Rate, g["high_prefill_p99_x_vs_lumen"], g["high_prefill_p99_x_ceiling_vs_lumen"], p.Columns[ColLumen].HighPrefillFloorP99Ms,
			g["high_prefill_p99_x"], LlumnixPriorityP99Goal, verdict(g["high_prefill_p99_x_vs_lumen"] >= LlumnixPriorityP99Goal),
			g["normal_prefill_mean_pct"], g["normal_decode_mean_pct"], g["normal_e2e_mean_pct"],
			g["normal_prefill_mean_pct_vs_lumen"], g["normal_decode_mean_pct_vs_lumen"], g["normal_e2e_mean_pct_vs_lumen"],
			LlumnixPriorityNormalGoal, verdict(worst <= LlumnixPriorityNormalGoal))
	}
	fmt.Fprintln(out)
}
