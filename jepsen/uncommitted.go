package jepsen

import (
	"context"
	"fmt"
	"sort"
	"syscall"
	"time"

	"github.com/lumen-project/lumen/internal/devcluster"
)

// killUncommitted is the kill-uncommitted nemesis's fault, the window
// issue 16 opens: a request starts on the worker its gateway chose before
// its placement commits. It stalls the commits (SIGSTOP the leader: until
// a new one is elected nothing commits, and a gateway's Place stream to it
// hangs), waits for a stream to start meanwhile (its first token came from
// a worker the gateway chose; the commit cannot have come), and kills -9 a
// worker that is running requests, that stream's when only one is. The
// gateway's journal must resume every such request on another worker,
// its output still the reference. The leader gets SIGCONT and the worker
// restarts at heal.
func (e *env) killUncommitted(ctx context.Context) (string, error) {
	i, err := e.leader(ctx)
	if err != nil {
		return "", err
	}
	if err := e.cl.Signal(i, syscall.SIGSTOP); err != nil {
		return "", err
	}
	what := "SIGSTOP leader " + e.cl.Controllers[i].ID
	paused := e.hist.Now()
	for {
		e.mu.Lock()
		opened := e.lastOpen
		e.mu.Unlock()
		if opened > paused {
			what += fmt.Sprintf("; a stream started %s later", time.Duration(opened-paused).Round(time.Millisecond))
			break
		}
		if ctx.Err() != nil {
			what += "; no stream started meanwhile"
			break
		}
		sleepCtx(ctx, 5*time.Millisecond)
	}
	// The workers running requests now: only streams' (the placement
	// clients' requests never run on a worker).
	sctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var busy, up []*devcluster.Worker
	for _, w := range e.cl.Workers {
		if !w.Running() {
			continue
		}
		up = append(up, w)
		if n, err := w.Metric(sctx, "lumen_worker_running"); err == nil && n > 0 {
			busy = append(busy, w)
		}
	}
	if len(up) == 0 {
		return what + "; no worker running", nil
	}
	pool := busy
	if len(pool) == 0 {
		pool = up
	}
	sort.Slice(pool, func(a, b int) bool { return pool[a].ID < pool[b].ID })
	w := pool[e.rng.Intn(len(pool))]
	e.killWorker(w)
	return fmt.Sprintf("%s; kill -9 %s (%d of %d workers running requests)", what, w.ID, len(busy), len(up)), nil
}
