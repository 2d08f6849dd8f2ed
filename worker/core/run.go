package core

import (
	"time"

	"github.com/lumen-project/lumen/worker/engine"
)

// Decode runs (issue 26: the simulator at 10,000 workers). While nothing
// comes into a Core and no request finishes, a batch of requests that all
// decode makes every Next after the first build the same step again: each
// running request's next token, one position further. A caller that runs
// such steps back to back (the simulator) may then skip Next and Done for
// them and give each row its tokens later, row by row, with AdvanceRow:
// the state it leaves is the one those Done and Next calls would have
// left, and so are the Events and CheckpointPages it outputs, row by row
// (a row's own order is kept; rows are no longer interleaved step by
// step). A row's tokens are applied at once, instead of every row being
// touched at every step: at 10,000 simulated workers the rows' memory, not
// their arithmetic, was the cost of a step.
//
// The protocol: after Next returned a Step for which DecodeRun is true,
// the caller may, for each of the next steps in turn, let it end without
// calling Done, and start the next without calling Next, as long as
//   - no row finishes (reaches MaxTokens) in a skipped step,
//   - every row gets its page: a step at which rows start new pages
//     needs that many free (Next would let a row short of one sit out),
//   - nothing else calls into the Core (Submit, Cancel, SetHolder, …):
//     before any such call, and before reading the Core's state, the
//     caller brings every row to the last step that ended (AdvanceRow)
//     and calls Next, which builds the step in flight again, and
//   - a row whose checkpoint page fills at a step gets its tokens up to
//     that step (AdvanceRow) when the step ends, so that the page is
//     output then; a page CheckpointBehind refuses ends the run.
// CachedPages and the other counts read the rows as far as they were
// advanced.

// DecodeRun reports whether the pending step (what Next returned last) can
// start a decode run: every running request, and nothing else, decodes
// one token in it (no prefill, restore, verification, held pre-step or
// migration), nothing waits, and no row asks for logprobs, stops on a
// token or is behind on its checkpoint (every full page sent). Automatic
// prefix caching and speculation (SetSpec) keep a Core out of runs.
func (c *Core) DecodeRun() bool {
	st := c.pending
	if len(st.Batch) == 0 || len(st.Batch) != len(c.running) || len(st.Restores) > 0 || len(c.waiting) > 0 ||
		len(c.held) > 0 || len(c.stopped) > 0 || len(c.incoming) > 0 || c.pc != nil || c.spec.cfg.K != 0 || c.spec.cfg.Adaptive {
		return false
	}
	for i, ch := range st.Batch {
		r := st.Reqs[i]
		if r != c.running[i] || ch.Sample != 1 || len(ch.Tokens) != 1 || len(ch.Targets) > 0 || r.fed != len(r.History)-1 ||
			r.held || r.out != nil || r.Logprobs || r.PromptLogprobs || len(r.Stop) > 0 {
			return false
		}
		if r.Holder != "" && r.Holder != c.cfg.Self && (r.ckptSent != len(r.hashes) || len(r.hashes) != r.fed/engine.PageTokens) {
			return false
		}
	}
	return true
}

// AdvanceRow gives row i of the pending step of a decode run (DecodeRun)
// what Done gives it in each of len(times) consecutive steps of the run:
// the token toks[k], committed at times[k] (an Event), then the
// checkpoint pages that step filled. It reports whether the row's request
// ended (it reached MaxTokens: the caller's run was too long).
func (c *Core) AdvanceRow(i int, times []time.Time, toks []int32) (ended bool) {
	r := c.pending.Reqs[i]
	c.one[0] = r
	one := c.one[:]
	defer func() { c.one[0] = nil }()
	for k, now := range times {
		r.fed++
		if c.commit(now, r, toks[k], nil) {
			return true
		}
		c.checkpoint(one)
	}
	return false
}
