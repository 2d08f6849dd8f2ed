package sim

import (
	"encoding/xml"
	"io"
	"strings"
	"testing"
	"time"
)

// TestFiguresSmall runs every figure of `make sim` at a size that fits in
// `make test`: 8 workers (4 to 16 for the proportional one), 12 s of
// arrivals, two points each. Each point is a Study, so conservation is
// checked in every simulation it runs.
func TestFiguresSmall(t *testing.T) {
	seed := uint64(2)
	t.Logf("seed %d", seed)
	o := DefaultFigureOptions()
	o.Workers, o.Sizes, o.Seed = 8, []int{4, 16}, seed
	o.Timeline = Timeline{Warmup: 2 * time.Second, FailAt: 4 * time.Second, Duration: 12 * time.Second, Calibration: 6 * time.Second, ReloadScale: 0.1}
	o.Seeds = 2 // two seeds per point: the means path runs too
	xs := map[string][]float64{"failures": {1, 2}, "load": {0.5, 0.9}, "proportional": nil, "lambda": {0, 2}, "budget": {0.1, 1}}
	for _, name := range FigureNames {
		t.Run(name, func(t *testing.T) {
			o := o
			o.Xs = xs[name]
			f, err := RunFigure(name, o)
			if err != nil {
				t.Fatal(err)
			}
			if len(f.Points) != 2 {
				t.Fatalf("%d points", len(f.Points))
			}
			for _, p := range f.Points {
				for _, col := range Columns {
					c := p.Columns[col.Name]
					if c == nil || c.TTFTMeanMs <= 0 || c.FailedRequests != 0 {
						t.Fatalf("x=%g %s: %+v", p.X, col.Name, c)
					}
					// Issue 27: every failed column but the oracle
					// carries its excess vs the oracle's, at every
					// point, the seeds' means too.
					if want := col.Fail && !col.Oracle; (c.ExcessVsOracle != nil) != want {
						t.Errorf("x=%g %s: excess_vs_oracle %+v, want one: %v", p.X, col.Name, c.ExcessVsOracle, want)
					}
				}
			}
			var b strings.Builder
			f.Print(&b)
			if !strings.Contains(b.String(), "lumen x oracle") {
				t.Errorf("the table has no excess vs the oracle:\n%s", b.String())
			}
		})
	}
}

// TestFigureSVG: the plot is well-formed XML naming every strategy.
func TestFigureSVG(t *testing.T) {
	f := &Figure{Name: "t", XLabel: "x", Points: []Point{
		{X: 1, Columns: map[string]*Figures{"lumen": ttft(100), "stop-and-restart": ttft(150), "fixed-checkpoint": ttft(120), "lumen-no-failure": ttft(90)}},
		{X: 2, Columns: map[string]*Figures{"lumen": ttft(110), "stop-and-restart": ttft(170), "fixed-checkpoint": ttft(130), "lumen-no-failure": ttft(95)}},
	}}
	var b strings.Builder
	if err := f.WriteSVG(&b); err != nil {
		t.Fatal(err)
	}
	d := xml.NewDecoder(strings.NewReader(b.String()))
	texts := map[string]bool{}
	inText := false
	for {
		tok, err := d.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("not XML: %v", err)
		}
		switch el := tok.(type) {
		case xml.StartElement:
			inText = el.Name.Local == "text"
		case xml.CharData:
			if inText {
				texts[strings.TrimSpace(string(el))] = true
			}
		case xml.EndElement:
			inText = false
		}
	}
	for _, s := range []string{"lumen", "stop-and-restart", "fixed-checkpoint", "lumen-no-failure", "t: TTFT mean (ms)"} {
		if !texts[s] {
			t.Errorf("no %q in the plot", s)
		}
	}
}

// ttft is a column's figures with only its TTFT mean.
func ttft(ms float64) *Figures {
	f := &Figures{}
	f.TTFTMeanMs = ms
	return f
}
