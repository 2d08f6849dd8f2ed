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
	m.reg.MustRegister(m.raftState, m.applied, m.commit, m.elections, m.batchSize, m.commitTime, m.readRound, m.forwarded, m.panics, m.applyTime, m.migrations,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// observeApply records one command's apply time (fsm.ObserveApply).
func (m *metrics) observeApply(command string, d time.Duration) {
	m.applyTime.WithLabelValues(command).Observe(d.Seconds())
}
