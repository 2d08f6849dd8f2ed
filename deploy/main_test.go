package deploy

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// lumenBin is the binary under test, built once by TestMain.
var lumenBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "lumen-deploy-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	lumenBin = filepath.Join(dir, "lumen")
	build := exec.Command("go", "build", "-o", lumenBin, "../cmd/lumen")
	build.Stdout, build.Stderr = os.Stdout, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building lumen:", err)
		os.Exit(1)
	}
	code := m.Run()
	stopLive()
	os.RemoveAll(dir)
	os.Exit(code)
}

// commands lists the binary's commands, as its usage prints them ("worker
// drain", "controller", ...).
func commands(t *testing.T) map[string]bool {
	t.Helper()
	out, _ := exec.Command(lumenBin).CombinedOutput() // usage, exit status 2
	cmds := map[string]bool{}
	in := false
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "Commands:"):
			in = true
		case in && strings.HasPrefix(line, "  "):
			// "  worker drain           drain a worker: ..." — the name is
			// padded to 22 columns.
			if len(line) > 24 {
				cmds[strings.TrimSpace(line[2:24])] = true
			}
		case in && strings.TrimSpace(line) == "":
			if len(cmds) > 0 {
				in = false
			}
		}
	}
	if !cmds["controller"] || !cmds["worker"] || !cmds["gateway"] {
		t.Fatalf("lumen's usage lists no controller, worker and gateway commands:\n%s", out)
	}
	return cmds
}

// acceptsFlags runs `lumen args... -h`: the flag package parses every flag
// before -h (an unknown flag or a value that does not parse stops it with
// an error) and answers -h with "flag: help requested".
func acceptsFlags(args []string) error {
	out, _ := exec.Command(lumenBin, append(append([]string(nil), args...), "-h")...).CombinedOutput()
	if bytes.Contains(out, []byte("flag: help requested")) {
		return nil
	}
	// The first line that is not the usage listing says what was wrong.
	msg := strings.TrimSpace(string(out))
	if i := strings.Index(msg, "\nUsage"); i > 0 {
		msg = msg[:i]
	}
	return fmt.Errorf("lumen %s: %s", strings.Join(args, " "), msg)
}
