package sim

import (
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"sort"
	"time"

	"github.com/lumen-project/lumen/internal/servingstats"
	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	"github.com/lumen-project/lumen/worker/engine"
)

// The prefix figure (issue 25): prefix-aware placement against freeness
// alone, both with the workers' prefix caches on, on the same arrivals, for
// three workloads: llm-d's shared-prefix benchmark, multi-turn chat, and a
// workload with no reuse. docs/calibration.md has the workloads' sources.

// PrefixFigureName is the figure's -figure name.
const PrefixFigureName = "prefix"

// The figure's columns.
const (
	ColFreeness    = "freeness"
	ColPrefixAware = "prefix-aware"
)

// ColPrefixPlanned is prefix-aware placement whose interrupted requests
// all resume where the recovery plan moved them (Config.PlanResumes): the
// placement before a recomputed resume went by its cached prefix, run
// beside the others when the figure has failures (PrefixOptions.Fail).
const ColPrefixPlanned = "prefix-aware-planned-resumes"

// PrefixColumns are the columns in order.
var PrefixColumns = []string{ColFreeness, ColPrefixAware}

// PrefixFailColumns are the columns of a figure with failures.
var PrefixFailColumns = []string{ColFreeness, ColPrefixAware, ColPrefixPlanned}

// The figure's workloads.
const (
	WorkloadLLMD    = "llm-d"
	WorkloadChat    = "multi-turn"
	WorkloadNoReuse = "no-reuse"
)

// PrefixWorkloads are the workloads in order.
var PrefixWorkloads = []string{WorkloadLLMD, WorkloadChat, WorkloadNoReuse}

// Stage is a span of Poisson arrivals at one rate.
type Stage struct {
	Rate     float64       `json:"rate"`
	Duration time.Duration `json:"duration_ns"`
}

// LLMDStages are llm-d's load ladder: a warm-up at 15 QPS for 50 s (it
// seats the groups' prefixes), then 3 → 60 QPS (llm-d's precise
// prefix-cache benchmark profile, docs/calibration.md).
var LLMDStages = []Stage{{15, 50 * time.Second},
	{3, 20 * time.Second}, {10, 20 * time.Second}, {15, 20 * time.Second}, {20, 38 * time.Second},
	{22, 34 * time.Second}, {25, 30 * time.Second}, {30, 25 * time.Second}, {35, 21 * time.Second},
	{40, 38 * time.Second}, {43, 36 * time.Second}, {46, 33 * time.Second}, {49, 30 * time.Second},
	{52, 29 * time.Second}, {55, 27 * time.Second}, {57, 26 * time.Second}, {60, 25 * time.Second}}

// QuickStages are a short ladder for -quick: the warm-up, then 3, 15, 30
// and 60 QPS for 20 s each.
var QuickStages = []Stage{{15, 50 * time.Second}, {3, 20 * time.Second}, {15, 20 * time.Second},
	{30, 20 * time.Second}, {60, 20 * time.Second}}

// SharedPrefix is llm-d's shared-prefix workload (inference-perf's
// shared_prefix data): Groups groups, each with a System-token shared
// context and Users users, each with one fixed Question-token question;
// every request is a uniformly drawn (group, user) asking for Output
// tokens.
type SharedPrefix struct {
	Groups, Users, System, Question, Output int
}

// LLMDSharedPrefix is llm-d's: 150 groups of 5 users, a 6,000-token
// context, 1,200-token questions, 1,000 output tokens.
var LLMDSharedPrefix = SharedPrefix{Groups: 150, Users: 5, System: 6000, Question: 1200, Output: 1000}

// Chat is the multi-turn workload: conversations starting at the stage's
// rate / Turns, each of Turns turns Gap apart, every turn's prompt the
// conversation's history (every earlier prompt and answer) and a new
// Message-token message, answered in Output tokens.
type Chat struct {
	Turns, Message, Output int
	Gap                    time.Duration
}

// DefaultChat: 6 turns 15 s apart, 400-token messages, 200-token answers
// (assumed: docs/calibration.md).
var DefaultChat = Chat{Turns: 6, Message: 400, Output: 200, Gap: 15 * time.Second}

// PrefixOptions are the figure's parameters.
type PrefixOptions struct {
	Workers                 int
	Profile                 engine.Profile
	MaxRunning, TokenBudget int
	KVPages                 int // 0: the profile's
	// Stages are the arrivals' ladder; the first Warmup are not measured.
	Stages    []Stage
	Warmup    int
	Workloads []string
	Columns   []string
	Shared    SharedPrefix
	Chat      Chat
	// NoReuse is the no-reuse workload's lengths (random prompts).
	NoReuse workload.Trace
	Seed    uint64
	Timing  Timing
	Log     io.Writer
	// Fail workers (worker-1 … worker-Fail) are killed at FailAt, and
	// restart and reload unless NoRestart; 0: no failure.
	Fail      int
	FailAt    time.Duration
	NoRestart bool
}

// DefaultPrefixOptions are llm-d's setup: 8 Qwen3-32B workers of two H100s
// each, vLLM's batch defaults for such GPUs, the context-dependent decode
// (its 7k-token contexts are far from the fitted line's 1.4k).
func DefaultPrefixOptions() PrefixOptions {
	t := DefaultTiming()
	t.DecodeContext = true
	return PrefixOptions{Workers: 8, Profile: engine.Profiles["qwen3-32b-2xh100"], MaxRunning: 256, TokenBudget: 8192,
		Stages: LLMDStages, Warmup: 1, Workloads: PrefixWorkloads, Columns: PrefixColumns, Shared: LLMDSharedPrefix,
		Chat: DefaultChat, NoReuse: workload.AzureConversation, Seed: 1, Timing: t}
}

// PrefixFigures are one column's figures over a span of arrivals (a stage,
// or every measured stage).
type PrefixFigures struct {
	TTFTMeanMs    float64 `json:"ttft_mean_ms"`
	TTFTP90Ms     float64 `json:"ttft_p90_ms"`
	OutputTokensS float64 `json:"output_tokens_s"`
	CacheHitPct   float64 `json:"cache_hit_pct"`
	// RunningCV is the running requests' coefficient of variation across
	// the workers, averaged over the samples of the span.
	RunningCV   float64 `json:"running_cv"`
	Requests    int     `json:"requests"`
	Preemptions int     `json:"preemptions,omitempty"`
	// With failures (summaries only, the whole run): the requests the
	// failures interrupted; of them, those the gateway placed by their
	// cached prefix rather than at the plan's target; their TTFT mean;
	// their resume latency (from the failure to the first token of the
	// first call after it), mean and p90; the history tokens the resumed
	// calls computed again and those they found in a prefix cache.
	Interrupted           int     `json:"interrupted,omitempty"`
	PrefixResumes         int     `json:"prefix_resumes,omitempty"`
	InterruptedTTFTMeanMs float64 `json:"interrupted_ttft_mean_ms,omitempty"`
	ResumeMeanMs          float64 `json:"resume_mean_ms,omitempty"`
	ResumeP90Ms           float64 `json:"resume_p90_ms,omitempty"`
	ResumeRecomputed      int     `json:"resume_recomputed_tokens,omitempty"`
	ResumeCached          int     `json:"resume_cached_tokens,omitempty"`
}

// PrefixPoint is one stage's columns.
type PrefixPoint struct {
	Rate    float64                   `json:"rate"`
	Columns map[string]*PrefixFigures `json:"columns"`
}

// PrefixRun is one workload's points and its summary over every measured
// stage.
type PrefixRun struct {
	Workload string                    `json:"workload"`
	Points   []PrefixPoint             `json:"points"`
	Summary  map[string]*PrefixFigures `json:"summary"`
}

// PrefixFigure is the figure.
type PrefixFigure struct {
	Name        string      `json:"name"`
	Profile     string      `json:"profile"`
	Workers     int         `json:"workers"`
	KVPages     int         `json:"kv_pages"`
	MaxRunning  int         `json:"max_running"`
	TokenBudget int         `json:"token_budget"`
	Seed        uint64      `json:"seed"`
	Stages      []Stage     `json:"stages"`
	Runs        []PrefixRun `json:"runs"`
	// Fail workers killed at FailAtS seconds (0: none).
	Fail    int     `json:"fail,omitempty"`
	FailAtS float64 `json:"fail_at_s,omitempty"`
}

// PrefixArrivals are a workload's arrivals over the stages, sorted.
func PrefixArrivals(o PrefixOptions, name string) ([]workload.Request, error) {
	rng := rand.New(rand.NewPCG(o.Seed, 0x707265666978))
	tok := func() int32 { return 32 + int32(rng.Uint32()%95) }
	toks := func(n int) []int32 {
		p := make([]int32, n)
		for i := range p {
			p[i] = tok()
		}
		return p
	}
	// times are Poisson arrivals at each stage's rate times scale.
	times := func(scale float64) []time.Duration {
		var out []time.Duration
		start := time.Duration(0)
		for _, st := range o.Stages {
			t := start.Seconds()
			end := (start + st.Duration).Seconds()
			for {
				t += rng.ExpFloat64() / (st.Rate * scale)
				if t >= end {
					break
				}
				out = append(out, time.Duration(t*float64(time.Second)))
			}
			start += st.Duration
		}
		return out
	}
	switch name {
	case WorkloadLLMD:
		sp := o.Shared
		if sp.Groups <= 0 || sp.Users <= 0 || sp.System < 0 || sp.Question <= 0 || sp.Output <= 0 {
			return nil, fmt.Errorf("%w: shared-prefix workload %+v: every count must be positive", ErrInvalid, sp)
		}
		prompts := make([][]int32, 0, sp.Groups*sp.Users)
		for range sp.Groups {
			sys := toks(sp.System)
			for range sp.Users {
				prompts = append(prompts, append(sys[:len(sys):len(sys)], toks(sp.Question)...))
			}
		}
		var out []workload.Request
		for _, at := range times(1) {
			out = append(out, workload.Request{At: at, Prompt: prompts[rng.IntN(len(prompts))], Output: sp.Output})
		}
		return out, nil
	case WorkloadChat:
		ch := o.Chat
		if ch.Turns <= 0 || ch.Message <= 0 || ch.Output <= 0 || ch.Gap < 0 {
			return nil, fmt.Errorf("%w: chat workload %+v: turns, message and output must be positive", ErrInvalid, ch)
		}
		type turn struct {
			at         time.Duration
			conv, turn int
		}
		var ts []turn
		for c, at := range times(1 / float64(ch.Turns)) {
			for k := range ch.Turns {
				ts = append(ts, turn{at: at + time.Duration(k)*ch.Gap, conv: c, turn: k})
			}
		}
		sort.SliceStable(ts, func(i, j int) bool { return ts[i].at < ts[j].at })
		// Each turn's prompt is the history so far (the earlier prompts
		// and the answers the simulator generates for them: token) and a
		// new message.
		hist := map[int][]int32{}
		out := make([]workload.Request, len(ts))
		for i, t := range ts {
			p := append(hist[t.conv], toks(ch.Message)...)
			out[i] = workload.Request{At: t.at, Prompt: p, Output: ch.Output}
			if t.turn == ch.Turns-1 {
				delete(hist, t.conv)
				continue
			}
			h := withRoom(p, ch.Output)
			for k := range ch.Output {
				h = append(h, token(i, k))
			}
			hist[t.conv] = h
		}
		return out, nil
	case WorkloadNoReuse:
		var out []workload.Request
		start := time.Duration(0)
		for k, st := range o.Stages {
			rs, err := workload.GenerateLazy(workload.Config{Seed: o.Seed*1000 + uint64(k), Rate: st.Rate, Duration: st.Duration, Trace: o.NoReuse})
			if err != nil {
				return nil, err
			}
			for _, r := range rs {
				r.At += start
				out = append(out, r)
			}
			start += st.Duration
		}
		return out, nil
	}
	return nil, fmt.Errorf("%w: workload %q: one of %v", ErrInvalid, name, PrefixWorkloads)
}

// withRoom copies p with room for extra more.
func withRoom(p []int32, extra int) []int32 { return append(make([]int32, 0, len(p)+extra), p...) }

// config is one column's run of the figure on reqs.
func (o PrefixOptions) config(col string, reqs []workload.Request) Config {
	var fails []Failure
	for k := range o.Fail {
		fails = append(fails, Failure{Worker: k, At: o.FailAt, Restart: !o.NoRestart})
	}
	return Config{Workers: o.Workers, Profile: o.Profile, Strategy: policy.RecomputeHistory, TokenBudget: o.TokenBudget,
		MaxRunning: o.MaxRunning, MaxWaiting: len(reqs) + 1, KVPages: o.KVPages, Arrivals: reqs, Timing: o.Timing,
		PrefixCache: true, PrefixRouting: col == ColPrefixAware || col == ColPrefixPlanned, PlanResumes: col == ColPrefixPlanned,
		Failures: fails}
}

// failFigures adds a run's failure figures to f (failures only).
func failFigures(f *PrefixFigures, res *Result) {
	var ttft []time.Duration
	for _, r := range res.Records {
		if r.Interrupted && r.Err == nil {
			if d, ok := r.TTFT(); ok {
				ttft = append(ttft, d)
			}
		}
	}
	f.Interrupted, f.PrefixResumes = res.Interrupted, res.PrefixResumes
	f.InterruptedTTFTMeanMs = servingstats.Mean(ttft)
	f.ResumeMeanMs, f.ResumeP90Ms = servingstats.Mean(res.Resumes), servingstats.Percentile(res.Resumes, 0.9)
	f.ResumeRecomputed, f.ResumeCached = res.RecomputedTokens, res.ResumeCachedPages*engine.PageTokens
}

// RunPrefix runs the figure.
func RunPrefix(o PrefixOptions) (*PrefixFigure, error) {
	if o.Warmup < 0 || o.Warmup >= len(o.Stages) {
		return nil, fmt.Errorf("%w: %d warm-up stages of %d: at least one stage must be measured", ErrInvalid, o.Warmup, len(o.Stages))
	}
	for _, st := range o.Stages {
		if st.Rate <= 0 || st.Duration < time.Second || st.Duration%time.Second != 0 {
			return nil, fmt.Errorf("%w: stage %g/s for %s: the rate must be positive and the duration whole seconds", ErrInvalid, st.Rate, st.Duration)
		}
	}
	kv := o.KVPages
	if kv == 0 {
		kv = o.Profile.KVPages()
	}
	total := time.Duration(0)
	for _, st := range o.Stages {
		total += st.Duration
	}
	if o.Fail < 0 || o.Fail >= o.Workers {
		return nil, fmt.Errorf("%w: %d failed workers of %d: at least one must survive", ErrInvalid, o.Fail, o.Workers)
	}
	if o.Fail > 0 && (o.FailAt <= 0 || o.FailAt >= total) {
		return nil, fmt.Errorf("%w: failures at %s: within the arrivals, (0, %s)", ErrInvalid, o.FailAt, total)
	}
	f := &PrefixFigure{Name: PrefixFigureName, Profile: o.Profile.Name, Workers: o.Workers, KVPages: kv, MaxRunning: o.MaxRunning,
		TokenBudget: o.TokenBudget, Seed: o.Seed, Stages: o.Stages}
	if o.Fail > 0 {
		f.Fail, f.FailAtS = o.Fail, o.FailAt.Seconds()
	}
	for _, wl := range o.Workloads {
		reqs, err := PrefixArrivals(o, wl)
		if err != nil {
			return nil, err
		}
		run := PrefixRun{Workload: wl, Summary: map[string]*PrefixFigures{}}
		for range o.Stages[o.Warmup:] {
			run.Points = append(run.Points, PrefixPoint{Columns: map[string]*PrefixFigures{}})
		}
		for _, col := range o.Columns {
			start := time.Now()
			res, err := Run(o.config(col, reqs))
			if err != nil {
				return nil, fmt.Errorf("prefix %s, %s: %w", wl, col, err)
			}
			from := time.Duration(0)
			for _, st := range o.Stages[:o.Warmup] {
				from += st.Duration
			}
			measured := from
			for k, st := range o.Stages[o.Warmup:] {
				run.Points[k].Rate = st.Rate
				run.Points[k].Columns[col] = prefixFigures(res, from, from+st.Duration)
				from += st.Duration
			}
			run.Summary[col] = prefixFigures(res, measured, from)
			if o.Fail > 0 {
				failFigures(run.Summary[col], res)
			}
			if o.Log != nil {
				s := run.Summary[col]
				fmt.Fprintf(o.Log, "prefix %s, %s: %.0f output tokens/s, TTFT p90 %.0f ms, cache hits %.1f%% (%s of wall time)\n",
					wl, col, s.OutputTokensS, s.TTFTP90Ms, s.CacheHitPct, time.Since(start).Round(10*time.Millisecond))
			}
		}
		f.Runs = append(f.Runs, run)
	}
	if o.Log != nil {
		f.Print(o.Log)
	}
	return f, nil
}

// prefixFigures are a run's figures for the requests arriving in
// [from, to): their TTFTs, the output tokens delivered (to anyone) in that
// span per second, the cache's hits of the tokens looked up in it, the
// running requests' spread.
func prefixFigures(res *Result, from, to time.Duration) *PrefixFigures {
	f := &PrefixFigures{}
	var ttft []time.Duration
	for _, r := range res.Records {
		if r.Err != nil || r.Arrival < from || r.Arrival >= to {
			continue
		}
		if d, ok := r.TTFT(); ok {
			ttft = append(ttft, d)
		}
		f.Requests++
	}
	f.TTFTMeanMs, f.TTFTP90Ms = servingstats.Mean(ttft), servingstats.Percentile(ttft, 0.9)
	a, b := int(from/time.Second), int(to/time.Second)
	tokens, q, h := 0, 0, 0
	for k := a; k < b; k++ {
		if k < len(res.Delivered) {
			tokens += res.Delivered[k]
		}
		if k < len(res.CacheQueries) {
			q += res.CacheQueries[k]
			h += res.CacheHits[k]
		}
	}
	f.OutputTokensS = float64(tokens) / (to - from).Seconds()
	if q > 0 {
		f.CacheHitPct = 100 * float64(h) / float64(q)
	}
	f.RunningCV, _, _ = spreadOver(res.Spread, from, to)
	f.Preemptions = res.Preemptions
	return f
}

// Print writes the figure's tables and its goals.
func (f *PrefixFigure) Print(out io.Writer) {
	fmt.Fprintf(out, "\nfigure prefix: %d × %s (%d KV pages each), batches of %d, %d tokens a step, seed %d\n",
		f.Workers, f.Profile, f.KVPages, f.MaxRunning, f.TokenBudget, f.Seed)
	cw := 13 // the column names' width
	if f.Fail > 0 {
		cw = len(ColPrefixPlanned)
	}
	fmt.Fprintf(out, "%-10s %6s %-*s %10s %10s %10s %7s %7s\n", "workload", "req/s", cw, "column", "TTFT ms", "p90 TTFT", "out tok/s", "hit %", "run CV")
	for _, run := range f.Runs {
		row := func(rate string, col string, c *PrefixFigures) {
			if c != nil {
				fmt.Fprintf(out, "%-10s %6s %-*s %10.0f %10.0f %10.0f %7.1f %7.3f\n", run.Workload, rate, cw, col,
					c.TTFTMeanMs, c.TTFTP90Ms, c.OutputTokensS, c.CacheHitPct, c.RunningCV)
			}
		}
		for _, p := range run.Points {
			for _, col := range PrefixFailColumns {
				row(fmt.Sprint(p.Rate), col, p.Columns[col])
			}
		}
		for _, col := range PrefixFailColumns {
			row("all", col, run.Summary[col])
		}
	}
	if f.Fail > 0 {
		fmt.Fprintf(out, "\n%d workers killed at %gs: the interrupted requests (whole run)\n", f.Fail, f.FailAtS)
		fmt.Fprintf(out, "%-10s %-29s %5s %7s %9s %9s %9s %12s %12s\n", "workload", "column", "intr", "byprefx", "TTFT ms", "resume ms", "p90 ms", "recomputed", "from cache")
		for _, run := range f.Runs {
			for _, col := range PrefixFailColumns {
				if c := run.Summary[col]; c != nil {
					fmt.Fprintf(out, "%-10s %-29s %5d %7d %9.0f %9.0f %9.0f %12d %12d\n", run.Workload, col, c.Interrupted, c.PrefixResumes,
						c.InterruptedTTFTMeanMs, c.ResumeMeanMs, c.ResumeP90Ms, c.ResumeRecomputed, c.ResumeCached)
				}
			}
		}
	}
	fmt.Fprintf(out, "\nprefix-aware against freeness alone (summary over the measured stages)\n")
	for _, run := range f.Runs {
		a, b := run.Summary[ColFreeness], run.Summary[ColPrefixAware]
		if a == nil || b == nil {
			continue
		}
		fmt.Fprintf(out, "%-10s output tokens/s ×%.2f, TTFT p90 ×%.4f, TTFT mean ×%.4f, running CV %+.1f%%, hits %.1f%% → %.1f%%\n",
			run.Workload, ratio(b.OutputTokensS, a.OutputTokensS), ratio(b.TTFTP90Ms, a.TTFTP90Ms), ratio(b.TTFTMeanMs, a.TTFTMeanMs),
			100*(ratio(b.RunningCV, a.RunningCV)-1), a.CacheHitPct, b.CacheHitPct)
	}
}

// runPrefix runs -figure prefix: the workloads on llm-d's setup (-workers,
// -max-running, -seed and -quick change it), both columns unless
// -prefix-routing names one.
func (c *Command) runPrefix(given func(...string) bool) error {
	if given("duration", "xs", "seeds", "stress", "load", "profile") {
		return fmt.Errorf("-figure %s runs llm-d's load ladder (3 → 60 QPS, -quick a shorter one) on %d × qwen3-32b-2xh100: -duration, -xs, -seeds, -stress, -load and -profile do not apply",
			PrefixFigureName, DefaultPrefixOptions().Workers)
	}
	o := DefaultPrefixOptions()
	o.Seed, o.Log = c.Seed, c.Out
	if c.Workers > 0 {
		o.Workers = c.Workers
	}
	if given("max-running") {
		o.MaxRunning = c.MaxRunning
	}
	if c.Quick {
		o.Stages = QuickStages
	}
	if given("fail") {
		// Failures: the interrupted requests' figures, and the
		// prefix-aware column's ablation, its resumes as planned.
		o.Fail, o.NoRestart, o.Columns = c.Fail, c.NoRestart, PrefixFailColumns
		o.FailAt = c.FailAt
		if o.FailAt == 0 {
			// Halfway through the measured stages.
			var warm, all time.Duration
			for k, st := range o.Stages {
				if k < o.Warmup {
					warm += st.Duration
				}
				all += st.Duration
			}
			o.FailAt = warm + (all-warm)/2
		}
	} else if given("fail-at", "no-restart") {
		return fmt.Errorf("-figure %s: -fail-at and -no-restart go with -fail (the workers killed)", PrefixFigureName)
	}
	if given("prefix-routing") {
		o.Columns = []string{ColFreeness}
		if c.PrefixRouting == "on" {
			o.Columns = []string{ColPrefixAware}
			if o.Fail > 0 {
				o.Columns = append(o.Columns, ColPrefixPlanned)
			}
		}
	}
	f, err := RunPrefix(o)
	if err != nil {
		return err
	}
	if c.JSONPath == "" {
		return nil
	}
	data, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(c.JSONPath, append(data, '\n'), 0o644)
}
