package progress

import (
	"strings"
	"testing"
	"time"
)

// clock is a fake time source the test moves by hand.
type clock struct{ t time.Time }

func (c *clock) now() time.Time          { return c.t }
func (c *clock) advance(d time.Duration) { c.t = c.t.Add(d) }
func plainMeter(b *strings.Builder, c *clock) *Meter {
	return newMeter(b, false, "bench recovery", "runs", 10, c.now, false)
}

// TestPlainLines: off a terminal, a line at the first update, then at most
// one per Every, and the last; each with the
// fraction, the elapsed time, the estimate of the time left and the note.
func TestPlainLines(t *testing.T) {
	var b strings.Builder
	c := &clock{t: time.Unix(1000, 0)}
	m := plainMeter(&b, c)
	m.Set(0, "calibration")
	c.advance(30 * time.Second)
	m.Set(1, "w4 / stop-and-restart")
	c.advance(5 * time.Second) // within Every of the last line: nothing
	m.Add(1, "w4 / fixed-checkpoint")
	c.advance(25 * time.Second)
	m.Add(1, "w4 / lumen")
	c.advance(20 * time.Second)
	m.Set(10, "")
	m.Finish("wrote recovery.json")
	want := []string{
		"bench recovery: 0/10 runs (0%), 0s elapsed, estimating: calibration",
		"bench recovery: 1/10 runs (10%), 30s elapsed, about 4m30s left: w4 / stop-and-restart",
		"bench recovery: 3/10 runs (30%), 1m0s elapsed, about 2m20s left: w4 / lumen",
		"bench recovery: 10/10 runs (100%), 1m20s elapsed", // 20 s after the last line
		"bench recovery: 10/10 runs (100%), 1m20s elapsed, done: wrote recovery.json",
	}
	got := strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("lines:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if strings.ContainsAny(b.String(), "\r\x1b") {
		t.Fatal("control characters in plain output")
	}
	var stopped strings.Builder
	s := plainMeter(&stopped, c)
	s.Set(2, "w4 / lumen")
	s.Finish("interrupted")
	if got := strings.Split(strings.TrimSpace(stopped.String()), "\n"); got[len(got)-1] != "bench recovery: 2/10 runs (20%), 0s elapsed, stopped: interrupted" {
		t.Fatalf("a meter finished early: %q", got)
	}
	m.Set(3, "after finish") // ignored
	if strings.Count(b.String(), "\n") != len(want) {
		t.Fatal("a line after Finish")
	}
}

// TestTerminal: on a terminal the bar is redrawn in place and ends with a
// newline.
func TestTerminal(t *testing.T) {
	var b strings.Builder
	m := newMeter(&b, true, "jepsen -matrix", "runs", 4, time.Now, false)
	m.Set(2, "partition")
	m.Finish("")
	out := b.String()
	if !strings.HasPrefix(out, "\rjepsen -matrix [===========>            ] 2/4 runs (50%)") || !strings.HasSuffix(out, "\n") {
		t.Fatalf("terminal output %q", out)
	}
	var nilMeter *Meter
	nilMeter.Set(1, "")
	nilMeter.Finish("")
}
