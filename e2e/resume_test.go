package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/lumen-project/lumen/internal/devcluster"
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
