package engine

import (
	"context"
	"math/rand"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/lumen-project/lumen/tokenizer"
)

// modelDir holds the default model, written once by TestMain.
var modelDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "lumen-engine-test-")
	if err != nil {
		panic(err)
	}
	modelDir = dir
	if _, _, err := InitModel(modelDir, DefaultSeed); err != nil {
		panic(err)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func testModel(testing.TB) string { return filepath.Join(modelDir, TargetFile) }

func newEngine(t testing.TB, pages int) *Transformer {
	t.Helper()
	e, err := NewTransformer(TransformerConfig{Path: testModel(t), Pages: pages})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

type request struct {
	prompt []int32
	max    int
	params Sampling
}

// reference runs one request alone: the whole prompt in one chunk, then one
// token per step.
func reference(t testing.TB, e Engine, r request) []int32 {
	t.Helper()
	ctx := context.Background()
	const seq = 1 << 40
	defer e.Release(seq)
	out, err := e.Forward(ctx, []Chunk{{Seq: seq, Tokens: r.prompt, Sample: 1, Params: r.params}})
	if err != nil {
		t.Fatal(err)
	}
	gen := []int32{out[0][0]}
	for len(gen) < r.max {
		out, err = e.Forward(ctx, []Chunk{{Seq: seq, Tokens: gen[len(gen)-1:], Sample: 1, Params: r.params, OutIndex: len(gen)}})
		if err != nil {
			t.Fatal(err)
		}
		gen = append(gen, out[0][0])
	}
	return gen
}

func randomRequest(rng *rand.Rand, sampled bool) request {
	p := make([]int32, 1+rng.Intn(90))
	for i := range p {
		p[i] = int32(rng.Intn(tokenizer.VocabSize))
	}
	r := request{prompt: p, max: 1 + rng.Intn(40)}
	if sampled {
		r.params = Sampling{Temperature: 0.3 + rng.Float32(), TopP: 0.5 + rng.Float32()/2, Seed: rng.Uint64()}
	}
	return r
}

// live is a request in flight in the batched run.
type live struct {
	id       int
	seq      SeqID
	req      request
	history  []int32 // prompt + generated
	fed      int     // tokens of history in the cache
	gen      []int32
	restored bool
}

// TestOracle runs random request mixes with continuous batching, chunked
// prefill and restores from exported pages at random page boundaries, and
// requires every output to equal the request's reference run alone.
func TestOracle(t *testing.T) {
	syn, err := NewSynthetic(SyntheticConfig{Pages: 2048})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range []Engine{newEngine(t, 2048), syn} {
		t.Run(e.Info().Backend, func(t *testing.T) { oracle(t, e) })
	}
}

func oracle(t *testing.T, e Engine) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	ctx := context.Background()
	for trial := 0; trial < 6; trial++ {
		sampled := trial%2 == 1
		var reqs []request
		for i := 0; i < 4+rng.Intn(10); i++ {
			reqs = append(reqs, randomRequest(rng, sampled))
		}
		want := make([][]int32, len(reqs))
		for i, r := range reqs {
			want[i] = reference(t, e, r)
		}
		var running []*live
		next := 0
		nextSeq := SeqID(trial * 1000)
		done := 0
		for done < len(reqs) {
			// Admit a random number of waiting requests.
			for k := rng.Intn(3); k >= 0 && next < len(reqs); k-- {
				nextSeq++
				running = append(running, &live{id: next, seq: nextSeq, req: reqs[next], history: slices.Clone(reqs[next].prompt)})
				next++
			}
			// Sometimes restore one request: export its full pages, drop
			// its cache, import them into a new sequence at a random
			// page boundary, and let partial prefill redo the rest.
			if len(running) > 0 && rng.Intn(4) == 0 {
				l := running[rng.Intn(len(running))]
				full := e.Len(l.seq) / PageTokens
				keep := rng.Intn(full + 1)
				var pages [][]byte
				for i := 0; i < keep; i++ {
					p, err := e.ExportPage(l.seq, i)
					if err != nil {
						t.Fatal(err)
					}
					pages = append(pages, p)
				}
				e.Release(l.seq)
				nextSeq++
				l.seq = nextSeq
				if err := e.ImportPages(l.seq, pages); err != nil {
					t.Fatal(err)
				}
				l.fed, l.restored = keep*PageTokens, true
			}
			var batch []Chunk
			for _, l := range running {
				pending := l.history[l.fed:]
				if len(pending) > 1 {
					// Prefill in a random chunk size.
					n := 1 + rng.Intn(len(pending))
					sample := 0
					if n == len(pending) {
						sample = 1
					}
					batch = append(batch, Chunk{Seq: l.seq, Tokens: pending[:n], Sample: sample, Params: l.req.params, OutIndex: len(l.gen)})
				} else {
					batch = append(batch, Chunk{Seq: l.seq, Tokens: pending, Sample: 1, Params: l.req.params, OutIndex: len(l.gen)})
				}
			}
			out, err := e.Forward(ctx, batch)
			if err != nil {
				t.Fatal(err)
			}
			var still []*live
			for i, l := range running {
				l.fed += len(batch[i].Tokens)
				if len(out[i]) == 1 {
					l.gen = append(l.gen, out[i][0])
					l.history = append(l.history, out[i][0])
				}
				if len(l.gen) == l.req.max {
					if !slices.Equal(l.gen, want[l.id]) {
						t.Fatalf("seed %d trial %d request %d (restored %v, sampled %v):\n got  %v\n want %v", seed, trial, l.id, l.restored, sampled, l.gen, want[l.id])
					}
					e.Release(l.seq)
					done++
					continue
				}
				still = append(still, l)
			}
			running = still
		}
		if free := e.FreePages(); free != 2048 {
			t.Fatalf("pages leaked: %d free of 2048", free)
		}
	}
}

// TestVerifyMatchesDecode checks that verifying K drafts in one pass of K+1
// positions returns, at every position, the token greedy decoding chooses.
func TestVerifyMatchesDecode(t *testing.T) {
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewSource(seed))
	e := newEngine(t, 512)
	ctx := context.Background()
	for trial := 0; trial < 5; trial++ {
		r := randomRequest(rng, false)
		r.max = 12
		want := reference(t, e, r)
		seq := SeqID(100 + trial)
		if _, err := e.Forward(ctx, []Chunk{{Seq: seq, Tokens: r.prompt}}); err != nil {
			t.Fatal(err)
		}
		// Position 1 is the last committed token (want[0] follows the
		// prompt); then K = 4 correct drafts and one wrong one.
		drafts := append([]int32{want[0]}, want[1:5]...)
		drafts = append(drafts, (want[5]+1)%tokenizer.VocabSize)
		out, err := e.Forward(ctx, []Chunk{{Seq: seq, Tokens: drafts, Sample: len(drafts)}})
		if err != nil {
			t.Fatal(err)
		}
		// After each accepted draft the target's choice is the next
		// reference token; what follows the wrong draft is discarded.
		if !slices.Equal(out[0][:5], want[1:6]) {
			t.Fatalf("seed %d: verification %v, decode %v", seed, out[0][:5], want[1:6])
		}
		// Reject the wrong draft: truncate and continue from there.
		if err := e.Truncate(seq, len(r.prompt)+5); err != nil {
			t.Fatal(err)
		}
		out, err = e.Forward(ctx, []Chunk{{Seq: seq, Tokens: want[5:6], Sample: 1}})
		if err != nil || out[0][0] != want[6] {
			t.Fatalf("after truncate: %v %v, want %d", out, err, want[6])
		}
		e.Release(seq)
	}
}

func TestForwardRejectsBadInput(t *testing.T) {
	e := newEngine(t, 4)
	ctx := context.Background()
	cases := []struct {
		name  string
		chunk Chunk
	}{
		{"unknown token", Chunk{Seq: 1, Tokens: []int32{tokenizer.VocabSize}, Sample: 1}},
		{"negative token", Chunk{Seq: 1, Tokens: []int32{-1}, Sample: 1}},
		{"bad temperature", Chunk{Seq: 1, Tokens: []int32{1}, Sample: 1, Params: Sampling{Temperature: 3}}},
		{"bad top_p", Chunk{Seq: 1, Tokens: []int32{1}, Sample: 1, Params: Sampling{Temperature: 1, TopP: 1.5}}},
		{"sample beyond tokens", Chunk{Seq: 1, Tokens: []int32{1}, Sample: 2}},
	}
	for _, c := range cases {
		if _, err := e.Forward(ctx, []Chunk{c.chunk}); err == nil {
			t.Errorf("%s: accepted", c.name)
		}
	}
	// 4 pages hold 64 tokens: 65 does not fit, and nothing is allocated.
	long := make([]int32, 65)
	if _, err := e.Forward(ctx, []Chunk{{Seq: 1, Tokens: long, Sample: 1}}); err != ErrOutOfPages {
		t.Fatalf("overflow: %v", err)
	}
	if e.FreePages() != 4 {
		t.Fatalf("a failed Forward kept pages: %d free", e.FreePages())
	}
	if _, err := e.Forward(ctx, []Chunk{{Seq: 1, Tokens: long[:64], Sample: 1}}); err != nil {
		t.Fatal(err)
	}
}
