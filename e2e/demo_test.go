package e2e

import (
	"os/exec"
	"strings"
	"testing"
)

// TestDemo runs the README's first command, `lumen demo`, and requires it
// to succeed with every stream identical to the reference, and to show the
// killed worker's progressive recovery.
func TestDemo(t *testing.T) {
	out, err := exec.Command(lumenBin, "demo", "-streams", "12").CombinedOutput()
	if err != nil {
		t.Fatalf("lumen demo: %v\n%s", err, out)
	}
	// 12 streams through the failures, 12 more during the progressive
	// recovery, whose phases and assist the story shows.
	for _, want := range []string{"streams complete and identical to the failure-free reference", "LOADING_DRAFT", "ASSIST", "HOTSWAP", "FULL_SERVICE", "draft tokens of worker-"} {
		if !strings.Contains(string(out), want) {
			t.Fatalf("no %q in the demo's output:\n%s", want, out)
		}
	}
}
