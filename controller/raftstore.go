package controller

import (
	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// countingStore is raft.db (raft-boltdb on bbolt) counting its durable
// writes: every StoreLog(s), DeleteRange, Set and SetUint64 is one bbolt
// read-write transaction, whose commit fdatasyncs the file (twice: the
// data pages, then the meta page). hashicorp/raft hands the log store
// whole batches of entries (up to MaxAppendEntries a call, on the leader
// and on each follower), so the store's commits, not the entries, are
// the fsyncs a write costs (issue 26's write budget in fsyncs).
type countingStore struct {
	*raftboltdb.BoltStore
	fsyncs  *prometheus.CounterVec // by op: logs, delete, stable
	entries prometheus.Counter
	bytes   prometheus.Counter
	logs    prometheus.Counter // lumen_controller_raft_fsyncs_total{op="logs"}
}

func newCountingStore(s *raftboltdb.BoltStore, m *metrics) *countingStore {
	return &countingStore{BoltStore: s, fsyncs: m.raftFsyncs, entries: m.raftLogEntries, bytes: m.raftLogBytes,
		logs: m.raftFsyncs.WithLabelValues("logs")}
}

// StoreLog stores one entry in one commit.
func (c *countingStore) StoreLog(l *raft.Log) error {
	return c.StoreLogs([]*raft.Log{l})
}

// StoreLogs stores a batch of entries in one commit.
func (c *countingStore) StoreLogs(ls []*raft.Log) error {
	if err := c.BoltStore.StoreLogs(ls); err != nil {
		return err
	}
	c.logs.Inc()
	c.entries.Add(float64(len(ls)))
	n := 0
	for _, l := range ls {
		n += len(l.Data)
	}
	c.bytes.Add(float64(n))
	return nil
}

// DeleteRange drops compacted entries in one commit.
func (c *countingStore) DeleteRange(lo, hi uint64) error {
	if err := c.BoltStore.DeleteRange(lo, hi); err != nil {
		return err
	}
	c.fsyncs.WithLabelValues("delete").Inc()
	return nil
}

// Set writes one stable-store key (the term, the vote) in one commit.
func (c *countingStore) Set(k, v []byte) error {
	if err := c.BoltStore.Set(k, v); err != nil {
		return err
	}
	c.fsyncs.WithLabelValues("stable").Inc()
	return nil
}

// SetUint64 is Set of an integer.
func (c *countingStore) SetUint64(k []byte, v uint64) error {
	if err := c.BoltStore.SetUint64(k, v); err != nil {
		return err
	}
	c.fsyncs.WithLabelValues("stable").Inc()
	return nil
}
