package gossip

import (
	"encoding/base64"
	"strings"
	"testing"
)

// TestParseKey: base64 of 16, 24 or 32 bytes is a key, empty is none, and
// anything else is refused saying what was wrong.
func TestParseKey(t *testing.T) {
	for _, n := range []int{16, 24, 32} {
		k, err := ParseKey(base64.StdEncoding.EncodeToString(make([]byte, n)))
		if err != nil || len(k) != n {
			t.Fatalf("%d bytes: %v %v", n, k, err)
		}
	}
	if k, err := ParseKey(""); err != nil || k != nil {
		t.Fatalf("empty: %v %v", k, err)
	}
	for in, want := range map[string]string{
		"not base64!": "not base64",
		base64.StdEncoding.EncodeToString(make([]byte, 20)): "20 bytes; it must be 16, 24 or 32",
	} {
		if _, err := ParseKey(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want %q", in, err, want)
		}
	}
}
