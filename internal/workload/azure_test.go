package workload

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

// azureCSV writes n rows of a trace in the Azure 2023 format, one every
// 100 ms.
func azureCSV(seed uint64, n int) string {
	rng := rand.New(rand.NewPCG(seed, 0))
	var b strings.Builder
	b.WriteString("TIMESTAMP,ContextTokens,GeneratedTokens\n")
	t0 := time.Date(2023, 11, 16, 18, 15, 46, 680590000, time.UTC)
	for i := range n {
		at := t0.Add(time.Duration(i) * 100 * time.Millisecond)
		fmt.Fprintf(&b, "%s,%d,%d\n", at.Format("2006-01-02 15:04:05.0000000"), 50+rng.IntN(2000), 1+rng.IntN(300))
	}
	return b.String()
}

// TestReadAzureTrace: the trace's arrivals offset from the first, lazy
// prompts of its lengths, the same for a seed; a rescale to twice the
// native rate halves the times; bad files are refused with ErrTrace.
func TestReadAzureTrace(t *testing.T) {
	reqs, err := ReadAzureTrace(strings.NewReader(azureCSV(1, 50)), 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 50 || reqs[0].At != 0 || reqs[49].At != 4900*time.Millisecond {
		t.Fatalf("%d requests, first at %s, last at %s", len(reqs), reqs[0].At, reqs[len(reqs)-1].At)
	}
	again, _ := ReadAzureTrace(strings.NewReader(azureCSV(1, 50)), 1)
	m := reqs[7].Materialize()
	if len(m.Prompt) != reqs[7].PromptLen() || fmt.Sprint(again[7].Materialize().Prompt) != fmt.Sprint(m.Prompt) {
		t.Fatalf("request 7: %d ids for %d tokens, or another seed's", len(m.Prompt), reqs[7].PromptLen())
	}
	half := Rescale(reqs, 20, time.Hour)
	if len(half) != 50 || half[49].At != 2450*time.Millisecond {
		t.Fatalf("rescaled: %d requests, last at %s", len(half), half[len(half)-1].At)
	}
	if cut := Rescale(reqs, 10, 2*time.Second); len(cut) != 20 {
		t.Fatalf("the first 2 s at the native rate: %d requests, want 20", len(cut))
	}
	for _, bad := range []string{"", "a,b\n1,2\n", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n",
		"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,0,5\n"} {
		if _, err := ReadAzureTrace(strings.NewReader(bad), 1); !errors.Is(err, ErrTrace) {
			t.Errorf("%q: %v", bad, err)
		}
	}
}
