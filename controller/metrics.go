package controller

import (
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/lumen-project/lumen/fsm"
	"github.com/lumen-project/lumen/policy"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
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
	term       prometheus.Gauge
	// Recovery plans committed (one per MarkFailed that found requests or
	// not), and their requests by mode, from the applied log.
	recoveryPlans    prometheus.Counter
	recoveryRequests *prometheus.CounterVec

	placeStreams     prometheus.Gauge
	placeBatches     prometheus.Counter
	placeDispatches  *prometheus.CounterVec
	placeCompletes   prometheus.Counter
	placeBatchTime   prometheus.Histogram
	watchLoadStreams prometheus.Gauge
	watchLoadTables  prometheus.Counter
	getPlacementsIDs prometheus.Histogram

	// raft.db's durable writes (raftstore.go) and the commands this
	// replica proposed as leader, by type (proposer.go).
	raftFsyncs       *prometheus.CounterVec
	raftLogEntries   prometheus.Counter
	raftLogBytes     prometheus.Counter
	proposedCommands *prometheus.CounterVec
	proposedBytes    *prometheus.CounterVec
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
	m.term = prometheus.NewGauge(prometheus.GaugeOpts{Name: "lumen_controller_raft_term",
		Help: "Raft term this replica is in (a rise is an election)."})
	m.recoveryPlans = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_controller_recovery_plans_total",
		Help: "Recovery plans committed (one per worker failure), counted from the applied log: every replica counts every one."})
	m.recoveryRequests = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_controller_recovery_requests_total",
		Help: "Requests the recovery plans assigned to a new worker, by mode (REUSE: from checkpoint pages; RECOMPUTE: prefilled again)."},
		[]string{"mode"})
	for _, mode := range []string{"REUSE", "RECOMPUTE"} {
		m.recoveryRequests.WithLabelValues(mode)
	}
	m.reg.MustRegister(m.term, m.recoveryPlans, m.recoveryRequests)
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
	m.raftFsyncs = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_controller_raft_fsyncs_total",
		Help: "Durable writes of raft.db, each one bbolt commit (two fdatasyncs), by op: logs (a batch of log entries), delete (compaction), stable (term, vote)."},
		[]string{"op"})
	for _, op := range []string{"logs", "delete", "stable"} {
		m.raftFsyncs.WithLabelValues(op)
	}
	m.raftLogEntries = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_controller_raft_log_entries_total",
		Help: "Raft log entries written to raft.db by this replica."})
	m.raftLogBytes = prometheus.NewCounter(prometheus.CounterOpts{Name: "lumen_controller_raft_log_bytes_total",
		Help: "Bytes of the Raft log entries' data written to raft.db by this replica."})
	m.proposedCommands = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_controller_proposed_commands_total",
		Help: "Commands this replica proposed as leader, by command type (fsm.CommandType)."}, []string{"command"})
	m.proposedBytes = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_controller_proposed_bytes_total",
		Help: "Encoded bytes of the commands this replica proposed as leader, by command type."}, []string{"command"})
	m.reg.MustRegister(m.raftFsyncs, m.raftLogEntries, m.raftLogBytes, m.proposedCommands, m.proposedBytes)
	m.reg.MustRegister(m.raftState, m.applied, m.commit, m.elections, m.batchSize, m.commitTime, m.readRound, m.forwarded, m.panics, m.applyTime, m.migrations,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// observeApply records one command's apply time (fsm.ObserveApply).
func (m *metrics) observeApply(command string, d time.Duration) {
	m.applyTime.WithLabelValues(command).Observe(d.Seconds())
}

// workerTable exports, per worker of the replicated table, what the
// controllers decide with: the checkpoint budget and the bytes reserved on
// it, and q_w as the last load report carried it. Read at each scrape.
type workerTable struct {
	f                           *fsm.FSM
	budget, reserved, queueWait *prometheus.Desc
	sameDomain, shortReplicas   *prometheus.Desc
	replicas                    *prometheus.Desc
	// The autoscaling signal (Llumnix's): each worker's freeness and the
	// mean over the workers in full service, with their number.
	freeness, freenessMean, freenessWorkers *prometheus.Desc
}

func newWorkerTable(f *fsm.FSM) *workerTable {
	return &workerTable{f: f,
		budget: prometheus.NewDesc("lumen_controller_worker_checkpoint_budget_bytes",
			"A worker's host memory for other workers' checkpoints, as registered.", []string{"worker"}, nil),
		reserved: prometheus.NewDesc("lumen_controller_worker_checkpoint_reserved_bytes",
			"Checkpoint bytes the placements reserve on a worker (its budget less these is what h(r) can still place there).", []string{"worker"}, nil),
		queueWait: prometheus.NewDesc("lumen_controller_worker_queue_wait_seconds",
			"q_w of a worker: the mean wait from arrival to prefill start over its window, as its last load report carried it.", []string{"worker"}, nil),
		sameDomain: prometheus.NewDesc("lumen_controller_checkpoint_same_domain_total",
			"Placements whose checkpoint went to a worker of the serving worker's own node: no worker outside it had budget for the footprint (issue 24; counted over this replica's applies since it started or restored a snapshot).", nil, nil),
		shortReplicas: prometheus.NewDesc("lumen_controller_checkpoint_replicas_short_total",
			"Placements that got fewer checkpoint copies than the cluster's replication factor, for want of budget in distinct nodes.", nil, nil),
		replicas: prometheus.NewDesc("lumen_controller_checkpoint_replicas",
			"The strategy's replication factor: the checkpoint copies each new placement asks for (SetStrategy's checkpoint_replicas, 1 by default).", nil, nil),
		freeness: prometheus.NewDesc("lumen_controller_worker_freeness",
			"A worker's freeness (policy.Worker.Freeness, Llumnix's): its free KV pages less its queue head's and those dispatched since its last load report, per request it has to serve.", []string{"worker"}, nil),
		freenessMean: prometheus.NewDesc("lumen_cluster_freeness_mean",
			"The mean freeness of the workers in full service (lumen_cluster_freeness_workers of them), as this replica's table has it: Llumnix's autoscaling signal, which scales out below 10 and in above 60 (deploy/k8s/overlays/autoscale). Absent while no worker is in full service.", nil, nil),
		freenessWorkers: prometheus.NewDesc("lumen_cluster_freeness_workers",
			"The workers in full service that lumen_cluster_freeness_mean averages over.", nil, nil)}
}

func (t *workerTable) Describe(ch chan<- *prometheus.Desc) {
	ch <- t.budget
	ch <- t.reserved
	ch <- t.queueWait
	ch <- t.sameDomain
	ch <- t.shortReplicas
	ch <- t.replicas
	ch <- t.freeness
	ch <- t.freenessMean
	ch <- t.freenessWorkers
}

func (t *workerTable) Collect(ch chan<- prometheus.Metric) {
	tab := t.f.Workers()
	for _, r := range tab.Reservations {
		ch <- prometheus.MustNewConstMetric(t.budget, prometheus.GaugeValue, float64(r.BudgetBytes), r.WorkerId)
		ch <- prometheus.MustNewConstMetric(t.reserved, prometheus.GaugeValue, float64(r.ReservedBytes), r.WorkerId)
	}
	for _, l := range tab.Loads {
		ch <- prometheus.MustNewConstMetric(t.queueWait, prometheus.GaugeValue, l.QueueWaitMs/1000, l.WorkerId)
	}
	same, short := t.f.DomainCounts()
	ch <- prometheus.MustNewConstMetric(t.sameDomain, prometheus.CounterValue, float64(same))
	ch <- prometheus.MustNewConstMetric(t.shortReplicas, prometheus.CounterValue, float64(short))
	ch <- prometheus.MustNewConstMetric(t.replicas, prometheus.GaugeValue, float64(t.f.CheckpointReplicas()))
	views, _ := t.f.LoadViews()
	mean, n := meanFreeness(views)
	for i := range views {
		if views[i].Eligible {
			ch <- prometheus.MustNewConstMetric(t.freeness, prometheus.GaugeValue, views[i].Freeness(), views[i].ID)
		}
	}
	ch <- prometheus.MustNewConstMetric(t.freenessWorkers, prometheus.GaugeValue, float64(n))
	if n > 0 {
		ch <- prometheus.MustNewConstMetric(t.freenessMean, prometheus.GaugeValue, mean)
	}
}

// meanFreeness is the mean freeness of the workers in full service
// (Eligible: those dispatch may choose), and their number. A draining or
// loading worker is left out: it takes no new request, so its free pages
// are no room the cluster can use; a worker being scaled down counts as
// gone from the moment its drain starts.
func meanFreeness(ws []policy.Worker) (float64, int) {
	sum, n := 0.0, 0
	for i := range ws {
		if ws[i].Eligible {
			sum += ws[i].Freeness()
			n++
		}
	}
	if n == 0 {
		return 0, 0
	}
	return sum / float64(n), n
}

// countRecovery counts a committed recovery plan and its requests by mode.
func (m *metrics) countRecovery(rp *pb.RecoveryPlan) {
	m.recoveryPlans.Inc()
	for _, a := range rp.Assignments {
		m.recoveryRequests.WithLabelValues(strings.TrimPrefix(a.Mode.String(), "RECOVERY_MODE_")).Inc()
	}
}
