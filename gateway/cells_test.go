package gateway

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

func TestParseCell(t *testing.T) {
	c, err := ParseCell("east-1=10.0.0.1:7100, 10.0.0.2:7100,10.0.0.3:7100")
	if err != nil {
		t.Fatal(err)
	}
	if c.Name != "east-1" || strings.Join(c.Controllers, " ") != "10.0.0.1:7100 10.0.0.2:7100 10.0.0.3:7100" {
		t.Fatalf("parsed %+v", c)
	}
	for in, want := range map[string]string{
		"10.0.0.1:7100":                  "want NAME=ADDR",
		"=10.0.0.1:7100":                 "must be 1-63 letters",
		"a b=10.0.0.1:7100":              "must be 1-63 letters",
		"east=":                          "no controller address for cell east",
		"east= , ":                       "no controller address for cell east",
		"-x=10.0.0.1:7100":               "starting with a letter or digit",
		strings.Repeat("a", 64) + "=h:1": "must be 1-63",
	} {
		if _, err := ParseCell(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseCell(%q) = %v, want an error saying %q", in, err, want)
		}
	}
}

func TestNewCellsRefusesBadCells(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Addr = "127.0.0.1:0"
	for _, tc := range []struct {
		cells []Cell
		want  string
	}{
		{nil, "0 cells: want 1 to 64"},
		{[]Cell{{"a", []string{"h:1"}}, {"a", []string{"h:2"}}}, "cell a is named twice"},
		{[]Cell{{"a", nil}}, "cell a has no controller address"},
	} {
		if _, err := NewCells(cfg, tc.cells); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewCells(%v) = %v, want an error saying %q", tc.cells, err, tc.want)
		}
	}
}

// TestCellGathererLabelsSeries: every series of a cell gateway's registry
// gets its cell label, sorted among its others; the runtime's series
// appear from one cell only.
func TestCellGathererLabelsSeries(t *testing.T) {
	mk := func() *prometheus.Registry {
		reg := prometheus.NewRegistry()
		c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "lumen_gateway_requests_total", Help: "h"}, []string{"endpoint", "code"})
		c.WithLabelValues("completions", "200").Inc()
		reg.MustRegister(c, collectors.NewGoCollector())
		return reg
	}
	gs := prometheus.Gatherers{cellGatherer{g: mk(), cell: "a", runtime: true}, cellGatherer{g: mk(), cell: "b"}}
	mfs, err := gs.Gather()
	if err != nil {
		t.Fatal(err)
	}
	goSeries, cells := 0, map[string]bool{}
	for _, mf := range mfs {
		switch {
		case strings.HasPrefix(mf.GetName(), "go_"):
			goSeries++
			for _, m := range mf.Metric {
				for _, l := range m.Label {
					if l.GetName() == "cell" {
						t.Fatalf("%s carries a cell label", mf.GetName())
					}
				}
			}
		case mf.GetName() == "lumen_gateway_requests_total":
			for _, m := range mf.Metric {
				var names []string
				for _, l := range m.Label {
					names = append(names, l.GetName())
					if l.GetName() == "cell" {
						cells[l.GetValue()] = true
					}
				}
				if strings.Join(names, ",") != "cell,code,endpoint" {
					t.Fatalf("labels %v, want cell,code,endpoint", names)
				}
			}
		}
	}
	if !cells["a"] || !cells["b"] || goSeries == 0 {
		t.Fatalf("cells %v, %d go_ families", cells, goSeries)
	}
}
