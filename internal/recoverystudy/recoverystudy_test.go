package recoverystudy

import (
	"errors"
	"testing"
	"time"

	"github.com/lumen-project/lumen/internal/servingstats"
)

func TestGain(t *testing.T) {
	for _, c := range []struct {
		a, b float64
		want string
	}{{110, 100, "+10.0%"}, {90, 100, "-10.0%"}, {5, 0, "n/a"}, {100, 100, "+0.0%"}} {
		if got := Gain(c.a, c.b); got != c.want {
			t.Errorf("Gain(%v, %v) = %q, want %q", c.a, c.b, got, c.want)
		}
	}
}

func TestParseSetups(t *testing.T) {
	got, err := ParseSetups("w8_f4, w4")
	if err != nil || len(got) != 2 || got[0].Name != "w8_f4" || got[0].Failures != 4 || got[1].Budget != 160e9 {
		t.Fatalf("%+v, %v", got, err)
	}
	if _, err := ParseSetups("w4,w16"); !errors.Is(err, ErrUnknownSetup) {
		t.Fatalf("unknown setup: %v, want ErrUnknownSetup", err)
	}
}

// The table order and the run order hold the same columns, and every
// failed column's reference is a failure-free column that runs before it.
func TestColumns(t *testing.T) {
	ran := map[string]bool{}
	for _, c := range Columns {
		if c.Fail && (ran[c.Ref] == false || c.Ref == "") {
			t.Errorf("%s: reference %q does not run before it", c.Name, c.Ref)
		}
		if !c.Fail {
			ran[c.Name] = true
		}
	}
	if len(tableOrder) != len(Columns) {
		t.Fatalf("table shows %d columns of %d", len(tableOrder), len(Columns))
	}
	for _, name := range tableOrder {
		found := false
		for _, c := range Columns {
			found = found || c.Name == name
		}
		if !found {
			t.Errorf("table column %s does not run", name)
		}
	}
}

func TestLatencies(t *testing.T) {
	ms := time.Millisecond
	recs := []*servingstats.Record{
		{Arrival: 0, Chunks: []time.Duration{100 * ms}},                                // before the warm-up: counted, not timed
		{Arrival: 2000 * ms, Chunks: []time.Duration{2050 * ms, 2060 * ms}, Tokens: 2}, // before the failure
		{Arrival: 6000 * ms, Chunks: []time.Duration{6100 * ms, 6120 * ms}, Tokens: 2},
		{Arrival: 7000 * ms, Err: errors.New("HTTP 503")},
	}
	var f Figures
	f.Latencies(recs, time.Second, 5*time.Second)
	if f.Requests != 4 || f.FailedRequests != 1 || f.TTFTMeanMs != 75 || f.PreFailureTTFTMs != 50 || f.TPOTMeanMs != 15 {
		t.Fatalf("%+v", f)
	}
}
