package gateway

import (
	"net/http"

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
	inflight prometheus.Gauge
	tokens   prometheus.Counter
	// migrationDowntime: the last token before a live migration's switch
	// to the first after it.
	migrationDowntime prometheus.Histogram
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
			Help: "Broken worker streams resumed, by how: moved (the placement moved), migrated (a live migration committed), retry (same worker), redispatch (before the first token)."}, []string{"how"}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_gateway_inflight", Help: "Requests in flight."}),
		tokens:   prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_gateway_tokens_total", Help: "Output tokens delivered."}),
		migrationDowntime: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_gateway_migration_downtime_seconds",
			Help:    "A live migration's downtime as the client sees it: from the last token the source streamed to the first the destination did.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18)}),
	}
	m.reg.MustRegister(m.requests, m.ttft, m.e2e, m.resumes, m.inflight, m.tokens, m.migrationDowntime,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

func (m *metrics) handler() http.Handler { return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}) }
