package gateway

import (
	"errors"
	"fmt"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

// errGap: a worker sent a token past the next expected index.
var errGap = errors.New("gateway: token index gap")

// entry is one in-flight request's journal: its prompt and every output
// token so far, in index order. It is what a resume sends. The request's
// handler owns it; nothing else reads it.
type entry struct {
	id      string
	attempt int // re-dispatches: before the first token, or after the placement was lost
	prompt  []int32
	out     []int32
	// hashes are the prompt's page hashes, for prefix routing
	// (promptHashes, kvwatch.go); histHashes those of the prompt and
	// the first histOut output tokens but the last (placeHashes).
	hashes     []uint64
	histHashes []uint64
	histOut    int
	// regen: the request's next call sends the prompt alone, its output
	// to be decoded again (a stop-and-restart resume): it is placed by
	// the prompt's prefix.
	regen bool
	// on is the worker of the request's latest call.
	on       string
	params   params
	maxToken int
	// unsettled are closed when the Dispatches sent for attempts started
	// before their commit have their answer (or gave up waiting): the
	// request's completions go after them.
	unsettled []chan struct{}
	// excluded are the workers earlier attempts failed on or were refused
	// on; refusals counts the refused ones.
	excluded []string
	refusals int
	// diverged is set when a stop-and-restart resume regenerated a token
	// other than the journal's: the request's later resumes carry the
	// journal instead.
	diverged bool
	// lps[i] are out[i]'s logprobs when the request asks for them.
	lps []*pb.GenerateResponse
	// promptLPs are the prompt's logprobs (echo with logprobs), from the
	// first token's message: positions 1 … len(prompt)−1. A call made
	// before they came asks for them (a resume after none arrived).
	promptLPs []*pb.PromptLogprob
	// arrived is when the handler took the request; viaController whether
	// its last placement waited for the controller's commit; sent whether
	// its first Generate call has gone out (the gateway's own time up to
	// it is observed once, at that call).
	arrived       time.Time
	viaController bool
	sent          bool
}

// noteLogprobs keeps the logprobs of the token just accepted (the
// response that carried it) when the request asks for them.
func (e *entry) noteLogprobs(r *pb.GenerateResponse) {
	if e.params.logprobs {
		e.lps = append(e.lps, &pb.GenerateResponse{Token: r.Token, Logprob: r.Logprob, TopLogprobs: r.TopLogprobs})
	}
	if e.wantsPromptLogprobs() && len(r.PromptLogprobs) > 0 {
		e.promptLPs = r.PromptLogprobs
	}
}

// wantsPromptLogprobs says whether the next call must ask its worker for
// the prompt's logprobs: the request echoes them and none came yet.
func (e *entry) wantsPromptLogprobs() bool {
	return e.params.echo && e.params.logprobs && e.promptLPs == nil && len(e.prompt) > 1
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

// dispatchIDs are the ids of every attempt so far, the current one last:
// each may hold a placement until it is completed.
func (e *entry) dispatchIDs() []string {
	ids := []string{e.id}
	for a := 1; a <= e.attempt; a++ {
		ids = append(ids, fmt.Sprintf("%s~%d", e.id, a))
	}
	return ids
}

// dispatchID is the request id the controller knows for this attempt.
func (e *entry) dispatchID() string {
	if e.attempt == 0 {
		return e.id
	}
	return fmt.Sprintf("%s~%d", e.id, e.attempt)
}
