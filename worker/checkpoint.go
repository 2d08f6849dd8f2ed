package worker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/core"
	"github.com/lumen-project/lumen/worker/engine"
)

// pageHashes returns the prefix hash of each full page of tokens (the
// scheduling core's definition, which the holder's store keys pages by).
func pageHashes(tokens []int32, prev []uint64) []uint64 { return core.PageHashes(tokens, prev) }

// Errors the checkpoint store refuses a page with.
var (
	// errStoreFull: the page would take the store over its budget.
	errStoreFull = errors.New("worker: checkpoint store: budget full")
	// errOverReservation: the page would take its request over the
	// checkpoint footprint the controller reserved for it here.
	errOverReservation = errors.New("worker: checkpoint store: the request's reservation is full")
	// errNoReservation: the page came without a reservation (0): nothing
	// was reserved for the request, so nothing of it is stored.
	errNoReservation = errors.New("worker: checkpoint store: the request has no reservation")
)

// ckptStore is a holder's checkpoint store: KV pages of other workers'
// requests in host memory, under a hard budget, and each request under the
// footprint reserved for it. Pages are keyed by prefix hash, so identical
// prefixes share a page (charged to the request that stored it first).
type ckptStore struct {
	mu     sync.Mutex // guards all fields
	budget uint64
	used   uint64
	gen    uint64 // bumped on every change to a request's pages
	pages  map[uint64]*ckptPage
	reqs   map[string]*heldRequest
}

type ckptPage struct {
	data []byte
	refs int
}

// heldRequest is what the store holds of one request.
type heldRequest struct {
	hashes   []uint64
	charged  uint64 // bytes of the pages this request stored first
	reserved uint64 // the reservation its latest page carried
	gen      uint64 // the store's gen at the last change
	warned   bool   // a refusal of its pages was logged
}

func newCkptStore(budget uint64) *ckptStore {
	return &ckptStore{budget: budget, pages: map[uint64]*ckptPage{}, reqs: map[string]*heldRequest{}}
}

// put stores a page for a request, or refuses it: past the store's budget,
// past the request's reservation, or without one. A refusal returns
// firstRefusal set the first time one of the request's pages is refused, so
// the caller logs it once.
func (s *ckptStore) put(req string, reserved, hash uint64, data []byte) (firstRefusal bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.reqs[req]
	if r == nil {
		r = &heldRequest{}
		s.reqs[req] = r
	}
	s.gen++
	r.gen = s.gen
	refuse := func(err error) (bool, error) {
		first := !r.warned
		r.warned = true
		return first, err
	}
	if reserved == 0 {
		return refuse(errNoReservation)
	}
	r.reserved = reserved
	if p, ok := s.pages[hash]; ok {
		if !slices.Contains(r.hashes, hash) {
			p.refs++
			r.hashes = append(r.hashes, hash)
		}
		return false, nil
	}
	size := uint64(len(data))
	if r.charged+size > reserved {
		return refuse(fmt.Errorf("%w: %d bytes stored of %d reserved, the page has %d", errOverReservation, r.charged, reserved, size))
	}
	if s.used+size > s.budget {
		return refuse(fmt.Errorf("%w: %d bytes stored of %d, the page has %d", errStoreFull, s.used, s.budget, size))
	}
	s.pages[hash] = &ckptPage{data: data, refs: 1}
	r.hashes = append(r.hashes, hash)
	r.charged += size
	s.used += size
	return false, nil
}

// release drops a request's pages (those no other request shares).
func (s *ckptStore) release(req string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.releaseLocked(req)
}

// releaseLocked is release; s.mu must be held.
func (s *ckptStore) releaseLocked(req string) {
	r := s.reqs[req]
	if r == nil {
		return
	}
	for _, h := range r.hashes {
		if p := s.pages[h]; p != nil {
			if p.refs--; p.refs == 0 {
				s.used -= uint64(len(p.data))
				delete(s.pages, h)
			}
		}
	}
	delete(s.reqs, req)
	s.gen++
}

// releaseUnchanged drops a request's pages unless they changed after
// generation gen (from requests): a page that arrived after the caller
// decided the request is no longer held here waits for the next decision.
// It reports whether it dropped them.
func (s *ckptStore) releaseUnchanged(req string, gen uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.reqs[req]
	if r == nil || r.gen != gen {
		return false
	}
	s.releaseLocked(req)
	return true
}

// heldGen is a request the store holds pages of (or refused pages of), and
// the generation of its last change.
type heldGen struct {
	req string
	gen uint64
}

// requests lists the requests the store knows, by id.
func (s *ckptStore) requests() []heldGen {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]heldGen, 0, len(s.reqs))
	for id, r := range s.reqs {
		out = append(out, heldGen{id, r.gen})
	}
	slices.SortFunc(out, func(a, b heldGen) int { return strings.Compare(a.req, b.req) })
	return out
}

// stored returns the bytes the store holds of a request (those it was
// charged) and the reservation its pages carried; ok is false when it holds
// nothing of it.
func (s *ckptStore) stored(req string) (charged, reserved uint64, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.reqs[req]
	if r == nil {
		return 0, 0, false
	}
	return r.charged, r.reserved, true
}

// prefixPages returns how many of a request's pages the store holds. A
// request's pages arrive in page order from its serving worker's sender,
// so they are its prefix, but for a page the store's budget refused while
// later ones fitted (the budget freed in between): then the count is
// above the restorable prefix, which only orders a plan's copies.
func (s *ckptStore) prefixPages(req string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.reqs[req]; r != nil {
		return len(r.hashes)
	}
	return 0
}

// prefix returns the pages of the longest contiguous prefix it holds.
func (s *ckptStore) prefix(hashes []uint64) [][]byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out [][]byte
	for _, h := range hashes {
		p, ok := s.pages[h]
		if !ok {
			break
		}
		out = append(out, p.data)
	}
	return out
}

// reset drops every page.
func (s *ckptStore) reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.used = 0
	s.gen++
	s.pages, s.reqs = map[uint64]*ckptPage{}, map[string]*heldRequest{}
}

// usage returns the bytes stored, the budget, and the requests known.
func (s *ckptStore) usage() (used, budget uint64, requests int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.used, s.budget, len(s.reqs)
}

// ckptJob is a page to send to a holder.
type ckptJob struct {
	req      string
	reserved uint64 // the request's reserved footprint on the holder
	seq      engine.SeqID
	page     int
	hash     uint64
}

// ckptQueue bounds the pages waiting to go to one holder: when it is full the
// request's checkpoint falls behind; decoding never waits.
const ckptQueue = 1024

// ckptSender streams pages to one holder over a long-lived Checkpoint call.
type ckptSender struct {
	w      *Worker
	holder string
	jobs   chan ckptJob
	// down: the last send to the holder failed (unreachable, stream
	// broken); the next that succeeds clears it.
	down atomic.Bool

	mu       sync.Mutex // guards releases
	releases []string
	wake     chan struct{}
}

// sender returns the sender for a holder, starting it on first use.
func (w *Worker) sender(holder string) *ckptSender {
	w.mu.Lock()
	defer w.mu.Unlock()
	if s, ok := w.senders[holder]; ok {
		return s
	}
	s := &ckptSender{w: w, holder: holder, jobs: make(chan ckptJob, ckptQueue), wake: make(chan struct{}, 1)}
	w.senders[holder] = s
	w.goFunc(s.run)
	return s
}

// release asks the holder to drop a request's pages; it never blocks.
func (s *ckptSender) release(req string) {
	s.mu.Lock()
	s.releases = append(s.releases, req)
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *ckptSender) run() {
	var stream grpc.ClientStreamingClient[pb.CheckpointMessage, pb.CheckpointAck]
	defer func() {
		if stream != nil {
			_, _ = stream.CloseAndRecv()
		}
	}()
	send := func(m *pb.CheckpointMessage) {
		if stream == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			cc, err := s.w.peers.Conn(ctx, s.holder)
			cancel()
			if err == nil {
				stream, err = pb.NewInferenceClient(cc).Checkpoint(context.Background())
			}
			if err != nil {
				s.down.Store(true)
				s.w.metrics.ckptDropped.Inc()
				return
			}
		}
		if err := stream.Send(m); err != nil {
			stream = nil
			s.down.Store(true)
			s.w.metrics.ckptDropped.Inc()
			return
		}
		s.down.Store(false)
		if !m.Release {
			s.w.metrics.ckptSent.Inc()
		}
	}
	for {
		select {
		case <-s.w.stop:
			return
		case j := <-s.jobs:
			data, err := s.w.cfg.Engine.ExportPage(j.seq, j.page)
			if err != nil {
				continue // the sequence ended or was preempted meanwhile
			}
			send(&pb.CheckpointMessage{RequestId: j.req, PageIndex: uint32(j.page), PrefixHash: j.hash, Data: data,
				ReservedBytes: j.reserved})
		case <-s.wake:
		}
		s.mu.Lock()
		rel := s.releases
		s.releases = nil
		s.mu.Unlock()
		for _, req := range rel {
			send(&pb.CheckpointMessage{RequestId: req, Release: true})
		}
	}
}
