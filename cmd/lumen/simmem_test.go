package main

import (
	"runtime"
	"testing"
)

// lumen sim's soft memory limit: half the machine's memory, unless
// GOMEMLIMIT sets one.
func TestSimMemoryLimit(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("reads /proc/meminfo")
	}
	t.Setenv("GOMEMLIMIT", "")
	limit, ok := simMemoryLimit()
	if !ok || limit < 1<<28 {
		t.Fatalf("no limit from /proc/meminfo: %d %v", limit, ok)
	}
	t.Setenv("GOMEMLIMIT", "4GiB")
	if _, ok := simMemoryLimit(); ok {
		t.Fatal("GOMEMLIMIT is set: lumen sim must leave it")
	}
}
