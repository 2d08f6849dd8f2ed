package gpu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// Injected is a HealthSource that reports the faults a test injects. It
// serves one Watch.
type Injected struct {
	ch chan HealthEvent
}

// NewInjected returns a source with nothing injected yet.
func NewInjected() *Injected { return &Injected{ch: make(chan HealthEvent, 16)} }

// Inject reports a fault to the watcher.
func (i *Injected) Inject(ev HealthEvent) {
	if ev.Time.IsZero() {
		ev.Time = time.Now()
	}
	i.ch <- ev
}

// Watch implements HealthSource.
func (i *Injected) Watch(ctx context.Context, _ []string) (<-chan HealthEvent, error) {
	out := make(chan HealthEvent)
	go func() {
		defer close(out)
		for {
			select {
			case <-ctx.Done():
				return
			case ev := <-i.ch:
				select {
				case out <- ev:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return out, nil
}

// FaultFile is a HealthSource that reports a fault for each line appended
// to a file: "xid 79", "ecc-double-bit" or "ecc-single-bit", optionally
// followed by a device UUID. It is how an end-to-end test (or an
// operator's drill) injects a fault into a worker process on a machine
// without a GPU. The file need not exist yet; lines already in it when the
// watch starts are faults too.
type FaultFile struct {
	Path string
	// Poll is how often the file is read (default 100 ms).
	Poll time.Duration
}

// ErrBadFault: a line of a fault file is not a fault.
var ErrBadFault = errors.New("gpu: not a fault line")

// ParseFault reads one fault line.
func ParseFault(line string) (HealthEvent, error) {
	f := strings.Fields(line)
	if len(f) == 0 {
		return HealthEvent{}, fmt.Errorf("%w: empty", ErrBadFault)
	}
	ev := HealthEvent{Kind: f[0], Time: time.Now()}
	rest := f[1:]
	switch ev.Kind {
	case "xid":
		if len(rest) == 0 {
			return HealthEvent{}, fmt.Errorf("%w: %q: an xid line needs the XID number (xid 79)", ErrBadFault, line)
		}
		code, err := strconv.ParseUint(rest[0], 10, 64)
		if err != nil {
			return HealthEvent{}, fmt.Errorf("%w: %q: the XID %q is not a number", ErrBadFault, line, rest[0])
		}
		ev.Code, rest = code, rest[1:]
	case "ecc-double-bit", "ecc-single-bit":
	default:
		return HealthEvent{}, fmt.Errorf("%w: %q: the kind is xid, ecc-double-bit or ecc-single-bit", ErrBadFault, line)
	}
	if len(rest) > 0 {
		ev.UUID = rest[0]
	}
	return ev, nil
}

// Watch implements HealthSource. A line that is not a fault is skipped.
func (f FaultFile) Watch(ctx context.Context, _ []string) (<-chan HealthEvent, error) {
	if f.Path == "" {
		return nil, errors.New("gpu: a fault file needs a path")
	}
	poll := f.Poll
	if poll <= 0 {
		poll = 100 * time.Millisecond
	}
	out := make(chan HealthEvent)
	go func() {
		defer close(out)
		read := 0 // lines reported
		t := time.NewTicker(poll)
		defer t.Stop()
		for {
			lines := readLines(f.Path)
			for ; read < len(lines); read++ {
				ev, err := ParseFault(lines[read])
				if err != nil {
					continue
				}
				select {
				case out <- ev:
				case <-ctx.Done():
					return
				}
			}
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return out, nil
}

// readLines returns the complete lines of a file (none when it is absent):
// a line still being written, without its newline, waits for the next read.
func readLines(path string) []string {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil
	}
	lines := strings.Split(string(b), "\n")
	return lines[:len(lines)-1]
}
