package gateway

import (
	"bytes"
	"encoding/json"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/tokenizer"
)

// Logprobs in responses, as vLLM and OpenAI shape them. The values are the
// model's raw distribution at each position (before temperature and top-p;
// see the worker's engine.Logprobs), sent as float32. A token's string is
// its text alone: a byte is itself (a byte of a multi-byte character is
// not valid UTF-8 alone and reads as U+FFFD; chat's `bytes` has the real
// byte), a special token its name (`<|eos|>`). The stop token that ended
// generation is counted in usage and so has its entry too, as in vLLM.

// minLogprob stands in for −Inf, which JSON cannot carry (vLLM's value).
const minLogprob = -9999

func clampLogprob(v float32) float32 { return max(v, minLogprob) }

// tokenString is a token's string in logprobs.
func tokenString(id int32) string { return tokenizer.Tokenizer{}.Decode([]int32{id}) }

// tokenBytes are its bytes: the byte itself, a special token's name.
func tokenBytes(id int32) []int {
	s := tokenString(id)
	out := make([]int, len(s))
	for i := 0; i < len(s); i++ {
		out[i] = int(s[i])
	}
	return out
}

// textBytes is how many bytes the token adds to the completion's text (the
// special tokens add none).
func textBytes(id int32) int { return len(tokenizer.Tokenizer{}.DecodeToken(id)) }

// completionLogprobs is a completions choice's `logprobs`.
type completionLogprobs struct {
	Tokens []string `json:"tokens"`
	// null for an echoed prompt's first token, which nothing precedes.
	TokenLogprobs []*float32       `json:"token_logprobs"`
	TopLogprobs   []*orderedLogMap `json:"top_logprobs"`
	TextOffset    []int            `json:"text_offset"`
}

// orderedLogMap is a JSON object from token strings to logprobs that keeps
// its order: the chosen token first, then the most likely ones (vLLM's
// order). Two tokens with the same string (all lone bytes above 0x7F read
// as U+FFFD) keep the first.
type orderedLogMap []struct {
	token   string
	logprob float32
}

func (m orderedLogMap) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	seen := map[string]bool{}
	for _, e := range m {
		// Compared as JSON: bytes that are not UTF-8 alone all read as
		// U+FFFD.
		k, _ := json.Marshal(e.token)
		if seen[string(k)] {
			continue
		}
		seen[string(k)] = true
		if len(seen) > 1 {
			b.WriteByte(',')
		}
		v, _ := json.Marshal(e.logprob)
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

func (m *orderedLogMap) add(token string, lp float32) {
	*m = append(*m, struct {
		token   string
		logprob float32
	}{token, clampLogprob(lp)})
}

// chatLogprob is one entry of a chat choice's `logprobs.content`.
type chatLogprob struct {
	Token       string           `json:"token"`
	Logprob     float32          `json:"logprob"`
	Bytes       []int            `json:"bytes"`
	TopLogprobs []chatTopLogprob `json:"top_logprobs"`
}

// chatTopLogprob is one of its top_logprobs.
type chatTopLogprob struct {
	Token   string  `json:"token"`
	Logprob float32 `json:"logprob"`
	Bytes   []int   `json:"bytes"`
}

// completionsLogprobs formats the tokens' logprobs for completions; offset
// is the text offset (bytes of the choice's text) of the first, and the
// offset after the last is returned. nullFirst: the first is an echoed
// prompt's first token, whose logprob and top_logprobs are null.
func completionsLogprobs(lps []*pb.GenerateResponse, offset int, nullFirst bool) (*completionLogprobs, int) {
	c := &completionLogprobs{Tokens: []string{}, TokenLogprobs: []*float32{}, TopLogprobs: []*orderedLogMap{}, TextOffset: []int{}}
	for i, r := range lps {
		tok := tokenString(r.Token)
		c.Tokens = append(c.Tokens, tok)
		c.TextOffset = append(c.TextOffset, offset)
		offset += textBytes(r.Token)
		if i == 0 && nullFirst {
			c.TokenLogprobs, c.TopLogprobs = append(c.TokenLogprobs, nil), append(c.TopLogprobs, nil)
			continue
		}
		lp := clampLogprob(r.Logprob)
		c.TokenLogprobs = append(c.TokenLogprobs, &lp)
		top := &orderedLogMap{}
		top.add(tok, r.Logprob)
		for _, t := range r.TopLogprobs {
			top.add(tokenString(t.Token), t.Logprob)
		}
		c.TopLogprobs = append(c.TopLogprobs, top)
	}
	return c, offset
}

// chatLogprobs formats the tokens' logprobs for chat: `{"content": [...]}`,
// each entry with exactly the requested most likely tokens (OpenAI's
// top_logprobs, which may not include the chosen one).
func chatLogprobs(lps []*pb.GenerateResponse, top int) map[string]any {
	content := make([]chatLogprob, len(lps))
	for i, r := range lps {
		e := chatLogprob{Token: tokenString(r.Token), Logprob: clampLogprob(r.Logprob), Bytes: tokenBytes(r.Token),
			TopLogprobs: []chatTopLogprob{}}
		for _, t := range r.TopLogprobs[:min(top, len(r.TopLogprobs))] {
			e.TopLogprobs = append(e.TopLogprobs, chatTopLogprob{Token: tokenString(t.Token), Logprob: clampLogprob(t.Logprob), Bytes: tokenBytes(t.Token)})
		}
		content[i] = e
	}
	return map[string]any{"content": content}
}
