package gateway

import (
	"errors"
	"fmt"
	"sync"
)

// errGap: a worker sent a token past the next expected index.
var errGap = errors.New("gateway: token index gap")

// entry is one in-flight request in the journal: its prompt and every output
// token so far, in index order. It is what a resume sends.
type entry struct {
	id       string
	attempt  int // re-dispatches before the first token
	prompt   []int32
	out      []int32
	params   params
	maxToken int
}

// accept takes the token at index idx. A repeat (idx already held, same
// token) is dropped; a repeat with another token, or a gap, is an error that
// makes the gateway resume from what it holds.
func (e *entry) accept(idx uint32, tok int32) (bool, error) {
	switch n := uint32(len(e.out)); {
	case idx == n:
		e.out = append(e.out, tok)
		return true, nil
	case idx < n:
		if e.out[idx] != tok {
			return false, fmt.Errorf("gateway: worker resent index %d as token %d, journal holds %d", idx, tok, e.out[idx])
		}
		return false, nil
	default:
		return false, fmt.Errorf("%w: got index %d, expected %d", errGap, idx, n)
	}
}

// dispatchID is the request id the controller knows for this attempt.
func (e *entry) dispatchID() string {
	if e.attempt == 0 {
		return e.id
	}
	return fmt.Sprintf("%s~%d", e.id, e.attempt)
}

// journal is every in-flight request.
type journal struct {
	mu      sync.Mutex // guards entries
	entries map[string]*entry
}

func newJournal() *journal { return &journal{entries: map[string]*entry{}} }

func (j *journal) open(e *entry) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.entries[e.id] = e
}

func (j *journal) close(id string) {
	j.mu.Lock()
	defer j.mu.Unlock()
	delete(j.entries, id)
}
