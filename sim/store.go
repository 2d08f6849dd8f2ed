package sim

import "slices"

// simStore is a holder's checkpoint store as the worker keeps it
// (worker/checkpoint.go): pages by prefix hash under a hard budget, each
// request under its reservation, nothing stored without one. Pages carry
// no bytes here, only their size. Unlike the worker's store it does not
// share identical prefixes between requests (the simulated prompts are
// distinct).
type simStore struct {
	budget uint64
	used   uint64
	pages  map[uint64]int // hash → requests holding it
	reqs   map[string]*heldPages
	// refused counts pages refused (budget or reservation).
	refused int
}

type heldPages struct {
	hashes  []uint64
	charged uint64
}

func newSimStore(budget uint64) *simStore {
	return &simStore{budget: budget, pages: map[uint64]int{}, reqs: map[string]*heldPages{}}
}

// noPages is what Prefix returns: the core only counts them.
var noPages = make([][]byte, 4096)

// Prefix implements core.Store.
func (s *simStore) Prefix(hashes []uint64) [][]byte {
	n := 0
	for _, h := range hashes {
		if s.pages[h] == 0 {
			break
		}
		n++
	}
	if n > len(noPages) {
		return make([][]byte, n)
	}
	return noPages[:n]
}

func (s *simStore) put(req string, reserved, hash, size uint64) {
	r := s.reqs[req]
	if r == nil {
		r = &heldPages{}
		s.reqs[req] = r
	}
	if reserved == 0 || r.charged+size > reserved || s.used+size > s.budget {
		s.refused++
		return
	}
	if s.pages[hash] > 0 {
		return // held already (sent again after a preemption)
	}
	s.pages[hash]++
	r.hashes = append(r.hashes, hash)
	r.charged += size
	s.used += size
}

func (s *simStore) release(req string) {
	r := s.reqs[req]
	if r == nil {
		return
	}
	for _, h := range r.hashes {
		if s.pages[h]--; s.pages[h] <= 0 {
			delete(s.pages, h)
		}
	}
	s.used -= r.charged
	delete(s.reqs, req)
}

// requests lists the requests the store holds pages of, sorted.
func (s *simStore) requests() []string {
	out := make([]string, 0, len(s.reqs))
	for id := range s.reqs {
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}
