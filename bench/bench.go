// Package bench holds lumen's benchmarks over real processes, the bodies of
// `lumen bench controller|gateway|pacing|recovery`: each starts a local
// cluster (internal/devcluster), drives it, prints a table and writes its
// figures as JSON. The tables and JSON keys are read by scripts and by
// docs/benchmarks.md: change them only together.
//
// What can be checked without a cluster (percentiles, summaries, tables,
// keys, request bodies) is split into plain functions
// with unit tests; the runs themselves are what `make bench` measures.
package bench

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/lumen-project/lumen/internal/plot"
)

func grpcInsecure() grpc.DialOption { return grpc.WithTransportCredentials(insecure.NewCredentials()) }

// percentileMs sorts d and returns its p-quantile (nearest rank below) in
// milliseconds, or 0 for no samples.
func percentileMs(d []time.Duration, p float64) float64 {
	if len(d) == 0 {
		return 0
	}
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	return float64(d[int(float64(len(d)-1)*p)].Microseconds()) / 1000
}

// writeJSON writes v, indented, with a final newline, and its plot next to
// it (internal/plot: the same name with .svg). A plot that cannot be drawn
// is said, not fatal: the figures are what a long run must keep.
func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return err
	}
	if _, err := plot.WriteNextTo(path); err != nil {
		fmt.Fprintf(os.Stderr, "plot: %v\n", err)
	}
	return nil
}
