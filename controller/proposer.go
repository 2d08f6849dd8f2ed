package controller

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	"github.com/lumen-project/lumen/fsm"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// errNotLeader: this replica stopped leading before the command was proposed.
var errNotLeader = errors.New("controller: not the leader")

// proposer coalesces commands into log entries (group commit). Callers
// append to a queue; one goroutine, run, proposes an entry as soon as fewer
// than `inflight` entries are waiting to apply, taking everything queued.
// A lone command is proposed at once; under load commands pile up while
// earlier entries replicate. (A mutex-guarded queue rather than a channel:
// hundreds of callers selecting on one channel contended on its lock.)
type proposer struct {
	raft    *raft.Raft
	wake    chan struct{} // buffered 1: something was queued
	slots   chan struct{}
	max     int
	metrics *metrics
	stop    <-chan struct{}

	mu      sync.Mutex // guards queue and stopped
	queue   []*proposal
	stopped bool
}

type proposal struct {
	cmd  *pb.Command
	done chan proposalResult // buffered 1
}

type proposalResult struct {
	res   fsm.Result
	index uint64
	err   error
}

func newProposer(r *raft.Raft, max, inflight int, m *metrics, stop <-chan struct{}) *proposer {
	return &proposer{raft: r, wake: make(chan struct{}, 1), slots: make(chan struct{}, inflight),
		max: max, metrics: m, stop: stop}
}

// propose commits cmd and returns its result. When ctx ends first the
// command may still commit: the caller's outcome is unknown, and writes are
// idempotent so it may retry.
func (p *proposer) propose(ctx context.Context, cmd *pb.Command) (proposalResult, error) {
	pr := &proposal{cmd: cmd, done: make(chan proposalResult, 1)}
	p.mu.Lock()
	if p.stopped {
		p.mu.Unlock()
		return proposalResult{}, errNotLeader
	}
	p.queue = append(p.queue, pr)
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
	select {
	case r := <-pr.done:
		return r, r.err
	case <-ctx.Done():
		return proposalResult{}, ctx.Err()
	case <-p.stop:
		// It may still commit; the caller retries on the next leader.
		return proposalResult{}, errNotLeader
	}
}

// enqueue queues cmds, in order and together (no other caller's command
// lands between them), and returns their proposals: each one's done
// channel gets its result. It does not wait. After leadership is lost it
// returns errNotLeader; a queued proposal then gets errNotLeader on done.
func (p *proposer) enqueue(cmds ...*pb.Command) ([]*proposal, error) {
	prs := make([]*proposal, len(cmds))
	for i, c := range cmds {
		prs[i] = &proposal{cmd: c, done: make(chan proposalResult, 1)}
	}
	p.mu.Lock()
	if p.stopped {
		p.mu.Unlock()
		return nil, errNotLeader
	}
	p.queue = append(p.queue, prs...)
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
	return prs, nil
}

func (p *proposer) run() {
	var waiters sync.WaitGroup
	defer waiters.Wait()
	defer p.failQueued()
	for {
		select {
		case <-p.wake:
		case <-p.stop:
			return
		}
		for {
			// Wait for a slot first: commands queue up meanwhile.
			select {
			case p.slots <- struct{}{}:
			case <-p.stop:
				return
			}
			p.mu.Lock()
			n := min(len(p.queue), p.max)
			batch := p.queue[:n:n]
			p.queue = p.queue[n:]
			p.mu.Unlock()
			if n == 0 {
				<-p.slots
				break
			}
			p.submit(batch, &waiters)
		}
	}
}

func (p *proposer) submit(batch []*proposal, waiters *sync.WaitGroup) {
	entry := &pb.LogEntry{Commands: make([]*pb.Command, len(batch))}
	stamp := time.Now().UnixNano()
	for i, pr := range batch {
		pr.cmd.StampedUnixNano = stamp
		entry.Commands[i] = pr.cmd
	}
	data, err := proto.Marshal(entry)
	if err != nil {
		fail(batch, err)
		<-p.slots
		return
	}
	p.metrics.batchSize.Observe(float64(len(batch)))
	for _, c := range entry.Commands {
		typ := fsm.CommandType(c)
		p.metrics.proposedCommands.WithLabelValues(typ).Inc()
		p.metrics.proposedBytes.WithLabelValues(typ).Add(float64(proto.Size(c)))
	}
	start := time.Now()
	fut := p.raft.Apply(data, 0)
	waiters.Go(func() {
		defer func() { <-p.slots }()
		if err := fut.Error(); err != nil {
			fail(batch, err)
			return
		}
		p.metrics.commitTime.Observe(time.Since(start).Seconds())
		res, ok := fut.Response().([]fsm.Result)
		if !ok || len(res) != len(batch) {
			fail(batch, errors.New("controller: FSM returned no result for the entry"))
			return
		}
		for i, pr := range batch {
			pr.done <- proposalResult{res: res[i], index: fut.Index()}
		}
	})
}

// failQueued fails everything still queued once leadership is gone, and
// refuses what comes after.
func (p *proposer) failQueued() {
	p.mu.Lock()
	q := p.queue
	p.queue, p.stopped = nil, true
	p.mu.Unlock()
	fail(q, errNotLeader)
}

func fail(batch []*proposal, err error) {
	for _, pr := range batch {
		pr.done <- proposalResult{err: err}
	}
}
