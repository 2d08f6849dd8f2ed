package jepsen

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// A Go panic leaves one of these in a process's output: the runtime's
// "panic: ..." or "fatal error: ..." at the start of a line, and a stack that
// begins "goroutine N [running]:". A panic a recovery handler caught and
// logged still shows its stack (hclog writes a multi-line value as lines
// prefixed "| "), so a recovered panic fails the run too: it is a bug the
// process only survived.
var (
	panicStart     = regexp.MustCompile(`^(panic: |fatal error: )`)
	panicGoroutine = regexp.MustCompile(`goroutine \d+ \[running\]`)
)

// panicContext is how many lines of a panic a violation quotes.
const panicContext = 6

// CheckPanics scans every process log in dir (the *.log files the cluster
// writes: controllers, workers, gateways) for a Go panic and fails naming
// the process, the line, and the first lines of each panic (the first panic
// of each log; one is enough to look).
func CheckPanics(dir string) Verdict {
	v := Verdict{Checker: "no-panic", OK: true}
	logs, err := filepath.Glob(filepath.Join(dir, "*.log"))
	if err != nil {
		v.fail("listing the logs in %s: %v", dir, err)
		return v
	}
	sort.Strings(logs)
	for _, path := range logs {
		line, lines, err := firstPanic(path)
		if err != nil {
			v.fail("%s: %v", filepath.Base(path), err)
			continue
		}
		if line > 0 {
			v.fail("%s panicked (%s line %d):\n      %s", strings.TrimSuffix(filepath.Base(path), ".log"), path, line, strings.Join(lines, "\n      "))
		}
	}
	v.Note = fmt.Sprintf("%d process logs scanned", len(logs))
	return v
}

// firstPanic returns the line number (1-based; 0 when there is none) and
// the first lines of the first panic in a log.
func firstPanic(path string) (int, []string, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 4*1024*1024)
	at := 0
	var quoted []string
	for n := 1; sc.Scan(); n++ {
		text := sc.Text()
		if at == 0 {
			bare := strings.TrimLeft(text, " \t|")
			if !panicStart.MatchString(bare) && !panicGoroutine.MatchString(text) {
				continue
			}
			at = n
		}
		quoted = append(quoted, text)
		if len(quoted) == panicContext {
			break
		}
	}
	return at, quoted, sc.Err()
}
