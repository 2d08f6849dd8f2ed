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

// proposer coalesces commands into log entries (group commit). One goroutine,
// run, owns the batch being built: it proposes an entry as soon as fewer than
// `inflight` entries are waiting to apply, so a lone command is proposed at
// once, and under load commands pile up into the next entry while earlier
// ones replicate.
type proposer struct {
	raft    *raft.Raft
	in      chan *proposal
	slots   chan struct{}
	max     int
	metrics *metrics
	stop    <-chan struct{}
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
	return &proposer{raft: r, in: make(chan *proposal, 4*max), slots: make(chan struct{}, inflight),
		max: max, metrics: m, stop: stop}
}

// propose commits cmd and returns its result. When ctx ends first the
// command may still commit: the caller's outcome is unknown, and writes are
// idempotent so it may retry.
func (p *proposer) propose(ctx context.Context, cmd *pb.Command) (proposalResult, error) {
	pr := &proposal{cmd: cmd, done: make(chan proposalResult, 1)}
	select {
	case p.in <- pr:
	case <-ctx.Done():
		return proposalResult{}, ctx.Err()
	case <-p.stop:
		return proposalResult{}, errNotLeader
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

func (p *proposer) run() {
	var waiters sync.WaitGroup
	defer waiters.Wait()
	for {
		var batch []*proposal
		select {
		case pr := <-p.in:
			batch = append(batch, pr)
		case <-p.stop:
			p.failQueued()
			return
		}
		// Wait for a free slot, gathering what arrives meanwhile.
		acquired := false
		for !acquired {
			in := p.in
			if len(batch) >= p.max {
				in = nil
			}
			select {
			case p.slots <- struct{}{}:
				acquired = true
			case pr := <-in:
				batch = append(batch, pr)
			case <-p.stop:
				fail(batch, errNotLeader)
				p.failQueued()
				return
			}
		}
	drain:
		for len(batch) < p.max {
			select {
			case pr := <-p.in:
				batch = append(batch, pr)
			default:
				break drain
			}
		}
		p.submit(batch, &waiters)
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

// failQueued fails everything still queued once leadership is gone.
func (p *proposer) failQueued() {
	for {
		select {
		case pr := <-p.in:
			pr.done <- proposalResult{err: errNotLeader}
		default:
			return
		}
	}
}

func fail(batch []*proposal, err error) {
	for _, pr := range batch {
		pr.done <- proposalResult{err: err}
	}
}
