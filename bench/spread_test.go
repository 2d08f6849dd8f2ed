package bench

import (
	"math"
	"testing"
)

// spreadStats is the simulator's running_cv: the mean over samples of the
// population standard deviation over the mean, and of max − min; samples
// with nothing running do not count.
func TestSpreadStats(t *testing.T) {
	cv, maxMin, mean, n := spreadStats([][]float64{{2, 2, 2, 2}, {1, 3, 1, 3}, {0, 0, 0, 0}, {}})
	if n != 2 || math.Abs(cv-0.25) > 1e-12 || maxMin != 1 || mean != 2 {
		t.Fatalf("cv %v, max-min %v, mean %v over %d samples; want 0.25, 1, 2 over 2", cv, maxMin, mean, n)
	}
	if cv, _, _, n := spreadStats(nil); cv != 0 || n != 0 {
		t.Fatalf("no samples: cv %v over %d", cv, n)
	}
}
