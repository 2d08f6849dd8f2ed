package gateway

import (
	"strings"
	"unicode/utf8"
)

// textStream turns byte tokens into text deltas: it holds back an incomplete
// UTF-8 sequence, and any tail that could still grow into a stop sequence,
// until it is known not to.
type textStream struct {
	stop    []string
	pending []byte // bytes not yet emitted
	text    strings.Builder
	stopped bool
}

// push adds a token's bytes and returns the text that is safe to emit;
// stopped reports that a stop sequence appeared (the text before it is
// returned, the rest dropped).
func (t *textStream) push(b []byte) (delta string, stopped bool) {
	if t.stopped {
		return "", true
	}
	t.pending = append(t.pending, b...)
	s := string(t.pending)
	for _, stop := range t.stop {
		if i := strings.Index(s, stop); i >= 0 {
			t.stopped = true
			t.pending = nil
			t.text.WriteString(s[:i])
			return s[:i], true
		}
	}
	// Keep back what may begin a stop sequence.
	keep := 0
	for _, stop := range t.stop {
		for k := min(len(stop)-1, len(s)); k > keep; k-- {
			if strings.HasPrefix(stop, s[len(s)-k:]) {
				keep = k
				break
			}
		}
	}
	emit := len(s) - keep
	// And an incomplete UTF-8 sequence at the end (invalid bytes go out at
	// once, as they are).
	for i := max(0, emit-utf8.UTFMax+1); i < emit; i++ {
		if utf8.RuneStart(s[i]) && !utf8.FullRuneInString(s[i:emit]) {
			emit = i
			break
		}
	}
	out := s[:emit]
	t.pending = append(t.pending[:0], s[emit:]...)
	t.text.WriteString(out)
	return out, false
}

// flush emits what is held back at the end of generation.
func (t *textStream) flush() string {
	out := string(t.pending)
	t.pending = nil
	t.text.WriteString(out)
	return out
}
