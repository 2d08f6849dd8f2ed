package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/lumen-project/lumen/tokenizer"
	"github.com/lumen-project/lumen/worker/engine"
)

// referenceText decodes greedily with the engine, alone, and renders the text
// as the gateway does (bytes; special tokens and the stop token add nothing),
// with invalid UTF-8 replaced as JSON encoding replaces it.
func referenceText(t *testing.T, e *engine.Transformer, prompt []int32, max int, stops ...int32) (string, string, int) {
	t.Helper()
	ctx := context.Background()
	defer e.Release(1)
	out, err := e.Forward(ctx, []engine.Chunk{{Seq: 1, Tokens: prompt, Sample: 1}})
	if err != nil {
		t.Fatal(err)
	}
	var tk tokenizer.Tokenizer
	var text []byte
	n := 0
	for {
		tok := out[0][0]
		n++
		stop := false
		for _, s := range stops {
			stop = stop || s == tok
		}
		if stop {
			return jsonText(text), "stop", n
		}
		text = append(text, tk.DecodeToken(tok)...)
		if n == max {
			return jsonText(text), "length", n
		}
		if out, err = e.Forward(ctx, []engine.Chunk{{Seq: 1, Tokens: []int32{tok}, Sample: 1, OutIndex: n}}); err != nil {
			t.Fatal(err)
		}
	}
}

func jsonText(b []byte) string {
	enc, _ := json.Marshal(string(b))
	var s string
	_ = json.Unmarshal(enc, &s)
	return s
}

// TestOpenAISDK drives the gateway with the official OpenAI Go SDK:
// completions and chat, streaming and not; every output equals the engine's
// reference output for the same prompt.
func TestOpenAISDK(t *testing.T) {
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
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := gw.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	ref, err := engine.NewTransformer(engine.TransformerConfig{Path: filepath.Join(modelDir, engine.TargetFile), Pages: 256})
	if err != nil {
		t.Fatal(err)
	}
	client := openai.NewClient(option.WithBaseURL("http://"+gw.Addr+"/v1"), option.WithAPIKey("sk-test"), option.WithMaxRetries(0))
	var tk tokenizer.Tokenizer

	for i, prompt := range []string{"The cluster", "kill -9 and carry on", "é"} {
		want, reason, n := referenceText(t, ref, tk.Encode(prompt), 24, tokenizer.TokEOS)
		c, err := client.Completions.New(ctx, openai.CompletionNewParams{
			Model: "lumen-tiny", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String(prompt)},
			MaxTokens: openai.Int(24), Temperature: openai.Float(0), Logprobs: openai.Int(2)})
		if err != nil {
			t.Fatalf("completion %d: %v", i, err)
		}
		if c.Choices[0].Text != want || string(c.Choices[0].FinishReason) != reason || c.Usage.CompletionTokens != int64(n) {
			t.Fatalf("completion %d: %q %s %d, want %q %s %d", i, c.Choices[0].Text, c.Choices[0].FinishReason, c.Usage.CompletionTokens, want, reason, n)
		}
		wantLP := referenceLogprobs(t, ref, tk.Encode(prompt), n, 2)
		if lp := c.Choices[0].Logprobs; len(lp.TokenLogprobs) != n || len(lp.Tokens) != n || len(lp.TopLogprobs) != n || len(lp.TextOffset) != n {
			t.Fatalf("completion %d: logprobs %+v for %d tokens", i, lp, n)
		}
		for j, v := range c.Choices[0].Logprobs.TokenLogprobs {
			if float32(v) != wantLP[j].Logprob {
				t.Fatalf("completion %d: token %d logprob %v, reference %v", i, j, v, wantLP[j].Logprob)
			}
		}
		stream := client.Completions.NewStreaming(ctx, openai.CompletionNewParams{
			Model: "lumen-tiny", Prompt: openai.CompletionNewParamsPromptUnion{OfArrayOfTokens: toInt64(tk.Encode(prompt))},
			MaxTokens: openai.Int(24), Temperature: openai.Float(0)})
		var sb strings.Builder
		var finish string
		for stream.Next() {
			ch := stream.Current()
			if len(ch.Choices) > 0 {
				sb.WriteString(ch.Choices[0].Text)
				if ch.Choices[0].FinishReason != "" {
					finish = string(ch.Choices[0].FinishReason)
				}
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatalf("streaming completion %d: %v", i, err)
		}
		if sb.String() != want || finish != reason {
			t.Fatalf("streaming completion %d: %q %s, want %q %s", i, sb.String(), finish, want, reason)
		}
	}

	msgs := []tokenizer.Message{{Role: "system", Content: "be brief"}, {Role: "user", Content: "where do requests go when a worker dies?"}}
	want, reason, n := referenceText(t, ref, tk.ApplyChatTemplate(msgs), 32, tokenizer.TokEOS, tokenizer.TokImEnd)
	params := openai.ChatCompletionNewParams{Model: "lumen-tiny", MaxTokens: openai.Int(32), Temperature: openai.Float(0),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("be brief"), openai.UserMessage("where do requests go when a worker dies?")}}
	lpParams := params
	lpParams.Logprobs, lpParams.TopLogprobs = openai.Bool(true), openai.Int(2)
	cc, err := client.Chat.Completions.New(ctx, lpParams)
	if err != nil {
		t.Fatal(err)
	}
	if cc.Choices[0].Message.Content != want || string(cc.Choices[0].FinishReason) != reason || cc.Usage.CompletionTokens != int64(n) {
		t.Fatalf("chat: %q %s, want %q %s", cc.Choices[0].Message.Content, cc.Choices[0].FinishReason, want, reason)
	}
	wantLP := referenceLogprobs(t, ref, tk.ApplyChatTemplate(msgs), n, 2)
	if content := cc.Choices[0].Logprobs.Content; len(content) != n {
		t.Fatalf("chat: %d logprobs for %d tokens", len(content), n)
	}
	for j, e := range cc.Choices[0].Logprobs.Content {
		if float32(e.Logprob) != wantLP[j].Logprob || len(e.TopLogprobs) != 2 || float32(e.TopLogprobs[0].Logprob) != wantLP[j].Top[0].Logprob {
			t.Fatalf("chat: token %d: %+v, reference %+v", j, e, wantLP[j])
		}
	}
	params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	cs := client.Chat.Completions.NewStreaming(ctx, params)
	var sb strings.Builder
	var usage int64
	for cs.Next() {
		ch := cs.Current()
		if len(ch.Choices) > 0 {
			sb.WriteString(ch.Choices[0].Delta.Content)
		}
		if ch.Usage.TotalTokens > 0 {
			usage = ch.Usage.CompletionTokens
		}
	}
	if err := cs.Err(); err != nil {
		t.Fatal(err)
	}
	if sb.String() != want || usage != int64(n) {
		t.Fatalf("streaming chat: %q (usage %d), want %q (%d)", sb.String(), usage, want, n)
	}

	// n samples: choice i is what one request with the seed plus i
	// samples, and their usage is the sum.
	sampled := openai.CompletionNewParams{Model: "lumen-tiny", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("The cluster")},
		MaxTokens: openai.Int(16), Temperature: openai.Float(0.9), Seed: openai.Int(11), N: openai.Int(3)}
	multi, err := client.Completions.New(ctx, sampled)
	if err != nil {
		t.Fatalf("n=3: %v", err)
	}
	if len(multi.Choices) != 3 {
		t.Fatalf("n=3: %d choices", len(multi.Choices))
	}
	var total int64
	for i, ch := range multi.Choices {
		one := sampled
		one.N, one.Seed = openai.Int(1), openai.Int(11+int64(i))
		single, err := client.Completions.New(ctx, one)
		if err != nil {
			t.Fatalf("seed %d: %v", 11+i, err)
		}
		if ch.Index != int64(i) || ch.Text != single.Choices[0].Text || ch.FinishReason != single.Choices[0].FinishReason {
			t.Fatalf("n=3 choice %d (index %d): %q %s; seed %d alone: %q %s", i, ch.Index, ch.Text, ch.FinishReason, 11+i,
				single.Choices[0].Text, single.Choices[0].FinishReason)
		}
		total += single.Usage.CompletionTokens
	}
	if multi.Choices[0].Text == multi.Choices[1].Text && multi.Choices[1].Text == multi.Choices[2].Text {
		t.Fatalf("n=3 at temperature 0.9: three identical samples %q; each must draw with its own seed", multi.Choices[0].Text)
	}
	if multi.Usage.CompletionTokens != total {
		t.Fatalf("n=3 usage %d completion tokens, the three alone %d", multi.Usage.CompletionTokens, total)
	}

	// best_of 3: the one choice returned is, of the samples with seeds
	// 11, 12, 13 alone, the one whose tokens' logprobs sum highest.
	best, err := client.Completions.New(ctx, openai.CompletionNewParams{Model: "lumen-tiny",
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("The cluster")},
		MaxTokens: openai.Int(16), Temperature: openai.Float(0.9), Seed: openai.Int(11), BestOf: openai.Int(3)})
	if err != nil {
		t.Fatalf("best_of=3: %v", err)
	}
	wantBest, bestSum := "", math.Inf(-1)
	var drawn int64
	for i := range 3 {
		single, err := client.Completions.New(ctx, openai.CompletionNewParams{Model: "lumen-tiny",
			Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("The cluster")},
			MaxTokens: openai.Int(16), Temperature: openai.Float(0.9), Seed: openai.Int(11 + int64(i)), Logprobs: openai.Int(0)})
		if err != nil {
			t.Fatalf("seed %d: %v", 11+i, err)
		}
		sum := 0.0
		for _, lp := range single.Choices[0].Logprobs.TokenLogprobs {
			sum += lp
		}
		if sum > bestSum {
			wantBest, bestSum = single.Choices[0].Text, sum
		}
		drawn += single.Usage.CompletionTokens
	}
	if len(best.Choices) != 1 || best.Choices[0].Text != wantBest || best.Usage.CompletionTokens != drawn {
		t.Fatalf("best_of=3: %d choices, %q, usage %d; want the likeliest sample %q and the usage of all three, %d",
			len(best.Choices), best.Choices[0].Text, best.Usage.CompletionTokens, wantBest, drawn)
	}

	// echo with logprobs and max_tokens 0, as lm-evaluation-harness's
	// loglikelihood requests send it: the prompt comes back with each
	// token's logprob as the engine scores it (the first null), bit for
	// bit; with max_tokens 8 the greedy completion follows the prompt.
	scored := "The cluster keeps serving"
	sp := tk.Encode(scored)
	echoed, err := client.Completions.New(ctx, openai.CompletionNewParams{Model: "lumen-tiny", Echo: openai.Bool(true),
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(scored)},
		MaxTokens: openai.Int(0), Logprobs: openai.Int(1), Temperature: openai.Float(0)})
	if err != nil {
		t.Fatalf("echo with max_tokens 0: %v", err)
	}
	wantScores := make([]engine.Logprobs, len(sp)-1)
	if _, err := ref.Forward(ctx, []engine.Chunk{{Seq: 2, Tokens: sp, Targets: sp[1:], Scores: wantScores, TopLogprobs: 1}}); err != nil {
		t.Fatal(err)
	}
	ref.Release(2)
	ech := echoed.Choices[0]
	if ech.Text != scored || len(ech.Logprobs.TokenLogprobs) != len(sp) || echoed.Usage.CompletionTokens != 0 || ech.FinishReason != "length" {
		t.Fatalf("echo, max_tokens 0: %q, %d logprobs, %d completion tokens, %s; want the prompt, %d, 0, length",
			ech.Text, len(ech.Logprobs.TokenLogprobs), echoed.Usage.CompletionTokens, ech.FinishReason, len(sp))
	}
	if !strings.Contains(ech.Logprobs.RawJSON(), `"token_logprobs":[null,`) {
		t.Fatalf("echo: the first prompt token's logprob must be null: %s", ech.Logprobs.RawJSON())
	}
	for i, w := range wantScores {
		if got := float32(ech.Logprobs.TokenLogprobs[i+1]); got != w.Logprob {
			t.Fatalf("echo: prompt token %d's logprob %v, the engine scores %v", i+1, got, w.Logprob)
		}
	}
	withGen, err := client.Completions.New(ctx, openai.CompletionNewParams{Model: "lumen-tiny", Echo: openai.Bool(true),
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(scored)},
		MaxTokens: openai.Int(8), Temperature: openai.Float(0)})
	if err != nil {
		t.Fatalf("echo with max_tokens 8: %v", err)
	}
	if wantGen, _, _ := referenceText(t, ref, sp, 8, tokenizer.TokEOS); withGen.Choices[0].Text != scored+wantGen {
		t.Fatalf("echo with max_tokens 8: %q, want the prompt then the reference, %q", withGen.Choices[0].Text, scored+wantGen)
	}

	// Errors through the SDK: status and message.
	var apiErr *openai.Error
	_, err = client.Completions.New(ctx, openai.CompletionNewParams{Model: "lumen-tiny", Suffix: openai.String("end"),
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("x")}})
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 400 || apiErr.Param != "suffix" {
		t.Fatalf("suffix, not implemented, must be refused by name: %v", err)
	}
	_, err = client.Completions.New(ctx, openai.CompletionNewParams{Model: "gpt-4",
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("x")}})
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 404 || !strings.Contains(apiErr.Message, "gpt-4") {
		t.Fatalf("unknown model: %v", err)
	}
	_, err = client.Completions.New(ctx, openai.CompletionNewParams{Model: "lumen-tiny", Temperature: openai.Float(3),
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("x")}})
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 400 || apiErr.Param != "temperature" {
		t.Fatalf("bad temperature: %v", err)
	}
	_, err = client.Completions.New(ctx, openai.CompletionNewParams{Model: "lumen-tiny", Logprobs: openai.Int(21),
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("x")}})
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 400 || apiErr.Param != "logprobs" || !strings.Contains(apiErr.Message, "between 0 and 20") {
		t.Fatalf("logprobs 21: %v", err)
	}
	_, err = client.Embeddings.New(ctx, openai.EmbeddingNewParams{Model: "lumen-tiny", Input: openai.EmbeddingNewParamsInputUnion{OfString: openai.String("x")}})
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 404 || apiErr.Code != "unknown_url" {
		t.Fatalf("an unknown path: %v", err)
	}
	bad := openai.NewClient(option.WithBaseURL("http://"+gw.Addr+"/v1"), option.WithAPIKey("sk-wrong"), option.WithMaxRetries(0))
	_, err = bad.Models.List(ctx)
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 401 {
		t.Fatalf("wrong key: %v", err)
	}
	models, err := client.Models.List(ctx)
	if err != nil || len(models.Data) != 1 || models.Data[0].ID != "lumen-tiny" {
		t.Fatalf("models: %v %v", models, err)
	}
}

func toInt64(ids []int32) []int64 {
	out := make([]int64, len(ids))
	for i, id := range ids {
		out[i] = int64(id)
	}
	return out
}
