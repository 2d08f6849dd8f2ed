package sim

import (
	"fmt"
	"io"
	"math"
	"strings"
)

// plotSeries are the lines of a figure's plot: column, colour.
var plotSeries = []struct{ col, colour string }{
	{"stop-and-restart", "#d62728"},
	{"fixed-checkpoint", "#ff7f0e"},
	{"lumen", "#1f77b4"},
	{"lumen-no-failure", "#7f7f7f"},
}

// WriteSVG plots a figure: TTFT mean of each strategy (and the failure-free
// run) against the swept parameter, points evenly spaced.
func (f *Figure) WriteSVG(w io.Writer) error {
	const width, height, left, right, top, bottom = 640.0, 400.0, 70.0, 170.0, 40.0, 60.0
	pw, ph := width-left-right, height-top-bottom
	ymax := 0.0
	for _, p := range f.Points {
		for _, s := range plotSeries {
			if c := p.Columns[s.col]; c != nil {
				ymax = math.Max(ymax, c.TTFTMeanMs)
			}
		}
	}
	if ymax == 0 || len(f.Points) == 0 {
		return fmt.Errorf("%w: figure %s has nothing to plot", ErrInvalid, f.Name)
	}
	step := math.Pow(10, math.Floor(math.Log10(ymax)))
	for ymax/step < 4 {
		step /= 2
	}
	ytop := math.Ceil(ymax/step) * step
	x := func(i int) float64 {
		if len(f.Points) == 1 {
			return left + pw/2
		}
		return left + pw*float64(i)/float64(len(f.Points)-1)
	}
	y := func(v float64) float64 { return top + ph*(1-v/ytop) }
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif" font-size="12">`+"\n", width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%.0f" y="20" font-size="14">%s: TTFT mean (ms)</text>`+"\n", left, f.Name)
	for v := 0.0; v <= ytop+step/2; v += step {
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", left, left+pw, y(v), y(v))
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="end">%g</text>`+"\n", left-6, y(v)+4, v)
	}
	for i, p := range f.Points {
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%g</text>`+"\n", x(i), top+ph+18, p.X)
	}
	fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`+"\n", left+pw/2, height-12, f.XLabel)
	for k, s := range plotSeries {
		var pts []string
		for i, p := range f.Points {
			if c := p.Columns[s.col]; c != nil {
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(i), y(c.TTFTMeanMs)))
			}
		}
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", s.colour, strings.Join(pts, " "))
		for _, pt := range pts {
			xy := strings.Split(pt, ",")
			fmt.Fprintf(&b, `<circle cx="%s" cy="%s" r="3" fill="%s"/>`+"\n", xy[0], xy[1], s.colour)
		}
		ly := top + 16*float64(k)
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="%s" stroke-width="2"/>`+"\n", left+pw+12, left+pw+32, ly, ly, s.colour)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f">%s</text>`+"\n", left+pw+38, ly+4, s.col)
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}
