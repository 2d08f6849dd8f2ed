package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/tokenizer"
	"github.com/lumen-project/lumen/worker/engine"
)

// npmClient is e2e/npm: the official openai npm package, pinned by its
// package-lock.json, and client.mjs, which drives it.
const npmClient = "npm"

// nodeWithOpenAI returns node's path once e2e/npm has its packages
// (`make npm` runs npm ci there; `make test` does first).
func nodeWithOpenAI(t *testing.T) string {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatal("no node for the npm client's test: install Node.js >= 20 with npm (apt-get install nodejs npm), then `make npm`; `go test -short` leaves the test out")
	}
	if _, err := os.Stat(filepath.Join(npmClient, "node_modules", "openai", "package.json")); err != nil {
		t.Fatal("e2e/npm has no node_modules/openai: run `make npm` (npm ci in e2e/npm, from its package-lock.json)")
	}
	return node
}

// referenceLogprobs decodes prompt greedily, alone, for n tokens and
// returns each one's logprob and the top k at its position.
func referenceLogprobs(t *testing.T, e *engine.Transformer, prompt []int32, n, k int) []engine.Logprobs {
	t.Helper()
	defer e.Release(1)
	var out []engine.Logprobs
	in := prompt
	for len(out) < n {
		slot := make([]engine.Logprobs, 1)
		got, err := e.Forward(context.Background(), []engine.Chunk{{Seq: 1, Tokens: in, Sample: 1, OutIndex: len(out), Logprobs: slot, TopLogprobs: k}})
		if err != nil {
			t.Fatal(err)
		}
		out, in = append(out, slot[0]), got[0]
	}
	return out
}

// npmResult is what client.mjs prints.
type npmResult struct {
	Completions []struct {
		Plain, Streamed npmCall[npmCompletion]
	} `json:"completions"`
	Chat struct {
		Plain, Streamed npmCall[npmChat]
	} `json:"chat"`
	Errors     map[string]npmCall[json.RawMessage] `json:"errors"`
	Models     npmCall[[]string]                   `json:"models"`
	Concurrent []npmCall[string]                   `json:"concurrent"`
	Held       string                              `json:"held"`
	Samples    npmCall[struct {
		Texts  []string `json:"texts"`
		Finish []string `json:"finish"`
	}] `json:"samples"`
	Echo npmCall[struct {
		Text             string     `json:"text"`
		TokenLogprobs    []*float64 `json:"token_logprobs"`
		CompletionTokens int        `json:"completion_tokens"`
	}] `json:"echo"`
	BestOf npmCall[struct {
		Texts            []string `json:"texts"`
		CompletionTokens int      `json:"completion_tokens"`
	}] `json:"bestOf"`
}

type npmCompletion struct {
	Text             string              `json:"text"`
	Finish           string              `json:"finish"`
	CompletionTokens int                 `json:"completion_tokens"`
	Logprobs         *npmCompletionLogps `json:"logprobs"`
}

type npmChat struct {
	Content          string `json:"content"`
	Finish           string `json:"finish"`
	CompletionTokens int    `json:"completion_tokens"`
	Logprobs         []struct {
		Token       string  `json:"token"`
		Logprob     float64 `json:"logprob"`
		Bytes       []int   `json:"bytes"`
		TopLogprobs []struct {
			Token   string  `json:"token"`
			Logprob float64 `json:"logprob"`
		} `json:"top_logprobs"`
	} `json:"logprobs"`
}

type npmCompletionLogps struct {
	Tokens        []string             `json:"tokens"`
	TokenLogprobs []float64            `json:"token_logprobs"`
	TopLogprobs   []map[string]float64 `json:"top_logprobs"`
	TextOffset    []int                `json:"text_offset"`
}

type npmCall[T any] struct {
	OK    T         `json:"ok"`
	Error *npmError `json:"error"`
}

type npmError struct {
	Class   string  `json:"class"`
	Status  int     `json:"status"`
	Message string  `json:"message"`
	Type    *string `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

// TestOpenAINpmClient drives the gateway with the official openai npm
// package, as TestOpenAISDK does with the Go SDK: completions and chat,
// streaming and not, every output equal to the engine's reference, with
// logprobs (each chosen token's equal to the reference's as float32, and
// the top ones); errors come out as the package's error classes —
// BadRequestError (400: parameters out of range), NotFoundError (404: an
// unknown model, an unknown path), AuthenticationError (401),
// RateLimitError (429: a gateway admitting one request at a time).
func TestOpenAINpmClient(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster and node")
	}
	node := nodeWithOpenAI(t)
	modelDir := t.TempDir()
	if _, _, err := engine.InitModel(modelDir, engine.DefaultSeed); err != nil {
		t.Fatal(err)
	}
	cl := startQuorum(t)
	for _, id := range []string{"w1", "w2"} {
		if _, err := cl.AddWorker(id, "-model-dir", modelDir, "-kv-pages", "1024"); err != nil {
			t.Fatal(err)
		}
	}
	gw, err := cl.StartGateway("", "-api-keys", "sk-test")
	if err != nil {
		t.Fatal(err)
	}
	limited, err := cl.StartGateway("", "-api-keys", "sk-test", "-max-concurrent", "1")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if err := gw.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if err := limited.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	ref, err := engine.NewTransformer(engine.TransformerConfig{Path: filepath.Join(modelDir, engine.TargetFile), Pages: 256})
	if err != nil {
		t.Fatal(err)
	}
	const maxTokens, chatMaxTokens, top = 24, 32, 3
	prompts := []string{"The cluster", "kill -9 and carry on"}
	msgs := []tokenizer.Message{{Role: "system", Content: "be brief"}, {Role: "user", Content: "where do requests go when a worker dies?"}}
	spec := map[string]any{"baseURL": "http://" + gw.Addr + "/v1", "limitedURL": "http://" + limited.Addr + "/v1", "apiKey": "sk-test",
		"model": "lumen-tiny", "prompts": prompts, "maxTokens": maxTokens, "chatMaxTokens": chatMaxTokens, "topLogprobs": top,
		"messages": []map[string]string{{"role": msgs[0].Role, "content": msgs[0].Content}, {"role": msgs[1].Role, "content": msgs[1].Content}}}
	specFile := filepath.Join(t.TempDir(), "spec.json")
	b, _ := json.Marshal(spec)
	if err := os.WriteFile(specFile, b, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, node, "client.mjs", specFile)
	cmd.Dir = npmClient
	var stderr strings.Builder
	cmd.Stderr = &stderr
	raw, err := cmd.Output()
	if err != nil {
		t.Fatalf("node client.mjs: %v\n%s", err, stderr.String())
	}
	var res npmResult
	if err := json.Unmarshal(raw, &res); err != nil {
		t.Fatalf("client.mjs printed %s: %v", raw, err)
	}

	var tk tokenizer.Tokenizer
	for i, prompt := range prompts {
		want, reason, n := referenceText(t, ref, tk.Encode(prompt), maxTokens, tokenizer.TokEOS)
		wantLP := referenceLogprobs(t, ref, tk.Encode(prompt), n, top)
		got := res.Completions[i]
		for name, c := range map[string]npmCall[npmCompletion]{"completion": got.Plain, "streaming completion": got.Streamed} {
			if c.Error != nil {
				t.Fatalf("%s %d: %+v", name, i, c.Error)
			}
			if c.OK.Text != want || c.OK.Finish != reason || (name == "completion" && c.OK.CompletionTokens != n) {
				t.Fatalf("%s %d: %q %s %d, want %q %s %d", name, i, c.OK.Text, c.OK.Finish, c.OK.CompletionTokens, want, reason, n)
			}
			lp := c.OK.Logprobs
			if lp == nil || len(lp.Tokens) != n || len(lp.TokenLogprobs) != n || len(lp.TopLogprobs) != n || len(lp.TextOffset) != n {
				t.Fatalf("%s %d: logprobs %+v for %d tokens", name, i, lp, n)
			}
			for j := range n {
				if float32(lp.TokenLogprobs[j]) != wantLP[j].Logprob {
					t.Fatalf("%s %d: token %d logprob %v, reference %v", name, i, j, lp.TokenLogprobs[j], wantLP[j].Logprob)
				}
				// The chosen token, then the top 3 (fewer when two share a
				// string, or the chosen one is among them).
				if k := len(lp.TopLogprobs[j]); k < 1 || k > top+1 {
					t.Fatalf("%s %d: token %d has %d top logprobs", name, i, j, k)
				}
				// Every alternative is there (bytes that are not UTF-8
				// alone all read as U+FFFD: one key for them).
				for _, alt := range wantLP[j].Top {
					s := strings.ToValidUTF8(tk.Decode([]int32{alt.Token}), "\uFFFD")
					if v, ok := lp.TopLogprobs[j][s]; !ok || s != "\uFFFD" && float32(v) != alt.Logprob {
						t.Fatalf("%s %d: token %d: top %q = %v (%v), reference %v", name, i, j, s, v, ok, alt.Logprob)
					}
				}
			}
		}
	}

	want, reason, n := referenceText(t, ref, tk.ApplyChatTemplate(msgs), chatMaxTokens, tokenizer.TokEOS, tokenizer.TokImEnd)
	wantLP := referenceLogprobs(t, ref, tk.ApplyChatTemplate(msgs), n, top)
	for name, c := range map[string]npmCall[npmChat]{"chat": res.Chat.Plain, "streaming chat": res.Chat.Streamed} {
		if c.Error != nil {
			t.Fatalf("%s: %+v", name, c.Error)
		}
		if c.OK.Content != want || c.OK.Finish != reason || c.OK.CompletionTokens != n || len(c.OK.Logprobs) != n {
			t.Fatalf("%s: %q %s %d tokens (%d logprobs), want %q %s %d", name, c.OK.Content, c.OK.Finish, c.OK.CompletionTokens, len(c.OK.Logprobs), want, reason, n)
		}
		var text []byte
		for j, e := range c.OK.Logprobs {
			if float32(e.Logprob) != wantLP[j].Logprob || len(e.TopLogprobs) != top {
				t.Fatalf("%s: token %d: logprob %v with %d top, reference %v with %d", name, j, e.Logprob, len(e.TopLogprobs), wantLP[j].Logprob, top)
			}
			for x, alt := range e.TopLogprobs {
				if float32(alt.Logprob) != wantLP[j].Top[x].Logprob {
					t.Fatalf("%s: token %d: top %d %v, reference %v", name, j, x, alt.Logprob, wantLP[j].Top[x].Logprob)
				}
			}
			if j < n-1 || reason != "stop" {
				for _, v := range e.Bytes {
					text = append(text, byte(v))
				}
			}
		}
		// The tokens' bytes spell the content (the stop token aside).
		if jsonText(text) != want {
			t.Fatalf("%s: the logprobs' bytes spell %q, the content is %q", name, jsonText(text), want)
		}
	}

	// Errors: the client's classes, with the gateway's status, param and
	// message.
	for name, w := range map[string]struct {
		class  string
		status int
		param  string
		msg    string
	}{
		"unknownModel":    {"NotFoundError", 404, "model", "gpt-4"},
		"badTemperature":  {"BadRequestError", 400, "temperature", "between 0 and 2"},
		"tooManyLogprobs": {"BadRequestError", 400, "logprobs", "between 0 and 20, got 21"},
		"chatTopLogprobs": {"BadRequestError", 400, "top_logprobs", "between 0 and 20, got 30"},
		"unknownPath":     {"NotFoundError", 404, "", "Invalid URL (POST /v1/embeddings)"},
		"wrongKey":        {"AuthenticationError", 401, "", "Incorrect API key"},
		"suffix":          {"BadRequestError", 400, "suffix", "suffix is not supported"},
	} {
		e := res.Errors[name].Error
		if e == nil || e.Class != w.class || e.Status != w.status || !strings.Contains(e.Message, w.msg) ||
			(w.param != "" && (e.Param == nil || *e.Param != w.param)) {
			t.Errorf("%s: %+v, want %s %d param %q containing %q", name, e, w.class, w.status, w.param, w.msg)
		}
	}
	if res.Models.Error != nil || len(res.Models.OK) != 1 || res.Models.OK[0] != "lumen-tiny" {
		t.Errorf("models: %+v", res.Models)
	}
	// n=2 greedy, streamed: both choices are the reference.
	wantS, reasonS, nS := referenceText(t, ref, tk.Encode(prompts[0]), maxTokens, tokenizer.TokEOS)
	if s := res.Samples; s.Error != nil || len(s.OK.Texts) != 2 || s.OK.Texts[0] != wantS || s.OK.Texts[1] != wantS ||
		len(s.OK.Finish) != 2 || s.OK.Finish[0] != reasonS || s.OK.Finish[1] != reasonS {
		t.Errorf("n=2 streamed: %+v, want both %q %s", s, wantS, reasonS)
	}
	// echo, max_tokens 0: the prompt, its logprobs as the engine scores
	// them (the first null), nothing billed.
	p0 := tk.Encode(prompts[0])
	scores := make([]engine.Logprobs, len(p0)-1)
	if _, err := ref.Forward(context.Background(), []engine.Chunk{{Seq: 3, Tokens: p0, Targets: p0[1:], Scores: scores, TopLogprobs: 1}}); err != nil {
		t.Fatal(err)
	}
	ref.Release(3)
	if e := res.Echo; e.Error != nil || e.OK.Text != prompts[0] || len(e.OK.TokenLogprobs) != len(p0) || e.OK.TokenLogprobs[0] != nil || e.OK.CompletionTokens != 0 {
		t.Errorf("echo, max_tokens 0: %+v, want the prompt %q with %d logprobs, the first null, and no completion tokens", e, prompts[0], len(p0))
	} else {
		for i, s := range scores {
			if lp := e.OK.TokenLogprobs[i+1]; lp == nil || float32(*lp) != s.Logprob {
				t.Errorf("echo: prompt token %d's logprob %v, the engine scores %v", i+1, lp, s.Logprob)
				break
			}
		}
	}
	// best_of 3, greedy: one choice, the reference, three samples billed.
	if b := res.BestOf; b.Error != nil || len(b.OK.Texts) != 1 || b.OK.Texts[0] != wantS || b.OK.CompletionTokens != 3*nS {
		t.Errorf("best_of 3: %+v, want one choice %q and the usage of three", b, wantS)
	}
	// Five sent while a stream holds the only slot of a gateway admitting
	// one: every one is a RateLimitError; the stream is the reference.
	want0, _, _ := referenceText(t, ref, tk.Encode(prompts[0]), 64, tokenizer.TokEOS)
	if res.Held != want0 {
		t.Errorf("the stream holding the limited gateway's slot: %q, want the reference %q", res.Held, want0)
	}
	limitedN := 0
	for i, c := range res.Concurrent {
		if c.Error != nil && c.Error.Class == "RateLimitError" && c.Error.Status == 429 {
			limitedN++
		} else {
			t.Errorf("request %d sent while the only slot was held: %q %+v, want a RateLimitError", i, c.OK, c.Error)
		}
	}
	if limitedN != 5 {
		t.Errorf("%d of 5 requests were rate limited while the slot was held", limitedN)
	}
}
