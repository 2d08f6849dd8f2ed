package e2e

import (
	"os/exec"
	"strings"
	"testing"
)

// TestDemo runs the README's first command, `lumen demo`, and requires it
// to succeed with every stream identical to the reference.
func TestDemo(t *testing.T) {
	out, err := exec.Command(lumenBin, "demo", "-streams", "12").CombinedOutput()
	if err != nil {
		t.Fatalf("lumen demo: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "12 of 12 streams complete and identical") {
		t.Fatalf("demo output:\n%s", out)
	}
}
