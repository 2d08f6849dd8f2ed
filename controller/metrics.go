package controller

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// metrics are a replica's Prometheus metrics, in a registry of its own so
// several replicas can run in one process (tests).
type metrics struct {
	reg        *prometheus.Registry
	raftState  prometheus.Gauge
	applied    prometheus.Gauge
	commit     prometheus.Gauge
	elections  prometheus.Counter
	batchSize  prometheus.Histogram
	commitTime prometheus.Histogram
	readRound  prometheus.Histogram
	forwarded  *prometheus.CounterVec
	panics     prometheus.Counter
	applyTime  *prometheus.HistogramVec
	migrations *prometheus.CounterVec

	placeStreams     prometheus.Gauge
	placeBatches     prometheus.Counter
	placeDispatches  *prometheus.CounterVec
	placeCompletes   prometheus.Counter
	placeBatchTime   prometheus.Histogram
	watchLoadStreams prometheus.Gauge
	watchLoadTables  prometheus.Counter
	getPlacementsIDs prometheus.Histogram
}

func newMetrics() *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		raftState: prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_controller_raft_state",
			Help: "Raft state of this replica: 0 follower, 1 candidate, 2 leader, 3 shutdown."}),
		applied: prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_controller_applied_index",
			Help: "Last log index applied to the FSM."}),
		commit: prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_controller_commit_index",
			Help: "Raft commit index known to this replica."}),
		elections: prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_controller_leadership_gained_total",
			Help: "Times this replica became leader."}),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_controller_batch_commands",
			Help: "Commands coalesced into one log entry.", Buckets: prometheus.ExponentialBuckets(1, 2, 12)}),
		commitTime: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_controller_commit_seconds",
			Help: "Time from proposing a log entry to its application on the leader.", Buckets: prometheus.ExponentialBuckets(0.0002, 2, 14)}),
		readRound: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_controller_read_round_reads",
			Help: "Linearizable reads served by one VerifyLeader round.", Buckets: prometheus.ExponentialBuckets(1, 2, 12)}),
		forwarded: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_controller_forwarded_total",
			Help: "Calls forwarded to the leader, by method."}, []string{"method"}),
		panics: prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_controller_handler_panics_total",
			Help: "gRPC handler panics turned into Internal errors by the recovery interceptor (each one is a bug)."}),
		applyTime: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "lumen_controller_fsm_apply_seconds",
			Help: "Time to apply one command to the FSM, under its lock (readers wait meanwhile), by command type; " +
				"mark_failed, set_phase and register_worker include recovery planning.",
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 11)}, []string{"command"}),
	}
	m.migrations = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_controller_migrations_total",
		Help: "Live migrations started, committed and aborted, by cause (fsm.MigrationCause: started balance/drain/operator; " +
			"aborted timeout/destination/source_failed/finished/worker), counted from the applied log: every replica counts every one."},
		[]string{"stage", "cause"})
	m.placeStreams = prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_controller_place_streams",
		Help: "Place streams this replica serves (gateways' placement streams; the leader only)."})
	m.placeBatches = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_controller_place_batches_total",
		Help: "PlaceBatches received and proposed."})
	m.placeDispatches = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_controller_place_dispatches_total",
		Help: "Dispatches answered on Place streams, by outcome: placed, or the refusal's ErrorInfo reason (WORKER_UNAVAILABLE, …) or gRPC code."},
		[]string{"outcome"})
	m.placeCompletes = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_controller_place_completes_total",
		Help: "Placements completed by Place streams."})
	m.placeBatchTime = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_controller_place_batch_seconds",
		Help: "Time from receiving a PlaceBatch to sending its answer (commit included).", Buckets: prometheus.ExponentialBuckets(0.0002, 2, 14)})
	m.watchLoadStreams = prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_controller_watch_load_streams",
		Help: "WatchLoad streams this replica serves."})
	m.watchLoadTables = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_controller_watch_load_tables_total",
		Help: "Load tables sent on WatchLoad streams."})
	m.getPlacementsIDs = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "lumen_controller_get_placements_ids",
		Help: "Request ids per GetPlacements call.", Buckets: prometheus.ExponentialBuckets(1, 2, 13)})
	m.reg.MustRegister(m.placeStreams, m.placeBatches, m.placeDispatches, m.placeCompletes, m.placeBatchTime,
		m.watchLoadStreams, m.watchLoadTables, m.getPlacementsIDs)
	m.reg.MustRegister(m.raftState, m.applied, m.commit, m.elections, m.batchSize, m.commitTime, m.readRound, m.forwarded, m.panics, m.applyTime, m.migrations,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// observeApply records one command's apply time (fsm.ObserveApply).
func (m *metrics) observeApply(command string, d time.Duration) {
	m.applyTime.WithLabelValues(command).Observe(d.Seconds())
}
