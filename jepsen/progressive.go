package jepsen

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/lumen-project/lumen/internal/devcluster"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// Progressive recovery under faults. A worker killed with SIGKILL leaves
// its run marker in its data directory, which the harness keeps, so its
// restart recovers progressively: LOADING_DRAFT, ASSIST (drafting for the
// full-service worker the controller pairs it with), HOTSWAP, FULL_SERVICE.
// The phases last as long as the loads they wait for, so a restart takes
// the profile's load times, scaled by restartLoadScale; the first start
// loads at once (the tiny model loads in milliseconds), so the cluster
// comes up as fast as before.

// workerProfile paces the workers' engines and, on a restart, their loads.
const workerProfile = "qwen3-14b-h100"

// restartLoadScale scales the profile's load times on a restart: Qwen3-14B's
// 22.8 s to host memory and 0.84 s hot swap, Qwen3-0.6B's 1.35 s draft load
// become 5.7 s, 0.21 s and 0.34 s, so a restarted worker assists for about
// 5 s, long enough for faults to land in every phase.
const restartLoadScale = 0.25

// restartLoadTime is how long a restarted worker takes to reach full
// service when nothing slows it down.
func restartLoadTime() time.Duration {
	return time.Duration(float64(engine.Profiles[workerProfile].LoadTime()) * restartLoadScale)
}

// tablePoll is how often the nemeses read the worker table while they wait
// for a phase; a hot swap lasts about 200 ms.
const tablePoll = 20 * time.Millisecond

// table reads the worker table from any replica (stale reads: a consistent
// snapshot, maybe a little behind, and fast).
func (e *env) table(ctx context.Context) (map[string]*pb.Worker, error) {
	qctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	r, err := e.client.ListWorkers(qctx, &pb.ListWorkersRequest{Consistency: pb.Consistency_CONSISTENCY_STALE})
	if err != nil {
		return nil, err
	}
	out := make(map[string]*pb.Worker, len(r.Workers))
	for _, w := range r.Workers {
		out[w.Id] = w
	}
	return out, nil
}

// process is the harness's handle on worker id (nil if none).
func (e *env) process(id string) *devcluster.Worker {
	for _, w := range e.cl.Workers {
		if w.ID == id {
			return w
		}
	}
	return nil
}

// killWorker sends a worker SIGKILL and counts the kill, for the recovered
// checker.
func (e *env) killWorker(w *devcluster.Worker) {
	e.cl.KillWorker(w)
	e.mu.Lock()
	e.workerKills[w.ID]++
	e.mu.Unlock()
}

// The assist-kill faults, picked at random (seeded) each time.
const (
	akDrafter        = "drafter"                 // kill -9 a paired drafter in ASSIST
	akPartner        = "partner"                 // kill -9 the full-service worker a drafter assists
	akHotswap        = "drafter-in-hotswap"      // kill -9 a drafter once it has left ASSIST
	akLeaderLoading  = "leader-at-loading-draft" // kill -9 the leader as a restarted worker registers
	akLeaderHotswap  = "leader-at-hotswap"       // kill -9 the leader as a drafter leaves ASSIST
	akMissedSuffix   = " (missed: already FULL_SERVICE)"
	assistKillWindow = time.Second // how long it looks for a drafter before it makes one
)

var assistKillModes = []string{akDrafter, akPartner, akHotswap, akLeaderLoading, akLeaderHotswap}

// assistKill is the assist-kill nemesis: it waits until a restarted worker
// drafts in ASSIST (restarting one itself, a kill -9 and an immediate
// restart, when no recovery is under way) and kills, at random: the
// drafter; its partner; the drafter once it is in HOTSWAP; or the
// controller leader during a phase change (as a restarted worker registers
// in LOADING_DRAFT, its ASSIST and its pairing then commit under an
// election; or as a drafter enters HOTSWAP, its FULL_SERVICE then commits
// under one). Dead processes restart at heal.
func (e *env) assistKill(ctx context.Context) (string, error) {
	mode := assistKillModes[e.rng.Intn(len(assistKillModes))]
	var did []string
	say := func(format string, args ...any) { did = append(did, fmt.Sprintf(format, args...)) }
	fail := func(err error) (string, error) {
		if len(did) > 0 {
			err = fmt.Errorf("%s: %s: %w", mode, strings.Join(did, "; "), err)
		} else {
			err = fmt.Errorf("%s: %w", mode, err)
		}
		return "", err
	}
	done := func(what string) (string, error) {
		e.mu.Lock()
		e.assistKills[what]++
		e.mu.Unlock()
		return mode + ": " + strings.Join(did, "; "), nil
	}

	if mode == akLeaderLoading {
		leader, err := e.leader(ctx)
		if err != nil {
			return fail(err)
		}
		w, inc, err := e.startRecovery(ctx)
		if err != nil {
			return fail(err)
		}
		say("kill -9 %s (incarnation %d) and restart it at once", w.ID, inc)
		row, err := e.waitRow(ctx, w.ID, func(r *pb.Worker) bool { return r.Incarnation > inc })
		if err != nil {
			return fail(fmt.Errorf("%s did not register again: %w", w.ID, err))
		}
		e.cl.Kill(leader)
		say("it registered in %s (incarnation %d): kill -9 leader %s", phaseString(row.Phase), row.Incarnation, e.cl.Controllers[leader].ID)
		if row.Phase != pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT {
			return done(mode + " (late: already " + phaseString(row.Phase) + ")")
		}
		return done(mode)
	}

	d, t, err := e.findDrafter(ctx, mode == akDrafter || mode == akPartner, say)
	if err != nil {
		return fail(err)
	}
	switch mode {
	case akDrafter:
		e.killWorker(e.process(d.Id))
		say("kill -9 drafter %s (incarnation %d, assisting %s)", d.Id, d.Incarnation, t.Id)
		return done(mode)
	case akPartner:
		e.killWorker(e.process(t.Id))
		say("kill -9 %s (incarnation %d), the partner of drafter %s", t.Id, t.Incarnation, d.Id)
		return done(mode)
	}
	// Wait for the drafter to leave ASSIST.
	leader := -1
	if mode == akLeaderHotswap {
		if leader, err = e.leader(ctx); err != nil {
			return fail(err)
		}
	}
	say("drafter %s (incarnation %d) in ASSIST", d.Id, d.Incarnation)
	row, err := e.waitRow(ctx, d.Id, func(r *pb.Worker) bool {
		return r.Incarnation != d.Incarnation || r.Phase != pb.WorkerPhase_WORKER_PHASE_ASSIST
	})
	if err != nil {
		return fail(fmt.Errorf("still in ASSIST: %w", err))
	}
	switch {
	case row.Incarnation != d.Incarnation || (row.Phase != pb.WorkerPhase_WORKER_PHASE_HOTSWAP && row.Phase != pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE):
		return fail(fmt.Errorf("it went %s (incarnation %d) before HOTSWAP", phaseString(row.Phase), row.Incarnation))
	}
	what := mode
	if row.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
		what += akMissedSuffix
	}
	if mode == akHotswap {
		e.killWorker(e.process(d.Id))
		say("in %s: kill -9 %s", phaseString(row.Phase), d.Id)
	} else {
		e.cl.Kill(leader)
		say("in %s: kill -9 leader %s", phaseString(row.Phase), e.cl.Controllers[leader].ID)
	}
	return done(what)
}

// startRecovery kills a worker in full service (at random, seeded) and
// restarts it at once, so that it recovers progressively; it returns the
// worker and the incarnation it killed. It needs a second worker in full
// service for the restarted one to assist.
func (e *env) startRecovery(ctx context.Context) (*devcluster.Worker, uint64, error) {
	rows, err := e.table(ctx)
	if err != nil {
		return nil, 0, err
	}
	var full []string
	for id, r := range rows {
		if p := e.process(id); p != nil && p.Running() && r.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
			full = append(full, id)
		}
	}
	if len(full) < 2 {
		return nil, 0, fmt.Errorf("%d workers in full service: none to restart with another to assist", len(full))
	}
	sort.Strings(full)
	w := e.process(full[e.rng.Intn(len(full))])
	inc := rows[w.ID].Incarnation
	e.killWorker(w)
	if err := e.cl.StartWorker(w); err != nil {
		return nil, 0, fmt.Errorf("restart %s: %w", w.ID, err)
	}
	return w, inc, nil
}

// findDrafter waits for a running worker in ASSIST (paired, with its
// partner in full service naming it back, when paired is set) and returns
// it and its partner (nil when unpaired). When no worker recovers for
// assistKillWindow, it starts a recovery.
func (e *env) findDrafter(ctx context.Context, paired bool, say func(string, ...any)) (d, t *pb.Worker, err error) {
	deadline := time.Now().Add(assistKillWindow)
	started := false
	var last map[string]*pb.Worker
	for {
		rows, err := e.table(ctx)
		if err == nil {
			last = rows
			var ids []string
			recovering := false
			for id, r := range rows {
				p := e.process(id)
				if p == nil || !p.Running() {
					continue
				}
				switch r.Phase {
				case pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT:
					recovering = true
				case pb.WorkerPhase_WORKER_PHASE_ASSIST:
					recovering = true
					if !paired {
						ids = append(ids, id)
					} else if q := rows[r.PairedWorker]; q != nil && q.PairedWorker == id && q.Phase == pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE {
						if qp := e.process(q.Id); qp != nil && qp.Running() {
							ids = append(ids, id)
						}
					}
				}
			}
			if len(ids) > 0 {
				sort.Strings(ids)
				d = rows[ids[e.rng.Intn(len(ids))]]
				return d, rows[d.PairedWorker], nil
			}
			if !started && !recovering && time.Now().After(deadline) {
				w, inc, err := e.startRecovery(ctx)
				if err != nil {
					return nil, nil, fmt.Errorf("no worker recovering, and none could be restarted: %w", err)
				}
				started = true
				say("no worker recovering: kill -9 %s (incarnation %d) and restart it at once", w.ID, inc)
			}
		}
		sleepCtx(ctx, tablePoll)
		if ctx.Err() != nil {
			what := "in ASSIST"
			if paired {
				what = "paired in ASSIST"
			}
			return nil, nil, fmt.Errorf("no worker %s in time (table: %s)", what, describeTable(last))
		}
	}
}

// waitRow polls worker id's row until ok says so.
func (e *env) waitRow(ctx context.Context, id string, ok func(*pb.Worker) bool) (*pb.Worker, error) {
	var last *pb.Worker
	for {
		if rows, err := e.table(ctx); err == nil {
			if r := rows[id]; r != nil {
				last = r
				if ok(r) {
					return r, nil
				}
			}
		}
		sleepCtx(ctx, tablePoll)
		if ctx.Err() != nil {
			if last == nil {
				return nil, fmt.Errorf("no row for %s: %w", id, ctx.Err())
			}
			return nil, fmt.Errorf("%s in %s (incarnation %d): %w", id, phaseString(last.Phase), last.Incarnation, ctx.Err())
		}
	}
}

func describeTable(rows map[string]*pb.Worker) string {
	if rows == nil {
		return "unread"
	}
	var parts []string
	for _, r := range tableRows(sortedRows(rows)) {
		s := fmt.Sprintf("%s/%d %s", r.ID, r.Inc, r.Phase)
		if r.Paired != "" {
			s += " paired " + r.Paired
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, ", ")
}

func sortedRows(rows map[string]*pb.Worker) []*pb.Worker {
	out := make([]*pb.Worker, 0, len(rows))
	for _, r := range rows {
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Id < out[j].Id })
	return out
}

// ProgressStats counts what progressive recovery did in a run: from the
// event log (phase changes and pairings), from the workers' metrics
// (drafts), and from assist-kill (which faults landed).
type ProgressStats struct {
	Restarts      int // registered in LOADING_DRAFT
	Assist        int // entered ASSIST
	SkippedAssist int // LOADING_DRAFT straight to HOTSWAP (the model loaded first)
	Hotswap       int // entered HOTSWAP
	Recovered     int // HOTSWAP to FULL_SERVICE
	Paired        int // WorkerPaired, paired
	Unpaired      int // WorkerPaired, ended
	// Draft tokens the drafters proposed, the targets verified and
	// accepted (sums over processes, sampled once a second: a killed
	// process's last second is missing).
	Drafted, Verified, Accepted uint64
	AssistKills                 map[string]int
}

func (s ProgressStats) String() string {
	out := fmt.Sprintf("%d progressive restarts: %d ASSIST (%d skipped it), %d HOTSWAP, %d back in FULL_SERVICE; %d pairings, %d ended; %d draft tokens proposed, %d verified, %d accepted",
		s.Restarts, s.Assist, s.SkippedAssist, s.Hotswap, s.Recovered, s.Paired, s.Unpaired, s.Drafted, s.Verified, s.Accepted)
	if len(s.AssistKills) > 0 {
		var ks []string
		for k, n := range s.AssistKills {
			ks = append(ks, fmt.Sprintf("%s %d", k, n))
		}
		sort.Strings(ks)
		out += "; assist-kill: " + strings.Join(ks, ", ")
	}
	return out
}

// countEvent adds a progressive-recovery event to s.
func (s *ProgressStats) countEvent(ev *pb.Event) {
	if pc := ev.GetPhaseChanged(); pc != nil {
		switch pc.To {
		case pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT:
			s.Restarts++
		case pb.WorkerPhase_WORKER_PHASE_ASSIST:
			s.Assist++
		case pb.WorkerPhase_WORKER_PHASE_HOTSWAP:
			s.Hotswap++
			if pc.From == pb.WorkerPhase_WORKER_PHASE_LOADING_DRAFT {
				s.SkippedAssist++
			}
		case pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE:
			if pc.From == pb.WorkerPhase_WORKER_PHASE_HOTSWAP {
				s.Recovered++
			}
		}
	}
	if p := ev.GetPaired(); p != nil {
		if p.Paired {
			s.Paired++
		} else {
			s.Unpaired++
		}
	}
}

// specCounters are the draft metrics sampleSpec follows in every worker.
var specCounters = []string{"lumen_worker_drafted_tokens_total", "lumen_worker_spec_draft_tokens_total", "lumen_worker_spec_accepted_tokens_total"}

// sampleSpec scrapes each running worker's draft counters once a second
// and sums them over processes (a counter that went down is a new
// process: the old one's last value is kept).
func (e *env) sampleSpec(ctx context.Context) [3]uint64 {
	type key struct {
		worker string
		k      int
	}
	last, base := map[key]float64{}, map[key]float64{}
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			var out [3]uint64
			for k, v := range last {
				out[k.k] += uint64(v + base[k])
			}
			return out
		case <-t.C:
		}
		for _, w := range e.cl.Workers {
			if !w.Running() {
				continue
			}
			for i, name := range specCounters {
				sctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
				v, err := w.Metric(sctx, name)
				cancel()
				if err != nil {
					break // paused, restarting: next time
				}
				k := key{w.ID, i}
				if v < last[k] {
					base[k] += last[k]
				}
				last[k] = v
			}
		}
	}
}

// awaitRecovered waits until every worker's row is in FULL_SERVICE and
// unpaired (read linearizably), for as long as a restart takes plus 30 s,
// and returns the last table.
func (e *env) awaitRecovered(ctx context.Context) Recovered {
	start := time.Now()
	deadline := start.Add(restartLoadTime() + 30*time.Second)
	var r Recovered
	for {
		r = Recovered{Running: map[string]bool{}}
		qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		resp, err := e.client.ListWorkers(qctx, &pb.ListWorkersRequest{Consistency: pb.Consistency_CONSISTENCY_LINEARIZABLE})
		cancel()
		if err != nil {
			r.Err = err.Error()
		} else {
			r.Rows = tableRows(resp.Workers)
		}
		all := err == nil && len(r.Rows) == len(e.cl.Workers)
		for _, w := range r.Rows {
			if w.Phase != "FULL_SERVICE" || w.Paired != "" {
				all = false
			}
		}
		if all || !time.Now().Before(deadline) || ctx.Err() != nil {
			break
		}
		sleepCtx(ctx, 250*time.Millisecond)
	}
	r.Waited = time.Since(start)
	e.mu.Lock()
	r.Killed = map[string]int{}
	for id, n := range e.workerKills {
		r.Killed[id] = n
	}
	e.mu.Unlock()
	r.Logs = map[string]string{}
	for _, w := range e.cl.Workers {
		r.Running[w.ID] = w.Running()
		if tail := logTail(w.LogPath, 3); tail != "" {
			r.Logs[w.ID] = tail
		}
	}
	return r
}

// awaitEvents waits, for at most 5 s, until the event log has shown every
// row of the final table entering FULL_SERVICE in its incarnation, so that
// the run's counts include the last recoveries.
func (e *env) awaitEvents(ctx context.Context, rows []WorkerRow) {
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		seen := true
		e.mu.Lock()
		for _, r := range rows {
			if r.Phase == "FULL_SERVICE" && e.inService[r.ID] != r.Inc {
				seen = false
			}
		}
		e.mu.Unlock()
		if seen {
			return
		}
		sleepCtx(ctx, 20*time.Millisecond)
	}
}

// logTail is the last n lines of a log, joined by " | ".
func logTail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return ""
		}
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
