package controller

import (
	"path/filepath"
	"testing"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// TestCountingStore: each durable write of raft.db counts one fsync'd
// commit whatever the entries in it, and the entries and their bytes are
// counted apart.
func TestCountingStore(t *testing.T) {
	bs, err := raftboltdb.New(raftboltdb.Options{Path: filepath.Join(t.TempDir(), "raft.db")})
	if err != nil {
		t.Fatal(err)
	}
	defer bs.Close()
	m := newMetrics()
	s := newCountingStore(bs, m)
	var _ raft.LogStore = s
	var _ raft.StableStore = s
	logs := []*raft.Log{{Index: 1, Term: 1, Type: raft.LogCommand, Data: []byte("abc")},
		{Index: 2, Term: 1, Type: raft.LogCommand, Data: []byte("de")},
		{Index: 3, Term: 1, Type: raft.LogCommand, Data: []byte("f")}}
	if err := s.StoreLogs(logs); err != nil {
		t.Fatal(err)
	}
	if err := s.StoreLog(&raft.Log{Index: 4, Term: 1, Type: raft.LogCommand, Data: []byte("ghij")}); err != nil {
		t.Fatal(err)
	}
	if err := s.SetUint64([]byte("CurrentTerm"), 2); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteRange(1, 2); err != nil {
		t.Fatal(err)
	}
	for op, want := range map[string]float64{"logs": 2, "stable": 1, "delete": 1} {
		if got := counterValue(t, m.raftFsyncs.WithLabelValues(op)); got != want {
			t.Errorf("fsyncs{op=%q} = %v, want %v", op, got, want)
		}
	}
	if got := counterValue(t, m.raftLogEntries); got != 4 {
		t.Errorf("entries = %v, want 4", got)
	}
	if got := counterValue(t, m.raftLogBytes); got != 10 {
		t.Errorf("bytes = %v, want 10", got)
	}
	var l raft.Log
	if err := s.GetLog(4, &l); err != nil || string(l.Data) != "ghij" {
		t.Fatalf("GetLog(4) = %q, %v", l.Data, err)
	}
	// A failed write counts nothing.
	if err := bs.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.StoreLogs(logs[:1]); err == nil {
		t.Fatal("StoreLogs on a closed store succeeded")
	}
	if got := counterValue(t, m.raftFsyncs.WithLabelValues("logs")); got != 2 {
		t.Errorf("after a failed write fsyncs{op=logs} = %v, want 2", got)
	}
}

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}
