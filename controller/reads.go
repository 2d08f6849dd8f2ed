package controller

import (
	"context"
	"sync"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// maxReadRounds caps concurrent VerifyLeader rounds; reads that arrive while
// every round is busy share the next one.
const maxReadRounds = 2

// readBatcher serves linearizable reads on the leader. A round takes every
// read waiting when it starts, records the commit index, confirms leadership
// with a quorum (VerifyLeader), and waits for the FSM to apply up to the
// recorded index; then each read in it may read local state. A read that
// arrives during a round joins a later one, so its commit index is recorded
// after it arrived.
type readBatcher struct {
	n  *Node
	ls *leaderState

	mu      sync.Mutex // guards waiting
	waiting []chan error

	kick  chan struct{}
	slots chan struct{}
}

func newReadBatcher(n *Node, ls *leaderState) *readBatcher {
	return &readBatcher{n: n, ls: ls, kick: make(chan struct{}, 1), slots: make(chan struct{}, maxReadRounds)}
}

// read returns nil once local state reflects every write acknowledged before
// the call.
func (b *readBatcher) read(ctx context.Context) error {
	ch := make(chan error, 1)
	b.mu.Lock()
	b.waiting = append(b.waiting, ch)
	b.mu.Unlock()
	select {
	case b.kick <- struct{}{}:
	default:
	}
	select {
	case err := <-ch:
		return err
	case <-ctx.Done():
		return ctx.Err()
	case <-b.ls.stop:
		return errNotLeader
	}
}

func (b *readBatcher) run() {
	var rounds sync.WaitGroup
	defer rounds.Wait()
	for {
		select {
		case <-b.kick:
		case <-b.ls.stop:
			b.failWaiting()
			return
		}
		for {
			select {
			case b.slots <- struct{}{}:
			case <-b.ls.stop:
				b.failWaiting()
				return
			}
			b.mu.Lock()
			batch := b.waiting
			b.waiting = nil
			b.mu.Unlock()
			if len(batch) == 0 {
				<-b.slots
				break
			}
			rounds.Go(func() {
				defer func() { <-b.slots }()
				err := b.round()
				b.n.metrics.readRound.Observe(float64(len(batch)))
				for _, ch := range batch {
					ch <- err
				}
			})
		}
	}
}

func (b *readBatcher) round() error {
	idx := b.n.raft.CommitIndex()
	if err := b.n.raft.VerifyLeader().Error(); err != nil {
		return err
	}
	// Entries the FSM never sees (Raft's no-ops and barriers) can leave its
	// applied index below the commit index while nothing else is written;
	// a no-op command then carries it past.
	timer := time.NewTimer(20 * time.Millisecond)
	defer timer.Stop()
	for {
		select {
		case <-b.n.fsm.WaitApplied(idx):
			return nil
		case <-timer.C:
			ctx, cancel := context.WithTimeout(context.Background(), b.n.cfg.RequestTimeout)
			_, err := b.ls.proposer.propose(ctx, &pb.Command{Body: &pb.Command_Noop{Noop: &pb.NoopCmd{}}})
			cancel()
			if err != nil {
				return err
			}
		case <-b.ls.stop:
			return errNotLeader
		}
	}
}

func (b *readBatcher) failWaiting() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, ch := range b.waiting {
		ch <- errNotLeader
	}
	b.waiting = nil
}
