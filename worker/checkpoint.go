package worker

import (
	"context"
	"encoding/binary"
	"hash/fnv"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/lumen-project/lumen/internal/kvpage"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/worker/engine"
)

// pageHashes returns the prefix hash of each full page of tokens: hash i
// covers tokens[0 : 16(i+1)], chained page by page.
func pageHashes(tokens []int32, prev []uint64) []uint64 {
	out := prev
	for i := len(prev); (i+1)*kvpage.Tokens <= len(tokens); i++ {
		h := fnv.New64a()
		var b [8]byte
		if i > 0 {
			binary.LittleEndian.PutUint64(b[:], out[i-1])
			h.Write(b[:])
		}
		for _, t := range tokens[i*kvpage.Tokens : (i+1)*kvpage.Tokens] {
			binary.LittleEndian.PutUint32(b[:4], uint32(t))
			h.Write(b[:4])
		}
		out = append(out, h.Sum64())
	}
	return out
}

// ckptStore is a holder's checkpoint store: KV pages of other workers'
// requests in host memory, under a hard budget. Pages are keyed by prefix
// hash, so identical prefixes share a page.
type ckptStore struct {
	mu       sync.Mutex // guards all fields
	budget   uint64
	used     uint64
	pages    map[uint64]*ckptPage
	byReq    map[string][]uint64
	reqBytes map[string]uint64 // bytes charged to each request
}

type ckptPage struct {
	data []byte
	refs int
}

func newCkptStore(budget uint64) *ckptStore {
	return &ckptStore{budget: budget, pages: map[uint64]*ckptPage{}, byReq: map[string][]uint64{}, reqBytes: map[string]uint64{}}
}

// put stores a page for a request. It refuses (false) a page that would take
// the store over its budget, or the request over its reservation (when one
// is known).
func (s *ckptStore) put(req string, reserved, hash uint64, data []byte) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.pages[hash]; ok {
		for _, h := range s.byReq[req] {
			if h == hash {
				return true
			}
		}
		p.refs++
		s.byReq[req] = append(s.byReq[req], hash)
		return true
	}
	size := uint64(len(data))
	if s.used+size > s.budget || (reserved > 0 && s.reqBytes[req]+size > reserved) {
		return false
	}
	s.pages[hash] = &ckptPage{data: data, refs: 1}
	s.byReq[req] = append(s.byReq[req], hash)
	s.reqBytes[req] += size
	s.used += size
	return true
}

// release drops a request's pages (those no other request shares).
func (s *ckptStore) release(req string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, h := range s.byReq[req] {
		if p := s.pages[h]; p != nil {
			if p.refs--; p.refs == 0 {
				s.used -= uint64(len(p.data))
				delete(s.pages, h)
			}
		}
	}
	delete(s.byReq, req)
	delete(s.reqBytes, req)
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
	s.pages, s.byReq, s.reqBytes = map[uint64]*ckptPage{}, map[string][]uint64{}, map[string]uint64{}
}

func (s *ckptStore) usage() (used, budget uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.used, s.budget
}

// ckptJob is a page to send to a holder.
type ckptJob struct {
	req  string
	seq  engine.SeqID
	page int
	hash uint64
}

// ckptQueue bounds the pages waiting to go to one holder: when it is full the
// request's checkpoint falls behind; decoding never waits.
const ckptQueue = 1024

// ckptSender streams pages to one holder over a long-lived Checkpoint call.
type ckptSender struct {
	w      *Worker
	holder string
	jobs   chan ckptJob

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
				s.w.metrics.ckptDropped.Inc()
				return
			}
		}
		if err := stream.Send(m); err != nil {
			stream = nil
			s.w.metrics.ckptDropped.Inc()
			return
		}
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
			send(&pb.CheckpointMessage{RequestId: j.req, PageIndex: uint32(j.page), PrefixHash: j.hash, Data: data})
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
