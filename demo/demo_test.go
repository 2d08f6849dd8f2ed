package demo

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	pb "github.com/lumen-project/lumen/proto/lumenpb"
)

func TestStreamObserveLongestGap(t *testing.T) {
	var s stream
	t0 := time.Unix(0, 0)
	for _, c := range []struct {
		at   time.Duration
		text string
	}{{0, "a"}, {10 * time.Millisecond, "b"}, {250 * time.Millisecond, "c"}, {260 * time.Millisecond, "d"}} {
		s.observe(t0.Add(c.at), c.text)
	}
	if s.text.String() != "abcd" || s.maxGap != 240*time.Millisecond {
		t.Fatalf("text %q, longest gap %s", s.text.String(), s.maxGap)
	}
}

func TestCheckStreams(t *testing.T) {
	mk := func(text string, err error, gap time.Duration) *stream {
		s := &stream{err: err, maxGap: gap}
		s.text.WriteString(text)
		return s
	}
	streams := []*stream{mk("same", nil, 5*time.Millisecond), mk("other", nil, time.Millisecond),
		mk("", errors.New("HTTP 503"), 0), mk("fine", nil, 1200*time.Millisecond)}
	var out bytes.Buffer
	ok := checkStreams(&out, streams, []string{"same", "wanted", "x", "fine"})
	if ok != 2 {
		t.Fatalf("ok %d, want 2", ok)
	}
	want := `   stream 1 DIFFERS from the reference:
     got  "other"
     want "wanted"
   stream 2 FAILED: HTTP 503
   2 of 4 streams complete and identical to the failure-free reference: no error, no gap, no repeat
   the longest pause any client saw between two tokens: 1200 ms (the failures' cost: a delay)
`
	if out.String() != want {
		t.Fatalf("got\n%s\nwant\n%s", out.String(), want)
	}
}

func TestPrintPlanSortsAndCountsReuse(t *testing.T) {
	plan := &pb.RecoveryPlan{Assignments: []*pb.RecoveryAssignment{
		{RequestId: "r2", TargetWorker: "worker-3", Mode: pb.RecoveryMode_RECOVERY_MODE_RECOMPUTE},
		{RequestId: "r1", TargetWorker: "worker-2", Mode: pb.RecoveryMode_RECOVERY_MODE_REUSE},
	}}
	var out bytes.Buffer
	if reuse := printPlan(&out, plan); reuse != 1 {
		t.Fatalf("reuse %d", reuse)
	}
	lines := strings.Split(strings.TrimRight(out.String(), "\n"), "\n")
	if len(lines) != 2 || lines[0] != "   r1 -> worker-2  resume at its checkpoint holder, reusing its KV pages" ||
		lines[1] != "   r2 -> worker-3  recompute (its holder is gone or it had none)" {
		t.Fatalf("got\n%s", out.String())
	}
	if plan.Assignments[0].RequestId != "r2" {
		t.Fatal("printPlan reordered the plan it was given")
	}
}

func TestRunRejectsEmptyConfig(t *testing.T) {
	if err := Run(Config{}); err == nil {
		t.Fatal("a demo of no workers and no streams ran")
	}
}
