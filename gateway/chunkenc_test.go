package gateway

import (
	"encoding/json"
	"math/rand/v2"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// randomText is text of every kind a token may decode to: ASCII, control
// characters, JSON's and HTML's special characters, multi-byte runes,
// U+2028/2029 and invalid UTF-8.
func randomText(rng *rand.Rand) string {
	pieces := []string{"a", "Z", " ", "\"", "\\", "/", "<", ">", "&", "\n", "\r", "\t", "\b", "\f", "\x00", "\x1f", "\x7f",
		"é", "日本", "😀", "\u2028", "\u2029", "\ufffd", "\xff", "\xe2\x80", "\xc3", "{}", "data: x"}
	var b strings.Builder
	for range rng.IntN(12) {
		if rng.IntN(4) == 0 {
			b.WriteByte(byte(rng.IntN(256)))
		} else {
			b.WriteString(pieces[rng.IntN(len(pieces))])
		}
	}
	return b.String()
}

// The chunks written without reflection are byte for byte json.Marshal's
// of responder.chunk's maps, for completions and chat, the first chunk of
// a choice and later ones, tokens' chunks and the last.
func TestChunkEncodingMatches(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	for k := range 20000 {
		chat := rng.IntN(2) == 0
		n := 1 + rng.IntN(3)
		id, model := "cmpl-"+randomText(rng), randomText(rng)
		fast := newResponder(nil, chat, true, false, id, model, n)
		ref := newResponder(nil, chat, true, false, id, model, n)
		fast.created, ref.created = rng.Int64N(1<<40), 0
		ref.created = fast.created
		for range 1 + rng.IntN(4) {
			i := rng.IntN(n)
			text := randomText(rng)
			var finish *string
			if rng.IntN(3) == 0 {
				f := []string{"stop", "length", randomText(rng)}[rng.IntN(3)]
				finish = &f
			}
			got, ok := fast.appendChunk(nil, i, text, finish)
			if !ok {
				t.Fatalf("case %d: the fast path refused a chunk without logprobs", k)
			}
			want, err := json.Marshal(ref.chunk(i, text, finish))
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != string(want) {
				t.Fatalf("case %d (chat %v, choice %d, text %q):\n got %s\nwant %s", k, chat, i, text, got, want)
			}
		}
	}
	if !utf8.ValidString(string(appendJSONString(nil, "\xff"))) {
		t.Fatal("invalid UTF-8 passed through")
	}
}

// With logprobs the fast path declines and the chunk goes through the
// maps, logprobs included.
func TestChunkWithLogprobsUsesTheMaps(t *testing.T) {
	rec := httptest.NewRecorder()
	o := newResponder(rec, false, true, false, "cmpl-1", "m", 1)
	o.withLogprobs(params{logprobs: true})
	if _, ok := o.appendChunk(nil, 0, "x", nil); ok {
		t.Fatal("the fast path took a chunk with logprobs")
	}
	o = newResponder(rec, false, true, false, "cmpl-1", "m", 1)
	o.writeChunk(0, "hi", nil)
	if got, want := rec.Body.String(), `data: {"choices":[{"finish_reason":null,"index":0,"logprobs":null,"text":"hi"}],"created":`; !strings.HasPrefix(got, want) {
		t.Fatalf("event %q, want it to start %q", got, want)
	}
	if !strings.HasSuffix(rec.Body.String(), `"id":"cmpl-1","model":"m","object":"text_completion"}`+"\n\n") {
		t.Fatalf("event %q", rec.Body.String())
	}
}

func BenchmarkChunk(b *testing.B) {
	o := newResponder(nil, false, true, false, "cmpl-abcdef0123456789", "lumen-tiny", 1)
	b.Run("fast", func(b *testing.B) {
		var buf []byte
		for b.Loop() {
			buf, _ = o.appendChunk(buf[:0], 0, " word", nil)
		}
	})
	b.Run("maps", func(b *testing.B) {
		for b.Loop() {
			_, _ = json.Marshal(o.chunk(0, " word", nil))
		}
	})
}
