package gateway

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/tokenizer"
)

func TestLogprobsErrors(t *testing.T) {
	h := newTestGateway(t, nil).Handler()
	cases := []struct {
		name, path, body string
		param, msg       string
	}{
		{"completions above 20", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","logprobs":21}`, "logprobs", "logprobs must be between 0 and 20, got 21"},
		{"completions negative", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","logprobs":-1}`, "logprobs", "between 0 and 20, got -1"},
		{"completions boolean", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","logprobs":true}`, "logprobs", "must be an integer between 0 and 20"},
		{"completions top_logprobs", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","top_logprobs":2}`, "top_logprobs", "not top_logprobs"},
		{"chat above 20", "/v1/chat/completions", `{"model":"lumen-tiny","messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":25}`, "top_logprobs", "top_logprobs must be between 0 and 20, got 25"},
		{"chat without logprobs", "/v1/chat/completions", `{"model":"lumen-tiny","messages":[{"role":"user","content":"x"}],"top_logprobs":3}`, "top_logprobs", "needs logprobs set to true"},
		{"chat integer", "/v1/chat/completions", `{"model":"lumen-tiny","messages":[{"role":"user","content":"x"}],"logprobs":5}`, "logprobs", "must be a boolean"},
	}
	for _, c := range cases {
		code, body := post(t, h, c.path, c.body)
		msg, param := errorOf(body)
		if code != 400 || param != c.param || !strings.Contains(msg, c.msg) {
			t.Errorf("%s: %d param %q %q, want 400 param %q containing %q", c.name, code, param, msg, c.param, c.msg)
		}
	}
}

// lpResp is a token the fake worker sends with its logprobs: the chosen
// one, then top alternatives t1, t2 (the chosen first among them when it
// is the most likely).
func lpResp(idx uint32, tok int32, lp float32, top ...int32) *pb.GenerateResponse {
	r := &pb.GenerateResponse{Token: tok, Index: idx, Logprob: lp}
	for i, id := range top {
		r.TopLogprobs = append(r.TopLogprobs, &pb.TokenLogprob{Token: id, Logprob: -0.5 * float32(i+1)})
	}
	return r
}

func (c *call) sendResp(t *testing.T, r *pb.GenerateResponse) {
	t.Helper()
	select {
	case c.out <- r:
		if err := <-c.sent; err != nil {
			t.Fatalf("sending token %d: %v", r.Index, err)
		}
	case <-c.ctx.Done():
		t.Fatalf("the gateway cut the call before token %d", r.Index)
	}
}

// postRaw posts body and returns the response: the JSON object, or the
// stream's events (data lines before [DONE]).
func postRaw(t *testing.T, addr, path, body string) (int, []map[string]any) {
	resp, err := (&http.Client{Timeout: 60 * time.Second}).Post("http://"+addr+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Error(err)
		return 0, nil
	}
	defer resp.Body.Close()
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		var m map[string]any
		b, _ := io.ReadAll(resp.Body)
		if err := json.Unmarshal(b, &m); err != nil {
			t.Errorf("%s: %v", b, err)
		}
		return resp.StatusCode, []map[string]any{m}
	}
	var evs []map[string]any
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || line == "[DONE]" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Errorf("%s: %v", line, err)
		}
		evs = append(evs, m)
	}
	return resp.StatusCode, evs
}

// roundTrip is JSON's view of v.
func roundTrip(v any) any {
	b, _ := json.Marshal(v)
	var out any
	_ = json.Unmarshal(b, &out)
	return out
}

// TestLogprobsInResponses: the worker's logprobs come out as vLLM shapes
// them — completions' tokens/token_logprobs/top_logprobs/text_offset (the
// chosen token first in each top map, then the alternatives), chat's
// content entries with bytes and exactly top_logprobs alternatives —
// streaming and not; the request carries logprobs to the worker; and a
// request that moved mid-stream has every token's logprobs once, in
// order (the journal keeps them across the resume).
func TestLogprobsInResponses(t *testing.T) {
	r := newRig(t, 1, nil, nil)
	const eos = tokenizer.TokEOS
	// Tokens: 'H' (most likely), 0xC3 (a byte of a multi-byte character),
	// then <|eos|> or <|im_end|>.
	for _, tc := range []struct {
		name, path, body string
		top              uint32
		want             any
	}{
		{"completions", "/v1/completions", `{"model":"lumen-tiny","prompt":"x","max_tokens":3,"logprobs":2}`, 2,
			map[string]any{"tokens": []any{"H", "\ufffd", "<|eos|>"}, "token_logprobs": []any{-0.25, -3.0, -0.75},
				"top_logprobs": []any{map[string]any{"H": -0.25, "a": -1.0}, map[string]any{"\ufffd": -3.0, "H": -0.5, "a": -1.0},
					map[string]any{"<|eos|>": -0.75, "H": -0.5, "a": -1.0}},
				"text_offset": []any{0.0, 1.0, 2.0}}},
		{"chat", "/v1/chat/completions", `{"model":"lumen-tiny","messages":[{"role":"user","content":"x"}],"max_tokens":3,"logprobs":true,"top_logprobs":1}`, 1,
			map[string]any{"content": []any{
				map[string]any{"token": "H", "logprob": -0.25, "bytes": []any{72.0}, "top_logprobs": []any{map[string]any{"token": "H", "logprob": -0.5, "bytes": []any{72.0}}}},
				map[string]any{"token": "\ufffd", "logprob": -3.0, "bytes": []any{195.0}, "top_logprobs": []any{map[string]any{"token": "H", "logprob": -0.5, "bytes": []any{72.0}}}},
				map[string]any{"token": "<|eos|>", "logprob": -0.75, "bytes": toAny(tokenBytes(eos)), "top_logprobs": []any{map[string]any{"token": "H", "logprob": -0.5, "bytes": []any{72.0}}}},
			}}},
	} {
		for _, stream := range []bool{false, true} {
			name := tc.name
			body := tc.body
			if stream {
				name += " streaming"
				body = strings.Replace(body, `{`, `{"stream":true,`, 1)
			}
			type result struct {
				code int
				evs  []map[string]any
			}
			done := make(chan result, 1)
			go func() {
				code, evs := postRaw(t, r.g.Addr(), tc.path, body)
				done <- result{code, evs}
			}()
			c := r.w["w1"].next(t)
			if !c.req.Logprobs || c.req.TopLogprobs != tc.top {
				t.Fatalf("%s: the worker was asked logprobs=%v top %d, want true, %d", name, c.req.Logprobs, c.req.TopLogprobs, tc.top)
			}
			before := tokensOut(r.g)
			c.sendResp(t, lpResp(0, 'H', -0.25, 'H', 'a'))
			waitFor(t, 10*time.Second, "the gateway to take the first token", func() bool { return tokensOut(r.g) > before })
			// The move: the rest comes from w2, which continues at index 1.
			r.fc.publish(moved(&pb.Placement{RequestId: c.req.RequestId, WorkerId: "w2", Epoch: 2}))
			c2 := r.w["w2"].next(t)
			if len(c2.req.Generated) != 1 || !c2.req.Logprobs {
				t.Fatalf("%s: resumed with %v, logprobs %v", name, c2.req.Generated, c2.req.Logprobs)
			}
			c2.sendResp(t, lpResp(0, 'H', -0.25, 'H', 'a')) // a repeat: dropped
			c2.sendResp(t, lpResp(1, 0xC3, -3, 'H', 'a'))
			last := lpResp(2, eos, -0.75, 'H', 'a')
			if tc.name == "chat" {
				last = lpResp(2, tokenizer.TokImEnd, -0.75, 'H', 'a')
			}
			last.Done, last.FinishReason = true, pb.FinishReason_FINISH_REASON_STOP
			c2.sendResp(t, last)
			res := <-done
			if res.code != 200 {
				t.Fatalf("%s: status %d %v", name, res.code, res.evs)
			}
			want := tc.want
			if tc.name == "chat" {
				w := roundTrip(want).(map[string]any)
				e := w["content"].([]any)[2].(map[string]any)
				e["token"], e["bytes"] = "<|im_end|>", toAny(tokenBytes(tokenizer.TokImEnd))
				want = w
			}
			got := mergeLogprobs(t, res.evs, tc.name == "chat")
			if !reflect.DeepEqual(roundTrip(got), roundTrip(want)) {
				gb, _ := json.Marshal(got)
				wb, _ := json.Marshal(want)
				t.Fatalf("%s: logprobs\n got %s\nwant %s", name, gb, wb)
			}
		}
	}
	// Without logprobs: null, and the worker is not asked.
	done := make(chan []map[string]any, 1)
	go func() {
		_, evs := postRaw(t, r.g.Addr(), "/v1/completions", `{"model":"lumen-tiny","prompt":"x","max_tokens":1}`)
		done <- evs
	}()
	c := r.w["w1"].next(t)
	if c.req.Logprobs {
		t.Fatal("the worker was asked for logprobs nobody wanted")
	}
	c.send(t, 0, 'a', true)
	evs := <-done
	if ch := evs[0]["choices"].([]any)[0].(map[string]any); ch["logprobs"] != nil {
		t.Fatalf("logprobs %v for a request without them", ch["logprobs"])
	}
}

func toAny(b []int) []any {
	out := make([]any, len(b))
	for i, v := range b {
		out[i] = float64(v)
	}
	return out
}

// mergeLogprobs joins the logprobs of a response's events into one object
// (a stream's chunks each carry their tokens'; text_offset goes on).
func mergeLogprobs(t *testing.T, evs []map[string]any, chat bool) any {
	t.Helper()
	var merged map[string]any
	for _, ev := range evs {
		chs, _ := ev["choices"].([]any)
		if len(chs) == 0 {
			continue
		}
		lp, _ := chs[0].(map[string]any)["logprobs"].(map[string]any)
		if lp == nil {
			continue
		}
		if merged == nil {
			merged = lp
			continue
		}
		for k, v := range lp {
			merged[k] = append(merged[k].([]any), v.([]any)...)
		}
	}
	return merged
}

// TestTopLogprobsKeysAreUnique: lone bytes above 0x7F all read as U+FFFD;
// the completions' top map keeps the first of them (JSON objects with
// repeated keys are ambiguous).
func TestTopLogprobsKeysAreUnique(t *testing.T) {
	c, _ := completionsLogprobs([]*pb.GenerateResponse{lpResp(0, 0xC3, -1, 0xC3, 0xA9, 'a')}, 0, false)
	b, err := json.Marshal(c.TopLogprobs[0])
	if err != nil || string(b) != `{"\ufffd":-1,"a":-1.5}` {
		t.Fatalf("top map %s (%v)", b, err)
	}
}

// echo with logprobs: the worker is asked for the prompt's logprobs until a
// token's message brings them — the call a resume makes before any token
// asks again, one after the first token does not — and the response is
// the prompt, its logprobs (the first null, text offsets from 0), then the
// completion's, streaming and not. With max_tokens 0 the prompt alone
// comes back: the worker's one token is not the client's.
func TestEchoWithPromptLogprobs(t *testing.T) {
	r := newRig(t, 1, nil, nil)
	promptLPs := []*pb.PromptLogprob{{Logprob: -1.5, TopLogprobs: []*pb.TokenLogprob{{Token: 'a', Logprob: -0.5}}},
		{Logprob: -2.5, TopLogprobs: []*pb.TokenLogprob{{Token: 'a', Logprob: -0.5}}}}
	wantPrompt := map[string]any{"tokens": []any{"x", "y", "z"}, "token_logprobs": []any{nil, -1.5, -2.5},
		"top_logprobs": []any{nil, map[string]any{"y": -1.5, "a": -0.5}, map[string]any{"z": -2.5, "a": -0.5}},
		"text_offset":  []any{0.0, 1.0, 2.0}}
	for _, stream := range []bool{false, true} {
		body := `{"model":"lumen-tiny","prompt":"xyz","max_tokens":2,"logprobs":1,"echo":true,"stream":` + strconv.FormatBool(stream) + `}`
		done := make(chan []map[string]any, 1)
		go func() {
			code, evs := postRaw(t, r.g.Addr(), "/v1/completions", body)
			if code != 200 {
				t.Errorf("stream %v: status %d %v", stream, code, evs)
			}
			done <- evs
		}()
		c := r.w["w1"].next(t)
		if !c.req.PromptLogprobs || !c.req.Logprobs || c.req.TopLogprobs != 1 {
			t.Fatalf("the worker was asked prompt_logprobs %v, logprobs %v, top %d; want true, true, 1", c.req.PromptLogprobs, c.req.Logprobs, c.req.TopLogprobs)
		}
		// The worker dies before any token: the resume asks again.
		c.fail(status.Error(codes.Unavailable, "killed"))
		r.fc.setPlacement(&pb.Placement{RequestId: c.req.RequestId, WorkerId: "w2", Epoch: 2})
		c2 := r.w["w2"].next(t)
		if !c2.req.PromptLogprobs || len(c2.req.Generated) != 0 {
			t.Fatalf("the resume before any token: prompt_logprobs %v, %d generated; want true, 0", c2.req.PromptLogprobs, len(c2.req.Generated))
		}
		first := lpResp(0, 'H', -0.25, 'a')
		first.PromptLogprobs = promptLPs
		before := tokensOut(r.g)
		c2.sendResp(t, first)
		waitFor(t, 10*time.Second, "the gateway to take the first token", func() bool { return tokensOut(r.g) > before })
		// Moved after it: the next call has the prompt's logprobs already.
		r.fc.publish(moved(&pb.Placement{RequestId: c.req.RequestId, WorkerId: "w1", Epoch: 3}))
		c3 := r.w["w1"].next(t)
		if c3.req.PromptLogprobs || len(c3.req.Generated) != 1 {
			t.Fatalf("the call after the first token: prompt_logprobs %v, %d generated; want false, 1", c3.req.PromptLogprobs, len(c3.req.Generated))
		}
		last := lpResp(1, 'i', -0.75, 'a')
		last.Done, last.FinishReason = true, pb.FinishReason_FINISH_REASON_LENGTH
		c3.sendResp(t, last)
		evs := <-done
		text := ""
		for _, ev := range evs {
			for _, ch := range ev["choices"].([]any) {
				text += ch.(map[string]any)["text"].(string)
			}
		}
		if text != "xyzHi" {
			t.Fatalf("stream %v: text %q, want the prompt then the completion, \"xyzHi\"", stream, text)
		}
		want := roundTrip(wantPrompt).(map[string]any)
		want["tokens"] = append(want["tokens"].([]any), "H", "i")
		want["token_logprobs"] = append(want["token_logprobs"].([]any), -0.25, -0.75)
		want["top_logprobs"] = append(want["top_logprobs"].([]any), map[string]any{"H": -0.25, "a": -0.5}, map[string]any{"i": -0.75, "a": -0.5})
		want["text_offset"] = append(want["text_offset"].([]any), 3.0, 4.0)
		if got := mergeLogprobs(t, evs, false); !reflect.DeepEqual(roundTrip(got), want) {
			gb, _ := json.Marshal(got)
			wb, _ := json.Marshal(want)
			t.Fatalf("stream %v: logprobs\n got %s\nwant %s", stream, gb, wb)
		}
	}
	// max_tokens 0: the prompt and its logprobs alone, no completion
	// token billed, finish length.
	done := make(chan []map[string]any, 1)
	go func() {
		_, evs := postRaw(t, r.g.Addr(), "/v1/completions", `{"model":"lumen-tiny","prompt":"xyz","max_tokens":0,"logprobs":1,"echo":true}`)
		done <- evs
	}()
	c := r.w["w1"].next(t)
	if c.req.MaxTokens != 1 || !c.req.PromptLogprobs {
		t.Fatalf("max_tokens 0: the worker was asked %d tokens, prompt_logprobs %v; want 1, true", c.req.MaxTokens, c.req.PromptLogprobs)
	}
	only := lpResp(0, 'H', -0.25, 'a')
	only.PromptLogprobs, only.Done, only.FinishReason = promptLPs, true, pb.FinishReason_FINISH_REASON_LENGTH
	c.sendResp(t, only)
	evs := <-done
	ch := evs[0]["choices"].([]any)[0].(map[string]any)
	usage := evs[0]["usage"].(map[string]any)
	if ch["text"] != "xyz" || ch["finish_reason"] != "length" || usage["completion_tokens"] != 0.0 {
		t.Fatalf("max_tokens 0: %v, usage %v; want text \"xyz\", finish length, 0 completion tokens", ch, usage)
	}
	if got := roundTrip(ch["logprobs"]); !reflect.DeepEqual(got, roundTrip(wantPrompt)) {
		t.Fatalf("max_tokens 0: logprobs %v, want %v", got, wantPrompt)
	}
}
