package sim

import "slices"

// simStore is a holder's checkpoint store as the worker keeps it
// (worker/checkpoint.go): pages by prefix hash under a hard budget, each
// request under its reservation, nothing stored without one. Pages carry
// no bytes here, only their size. Unlike the worker's store it does not
// share identical prefixes between requests (the simulated prompts are
// distinct), so a request's pages are found by the hash of its first page.
type simStore struct {
	budget uint64
	used   uint64
	reqs   map[string]*heldPages
	first  map[uint64]*heldPages // by the hash of page 0
	// refused counts pages refused (budget or reservation).
	refused int
}

type heldPages struct {
	hashes  []uint64 // by page index; 0 where a page is missing
	charged uint64
	oracle  bool // oraclePages': not the placement table's to release
}

func newSimStore(budget uint64) *simStore {
	return &simStore{budget: budget, reqs: map[string]*heldPages{}, first: map[uint64]*heldPages{}}
}

// noPages is what Prefix returns: the core only counts them.
var noPages = make([][]byte, 4096)

// Prefix implements core.Store.
func (s *simStore) Prefix(hashes []uint64) [][]byte {
	if len(hashes) == 0 {
		return nil
	}
	r := s.first[hashes[0]]
	n := 0
	for r != nil && n < len(hashes) && n < len(r.hashes) && r.hashes[n] == hashes[n] {
		n++
	}
	if n > len(noPages) {
		return make([][]byte, n)
	}
	return noPages[:n]
}

// Holds implements core.Store: the store holds (or refused) pages of req.
func (s *simStore) Holds(req string) bool {
	_, ok := s.reqs[req]
	return ok
}

// prefixPages returns how many pages from the first the store holds of
// req.
func (s *simStore) prefixPages(req string) int {
	r := s.reqs[req]
	n := 0
	for r != nil && n < len(r.hashes) && r.hashes[n] != 0 {
		n++
	}
	return n
}

// holdsPages reports whether the store holds at least one page of req.
func (s *simStore) holdsPages(req string) bool {
	r := s.reqs[req]
	return r != nil && r.charged > 0
}

// put stores pages first, first+1, … of a request (their hashes), or
// refuses each that would exceed the budget or the reservation.
func (s *simStore) put(req string, reserved uint64, first int, hashes []uint64, size uint64) {
	r := s.reqs[req]
	if r == nil {
		r = &heldPages{}
		s.reqs[req] = r
	}
	if end := first + len(hashes); end > cap(r.hashes) {
		// One growth for the batch, not a growslice a page.
		r.hashes = slices.Grow(r.hashes, end-len(r.hashes))
	}
	for k, hash := range hashes {
		page := first + k
		if page < len(r.hashes) && r.hashes[page] != 0 {
			continue // held already (sent again after a preemption)
		}
		if reserved == 0 || r.charged+size > reserved || s.used+size > s.budget {
			s.refused++
			continue
		}
		for len(r.hashes) <= page {
			r.hashes = append(r.hashes, 0)
		}
		r.hashes[page] = hash
		if page == 0 {
			s.first[hash] = r
		}
		r.charged += size
		s.used += size
	}
}

// oraclePages holds every page of a request at no charge: the oracle's
// cache already on the survivor (Config.Oracle), in GPU memory, not in the
// checkpoint budget.
func (s *simStore) oraclePages(req string, hashes []uint64) {
	if len(hashes) == 0 {
		return
	}
	s.release(req)
	r := &heldPages{hashes: hashes, oracle: true}
	s.reqs[req] = r
	s.first[hashes[0]] = r
}

func (s *simStore) release(req string) {
	r := s.reqs[req]
	if r == nil {
		return
	}
	if len(r.hashes) > 0 && s.first[r.hashes[0]] == r {
		delete(s.first, r.hashes[0])
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
