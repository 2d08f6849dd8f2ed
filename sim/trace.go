package sim

import (
	"io"
	"time"

	"github.com/lumen-project/lumen/internal/workload"
)

// ErrTrace: a trace file cannot be read (workload.ErrTrace).
var ErrTrace = workload.ErrTrace

// ReadAzureTrace reads a CSV trace in the Azure LLM inference 2023 format
// (workload.ReadAzureTrace): `lumen bench recovery -trace` reads the same.
func ReadAzureTrace(r io.Reader, seed uint64) ([]workload.Request, error) {
	return workload.ReadAzureTrace(r, seed)
}

// Rescale compresses or stretches a trace's arrival times to a mean rate
// (workload.Rescale).
func Rescale(trace []workload.Request, rate float64, d time.Duration) []workload.Request {
	return workload.Rescale(trace, rate, d)
}
