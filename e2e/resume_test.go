package e2e

import (
	"context"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/lumen-project/lumen/internal/ctlclient"
	"github.com/lumen-project/lumen/internal/devcluster"
	"github.com/lumen-project/lumen/internal/kvpage"
	pb "github.com/lumen-project/lumen/proto/lumenpb"
	"github.com/lumen-project/lumen/tokenizer"
	"github.com/lumen-project/lumen/worker/engine"
)

// TestStreamsSurviveWorkerKill streams requests through the gateway, kills
// the worker serving them with SIGKILL mid-stream, and requires every client
// to receive its full output, equal to the reference, without an error. The
// resume here is the gateway's: it waits for the controller to move the
// placement (Serf notices the death, the leader commits MarkFailed, Apply
// plans recovery) and continues there with the token history. Half the
// streams ask for logprobs: every token's equals the failure-free run's,
// bit for bit (float32), across the resume.
func TestStreamsSurviveWorkerKill(t *testing.T) {
	modelDir := t.TempDir()
	if _, _, err := engine.InitModel(modelDir, engine.DefaultSeed); err != nil {
		t.Fatal(err)
	}
	cl := startQuorum(t)
	// Paced by the 14B profile at half speed (time-scale 2), so streams are
	// still running when the worker dies.
	var ws []*devcluster.Worker
	for _, id := range []string{"w1", "w2", "w3"} {
		w, err := cl.AddWorker(id, "-model-dir", modelDir, "-kv-pages", "1024", "-profile", "qwen3-14b-h100", "-time-scale", "2", "-emulate-load=false")
		if err != nil {
			t.Fatal(err)
		}
		ws = append(ws, w)
	}
	gw, err := cl.StartGateway("")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	if err := gw.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	ref, err := engine.NewTransformer(engine.TransformerConfig{Path: filepath.Join(modelDir, engine.TargetFile), Pages: 256})
	if err != nil {
		t.Fatal(err)
	}
	client := openai.NewClient(option.WithBaseURL("http://"+gw.Addr+"/v1"), option.WithMaxRetries(0))
	var tk tokenizer.Tokenizer
	const streams, maxTokens = 12, 60
	prompts := make([]string, streams)
	wants := make([]string, streams)
	wantLPs := make([][]engine.Logprobs, streams)
	for i := range prompts {
		prompts[i] = fmt.Sprintf("stream %d keeps going", i)
		var n int
		wants[i], _, n = referenceText(t, ref, tk.Encode(prompts[i]), maxTokens, tokenizer.TokEOS)
		if i%2 == 0 {
			wantLPs[i] = referenceLogprobs(t, ref, tk.Encode(prompts[i]), n, 2)
		}
	}
	var wg sync.WaitGroup
	got := make([]string, streams)
	gotLPs := make([][]float64, streams)
	errs := make([]error, streams)
	started := make(chan struct{}, streams)
	for i := range prompts {
		wg.Go(func() {
			params := openai.CompletionNewParams{Model: "lumen-tiny",
				Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(prompts[i])},
				MaxTokens: openai.Int(maxTokens), Temperature: openai.Float(0)}
			if wantLPs[i] != nil {
				params.Logprobs = openai.Int(2)
			}
			s := client.Completions.NewStreaming(ctx, params)
			// A stream signals once its text passes 32 bytes: the prompt
			// and those tokens fill full pages, which the checkpoint holders
			// have by the kill. (Signalled at the first token, a loaded
			// machine could kill a worker whose requests had no full page
			// yet, and nothing would be there to reuse.)
			var sb strings.Builder
			signalled := false
			for s.Next() {
				if ch := s.Current(); len(ch.Choices) > 0 {
					sb.WriteString(ch.Choices[0].Text)
					gotLPs[i] = append(gotLPs[i], ch.Choices[0].Logprobs.TokenLogprobs...)
					if !signalled && sb.Len() > 32 {
						signalled = true
						started <- struct{}{}
					}
				}
			}
			if !signalled {
				started <- struct{}{}
			}
			got[i], errs[i] = sb.String(), s.Err()
		})
	}
	for i := 0; i < streams; i++ {
		<-started
	}
	// Kill the worker serving the most streams.
	busiest, most := ws[0], -1
	for _, w := range ws {
		if n := countInFlight(t, w); n > most {
			busiest, most = w, n
		}
	}
	t.Logf("kill -9 %s with %d requests in flight", busiest.ID, most)
	if most == 0 {
		t.Fatal("no worker has requests in flight: the streams finished before the kill")
	}
	cl.KillWorker(busiest)
	wg.Wait()
	for i := range prompts {
		if errs[i] != nil {
			t.Errorf("stream %d ended with an error: %v", i, errs[i])
		} else if got[i] != wants[i] {
			t.Errorf("stream %d:\n got  %q\n want %q", i, got[i], wants[i])
		} else if want := wantLPs[i]; want != nil {
			same := len(gotLPs[i]) == len(want)
			for j := 0; same && j < len(want); j++ {
				same = float32(gotLPs[i][j]) == want[j].Logprob
			}
			if !same {
				t.Errorf("stream %d: logprobs across the kill %v, reference %v", i, gotLPs[i], want)
			}
		}
	}
	// The interrupted requests resumed at their holders from checkpointed
	// pages, not only by recomputing.
	restored, recomputed := 0.0, 0.0
	for _, w := range ws {
		if w != busiest {
			restored += metricValue(t, "http://"+w.HTTPAddr+"/metrics", "lumen_worker_restored_pages_total")
			recomputed += metricValue(t, "http://"+w.HTTPAddr+"/metrics", "lumen_worker_resume_recomputed_tokens_total")
		}
	}
	t.Logf("resumed from %v checkpointed pages; %v tokens recomputed", restored, recomputed)
	if restored == 0 {
		t.Fatal("no resumed request reused a checkpointed page")
	}
}

// countInFlight reads a worker's running + waiting gauges.
func countInFlight(t *testing.T, w *devcluster.Worker) int {
	t.Helper()
	n := 0
	for _, name := range []string{"lumen_worker_num_requests_running", "lumen_worker_num_requests_waiting"} {
		n += int(metricValue(t, "http://"+w.HTTPAddr+"/metrics", name))
	}
	return n
}

// streamed is one streamed completion as the client read it: each
// choice's text and token logprobs, by index.
type streamed struct {
	text map[int]string
	lps  map[int][]float64
	err  error
}

// streamCompletion streams params to its end; signal, when set, is called
// once every one of want choices has more than 8 tokens of logprobs
// (started: the tokens are the client's).
func streamCompletion(ctx context.Context, client openai.Client, params openai.CompletionNewParams, want int, signal func()) streamed {
	got := streamed{text: map[int]string{}, lps: map[int][]float64{}}
	s := client.Completions.NewStreaming(ctx, params)
	signalled := signal == nil
	for s.Next() {
		for _, ch := range s.Current().Choices {
			got.text[int(ch.Index)] += ch.Text
			got.lps[int(ch.Index)] = append(got.lps[int(ch.Index)], ch.Logprobs.TokenLogprobs...)
		}
		if !signalled {
			n := 0
			for _, l := range got.lps {
				if len(l) > 8 {
					n++
				}
			}
			if n == want {
				signalled = true
				signal()
			}
		}
	}
	if !signalled {
		signal()
	}
	got.err = s.Err()
	return got
}

// TestSamplesSurviveWorkerKill runs the OpenAI features evaluation
// harnesses use through a real resume: an n=2 streamed request (sampled,
// with logprobs), best_of 3, and echo with the prompt's logprobs, all on
// the one worker there is while they start; a second worker joins and the
// first is SIGKILLed mid-stream, and every sample resumes on the second.
// Each output and every logprob (prompt and completion) equals the
// failure-free reference's, bit for bit: n=1 requests with each sample's
// seed, the three best_of draws ranked, the same echo request, all run
// after on the survivor. Once with the defaults, once with the workers'
// prefix caches and the gateway's prefix routing on; then an n=4 request
// prefills its prompt once: its other three samples find the prompt's
// full pages in the cache (the worker's prefix-cache counters), and each
// sample equals the n=1 reference with its seed.
func TestSamplesSurviveWorkerKill(t *testing.T) {
	modelDir := t.TempDir()
	if _, _, err := engine.InitModel(modelDir, engine.DefaultSeed); err != nil {
		t.Fatal(err)
	}
	for _, routing := range []bool{false, true} {
		name := "defaults"
		if routing {
			name = "prefix-routing"
		}
		t.Run(name, func(t *testing.T) { samplesThroughAKill(t, modelDir, routing) })
	}
}

func samplesThroughAKill(t *testing.T, modelDir string, routing bool) {
	cl := startQuorum(t)
	// Paced by the 14B profile at a quarter speed, so the requests are
	// still running when the second worker is up and the first dies.
	wargs := []string{"-model-dir", modelDir, "-kv-pages", "1024", "-profile", "qwen3-14b-h100", "-time-scale", "4", "-emulate-load=false"}
	var gargs []string
	if routing {
		wargs = append(wargs, "-prefix-cache", "on")
		gargs = []string{"-prefix-routing", "on"}
	}
	w1, err := cl.AddWorker("w1", wargs...)
	if err != nil {
		t.Fatal(err)
	}
	gw, err := cl.StartGateway("", gargs...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	if err := gw.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	client := openai.NewClient(option.WithBaseURL("http://"+gw.Addr+"/v1"), option.WithMaxRetries(0))
	const maxTokens = 64
	prompt := func(what string) openai.CompletionNewParamsPromptUnion {
		return openai.CompletionNewParamsPromptUnion{OfString: openai.String("A shared context the samples of one request read first, then " + what)}
	}
	samples := openai.CompletionNewParams{Model: "lumen-tiny", Prompt: prompt("two samples"), MaxTokens: openai.Int(maxTokens),
		Temperature: openai.Float(0.9), Seed: openai.Int(21), N: openai.Int(2), Logprobs: openai.Int(1)}
	bestOf := openai.CompletionNewParams{Model: "lumen-tiny", Prompt: prompt("the best of three"), MaxTokens: openai.Int(maxTokens),
		Temperature: openai.Float(0.9), Seed: openai.Int(31), BestOf: openai.Int(3)}
	echo := openai.CompletionNewParams{Model: "lumen-tiny", Prompt: prompt("an echo scored"), MaxTokens: openai.Int(maxTokens),
		Temperature: openai.Float(0), Echo: openai.Bool(true), Logprobs: openai.Int(1)}

	var wg sync.WaitGroup
	started := make(chan struct{}, 2)
	signal := func() { started <- struct{}{} }
	var gotSamples, gotEcho streamed
	var gotBest *openai.Completion
	var bestErr error
	wg.Go(func() { gotSamples = streamCompletion(ctx, client, samples, 2, signal) })
	wg.Go(func() { gotEcho = streamCompletion(ctx, client, echo, 1, signal) })
	wg.Go(func() { gotBest, bestErr = client.Completions.New(ctx, bestOf) })
	<-started
	<-started
	// Every request runs on w1: two samples, three draws, the echo.
	deadline := time.Now().Add(30 * time.Second)
	for countInFlight(t, w1) < 6 {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests in flight on w1, want the 6 samples", countInFlight(t, w1))
		}
		time.Sleep(10 * time.Millisecond)
	}
	w2, err := cl.AddWorker("w2", wargs...)
	if err != nil {
		t.Fatal(err)
	}
	ctl, err := ctlclient.New(cl.GRPCAddrs(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	waitPhase(t, ctl, "w2", pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, 0)
	if n := countInFlight(t, w1); n != 6 {
		t.Fatalf("%d requests in flight on w1 at the kill, want all 6: the requests are too short for this machine", n)
	}
	cl.KillWorker(w1)
	wg.Wait()
	if gotSamples.err != nil || gotEcho.err != nil || bestErr != nil {
		t.Fatalf("through the kill: n=2 %v, echo %v, best_of %v", gotSamples.err, gotEcho.err, bestErr)
	}
	if resumed := metricValue(t, "http://"+gw.Addr+"/metrics", "lumen_gateway_resumes_total"); resumed < 6 {
		t.Fatalf("%v resumes, want one per sample at least (6)", resumed)
	}

	// The failure-free references, on w2, side by side: n=1 with each
	// sample's seed, the three best_of draws with their logprobs, the
	// same echo request.
	var refs [2]streamed
	var draws [3]*openai.Completion
	var drawErrs [3]error
	var refEcho streamed
	for i := range refs {
		one := samples
		one.N, one.Seed = openai.Int(1), openai.Int(21+int64(i))
		wg.Go(func() { refs[i] = streamCompletion(ctx, client, one, 1, nil) })
	}
	for i := range draws {
		one := bestOf
		one.BestOf, one.Seed, one.Logprobs = openai.Int(1), openai.Int(31+int64(i)), openai.Int(0)
		wg.Go(func() { draws[i], drawErrs[i] = client.Completions.New(ctx, one) })
	}
	wg.Go(func() { refEcho = streamCompletion(ctx, client, echo, 1, nil) })
	wg.Wait()
	for i, ref := range refs {
		if ref.err != nil {
			t.Fatal(ref.err)
		}
		if gotSamples.text[i] != ref.text[0] || !slices.Equal(gotSamples.lps[i], ref.lps[0]) {
			t.Errorf("n=2 sample %d through the kill:\n got  %q %v\n want %q %v (seed %d alone)", i, gotSamples.text[i], gotSamples.lps[i],
				ref.text[0], ref.lps[0], 21+i)
		}
	}
	wantBest, bestSum, drawn := "", math.Inf(-1), int64(0)
	for i, c := range draws {
		if drawErrs[i] != nil {
			t.Fatal(drawErrs[i])
		}
		sum := 0.0
		for _, lp := range c.Choices[0].Logprobs.TokenLogprobs {
			sum += lp
		}
		if sum > bestSum {
			wantBest, bestSum = c.Choices[0].Text, sum
		}
		drawn += c.Usage.CompletionTokens
	}
	if gotBest.Choices[0].Text != wantBest || gotBest.Usage.CompletionTokens != drawn {
		t.Errorf("best_of 3 through the kill: %q (usage %d), want the likeliest draw %q (usage %d)", gotBest.Choices[0].Text,
			gotBest.Usage.CompletionTokens, wantBest, drawn)
	}
	if refEcho.err != nil {
		t.Fatal(refEcho.err)
	}
	if gotEcho.text[0] != refEcho.text[0] || !slices.Equal(gotEcho.lps[0], refEcho.lps[0]) {
		t.Errorf("echo with logprobs through the kill:\n got  %q %v\n want %q %v", gotEcho.text[0], gotEcho.lps[0], refEcho.text[0], refEcho.lps[0])
	}
	if !routing {
		return
	}

	// n=4 on a prompt no worker holds, with two workers the gateway can
	// choose from (placed on their own, the samples would spread and
	// those away from sample 0 miss): sample 0 prefills it, the other
	// three find its full pages cached.
	w3, err := cl.AddWorker("w3", wargs...)
	if err != nil {
		t.Fatal(err)
	}
	waitPhase(t, ctl, "w3", pb.WorkerPhase_WORKER_PHASE_FULL_SERVICE, 0)
	st, err := ctl.ClusterStatus(ctx)
	if err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(30 * time.Second)
	for metricValue(t, "http://"+gw.Addr+"/metrics", "lumen_gateway_replica_applied_index") < float64(st.AppliedIndex) {
		if time.Now().After(deadline) {
			t.Fatalf("the gateway's load table is not at index %d, where w3 serves", st.AppliedIndex)
		}
		time.Sleep(10 * time.Millisecond)
	}
	var tk tokenizer.Tokenizer
	text := "A prompt nobody sent before, long enough for several full pages of sixteen tokens each: four samples share it."
	l := len(tk.Encode(text))
	counters := func() (q, h float64) {
		for _, w := range []*devcluster.Worker{w2, w3} {
			m := "http://" + w.HTTPAddr + "/metrics"
			q += metricValue(t, m, "lumen_worker_prefix_cache_queries_total")
			h += metricValue(t, m, "lumen_worker_prefix_cache_hits_total")
		}
		return q, h
	}
	q0, h0 := counters()
	four := openai.CompletionNewParams{Model: "lumen-tiny", Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String(text)},
		MaxTokens: openai.Int(8), Temperature: openai.Float(0.9), Seed: openai.Int(41), N: openai.Int(4)}
	c4, err := client.Completions.New(ctx, four)
	if err != nil {
		t.Fatal(err)
	}
	q, h := counters()
	q, h = q-q0, h-h0
	full := kvpage.Tokens * ((l - 1) / kvpage.Tokens)
	t.Logf("n=4 on a %d-token prompt: %v tokens looked up, %v found cached (%d prefilled)", l, q, h, int(q-h))
	if int(q) != 4*l || int(h) != 3*full {
		t.Fatalf("n=4 on a %d-token prompt: %v tokens looked up and %v cached; want %d and %d (samples 1-3 each find the %d tokens of its full pages)",
			l, q, h, 4*l, 3*full, full)
	}
	singles := make([]*openai.Completion, len(c4.Choices))
	singleErrs := make([]error, len(c4.Choices))
	for i := range c4.Choices {
		one := four
		one.N, one.Seed = openai.Int(1), openai.Int(41+int64(i))
		wg.Go(func() { singles[i], singleErrs[i] = client.Completions.New(ctx, one) })
	}
	wg.Wait()
	for i, ch := range c4.Choices {
		if singleErrs[i] != nil {
			t.Fatal(singleErrs[i])
		}
		if ch.Text != singles[i].Choices[0].Text {
			t.Errorf("n=4 sample %d: %q, seed %d alone %q", i, ch.Text, 41+i, singles[i].Choices[0].Text)
		}
	}
}
