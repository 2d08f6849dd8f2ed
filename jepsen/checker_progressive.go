package jepsen

import (
	"fmt"
	"sort"
	"strings"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// WorkerRow is one row of the worker table as the harness saw it.
type WorkerRow struct {
	ID     string
	Inc    uint64
	Phase  string // "ASSIST", "FULL_SERVICE", ... (the enum without its prefix)
	Paired string // paired_worker
	// PhaseSince is when the row entered its phase (the leader's stamp).
	PhaseSince int64
}

// TableSample is the worker table at one instant: one replica's applied
// state, so a consistent snapshot even when it is stale.
type TableSample struct {
	At   int64
	Rows []WorkerRow
}

func phaseString(p pb.WorkerPhase) string {
	return strings.TrimPrefix(p.String(), "WORKER_PHASE_")
}

func tableRows(ws []*pb.Worker) []WorkerRow {
	out := make([]WorkerRow, 0, len(ws))
	for _, w := range ws {
		out = append(out, WorkerRow{ID: w.Id, Inc: w.Incarnation, Phase: phaseString(w.Phase), Paired: w.PairedWorker, PhaseSince: w.PhaseChangedUnixNano})
	}
	return out
}

// pairingErrors says what is wrong with the pairings of one table: a
// pairing holds between a drafter in ASSIST and a worker in FULL_SERVICE,
// and both rows name each other.
func pairingErrors(rows []WorkerRow) []string {
	by := map[string]WorkerRow{}
	for _, r := range rows {
		by[r.ID] = r
	}
	var out []string
	for _, r := range rows {
		if r.Paired == "" {
			continue
		}
		p, ok := by[r.Paired]
		switch {
		case !ok:
			out = append(out, fmt.Sprintf("%s (%s) is paired with %s, which has no row", r.ID, r.Phase, r.Paired))
		case p.Paired != r.ID:
			out = append(out, fmt.Sprintf("%s (%s) is paired with %s (%s), which is paired with %q", r.ID, r.Phase, p.ID, p.Phase, p.Paired))
		case r.Phase == "ASSIST" && p.Phase != "FULL_SERVICE", r.Phase == "FULL_SERVICE" && p.Phase != "ASSIST":
			out = append(out, fmt.Sprintf("%s (%s) is paired with %s in %s", r.ID, r.Phase, p.ID, p.Phase))
		case r.Phase != "ASSIST" && r.Phase != "FULL_SERVICE":
			out = append(out, fmt.Sprintf("%s is paired with %s in %s: only a drafter in ASSIST and a worker in FULL_SERVICE pair", r.ID, p.ID, r.Phase))
		}
	}
	return out
}

// CheckPairing: in every sampled worker table each pairing is a drafter in
// ASSIST and a worker in FULL_SERVICE that name each other; no row names a
// partner that is gone, failed, recovering or paired elsewhere.
func CheckPairing(samples []TableSample) Verdict {
	v := Verdict{Checker: "pairing", OK: true}
	withPair := 0
	pairs := map[string]bool{}
	for _, s := range samples {
		paired := false
		for _, r := range s.Rows {
			if r.Paired != "" && r.Phase == "ASSIST" {
				paired = true
				pairs[fmt.Sprintf("%s/%d>%s", r.ID, r.Inc, r.Paired)] = true
			}
		}
		if paired {
			withPair++
		}
		for _, e := range pairingErrors(s.Rows) {
			v.fail("at %s: %s", fmtNanos(s.At), e)
		}
	}
	v.Note = fmt.Sprintf("%d tables, %d with a pairing, %d distinct pairings", len(samples), withPair, len(pairs))
	return v
}

// Recovered is the worker table once the run is over and every process has
// been restarted, after waiting for every worker to reach full service.
type Recovered struct {
	Rows    []WorkerRow
	Killed  map[string]int  // kill -9s of each worker during the run
	Running map[string]bool // whose process is alive
	Logs    map[string]string
	Waited  time.Duration
	Err     string // the last read of the table failed
}

// CheckRecovered: every worker, and every worker that was killed above all,
// is back in FULL_SERVICE by the end of the run, and no pairing is left: no
// row is stuck in LOADING_DRAFT, ASSIST or HOTSWAP, no row names a partner.
// A violation says where the worker stopped and what its log said last.
func CheckRecovered(r Recovered) Verdict {
	v := Verdict{Checker: "recovered", OK: true}
	kills := 0
	var killed []string
	for id, n := range r.Killed {
		kills += n
		killed = append(killed, id)
	}
	sort.Strings(killed)
	v.Note = fmt.Sprintf("%d workers in full service after %s; %d kill -9s of %d workers", len(r.Rows), r.Waited.Round(100*time.Millisecond), kills, len(killed))
	if r.Err != "" {
		v.fail("the worker table could not be read: %s", r.Err)
		return v
	}
	by := map[string]WorkerRow{}
	for _, w := range r.Rows {
		by[w.ID] = w
	}
	for _, id := range killed {
		if _, ok := by[id]; !ok {
			v.fail("%s was killed %d times and has no row", id, r.Killed[id])
		}
	}
	for _, w := range r.Rows {
		why := ""
		switch {
		case w.Phase != "FULL_SERVICE":
			why = fmt.Sprintf("%s is in %s (incarnation %d, since %s)", w.ID, w.Phase, w.Inc, time.Unix(0, w.PhaseSince).UTC().Format("15:04:05.000"))
		case w.Paired != "":
			why = fmt.Sprintf("%s in FULL_SERVICE is still paired with %s", w.ID, w.Paired)
		default:
			continue
		}
		why += fmt.Sprintf(" after waiting %s; killed %d times", r.Waited.Round(100*time.Millisecond), r.Killed[w.ID])
		if !r.Running[w.ID] {
			why += "; its process is not running"
		}
		if l := r.Logs[w.ID]; l != "" {
			why += "; its log ends: " + l
		}
		v.fail("%s", why)
	}
	for _, e := range pairingErrors(r.Rows) {
		v.fail("at the end: %s", e)
	}
	if v.OK {
		v.Note = strings.Replace(v.Note, "workers in full service", "workers in full service, none paired,", 1)
	}
	return v
}
