//go:build !linux

package core

import "time"

// threadCPU is not available here: the benchmarks report wall time alone.
func threadCPU() (time.Duration, bool) { return 0, false }
