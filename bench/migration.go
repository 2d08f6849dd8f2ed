package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/lumen-project/lumen/internal/completions"
	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	"github.com/lumen-project/lumen/internal/progress"
	"github.com/lumen-project/lumen/internal/servingstats"
	"github.com/lumen-project/lumen/internal/workload"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// `lumen bench migration`: live migration (Llumnix) on real processes —
// three controllers, a gateway and synthetic workers paced as Qwen3-14B on
// an H100 — in three phases:
//
//   - downtime: two workers, each decoding a background batch; requests at
//     256 to 8192 tokens of context are migrated (Operator.Migrate) while
//     they stream, and each is run again, the same length, not migrated.
//     The downtime is the gateway's lumen_gateway_migration_downtime_seconds
//     (the client's token times agree, and split it); the background's
//     token gaps inside the migrated windows against the same windows not
//     migrated are the slowdown. Then an 8192-token request's worker is
//     killed under stop-and-restart: the resume elsewhere recomputes it all.
//   - burst: eight workers, Gamma arrivals with cv 4 at the Azure
//     conversation lengths, migration on and then off on the same arrivals.
//   - drain: a worker with 32 streams is drained (DRAINING) while three
//     others serve their own; every stream must equal the reference and no
//     token may be recomputed.
//
// The arithmetic (what the runs measured, as plain values, turned into the
// figures under their JSON keys and the table) comes first; the runs after.

// downtimeSample is one migration of the downtime phase. Times are offsets
// from the phase's start, as the client (the bench) saw them, but stamp,
// which is the controller leader's: when it proposed the commit.
type downtimeSample struct {
	length int // tokens of context when the migration started
	// gatewayMs is the gateway's lumen_gateway_migration_downtime_seconds
	// for this migration (the histogram's sum grew by it), in ms.
	gatewayMs float64
	// tokens are the client's token arrival times; trigger when the
	// migration was asked for.
	tokens  []time.Duration
	trigger time.Duration
	// started: the STARTED event's leader stamp; stamp: the COMMITTED
	// event's leader stamp (the FinishMigration's proposal); seen: when
	// the leader's event stream delivered COMMITTED to the bench (it
	// applied there), seenLast when the last replica's did.
	started, stamp, seen, seenLast time.Duration
	// dest is the destination's own part: from the gateway's call to the
	// first token it computed (its lumen_worker_time_to_first_token_seconds for the
	// adopted call: the wait for the step in progress, and the step);
	// destOK says it was measured.
	dest   time.Duration
	destOK bool
	// rpc is the Operator.Migrate call's latency: one Raft commit through
	// the leader, as the source's FinishMigration is.
	rpc time.Duration
}

// switchGap finds the switch in a stream of token times: the two tokens
// either side of at (the commit's stamp). Without one it takes the
// longest gap after from.
func switchGap(tokens []time.Duration, at, from time.Duration) (last, first time.Duration, ok bool) {
	for i := 1; i < len(tokens); i++ {
		if tokens[i-1] < at && at <= tokens[i] {
			return tokens[i-1], tokens[i], true
		}
	}
	best := time.Duration(-1)
	for i := 1; i < len(tokens); i++ {
		if tokens[i-1] >= from && tokens[i]-tokens[i-1] > best {
			best, last, first, ok = tokens[i]-tokens[i-1], tokens[i-1], tokens[i], true
		}
	}
	return last, first, ok
}

// downtimeParts is one migration's client-side downtime and its parts,
// which add up to it.
type downtimeParts struct {
	gap time.Duration
	// stopCopy: the source's last token to the leader's commit proposal
	// (the last stage's copy, the destination taking it between two of its
	// steps and acknowledging it, the FinishMigration call).
	stopCopy time.Duration
	// commit: the proposal to the leader's COMMITTED event reaching a
	// watcher (the Raft round, apply, fan-out).
	commit time.Duration
	// gateway: that event to the gateway's call reaching the destination
	// (the gateway learns of the commit from its event stream or from the
	// source's last message, and calls the destination); with dest unknown
	// it holds the destination's part too.
	gateway time.Duration
	// dest: the call to the destination's first token (dest).
	dest time.Duration
}

// partsOf splits a migration's downtime; false when the stream shows no
// switch.
func partsOf(s downtimeSample) (downtimeParts, bool) {
	last, first, ok := switchGap(s.tokens, s.stamp, s.trigger)
	if !ok {
		return downtimeParts{}, false
	}
	p := downtimeParts{gap: first - last, stopCopy: s.stamp - last, commit: s.seen - s.stamp, gateway: first - s.seen}
	if s.destOK {
		p.gateway -= s.dest
		p.dest = s.dest
	}
	return p, true
}

// window is a span of time, [from, to].
type window struct{ from, to time.Duration }

// windowGaps are the gaps between consecutive tokens of the streams that
// lie wholly inside one of the windows.
func windowGaps(streams [][]time.Duration, wins []window) []time.Duration {
	var out []time.Duration
	for _, toks := range streams {
		for i := 1; i < len(toks); i++ {
			for _, w := range wins {
				if toks[i-1] >= w.from && toks[i] <= w.to {
					out = append(out, toks[i]-toks[i-1])
					break
				}
			}
		}
	}
	return out
}

// medianMs is the median of d in milliseconds (the mean of the two middle
// values for an even count), or 0 for none. d is not changed.
func medianMs(d []time.Duration) float64 {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return msOf(s[n/2])
	}
	return (msOf(s[n/2-1]) + msOf(s[n/2])) / 2
}

func medianOf(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

func msOf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// recomputeSample is one resume by recompute of the downtime phase's
// recompute step: the request's worker killed, the request resumed
// elsewhere with its history, every token prefilled again.
type recomputeSample struct {
	// seen: the recovery (the request's RecoveryPlan or move) reached the
	// bench; first: the first token after the kill; lastBefore: the last
	// one before it.
	lastBefore, kill, seen, first time.Duration
	recomputed                    float64 // tokens the destination prefilled again
}

// burstResult is one run of the burst phase.
type burstResult struct {
	// window is how long arrivals came.
	window time.Duration
	recs   []*servingstats.Record
	failed int
	wrong  int // outputs that differ from the reference
	// Counters summed over the workers.
	preemptions, migrations, aborted, recomputed float64
	// The gateway's migration downtime histogram.
	downtimeCount, downtimeSum float64
	// The engines' paced and emulated seconds, summed.
	paced, emulated float64
	// aborts counts the aborted migrations by abortReason.
	aborts map[string]int
}

// abortReason shortens an ABORTED event's reason to its kind: the
// destination's refusal, why the request left its source, the stage
// timeout, or the reason's start.
func abortReason(r string) string {
	if i := strings.Index(r, "MIGRATE_REFUSAL_"); i >= 0 {
		k := r[i+len("MIGRATE_REFUSAL_"):]
		if j := strings.IndexAny(k, "): "); j >= 0 {
			k = k[:j]
		}
		return "refused: " + strings.ToLower(k)
	}
	if _, why, ok := strings.Cut(r, "the request left the source: "); ok {
		return why
	}
	if strings.HasPrefix(r, "stage timeout") {
		return "stage timeout"
	}
	// Request ids and numbers apart, the same failure reads the same.
	r = quotedRE.ReplaceAllString(r, `"…"`)
	r = digitsRE.ReplaceAllString(r, "N")
	if len(r) > 160 {
		r = r[:160] + "…"
	}
	return r
}

var (
	quotedRE = regexp.MustCompile(`"[^"]*"`)
	digitsRE = regexp.MustCompile(`[0-9]+`)
)

// abortSummary lists the abort reasons, most frequent first.
func abortSummary(aborts map[string]int) string {
	type kv struct {
		k string
		n int
	}
	var l []kv
	for k, n := range aborts {
		l = append(l, kv{k, n})
	}
	slices.SortFunc(l, func(a, b kv) int {
		if a.n != b.n {
			return b.n - a.n
		}
		return strings.Compare(a.k, b.k)
	})
	var out []string
	for _, x := range l {
		out = append(out, fmt.Sprintf("%d %s", x.n, x.k))
	}
	return strings.Join(out, ", ")
}

// tokens is the output tokens delivered, and makespan the time from the
// run's start to the last token.
func (b *burstResult) throughput() (tokens int, makespan time.Duration) {
	for _, r := range b.recs {
		if r == nil {
			continue
		}
		tokens += len(r.Chunks)
		if n := len(r.Chunks); n > 0 && r.Chunks[n-1] > makespan {
			makespan = r.Chunks[n-1]
		}
	}
	return tokens, makespan
}

// windowTokens is the output tokens delivered while arrivals came.
func (b *burstResult) windowTokens() int {
	n := 0
	for _, r := range b.recs {
		if r == nil {
			continue
		}
		for _, c := range r.Chunks {
			if c < b.window {
				n++
			}
		}
	}
	return n
}

func (b *burstResult) ttfts() []time.Duration {
	var out []time.Duration
	for _, r := range b.recs {
		if r == nil || r.Err != nil {
			continue
		}
		if d, ok := r.TTFT(); ok {
			out = append(out, d)
		}
	}
	return out
}

// burstTotals pools runs of the burst phase: every request's TTFT, the
// tokens and times summed, the counters summed.
type burstTotals struct {
	ttft                                   []time.Duration
	tokens, windowTokens, requests         int
	makespan, window                       time.Duration
	failed, wrong                          int
	preemptions, migrations, aborted       float64
	recomputed, downtimeCount, downtimeSum float64
	paced, emulated                        float64
}

func burstTotalsOf(rs []*burstResult) burstTotals {
	var t burstTotals
	for _, b := range rs {
		t.ttft = append(t.ttft, b.ttfts()...)
		n, span := b.throughput()
		t.tokens, t.makespan = t.tokens+n, t.makespan+span
		t.windowTokens, t.window = t.windowTokens+b.windowTokens(), t.window+b.window
		t.requests += len(b.recs)
		t.failed, t.wrong = t.failed+b.failed, t.wrong+b.wrong
		t.preemptions, t.migrations, t.aborted = t.preemptions+b.preemptions, t.migrations+b.migrations, t.aborted+b.aborted
		t.recomputed += b.recomputed
		t.downtimeCount, t.downtimeSum = t.downtimeCount+b.downtimeCount, t.downtimeSum+b.downtimeSum
		t.paced, t.emulated = t.paced+b.paced, t.emulated+b.emulated
	}
	return t
}

// drainResult is the drain phase.
type drainResult struct {
	streams, onDrained int // streams in all, on the drained worker at the drain
	// empty: the drain's start to the last migration off the worker
	// committing (as the event reached the bench); left: to its LEFT.
	empty, left           time.Duration
	committed, aborted    int
	recomputed            float64
	differing, failed     int
	downtimeN, downtimeMs float64 // the gateway's switches during the drain and their mean
}

// migrationRaw is everything the phases measured.
type migrationRaw struct {
	// profileStep: the profile's decode step at the batch the migrated
	// requests ran in (batch).
	profileStep time.Duration
	batch       int
	samples     []downtimeSample
	aborted     int // migrations of the downtime phase that did not commit
	// The other requests' token gaps inside the migrated requests' windows
	// (from the migration's request to the stream's end), with migrations
	// and in the same windows of the same requests not migrated.
	bgOn, bgOff []time.Duration
	// Outputs of the downtime phase's requests that differ from the
	// reference, and streams that failed.
	differing, failed int
	recompute         []recomputeSample
	// The burst runs, with migration on and off, pairwise on the same
	// arrivals.
	burstOn, burstOff []*burstResult
	drain             *drainResult
	// llumnix: the llumnix phase (llumnix.go).
	llumnix *llumnixRaw
}

// migrationLengths are the context lengths of the downtime phase.
var migrationLengths = []int{256, 1024, 4096, 8192}

// migrationFigures turns what the phases measured into the figures, under
// their JSON keys (the contract keys first; the rest explain them). A
// phase not run leaves its keys out.
func migrationFigures(r *migrationRaw) map[string]float64 {
	f := map[string]float64{}
	if len(r.samples) > 0 {
		f["decode_step_ms"] = msOf(r.profileStep)
		f["decode_batch"] = float64(r.batch)
		if len(r.bgOff) > 0 {
			f["decode_step_measured_ms"] = medianMs(r.bgOff)
		}
		lo, hi := math.Inf(1), 0.0
		var rpcs, lag []time.Duration
		for _, n := range migrationLengths {
			var gw []float64
			var gap, stopCopy, commit, gwPart, dest, copyAll []time.Duration
			for _, s := range r.samples {
				if s.length != n {
					continue
				}
				gw = append(gw, s.gatewayMs)
				rpcs = append(rpcs, s.rpc)
				if p, ok := partsOf(s); ok {
					gap, stopCopy, commit, gwPart = append(gap, p.gap), append(stopCopy, p.stopCopy), append(commit, p.commit), append(gwPart, p.gateway)
					if s.destOK {
						dest = append(dest, p.dest)
					}
				}
				copyAll = append(copyAll, s.stamp-s.started)
				lag = append(lag, s.seenLast-s.seen)
			}
			if len(gw) == 0 {
				continue
			}
			m := medianOf(gw)
			f[fmt.Sprintf("downtime_ms_%d", n)] = m
			f[fmt.Sprintf("downtime_migrations_%d", n)] = float64(len(gw))
			f[fmt.Sprintf("downtime_max_ms_%d", n)] = slices.Max(gw)
			f[fmt.Sprintf("downtime_client_ms_%d", n)] = medianMs(gap)
			f[fmt.Sprintf("downtime_stop_copy_ms_%d", n)] = medianMs(stopCopy)
			f[fmt.Sprintf("downtime_commit_ms_%d", n)] = medianMs(commit)
			f[fmt.Sprintf("downtime_gateway_ms_%d", n)] = medianMs(gwPart)
			if len(dest) > 0 {
				f[fmt.Sprintf("downtime_dest_ms_%d", n)] = medianMs(dest)
			}
			f[fmt.Sprintf("migration_ms_%d", n)] = medianMs(copyAll)
			lo, hi = math.Min(lo, m), math.Max(hi, m)
		}
		if lo > 0 && hi > 0 {
			f["downtime_flatness"] = hi / lo
		}
		f["migrate_rpc_ms"] = medianMs(rpcs)
		f["commit_follower_lag_ms"] = medianMs(lag)
		f["downtime_aborted"] = float64(r.aborted)
		f["downtime_outputs_differing"] = float64(r.differing)
		f["downtime_failed"] = float64(r.failed)
		if len(r.bgOn) > 0 && len(r.bgOff) > 0 {
			on, off := servingstats.Mean(r.bgOn), servingstats.Mean(r.bgOff)
			f["slowdown_pct"] = 100 * (on/off - 1)
			f["tpot_during_migration_ms"], f["tpot_without_migration_ms"] = on, off
		}
	}
	if len(r.recompute) > 0 {
		var rc, gap []time.Duration
		var toks []float64
		for _, s := range r.recompute {
			rc, gap = append(rc, s.first-s.seen), append(gap, s.first-s.lastBefore)
			toks = append(toks, s.recomputed)
		}
		f["recompute_ms_8192"] = medianMs(rc)
		f["recompute_gap_ms_8192"] = medianMs(gap)
		f["recompute_tokens_8192"] = medianOf(toks)
	}
	if len(r.burstOn) > 0 && len(r.burstOff) > 0 {
		on, off := burstTotalsOf(r.burstOn), burstTotalsOf(r.burstOff)
		f["burst_p99_ttft_ms_on"] = servingstats.Percentile(on.ttft, 0.99)
		f["burst_p99_ttft_ms_off"] = servingstats.Percentile(off.ttft, 0.99)
		f["burst_mean_ttft_ms_on"] = servingstats.Mean(on.ttft)
		f["burst_mean_ttft_ms_off"] = servingstats.Mean(off.ttft)
		for i, b := range r.burstOn {
			f[fmt.Sprintf("burst_p99_ttft_ms_on_%d", i+1)] = servingstats.Percentile(b.ttfts(), 0.99)
		}
		for i, b := range r.burstOff {
			f[fmt.Sprintf("burst_p99_ttft_ms_off_%d", i+1)] = servingstats.Percentile(b.ttfts(), 0.99)
		}
		if on.makespan > 0 && off.makespan > 0 {
			a, b := float64(on.tokens)/on.makespan.Seconds(), float64(off.tokens)/off.makespan.Seconds()
			f["burst_tokens_per_s_on"], f["burst_tokens_per_s_off"] = a, b
			f["burst_throughput_loss_pct"] = 100 * (1 - a/b)
			f["burst_makespan_s_on"], f["burst_makespan_s_off"] = on.makespan.Seconds(), off.makespan.Seconds()
		}
		if on.window > 0 && off.window > 0 && off.windowTokens > 0 {
			a, b := float64(on.windowTokens)/on.window.Seconds(), float64(off.windowTokens)/off.window.Seconds()
			f["burst_window_tokens_per_s_on"], f["burst_window_tokens_per_s_off"] = a, b
			f["burst_window_loss_pct"] = 100 * (1 - a/b)
		}
		f["burst_preemptions_on"], f["burst_preemptions_off"] = on.preemptions, off.preemptions
		f["burst_migrations_on"], f["burst_migrations_aborted_on"] = on.migrations, on.aborted
		f["burst_recomputed_tokens_on"], f["burst_recomputed_tokens_off"] = on.recomputed, off.recomputed
		f["burst_requests"] = float64(on.requests)
		f["burst_runs"] = float64(len(r.burstOn))
		f["burst_failed_on"], f["burst_failed_off"] = float64(on.failed), float64(off.failed)
		f["burst_outputs_differing_on"], f["burst_outputs_differing_off"] = float64(on.wrong), float64(off.wrong)
		if on.downtimeCount > 0 {
			f["burst_downtime_mean_ms"] = 1000 * on.downtimeSum / on.downtimeCount
		}
		if on.emulated > 0 && off.emulated > 0 {
			f["burst_pacing_overrun_pct_on"] = 100 * (on.paced/on.emulated - 1)
			f["burst_pacing_overrun_pct_off"] = 100 * (off.paced/off.emulated - 1)
		}
	}
	r.llumnix.figures(f)
	if d := r.drain; d != nil {
		f["drain_recomputed_tokens"] = d.recomputed
		f["drain_outputs_differing"] = float64(d.differing)
		f["drain_failed"] = float64(d.failed)
		f["drain_streams"], f["drain_streams_on_worker"] = float64(d.streams), float64(d.onDrained)
		f["drain_empty_s"], f["drain_left_s"] = d.empty.Seconds(), d.left.Seconds()
		f["drain_migrations"], f["drain_migrations_aborted"] = float64(d.committed), float64(d.aborted)
		if d.downtimeN > 0 {
			f["drain_downtime_mean_ms"] = d.downtimeMs
		}
	}
	return f
}

// verdict says whether a goal is met.
func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "**missed**"
}

// printMigrationTable prints the table `lumen bench migration` ends with
// (Markdown, as docs/benchmarks.md shows it). Missing figures (a phase not
// run) leave their rows out.
func printMigrationTable(w io.Writer, f map[string]float64) {
	has := func(k ...string) bool {
		for _, x := range k {
			if _, ok := f[x]; !ok {
				return false
			}
		}
		return true
	}
	fmt.Fprintf(w, "\n| measure | result | goal | verdict |\n| --- | --- | --- | --- |\n")
	row := func(m, res, goal, v string) { fmt.Fprintf(w, "| %s | %s | %s | %s |\n", m, res, goal, v) }
	step := f["decode_step_ms"]
	if has("decode_step_ms") {
		for _, n := range migrationLengths {
			k := fmt.Sprintf("downtime_ms_%d", n)
			if !has(k) {
				continue
			}
			row(fmt.Sprintf("downtime, %d tokens (median of %.0f; max)", n, f[fmt.Sprintf("downtime_migrations_%d", n)]),
				fmt.Sprintf("%.1f ms = %.1f steps (max %.1f)", f[k], f[k]/step, f[fmt.Sprintf("downtime_max_ms_%d", n)]),
				fmt.Sprintf("≤ one step (%.1f ms)", step), verdict(f[k] <= step))
		}
		if has("downtime_flatness") {
			row("downtime max/min over the lengths", fmt.Sprintf("%.2f", f["downtime_flatness"]), "≤ 1.5", verdict(f["downtime_flatness"] <= 1.5))
		}
		meas := ""
		if has("decode_step_measured_ms") {
			meas = fmt.Sprintf("; measured %.1f ms", f["decode_step_measured_ms"])
		}
		row(fmt.Sprintf("decode step at batch %.0f", f["decode_batch"]), fmt.Sprintf("profile %.2f ms%s", step, meas), "—", "—")
	}
	if has("recompute_ms_8192") {
		row("recompute 8192 tokens instead (kill, resume elsewhere)", fmt.Sprintf("%.0f ms (%.0f tokens; client gap %.0f ms)",
			f["recompute_ms_8192"], f["recompute_tokens_8192"], f["recompute_gap_ms_8192"]), "—", "—")
	}
	if has("slowdown_pct") {
		row("TPOT of the other requests, during migrations vs without", fmt.Sprintf("%+.2f%% (%.2f vs %.2f ms)",
			f["slowdown_pct"], f["tpot_during_migration_ms"], f["tpot_without_migration_ms"]), "≤ 1%", verdict(f["slowdown_pct"] <= 1))
	}
	if has("burst_p99_ttft_ms_on", "burst_p99_ttft_ms_off") {
		on, off := f["burst_p99_ttft_ms_on"], f["burst_p99_ttft_ms_off"]
		ratio := "n/a"
		if on > 0 {
			ratio = fmt.Sprintf("%.2f× lower", off/on)
		}
		var runs []string
		for i := 1; has(fmt.Sprintf("burst_p99_ttft_ms_on_%d", i), fmt.Sprintf("burst_p99_ttft_ms_off_%d", i)); i++ {
			runs = append(runs, fmt.Sprintf("%.0f / %.0f", f[fmt.Sprintf("burst_p99_ttft_ms_on_%d", i)], f[fmt.Sprintf("burst_p99_ttft_ms_off_%d", i)]))
		}
		each := ""
		if len(runs) > 1 {
			each = "; each pair: " + strings.Join(runs, ", ")
		}
		row(fmt.Sprintf("burst p99 TTFT, migration on / off (%.0f requests in %.0f run(s) each)", f["burst_requests"], f["burst_runs"]),
			fmt.Sprintf("%.0f / %.0f ms (%s%s)", on, off, ratio, each), "on ≤ half of off", verdict(on <= off/2))
		row("burst mean TTFT, on / off", fmt.Sprintf("%.0f / %.0f ms", f["burst_mean_ttft_ms_on"], f["burst_mean_ttft_ms_off"]), "—", "—")
		loss := f["burst_throughput_loss_pct"]
		row("burst throughput loss (output tokens / makespan)", fmt.Sprintf("%+.2f%% (%.0f vs %.0f tokens/s; %.1f vs %.1f s)", loss,
			f["burst_tokens_per_s_on"], f["burst_tokens_per_s_off"], f["burst_makespan_s_on"], f["burst_makespan_s_off"]), "within 1%", verdict(math.Abs(loss) <= 1))
		if has("burst_window_loss_pct") {
			row("burst tokens delivered while arrivals came, loss", fmt.Sprintf("%+.2f%% (%.0f vs %.0f tokens/s)", f["burst_window_loss_pct"],
				f["burst_window_tokens_per_s_on"], f["burst_window_tokens_per_s_off"]), "—", "—")
		}
		row("burst preemptions, on / off", fmt.Sprintf("%.0f / %.0f", f["burst_preemptions_on"], f["burst_preemptions_off"]), "—", "—")
		if has("burst_pacing_overrun_pct_on") {
			row("burst engine steps over the profile's time, on / off", fmt.Sprintf("%.1f%% / %.1f%%", f["burst_pacing_overrun_pct_on"],
				f["burst_pacing_overrun_pct_off"]), "—", "—")
		}
		mig := fmt.Sprintf("%.0f / %.0f", f["burst_migrations_on"], f["burst_migrations_aborted_on"])
		if has("burst_downtime_mean_ms") {
			mig += fmt.Sprintf("; downtime %.1f ms on average", f["burst_downtime_mean_ms"])
		}
		row("burst migrations (committed / aborted)", mig, "—", "—")
		row("burst outputs ≠ reference, on / off", fmt.Sprintf("%.0f / %.0f of %.0f (failed %.0f / %.0f)", f["burst_outputs_differing_on"],
			f["burst_outputs_differing_off"], f["burst_requests"], f["burst_failed_on"], f["burst_failed_off"]), "0", verdict(f["burst_outputs_differing_on"]+f["burst_outputs_differing_off"]+f["burst_failed_on"]+f["burst_failed_off"] == 0))
	}
	if has("drain_recomputed_tokens") {
		row(fmt.Sprintf("drain of a worker with %.0f streams: time to empty / to LEFT", f["drain_streams_on_worker"]),
			fmt.Sprintf("%.2f s / %.2f s (%.0f migrations, %.0f aborted; downtime %.1f ms on average)", f["drain_empty_s"], f["drain_left_s"],
				f["drain_migrations"], f["drain_migrations_aborted"], f["drain_downtime_mean_ms"]), "—", "—")
		row("drain: tokens recomputed", fmt.Sprintf("%.0f", f["drain_recomputed_tokens"]), "0", verdict(f["drain_recomputed_tokens"] == 0))
		row("drain: outputs ≠ reference", fmt.Sprintf("%.0f of %.0f (failed %.0f)", f["drain_outputs_differing"], f["drain_streams"], f["drain_failed"]),
			"0", verdict(f["drain_outputs_differing"]+f["drain_failed"] == 0))
	}
	printLlumnixRows(row, has, f)
	if has("decode_step_ms", "downtime_ms_8192") {
		fmt.Fprintf(w, "\nDowntime, the client's view, split (medians, ms): the source's last token → the leader's commit proposal\n"+
			"(the last stage's copy, taken by the destination between its steps, acknowledged; FinishMigration) → the leader's\n"+
			"COMMITTED event (Raft, apply, fan-out) → the gateway's call at the destination → the destination's first token\n"+
			"(its step in progress, then the step that computes it). The whole migration runs from its start to the commit.\n\n")
		fmt.Fprintf(w, "| context | gateway's downtime | client gap | stop + copy | commit | gateway | destination | whole migration |\n"+
			"| --- | --- | --- | --- | --- | --- | --- | --- |\n")
		for _, n := range migrationLengths {
			k := func(p string) string {
				v, ok := f[fmt.Sprintf("%s_%d", p, n)]
				if !ok {
					return "—"
				}
				return fmt.Sprintf("%.1f", v)
			}
			if !has(fmt.Sprintf("downtime_ms_%d", n)) {
				continue
			}
			fmt.Fprintf(w, "| %d | %s | %s | %s | %s | %s | %s | %s |\n", n, k("downtime_ms"), k("downtime_client_ms"),
				k("downtime_stop_copy_ms"), k("downtime_commit_ms"), k("downtime_gateway_ms"), k("downtime_dest_ms"), k("migration_ms"))
		}
		fmt.Fprintf(w, "(Operator.Migrate, one Raft commit through the leader: median %.1f ms; the last follower's COMMITTED event\n"+
			"came %.1f ms after the leader's, median)\n", f["migrate_rpc_ms"], f["commit_follower_lag_ms"])
	}
}

// gammaGaps returns n inter-arrival gaps of a Gamma renewal process with
// mean 1/rate seconds and coefficient of variation cv (shape 1/cv²): cv 1
// is Poisson, larger is burstier.
func gammaGaps(r *rand.Rand, rate, cv float64, n int) []time.Duration {
	k := 1 / (cv * cv)
	theta := 1 / (rate * k)
	out := make([]time.Duration, n)
	for i := range out {
		out[i] = time.Duration(theta * workload.Gamma(r, k) * float64(time.Second))
	}
	return out
}

// MigrationConfig is `lumen bench migration`.
type MigrationConfig struct {
	// Quick is fewer migrations per length and a shorter burst, same keys.
	Quick bool
	// JSONPath, when set, receives the figures as JSON (after every phase).
	JSONPath string
	// Seed seeds the prompts and the burst's arrivals.
	Seed uint64
	// Load is the burst's mean offered load, a fraction of the cluster's
	// modelled saturated throughput, in (0, 1.5].
	Load float64
	// Phases is a comma-separated list of phases: downtime, burst, drain,
	// llumnix.
	Phases string
	// BurstKVPages, when > 0, gives the burst's workers this many KV pages
	// instead of the profile's GPU's (a smaller GPU: memory binds before
	// the batch cap, as in Llumnix's setups).
	BurstKVPages int
	// Dir keeps logs and data; empty means a temporary directory, removed.
	Dir string
	// Profile is every worker's timing profile (engine.Profiles; empty:
	// qwen3-14b-h100, and llama-7b-a10 for the llumnix phase).
	// llama-7b-a10 is Llumnix's instance, the simulator's figure llumnix.
	Profile string
	// Llumnix is the llumnix phase's setup (llumnix.go).
	Llumnix LlumnixBench
}

// DefaultMigrationConfig is `lumen bench migration` without flags.
func DefaultMigrationConfig() MigrationConfig {
	return MigrationConfig{Seed: 1, Load: 0.6, Phases: "downtime,burst,drain", Llumnix: DefaultLlumnixBench()}
}

// migrationPlan is the size of each phase.
type migrationPlan struct {
	// Downtime: migrations per length; tokens streamed before the
	// migration (the prompt is the length less these) and after it;
	// background streams per worker; resumes by recompute.
	reps, lead, tail, background, recomputeReps int
	// Burst: how long arrivals come, on how many workers, and the
	// arrivals' coefficient of variation.
	burst        time.Duration
	burstWorkers int
	burstCV      float64
	burstPairs   int
	// Drain: streams on the drained worker, on the others, and workers.
	drainStreams, drainOthers, drainWorkers int
	// profile is every worker's timing profile (MigrationConfig.Profile).
	profile string
}

func migrationPlanFor(quick bool) migrationPlan {
	p := migrationPlan{profile: migProfile, reps: 10, lead: 16, tail: 48, background: 8, recomputeReps: 3,
		burst: 60 * time.Second, burstWorkers: 8, burstCV: 4, burstPairs: 2, drainStreams: 32, drainOthers: 24, drainWorkers: 4}
	if quick {
		p.reps, p.recomputeReps, p.burst, p.burstPairs = 4, 1, 30*time.Second, 1
	}
	return p
}

// migProfile is every worker's timing profile by default.
const migProfile = "qwen3-14b-h100"

// migWorkerArgs are every worker's flags: paced on profile, no model load
// to wait for.
func migWorkerArgs(profile string) []string {
	return []string{"-engine", "synthetic", "-profile", profile, "-time-scale", "1", "-emulate-load=false", "-token-budget", "2048"}
}

// Migration runs `lumen bench migration`.
func Migration(cfg MigrationConfig) error {
	if cfg.Load <= 0 || cfg.Load > 1.5 {
		return fmt.Errorf("-load %g: use a fraction of capacity in (0, 1.5]", cfg.Load)
	}
	phases := map[string]bool{}
	for _, p := range strings.Split(cfg.Phases, ",") {
		p = strings.TrimSpace(p)
		switch p {
		case "downtime", "burst", "drain", "llumnix":
			phases[p] = true
		default:
			return fmt.Errorf("-phases: unknown phase %q: use downtime, burst, drain, llumnix", p)
		}
	}
	if phases["llumnix"] {
		if err := checkLlumnixBench(cfg.Llumnix); err != nil {
			return err
		}
	}
	plan := migrationPlanFor(cfg.Quick)
	if cfg.Profile != "" {
		if _, ok, err := engine.LookupProfile(cfg.Profile); err != nil || !ok {
			return fmt.Errorf("-profile %q: a timing profile is needed (%v)", cfg.Profile, err)
		}
		plan.profile = cfg.Profile
	}
	dir := cfg.Dir
	if dir == "" {
		d, err := os.MkdirTemp("", "lumen-bench-migration-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(d)
		dir = d
	}
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	raw := &migrationRaw{}
	begin := time.Now()
	meter := progress.New("bench migration", "phases", float64(len(phases)))
	defer meter.Finish("")
	save := func() error {
		if cfg.JSONPath == "" {
			return nil
		}
		return writeJSON(cfg.JSONPath, migrationFigures(raw))
	}
	if phases["downtime"] {
		meter.Set(meter.Done(), "downtime")
		if err := raw.runDowntime(ctx, plan, filepath.Join(dir, "downtime"), cfg.Seed); err != nil {
			return fmt.Errorf("downtime: %w", err)
		}
		if err := save(); err != nil {
			return err
		}
		meter.Add(1, "downtime done")
	}
	if phases["burst"] {
		meter.Set(meter.Done(), "burst")
		if err := raw.runBurst(ctx, plan, filepath.Join(dir, "burst"), cfg.Seed, cfg.Load, cfg.BurstKVPages); err != nil {
			return fmt.Errorf("burst: %w", err)
		}
		if err := save(); err != nil {
			return err
		}
		meter.Add(1, "burst done")
	}
	if phases["llumnix"] {
		meter.Set(meter.Done(), "llumnix")
		if err := raw.runLlumnix(ctx, cfg, filepath.Join(dir, "llumnix")); err != nil {
			return fmt.Errorf("llumnix: %w", err)
		}
		if err := save(); err != nil {
			return err
		}
		meter.Add(1, "llumnix done")
	}
	if phases["drain"] {
		meter.Set(meter.Done(), "drain")
		if err := raw.runDrain(ctx, plan, filepath.Join(dir, "drain"), cfg.Seed); err != nil {
			return fmt.Errorf("drain: %w", err)
		}
		if err := save(); err != nil {
			return err
		}
		meter.Add(1, "drain done")
	}
	printMigrationTable(os.Stdout, migrationFigures(raw))
	fmt.Printf("\n(%s in all)\n", time.Since(begin).Round(time.Second))
	return nil
}

// migCluster is one phase's cluster: three controllers, workers w1..wN, a
// gateway, and the controllers' events as the bench saw them.
type migCluster struct {
	cl    *devcluster.Cluster
	ctl   *ctlclient.Client
	gw    *devcluster.Gateway
	start time.Time
	httpc *http.Client
	args  []string

	// leader is the controller leader's index (it does not change: no
	// controller fails here).
	leader int
	// stopWatch ends the event watches (close).
	stopWatch context.CancelFunc

	mu    sync.Mutex
	evs   []*seenEvent
	byKey map[[2]uint64]*seenEvent
	wake  chan struct{}
}

// seenEvent is an event and when the bench received it: first over every
// replica's stream, and from each replica.
type seenEvent struct {
	ev *pb.Event
	at time.Duration
	by []time.Duration // by replica index; 0 until that replica's stream delivers it
}

// startMigCluster starts a cluster with n workers with args and live
// migration set to mode.
func startMigCluster(ctx context.Context, dir string, n int, args []string, mode pb.MigrationMode) (*migCluster, error) {
	// Every phase starts from empty data directories (a -dir kept from an
	// earlier invocation would restart its old quorum).
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	cl, err := devcluster.Start(ctx, devcluster.Options{Dir: dir, Controllers: 3, Args: []string{"-log-level", "warn"}})
	if err != nil {
		return nil, err
	}
	m := &migCluster{cl: cl, args: args, wake: make(chan struct{}), byKey: map[[2]uint64]*seenEvent{},
		httpc: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4096}}}
	ok := false
	defer func() {
		if !ok {
			m.close()
		}
	}()
	if m.ctl, err = ctlclient.New(cl.GRPCAddrs(), nil); err != nil {
		return nil, err
	}
	if err := m.setStrategy(ctx, &pb.SetStrategyRequest{Migration: mode}); err != nil {
		return nil, err
	}
	for i := 1; i <= n; i++ {
		if _, err := cl.AddWorkerContext(ctx, fmt.Sprintf("w%d", i), args...); err != nil {
			return nil, err
		}
	}
	if m.gw, err = cl.StartGateway("", "-max-concurrent", "16384", "-max-context", "32768"); err != nil {
		return nil, err
	}
	if err := m.gw.WaitReady(ctx); err != nil {
		return nil, err
	}
	if err := waitWorkersServing(ctx, m.ctl, n); err != nil {
		return nil, err
	}
	if m.leader, err = cl.WaitLeader(ctx); err != nil {
		return nil, err
	}
	st, err := m.ctl.ClusterStatus(ctx)
	if err != nil {
		return nil, err
	}
	m.start = time.Now()
	wctx, stop := context.WithCancel(ctx)
	m.stopWatch = stop
	for i := range cl.Controllers {
		go m.watch(wctx, i, st.AppliedIndex)
	}
	ok = true
	return m, nil
}

func (m *migCluster) close() {
	if m.stopWatch != nil {
		m.stopWatch()
	}
	if m.ctl != nil {
		m.ctl.Close()
	}
	m.cl.Stop()
}

func (m *migCluster) setStrategy(ctx context.Context, req *pb.SetStrategyRequest) error {
	err := m.ctl.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) error {
		_, err := op.SetStrategy(ctx, req)
		return err
	})
	if err != nil {
		return fmt.Errorf("set strategy: %w", err)
	}
	return nil
}

// since is the time since the phase's start; stamp turns a controller's
// time stamp into the same clock.
func (m *migCluster) since() time.Duration               { return time.Since(m.start) }
func (m *migCluster) stamp(unixNano int64) time.Duration { return time.Unix(0, unixNano).Sub(m.start) }

// watch keeps the events of controller i, from index from, reconnecting
// after a break, until ctx ends. Every replica is watched: the leader's
// stream shows when a command applied there, the followers' how much later
// they did (a gateway follows one replica's stream).
func (m *migCluster) watch(ctx context.Context, i int, from uint64) {
	n := len(m.cl.Controllers)
	for ctx.Err() == nil {
		stream, err := pb.NewControllerClient(m.ctl.Conn(i)).WatchEvents(ctx, &pb.WatchEventsRequest{FromIndex: from})
		if err != nil {
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		for {
			ev, err := stream.Recv()
			if err != nil {
				break
			}
			at := m.since()
			from = ev.Index
			key := [2]uint64{ev.Index, uint64(ev.Seq)}
			m.mu.Lock()
			e := m.byKey[key]
			if e == nil {
				e = &seenEvent{ev: ev, at: at, by: make([]time.Duration, n)}
				m.byKey[key] = e
				m.evs = append(m.evs, e)
				close(m.wake)
				m.wake = make(chan struct{})
			}
			if e.by[i] == 0 {
				e.by[i] = at
			}
			m.mu.Unlock()
		}
	}
}

// receipts returns when each replica's stream delivered e (0: not yet).
func (m *migCluster) receipts(e *seenEvent) []time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(e.by)
}

// waitEvent waits up to timeout for an event that match says is the one.
func (m *migCluster) waitEvent(ctx context.Context, timeout time.Duration, what string, match func(*pb.Event) bool) (*seenEvent, error) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		m.mu.Lock()
		for _, e := range m.evs {
			if match(e.ev) {
				m.mu.Unlock()
				return e, nil
			}
		}
		wake := m.wake
		m.mu.Unlock()
		select {
		case <-wake:
		case <-t.C:
			return nil, fmt.Errorf("no event for %s within %s", what, timeout)
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// events returns the events seen so far that match.
func (m *migCluster) events(match func(*pb.Event) bool) []*seenEvent {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []*seenEvent
	for _, e := range m.evs {
		if match(e.ev) {
			out = append(out, e)
		}
	}
	return out
}

func migrationOf(id string, stages ...pb.Migration_Stage) func(*pb.Event) bool {
	return func(ev *pb.Event) bool {
		mg := ev.GetMigration()
		return mg != nil && mg.Placement.GetRequestId() == id && slices.Contains(stages, mg.Stage)
	}
}

func (m *migCluster) worker(id string) *devcluster.Worker {
	for _, w := range m.cl.Workers {
		if w.ID == id {
			return w
		}
	}
	return nil
}

// sumMetric sums a metric over the running workers; a worker that does not
// answer is said so and left out.
func (m *migCluster) sumMetric(ctx context.Context, name string) float64 {
	sum := 0.0
	for _, w := range m.cl.Workers {
		if !w.Running() {
			continue
		}
		v, err := w.Metric(ctx, name)
		if err != nil {
			fmt.Printf("   %v\n", err)
			continue
		}
		sum += v
	}
	return sum
}

// downtimeHist reads the gateway's migration downtime histogram: switches
// and their sum in seconds.
func (m *migCluster) downtimeHist(ctx context.Context) (count, sum float64, err error) {
	url := "http://" + m.gw.Addr + "/metrics"
	if count, err = devcluster.ScrapeMetric(ctx, url, "lumen_gateway_migration_downtime_seconds_count"); err != nil {
		return 0, 0, err
	}
	sum, err = devcluster.ScrapeMetric(ctx, url, "lumen_gateway_migration_downtime_seconds_sum")
	return count, sum, err
}

func labelledMetric(name, label, value string) string {
	return fmt.Sprintf("%s{%s=%q}", name, label, value)
}

// migStream is one streaming completion through the gateway, with the
// time of every token.
type migStream struct {
	id    string
	toks  []time.Duration
	text  string
	err   error
	first chan struct{} // closed at the first token (or the end)
	nth   chan struct{} // closed at the lead-th token (or the end)
	done  chan struct{}
}

// stream starts a completion of body; lead is the token nth waits for.
func (m *migCluster) stream(ctx context.Context, body []byte, lead int) *migStream {
	s := &migStream{first: make(chan struct{}), nth: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		res, err := completions.Stream(ctx, m.httpc, m.gw.Addr, body, func(c completions.Chunk) {
			if c.Text == "" {
				return
			}
			s.toks = append(s.toks, m.since())
			if len(s.toks) == 1 {
				s.id = c.ID
				close(s.first)
			}
			if len(s.toks) == lead {
				close(s.nth)
			}
		})
		s.text, s.err = res.Text, err
		if len(s.toks) == 0 {
			close(s.first)
		}
		if len(s.toks) < lead {
			close(s.nth)
		}
	}()
	return s
}

// wait waits for c, or ctx's end.
func wait(ctx context.Context, c <-chan struct{}) error {
	select {
	case <-c:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// randomPrompt is n printable token ids.
func randomPrompt(r *rand.Rand, n int) []int32 {
	p := make([]int32, n)
	for i := range p {
		p[i] = 32 + int32(r.IntN(95))
	}
	return p
}

// reference is a prompt's greedy output on the synthetic engine, alone.
func reference(prompt []int32, n int) (string, error) {
	e, err := engine.NewSynthetic(engine.SyntheticConfig{Pages: 1024})
	if err != nil {
		return "", err
	}
	return engine.GreedyText(e, prompt, n), nil
}

// placementOf reads a request's placement, linearizably.
func (m *migCluster) placementOf(ctx context.Context, id string) (*pb.Placement, error) {
	resp, err := m.ctl.GetPlacement(ctx, &pb.GetPlacementRequest{RequestId: id, Consistency: pb.Consistency_CONSISTENCY_LINEARIZABLE})
	if err != nil {
		return nil, fmt.Errorf("placement of %s: %w", id, err)
	}
	return resp.Placement, nil
}

// runDowntime is the downtime phase: the migrations at each length, the
// same requests not migrated, then the resumes by recompute.
func (r *migrationRaw) runDowntime(ctx context.Context, plan migrationPlan, dir string, seed uint64) error {
	prof, _, err := engine.LookupProfile(plan.profile)
	if err != nil {
		return err
	}
	r.batch = plan.background + 1
	r.profileStep = prof.StepTime(r.batch, 0)
	fmt.Printf("== downtime: 2 workers paced as %s, %d background streams each (a decode step at batch %d is %s);\n"+
		"   %d migrations per length at %v tokens of context, each followed by the same length not migrated\n",
		plan.profile, plan.background, r.batch, r.profileStep, plan.reps, migrationLengths)
	m, err := startMigCluster(ctx, dir, 2, append(migWorkerArgs(plan.profile), "-max-running", "64"), pb.MigrationMode_MIGRATION_MODE_OFF)
	if err != nil {
		return err
	}
	defer m.close()
	rng := rand.New(rand.NewPCG(seed, 0x6d6967))

	// The background: long streams decoding through the whole phase,
	// placed one after the other so that dispatch spreads them.
	bgCtx, stopBG := context.WithCancel(ctx)
	defer stopBG()
	bg := make([]*migStream, 2*plan.background)
	// As long as the model's context allows (llama-7b-a10: 12,288).
	bgTokens := 30000
	if prof.MaxContext > 0 {
		bgTokens = min(bgTokens, prof.MaxContext-64)
	}
	for i := range bg {
		bg[i] = m.stream(bgCtx, completions.Body(randomPrompt(rng, 64), bgTokens, false), 0)
		if err := wait(ctx, bg[i].first); err != nil {
			return err
		}
		if bg[i].id == "" {
			<-bg[i].done
			return fmt.Errorf("background stream %d got no token: %v", i, bg[i].err)
		}
	}
	on := map[string]int{}
	for _, s := range bg {
		pl, err := m.placementOf(ctx, s.id)
		if err != nil {
			return err
		}
		on[pl.WorkerId]++
	}
	fmt.Printf("   background: %d on w1, %d on w2\n", on["w1"], on["w2"])

	var winOn, winOff []window
	prevCount, prevSum, err := m.downtimeHist(ctx)
	if err != nil {
		return err
	}
	for _, n := range migrationLengths {
		var gw []float64
		for rep := 0; rep < plan.reps; rep++ {
			for _, migrate := range []bool{true, false} {
				prompt := randomPrompt(rng, n-plan.lead)
				want, err := reference(prompt, plan.lead+plan.tail)
				if err != nil {
					return err
				}
				s := m.stream(ctx, completions.Body(prompt, plan.lead+plan.tail, false), plan.lead)
				if err := wait(ctx, s.nth); err != nil {
					return err
				}
				trigger := m.since()
				sample := downtimeSample{length: n, trigger: trigger}
				var commit *seenEvent
				var dest *devcluster.Worker
				// Both workers' first-token histograms before the
				// migration: the adopted call is the only first token
				// the destination computes until the stream ends.
				var ttft0 [2][2]float64
				if migrate {
					for i, id := range []string{"w1", "w2"} {
						if ttft0[i][0], ttft0[i][1], err = ttftHist(ctx, m.worker(id)); err != nil {
							return err
						}
					}
				}
				if migrate && s.id != "" {
					if commit, dest, err = m.migrateOne(ctx, s.id, &sample); err != nil {
						return err
					}
					if commit == nil {
						r.aborted++
					}
				}
				if err := wait(ctx, s.done); err != nil {
					return err
				}
				if s.err != nil || len(s.toks) == 0 {
					r.failed++
					fmt.Printf("   %d tokens: a stream failed: %v\n", n, s.err)
					continue
				}
				if s.text != want {
					r.differing++
					fmt.Printf("   %d tokens: %s differs from the reference\n", n, s.id)
				}
				end := s.toks[len(s.toks)-1]
				if !migrate {
					winOff = append(winOff, window{trigger, end})
					continue
				}
				winOn = append(winOn, window{trigger, end})
				count, sum, err := m.downtimeHist(ctx)
				if err != nil {
					return err
				}
				if commit != nil {
					by := m.receipts(commit)
					sample.seen, sample.seenLast = by[m.leader], slices.Max(by)
					i := 0
					if dest.ID == "w2" {
						i = 1
					}
					if c, sum, err := ttftHist(ctx, dest); err == nil && c == ttft0[i][0]+1 {
						sample.dest, sample.destOK = time.Duration((sum-ttft0[i][1])*float64(time.Second)), true
					}
					if count-prevCount != 1 {
						fmt.Printf("   the gateway recorded %.0f switches for one migration\n", count-prevCount)
					}
					if count > prevCount {
						sample.gatewayMs = 1000 * (sum - prevSum) / (count - prevCount)
						sample.tokens = s.toks
						r.samples = append(r.samples, sample)
						gw = append(gw, sample.gatewayMs)
					}
				}
				prevCount, prevSum = count, sum
			}
		}
		fmt.Printf("   t=%4.0fs  %5d tokens: %d migrations committed; the gateway's downtime median %.1f ms, max %.1f ms\n",
			m.since().Seconds(), n, len(gw), medianOf(gw), maxOf(gw))
	}
	stopBG()
	streams := make([][]time.Duration, len(bg))
	for i, s := range bg {
		<-s.done
		streams[i] = s.toks
	}
	r.bgOn, r.bgOff = windowGaps(streams, winOn), windowGaps(streams, winOff)
	fmt.Printf("   the background's TPOT inside the migrated windows %.2f ms (%d gaps), inside the windows not migrated %.2f ms (%d gaps)\n",
		servingstats.Mean(r.bgOn), len(r.bgOn), servingstats.Mean(r.bgOff), len(r.bgOff))
	return r.runRecompute(ctx, plan, m, rng)
}

func maxOf(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	return slices.Max(v)
}

// migrateOne migrates request id to the other worker and waits for the
// migration to end. A commit fills sample's stamps and returns the
// COMMITTED event (nil: no commit) and the destination.
func (m *migCluster) migrateOne(ctx context.Context, id string, sample *downtimeSample) (*seenEvent, *devcluster.Worker, error) {
	pl, err := m.placementOf(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	to := m.worker("w1")
	if pl.WorkerId == "w1" {
		to = m.worker("w2")
	}
	t0 := time.Now()
	_, err = m.ctl.Migrate(ctx, &pb.MigrateRequest{RequestId: id, ToWorker: to.ID})
	sample.rpc = time.Since(t0)
	if err != nil {
		fmt.Printf("   migrate %s to %s: %v\n", id, to.ID, err)
		return nil, nil, nil
	}
	st, err := m.waitEvent(ctx, 15*time.Second, id+"'s migration start", migrationOf(id, pb.Migration_STAGE_STARTED))
	if err != nil {
		return nil, nil, err
	}
	end, err := m.waitEvent(ctx, 15*time.Second, id+"'s migration end", migrationOf(id, pb.Migration_STAGE_COMMITTED, pb.Migration_STAGE_ABORTED))
	if err != nil {
		return nil, nil, err
	}
	if mg := end.ev.GetMigration(); mg.Stage != pb.Migration_STAGE_COMMITTED {
		fmt.Printf("   the migration of %s to %s was aborted: %s\n", id, to.ID, mg.Reason)
		return nil, nil, nil
	}
	sample.started, sample.stamp = m.stamp(st.ev.UnixNano), m.stamp(end.ev.UnixNano)
	return end, to, nil
}

// ttftHist reads a worker's lumen_worker_time_to_first_token_seconds: count and sum.
func ttftHist(ctx context.Context, w *devcluster.Worker) (count, sum float64, err error) {
	if count, err = w.Metric(ctx, "lumen_worker_time_to_first_token_seconds_count"); err != nil {
		return 0, 0, err
	}
	sum, err = w.Metric(ctx, "lumen_worker_time_to_first_token_seconds_sum")
	return count, sum, err
}

// runRecompute kills the worker of an 8192-token request under
// stop-and-restart (no checkpoint): the request resumes on the other
// worker, which prefills its whole history again. The figure is the
// recovery reaching the bench (the gateway follows the same event) to the
// first token after it.
func (r *migrationRaw) runRecompute(ctx context.Context, plan migrationPlan, m *migCluster, rng *rand.Rand) error {
	if err := m.setStrategy(ctx, &pb.SetStrategyRequest{Strategy: pb.Strategy(policy.StopAndRestart)}); err != nil {
		return err
	}
	fmt.Printf("-- recompute instead: %d × an 8192-token request whose worker is killed (stop-and-restart: no checkpoint)\n", plan.recomputeReps)
	const n = 8192
	for rep := 0; rep < plan.recomputeReps; rep++ {
		prompt := randomPrompt(rng, n-plan.lead)
		want, err := reference(prompt, plan.lead+plan.tail)
		if err != nil {
			return err
		}
		s := m.stream(ctx, completions.Body(prompt, plan.lead+plan.tail, false), plan.lead)
		if err := wait(ctx, s.nth); err != nil {
			return err
		}
		if s.id == "" {
			<-s.done
			return fmt.Errorf("an 8192-token request got no token: %v", s.err)
		}
		pl, err := m.placementOf(ctx, s.id)
		if err != nil {
			return err
		}
		victim := m.worker(pl.WorkerId)
		survivor := m.worker("w1")
		if victim.ID == "w1" {
			survivor = m.worker("w2")
		}
		recomputed := "lumen_worker_resume_recomputed_tokens_total"
		before, err := survivor.Metric(ctx, recomputed)
		if err != nil {
			return err
		}
		kill := m.since()
		m.cl.KillWorker(victim)
		ev, err := m.waitEvent(ctx, 30*time.Second, s.id+"'s recovery", func(ev *pb.Event) bool {
			if rp := ev.GetRecoveryPlan(); rp != nil && rp.FailedWorker == victim.ID {
				for _, a := range rp.Assignments {
					if id, _, _ := strings.Cut(a.RequestId, "~"); id == s.id {
						return true
					}
				}
			}
			mv := ev.GetPlacementMoved()
			return mv != nil && mv.Placement.GetRequestId() == s.id
		})
		if err != nil {
			return err
		}
		if err := wait(ctx, s.done); err != nil {
			return err
		}
		after, err := survivor.Metric(ctx, recomputed)
		if err != nil {
			return err
		}
		switch {
		case s.err != nil:
			r.failed++
			fmt.Printf("   the 8192-token request failed: %v\n", s.err)
		case s.text != want:
			r.differing++
			fmt.Printf("   the 8192-token request %s differs from the reference\n", s.id)
		}
		sample := recomputeSample{kill: kill, seen: ev.at, recomputed: after - before}
		for _, t := range s.toks {
			if t < kill {
				sample.lastBefore = t
			} else {
				sample.first = t
				break
			}
		}
		if sample.first > 0 {
			r.recompute = append(r.recompute, sample)
			fmt.Printf("   t=%4.0fs  %s killed: the recovery reached the bench %.0f ms later, the first token %.0f ms after that (%.0f tokens recomputed)\n",
				m.since().Seconds(), victim.ID, msOf(sample.seen-kill), msOf(sample.first-sample.seen), sample.recomputed)
		}
		if err := m.cl.StartWorker(victim); err != nil {
			return fmt.Errorf("restart %s: %w", victim.ID, err)
		}
		if err := waitWorkersServing(ctx, m.ctl, 2); err != nil {
			return err
		}
	}
	return nil
}

// burstWorkload is the burst's arrivals: Gamma with cv over d at rate,
// carrying the Azure conversation trace's requests (lengths and prompts
// from internal/workload, whose arrivals are Poisson) in order.
func burstWorkload(seed uint64, rate, cv float64, d time.Duration) ([]workload.Request, error) {
	r := rand.New(rand.NewPCG(seed, 0x6275727374))
	var at []time.Duration
	for t := time.Duration(0); ; {
		t += gammaGaps(r, rate, cv, 1)[0]
		if t >= d {
			break
		}
		at = append(at, t)
	}
	if len(at) == 0 {
		return nil, errors.New("bench: no arrival in the burst's duration")
	}
	span := d
	for {
		reqs, err := workload.Generate(workload.Config{Seed: seed, Rate: rate, Duration: span, Trace: workload.AzureConversation})
		if err != nil {
			return nil, err
		}
		if len(reqs) >= len(at) {
			reqs = reqs[:len(at)]
			for i := range reqs {
				reqs[i].At = at[i]
			}
			return reqs, nil
		}
		span *= 2
	}
}

// runBurst is the burst phase: pairs of runs on the same arrivals, one
// with migration on and one off (the second pair in the other order, and
// on arrivals of the next seed).
func (r *migrationRaw) runBurst(ctx context.Context, plan migrationPlan, dir string, seed uint64, load float64, kvPages int) error {
	prof, _, err := engine.LookupProfile(plan.profile)
	if err != nil {
		return err
	}
	args := append(migWorkerArgs(plan.profile), "-max-running", "32", "-checkpoint-budget", "80GB")
	if kvPages > 0 {
		// The same model on a GPU with room for kvPages pages: the
		// saturated rate is the model's at that cache.
		prof.GPUMemBytes = int64((float64(int64(kvPages)*engine.PageTokens*prof.KVBytesPerToken()+prof.WeightBytes) + 1) / 0.9)
		args = append(args, "-kv-pages", fmt.Sprint(kvPages))
		fmt.Printf("== burst: every worker has %d KV pages (%d tokens), not the profile's %d\n", prof.KVPages(), prof.KVPages()*engine.PageTokens,
			engine.Profiles[plan.profile].KVPages())
	}
	tr := workload.AzureConversation
	per, batch := prof.SaturatedRate(32, tr.Prompt.Mean(), tr.Output.Mean())
	rate := load * per * float64(plan.burstWorkers)
	fmt.Printf("== burst: %d workers paced as %s (batch up to 32: the model saturates at %.1f requests/s, batch %d);\n"+
		"   Gamma arrivals with cv %g at %.1f/s (%.0f%% of that) over %s, %s lengths; %d pair(s) of runs, migration on and off\n",
		plan.burstWorkers, plan.profile, per*float64(plan.burstWorkers), batch, plan.burstCV, rate, 100*load, plan.burst, tr.Name, plan.burstPairs)
	for pair := 0; pair < plan.burstPairs; pair++ {
		s := seed + uint64(pair)
		reqs, err := burstWorkload(s, rate, plan.burstCV, plan.burst)
		if err != nil {
			return err
		}
		refs, err := syntheticReferences(reqs)
		if err != nil {
			return err
		}
		bodies := requestBodies(reqs)
		modes := []pb.MigrationMode{pb.MigrationMode_MIGRATION_MODE_ON, pb.MigrationMode_MIGRATION_MODE_OFF}
		if pair%2 == 1 {
			modes[0], modes[1] = modes[1], modes[0]
		}
		for _, mode := range modes {
			name := "on"
			if mode == pb.MigrationMode_MIGRATION_MODE_OFF {
				name = "off"
			}
			fmt.Printf("-- burst %d (seed %d, %d requests), migration %s\n", pair+1, s, len(reqs), name)
			o, err := burstRun(ctx, filepath.Join(dir, fmt.Sprintf("%s-%d", name, pair+1)), plan.burstWorkers, args, mode, plan.burst, reqs, bodies, refs)
			if err != nil {
				return fmt.Errorf("migration %s: %w", name, err)
			}
			if mode == pb.MigrationMode_MIGRATION_MODE_ON {
				r.burstOn = append(r.burstOn, o)
			} else {
				r.burstOff = append(r.burstOff, o)
			}
			tok, span := o.throughput()
			overrun := 0.0
			if o.emulated > 0 {
				overrun = 100 * (o.paced/o.emulated - 1)
			}
			fmt.Printf("   TTFT p99 %.0f ms, mean %.0f ms; %d tokens in %.1f s; %.0f preemptions, %.0f migrations (%.0f aborted); %d failed, %d outputs differ; steps %.1f%% over the profile\n",
				servingstats.Percentile(o.ttfts(), 0.99), servingstats.Mean(o.ttfts()), tok, span.Seconds(), o.preemptions, o.migrations, o.aborted,
				o.failed, o.wrong, overrun)
			if len(o.aborts) > 0 {
				fmt.Printf("   migrations aborted: %s\n", abortSummary(o.aborts))
			}
		}
	}
	return nil
}

// burstRun runs the arrivals on a fresh cluster.
func burstRun(ctx context.Context, dir string, workers int, args []string, mode pb.MigrationMode, window time.Duration,
	reqs []workload.Request, bodies [][]byte, refs []string) (*burstResult, error) {
	m, err := startMigCluster(ctx, dir, workers, args, mode)
	if err != nil {
		return nil, err
	}
	defer m.close()
	return m.serve(ctx, window, reqs, bodies, refs)
}

// serve sends the arrivals to m's gateway, each at its time, waits for
// every stream, checks each output against its reference and reads the
// workers' counters.
func (m *migCluster) serve(ctx context.Context, window time.Duration, reqs []workload.Request, bodies [][]byte, refs []string) (*burstResult, error) {
	var err error
	o := &burstResult{recs: make([]*servingstats.Record, len(reqs)), window: window}
	texts := make([]string, len(reqs))
	start := time.Now()
	since := func() time.Duration { return time.Since(start) }
	var wg sync.WaitGroup
	var done, failed atomicCounter
	progress := time.NewTicker(10 * time.Second)
	defer progress.Stop()
	for i := range reqs {
		for wait := reqs[i].At - since(); wait > 0; wait = reqs[i].At - since() {
			select {
			case <-progress.C:
				fmt.Printf("   t=%4.0fs  %d sent, %d done, %d failed\n", since().Seconds(), i, done.load(), failed.load())
			case <-time.After(wait):
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		rec := &servingstats.Record{Arrival: since()}
		o.recs[i] = rec
		wg.Go(func() {
			texts[i], rec.ID, rec.Err = streamOne(ctx, m.httpc, m.gw.Addr, bodies[i], rec, since)
			if rec.Err != nil {
				failed.add()
			}
			done.add()
		})
	}
	fmt.Printf("   t=%4.0fs  all %d sent; waiting for the last streams\n", since().Seconds(), len(reqs))
	wg.Wait()
	shown := 0
	for i, rec := range o.recs {
		switch {
		case rec.Err != nil:
			o.failed++
			if shown < 5 {
				fmt.Printf("   request %d (%s) failed: %v\n", i, rec.ID, rec.Err)
				shown++
			}
		case texts[i] != refs[i]:
			o.wrong++
		}
	}
	o.preemptions = m.sumMetric(ctx, "lumen_worker_num_preemptions_total")
	o.migrations = m.sumMetric(ctx, labelledMetric("lumen_worker_migrations_out_total", "outcome", "committed"))
	o.aborted = m.sumMetric(ctx, labelledMetric("lumen_worker_migrations_out_total", "outcome", "aborted"))
	o.recomputed = m.sumMetric(ctx, "lumen_worker_resume_recomputed_tokens_total")
	o.aborts = map[string]int{}
	for _, e := range m.events(func(ev *pb.Event) bool { return ev.GetMigration().GetStage() == pb.Migration_STAGE_ABORTED }) {
		o.aborts[abortReason(e.ev.GetMigration().Reason)]++
	}
	o.paced = m.sumMetric(ctx, "lumen_worker_paced_seconds_total")
	o.emulated = m.sumMetric(ctx, "lumen_worker_emulated_seconds_total")
	if o.downtimeCount, o.downtimeSum, err = m.downtimeHist(ctx); err != nil {
		fmt.Printf("   %v\n", err)
	}
	return o, nil
}

// atomicCounter counts across goroutines.
type atomicCounter struct {
	mu sync.Mutex
	n  int
}

func (c *atomicCounter) add() { c.mu.Lock(); c.n++; c.mu.Unlock() }
func (c *atomicCounter) load() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

// runDrain is the drain phase: w1 serves drainStreams streams alone; then
// the other workers join and serve streams of their own; then w1 is
// drained. Every stream must equal the reference, none may be recomputed.
func (r *migrationRaw) runDrain(ctx context.Context, plan migrationPlan, dir string, seed uint64) error {
	n := plan.drainStreams + plan.drainOthers
	fmt.Printf("== drain: w1 serves %d streams; %d more workers join and serve %d; then w1 is drained (DRAINING)\n",
		plan.drainStreams, plan.drainWorkers-1, plan.drainOthers)
	reqs, err := workload.Generate(workload.Config{Seed: seed + 7, Rate: 10, Duration: time.Hour, Trace: workload.AzureConversation})
	if err != nil {
		return err
	}
	if len(reqs) < n {
		return fmt.Errorf("bench: %d requests generated, the drain needs %d", len(reqs), n)
	}
	reqs = reqs[:n]
	// Outputs long enough to outlast the drain: 800 to 1200 tokens
	// (15–18 s at a batch of 32).
	for i := range reqs {
		reqs[i].Output = 800 + (i*97)%400
	}
	refs, err := syntheticReferences(reqs)
	if err != nil {
		return err
	}
	args := append(migWorkerArgs(plan.profile), "-max-running", "64")
	m, err := startMigCluster(ctx, dir, 1, args, pb.MigrationMode_MIGRATION_MODE_OFF)
	if err != nil {
		return err
	}
	defer m.close()
	streams := make([]*migStream, n)
	start := func(i int) {
		streams[i] = m.stream(ctx, completions.Body(reqs[i].Prompt, reqs[i].Output, false), 1)
	}
	for i := 0; i < plan.drainStreams; i++ {
		start(i)
	}
	for i := 0; i < plan.drainStreams; i++ {
		if err := wait(ctx, streams[i].first); err != nil {
			return err
		}
	}
	for i := 2; i <= plan.drainWorkers; i++ {
		if _, err := m.cl.AddWorkerContext(ctx, fmt.Sprintf("w%d", i), args...); err != nil {
			return err
		}
	}
	if err := waitWorkersServing(ctx, m.ctl, plan.drainWorkers); err != nil {
		return err
	}
	for i := plan.drainStreams; i < n; i++ {
		start(i)
	}
	for i := plan.drainStreams; i < n; i++ {
		if err := wait(ctx, streams[i].first); err != nil {
			return err
		}
	}
	d := &drainResult{streams: n}
	for i := range streams {
		if streams[i].id == "" {
			continue
		}
		pl, err := m.placementOf(ctx, streams[i].id)
		if err != nil {
			return err
		}
		if pl.WorkerId == "w1" {
			d.onDrained++
		}
	}
	lw, err := m.ctl.ListWorkers(ctx, &pb.ListWorkersRequest{Consistency: pb.Consistency_CONSISTENCY_LINEARIZABLE})
	if err != nil {
		return err
	}
	var inc uint64
	for _, w := range lw.Workers {
		if w.Id == "w1" {
			inc = w.Incarnation
		}
	}
	c0, s0, err := m.downtimeHist(ctx)
	if err != nil {
		return err
	}
	t0 := m.since()
	if _, err := m.ctl.SetWorkerPhase(ctx, &pb.SetWorkerPhaseRequest{WorkerId: "w1", Incarnation: inc,
		Phase: pb.WorkerPhase_WORKER_PHASE_DRAINING, Reason: "lumen bench migration: drain"}); err != nil {
		return fmt.Errorf("drain w1: %w", err)
	}
	fmt.Printf("   t=%4.1fs  w1 DRAINING with %d streams\n", t0.Seconds(), d.onDrained)
	left, err := m.waitEvent(ctx, 2*time.Minute, "w1 to leave", func(ev *pb.Event) bool {
		pc := ev.GetPhaseChanged()
		return pc != nil && pc.WorkerId == "w1" && pc.Incarnation == inc && pc.To == pb.WorkerPhase_WORKER_PHASE_LEFT
	})
	if err != nil {
		return err
	}
	d.left = left.at - t0
	for _, e := range m.events(func(ev *pb.Event) bool { return ev.GetMigration().GetFromWorker() == "w1" }) {
		switch e.ev.GetMigration().Stage {
		case pb.Migration_STAGE_COMMITTED:
			d.committed++
			d.empty = max(d.empty, e.at-t0)
		case pb.Migration_STAGE_ABORTED:
			d.aborted++
		}
	}
	fmt.Printf("   t=%4.1fs  w1 LEFT: %d migrations committed, %d aborted, the last commit %.2f s after the drain began\n",
		left.at.Seconds(), d.committed, d.aborted, d.empty.Seconds())
	for i, s := range streams {
		if err := wait(ctx, s.done); err != nil {
			return err
		}
		switch {
		case s.err != nil:
			d.failed++
			fmt.Printf("   stream %d (%s) failed: %v\n", i, s.id, s.err)
		case s.text != refs[i]:
			d.differing++
			fmt.Printf("   stream %d (%s) differs from the reference\n", i, s.id)
		}
	}
	d.recomputed = m.sumMetric(ctx, "lumen_worker_resume_recomputed_tokens_total")
	if c1, s1, err := m.downtimeHist(ctx); err == nil && c1 > c0 {
		d.downtimeN, d.downtimeMs = c1-c0, 1000*(s1-s0)/(c1-c0)
	}
	fmt.Printf("   t=%4.1fs  every stream ended: %d failed, %d differ; %.0f tokens recomputed; %.0f switches, %.1f ms downtime on average\n",
		m.since().Seconds(), d.failed, d.differing, d.recomputed, d.downtimeN, d.downtimeMs)
	r.drain = d
	return nil
}
