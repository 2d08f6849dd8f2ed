// Package policy holds lumen's pure decision functions: which worker serves a
// new request (Llumnix freeness), which worker holds its KV checkpoint (h(r)
// for the LUMEN strategy, a fixed ring for fixed checkpointing), where the
// requests of a failed worker resume (the recovery plan), which full-service
// worker a restarted worker in ASSIST drafts for (pairing), and which running
// requests migrate where (Llumnix's migration scheduling, run by the leader
// and checked again in Apply).
//
// Everything here is deterministic: no I/O, no clock, no randomness, no map
// iteration. The fsm package calls these functions inside Raft's Apply, so
// every replica derives the same decision at the same log index. Inputs are
// slices sorted by worker id; ties always break toward the smaller id.
package policy

import (
	"math"

	"github.com/lumen-project/lumen/internal/kvpage"
)

// Strategy is the cluster's failure-recovery strategy.
type Strategy int

// The strategies. Their values match lumenpb.Strategy.
const (
	// Lumen checkpoints each request to the holder h(r) chooses and
	// recovers with locality (PlanRecovery).
	Lumen Strategy = 1
	// FixedCheckpoint is DéjàVu's: the holder is the serving worker's
	// successor on a fixed ring, and every request restores there.
	FixedCheckpoint Strategy = 2
	// StopAndRestart is the seed's baseline (KServe, TGI, Triton, vLLM on
	// Kubernetes): no checkpoints; an interrupted request runs again from
	// its prompt on the least-loaded worker, decoding the output tokens it
	// had sent again (the gateway checks them against its journal and
	// suppresses them: the client sees neither a repeat nor a gap).
	StopAndRestart Strategy = 3
	// RecomputeHistory ("recompute") is Dynamo's: no checkpoints; an interrupted request is
	// prefilled again with its whole history, prompt and output, on the
	// least-loaded worker, and continues at its next token.
	RecomputeHistory Strategy = 4
)

// Strategies are every strategy, in value order.
var Strategies = []Strategy{Lumen, FixedCheckpoint, StopAndRestart, RecomputeHistory}

// String returns the strategy's name as operators type it.
func (s Strategy) String() string {
	switch s {
	case Lumen:
		return "lumen"
	case FixedCheckpoint:
		return "fixed-checkpoint"
	case StopAndRestart:
		return "stop-and-restart"
	case RecomputeHistory:
		return "recompute"
	}
	return "unknown"
}

// Known reports whether s is one of Strategies.
func (s Strategy) Known() bool { return s >= Lumen && s <= RecomputeHistory }

// KeepsCheckpoints reports whether the strategy gives requests checkpoint
// holders (ChooseHolder) and resumes them from their pages.
func (s Strategy) KeepsCheckpoints() bool { return s == Lumen || s == FixedCheckpoint }

// Regenerates reports whether a request resumed after a failure runs again
// from its prompt alone, its output decoded a second time (StopAndRestart),
// rather than continuing from its whole history.
func (s Strategy) Regenerates() bool { return s == StopAndRestart }

// StrategyNames lists the strategies' names for messages: "a, b, c or d".
func StrategyNames() string {
	names := ""
	for i, s := range Strategies {
		switch {
		case i == 0:
		case i == len(Strategies)-1:
			names += " or "
		default:
			names += ", "
		}
		names += s.String()
	}
	return names
}

// ParseStrategy maps an operator's name to a Strategy.
func ParseStrategy(name string) (Strategy, bool) {
	for _, s := range Strategies {
		if s.String() == name {
			return s, true
		}
	}
	return 0, false
}

// Worker is what the policies know of one worker. The fsm keeps one per
// worker, sorted by ID.
type Worker struct {
	ID string
	// Node is the worker's failure domain (issue 24): the host it runs
	// on, whose workers fail together. Empty: a domain of its own.
	Node string
	// Eligible is true for a worker in FULL_SERVICE: it may serve new
	// requests and hold checkpoints.
	Eligible bool
	// Draining is true for a worker in DRAINING: every request it serves
	// migrates away (PlanMigrations).
	Draining bool
	// MaxRunning is the most requests it runs at once (0: unknown), from
	// its registration.
	MaxRunning uint32

	// From the worker's last load report.
	QueueWaitMs    float64 // q_w
	KVPagesTotal   uint64
	KVPagesUsed    uint64
	QueueHeadPages uint64 // pages the head of its waiting queue needs
	// QueuedPages is the pages every waiting request needs, the head's
	// included (0 from a worker that does not report it: QueueHeadPages
	// stands in).
	QueuedPages uint64
	Running     uint32
	Waiting     uint32
	// HighPriority is the running and waiting requests of high priority
	// (HighPriority, issue 23) of the report: each takes
	// HighPriorityHeadroom of its pages off its freeness.
	HighPriority uint32

	// Dispatched to it since its last load report (not yet in the report).
	PendingRequests uint32
	PendingPages    uint64

	// Checkpoint accounting, kept by the fsm from placements.
	CheckpointBudget uint64  // bytes of host memory for checkpoints
	Reserved         uint64  // bytes reserved by the checkpoints it holds
	Held             uint32  // number of checkpoints it holds
	H2DBytesPerSec   float64 // host-to-GPU bandwidth, for restore delay
}

// Domain is the failure domain the holder choice keeps a checkpoint out
// of: the worker's node, or for a worker without one, the worker alone.
func (w *Worker) Domain() string {
	if w.Node != "" {
		return w.Node
	}
	return "\x00" + w.ID // no node name starts with NUL
}

// SameDomain reports whether a and b fail together: the same node, or the
// same worker.
func SameDomain(a, b *Worker) bool {
	if a.Node == "" || b.Node == "" {
		return a.ID == b.ID
	}
	return a.Node == b.Node
}

// FreeCheckpointBytes is the part of the budget not yet reserved.
func (w *Worker) FreeCheckpointBytes() uint64 {
	if w.Reserved >= w.CheckpointBudget {
		return 0
	}
	return w.CheckpointBudget - w.Reserved
}

// Freeness is Llumnix's measure of how much room a worker has: free KV pages,
// less what its waiting requests and the requests dispatched since its last
// report will take, per request the worker has to serve: running, waiting,
// and dispatched since the report. Higher is freer. An over-committed
// worker (those pages negative) has the pages it is short instead, not
// per request: any worker with room is freer than any without, and among
// those without, the one with the smallest backlog.
//
// Over-committed, the ratio measured the queue's make-up, not its length:
// with every waiting request's pages in the numerator it tends, as the
// queue grows, to minus the mean pages of a waiting request, so dispatch
// chased the queue of the shortest prompts (issue 22's trace, w8_f4 seed
// 3: four survivors offered 1.8× their capacity, one averaging 901 waiting
// and still taking arrivals while another had 545: 2,850 of the window's
// arrivals against 2,161, a TTFT of 67 s against 43 s; in Llumnix's form, with the head's
// pages alone, every request added moved it up toward 0, docs/benchmarks.md
// "Issue 27"). The pages short are the backlog a worker admits as its
// running requests free their pages.
//
// Every waiting request's pages count (QueuedPages), not only the queue
// head's as in Llumnix: a request dispatched to the worker counts with its
// prompt's pages until the next report (PendingPages), and counting only
// the head's once the report says it waits forgave the rest of the queue
// at every report. A worker whose batch had just shrunk — a drafter's
// target decoding several tokens a step once its queue emptied, a worker
// back from its reload — then looked free for a queue many times its free
// pages, took every arrival for seconds, and admitted them at its prefill
// rate: issue 22's trace (docs/benchmarks.md), where the assisted worker
// of w8 seed 2 went from 0 to 162 waiting in under 3 s while the others had 1–6.
//
// Every waiting request counts, not only the queue as a whole: a worker's
// batch is capped (MaxRunning) well before its KV cache fills for
// conversational lengths, so a queue forms while most pages are free, and a
// request dispatched there waits for every request ahead of it. Counting the
// queue as one made a worker with 40 waiting look as free as one with 1
// (issue 12: with half the cluster down, dispatch piled arrivals onto the
// survivor whose running requests happened to be shortest).
//
// A worker serving high-priority requests reserves headroom for them
// (Llumnix's virtual usage, OSDI'24 §4.4.3): each takes
// HighPriorityHeadroom of the worker's pages off its free ones, so that
// dispatch places fewer normal requests beside it and balance moves
// requests off it sooner; the high-priority requests decode in a smaller
// batch and find pages when their queue would otherwise block.
func (w *Worker) Freeness() float64 {
	free, batch := w.FreePages()
	return FreenessOf(free, batch)
}

// FreePages is Freeness's two terms: the pages free after every demand
// counted (negative: the pages short), and the batch they are shared by
// (at least 1).
func (w *Worker) FreePages() (free, batch float64) {
	free = float64(w.KVPagesTotal) - float64(w.KVPagesUsed) -
		float64(w.Queued()) - float64(w.PendingPages) - w.HeadroomPages()
	batch = float64(w.Running) + float64(w.Waiting) + float64(w.PendingRequests)
	return free, max(batch, 1)
}

// FreenessOf is Freeness of free pages shared by batch requests: per
// request while free is positive, the pages short (whatever the batch)
// once it is not. Continuous at 0.
func FreenessOf(free, batch float64) float64 {
	if free < 0 {
		return free // over-committed: the pages short, whatever the batch
	}
	return free / batch
}

// Queued is the pages the worker's waiting requests need to start as its
// report says: QueuedPages, or the head's alone from a worker that does
// not report the queue's.
func (w *Worker) Queued() uint64 { return max(w.QueuedPages, w.QueueHeadPages) }

// Request priorities (issue 23) follow vLLM's API: an integer, lower
// served first, 0 the default. lumen takes MinPriority..MaxPriority; a
// request below 0 is high priority (HighPriority).
const (
	MinPriority = -100
	MaxPriority = 100
)

// HighPriority reports whether a request of priority p is high priority:
// more urgent than the default. Workers admit and step requests in
// priority order whatever the value; the cluster's policy (headroom in
// freeness, first to migrate) knows the two classes, as Llumnix's does.
func HighPriority(p int32) bool { return p < 0 }

// HighPriorityHeadroom is the share of a worker's KV pages each of its
// high-priority requests reserves as headroom (Freeness), at most all of
// them. 0: measured in the llumnix figure's priority experiment
// (docs/benchmarks.md, "Issue 23: request priorities"), 0.1 and 0.25 made
// the high-priority P99 prefill no better and the normal requests' mean
// prefill 3-37% worse on the simulated cluster, where its queues seldom
// block; the workers' execution priority (core.Request.Priority) does
// the work there.
const HighPriorityHeadroom = 0

// HeadroomPages is the headroom the worker's high-priority requests
// reserve: HighPriorityHeadroom of its pages each, at most all of them.
func (w *Worker) HeadroomPages() float64 {
	if w.HighPriority == 0 {
		return 0
	}
	return min(float64(w.HighPriority)*HighPriorityHeadroom, 1) * float64(w.KVPagesTotal)
}

// RestoreDelayMs is p_w(r): the expected delay, in milliseconds, of copying a
// checkpoint held by w back to the GPU, taken as the reserved footprint of
// every checkpoint w already holds over its host-to-GPU bandwidth: the
// restores queued ahead of r's when the workers whose copies w holds fail
// together (a node), which is when a holder's restores queue. A worker that
// holds nothing has no queue of restores: 0.
//
// Until 8478331 p_w(r) was the mean footprint of what w holds. That term
// does not grow with the number of copies, so h(r) piled copies onto
// the few workers with the lowest q_w: 6 of 56 survivors held 258 of the
// 291 checkpoints a node of 8 left behind (issue 24), and the recovery plan
// then recomputed 24% of them on other workers to spread the restores.
func (w *Worker) RestoreDelayMs() float64 {
	if w.Held == 0 || w.H2DBytesPerSec <= 0 {
		return 0
	}
	return float64(w.Reserved) / w.H2DBytesPerSec * 1000
}

// Pages returns how many KV pages n tokens fill.
func Pages(tokens uint64) uint64 {
	return (tokens + kvpage.Tokens - 1) / kvpage.Tokens
}

// Footprint is the checkpoint reservation of a request: its maximum context
// (prompt plus max output tokens, capped at the model's context) times the KV
// bytes per token.
func Footprint(promptTokens, maxTokens, maxContext uint32, kvBytesPerToken uint64) uint64 {
	ctx := uint64(promptTokens) + uint64(maxTokens)
	if maxContext > 0 && ctx > uint64(maxContext) {
		ctx = uint64(maxContext)
	}
	return ctx * kvBytesPerToken
}

// PickServing returns the index of the eligible worker with the highest
// freeness, or -1 when none is eligible. Ties go to the smaller id.
func PickServing(ws []Worker) int {
	best, bestF := -1, math.Inf(-1)
	for i := range ws {
		if !ws[i].Eligible {
			continue
		}
		if f := ws[i].Freeness(); f > bestF {
			best, bestF = i, f
		}
	}
	return best
}

// NoHolder says why a request got no checkpoint holder.
type NoHolder string

// Reasons for a placement without a holder.
const (
	HolderFound        NoHolder = ""
	NoHolderStrategy   NoHolder = "strategy stop-and-restart keeps no checkpoints"
	NoHolderNoPeer     NoHolder = "no other worker in full service"
	NoHolderBudgetFull NoHolder = "no worker has checkpoint budget left for the request's footprint"
)

// MaxCheckpointReplicas bounds SetStrategy's replication factor: each copy
// is the request's whole footprint in some worker's host memory and its
// pages once more on the serving worker's link.
const MaxCheckpointReplicas = 4

// PickHolder is LUMEN's h(r): among eligible workers other than the serving
// worker whose free checkpoint budget covers the footprint, the one that
// minimises q_w + lambda·p_w(r). Ties go to the smaller id. It returns -1 and
// the reason when there is none.
func PickHolder(ws []Worker, serving int, footprint uint64, lambda float64) (int, NoHolder) {
	return pickHolderSkip(ws, serving, footprint, lambda, nil)
}

// pickHolderSkip is PickHolder over the workers skip (when not nil) does
// not exclude; a skipped worker counts as no peer.
func pickHolderSkip(ws []Worker, serving int, footprint uint64, lambda float64, skip func(i int) bool) (int, NoHolder) {
	best, bestScore := -1, math.Inf(1)
	peers := false
	for i := range ws {
		w := &ws[i]
		if !w.Eligible || i == serving || skip != nil && skip(i) {
			continue
		}
		peers = true
		if w.FreeCheckpointBytes() < footprint {
			continue
		}
		if score := holderScore(w, lambda); score < bestScore {
			best, bestScore = i, score
		}
	}
	switch {
	case best >= 0:
		return best, HolderFound
	case !peers:
		return -1, NoHolderNoPeer
	default:
		return -1, NoHolderBudgetFull
	}
}

// RingHolder is fixed checkpointing's holder: the next eligible worker after
// the serving worker on the ring of workers ordered by id, whatever its load.
// When that worker's budget cannot cover the footprint there is no holder:
// the ring does not look further.
func RingHolder(ws []Worker, serving int, footprint uint64) (int, NoHolder) {
	n := len(ws)
	for step := 1; step < n; step++ {
		i := (serving + step) % n
		if !ws[i].Eligible {
			continue
		}
		if ws[i].Reserved+footprint > ws[i].CheckpointBudget {
			return -1, NoHolderBudgetFull
		}
		return i, HolderFound
	}
	return -1, NoHolderNoPeer
}

// ChooseHolder applies the strategy's holder rule. idx, when not nil, is the
// HolderIndex of ws and answers LUMEN's h(r). It is ChooseHolders for one
// copy.
func ChooseHolder(s Strategy, ws []Worker, idx *HolderIndex, serving int, footprint uint64, lambda float64) (int, NoHolder) {
	c := ChooseHolders(s, ws, idx, serving, footprint, lambda, 1, nil)
	if len(c.Holders) == 0 {
		return -1, c.Why
	}
	return c.Holders[0], HolderFound
}

// HolderChoice is where a request's checkpoint copies go.
type HolderChoice struct {
	// Holders are the indices of the copies' holders, the first copy's
	// first; empty when there is none (Why says why).
	Holders []int
	Why     NoHolder
	// SameDomain: no worker outside the serving worker's node had the
	// budget, and the first copy went to a worker of that node.
	SameDomain bool
	// Short: fewer copies than asked, for want of budget in distinct
	// domains.
	Short bool
}

// ChooseHolders is F(r) and h(r) with failure domains (issue 24): up to
// replicas copies, each chosen by the strategy's rule among the workers
// whose domain (Worker.Domain) is neither the serving worker's nor that of
// a copy already chosen. Under lumen every copy is h(r) over that set.
//
// When no worker outside the serving worker's node has the budget, the
// first copy falls back to h(r) over the node's other workers
// (SameDomain): such a copy does not survive the node, but it does survive
// the failure of the serving worker alone — a process crash, a GPU fault,
// an OOM kill, which are more frequent than a whole node's — where no copy
// survives nothing. Further copies never fall back (Short): a second copy
// in a domain that already has one survives nothing the first does not.
//
// fixed-checkpoint is DéjàVu's ring whatever the domains, as the anchor
// places it, and keeps one copy. idx, when not nil, is the HolderIndex of
// ws. dst, when not nil, is reused for Holders.
func ChooseHolders(s Strategy, ws []Worker, idx *HolderIndex, serving int, footprint uint64, lambda float64, replicas int, dst []int) HolderChoice {
	c := HolderChoice{Holders: dst[:0]}
	switch s {
	case StopAndRestart, RecomputeHistory:
		c.Why = NoHolderStrategy
		return c
	case FixedCheckpoint:
		h, why := RingHolder(ws, serving, footprint)
		if h >= 0 {
			c.Holders = append(c.Holders, h)
		}
		c.Why = why
		return c
	}
	replicas = max(replicas, 1)
	pick := func(skip func(i int) bool) (int, NoHolder) {
		if idx != nil {
			return idx.PickSkip(serving, footprint, skip)
		}
		return pickHolderSkip(ws, serving, footprint, lambda, skip)
	}
	var sw *Worker
	if serving >= 0 && serving < len(ws) {
		sw = &ws[serving]
	}
	// taken: the domain is the serving worker's or a chosen copy's.
	taken := func(i int) bool {
		w := &ws[i]
		if sw != nil && SameDomain(w, sw) {
			return true
		}
		for _, h := range c.Holders {
			if SameDomain(w, &ws[h]) {
				return true
			}
		}
		return false
	}
	for len(c.Holders) < replicas {
		h, why := pick(taken)
		if h < 0 && len(c.Holders) == 0 {
			// The fallback: the serving worker's own node.
			if h, why = pick(nil); h >= 0 {
				c.SameDomain = true
			}
		}
		if h < 0 {
			if len(c.Holders) == 0 {
				c.Why = why
			} else {
				c.Short = true
			}
			return c
		}
		c.Holders = append(c.Holders, h)
		if c.SameDomain {
			c.Short = replicas > 1
			return c
		}
	}
	return c
}
