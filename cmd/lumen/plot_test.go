package main

import (
	"encoding/xml"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPlotCommand: lumen plot draws a committed benchmark's JSON next to a
// copy of it, -o elsewhere, and refuses -o with several files.
func TestPlotCommand(t *testing.T) {
	data, err := os.ReadFile("../../bench-results/migration-059f895.json")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	in := filepath.Join(dir, "migration.json")
	if err := os.WriteFile(in, data, 0o644); err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(dir, "plots", "m.svg")
	if err := os.Mkdir(filepath.Dir(other), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := runPlot([]string{in}); err != nil {
		t.Fatal(err)
	}
	if err := runPlot([]string{"-o", other, in}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{filepath.Join(dir, "migration.svg"), other} {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		var doc struct{ XMLName xml.Name }
		if err := xml.Unmarshal(b, &doc); err != nil || doc.XMLName.Local != "svg" {
			t.Fatalf("%s: not an SVG (%v)", p, err)
		}
		if !strings.Contains(string(b), "downtime vs sequence length") {
			t.Errorf("%s: no downtime panel", p)
		}
	}
	if err := runPlot([]string{"-o", other, in, in}); err == nil || !strings.Contains(err.Error(), "-o with 2 files") {
		t.Fatalf("-o with two files: %v", err)
	}
}
