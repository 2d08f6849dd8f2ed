package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"regexp"
	"strconv"
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

// TestCellsSurviveAQuorumLoss: a gateway over two cells (issue 26), each a
// quorum of 3 controllers and 2 workers. Streams run in both cells; then
// cell-a's whole quorum is killed with SIGKILL, and one of its workers
// with it. While cell-a has no quorum, cell-b serves every new request;
// cell-a's streams on its surviving worker go on, and those of the killed
// worker wait. When cell-a's controllers come back (same data and
// addresses), its quorum recovers them onto the other cell-a worker: every
// stream ends with the failure-free reference's text and no error, and
// new requests reach cell-a again.
func TestCellsSurviveAQuorumLoss(t *testing.T) {
	modelDir := t.TempDir()
	if _, _, err := engine.InitModel(modelDir, engine.DefaultSeed); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
	defer cancel()
	cells := map[string]*devcluster.Cluster{"cell-a": startQuorum(t), "cell-b": startQuorum(t)}
	workers := map[string][]*devcluster.Worker{}
	for _, name := range []string{"cell-a", "cell-b"} {
		for j := 1; j <= 2; j++ {
			// Paced by the 14B profile at half speed, so that streams
			// are still running across the kills.
			w, err := cells[name].AddWorker(fmt.Sprintf("%s-w%d", name, j), "-model-dir", modelDir, "-kv-pages", "1024",
				"-profile", "qwen3-14b-h100", "-time-scale", "2", "-emulate-load=false")
			if err != nil {
				t.Fatal(err)
			}
			workers[name] = append(workers[name], w)
		}
	}
	gw, err := cells["cell-a"].StartCellsGateway(ctx, "", []string{cells["cell-a"].CellFlag("cell-a"), cells["cell-b"].CellFlag("cell-b")})
	if err != nil {
		t.Fatal(err)
	}
	if err := gw.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	waitCellUp := func(cell string, want float64) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for cellMetric(t, gw.Addr, "lumen_gateway_cell_up", cell) != want {
			if time.Now().After(deadline) {
				t.Fatalf("lumen_gateway_cell_up{cell=%q} never became %v", cell, want)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitCellUp("cell-a", 1)
	waitCellUp("cell-b", 1)

	ref, err := engine.NewTransformer(engine.TransformerConfig{Path: filepath.Join(modelDir, engine.TargetFile), Pages: 256})
	if err != nil {
		t.Fatal(err)
	}
	var tk tokenizer.Tokenizer
	reference := func(prompt string, max int) string {
		s, _, _ := referenceText(t, ref, tk.Encode(prompt), max, tokenizer.TokEOS)
		return s
	}
	client := openai.NewClient(option.WithBaseURL("http://"+gw.Addr+"/v1"), option.WithMaxRetries(0))
	complete := func(prompt string, max int) {
		t.Helper()
		c, err := client.Completions.New(ctx, openai.CompletionNewParams{Model: "lumen-tiny",
			Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(prompt)},
			MaxTokens: openai.Int(int64(max)), Temperature: openai.Float(0)})
		if err != nil {
			t.Fatalf("%q: %v", prompt, err)
		}
		if want := reference(prompt, max); c.Choices[0].Text != want {
			t.Fatalf("%q:\n got  %q\n want %q", prompt, c.Choices[0].Text, want)
		}
	}

	const streams, maxTokens = 8, 80
	prompts := make([]string, streams)
	wants := make([]string, streams)
	for i := range prompts {
		prompts[i] = fmt.Sprintf("cell stream %d carries on", i)
		wants[i] = reference(prompts[i], maxTokens)
	}
	var wg sync.WaitGroup
	got := make([]string, streams)
	errs := make([]error, streams)
	started := make(chan struct{}, streams)
	for i := range prompts {
		wg.Go(func() {
			s := client.Completions.NewStreaming(ctx, openai.CompletionNewParams{Model: "lumen-tiny",
				Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(prompts[i])},
				MaxTokens: openai.Int(maxTokens), Temperature: openai.Float(0)})
			var sb strings.Builder
			first := true
			for s.Next() {
				if ch := s.Current(); len(ch.Choices) > 0 {
					sb.WriteString(ch.Choices[0].Text)
					if first && ch.Choices[0].Text != "" {
						first = false
						started <- struct{}{}
					}
				}
			}
			got[i], errs[i] = sb.String(), s.Err()
		})
	}
	for range streams {
		<-started
	}
	for _, name := range []string{"cell-a", "cell-b"} {
		if n := cellMetric(t, gw.Addr, "lumen_gateway_cell_requests_total", name); n == 0 {
			t.Fatalf("no stream went to %s: the gateway does not spread requests over its cells", name)
		}
	}
	victim := workers["cell-a"][0]
	for _, w := range workers["cell-a"] {
		if countInFlight(t, w) > countInFlight(t, victim) {
			victim = w
		}
	}
	inFlight := countInFlight(t, victim)
	if inFlight == 0 {
		t.Fatal("cell-a's workers have nothing in flight: the streams finished before the kills")
	}
	t.Logf("kill -9 cell-a's 3 controllers, then %s with %d requests in flight", victim.ID, inFlight)
	a := cells["cell-a"]
	for i := range a.Controllers {
		a.Kill(i)
	}
	a.KillWorker(victim)
	waitCellUp("cell-a", 0)

	// Without cell-a's quorum, new requests are cell-b's.
	before := cellMetric(t, gw.Addr, "lumen_gateway_cell_requests_total", "cell-a")
	for i := range 4 {
		complete(fmt.Sprintf("while cell-a is down %d", i), 8)
	}
	if after := cellMetric(t, gw.Addr, "lumen_gateway_cell_requests_total", "cell-a"); after != before {
		t.Fatalf("%v new requests went to cell-a while its quorum was down", after-before)
	}

	// cell-a's quorum returns: its interrupted streams resume there.
	for i := range a.Controllers {
		if err := a.Restart(i); err != nil {
			t.Fatal(err)
		}
	}
	waitCellUp("cell-a", 1)
	wg.Wait()
	for i := range prompts {
		if errs[i] != nil {
			t.Errorf("stream %d ended with an error: %v", i, errs[i])
		} else if got[i] != wants[i] {
			t.Errorf("stream %d:\n got  %q\n want %q", i, got[i], wants[i])
		}
	}
	// And new requests reach cell-a again (the freest worker is there:
	// cell-a has one worker left, idle once the streams ended, as are
	// cell-b's two; ties take turns).
	before = cellMetric(t, gw.Addr, "lumen_gateway_cell_requests_total", "cell-a")
	for i := 0; cellMetric(t, gw.Addr, "lumen_gateway_cell_requests_total", "cell-a") == before; i++ {
		if i == 8 {
			t.Fatal("8 requests after cell-a's return, none went to cell-a")
		}
		complete(fmt.Sprintf("cell-a is back %d", i), 8)
	}
}

// cellMetric reads the series of a gateway metric labelled cell (summed
// over its other labels).
func cellMetric(t *testing.T, addr, name, cell string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `\{([^}]*)\} (\S+)$`)
	sum := 0.0
	for _, m := range re.FindAllStringSubmatch(string(b), -1) {
		if !strings.Contains(m[1], `cell="`+cell+`"`) {
			continue
		}
		v, err := strconv.ParseFloat(m[2], 64)
		if err != nil {
			t.Fatalf("%s: %v", m[0], err)
		}
		sum += v
	}
	return sum
}
