package jepsen

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/lumen-project/lumen/internal/devcluster"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// The node-kill nemesis (issue 24): a run that has it puts its workers on
// hosts, two a host in order (devcluster.DevNode: worker-1 and worker-2 on
// node-1, …; 3 workers make node-1 of two and node-2 of one), each started
// with -node, so no request's checkpoint is on its serving worker's node;
// the fault kills every worker process of one node at once with SIGKILL, as
// a kernel panic or a power supply takes the GPUs of a host together.

// nodeKillNodes is the hosts the workers of a node-kill run are on: two
// workers a host.
func nodeKillNodes(workers int) int { return (workers + 1) / 2 }

// workerNode is worker i's (1-based) -node in this run ("" without
// node-kill: every worker a domain of its own, as before).
func (e *env) workerNode(i int) string {
	if !e.hasNemesis("node-kill") {
		return ""
	}
	return devcluster.DevNode(i, e.cfg.Workers, nodeKillNodes(e.cfg.Workers))
}

// NodeKill is one node-kill: the node, when, and the incarnations it
// killed (those the worker table showed alive just before; a worker
// restarted so recently that its new incarnation had not registered is
// killed too but not listed: nothing of it was in the table to fail).
type NodeKill struct {
	Node    string
	At      int64
	Workers []string
	Incs    []uint64
}

// nodeKill kills every worker of a random node (seeded) at once.
func (e *env) nodeKill(ctx context.Context) (string, error) {
	nodes := map[string][]*devcluster.Worker{}
	for i, w := range e.cl.Workers {
		if n := e.workerNode(i + 1); n != "" {
			nodes[n] = append(nodes[n], w)
		}
	}
	if len(nodes) < 2 {
		return "", fmt.Errorf("node-kill needs workers on 2 nodes or more, %d workers make %d", len(e.cl.Workers), len(nodes))
	}
	names := make([]string, 0, len(nodes))
	for n := range nodes {
		names = append(names, n)
	}
	sort.Strings(names)
	node := names[e.rng.Intn(len(names))]
	alive := map[string]uint64{}
	qctx, cancel := context.WithTimeout(ctx, time.Second)
	r, err := e.client.ListWorkers(qctx, &pb.ListWorkersRequest{Consistency: pb.Consistency_CONSISTENCY_STALE})
	cancel()
	if err == nil {
		for _, w := range r.Workers {
			if w.Phase != pb.WorkerPhase_WORKER_PHASE_FAILED && w.Phase != pb.WorkerPhase_WORKER_PHASE_LEFT {
				alive[w.Id] = w.Incarnation
			}
		}
	}
	k := NodeKill{Node: node, At: e.hist.Now()}
	var ids []string
	for _, w := range nodes[node] {
		e.killWorker(w)
		ids = append(ids, w.ID)
		if inc, ok := alive[w.ID]; ok {
			k.Workers, k.Incs = append(k.Workers, w.ID), append(k.Incs, inc)
		}
	}
	e.mu.Lock()
	e.nodeKills = append(e.nodeKills, k)
	e.mu.Unlock()
	return fmt.Sprintf("kill -9 node %s: %s", node, strings.Join(ids, " ")), nil
}

// CheckNodeKills: every incarnation a node-kill killed is marked FAILED in
// the event log (by its detection, or by its restart's registration): a
// node's workers failing together must not leave one of them taken for
// alive, with its requests stuck on it. The streams' outputs are the
// serving checker's (equal to the reference across every kill).
func CheckNodeKills(kills []NodeKill, failures []Failure) Verdict {
	v := Verdict{Checker: "node-kill", OK: true}
	failed := map[string][]uint64{}
	for _, f := range failures {
		failed[f.Worker] = append(failed[f.Worker], f.Inc)
	}
	n := 0
	for _, k := range kills {
		for i, w := range k.Workers {
			n++
			if !slices.Contains(failed[w], k.Incs[i]) {
				v.fail("node %s killed at %s: %s incarnation %d never marked FAILED", k.Node, fmtNanos(k.At), w, k.Incs[i])
			}
		}
	}
	v.Note = fmt.Sprintf("%d node kills, %d incarnations killed, each marked failed", len(kills), n)
	if !v.OK {
		v.Note = fmt.Sprintf("%d node kills, %d incarnations killed", len(kills), n)
	}
	return v
}
