// Package progress shows how far a long command is and an estimate of the
// time left: a bar redrawn in place on a terminal, plain lines at most
// every Every (10 s) when the output is a file or a pipe (CI logs, `make
// bench > log`), so that a log is not flooded and still says where a run
// was.
//
// The estimate is linear: the time so far, scaled by the work left over
// the work done. Work is whatever unit the caller counts (runs, seconds of
// a benchmark's timeline, requests); weight unequal steps by their expected
// duration for a better estimate.
package progress

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/mattn/go-isatty"
)

// Every is how often a plain (non-terminal) progress line is written at
// most; the first and the last (Finish) are always written.
const Every = 10 * time.Second

// Meter is one long job's progress. Its methods are safe for concurrent
// use; a nil *Meter does nothing.
type Meter struct {
	mu       sync.Mutex
	w        io.Writer
	tty      bool
	name     string
	unit     string
	total    float64
	done     float64
	note     string
	start    time.Time
	lastLine time.Time
	drawn    bool
	finished bool
	stop     chan struct{}
	now      func() time.Time
}

// New returns a meter on standard error, redrawn in place when standard
// error is a terminal and written as plain lines otherwise. total is the
// work to do, in unit ("runs", "s"); name heads every line.
func New(name, unit string, total float64) *Meter {
	return NewTo(os.Stderr, IsTerminal(os.Stderr), name, unit, total)
}

// IsTerminal reports whether f is a terminal (Cygwin's included).
func IsTerminal(f *os.File) bool {
	return isatty.IsTerminal(f.Fd()) || isatty.IsCygwinTerminal(f.Fd())
}

// NewTo returns a meter on w; tty chooses the in-place bar.
func NewTo(w io.Writer, tty bool, name, unit string, total float64) *Meter {
	return newMeter(w, tty, name, unit, total, time.Now, true)
}

// newMeter is NewTo with a clock; tick starts the redraw: every second on
// a terminal (the elapsed time and the estimate move while a long step
// runs), and a plain line when Every has passed without one (a long wait
// still shows in a log).
func newMeter(w io.Writer, tty bool, name, unit string, total float64, now func() time.Time, tick bool) *Meter {
	m := &Meter{w: w, tty: tty, name: name, unit: unit, total: total, now: now, stop: make(chan struct{})}
	m.start = m.now()
	if tick {
		go func() {
			t := time.NewTicker(time.Second)
			defer t.Stop()
			for {
				select {
				case <-m.stop:
					return
				case <-t.C:
					m.mu.Lock()
					if !m.finished && (m.tty || !m.lastLine.IsZero()) {
						m.emit(false)
					}
					m.mu.Unlock()
				}
			}
		}()
	}
	return m
}

// Set records the work done so far and what is being done now.
func (m *Meter) Set(done float64, note string) {
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.finished {
		return
	}
	m.done, m.note = min(max(done, 0), m.total), note
	m.emit(false)
}

// Add adds n to the work done.
func (m *Meter) Add(n float64, note string) {
	if m == nil {
		return
	}
	m.mu.Lock()
	done := m.done + n
	m.mu.Unlock()
	m.Set(done, note)
}

// Done is the work done so far.
func (m *Meter) Done() float64 {
	if m == nil {
		return 0
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.done
}

// Finish writes the last line (the whole job's time; "done" when all the
// work was, "stopped" otherwise) and stops redrawing.
func (m *Meter) Finish(note string) {
	if m == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.finished {
		return
	}
	m.note = note
	m.emit(true)
	m.finished = true
	close(m.stop)
}

// emit writes a plain line when one is due, or redraws the bar.
func (m *Meter) emit(last bool) {
	if m.tty {
		m.draw()
		if last {
			fmt.Fprintln(m.w)
		}
		return
	}
	now := m.now()
	if last || m.lastLine.IsZero() || now.Sub(m.lastLine) >= Every {
		m.lastLine = now
		fmt.Fprintln(m.w, m.line(now, last))
	}
}

// draw redraws the bar in place: "\r", the line, erase to its end.
func (m *Meter) draw() {
	const width = 24
	frac := 0.0
	if m.total > 0 {
		frac = m.done / m.total
	}
	n := int(frac * width)
	bar := strings.Repeat("=", n) + strings.Repeat(" ", width-n)
	if n < width && n > 0 {
		bar = bar[:n-1] + ">" + bar[n:]
	}
	fmt.Fprintf(m.w, "\r%s [%s] %s\x1b[K", m.name, bar, m.status(m.now(), false))
	m.drawn = true
}

// Line is the plain line for the state now: what is written when the
// output is not a terminal.
func (m *Meter) line(now time.Time, last bool) string {
	return m.name + ": " + m.status(now, last)
}

// status is "3/10 runs (30%), 1m0s elapsed, about 2m20s left: note".
func (m *Meter) status(now time.Time, last bool) string {
	elapsed := now.Sub(m.start)
	pct := 0.0
	if m.total > 0 {
		pct = 100 * m.done / m.total
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s/%s %s (%.0f%%), %s elapsed", num(m.done), num(m.total), m.unit, pct, round(elapsed))
	switch {
	case last && m.done >= m.total:
		b.WriteString(", done")
	case last:
		b.WriteString(", stopped") // an error, or Ctrl-C
	case m.done > 0 && m.done < m.total:
		left := time.Duration(float64(elapsed) * (m.total - m.done) / m.done)
		fmt.Fprintf(&b, ", about %s left", round(left))
	case m.done == 0:
		b.WriteString(", estimating")
	}
	if m.note != "" {
		b.WriteString(": " + m.note)
	}
	return b.String()
}

// num prints whole numbers without decimals and others with one.
func num(v float64) string {
	if v == float64(int64(v)) {
		return fmt.Sprint(int64(v))
	}
	return fmt.Sprintf("%.1f", v)
}

// round keeps a duration readable: seconds under an hour, minutes above.
func round(d time.Duration) time.Duration {
	if d >= time.Hour {
		return d.Round(time.Minute)
	}
	return d.Round(time.Second)
}
