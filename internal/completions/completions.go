// Package completions is the one client of lumen's OpenAI streaming
// completions API that lumen's own tools use (the demo, the benchmarks,
// the jepsen serving clients): it posts a request to /v1/completions and
// reads the server-sent events up to "data: [DONE]", handing each event to
// the caller as it arrives.
//
// Tests of the API itself use the official OpenAI Go SDK; this client is
// for harnesses that need what the SDK hides: the arrival time of every
// chunk, the difference between an error event and a cut stream, the
// usage event, and no retries.
package completions

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// Errors of a stream that began (HTTP 200) but did not end well.
var (
	// ErrNoDone: the stream ended, or the connection broke, before
	// "data: [DONE]" and without an error event.
	ErrNoDone = errors.New("completions: stream ended without [DONE]")
	// ErrMalformed: a data line did not hold a JSON chunk.
	ErrMalformed = errors.New("completions: malformed event")
)

// HTTPError is an answer other than 200: the request was refused before
// any stream began.
type HTTPError struct {
	Status int
	// Body is the start of the answer's body, trimmed.
	Body string
}

func (e *HTTPError) Error() string { return fmt.Sprintf("HTTP %d: %s", e.Status, e.Body) }

// EventError is an error event in the stream: the server gave up on the
// request after the stream began, and said so.
type EventError struct {
	Message string
}

func (e *EventError) Error() string { return "error event: " + e.Message }

// Usage is the token count of a usage event
// (stream_options.include_usage).
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
}

// Chunk is one data event of the stream.
type Chunk struct {
	// ID is the completion's id, as the chunk gives it.
	ID string
	// Text is the first choice's text ("" in a role or usage chunk).
	Text string
	// Usage is set in the usage event.
	Usage *Usage
}

// Result is what a stream delivered, complete or not.
type Result struct {
	// Accepted: the server answered 200 and the stream began.
	Accepted bool
	// Done: the stream ended with [DONE].
	Done bool
	// ID is the first id a chunk gave.
	ID string
	// Text is every chunk's text, in order, up to the end or the failure.
	Text string
	// Usage is the last usage event's, or nil.
	Usage *Usage
}

// Body is the JSON of a streaming, greedy completion request for the
// model "lumen-tiny"; prompt is a string or a slice of token ids.
func Body(prompt any, maxTokens int, includeUsage bool) []byte {
	req := map[string]any{"model": "lumen-tiny", "prompt": prompt, "max_tokens": maxTokens, "temperature": 0, "stream": true}
	if includeUsage {
		req["stream_options"] = map[string]any{"include_usage": true}
	}
	b, _ := json.Marshal(req) // maps of strings, numbers and slices always encode
	return b
}

// maxEvent bounds one event line (a chunk carries a few tokens' text).
const maxEvent = 1 << 20

// Stream posts body to http://addr/v1/completions and reads the stream.
// onChunk, when not nil, is called with every data event as it arrives,
// before the next is read. The error is nil only when the stream ended
// with [DONE]; otherwise it is an *HTTPError, an *EventError, one that
// wraps ErrNoDone or ErrMalformed, or the transport's.
func Stream(ctx context.Context, httpc *http.Client, addr string, body []byte, onChunk func(Chunk)) (res Result, err error) {
	req, err := http.NewRequestWithContext(ctx, "POST", "http://"+addr+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return res, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := httpc.Do(req)
	if err != nil {
		return res, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return res, &HTTPError{Status: resp.StatusCode, Body: strings.TrimSpace(string(b))}
	}
	res.Accepted = true
	var text strings.Builder
	defer func() { res.Text = text.String() }() // what came, whichever way the stream ends
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), maxEvent)
	for sc.Scan() {
		data, ok := bytes.CutPrefix(sc.Bytes(), []byte("data:"))
		if !ok {
			continue // a blank line, a comment (": keepalive"), another field
		}
		data = bytes.TrimPrefix(data, []byte(" "))
		if bytes.Equal(data, []byte("[DONE]")) {
			res.Done = true
			return res, nil
		}
		var ev struct {
			ID      string `json:"id"`
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
			Usage *Usage `json:"usage"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal(data, &ev); err != nil {
			return res, fmt.Errorf("%w: %q: %v", ErrMalformed, data, err)
		}
		if ev.Error != nil {
			return res, &EventError{Message: ev.Error.Message}
		}
		ch := Chunk{ID: ev.ID, Usage: ev.Usage}
		if len(ev.Choices) > 0 {
			ch.Text = ev.Choices[0].Text
		}
		if res.ID == "" {
			res.ID = ch.ID
		}
		if ch.Usage != nil {
			res.Usage = ch.Usage
		}
		text.WriteString(ch.Text)
		if onChunk != nil {
			onChunk(ch)
		}
	}
	if err := sc.Err(); err != nil {
		return res, fmt.Errorf("%w: %w", ErrNoDone, err)
	}
	return res, ErrNoDone
}
