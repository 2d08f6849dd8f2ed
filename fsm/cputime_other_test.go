//go:build !linux

package fsm

import "time"

// threadCPU is not available here: the benchmark's CPU columns read 0.
func threadCPU() time.Duration { return 0 }
