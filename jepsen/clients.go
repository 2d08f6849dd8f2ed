package jepsen

import (
	"context"
	"fmt"
	"math/rand"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/placer"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// The placement clients take the paths a gateway takes (issue 16), so the
// placement model checks each of them:
//
//   - modeUnary: the unary Dispatch (the controller chooses the worker),
//     Complete and GetPlacement, one call per operation.
//   - modePlace: Dispatch and Complete on a Place stream of its own (one
//     ctlclient.Placer, in a session of its own, as a gateway has), naming
//     the worker a placer.Replica fed by WatchLoad chose — now and then a
//     worker incarnation the table shows gone, which the controller must
//     refuse (WORKER_UNAVAILABLE); reads are unary.
//   - modeBatch: the Place stream as modePlace, but its Dispatches go on
//     one Placer all batch clients share (as a gateway's many requests do:
//     concurrent Dispatches ride one batch, and each must get its own
//     answer), and reads in GetPlacements batches: its own id with ids of
//     other clients, each id's read an operation of its own, called when the
//     batch is sent and returned when its answer arrives.
type clientMode int

const (
	modeUnary clientMode = iota
	modePlace
	modeBatch
)

// modeOf is placement client c's mode: the three in turn.
func modeOf(c int) clientMode { return clientMode(c % 3) }

func (m clientMode) String() string {
	return [...]string{"unary", "place", "batch"}[m]
}

// opTimeout bounds one placement operation (a unary call, a Dispatch or a
// Complete on the stream, a batch of reads): past it the outcome of a write
// is unknown.
const opTimeout = 2 * time.Second

// deadPercent of the stream clients' Dispatches name a worker incarnation
// the load table shows gone (failed, left, or replaced by a newer one),
// when it shows one.
const deadPercent = 5

// clientSessionTTL is a stream client's session TTL: it outlives the run,
// so no placement ends with its session (the model has no such move). The
// session is destroyed at quiescence.
const clientSessionTTL = time.Hour

// PlaceStats counts what the stream clients' choices of worker met.
type PlaceStats struct {
	Named        int // Dispatches naming the replica's choice
	Fallback     int // no table yet, or no eligible worker in it: the controller chose
	DeadNamed    int // Dispatches naming an incarnation the table showed gone
	Unavailable  int // refused WORKER_UNAVAILABLE
	BatchReads   int // GetPlacements calls
	BatchIDs     int // ids they read
	StreamErrors int // Place streams that broke, or openings refused (the Placer's OnError)
}

func (s PlaceStats) String() string {
	return fmt.Sprintf("%d dispatches named the replica's choice, %d the controller's (no table or no eligible worker), %d a dead incarnation; %d refused WORKER_UNAVAILABLE; %d GetPlacements batches of %d ids; %d Place stream errors (breaks and refused openings)",
		s.Named, s.Fallback, s.DeadNamed, s.Unavailable, s.BatchReads, s.BatchIDs, s.StreamErrors)
}

// loadView is the gateways' view of the cluster the stream clients share:
// a placer.Replica fed by WatchLoad, and the last table (for incarnations
// the table shows gone).
type loadView struct {
	replica *placer.Replica
	mu      sync.Mutex
	last    *pb.LoadTable
}

// watchLoad feeds e.load until ctx ends.
func (e *env) watchLoad(ctx context.Context) {
	_ = e.client.WatchLoad(ctx, 10*time.Millisecond, 0, func(t *pb.LoadTable) {
		e.load.replica.Update(t)
		e.load.mu.Lock()
		if e.load.last == nil || t.AppliedIndex >= e.load.last.AppliedIndex {
			e.load.last = t
		}
		e.load.mu.Unlock()
	})
}

// deadIncarnation picks, with rng, a worker incarnation the last table
// shows gone for good: a FAILED or LEFT row's (an incarnation never comes
// back), or the one before a row's current one (incarnations only grow).
func (e *env) deadIncarnation(rng *rand.Rand) (string, uint64, bool) {
	e.load.mu.Lock()
	t := e.load.last
	e.load.mu.Unlock()
	type wi struct {
		w   string
		inc uint64
	}
	var dead []wi
	for _, w := range t.GetWorkers() {
		switch {
		case w.Phase == pb.WorkerPhase_WORKER_PHASE_FAILED || w.Phase == pb.WorkerPhase_WORKER_PHASE_LEFT:
			dead = append(dead, wi{w.WorkerId, w.Incarnation})
		case w.Incarnation > 1:
			dead = append(dead, wi{w.WorkerId, w.Incarnation - 1})
		}
	}
	if len(dead) == 0 {
		return "", 0, false
	}
	sort.Slice(dead, func(i, j int) bool { return dead[i].w < dead[j].w })
	d := dead[rng.Intn(len(dead))]
	return d.w, d.inc, true
}

// pclient is one placement client: its mode, and for the stream modes its
// session and Place stream.
type pclient struct {
	e       *env
	c       int
	mode    clientMode
	rng     *rand.Rand
	session string
	placer  *ctlclient.Placer // its own: its Completes, and modePlace's Dispatches
	// dispatcher carries its Dispatches: placer, or with modeBatch the
	// Placer the batch clients share.
	dispatcher *ctlclient.Placer
}

// sharedPlacer is the Place stream the batch clients' Dispatches share,
// opened on first use; closed by closeShared.
func (e *env) sharedPlacer() *ctlclient.Placer {
	e.sharedOnce.Do(func() { e.shared = e.client.NewPlacer(ctlclient.PlacerOptions{OnError: e.placerError}) })
	return e.shared
}

// closeShared closes the shared Placer once its clients are done.
func (e *env) closeShared() {
	if e.shared == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := e.shared.Close(ctx); err != nil {
		e.logf("shared placer: %v", err)
	}
}

func (e *env) placerError(addr string, err error) {
	e.mu.Lock()
	e.place.StreamErrors++
	e.mu.Unlock()
}

// newPlacementClient opens what client c's mode needs (retrying the
// session until the quorum takes it or ctx ends: a client without one
// stays idle).
func (e *env) newPlacementClient(ctx context.Context, c int) *pclient {
	pc := &pclient{e: e, c: c, mode: modeOf(c), rng: rand.New(rand.NewSource(e.cfg.Seed*1000 + int64(c)))}
	if pc.mode == modeUnary {
		return pc
	}
	for ctx.Err() == nil {
		sctx, cancel := context.WithTimeout(ctx, opTimeout)
		r, err := e.client.CreateSession(sctx, &pb.CreateSessionRequest{Owner: fmt.Sprintf("jepsen-client-%d", c), TtlMs: uint32(clientSessionTTL.Milliseconds())})
		cancel()
		if err == nil {
			pc.session = r.Session.GetId()
			break
		}
		sleepCtx(ctx, 100*time.Millisecond)
	}
	if pc.session == "" {
		return pc
	}
	e.mu.Lock()
	e.sessions = append(e.sessions, pc.session)
	e.mu.Unlock()
	pc.placer = e.client.NewPlacer(ctlclient.PlacerOptions{OnError: e.placerError})
	pc.dispatcher = pc.placer
	if pc.mode == modeBatch {
		pc.dispatcher = e.sharedPlacer()
	}
	return pc
}

// close flushes the stream's completes (for a while: the faults may still
// be on) and stops it.
func (pc *pclient) close() {
	if pc.placer == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := pc.placer.Close(ctx); err != nil {
		pc.e.logf("placement client %d: %v", pc.c, err)
	}
}

// ready reports whether the client can run its mode.
func (pc *pclient) ready() bool { return pc.mode == modeUnary || pc.placer != nil }

// dispatch places id.
func (pc *pclient) dispatch(id string) Op {
	if pc.mode == modeUnary {
		return pc.e.op(pc.c, Dispatch, id)
	}
	e := pc.e
	op := Op{Client: pc.c, Kind: Dispatch, ID: id, Via: ViaPlace}
	req := &pb.DispatchRequest{RequestId: id, PromptTokens: 16, MaxTokens: 16, SessionId: pc.session}
	took := false
	if pc.rng.Intn(100) < deadPercent {
		if w, inc, ok := e.deadIncarnation(pc.rng); ok {
			req.WorkerId, req.WorkerIncarnation, op.Dead = w, inc, true
		}
	}
	if req.WorkerId == "" {
		if w, inc, ok := e.load.replica.Take(id, req.PromptTokens); ok {
			req.WorkerId, req.WorkerIncarnation, took = w, inc, true
		}
	}
	op.Chose, op.ChoseInc = req.WorkerId, req.WorkerIncarnation
	op.Call = e.hist.Now()
	octx, cancel := context.WithTimeout(context.Background(), opTimeout)
	r, err := pc.dispatcher.Dispatch(octx, req)
	cancel()
	op.Return = e.hist.Now()
	if err == nil {
		op.Found, op.Index = true, r.Index
		fill(&op, r.Placement)
		if got := r.Placement.GetRequestId(); got != id {
			op.Answered = got // another request's answer: CheckPlacePath
		}
		if took {
			e.load.replica.Committed(id, r.Placement.GetWorkerId(), r.Index)
		}
	} else {
		if took {
			e.load.replica.Forget(id)
		}
		op.Err, op.Refusal = err.Error(), ctlclient.Reason(err)
		if !definite(err) {
			op.Indeterminate, op.Return = true, Unknown
		}
	}
	e.mu.Lock()
	switch {
	case op.Dead:
		e.place.DeadNamed++
	case took:
		e.place.Named++
	default:
		e.place.Fallback++
	}
	if op.Refusal == ctlclient.ReasonWorkerUnavailable {
		e.place.Unavailable++
	}
	e.mu.Unlock()
	e.hist.Add(op)
	return op
}

// definite: a write refused with this error changed nothing (a gRPC status
// the controller gave); any other error (a timeout, a broken connection,
// a closed stream) leaves its outcome unknown.
func definite(err error) bool {
	switch status.Code(err) {
	case codes.InvalidArgument, codes.AlreadyExists, codes.FailedPrecondition:
		return true
	}
	return false
}

// complete completes id. On the stream, Complete is fire-and-forget: it is
// acknowledged once the Placer has no complete left unanswered (this
// client's stream carries only its own, one at a time, so that is when the
// batch carrying id was answered, or later); past opTimeout it is unknown.
func (pc *pclient) complete(id string) {
	if pc.mode == modeUnary {
		pc.e.op(pc.c, Complete, id)
		return
	}
	e := pc.e
	op := Op{Client: pc.c, Kind: Complete, ID: id, Via: ViaPlace, Call: e.hist.Now()}
	if err := pc.placer.Complete(id); err != nil {
		// Not taken (one complete at a time never fills the Placer):
		// nothing was sent.
		op.Return, op.Err = e.hist.Now(), err.Error()
		e.hist.Add(op)
		return
	}
	deadline := time.Now().Add(opTimeout)
	for {
		if _, n := pc.placer.Pending(); n == 0 {
			op.Return = e.hist.Now()
			break
		}
		if time.Now().After(deadline) {
			op.Indeterminate, op.Return, op.Err = true, Unknown, "not acknowledged within "+opTimeout.String()
			break
		}
		time.Sleep(time.Millisecond)
	}
	e.hist.Add(op)
}

// readBack reads id after its Dispatch (linearizably, and stale one time in
// three) and a recent id of other clients.
func (pc *pclient) readBack(id string) {
	e := pc.e
	if pc.mode != modeBatch {
		e.op(pc.c, GetLin, id)
		if pc.rng.Intn(3) == 0 {
			e.op(pc.c, GetStale, id)
		}
		// Someone else's request, to interleave clients on one id.
		if other := e.recentID(pc.rng); other != "" {
			e.op(pc.c, GetLin, other)
		}
		return
	}
	ids := []string{id}
	for range 1 + pc.rng.Intn(3) {
		ids = append(ids, e.recentID(pc.rng))
	}
	pc.readBatch(GetLin, ids)
	if pc.rng.Intn(3) == 0 {
		pc.readBatch(GetStale, []string{id, e.recentID(pc.rng)})
	}
}

// readAfter reads id after its Complete (with a recent id of another
// client, in a batch).
func (pc *pclient) readAfter(id string) {
	if pc.mode != modeBatch {
		pc.e.op(pc.c, GetLin, id)
		return
	}
	pc.readBatch(GetLin, []string{id, pc.e.recentID(pc.rng)})
}

// readBatch reads ids (distinct, empty ones dropped) in one GetPlacements
// call and records a read of each: all called when the batch was sent,
// returned when its answer arrived. A failed batch records failed reads
// (the checkers drop them: a read changes nothing).
func (pc *pclient) readBatch(kind Kind, ids []string) {
	e := pc.e
	seen := map[string]bool{}
	var uniq []string
	for _, id := range ids {
		if id != "" && !seen[id] {
			seen[id] = true
			uniq = append(uniq, id)
		}
	}
	cons := pb.Consistency_CONSISTENCY_LINEARIZABLE
	if kind == GetStale {
		cons = pb.Consistency_CONSISTENCY_STALE
	}
	call := e.hist.Now()
	octx, cancel := context.WithTimeout(context.Background(), opTimeout)
	r, err := e.client.GetPlacements(octx, &pb.GetPlacementsRequest{RequestIds: uniq, Consistency: cons})
	cancel()
	ret := e.hist.Now()
	found := map[string]*pb.Placement{}
	notFound := map[string]bool{}
	if err == nil {
		for _, p := range r.Placements {
			found[p.RequestId] = p
		}
		for _, id := range r.NotFound {
			notFound[id] = true
		}
	}
	for _, id := range uniq {
		op := Op{Client: pc.c, Kind: kind, ID: id, Via: ViaBatch, Call: call, Return: ret}
		switch p, ok := found[id]; {
		case err != nil:
			op.Err = err.Error()
		case ok:
			op.Found, op.Index = true, r.AppliedIndex
			fill(&op, p)
		case !notFound[id]:
			// The answer named neither: a malformed answer, not a read.
			op.Err = fmt.Sprintf("%s%d placements and %d not found for %d ids, none for %s", malformedBatch, len(r.Placements), len(r.NotFound), len(uniq), id)
		}
		e.hist.Add(op)
	}
	e.mu.Lock()
	e.place.BatchReads++
	e.place.BatchIDs += len(uniq)
	e.mu.Unlock()
}

// malformedBatch starts the error of a batched read whose answer named the
// id neither found nor not found (CheckPlacePath reports it).
const malformedBatch = "GetPlacements answered "

// CheckPlacePath checks what the gateway's path promises beyond the
// placement model: a Dispatch naming a worker incarnation is placed there
// (a placement at epoch 0 has not moved since), or refused; one naming an
// incarnation the load table already showed gone is refused
// WORKER_UNAVAILABLE, never placed; a Dispatch on a stream is answered
// with its own request's placement (a batch's answers go to their calls);
// and a GetPlacements answer accounts for every id it was asked.
func CheckPlacePath(ops []Op) Verdict {
	v := Verdict{Checker: "place-path", OK: true}
	named, dead, refused, batched := 0, 0, 0, 0
	for _, op := range ops {
		if op.Via == ViaBatch {
			batched++
			if strings.HasPrefix(op.Err, malformedBatch) {
				v.fail("%s(%s) at %s: %s", op.Kind, op.ID, fmtNanos(op.Call), op.Err)
			}
		}
		if op.Kind == Dispatch && op.Answered != "" {
			v.fail("%s at %s was answered with the placement of %s (worker %s, created at index %d)", op.ID, fmtNanos(op.Call), op.Answered, op.Worker, op.Created)
		}
		if op.Kind != Dispatch || op.Chose == "" {
			continue
		}
		named++
		if op.Dead {
			dead++
		}
		if op.Refusal == ctlclient.ReasonWorkerUnavailable {
			refused++
		}
		if op.Indeterminate || op.Err != "" {
			continue
		}
		if op.Dead {
			v.fail("%s named %s incarnation %d, which the load table showed gone, and was placed on %s incarnation %d at index %d", op.ID, op.Chose, op.ChoseInc, op.Worker, op.Inc, op.Index)
		} else if op.Epoch == 0 && (op.Worker != op.Chose || op.Inc != op.ChoseInc) {
			v.fail("%s named %s incarnation %d and was placed on %s incarnation %d at index %d", op.ID, op.Chose, op.ChoseInc, op.Worker, op.Inc, op.Index)
		}
	}
	v.Note = fmt.Sprintf("%d dispatches named a worker (%d a dead incarnation), %d refused WORKER_UNAVAILABLE; %d batched reads", named, dead, refused, batched)
	return v
}
