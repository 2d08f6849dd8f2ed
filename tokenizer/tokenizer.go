// Package tokenizer is lumen's vocabulary and byte-level tokenizer: ids
// 0..255 are bytes, a few special tokens follow, and the chat template
// frames turns with them. The worker's engine computes over these ids and
// the gateway turns requests into them and tokens back into text, so both
// import this package, which imports nothing else of lumen.
package tokenizer

import (
	"fmt"
	"strings"
)

// The vocabulary: ids 0..255 are bytes; special tokens follow.
const (
	TokBOS     int32 = 256
	TokEOS     int32 = 257
	TokPad     int32 = 258
	TokImStart int32 = 259
	TokImEnd   int32 = 260
	NumSpecial       = 5
	VocabSize        = 320 // 256 bytes + specials, rounded up; unused ids are valid but never produced by text
	// FirstUnused is the first id that is neither a byte nor a special
	// token: the model never produces it.
	FirstUnused = 256 + NumSpecial
)

var specialNames = map[int32]string{TokBOS: "<|bos|>", TokEOS: "<|eos|>", TokPad: "<|pad|>",
	TokImStart: "<|im_start|>", TokImEnd: "<|im_end|>"}

// Tokenizer is a byte-level tokenizer with special tokens.
type Tokenizer struct{}

// Encode turns text into byte tokens. Special-token spellings in the text are
// encoded as their bytes, never as special tokens: only templates add those.
func (Tokenizer) Encode(text string) []int32 {
	out := make([]int32, len(text))
	for i := 0; i < len(text); i++ {
		out[i] = int32(text[i])
	}
	return out
}

// Decode turns tokens back into text; special tokens are spelled out and
// unused ids render as <|id|>.
func (Tokenizer) Decode(ids []int32) string {
	var b strings.Builder
	var bytes []byte
	flush := func() { b.Write(bytes); bytes = bytes[:0] }
	for _, id := range ids {
		switch {
		case id >= 0 && id < 256:
			bytes = append(bytes, byte(id))
		default:
			flush()
			if name, ok := specialNames[id]; ok {
				b.WriteString(name)
			} else {
				fmt.Fprintf(&b, "<|%d|>", id)
			}
		}
	}
	flush()
	return b.String()
}

// DecodeToken renders one token's text (bytes; special tokens empty).
func (Tokenizer) DecodeToken(id int32) string {
	if id >= 0 && id < 256 {
		return string([]byte{byte(id)})
	}
	return ""
}

// Message is one chat turn.
type Message struct {
	Role    string
	Content string
}

// ApplyChatTemplate renders messages as
//
//	<|bos|><|im_start|>role\ncontent<|im_end|>\n ... <|im_start|>assistant\n
//
// ready for the assistant's reply, which ends with <|im_end|>.
func (t Tokenizer) ApplyChatTemplate(msgs []Message) []int32 {
	out := []int32{TokBOS}
	for _, m := range msgs {
		out = append(out, TokImStart)
		out = append(out, t.Encode(m.Role+"\n"+m.Content)...)
		out = append(out, TokImEnd)
		out = append(out, t.Encode("\n")...)
	}
	out = append(out, TokImStart)
	return append(out, t.Encode("assistant\n")...)
}
