package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// lumenBin is the binary under test, built once by TestMain.
var lumenBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "lumen-e2e-bin-")
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
	os.RemoveAll(dir)
	os.Exit(code)
}
