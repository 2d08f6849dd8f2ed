package fsm

import (
	"math/rand"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// TestStateHashIsLabelledWithItsIndex: a state hash read while entries are
// applied must be the hash of the state at the index it is labelled with.
// The applied index used to be published after the FSM lock was released, so
// a reader in between hashed the new state under the old index (and replicas
// compared hashes at an index that did not match them).
func TestStateHashIsLabelledWithItsIndex(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	log := randomLog(rng, 300)

	// The hash at each index, from a replica nobody reads concurrently.
	ref := newHarness(t)
	want := map[uint64]uint64{}
	for _, batch := range log {
		ref.apply(proto.Clone(&pb.LogEntry{Commands: batch}).(*pb.LogEntry).Commands...)
		h, idx, err := ref.f.StateHash()
		if err != nil {
			t.Fatal(err)
		}
		want[idx] = h
	}

	for round := 0; round < 8; round++ {
		h := newHarness(t)
		entries := make([]*raft.Log, len(log))
		for i, batch := range log {
			entries[i] = h.entry(proto.Clone(&pb.LogEntry{Commands: batch}).(*pb.LogEntry).Commands...)
		}
		var applying atomic.Bool
		applying.Store(true)
		var wg sync.WaitGroup
		wg.Go(func() {
			defer applying.Store(false)
			for _, e := range entries {
				h.f.Apply(e)
			}
		})
		var bad atomic.Value
		for r := 0; r < 3; r++ {
			wg.Go(func() {
				for applying.Load() {
					hash, idx, err := h.f.StateHash()
					if err != nil {
						bad.Store(err.Error())
						return
					}
					if idx > 0 && want[idx] != hash {
						bad.Store("a state hash was labelled with the wrong index")
						return
					}
				}
			})
		}
		wg.Wait()
		if msg := bad.Load(); msg != nil {
			t.Fatalf("seed %d, round %d: %s", seed, round, msg)
		}
	}
}
