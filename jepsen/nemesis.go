package jepsen

import (
	"context"
	"fmt"
	"os"
	"sort"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/lumen-project/lumen/gateway"
	"github.com/lumen-project/lumen/internal/devcluster"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// nemesis is one kind of fault: start injects it and returns what it did;
// the fault lasts until heal (every nemesis heals through env.heal).
type nemesis struct {
	net bool // needs network namespaces
	doc string
	// timeout bounds start (default 5 s): a nemesis that waits for a
	// state (a worker in ASSIST) gets longer.
	timeout time.Duration
	// hold is how long the fault lasts before heal (default 1–3 s, at
	// random).
	hold  time.Duration
	start func(ctx context.Context, e *env) (string, error)
}

// Nemeses are the faults by name.
var Nemeses = map[string]nemesis{
	"kill-controller": {doc: "kill -9 a random controller; it restarts from its data directory (fsync'd state only) at heal",
		start: func(ctx context.Context, e *env) (string, error) {
			i := e.rng.Intn(len(e.cl.Controllers))
			e.cl.Kill(i)
			return "kill -9 " + e.cl.Controllers[i].ID, nil
		}},
	"kill-leader": {doc: "kill -9 the leader; it restarts at heal",
		start: func(ctx context.Context, e *env) (string, error) {
			i, err := e.leader(ctx)
			if err != nil {
				return "", err
			}
			e.cl.Kill(i)
			return "kill -9 leader " + e.cl.Controllers[i].ID, nil
		}},
	"kill-all-controllers": {doc: "kill -9 every controller at once: the whole quorum restarts from disk at heal",
		start: func(ctx context.Context, e *env) (string, error) {
			for i := range e.cl.Controllers {
				e.cl.Kill(i)
			}
			return "kill -9 every controller", nil
		}},
	"kill-worker": {doc: "kill -9 a random worker; it restarts (new incarnation) at heal",
		start: func(ctx context.Context, e *env) (string, error) {
			w := e.cl.Workers[e.rng.Intn(len(e.cl.Workers))]
			e.killWorker(w)
			return "kill -9 " + w.ID, nil
		}},
	"kill-holder": {doc: "kill -9 the checkpoint holder of a request in flight (or a random worker when none has one)",
		start: func(ctx context.Context, e *env) (string, error) {
			hctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			victim := e.holderInFlight(hctx)
			cancel()
			for _, w := range e.cl.Workers {
				if w.ID == victim {
					e.killWorker(w)
					return "kill -9 holder " + w.ID, nil
				}
			}
			w := e.cl.Workers[e.rng.Intn(len(e.cl.Workers))]
			e.killWorker(w)
			return "kill -9 " + w.ID + " (no holder found)", nil
		}},
	"node-kill": {doc: "kill -9 every worker of one node at once (the run puts its workers on nodes, two a node, each with -node: no checkpoint on its serving worker's node); they restart (new incarnations) at heal",
		start: func(ctx context.Context, e *env) (string, error) { return e.nodeKill(ctx) }},
	"assist-kill": {timeout: 20 * time.Second,
		doc:   "wait for a restarted worker drafting in ASSIST (kill -9 and restart one when none recovers), then kill -9 at random: the drafter, its partner, the drafter in HOTSWAP, or the leader as a restarted worker registers or a drafter enters HOTSWAP; they restart at heal",
		start: func(ctx context.Context, e *env) (string, error) { return e.assistKill(ctx) }},
	"migrate": {timeout: 15 * time.Second,
		doc:   "live migration forced all along (migration for balance switched on; Operator.Migrate of a stream in flight or a placement client's request every 150-450 ms); each fault forces one more of a stream in flight (a long one when one is open) and kills -9, at random: its source, its destination, both or the leader while the pages copy, or its old source or its new owner as the commit lands; or SIGSTOPs its source or its destination while the pages copy; they restart (SIGCONT) at heal",
		start: func(ctx context.Context, e *env) (string, error) { return e.migrateKill(ctx) }},
	"gateway-kill": {doc: "kill -9 a gateway with streams in flight (the other keeps serving; the streams through it break, visibly to their clients); it restarts on its address at heal",
		start: func(ctx context.Context, e *env) (string, error) {
			if len(e.gws) < 2 {
				return "", errOneGateway
			}
			hctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			g, open := e.gatewayInFlight(hctx)
			cancel()
			// Its counters die with it: sum them first.
			e.scrapeGateway(ctx, g)
			k := GatewayKill{Gateway: g.Name, At: e.hist.Now(), Restarted: Unknown}
			e.cl.KillGateway(g)
			k.Dead = e.hist.Now()
			e.mu.Lock()
			e.kills = append(e.kills, k)
			e.mu.Unlock()
			return fmt.Sprintf("kill -9 %s (%d streams in flight)", g.Name, open), nil
		}},
	"kill-uncommitted": {timeout: 6 * time.Second,
		doc:   "stall the commits (SIGSTOP the leader), wait for a stream to start meanwhile on the worker its gateway chose, its placement not committed, and kill -9 a worker running requests (issue 16: the gateway's journal resumes them); SIGCONT and restart at heal",
		start: func(ctx context.Context, e *env) (string, error) { return e.killUncommitted(ctx) }},
	"pause-leader": {doc: "SIGSTOP the leader; SIGCONT at heal",
		start: func(ctx context.Context, e *env) (string, error) {
			i, err := e.leader(ctx)
			if err != nil {
				return "", err
			}
			return "SIGSTOP leader " + e.cl.Controllers[i].ID, e.cl.Signal(i, syscall.SIGSTOP)
		}},
	"pause-leader-long": {hold: longPause,
		doc: "SIGSTOP the leader for the gateways' dispatch deadline and 5 s more, while two gateways place on the fast path: their Place streams to it stay open and silent (its kernel still acknowledges TCP), so only their liveness moves them to the new leader before their Dispatches time out unconfirmed; SIGCONT at heal",
		start: func(ctx context.Context, e *env) (string, error) {
			if len(e.gws) < 2 {
				return "", errOneGateway
			}
			i, err := e.leader(ctx)
			if err != nil {
				return "", err
			}
			return fmt.Sprintf("SIGSTOP leader %s for %s", e.cl.Controllers[i].ID, longPause), e.cl.Signal(i, syscall.SIGSTOP)
		}},
	"pause-worker": {doc: "SIGSTOP a random worker; SIGCONT at heal",
		start: func(ctx context.Context, e *env) (string, error) {
			w := e.cl.Workers[e.rng.Intn(len(e.cl.Workers))]
			return "SIGSTOP " + w.ID, e.cl.SignalWorker(w, syscall.SIGSTOP)
		}},
	"partition-leader": {net: true, doc: "isolate the leader from every other node, workers and clients included",
		start: func(ctx context.Context, e *env) (string, error) {
			i, err := e.leader(ctx)
			if err != nil {
				return "", err
			}
			for j := range e.cl.Controllers {
				if j != i {
					if err := e.cutBoth(i, j); err != nil {
						return "", err
					}
				}
			}
			return "isolate leader " + e.cl.Controllers[i].ID, e.cutBoth(i, -1)
		}},
	"partition-halves": {net: true, doc: "split the controllers into a random majority and minority",
		start: func(ctx context.Context, e *env) (string, error) {
			perm := e.rng.Perm(len(e.cl.Controllers))
			minority := perm[:len(perm)/2]
			in := map[int]bool{}
			for _, i := range minority {
				in[i] = true
			}
			for _, a := range minority {
				for b := range e.cl.Controllers {
					if !in[b] {
						if err := e.cutBoth(a, b); err != nil {
							return "", err
						}
					}
				}
			}
			return fmt.Sprintf("minority %s cut from the rest", e.names(minority)), nil
		}},
	"partition-bridge": {net: true, doc: "two halves that cannot talk, joined through one bridge node that talks to both",
		start: func(ctx context.Context, e *env) (string, error) {
			perm := e.rng.Perm(len(e.cl.Controllers))
			bridge, rest := perm[0], perm[1:]
			left, right := rest[:len(rest)/2], rest[len(rest)/2:]
			for _, a := range left {
				for _, b := range right {
					if err := e.cutBoth(a, b); err != nil {
						return "", err
					}
				}
			}
			return fmt.Sprintf("%s | %s | %s (bridge %s)", e.names(left), e.cl.Controllers[bridge].ID, e.names(right), e.cl.Controllers[bridge].ID), nil
		}},
	"partition-one-way": {net: true, doc: "one-way loss: one controller's packets to another are dropped, the reverse direction works",
		start: func(ctx context.Context, e *env) (string, error) {
			perm := e.rng.Perm(len(e.cl.Controllers))
			a, b := perm[0], perm[1]
			if i, err := e.leader(ctx); err == nil && e.rng.Intn(2) == 0 {
				a, b = i, perm[0]
				if b == a {
					b = perm[1]
				}
			}
			return fmt.Sprintf("drop %s -> %s", e.cl.Controllers[a].ID, e.cl.Controllers[b].ID), e.net.Cut(a, b)
		}},
	"membership": {doc: "remove a voter under load; at heal it is added back, half the time replaced by an empty replica (kill -9, data directory wiped, same id and flags)",
		start: func(ctx context.Context, e *env) (string, error) {
			i := e.rng.Intn(len(e.cl.Controllers))
			id := e.cl.Controllers[i].ID
			err := e.client.Operator(ctx, func(ctx context.Context, op pb.OperatorClient) error {
				_, err := op.RemovePeer(ctx, &pb.RemovePeerRequest{Id: id})
				return err
			})
			if err != nil {
				return "", err
			}
			e.mu.Lock()
			e.removed[i] = true
			e.mu.Unlock()
			return "remove voter " + id, nil
		}},
}

// NemesisNames lists the nemeses, sorted.
func NemesisNames() []string {
	var out []string
	for n := range Nemeses {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// NemesisDoc describes a nemesis.
func NemesisDoc(name string) string { return Nemeses[name].doc }

func (e *env) names(idx []int) string {
	s := ""
	for k, i := range idx {
		if k > 0 {
			s += ","
		}
		s += e.cl.Controllers[i].ID
	}
	return "{" + s + "}"
}

func (e *env) cutBoth(a, b int) error {
	if err := e.net.Cut(a, b); err != nil {
		return err
	}
	if b < 0 {
		return nil
	}
	return e.net.Cut(b, a)
}

// holderInFlight finds the checkpoint holder of requests the gateway is
// serving now: the worker whose checkpoint store holds the most bytes (its
// own load report; the placement clients' requests never stream, so only
// real streams put pages there). A store can be empty for a moment between
// streams, so it looks for up to two seconds.
func (e *env) holderInFlight(ctx context.Context) string {
	for ctx.Err() == nil {
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		r, err := e.client.ListWorkers(qctx, &pb.ListWorkersRequest{Consistency: pb.Consistency_CONSISTENCY_STALE})
		cancel()
		if err == nil {
			best, most := "", uint64(0)
			for _, l := range r.Loads {
				if l.StoredCheckpointBytes > most {
					best, most = l.WorkerId, l.StoredCheckpointBytes
				}
			}
			if best != "" {
				return best
			}
		}
		sleepCtx(ctx, 100*time.Millisecond)
	}
	return ""
}

// gatewayInFlight picks a running gateway with streams open through it (at
// random among them, seeded), looking until ctx ends for one (a client is
// between two streams for a moment), else a random running one; it returns
// the gateway and its open streams. Only one gateway is ever down: every
// fault is healed before the next.
func (e *env) gatewayInFlight(ctx context.Context) (*devcluster.Gateway, int) {
	for {
		var busy, up []*devcluster.Gateway
		e.mu.Lock()
		for _, g := range e.gws {
			if g.Running() {
				up = append(up, g)
				if e.inflight[g.Name] > 0 {
					busy = append(busy, g)
				}
			}
		}
		e.mu.Unlock()
		if len(busy) > 0 {
			g := busy[e.rng.Intn(len(busy))]
			e.mu.Lock()
			open := e.inflight[g.Name]
			e.mu.Unlock()
			return g, open
		}
		if ctx.Err() != nil {
			return up[e.rng.Intn(len(up))], 0
		}
		sleepCtx(ctx, 20*time.Millisecond)
	}
}

// longPause is pause-leader-long's pause: past the gateways' dispatch
// deadline, so that a Dispatch sent on a stream to the paused leader just
// before the pause times out within it.
var longPause = gateway.DefaultConfig().DispatchTimeout + 5*time.Second

// nemesis injects a fault from the configured set about every Interval,
// holds it for 1–3 s (or the nemesis's hold), heals it, and stops when ctx
// ends.
func (e *env) nemesis(ctx context.Context) {
	if len(e.cfg.Nemeses) == 0 {
		<-ctx.Done()
		return
	}
	for {
		wait := e.cfg.Interval/2 + time.Duration(e.rng.Int63n(int64(e.cfg.Interval)))
		sleepCtx(ctx, wait)
		if ctx.Err() != nil {
			return
		}
		name := e.cfg.Nemeses[e.rng.Intn(len(e.cfg.Nemeses))]
		n := Nemeses[name]
		timeout := 5 * time.Second
		if n.timeout > 0 {
			timeout = n.timeout
		}
		fctx, cancel := context.WithTimeout(ctx, timeout)
		what, err := n.start(fctx, e)
		cancel()
		if err != nil {
			e.logf("nemesis %s: not injected: %v", name, err)
		} else {
			e.mu.Lock()
			e.faults[name]++
			e.mu.Unlock()
			e.logf("nemesis %s: %s", name, what)
		}
		hold := time.Second + time.Duration(e.rng.Int63n(int64(2*time.Second)))
		if n.hold > 0 {
			hold = n.hold
		}
		sleepCtx(ctx, hold)
		e.heal(context.Background())
	}
}

// heal undoes every fault: SIGCONT to all, the network whole, dead
// processes restarted from their data, removed voters added back.
func (e *env) heal(ctx context.Context) {
	e.signalAll(syscall.SIGCONT)
	if e.net != nil {
		if err := e.net.Heal(); err != nil {
			e.logf("heal network: %v", err)
		}
	}
	for i, ctl := range e.cl.Controllers {
		if !ctl.Running() {
			if err := e.cl.Restart(i); err != nil {
				e.logf("restart %s: %v", ctl.ID, err)
			}
		}
	}
	for _, w := range e.cl.Workers {
		if !w.Running() {
			if err := e.cl.StartWorker(w); err != nil {
				e.logf("restart %s: %v", w.ID, err)
			}
		}
	}
	for _, g := range e.gws {
		if g.Running() {
			continue
		}
		if err := e.cl.RestartGateway(g); err != nil {
			e.logf("restart %s: %v", g.Name, err)
			continue
		}
		at := e.hist.Now()
		e.mu.Lock()
		for i := range e.kills {
			if k := &e.kills[i]; k.Gateway == g.Name && k.Restarted == Unknown {
				k.Restarted = at
			}
		}
		e.mu.Unlock()
	}
	e.mu.Lock()
	removed := e.removed
	e.removed = map[int]bool{}
	e.mu.Unlock()
	for i := range removed {
		ctl := e.cl.Controllers[i]
		if e.rng.Intn(2) == 0 {
			// The machine is replaced: a new replica with the same id and
			// flags and no state, which must join, not bootstrap, and
			// catch up from the leader. The leader may have added the
			// removed replica back meanwhile (it is alive in Serf), and a
			// voter must never lose its log: it is killed and removed
			// again before its data goes.
			e.cl.Kill(i)
			err := e.retryOperator(ctx, func(ctx context.Context, op pb.OperatorClient) error {
				_, err := op.RemovePeer(ctx, &pb.RemovePeerRequest{Id: ctl.ID})
				if status.Code(err) == codes.NotFound {
					return nil // not a voter: nothing to remove
				}
				return err
			})
			if err == nil {
				err = os.RemoveAll(ctl.DataDir)
			}
			if err != nil {
				e.logf("heal: %s not replaced (%v): it restarts with its data", ctl.ID, err)
			}
			if rerr := e.cl.Restart(i); rerr != nil {
				e.logf("heal: restart %s: %v", ctl.ID, rerr)
			} else if err == nil {
				e.logf("heal: %s replaced by an empty replica", ctl.ID)
			}
		}
		if err := e.retryOperator(ctx, func(ctx context.Context, op pb.OperatorClient) error {
			_, err := op.AddVoter(ctx, &pb.AddVoterRequest{Id: ctl.ID, RaftAddr: ctl.RaftAddr})
			return err
		}); err != nil {
			e.logf("heal: add voter %s: %v", ctl.ID, err)
		} else {
			e.logf("heal: %s added back as a voter", ctl.ID)
		}
	}
}

// retryOperator calls the operator API until it succeeds or 20 s pass.
func (e *env) retryOperator(ctx context.Context, call func(context.Context, pb.OperatorClient) error) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		actx, cancel := context.WithTimeout(ctx, 3*time.Second)
		err := e.client.Operator(actx, call)
		cancel()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		sleepCtx(ctx, 200*time.Millisecond)
	}
}

// healAll heals and waits until the quorum has a leader every replica
// agrees on.
func (e *env) healAll(ctx context.Context) {
	e.heal(ctx)
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if _, err := e.cl.WaitLeader(wctx); err != nil {
		e.logf("after heal: %v", err)
	}
}
