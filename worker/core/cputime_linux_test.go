//go:build linux

package core

import (
	"syscall"
	"time"
	"unsafe"
)

// threadCPU is the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID). A
// benchmark that locks its goroutine to its thread measures its own
// computation with it, whatever else shares the cores.
func threadCPU() (time.Duration, bool) {
	const clockThreadCPUTime = 3
	var ts syscall.Timespec
	if _, _, e := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTime, uintptr(unsafe.Pointer(&ts)), 0); e != 0 {
		return 0, false
	}
	return time.Duration(ts.Nano()), true
}
