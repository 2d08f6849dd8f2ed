package core

import (
	"fmt"
	"runtime"
	"testing"
)

// follower is a target committing, at each step, the first draft of the
// drafter's last line for request "a" (a mirror update of one token); the
// drafter then drafts one more.
type follower struct {
	d    *Drafter
	last Draft
}

func (f *follower) cycles(n int) {
	for range n {
		if len(f.last.Tokens) > 0 {
			f.d.Apply(MirrorUpdate{ID: "a", From: f.last.Base, Tokens: f.last.Tokens[:1:1]})
			f.last.Base, f.last.Tokens = f.last.Base+1, f.last.Tokens[1:]
		}
		st := f.d.Next(1 << 30)
		out := make([][]int32, len(st.Batch))
		for i, ch := range st.Batch {
			if ch.Sample > 0 {
				out[i] = []int32{7}
			}
		}
		f.d.Done(out)
		if o := f.d.Output(); len(o.Drafts) > 0 {
			f.last = o.Drafts[len(o.Drafts)-1]
		}
	}
}

func newFollower(hist int) *follower {
	f := &follower{d: NewDrafter(4)}
	f.d.Apply(MirrorUpdate{ID: "a", Tokens: make([]int32, hist)})
	f.cycles(20) // the prefill and a full lookahead
	return f
}

// TestDrafterFollowsInPlace: the drafter extends a request's line in place,
// so following it costs the same per token at any history length. It used
// to copy the whole history at every update and every draft step (O(L²)
// per request): 256 KB per token at 32,768 tokens.
func TestDrafterFollowsInPlace(t *testing.T) {
	const cycles = 500
	perCycle := func(hist int) float64 {
		f := newFollower(hist)
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		f.cycles(cycles)
		runtime.ReadMemStats(&after)
		return float64(after.TotalAlloc-before.TotalAlloc) / cycles
	}
	short, long := perCycle(1024), perCycle(32768)
	t.Logf("bytes allocated per token followed: %.0f at 1,024 tokens of history, %.0f at 32,768", short, long)
	// The line grows by appends (amortised: a few bytes a token); the
	// rest is the draft message and the step's buffers, whatever the length.
	if long > 2*short+1024 {
		t.Fatalf("following a request of 32,768 tokens allocates %.0f bytes per token, %.0f at 1,024: not linear in the history", long, short)
	}
}

// BenchmarkDrafterFollow: one token followed (a one-token update, a draft
// step) at several history lengths; ns/op should not grow with them.
func BenchmarkDrafterFollow(b *testing.B) {
	for _, hist := range []int{1 << 10, 1 << 13, 1 << 16} {
		b.Run(fmt.Sprintf("history=%d", hist), func(b *testing.B) {
			f := newFollower(hist)
			b.ReportAllocs()
			b.ResetTimer()
			f.cycles(b.N)
		})
	}
}
