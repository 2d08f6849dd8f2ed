package gateway

import (
	"net/http"
	"sync/atomic"
	"time"

	"github.com/lumen-project/lumen/internal/placer"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

type metrics struct {
	reg      *prometheus.Registry
	requests *prometheus.CounterVec
	ttft     prometheus.Histogram
	e2e      prometheus.Histogram
	resumes  *prometheus.CounterVec
	// regenerated: output tokens a stop-and-restart resume decoded again
	// and the gateway suppressed, by whether they matched the journal.
	regenerated *prometheus.CounterVec
	inflight    prometheus.Gauge
	tokens      prometheus.Counter
	// migrationDowntime: the last token before a live migration's switch
	// to the first after it.
	migrationDowntime prometheus.Histogram
	// The request path off consensus (issue 16): how each request was
	// placed (replica: on the worker the gateway chose, at once;
	// controller: waiting for the commit), why the replica could not
	// choose (fallbacks), the fast path's commit latency, its refusals,
	// and the SetHolder calls that follow a commit.
	placements *prometheus.CounterVec
	fallbacks  *prometheus.CounterVec
	commit     prometheus.Histogram
	refusals   *prometheus.CounterVec
	setHolder  *prometheus.CounterVec
	// own: the gateway's own added latency, by phase (issue 26):
	// accept_to_generate (the handler's start to the worker's Generate
	// call, placed from the replica), accept_to_generate_via_controller
	// (the same, placed by a commit the request waited for) and
	// token_to_write (a token's arrival from the worker to its bytes
	// written to the client).
	own *prometheus.HistogramVec
}

// newMetrics makes the gateway's metrics. The end-to-end latency means
// vLLM's e2e_request_latency_seconds: its name after lumen_gateway_ and
// vLLM's model_name label (the model clients ask for).
func newMetrics(model string) *metrics {
	lat := prometheus.ExponentialBuckets(0.001, 2, 18)
	var vl prometheus.Labels
	if model != "" {
		vl = prometheus.Labels{"model_name": model}
	}
	m := &metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_gateway_requests_total",
			Help: "Requests by endpoint and HTTP status."}, []string{"endpoint", "code"}),
		ttft: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_gateway_time_to_first_token_seconds",
			Help: "Time from a request's arrival to its first token, through the gateway (resumes included: the client's view; vllm:time_to_first_token_seconds is the worker's).", Buckets: lat}),
		e2e: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_gateway_e2e_request_latency_seconds",
			Help: "Time from arrival to the last token.", Buckets: lat, ConstLabels: vl}),
		resumes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_gateway_resumes_total",
			Help: "Broken worker streams resumed, by how: moved (the placement moved), migrated (a live migration committed), retry (same worker), redispatch (before the first token), prefix (with -prefix-routing on: a recovery that recomputes the request placed it where the longest part of its history is cached instead of at the plan's target; counted in moved too)."}, []string{"how"}),
		regenerated: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_gateway_regenerated_tokens_total",
			Help: "Output tokens a stop-and-restart resume decoded again, checked against the journal and not sent to the client, by result: matched, or mismatched (decoding was not deterministic; the request continued from the journal, and the client saw no repeat or gap)."}, []string{"result"}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_gateway_inflight", Help: "Requests in flight."}),
		tokens:   prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_gateway_tokens_total", Help: "Output tokens delivered."}),
		migrationDowntime: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_gateway_migration_downtime_seconds",
			Help:    "A live migration's downtime as the client sees it: from the last token the source streamed to the first the destination did.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18)}),
	}
	m.placements = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_gateway_placements_total",
		Help: "Placements by path: replica (the gateway chose the worker and started the request before the commit), controller (the request waited for the commit)."}, []string{"path"})
	m.fallbacks = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_gateway_placement_fallbacks_total",
		Help: "New placements that waited for the controller's choice, by why: no_table (no load table yet), no_worker (no eligible worker in it)."}, []string{"why"})
	m.commit = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_gateway_placement_commit_seconds",
		Help: "A request started before its commit: from its Dispatch to the commit's answer (the request streams meanwhile).", Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18)})
	m.refusals = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_gateway_placement_refusals_total",
		Help: "Dispatches of requests already started that did not commit, by reason: worker_unavailable (the chosen worker failed or left: placed again elsewhere), other (placed again by the controller), unconfirmed (no answer in time: the request runs on unplaced)."}, []string{"reason"})
	m.setHolder = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_gateway_set_holder_total",
		Help: "SetHolder calls after a commit, by result: applied, not_applied (the request ended or moved first), failed."}, []string{"result"})
	m.own = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "lumen_gateway_own_seconds",
		Help:    "The gateway's own added latency, by phase: accept_to_generate (request accepted to the worker's Generate call, placed from the gateway's replica of the load table), accept_to_generate_via_controller (the same, waiting for the controller's commit), token_to_write (a token received from the worker to its bytes written to the client).",
		Buckets: prometheus.ExponentialBuckets(0.00001, 2, 20)}, []string{"phase"})
	for _, p := range []string{"accept_to_generate", "accept_to_generate_via_controller", "token_to_write"} {
		m.own.WithLabelValues(p)
	}
	m.reg.MustRegister(m.own)
	// Every label value exists from the start, at 0: a scrape (or a
	// rate()) sees a counter that was never incremented.
	for _, v := range []struct {
		c      *prometheus.CounterVec
		labels []string
	}{{m.placements, []string{"replica", "controller"}}, {m.fallbacks, []string{"no_table", "no_worker"}},
		{m.refusals, []string{"worker_unavailable", "other", "unconfirmed"}}, {m.setHolder, []string{"applied", "not_applied", "failed"}},
		{m.regenerated, []string{"matched", "mismatched"}}} {
		for _, l := range v.labels {
			v.c.WithLabelValues(l)
		}
	}
	m.reg.MustRegister(m.placements, m.fallbacks, m.commit, m.refusals, m.setHolder, m.regenerated)
	m.reg.MustRegister(m.requests, m.ttft, m.e2e, m.resumes, m.inflight, m.tokens, m.migrationDowntime,
		// The scheduler's metrics too: go_sched_latencies_seconds, the
		// time goroutines wait runnable for a CPU, is what a request's
		// own time holds beyond its work when the cores are busy.
		collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(collectors.MetricsScheduler)), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// watchReplica exports the replica's lag: the applied index of the table it
// holds, and how long ago a table last arrived (tables come on change, at
// most one per interval: a quiet cluster sends none).
func (m *metrics) watchReplica(r *placer.Replica, tableAt *atomic.Int64) {
	m.reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "lumen_gateway_replica_applied_index",
			Help: "The controller log index the gateway's load table reflects."}, func() float64 {
			i, _ := r.Applied()
			return float64(i)
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "lumen_gateway_replica_table_age_seconds",
			Help: "Seconds since the gateway's load table last changed (-1: none yet)."}, func() float64 {
			at := tableAt.Load()
			if at == 0 {
				return -1
			}
			return time.Since(time.Unix(0, at)).Seconds()
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "lumen_gateway_replica_pending",
			Help: "This gateway's placements the load table does not count yet."}, func() float64 { return float64(r.Pending()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "lumen_gateway_share_index",
			Help: "This gateway's share of the workers: its index g among the gateways the load table lists (0..G-1)."}, func() float64 {
			g, _ := r.Share()
			return float64(g)
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "lumen_gateway_share_gateways",
			Help: "How many gateways share the workers, G, as the load table lists them (1: this gateway chooses alone, PickServing)."}, func() float64 {
			_, G := r.Share()
			return float64(G)
		}))
}

func (m *metrics) handler() http.Handler { return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}) }
