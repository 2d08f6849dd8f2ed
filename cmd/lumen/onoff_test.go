package main

import (
	"strings"
	"testing"
)

// TestPrefixRoutingFlag: -prefix-routing takes on or off on lumen gateway
// and lumen dev; another value is refused naming the flag and the values.
func TestPrefixRoutingFlag(t *testing.T) {
	for name, run := range map[string]func([]string) error{"gateway": runGateway, "dev": runDev} {
		err := run([]string{"-prefix-routing", "yes"})
		if err == nil || !strings.Contains(err.Error(), "-prefix-routing") || !strings.Contains(err.Error(), "want on or off") {
			t.Errorf("lumen %s -prefix-routing yes: %v, want an error naming the flag and on or off", name, err)
		}
	}
	var v bool
	f := onOff{&v}
	if err := f.Set("on"); err != nil || !v || f.String() != "on" {
		t.Fatalf("on: %v, %v, %q", err, v, f.String())
	}
	if err := f.Set("off"); err != nil || v || f.String() != "off" {
		t.Fatalf("off: %v, %v, %q", err, v, f.String())
	}
}
