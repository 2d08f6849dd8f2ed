package engine

import (
	"context"
	"encoding/json"

	"github.com/lumen-project/lumen/tokenizer"
)

// GreedyText decodes a prompt greedily on e, alone (sequence 1), for up to
// max tokens or <|eos|>, and renders it as the gateway does: the failure-free
// reference a served stream must equal.
func GreedyText(e Engine, prompt []int32, max int) string {
	ctx := context.Background()
	defer e.Release(1)
	var tk tokenizer.Tokenizer
	out, err := e.Forward(ctx, []Chunk{{Seq: 1, Tokens: prompt, Sample: 1}})
	var text []byte
	for n := 1; err == nil; n++ {
		tok := out[0][0]
		if tok == tokenizer.TokEOS {
			break
		}
		text = append(text, tk.DecodeToken(tok)...)
		if n == max {
			break
		}
		out, err = e.Forward(ctx, []Chunk{{Seq: 1, Tokens: []int32{tok}, Sample: 1, OutIndex: n}})
	}
	// Invalid UTF-8 turns into U+FFFD on the way through JSON, as it does
	// in the gateway's responses.
	enc, _ := json.Marshal(string(text))
	var s string
	_ = json.Unmarshal(enc, &s)
	return s
}
