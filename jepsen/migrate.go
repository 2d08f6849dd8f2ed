package jepsen

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"regexp"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/fsm"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// Live migration under faults. With the migrate nemesis in a run:
//
//   - the harness switches live migration for balance ON at the start
//     (Operator.SetStrategy), so the leader's balance round runs every
//     500 ms;
//   - a migrator forces migrations continuously (Operator.Migrate every
//     150–450 ms, seeded): of a stream in flight, mostly, else of a
//     placement client's request (a placement no worker runs: its source
//     aborts; or it completes while it migrates);
//   - each fault forces one more migration of a stream in flight (a long
//     one when one is open: it copies in stages) and kills, picked at
//     random (seeded) and logged, its source, its destination, both, or the
//     controller leader while it copies, or its old source or its
//     destination as it commits; or pauses (SIGSTOP) its source or its
//     destination while it copies. Dead processes restart at heal, paused
//     ones get SIGCONT.

// The migrate faults, picked at random (seeded) each time.
const (
	mkSource      = "source"                 // kill -9 the source while the pages copy
	mkDestination = "destination"            // kill -9 the destination while the pages copy
	mkBoth        = "source-and-destination" // kill -9 both while the pages copy
	mkLeader      = "leader"                 // kill -9 the leader while the pages copy
	mkSourceAt    = "source-at-commit"       // kill -9 the old source as the commit is applied
	mkDestAt      = "destination-at-commit"  // kill -9 the new owner as the commit is applied
	mkPauseSource = "pause-source"           // SIGSTOP the source while the pages copy
	mkPauseDest   = "pause-destination"      // SIGSTOP the destination while the pages copy
)

var migrateKillModes = []string{mkSource, mkDestination, mkBoth, mkLeader, mkSourceAt, mkDestAt, mkPauseSource, mkPauseDest}

// midKillDelay bounds the seeded delay between a forced migration's start
// (the Migrate call's answer) and a kill while the pages copy: a stream's
// few pages copy in tens of milliseconds, so later kills land after the
// commit (the log says which).
const midKillDelay = 40 * time.Millisecond

// MigrationStats is what live migration did in a run: from the event log
// (Migration events by cause, fsm.MigrationCause), from the migrator and
// from the migrate faults.
type MigrationStats struct {
	Started   map[string]int // by cause: balance, drain, operator, other
	Committed int
	Aborted   map[string]int // by cause: timeout, destination, source_failed, finished, worker
	// WorkerAborts: the reasons of the aborts a worker asked for, request
	// ids and numbers blanked.
	WorkerAborts map[string]int
	// FromCopy: requests whose source failed mid-migration and whose
	// recovery reused the pages copied to the destination
	// (RecoveryAssignment.migration_copy).
	FromCopy int
	// Requested: the migrator's Migrate calls; Refused, those refused, by
	// gRPC code.
	Requested int
	Refused   map[string]int
	// Kills: the migrate faults, by mode; KilledMigrating: those that
	// struck before the migration's outcome was in the event log.
	Kills           map[string]int
	KilledMigrating int
	// StreamsMigrated: completed streams whose request (or one of its
	// attempts) committed a migration; the serving checker compared each
	// with the reference.
	StreamsMigrated int
}

func newMigrationStats() MigrationStats {
	return MigrationStats{Started: map[string]int{}, Aborted: map[string]int{}, WorkerAborts: map[string]int{}, Refused: map[string]int{}, Kills: map[string]int{}}
}

// Any reports whether a migration was started or requested.
func (s MigrationStats) Any() bool { return s.Requested > 0 || len(s.Started) > 0 || len(s.Kills) > 0 }

func (s MigrationStats) String() string {
	started := 0
	for _, n := range s.Started {
		started += n
	}
	aborted := 0
	for _, n := range s.Aborted {
		aborted += n
	}
	out := fmt.Sprintf("%d migrations started (%s), %d committed, %d aborted (%s), %d recovered from the copy; migrator: %d requested, refused %s; %d completed streams migrated",
		started, countList(s.Started), s.Committed, aborted, countList(s.Aborted), s.FromCopy, s.Requested, countList(s.Refused), s.StreamsMigrated)
	if len(s.Kills) > 0 {
		out += fmt.Sprintf("; migrate faults: %s (%d struck while it copied)", countList(s.Kills), s.KilledMigrating)
	}
	return out
}

// countList is "a 3, b 1" for a map of counts, sorted by key.
func countList(m map[string]int) string {
	if len(m) == 0 {
		return "none"
	}
	var ks []string
	for k, n := range m {
		ks = append(ks, fmt.Sprintf("%s %d", k, n))
	}
	sort.Strings(ks)
	return strings.Join(ks, ", ")
}

// countMigration adds a Migration event to s; it returns the request id of
// a commit ("" otherwise).
func (s *MigrationStats) countMigration(ev *pb.Event) string {
	for _, a := range ev.GetRecoveryPlan().GetAssignments() {
		if a.MigrationCopy {
			s.FromCopy++
		}
	}
	m := ev.GetMigration()
	if m == nil {
		return ""
	}
	switch c := fsm.MigrationCause(m); m.Stage {
	case pb.Migration_STAGE_STARTED:
		s.Started[c]++
	case pb.Migration_STAGE_COMMITTED:
		s.Committed++
		return m.Placement.GetRequestId()
	case pb.Migration_STAGE_ABORTED:
		s.Aborted[c]++
		if c == "worker" {
			s.WorkerAborts[blankReason(m.Reason)]++
		}
	}
	return ""
}

var (
	quotedRE = regexp.MustCompile(`"[^"]*"`)
	numberRE = regexp.MustCompile(`[0-9]+`)
	idRE     = regexp.MustCompile(`c(hat)?mpl-[0-9a-f~]+|j[0-9]+-[0-9]+`)
)

// blankReason blanks the request ids and numbers of a reason, so reasons
// can be counted.
func blankReason(r string) string {
	r = quotedRE.ReplaceAllString(r, "ID")
	r = idRE.ReplaceAllString(r, "ID")
	return numberRE.ReplaceAllString(r, "N")
}

// streamsMigrated counts the completed streams whose request, under its
// first id or an attempt id (`id~n`), committed a migration.
func streamsMigrated(streams []Stream, committed map[string]bool) int {
	base := map[string]bool{}
	for id := range committed {
		b, _, _ := strings.Cut(id, "~")
		base[b] = true
	}
	n := 0
	for _, s := range streams {
		if s.Done && s.ID != "" && base[s.ID] {
			n++
		}
	}
	return n
}

func (e *env) hasNemesis(name string) bool { return slices.Contains(e.cfg.Nemeses, name) }

// openStream records that a stream's request id is in flight (its first
// chunk named it), and its length; closeStream, that it ended.
func (e *env) openStream(id string, max int) {
	e.mu.Lock()
	e.openIDs[id] = max
	e.lastOpen = e.hist.Now()
	e.mu.Unlock()
}

func (e *env) closeStream(id string) {
	e.mu.Lock()
	delete(e.openIDs, id)
	e.mu.Unlock()
}

// openStreamID picks a request id of a stream in flight, at random with
// rng (sorted first, so a seed picks the same way), or "". With long, it
// picks among the longest streams open.
func (e *env) openStreamID(rng *rand.Rand, long bool) string {
	e.mu.Lock()
	ids := make([]string, 0, len(e.openIDs))
	longest := 0
	for _, n := range e.openIDs {
		longest = max(longest, n)
	}
	for id, n := range e.openIDs {
		if !long || n == longest {
			ids = append(ids, id)
		}
	}
	e.mu.Unlock()
	if len(ids) == 0 {
		return ""
	}
	sort.Strings(ids)
	return ids[rng.Intn(len(ids))]
}

// otherWorker picks a worker other than from at random with rng, or ""
// (Operator.Migrate then picks the freest) half the time.
func (e *env) otherWorker(rng *rand.Rand, from string) string {
	if rng.Intn(2) == 0 {
		return ""
	}
	var ids []string
	for _, w := range e.cl.Workers {
		if w.ID != from {
			ids = append(ids, w.ID)
		}
	}
	if len(ids) == 0 {
		return ""
	}
	return ids[rng.Intn(len(ids))]
}

// migrationOn switches live migration for balance on (the leader's
// balance round), retrying until the quorum takes it.
func (e *env) migrationOn(ctx context.Context) {
	err := e.retryOperator(ctx, func(ctx context.Context, op pb.OperatorClient) error {
		_, err := op.SetStrategy(ctx, &pb.SetStrategyRequest{Migration: pb.MigrationMode_MIGRATION_MODE_ON})
		return err
	})
	if err != nil {
		e.logf("migration for balance not switched on: %v", err)
		return
	}
	e.logf("migration for balance switched on")
}

// migrator forces migrations until ctx ends: every 150–450 ms (seeded) a
// Migrate of a stream in flight (four times in five) or of a placement
// client's recent request, to a random other worker or to the one the
// policy picks. A refusal (the request just completed, is not RUNNING, the
// destination is not in full service) is counted by its code.
func (e *env) migrator(ctx context.Context) {
	rng := rand.New(rand.NewSource(e.cfg.Seed*7919 + 1))
	for ctx.Err() == nil {
		sleepCtx(ctx, 150*time.Millisecond+time.Duration(rng.Int63n(int64(300*time.Millisecond))))
		if ctx.Err() != nil {
			return
		}
		id := ""
		if rng.Intn(5) > 0 {
			id = e.openStreamID(rng, false)
		}
		if id == "" {
			id = e.recentID(rng)
		}
		if id == "" {
			continue
		}
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		p, err := e.client.GetPlacement(qctx, &pb.GetPlacementRequest{RequestId: id, Consistency: pb.Consistency_CONSISTENCY_STALE})
		cancel()
		from := ""
		if err == nil {
			from = p.Placement.GetWorkerId()
		}
		mctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err = e.client.Migrate(mctx, &pb.MigrateRequest{RequestId: id, ToWorker: e.otherWorker(rng, from)})
		cancel()
		e.mu.Lock()
		e.migs.Requested++
		if err != nil {
			e.migs.Refused[status.Code(err).String()]++
		}
		e.mu.Unlock()
	}
}

// migrationOutcome follows the event log from after index (a Migrate's)
// until request id's migration commits or aborts, and sends the stage and
// reason on the channel it returns (then closes it); it gives up when ctx
// ends.
func (e *env) migrationOutcome(ctx context.Context, id string, index uint64) <-chan string {
	out := make(chan string, 1)
	go func() {
		defer close(out)
		from := index
		for ctx.Err() == nil {
			st, err := e.client.WatchEvents(ctx, from)
			if err != nil {
				sleepCtx(ctx, 50*time.Millisecond)
				continue
			}
			for {
				ev, err := st.Recv()
				if err != nil {
					break
				}
				from = ev.Index
				m := ev.GetMigration()
				if m == nil || m.Placement.GetRequestId() != id || m.Stage == pb.Migration_STAGE_STARTED {
					continue
				}
				out <- fmt.Sprintf("%s at index %d (%s)", strings.TrimPrefix(m.Stage.String(), "STAGE_"), ev.Index, m.Reason)
				return
			}
		}
	}()
	return out
}

// errNoMigration: migrate found no stream in flight it could migrate.
var errNoMigration = errors.New("no stream in flight could be migrated")

// migrateKill is the migrate nemesis's fault: it forces a migration of a
// stream in flight and kills, as the seeded mode says, the source, the
// destination, both or the leader while the pages copy (after a seeded
// 0–40 ms), or the old source or the new owner as soon as the commit is in
// the event log.
func (e *env) migrateKill(ctx context.Context) (string, error) {
	mode := migrateKillModes[e.rng.Intn(len(migrateKillModes))]
	leader := -1
	if mode == mkLeader {
		var err error
		if leader, err = e.leader(ctx); err != nil {
			return "", err
		}
	}
	var resp *pb.MigrateResponse
	var id string
	var last error = errNoMigration
	for resp == nil {
		if ctx.Err() != nil {
			return "", fmt.Errorf("%s: %w", mode, last)
		}
		if id = e.openStreamID(e.rng, true); id == "" {
			sleepCtx(ctx, 20*time.Millisecond)
			continue
		}
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		p, err := e.client.GetPlacement(qctx, &pb.GetPlacementRequest{RequestId: id})
		cancel()
		if err != nil || p.Placement.GetState() != pb.PlacementState_PLACEMENT_STATE_RUNNING {
			if err == nil {
				err = fmt.Errorf("request %s is %s", id, p.Placement.GetState())
			}
			last = err
			sleepCtx(ctx, 20*time.Millisecond)
			continue
		}
		mctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		resp, err = e.client.Migrate(mctx, &pb.MigrateRequest{RequestId: id, ToWorker: e.otherWorker(e.rng, p.Placement.WorkerId)})
		cancel()
		if err != nil {
			last = err
			sleepCtx(ctx, 20*time.Millisecond)
		}
	}
	pl := resp.Placement
	src, dst := pl.WorkerId, pl.MigrationTarget
	wctx, stopWatch := context.WithTimeout(context.Background(), 10*time.Second)
	defer stopWatch()
	outcome := e.migrationOutcome(wctx, id, resp.Index)
	what := fmt.Sprintf("%s: request %s epoch %d migrating %s -> %s (index %d)", mode, id, pl.Epoch, src, dst, resp.Index)

	var seen string
	switch mode {
	case mkSourceAt, mkDestAt:
		select {
		case seen = <-outcome:
		case <-ctx.Done():
			seen = "no outcome yet"
		}
		what += "; " + seen
	default:
		d := time.Duration(e.rng.Int63n(int64(midKillDelay)))
		sleepCtx(ctx, d)
		select {
		case seen = <-outcome:
		default:
		}
		if seen == "" {
			what += fmt.Sprintf("; after %s, still migrating", d.Round(time.Millisecond))
		} else {
			what += fmt.Sprintf("; after %s, already %s", d.Round(time.Millisecond), seen)
		}
	}
	var victims []string
	switch mode {
	case mkSource, mkSourceAt:
		victims = []string{src}
	case mkDestination, mkDestAt:
		victims = []string{dst}
	case mkBoth:
		victims = []string{src, dst}
	}
	for _, v := range victims {
		if w := e.process(v); w != nil {
			e.killWorker(w)
		}
	}
	verb := "kill -9 "
	if mode == mkPauseSource || mode == mkPauseDest {
		v := src
		if mode == mkPauseDest {
			v = dst
		}
		verb, victims = "SIGSTOP ", []string{v}
		if w := e.process(v); w != nil {
			if err := e.cl.SignalWorker(w, syscall.SIGSTOP); err != nil {
				verb = fmt.Sprintf("SIGSTOP (failed: %v) ", err)
			}
		}
	}
	if mode == mkLeader {
		e.cl.Kill(leader)
		victims = []string{"leader " + e.cl.Controllers[leader].ID}
	}
	e.mu.Lock()
	e.migs.Kills[mode]++
	if seen == "" {
		e.migs.KilledMigrating++
	}
	e.mu.Unlock()
	return what + ": " + verb + strings.Join(victims, " and "), nil
}
