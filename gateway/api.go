package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"reflect"
	"strings"
	"time"

	"github.com/lumen-project/lumen/policy"
)

// apiError is an OpenAI-style error with its HTTP status.
type apiError struct {
	Status  int    `json:"-"`
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   string `json:"param,omitempty"`
	Code    string `json:"code,omitempty"`
	// RetryAfter, when set, goes out as the Retry-After header (whole
	// seconds, at least one): a 429 says when to come back.
	RetryAfter time.Duration `json:"-"`
}

func (e *apiError) Error() string { return e.Message }

// MarshalJSON writes all four of OpenAI's fields, param and code null when
// unset, as OpenAI does.
func (e *apiError) MarshalJSON() ([]byte, error) {
	orNull := func(s string) *string {
		if s == "" {
			return nil
		}
		return &s
	}
	return json.Marshal(struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	}{e.Message, e.Type, orNull(e.Param), orNull(e.Code)})
}

func badRequest(param, format string, args ...any) *apiError {
	return &apiError{Status: 400, Type: "invalid_request_error", Param: param, Message: fmt.Sprintf(format, args...)}
}

// Limits the gateway enforces on a request body.
const (
	maxStopSequences = 4
	maxStopBytes     = 64
	maxMessages      = 256
	// maxN is the most samples one request may ask for (OpenAI's limit);
	// each holds an admission slot of the gateway's -max-concurrent.
	maxN = 128
)

// promptInput is a completions prompt: text, or token ids.
type promptInput struct {
	text   *string
	tokens []int32
}

func (p *promptInput) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		p.text = &s
		return nil
	}
	var ids []int64
	if err := json.Unmarshal(b, &ids); err == nil {
		return p.setTokens(ids)
	}
	var ss []string
	if err := json.Unmarshal(b, &ss); err == nil {
		if len(ss) != 1 {
			return badRequest("prompt", "prompt: batches of %d prompts are not supported; send one prompt per request", len(ss))
		}
		p.text = &ss[0]
		return nil
	}
	var idss [][]int64
	if err := json.Unmarshal(b, &idss); err == nil {
		if len(idss) != 1 {
			return badRequest("prompt", "prompt: batches of %d prompts are not supported; send one prompt per request", len(idss))
		}
		return p.setTokens(idss[0])
	}
	return badRequest("prompt", "prompt must be a string, an array of one string, or an array of token ids")
}

func (p *promptInput) setTokens(ids []int64) error {
	p.tokens = make([]int32, len(ids))
	for i, id := range ids {
		if id < 0 || id > math.MaxInt32 {
			return badRequest("prompt", "prompt[%d] = %d is not a token id", i, id)
		}
		p.tokens[i] = int32(id)
	}
	return nil
}

// stopInput is a stop sequence or a list of them.
type stopInput []string

func (s *stopInput) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return nil
	}
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*s = []string{one}
		return nil
	}
	var many []string
	if err := json.Unmarshal(b, &many); err != nil {
		return badRequest("stop", "stop must be a string or an array of strings")
	}
	*s = many
	return nil
}

// content is a chat message's content: a string or text parts.
type content string

func (c *content) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		*c = content(s)
		return nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(b, &parts); err != nil {
		return badRequest("messages", "message content must be a string or an array of text parts")
	}
	var sb strings.Builder
	for _, p := range parts {
		if p.Type != "text" {
			return badRequest("messages", "message content part of type %q is not supported; only text", p.Type)
		}
		sb.WriteString(p.Text)
	}
	*c = content(sb.String())
	return nil
}

type message struct {
	Role    string  `json:"role"`
	Content content `json:"content"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// request is the union of the completions and chat completions bodies.
type request struct {
	Model               string         `json:"model"`
	Prompt              *promptInput   `json:"prompt"`
	Messages            []message      `json:"messages"`
	MaxTokens           *int64         `json:"max_tokens"`
	MaxCompletionTokens *int64         `json:"max_completion_tokens"`
	Temperature         *float64       `json:"temperature"`
	TopP                *float64       `json:"top_p"`
	N                   *int64         `json:"n"`
	BestOf              *int64         `json:"best_of"`
	Echo                *bool          `json:"echo"`
	Seed                *int64         `json:"seed"`
	Stop                stopInput      `json:"stop"`
	Stream              bool           `json:"stream"`
	StreamOptions       *streamOptions `json:"stream_options"`
	User                string         `json:"user"`
	// Logprobs is an integer for completions (the alternatives per token)
	// and a boolean for chat, which takes the count in TopLogprobs.
	Logprobs    json.RawMessage `json:"logprobs"`
	TopLogprobs *int64          `json:"top_logprobs"`
	// Priority is vLLM's request priority: lower is served first, 0 the
	// default, in [policy.MinPriority, policy.MaxPriority]; a negative
	// one is high priority (policy.HighPriority).
	Priority *int64 `json:"priority"`
	// Unsupported holds the parameters lumen does not implement yet, so a
	// request that sets one is refused by name instead of served as if it
	// had not (see refuseUnsupported).
	Unsupported
}

// Unsupported are the OpenAI (and vLLM) parameters lumen does not implement.
// Each is accepted only at its no-op value: a client that sends echo: false
// or presence_penalty: 0 is served, one that asks for the behaviour gets a
// 400 naming the parameter rather than an answer that silently lacks it.
type Unsupported struct {
	Suffix            json.RawMessage `json:"suffix"`
	LogitBias         json.RawMessage `json:"logit_bias"`
	PresencePenalty   json.RawMessage `json:"presence_penalty"`
	FrequencyPenalty  json.RawMessage `json:"frequency_penalty"`
	RepetitionPenalty json.RawMessage `json:"repetition_penalty"`
	MinTokens         json.RawMessage `json:"min_tokens"`
	PromptLogprobs    json.RawMessage `json:"prompt_logprobs"`
	Tools             json.RawMessage `json:"tools"`
	Functions         json.RawMessage `json:"functions"`
	ResponseFormat    json.RawMessage `json:"response_format"`
	GuidedJSON        json.RawMessage `json:"guided_json"`
	GuidedRegex       json.RawMessage `json:"guided_regex"`
	GuidedChoice      json.RawMessage `json:"guided_choice"`
}

// refuseUnsupported returns a 400 naming the first unsupported parameter the
// request sets to anything but its no-op value.
func (u *Unsupported) refuseUnsupported() *apiError {
	checks := []struct {
		name string
		raw  json.RawMessage
		noop []string // the JSON values that ask for nothing
		why  string
	}{
		{"suffix", u.Suffix, []string{`""`}, "insertion after a suffix is not implemented"},
		{"logit_bias", u.LogitBias, []string{"{}"}, "logits are not biased"},
		{"presence_penalty", u.PresencePenalty, []string{"0", "0.0"}, "sampling applies no penalties"},
		{"frequency_penalty", u.FrequencyPenalty, []string{"0", "0.0"}, "sampling applies no penalties"},
		{"repetition_penalty", u.RepetitionPenalty, []string{"1", "1.0"}, "sampling applies no penalties"},
		{"min_tokens", u.MinTokens, []string{"0"}, "end of sequence is not suppressed"},
		{"prompt_logprobs", u.PromptLogprobs, []string{"0"}, "logprobs are returned for generated tokens only"},
		{"tools", u.Tools, []string{"[]"}, "tool calling is not implemented"},
		{"functions", u.Functions, []string{"[]"}, "function calling is not implemented"},
		{"response_format", u.ResponseFormat, []string{`{"type":"text"}`}, "structured output is not implemented"},
		{"guided_json", u.GuidedJSON, nil, "structured output is not implemented"},
		{"guided_regex", u.GuidedRegex, nil, "structured output is not implemented"},
		{"guided_choice", u.GuidedChoice, nil, "structured output is not implemented"},
	}
	for _, c := range checks {
		v := compactJSON(c.raw)
		if v == "" || v == "null" {
			continue
		}
		ok := false
		for _, n := range c.noop {
			ok = ok || v == n
		}
		if !ok {
			return badRequest(c.name, "%s is not supported by lumen yet (%s); got %s: leave it out or at its default", c.name, c.why, v)
		}
	}
	return nil
}

// compactJSON is raw without insignificant whitespace ("" for none or
// invalid JSON, which the typed fields reject on their own).
func compactJSON(raw json.RawMessage) string {
	if len(bytes.TrimSpace(raw)) == 0 {
		return ""
	}
	var b bytes.Buffer
	if err := json.Compact(&b, raw); err != nil {
		return string(bytes.TrimSpace(raw))
	}
	return b.String()
}

// decodeRequest parses a body and turns JSON type errors into 400s naming
// the parameter.
func decodeRequest(r io.Reader) (*request, error) {
	body, err := io.ReadAll(r)
	if err != nil {
		return nil, err
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, badRequest("", "the request body is empty; send a JSON object")
	}
	var req request
	if err := json.Unmarshal(body, &req); err != nil {
		var ae *apiError
		var te *json.UnmarshalTypeError
		var se *json.SyntaxError
		switch {
		case errors.As(err, &ae):
			return nil, ae
		case errors.As(err, &te):
			return nil, badRequest(te.Field, "%s must be %s, got a JSON %s", te.Field, jsonType(te.Type.Kind()), te.Value)
		case errors.As(err, &se):
			return nil, badRequest("", "the body is not valid JSON: %v (at byte %d)", se, se.Offset)
		}
		return nil, badRequest("", "the body is not a valid request: %v", err)
	}
	return &req, nil
}

// params are a validated request's generation parameters.
type params struct {
	maxTokens   int
	temperature float32
	topP        float32
	seed        uint64
	seeded      bool
	stop        []string
	// logprobs: each token's logprob, with the topLogprobs most likely
	// tokens at its position.
	logprobs    bool
	topLogprobs int
	// n: the samples (choices) to return, each its own request to the
	// cluster with the seed plus its index; bestOf (≥ n) the samples
	// drawn, of which the n with the highest cumulative logprob return.
	n, bestOf int
	// echo: the prompt comes back before the completion, with its
	// logprobs when logprobs are asked for (the first token's null).
	echo bool
	// priority: the request's priority (request.Priority).
	priority int32
}

// validate checks what both endpoints share. defMax is the default
// max_tokens; context the model's context length.
func (req *request) validate(chat bool, defMax int) (params, *apiError) {
	var p params
	if req.Model == "" {
		return p, badRequest("model", "you must provide a model parameter")
	}
	mt := req.MaxTokens
	if chat && req.MaxCompletionTokens != nil {
		mt = req.MaxCompletionTokens
	}
	if req.Echo != nil && *req.Echo {
		if chat {
			return p, badRequest("echo", "echo is a parameter of /v1/completions")
		}
		p.echo = true
	}
	p.maxTokens = defMax
	if mt != nil {
		// max_tokens 0 with echo scores the prompt alone (what
		// lm-evaluation-harness's loglikelihood requests send).
		if *mt < 0 || *mt == 0 && !p.echo {
			return p, badRequest("max_tokens", "max_tokens must be at least 1 (0 only with echo), got %d", *mt)
		}
		if *mt > math.MaxInt32 {
			return p, badRequest("max_tokens", "max_tokens %d is too large", *mt)
		}
		p.maxTokens = int(*mt)
	}
	p.temperature = 1
	if req.Temperature != nil {
		t := *req.Temperature
		if math.IsNaN(t) || t < 0 || t > 2 {
			return p, badRequest("temperature", "temperature must be between 0 and 2, got %v", t)
		}
		p.temperature = float32(t)
	}
	p.topP = 1
	if req.TopP != nil {
		t := *req.TopP
		if math.IsNaN(t) || t <= 0 || t > 1 {
			return p, badRequest("top_p", "top_p must be greater than 0 and at most 1, got %v", t)
		}
		p.topP = float32(t)
	}
	if aerr := req.refuseUnsupported(); aerr != nil {
		return p, aerr
	}
	p.n = 1
	if req.N != nil {
		if *req.N < 1 || *req.N > maxN {
			return p, badRequest("n", "n must be between 1 and %d, got %d", maxN, *req.N)
		}
		p.n = int(*req.N)
	}
	p.bestOf = p.n
	if req.BestOf != nil {
		// vLLM's and OpenAI's best_of: draw best_of samples, return the n
		// with the highest cumulative logprob (completions only, and not
		// streamed: the best are known only once every sample ended).
		switch b := *req.BestOf; {
		case chat:
			return p, badRequest("best_of", "best_of is a parameter of /v1/completions; chat completions take n")
		case b < int64(p.n) || b > maxN:
			return p, badRequest("best_of", "best_of must be between n (%d) and %d, got %d", p.n, maxN, b)
		case b > int64(p.n) && req.Stream:
			return p, badRequest("best_of", "best_of (%d) above n (%d) cannot be streamed: the best samples are known only once all have ended", b, p.n)
		default:
			p.bestOf = int(b)
		}
	}
	if req.Seed != nil {
		p.seed, p.seeded = uint64(*req.Seed), true
	}
	if len(req.Stop) > maxStopSequences {
		return p, badRequest("stop", "stop has %d sequences; at most %d", len(req.Stop), maxStopSequences)
	}
	for i, s := range req.Stop {
		if s == "" || len(s) > maxStopBytes {
			return p, badRequest("stop", "stop[%d] must be 1..%d bytes, got %d", i, maxStopBytes, len(s))
		}
	}
	p.stop = req.Stop
	if req.Priority != nil {
		v := *req.Priority
		if v < policy.MinPriority || v > policy.MaxPriority {
			return p, badRequest("priority", "priority must be between %d and %d (lower is served first, 0 the default; below 0 is high priority), got %d",
				policy.MinPriority, policy.MaxPriority, v)
		}
		p.priority = int32(v)
	}
	if aerr := req.validateLogprobs(chat, &p); aerr != nil {
		return p, aerr
	}
	if req.StreamOptions != nil && !req.Stream {
		return p, badRequest("stream_options", "stream_options is only allowed when stream is true")
	}
	if chat {
		if req.Prompt != nil {
			return p, badRequest("prompt", "chat completions take messages, not prompt")
		}
		if len(req.Messages) == 0 {
			return p, badRequest("messages", "messages must hold at least one message")
		}
		if len(req.Messages) > maxMessages {
			return p, badRequest("messages", "messages has %d entries; at most %d", len(req.Messages), maxMessages)
		}
		for i, m := range req.Messages {
			switch m.Role {
			case "system", "user", "assistant", "developer":
			default:
				return p, badRequest("messages", "messages[%d].role %q must be system, developer, user or assistant", i, m.Role)
			}
		}
	} else {
		if len(req.Messages) > 0 {
			return p, badRequest("messages", "completions take prompt, not messages; use /v1/chat/completions")
		}
		if req.Prompt == nil {
			return p, badRequest("prompt", "you must provide a prompt")
		}
		if req.Prompt.text != nil && *req.Prompt.text == "" || req.Prompt.text == nil && len(req.Prompt.tokens) == 0 {
			return p, badRequest("prompt", "prompt is empty")
		}
	}
	return p, nil
}

// maxLogprobs is the most alternatives a request may ask for per token
// (vLLM's default max_logprobs, and OpenAI's limit).
const maxLogprobs = 20

// validateLogprobs reads the logprob parameters as vLLM takes them:
// completions' integer `logprobs` (0..20 alternatives per token), chat's
// boolean `logprobs` with `top_logprobs` (0..20, only with logprobs).
func (req *request) validateLogprobs(chat bool, p *params) *apiError {
	raw := bytes.TrimSpace(req.Logprobs)
	null := len(raw) == 0 || string(raw) == "null"
	if chat {
		if !null {
			if err := json.Unmarshal(raw, &p.logprobs); err != nil {
				return badRequest("logprobs", "logprobs must be a boolean for chat completions (the alternatives per token go in top_logprobs), got %s", raw)
			}
		}
		if req.TopLogprobs != nil {
			k := *req.TopLogprobs
			if k < 0 || k > maxLogprobs {
				return badRequest("top_logprobs", "top_logprobs must be between 0 and %d, got %d", maxLogprobs, k)
			}
			if k > 0 && !p.logprobs {
				return badRequest("top_logprobs", "top_logprobs needs logprobs set to true")
			}
			p.topLogprobs = int(k)
		}
		return nil
	}
	if req.TopLogprobs != nil {
		return badRequest("top_logprobs", "completions take the alternatives per token in logprobs (an integer 0..%d), not top_logprobs", maxLogprobs)
	}
	if null {
		return nil
	}
	var k int64
	if err := json.Unmarshal(raw, &k); err != nil {
		return badRequest("logprobs", "logprobs must be an integer between 0 and %d for completions, got %s", maxLogprobs, raw)
	}
	if k < 0 || k > maxLogprobs {
		return badRequest("logprobs", "logprobs must be between 0 and %d, got %d", maxLogprobs, k)
	}
	p.logprobs, p.topLogprobs = true, int(k)
	return nil
}

// jsonType names a Go kind as the JSON type a client must send.
func jsonType(k reflect.Kind) string {
	switch k {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean"
	case reflect.Slice, reflect.Array:
		return "an array"
	}
	return "an object"
}
