package gateway

import (
	"strconv"
	"unicode/utf8"
)

// The streaming chunk of a token, written without reflection (issue 26:
// at 500 streams the gateway writes one chunk per stream per engine step,
// a burst of hundreds each step, and the requests that arrive in it wait
// behind them; json.Marshal of the chunk's maps, sorting their keys, was
// most of a token's CPU after the write itself). The bytes are
// json.Marshal's of responder.chunk's maps (TestChunkEncodingMatches): the
// keys in sorted order, strings escaped as encoding/json escapes them.
// Chunks with logprobs keep the maps.

// appendJSONString appends s as encoding/json encodes a string: HTML
// characters, U+2028 and U+2029 escaped, invalid UTF-8 as U+FFFD.
func appendJSONString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		if c := s[i]; c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' && c != '<' && c != '>' && c != '&' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\b':
				b = append(b, '\\', 'b')
			case '\f':
				b = append(b, '\\', 'f')
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hex[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}

// chunkTail is the part of every chunk of a response after its choices:
// `],"created":…,"id":…,"model":…,"object":…}`, the same for all of them.
func (o *responder) chunkTail() []byte {
	if o.tail == nil {
		b := append([]byte(nil), `],"created":`...)
		b = strconv.AppendInt(b, o.created, 10)
		b = append(b, `,"id":`...)
		b = appendJSONString(b, o.id)
		b = append(b, `,"model":`...)
		b = appendJSONString(b, o.model)
		b = append(b, `,"object":`...)
		b = appendJSONString(b, o.object())
		o.tail = append(b, '}')
	}
	return o.tail
}

// appendChunk appends choice i's chunk of text (finish nil: a token's) as
// json.Marshal(o.chunk(i, text, finish)) would, when the chunk carries no
// logprobs; ok is false otherwise (the caller uses o.chunk).
func (o *responder) appendChunk(b []byte, i int, text string, finish *string) (_ []byte, ok bool) {
	c := o.choices[i]
	if o.lp || len(c.pending) > 0 {
		return b, false
	}
	b = append(b, `{"choices":[{`...)
	if o.chat {
		b = append(b, `"delta":{`...)
		comma := false
		if text != "" || finish == nil {
			b = append(b, `"content":`...)
			b = appendJSONString(b, text)
			comma = true
		}
		if !c.streamed {
			if comma {
				b = append(b, ',')
			}
			b = append(b, `"role":"assistant"`...)
		}
		b = append(b, "},"...)
	}
	b = append(b, `"finish_reason":`...)
	if finish == nil {
		b = append(b, "null"...)
	} else {
		b = appendJSONString(b, *finish)
	}
	b = append(b, `,"index":`...)
	b = strconv.AppendInt(b, int64(i), 10)
	b = append(b, `,"logprobs":null`...)
	if !o.chat {
		b = append(b, `,"text":`...)
		b = appendJSONString(b, text)
	}
	b = append(b, '}')
	c.streamed = true
	return append(b, o.chunkTail()...), true
}

// writeChunk writes choice i's chunk as an event (o.mu held).
func (o *responder) writeChunk(i int, text string, finish *string) {
	b := append(o.buf[:0], "data: "...)
	b, ok := o.appendChunk(b, i, text, finish)
	if !ok {
		o.event(o.chunk(i, text, finish))
		return
	}
	o.buf = append(b, "\n\n"...)
	o.writeEvent(o.buf)
}
