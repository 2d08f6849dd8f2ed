package worker

import (
	"strings"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

type metrics struct {
	reg         *prometheus.Registry
	ttft        prometheus.Histogram
	tpot        prometheus.Histogram
	queueDelay  prometheus.Histogram
	stepSeconds prometheus.Histogram
	batchRows   prometheus.Histogram
	kvUsed      prometheus.Gauge
	kvTotal     prometheus.Gauge
	kvUsage     prometheus.Gauge
	queueWait   prometheus.Gauge
	ckptBudget  prometheus.Gauge
	running     prometheus.Gauge
	waiting     prometheus.Gauge
	preemptions prometheus.Counter
	// stepOutOfPages: steps the engine refused for want of KV pages the
	// core had counted as free (0 while the two agree).
	stepOutOfPages prometheus.Counter
	// stepGap: the host's time between consecutive engine steps while
	// requests were running or waiting (scheduler.step).
	stepGap prometheus.Counter
	// The prefix cache (Config.PrefixCache): history tokens of the
	// requests admitted with an empty cache, and how many the cache held.
	cacheQueries, cacheHits prometheus.Counter
	completed               prometheus.Counter
	rejected                *prometheus.CounterVec
	rejoins                 prometheus.Counter
	loadReports             *prometheus.CounterVec
	// preemptionLoss: per preemption, the time until the request's cache
	// holds again what it held (scheduler.refilled).
	preemptionLoss prometheus.Histogram

	ckptSent      prometheus.Counter
	ckptDropped   prometheus.Counter
	ckptRefused   prometheus.Counter
	ckptFreed     prometheus.Counter
	ckptPasses    prometheus.Counter
	restoredPages prometheus.Counter
	resumeCached  prometheus.Counter
	// restoredReqs: resumed requests that imported at least one page.
	restoredReqs prometheus.Counter
	recomputed   prometheus.Counter

	// Progressive recovery: the phase, and each side of an assist.
	phase         *prometheus.GaugeVec
	specDrafts    prometheus.Counter
	specAccepted  prometheus.Counter
	specVerifies  prometheus.Counter
	specAccept    prometheus.Gauge
	specK         prometheus.Gauge
	assistStreams prometheus.Gauge
	drafted       prometheus.Counter
	draftSteps    prometheus.Counter
	assistSecs    prometheus.Counter
	phaseSeconds  *prometheus.GaugeVec

	// Live migration (migrate.go).
	migrationsOut   *prometheus.CounterVec // by outcome
	migrationsIn    *prometheus.CounterVec // by outcome
	migrationStages prometheus.Counter
	migrationHeld   prometheus.Counter
	migrationPages  *prometheus.CounterVec // by direction
	migrationStop   prometheus.Histogram
	migrationsLive  *prometheus.GaugeVec // by direction
	gpuHealthy      prometheus.Gauge
	gpuFaults       *prometheus.CounterVec // by kind
}

// newMetrics makes a worker's metrics. Those that mean what a vLLM metric
// means carry vLLM's name after lumen_worker_ (vllm:time_to_first_token_seconds
// is lumen_worker_time_to_first_token_seconds) and vLLM's model_name label
// (model, when not empty); deploy/prometheus/vllm-compat.rules.yml records
// them under vLLM's own names for dashboards built for vLLM.
func newMetrics(model string) *metrics {
	lat := prometheus.ExponentialBuckets(0.001, 2, 16)
	var vl prometheus.Labels
	if model != "" {
		vl = prometheus.Labels{"model_name": model}
	}
	m := &metrics{
		reg: prometheus.NewRegistry(),
		ttft: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_worker_time_to_first_token_seconds",
			Help: "Time from a request's arrival to its first output token.", Buckets: lat, ConstLabels: vl}),
		tpot: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_worker_inter_token_latency_seconds",
			Help: "Time between consecutive output tokens of a request (TPOT).", Buckets: lat, ConstLabels: vl}),
		queueDelay: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_worker_request_queue_time_seconds",
			Help: "Time from arrival to the first prefill chunk, waiting (the q_w samples).", Buckets: lat, ConstLabels: vl}),
		stepSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_worker_step_seconds",
			Help: "Wall time of one engine step, pacing included.", Buckets: lat}),
		batchRows: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_worker_batch_tokens",
			Help: "Tokens computed per engine step.", Buckets: prometheus.ExponentialBuckets(1, 2, 12)}),
		kvUsed:  prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_worker_kv_pages_used", Help: "KV cache pages in use."}),
		kvTotal: prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_worker_kv_pages_total", Help: "KV cache pages."}),
		running: prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_worker_num_requests_running", Help: "Requests in the running batch.", ConstLabels: vl}),
		waiting: prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_worker_num_requests_waiting", Help: "Requests waiting to start.", ConstLabels: vl}),
		preemptions: prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_num_preemptions_total",
			Help: "Requests preempted (cache dropped, recomputed later) when KV pages ran out.", ConstLabels: vl}),
		cacheQueries: prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_prefix_cache_queries_total",
			Help: "Prompt tokens looked up in the prefix cache (the history of each request admitted with an empty KV cache).", ConstLabels: vl}),
		cacheHits: prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_prefix_cache_hits_total",
			Help: "Of lumen_worker_prefix_cache_queries_total, the tokens the prefix cache held (not prefilled).", ConstLabels: vl}),
		kvUsage: prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_worker_kv_cache_usage_perc",
			Help: "KV cache in use, 0 to 1 (lumen_worker_kv_pages_used over lumen_worker_kv_pages_total).", ConstLabels: vl}),
		queueWait: prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_worker_queue_wait_seconds",
			Help: "q_w: the mean wait from arrival to prefill start over the sliding window, as the last load report carried it (what h(r) and placement read)."}),
		ckptBudget: prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_worker_checkpoint_budget_bytes",
			Help: "Host memory this worker offers for other workers' checkpoints (-checkpoint-budget)."}),
		completed: prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_requests_completed_total", Help: "Requests finished."}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_worker_requests_rejected_total",
			Help: "Generate calls refused, by gRPC code."}, []string{"code"}),
		rejoins: prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_rejoins_total",
			Help: "Times this process found its incarnation marked failed (it was paused or cut off) and registered a new one."}),
	}
	m.ckptSent = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_checkpoint_pages_sent_total",
		Help: "KV pages streamed to checkpoint holders."})
	m.ckptDropped = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_checkpoint_pages_lost_total",
		Help: "KV pages that could not be sent to their holder (holder unreachable)."})
	m.ckptRefused = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_checkpoint_pages_refused_total",
		Help: "Pages this holder refused: its budget or the request's reservation was full."})
	m.ckptFreed = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_checkpoint_requests_reclaimed_total",
		Help: "Requests whose checkpoint pages this holder freed because the placement table no longer names it (completed, moved, or never placed)."})
	m.ckptPasses = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_checkpoint_reconcile_passes_total",
		Help: "Passes of this holder over its checkpoint store against the placement table."})
	m.restoredPages = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_restored_pages_total",
		Help: "KV pages imported from the checkpoint store when a request resumed here."})
	m.resumeCached = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_resume_cached_pages_total",
		Help: "KV pages a request resumed here found in the prefix cache (reused like restored pages, and not imported)."})
	m.reg.MustRegister(m.resumeCached)
	m.restoredReqs = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_restored_requests_total",
		Help: "Resumed requests that imported pages from the checkpoint store here (at least one)."})
	m.recomputed = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_resume_recomputed_tokens_total",
		Help: "Tokens of resumed requests prefilled again (not covered by checkpoint pages)."})
	m.phase = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "lumen_worker_phase",
		Help: "1 for the phase this worker is in (FULL_SERVICE; LOADING_DRAFT, ASSIST, HOTSWAP while it recovers after a failure; DRAINING, LEFT), 0 for the others."},
		[]string{"phase"})
	m.phaseSeconds = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "lumen_worker_recovery_phase_seconds",
		Help: "How long this run's progressive recovery spent in each phase (set when the phase ends)."}, []string{"phase"})
	m.specDrafts = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_spec_draft_tokens_total",
		Help: "Draft tokens this worker verified for a drafter that assists it."})
	m.specAccepted = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_spec_accepted_tokens_total",
		Help: "Draft tokens this worker verified and committed (equal to its own next tokens)."})
	m.specVerifies = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_spec_verifications_total",
		Help: "Decode chunks that verified drafts (a request's K+1 positions in one fused step)."})
	m.specAccept = prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_worker_spec_acceptance",
		Help: "Estimated probability that a draft token is accepted given the one before it was (what adaptive K chooses by)."})
	m.specK = prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_worker_spec_k",
		Help: "Drafts per request the last step verified (0: none, or no drafter)."})
	m.assistStreams = prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_worker_assist_streams",
		Help: "Open Assist streams (a drafter assisting this worker): 0 or 1."})
	m.drafted = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_drafted_tokens_total",
		Help: "Draft tokens this worker's draft model proposed to its partner while it assisted (ASSIST)."})
	m.draftSteps = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_draft_steps_total",
		Help: "Draft-engine steps this worker ran while it assisted."})
	m.assistSecs = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_assist_seconds_total",
		Help: "Time this worker spent with an open Assist stream to a partner, as the drafter."})
	m.migrationsOut = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_worker_migrations_out_total",
		Help: "Live migrations of requests running here to another worker, by outcome (committed, aborted)."}, []string{"outcome"})
	m.migrationsIn = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_worker_migrations_in_total",
		Help: "Live migrations of requests to this worker, by outcome: adopted (the request's call took the pre-filled pages), aborted (the source gave up or a stage was refused), reclaimed (no stage or call within the migration timeout)."},
		[]string{"outcome"})
	m.migrationStages = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_migration_stages_total",
		Help: "Stages of migrations out taken here (each copies the pages filled since the last; the last one stops the request)."})
	m.migrationHeld = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_migration_held_tokens_total",
		Help: "Tokens computed here for requests migrating in after their last stage, before their call arrived (the held pre-step); the call's adoption delivers them at once."})
	m.migrationPages = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_worker_migration_pages_total",
		Help: "KV pages copied by live migration, by direction (out: sent from here; in: taken into pre-allocated sequences here)."}, []string{"direction"})
	m.migrationStop = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_worker_migration_stop_seconds",
		Help:    "Time a migrating request stood stopped here: from its last stage to the commit (or abort), the source's share of the downtime.",
		Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)})
	m.migrationsLive = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "lumen_worker_migrations",
		Help: "Live migrations under way, by direction (out: requests of this worker; in: pre-allocations here)."}, []string{"direction"})
	m.gpuHealthy = prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_worker_gpu_healthy",
		Help: "1 while no GPU fault (XID, ECC) was reported; 0 after one, while the worker drains itself."})
	m.gpuHealthy.Set(1)
	m.gpuFaults = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_worker_gpu_faults_total",
		Help: "GPU faults reported by the health watch, by kind (xid, ecc-double-bit, ecc-single-bit)."}, []string{"kind"})
	for _, o := range []string{"committed", "aborted"} {
		m.migrationsOut.WithLabelValues(o)
	}
	for _, o := range []string{"adopted", "aborted", "reclaimed"} {
		m.migrationsIn.WithLabelValues(o)
	}
	for _, d := range []string{"out", "in"} {
		m.migrationPages.WithLabelValues(d)
		m.migrationsLive.WithLabelValues(d)
	}
	m.reg.MustRegister(m.migrationsOut, m.migrationsIn, m.migrationStages, m.migrationHeld, m.migrationPages, m.migrationStop, m.migrationsLive,
		m.gpuHealthy, m.gpuFaults)
	m.reg.MustRegister(m.phase, m.phaseSeconds, m.specDrafts, m.specAccepted, m.specVerifies, m.specAccept, m.specK,
		m.assistStreams, m.drafted, m.draftSteps, m.assistSecs)
	m.reg.MustRegister(m.ckptSent, m.ckptDropped, m.ckptRefused, m.ckptFreed, m.ckptPasses, m.restoredPages, m.restoredReqs, m.recomputed)
	m.loadReports = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_worker_load_reports_total",
		Help: "Load reports committed, by why they were sent (worker/loadreport: first, queue, queue_wait, kv_pages, checkpoint, heartbeat; " +
			"marked_failed when the event watch saw this incarnation marked failed): each one is a Raft entry."}, []string{"reason"})
	m.reg.MustRegister(m.loadReports)
	m.stepOutOfPages = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_step_out_of_pages_total",
		Help: "Engine steps refused for want of KV pages the scheduler had counted as free (a request is preempted and the step rebuilt; " +
			"0 while the scheduler's page accounting matches the engine's)."})
	m.reg.MustRegister(m.stepOutOfPages)
	m.stepGap = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_worker_step_gap_seconds_total",
		Help: "The host's time between one engine step's end and the next one's start while requests were running or waiting " +
			"(committing and streaming the tokens, the checkpoint pages, the next batch's scheduling; KV imports not counted): " +
			"time the GPU waits for the host. Set against lumen_worker_paced_seconds_total or the step histogram's sum."})
	m.reg.MustRegister(m.stepGap)
	m.preemptionLoss = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_worker_preemption_loss_seconds",
		Help: "Per preemption (the request's KV cache dropped, recomputed later), the time until its cache holds again what it held: " +
			"the wait for its re-prefill plus the recompute (Llumnix's preemption loss).",
		Buckets: prometheus.ExponentialBuckets(0.01, 2, 16)})
	m.reg.MustRegister(m.preemptionLoss)
	m.reg.MustRegister(m.ttft, m.tpot, m.queueDelay, m.stepSeconds, m.batchRows, m.kvUsed, m.kvTotal,
		m.running, m.waiting, m.preemptions, m.cacheQueries, m.cacheHits, m.completed, m.rejected, m.rejoins, m.kvUsage, m.queueWait, m.ckptBudget,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// pacedStats is what a paced engine (engine.Paced) reports of its steps.
type pacedStats interface{ Stats() engine.StepStats }

// watchPacing exports how far a paced engine's steps ran over the times its
// profile asked for: on a busy machine emulated timings are only as good as
// this ratio.
func (m *metrics) watchPacing(e engine.Engine) {
	p, ok := e.(pacedStats)
	if !ok {
		return
	}
	m.reg.MustRegister(
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "lumen_worker_emulated_seconds_total",
			Help: "Engine time the timing profile asked for (steps and KV imports)."},
			func() float64 { return p.Stats().Emulated.Seconds() }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "lumen_worker_paced_seconds_total",
			Help: "Engine time those calls really took; above lumen_worker_emulated_seconds_total when the machine cannot keep up."},
			func() float64 { return p.Stats().Actual.Seconds() }))
}

// watchStore exports what a holder's checkpoint store holds, read at each
// scrape (the same figure the load report carries as
// stored_checkpoint_bytes).
func (m *metrics) watchStore(st *ckptStore) {
	m.reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "lumen_worker_checkpoint_bytes",
			Help: "Bytes of other workers' checkpoint pages stored here (compare with the bytes the controller reserved here)."},
			func() float64 { used, _, _ := st.usage(); return float64(used) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "lumen_worker_checkpoint_requests",
			Help: "Requests this holder stores checkpoint pages of."},
			func() float64 { _, _, n := st.usage(); return float64(n) }))
}

// setPhase shows phase as the worker's current phase.
func (m *metrics) setPhase(phase pb.WorkerPhase) {
	for _, p := range []pb.WorkerPhase{pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT, pb.WorkerPhase_WORKER_PHASE_ASSIST,
		pb.WorkerPhase_WORKER_PHASE_HOTSWAP, pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, pb.WorkerPhase_WORKER_PHASE_DRAINING,
		pb.WorkerPhase_WORKER_PHASE_LEFT} {
		v := 0.0
		if p == phase {
			v = 1
		}
		m.phase.WithLabelValues(phaseName(p)).Set(v)
	}
}

// phaseName is a phase without its enum prefix: ASSIST, FULL_SERVICE.
func phaseName(p pb.WorkerPhase) string { return strings.TrimPrefix(p.String(), "WORKER_PHASE_") }

// countMigrations adds an Output's live-migration counters.
func (m *metrics) countMigrations(o core.Output) {
	if o.MigrationStages > 0 {
		m.migrationStages.Add(float64(o.MigrationStages))
	}
	if o.MigrationPagesOut > 0 {
		m.migrationPages.WithLabelValues("out").Add(float64(o.MigrationPagesOut))
	}
	if o.HeldTokens > 0 {
		m.migrationHeld.Add(float64(o.HeldTokens))
	}
	if o.MigrationPagesIn > 0 {
		m.migrationPages.WithLabelValues("in").Add(float64(o.MigrationPagesIn))
	}
	if o.MigratedIn > 0 {
		m.migrationsIn.WithLabelValues("adopted").Add(float64(o.MigratedIn))
	}
	if o.MigrationsReclaimed > 0 {
		m.migrationsIn.WithLabelValues("reclaimed").Add(float64(o.MigrationsReclaimed))
	}
}
