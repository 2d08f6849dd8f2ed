package sim

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/workload"
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

// TestStudyOnATrace runs a small study on trace arrivals.
func TestStudyOnATrace(t *testing.T) {
	trace, err := workload.ReadAzureTrace(strings.NewReader(azureCSV(2, 400)), 2)
	if err != nil {
		t.Fatal(err)
	}
	st := Study{Setup: Setup{Name: "t", Workers: 4, Profile: "qwen3-14b-h100", Failures: 1, MaxRunning: 32, Budget: 80e9},
		Timeline: Timeline{Warmup: 2 * time.Second, FailAt: 4 * time.Second, Duration: 12 * time.Second, Calibration: 6 * time.Second, ReloadScale: 0.1},
		Seed:     2, Load: 0.7, Timing: DefaultTiming(), Trace: trace}
	figs, err := st.Run()
	if err != nil {
		t.Fatal(err)
	}
	if f := figs["lumen"]; f.Requests == 0 || f.FailedRequests != 0 || f.Interrupted == 0 {
		t.Fatalf("%+v", f)
	}
}
