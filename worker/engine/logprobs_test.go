package engine

import (
	"context"
	"errors"
	"math"
	"math/rand"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/tokenizer"
)

// referenceLogprobs decodes r alone, token by token (the prompt in one
// chunk), and returns the tokens and each one's logprobs with k alternatives.
func referenceLogprobs(t *testing.T, e Engine, r request, k int) ([]int32, []Logprobs) {
	t.Helper()
	ctx := context.Background()
	const seq = 1 << 41
	defer e.Release(seq)
	var gen []int32
	var lps []Logprobs
	in := r.prompt
	for len(gen) < r.max {
		slot := make([]Logprobs, 1)
		out, err := e.Forward(ctx, []Chunk{{Seq: seq, Tokens: in, Sample: 1, Params: r.params, OutIndex: len(gen),
			Logprobs: slot, TopLogprobs: k}})
		if err != nil {
			t.Fatal(err)
		}
		gen, lps = append(gen, out[0][0]), append(lps, slot[0])
		in = out[0]
	}
	return gen, lps
}

// TestLogprobsAreTheLogSoftmax checks the transformer's logprobs against a
// float64 log-softmax of its logits: the chosen token's value, the top k in
// order (lowest id first among equals), never a token the model cannot
// produce; and, greedy, the chosen token is the most likely one.
func TestLogprobsAreTheLogSoftmax(t *testing.T) {
	e := newEngine(t, 64)
	ctx := context.Background()
	prompt := tokenizer.Tokenizer{}.Encode("logprobs of a tiny model")
	for _, p := range []Sampling{{}, {Temperature: 1.3, TopP: 0.9, Seed: 7}} {
		slot := make([]Logprobs, 1)
		out, err := e.Forward(ctx, []Chunk{{Seq: 1, Tokens: prompt, Sample: 1, Params: p, Logprobs: slot, TopLogprobs: MaxTopLogprobs}})
		if err != nil {
			t.Fatal(err)
		}
		logits := append([]float32(nil), e.logits(len(prompt)-1)...)
		e.Release(1)
		var z float64
		for _, v := range logits {
			z += math.Exp(float64(v))
		}
		lp := slot[0]
		want := math.Log(math.Exp(float64(logits[out[0][0]])) / z)
		if math.Abs(float64(lp.Logprob)-want) > 1e-5 || lp.Logprob > 0 {
			t.Fatalf("%+v: chosen token %d logprob %v, log-softmax %v", p, out[0][0], lp.Logprob, want)
		}
		if len(lp.Top) != MaxTopLogprobs {
			t.Fatalf("%d top logprobs, want %d", len(lp.Top), MaxTopLogprobs)
		}
		var sum float64
		for i, tl := range lp.Top {
			if int(tl.Token) >= tokenizer.FirstUnused || tl.Token == tokenizer.TokBOS || tl.Token == tokenizer.TokPad {
				t.Fatalf("top[%d] = %d, a token the model never produces", i, tl.Token)
			}
			if i > 0 && (tl.Logprob > lp.Top[i-1].Logprob || tl.Logprob == lp.Top[i-1].Logprob && tl.Token < lp.Top[i-1].Token) {
				t.Fatalf("top not in order at %d: %+v", i, lp.Top)
			}
			sum += math.Exp(float64(tl.Logprob))
		}
		if sum > 1+1e-5 {
			t.Fatalf("top probabilities sum to %v", sum)
		}
		// Nothing outside the top is more likely than its last.
		for id, v := range logits {
			if float64(v)-math.Log(z) > float64(lp.Top[len(lp.Top)-1].Logprob)+1e-6 && !inTop(lp.Top, int32(id)) {
				t.Fatalf("token %d (%v) is missing from the top %+v", id, float64(v)-math.Log(z), lp.Top)
			}
		}
		if p.Temperature == 0 && (lp.Top[0].Token != out[0][0] || lp.Top[0].Logprob != lp.Logprob) {
			t.Fatalf("greedy chose %d (%v), the most likely is %+v", out[0][0], lp.Logprob, lp.Top[0])
		}
	}
}

func inTop(top []TokenLogprob, id int32) bool {
	for _, t := range top {
		if t.Token == id {
			return true
		}
	}
	return false
}

// TestLogprobsIndependentOfBatching: the logprobs of every token equal the
// reference run's bit for bit whatever the batch around the request, the
// prefill chunking, a restore from exported pages, or a verification of
// drafts in one fused pass (an accepted draft's logprobs are the target's) —
// and, being raw, whatever the temperature: the same history gives the same
// values.
func TestLogprobsIndependentOfBatching(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	syn, err := NewSynthetic(SyntheticConfig{Pages: 512})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range []Engine{newEngine(t, 512), syn} {
		t.Run(e.Info().Backend, func(t *testing.T) {
			ctx := context.Background()
			for trial := 0; trial < 4; trial++ {
				r := randomRequest(rng, trial%2 == 1)
				r.prompt = append(r.prompt, make([]int32, 20)...) // at least a page
				r.max = 10
				k := rng.Intn(MaxTopLogprobs + 1)
				gen, want := referenceLogprobs(t, e, r, k)

				// Chunked prefill beside another sequence, then restore the
				// first page into a new sequence, then verify the generated
				// tokens as drafts in one pass.
				seq, other := SeqID(10+trial), SeqID(100+trial)
				half := len(r.prompt) / 2
				if _, err := e.Forward(ctx, []Chunk{{Seq: seq, Tokens: r.prompt[:half]}, {Seq: other, Tokens: r.prompt, Sample: 1}}); err != nil {
					t.Fatal(err)
				}
				if _, err := e.Forward(ctx, []Chunk{{Seq: seq, Tokens: r.prompt[half:]}}); err != nil {
					t.Fatal(err)
				}
				page, err := e.ExportPage(seq, 0)
				if err != nil {
					t.Fatal(err)
				}
				e.Release(seq)
				e.Release(other)
				restored := SeqID(1000 + trial)
				if err := e.ImportPages(restored, [][]byte{page}); err != nil {
					t.Fatal(err)
				}
				// The rest of the prompt but its last token, then a
				// verification chunk: the last prompt token and every
				// generated token but the last, as drafts.
				if _, err := e.Forward(ctx, []Chunk{{Seq: restored, Tokens: r.prompt[PageTokens : len(r.prompt)-1]}}); err != nil {
					t.Fatal(err)
				}
				verify := append([]int32{r.prompt[len(r.prompt)-1]}, gen[:len(gen)-1]...)
				slots := make([]Logprobs, len(verify))
				other2 := SeqID(2000 + trial)
				out, err := e.Forward(ctx, []Chunk{
					{Seq: other2, Tokens: r.prompt[:3], Sample: 1, Logprobs: make([]Logprobs, 1), TopLogprobs: 3},
					{Seq: restored, Tokens: verify, Sample: len(verify), Params: r.params, Logprobs: slots, TopLogprobs: k},
				})
				if err != nil {
					t.Fatal(err)
				}
				e.Release(restored)
				e.Release(other2)
				for j := range gen {
					if out[1][j] != gen[j] {
						t.Fatalf("seed %d trial %d: verification token %d = %d, reference %d", seed, trial, j, out[1][j], gen[j])
					}
					if !reflect.DeepEqual(slots[j], want[j]) {
						t.Fatalf("seed %d trial %d: token %d logprobs %+v, reference %+v", seed, trial, j, slots[j], want[j])
					}
				}
				// Raw logprobs do not depend on the sampling parameters:
				// greedy over the same history gives the same values.
				if r.params.Temperature > 0 {
					slot := make([]Logprobs, 1)
					if _, err := e.Forward(ctx, []Chunk{{Seq: 7, Tokens: append(append([]int32(nil), r.prompt...), gen[:3]...), Sample: 1,
						Logprobs: slot, TopLogprobs: k}}); err != nil {
						t.Fatal(err)
					}
					e.Release(7)
					if !reflect.DeepEqual(slot[0].Top, want[3].Top) {
						t.Fatalf("seed %d: greedy top logprobs %+v, sampled run's %+v", seed, slot[0].Top, want[3].Top)
					}
				}
			}
		})
	}
}

// TestSyntheticLogprobs: the synthetic model's distribution ranks the
// printable bytes from its greedy token on, logit −rank/2.
func TestSyntheticLogprobs(t *testing.T) {
	syn, _ := NewSynthetic(SyntheticConfig{Pages: 8})
	slot := make([]Logprobs, 1)
	out, err := syn.Forward(context.Background(), []Chunk{{Seq: 1, Tokens: []int32{'h', 'i'}, Sample: 1, Logprobs: slot, TopLogprobs: 5}})
	if err != nil {
		t.Fatal(err)
	}
	var z float64
	for r := 0; r < 95; r++ {
		z += math.Exp(-float64(r) / 2)
	}
	lp := slot[0]
	if lp.Top[0].Token != out[0][0] || lp.Logprob != float32(-math.Log(z)) {
		t.Fatalf("greedy token %d logprob %v, top %+v; want it first at %v", out[0][0], lp.Logprob, lp.Top, -math.Log(z))
	}
	for r, tl := range lp.Top {
		want := ' ' + (out[0][0]-' '+int32(r))%95
		if tl.Token != want || tl.Logprob != float32(-float64(r)/2-math.Log(z)) {
			t.Fatalf("rank %d: %+v, want token %d", r, tl, want)
		}
	}
}

func TestLogprobsRejectsBadInput(t *testing.T) {
	syn, _ := NewSynthetic(SyntheticConfig{Pages: 8})
	for _, c := range []struct {
		chunk Chunk
		msg   string
	}{
		{Chunk{Seq: 1, Tokens: []int32{1}, Sample: 1, Logprobs: make([]Logprobs, 1), TopLogprobs: 21}, "top_logprobs 21 must be in [0, 20]"},
		{Chunk{Seq: 1, Tokens: []int32{1}, Sample: 1, Logprobs: make([]Logprobs, 2)}, "2 logprob slots for 1 sampled tokens"},
	} {
		_, err := syn.Forward(context.Background(), []Chunk{c.chunk})
		if !errors.Is(err, ErrBadInput) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%+v: %v, want %q", c.chunk, err, c.msg)
		}
	}
}

// TestTargetsScoreAHistory: scoring a history (Targets: each position's
// next token) gives, at each generated position, exactly the logprobs its
// decode computed — for the transformer and the synthetic engine, whole
// and in chunks of any split, and beside other rows in one batch.
func TestTargetsScoreAHistory(t *testing.T) {
	syn, err := NewSynthetic(SyntheticConfig{Pages: 64})
	if err != nil {
		t.Fatal(err)
	}
	for name, e := range map[string]Engine{"transformer": newEngine(t, 64), "synthetic": syn} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			prompt := tokenizer.Tokenizer{}.Encode("score me, ")
			gen, lps := referenceLogprobs(t, e, request{prompt: prompt, max: 12}, 3)
			hist := append(slices.Clone(prompt), gen...)
			// Position p's target is hist[p+1]: the generated token i is
			// the target at len(prompt)-1+i.
			for _, split := range []int{len(hist) - 1, 5, 1} {
				const seq = 7
				scores := make([]Logprobs, len(hist)-1)
				for at := 0; at < len(hist)-1; at += split {
					end := min(at+split, len(hist)-1)
					// Another request's row beside the scored chunk.
					batch := []Chunk{{Seq: seq, Tokens: hist[at:end], Targets: hist[at+1 : end+1], Scores: scores[at:end], TopLogprobs: 3},
						{Seq: seq + 1, Tokens: prompt[:3], Sample: 1}}
					if _, err := e.Forward(ctx, batch); err != nil {
						t.Fatal(err)
					}
					e.Release(seq + 1)
				}
				e.Release(seq)
				for i := range gen {
					if got, want := scores[len(prompt)-1+i], lps[i]; !reflect.DeepEqual(got, want) {
						t.Fatalf("split %d: generated token %d scored %+v, its decode said %+v", split, i, got, want)
					}
				}
			}
			if _, err := e.Forward(ctx, []Chunk{{Seq: 9, Tokens: prompt, Targets: prompt[1:], Scores: make([]Logprobs, 2)}}); !errors.Is(err, ErrBadInput) {
				t.Fatalf("targets with too few score slots: %v, want ErrBadInput", err)
			}
		})
	}
}
