// Package plot draws lumen's benchmark and simulator outputs as SVG with
// gonum.org/v1/plot: the JSON that `lumen bench recovery|migration|
// controller|gateway|pacing` and `lumen sim` write, and the simulator's
// -csv time series. It reads the files, not the Go types that wrote them,
// so a JSON committed under bench-results/ is plotted again without
// rerunning a benchmark (`lumen plot FILE.json`), and the package depends on
// nothing of lumen's.
//
// Render recognises a file by its shape:
//
//   - a simulator figure ({"name", "x_label", "points": [{"x", "columns"}]}):
//     TTFT mean, TTFT p99 and recovery time against the swept parameter,
//     a line per strategy (the paper's curves);
//   - setup → strategy → figures (`lumen bench recovery`, `lumen sim`'s
//     studies): bars of TTFT mean, TTFT p99 and recovery time per
//     strategy and setup, and, where a strategy carries its "series" (1 s
//     bins), TTFT and queue length over time around the failure;
//   - `lumen bench migration`'s flat keys: downtime against the sequence
//     length with one decode step as a line, and the burst off and on;
//   - `lumen sim -figure burst` and `-figure spec-k`;
//   - `lumen sim -figure degradation`: stop-and-restart's degradation by
//     the failure against the load, a line per setup and reload, the
//     seed's 4.0× TTFT and 1.6× TPOT as dashed lines;
//   - any other flat object of numbers (`lumen bench controller`, ...):
//     bars grouped by unit (per second, ms, s);
//   - the simulator's -csv series (setup,column,t_s,...): TTFT and queue
//     length over time per strategy.
package plot

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgsvg"
)

// ErrUnknown is returned for a file whose shape Render does not know.
var ErrUnknown = errors.New("plot: not a lumen benchmark or simulator output")

func init() {
	plot.DefaultFont = font.Font{Typeface: "Liberation", Variant: "Sans"}
}

// SVGPath is where the plot of path goes: path with its extension
// replaced by .svg.
func SVGPath(path string) string {
	return strings.TrimSuffix(path, filepath.Ext(path)) + ".svg"
}

// WriteNextTo plots the file at path into SVGPath(path) and returns that
// path.
func WriteNextTo(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	svg, err := Render(data)
	if err != nil {
		return "", fmt.Errorf("%s: %w", path, err)
	}
	out := SVGPath(path)
	return out, os.WriteFile(out, svg, 0o644)
}

// Options are what a file does not say.
type Options struct {
	// FailAtS marks the failure, in seconds, on the simulator's -csv
	// series (its rows do not carry it; `lumen sim`'s default is 30 s, 12 s
	// with -quick).
	FailAtS float64
}

// Render returns the SVG of a benchmark's or the simulator's output.
func Render(data []byte) ([]byte, error) { return RenderWith(data, Options{}) }

// RenderWith is Render with options.
func RenderWith(data []byte, o Options) ([]byte, error) {
	trimmed := bytes.TrimSpace(data)
	if bytes.HasPrefix(trimmed, []byte(seriesCSVHeader)) {
		panels, err := csvSeriesPanels(trimmed, o.FailAtS)
		if err != nil {
			return nil, err
		}
		return draw1(panels)
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(trimmed, &raw); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnknown, err)
	}
	var panels []*plot.Plot
	var err error
	switch name := stringField(raw, "name"); {
	case raw["x_label"] != nil && raw["points"] != nil:
		panels, err = figurePanels(trimmed)
	case name == "burst":
		panels, err = burstPanels(trimmed)
	case name == "llumnix" && raw["priority_fraction"] != nil:
		panels, err = llumnixPriorityPanels(trimmed)
	case name == "llumnix":
		panels, err = llumnixPanels(trimmed)
	case name == "cells":
		panels, err = cellsPanels(trimmed)
	case name == "prefix":
		panels, err = prefixPanels(trimmed)
	case raw["llumnix_prefill_p99_x"] != nil:
		panels, err = llumnixBenchPanels(trimmed)
	case name == "spec-k":
		panels, err = specKPanels(trimmed)
	case name == "degradation":
		panels, err = degradationPanels(trimmed)
	case raw["downtime_client_ms_256"] != nil || hasPrefixKey(raw, "downtime_client_ms_"):
		panels, err = migrationPanels(trimmed)
	case isReplicas(raw):
		panels, err = replicasPanels(trimmed)
	case isSetups(raw):
		panels, err = setupsPanels(trimmed)
	default:
		panels, err = flatPanels(trimmed)
	}
	if err != nil {
		return nil, err
	}
	return draw1(panels)
}

// draw1 stacks the panels in one SVG.
func draw1(panels []*plot.Plot) ([]byte, error) {
	if len(panels) == 0 {
		return nil, fmt.Errorf("%w: nothing to plot", ErrUnknown)
	}
	const cols = 2
	rows := (len(panels) + cols - 1) / cols
	ncols := min(cols, len(panels))
	w, h := vg.Length(ncols)*14*vg.Centimeter, vg.Length(rows)*9*vg.Centimeter
	c := vgsvg.New(w, h)
	dc := draw.New(c)
	// A white background: the SVG is read on dark pages too.
	dc.SetColor(color.White)
	dc.Fill(dc.Rectangle.Path())
	grid := make([][]*plot.Plot, rows)
	for i := range grid {
		grid[i] = make([]*plot.Plot, ncols)
	}
	for i, p := range panels {
		grid[i/ncols][i%ncols] = p
	}
	canvases := plot.Align(grid, draw.Tiles{Rows: rows, Cols: ncols, PadX: vg.Centimeter / 2, PadY: vg.Centimeter / 2,
		PadTop: vg.Centimeter / 4, PadBottom: vg.Centimeter / 4, PadLeft: vg.Centimeter / 4, PadRight: vg.Centimeter / 4}, dc)
	for i, row := range grid {
		for j, p := range row {
			if p != nil {
				headroom(p)
				p.Draw(canvases[i][j])
			}
		}
	}
	var b bytes.Buffer
	if _, err := c.WriteTo(&b); err != nil {
		return nil, err
	}
	// Text is measured with Liberation Sans, which the SVG names but does
	// not embed (that would add 400 KB a file); Arial has the same metrics,
	// so a viewer without Liberation lays the labels out the same.
	return bytes.ReplaceAll(b.Bytes(), []byte("font-family:Liberation Sans;"),
		[]byte("font-family:'Liberation Sans',Arial,Helvetica,sans-serif;")), nil
}

// palette colours series by name, so that a strategy keeps its colour in
// every panel and file.
var palette = []color.RGBA{
	{0x1f, 0x77, 0xb4, 0xff}, {0xd6, 0x27, 0x28, 0xff}, {0xff, 0x7f, 0x0e, 0xff}, {0x2c, 0xa0, 0x2c, 0xff},
	{0x94, 0x67, 0xbd, 0xff}, {0x7f, 0x7f, 0x7f, 0xff}, {0x8c, 0x56, 0x4b, 0xff}, {0xe3, 0x77, 0xc2, 0xff},
	{0x17, 0xbe, 0xcf, 0xff}, {0xbc, 0xbd, 0x22, 0xff},
}

var named = map[string]color.RGBA{
	"lumen": palette[0], "stop-and-restart": palette[1], "fixed-checkpoint": palette[2], "lumen-no-spec": palette[3],
	"recompute": palette[4], "lumen-no-failure": palette[5], "no-checkpoint-no-failure": palette[6], "off": palette[1], "on": palette[0],
	"infaas++": palette[1], "round-robin": palette[5],
	oracleName: palette[8],
}

func colour(name string, i int) color.Color {
	if c, ok := named[name]; ok {
		return c
	}
	return palette[i%len(palette)]
}

// strategyOrder sorts strategies as the paper's tables do, others after,
// by name.
func strategyOrder(names []string) []string {
	rank := map[string]int{"stop-and-restart": 0, "recompute": 1, "fixed-checkpoint": 2, "lumen-no-spec": 3, "lumen": 4, oracleName: 5, "lumen-no-failure": 6, "no-checkpoint-no-failure": 7}
	out := append([]string(nil), names...)
	sort.Slice(out, func(i, j int) bool {
		ri, iok := rank[out[i]]
		rj, jok := rank[out[j]]
		switch {
		case iok && jok:
			return ri < rj
		case iok != jok:
			return iok
		}
		return out[i] < out[j]
	})
	return out
}

func newPlot(title, x, y string) *plot.Plot {
	p := plot.New()
	p.Title.Text, p.X.Label.Text, p.Y.Label.Text = title, x, y
	p.Legend.Top = true
	p.Legend.TextStyle.Font.Size = vg.Points(9)
	g := plotter.NewGrid()
	p.Add(g)
	legendMu.Lock()
	grids[p] = g
	legendMu.Unlock()
	return p
}

// legendRows counts each plot's legend entries, to leave the legend room
// above the data (headroom).
var (
	legendMu   sync.Mutex
	legendRows = map[*plot.Plot]int{}
	grids      = map[*plot.Plot]*plotter.Grid{}
)

func legend(p *plot.Plot, name string, thumbs ...plot.Thumbnailer) {
	p.Legend.Add(name, thumbs...)
	legendMu.Lock()
	legendRows[p]++
	legendMu.Unlock()
}

// headroom raises the top of the y axis so that the legend, drawn in the
// top right corner, does not cover the data.
func headroom(p *plot.Plot) {
	legendMu.Lock()
	n := legendRows[p]
	delete(legendRows, p)
	delete(grids, p)
	legendMu.Unlock()
	if p.Y.Min == 0 && p.Y.Max <= 0 {
		p.Y.Max = 1 // all zeros (no recovery measured): an axis from 0, not around it
	}
	if n == 0 || p.Y.Max <= p.Y.Min {
		return
	}
	if _, log := p.Y.Scale.(plot.LogScale); log && p.Y.Min > 0 {
		lo, hi := math.Log(p.Y.Min), math.Log(p.Y.Max)
		p.Y.Max = math.Exp(lo + (hi-lo)*(1+0.075*float64(n)))
		return
	}
	p.Y.Max = p.Y.Min + (p.Y.Max-p.Y.Min)*(1+0.075*float64(n))
}

// logX puts x on a log scale when its values span a factor of 8 or more
// and are all positive (a sweep of 1, 2, 4, 8, 16 failed workers).
func logX(p *plot.Plot, xs []float64) {
	lo, hi := math.Inf(1), 0.0
	for _, x := range xs {
		lo, hi = math.Min(lo, x), math.Max(hi, x)
	}
	if lo > 0 && hi/lo >= 8 {
		p.X.Scale, p.X.Tick.Marker = plot.LogScale{}, plot.LogTicks{Prec: -1}
	}
}

// line is one named series.
type line struct {
	name string
	xy   plotter.XYs
}

// addLines draws lines with points; dashed draws them dashed.
func addLines(p *plot.Plot, lines []line, points bool) error {
	for i, l := range lines {
		if len(l.xy) == 0 {
			continue
		}
		ln, err := plotter.NewLine(l.xy)
		if err != nil {
			return fmt.Errorf("%s: %w", l.name, err)
		}
		ln.Color, ln.Width = colour(l.name, i), vg.Points(1.5)
		p.Add(ln)
		if points {
			sc, err := plotter.NewScatter(l.xy)
			if err != nil {
				return err
			}
			sc.Color, sc.Radius, sc.Shape = ln.Color, vg.Points(2.5), draw.CircleGlyph{}
			p.Add(sc)
			legend(p, l.name, ln, sc)
		} else {
			legend(p, l.name, ln)
		}
	}
	return nil
}

// addBars draws grouped bars: groups along x (named), one bar per series
// in each group; values[s][g].
func addBars(p *plot.Plot, groups, series []string, values [][]float64) error {
	if len(series) == 0 || len(groups) == 0 {
		return nil
	}
	width := vg.Points(min(18, 220/float64(len(series)*len(groups))+4))
	for s, name := range series {
		b, err := plotter.NewBarChart(plotter.Values(values[s]), width)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		b.Color, b.LineStyle.Width = colour(name, s), 0
		b.Offset = width * vg.Length(float64(s)-float64(len(series)-1)/2)
		p.Add(b)
		legend(p, name, b)
	}
	p.NominalX(groups...)
	p.Y.Min = 0
	// The groups' bars spread around each integer x: keep them all inside
	// the data area, and no vertical grid line through them.
	p.X.Min, p.X.Max = -0.5, float64(len(groups))-0.5
	noVerticalGrid(p)
	return nil
}

// noVerticalGrid hides the vertical lines of p's grid.
func noVerticalGrid(p *plot.Plot) {
	legendMu.Lock()
	defer legendMu.Unlock()
	if g := grids[p]; g != nil {
		g.Vertical.Color = nil
	}
}

// hline draws a dashed horizontal line at y across [x0, x1], named.
func hline(p *plot.Plot, name string, y, x0, x1 float64, c color.Color) error {
	ln, err := plotter.NewLine(plotter.XYs{{X: x0, Y: y}, {X: x1, Y: y}})
	if err != nil {
		return err
	}
	ln.Color, ln.Dashes, ln.Width = c, []vg.Length{vg.Points(4), vg.Points(3)}, vg.Points(1.5)
	p.Add(ln)
	legend(p, name, ln)
	return nil
}

// vline marks x (a failure) from the bottom to the top of the data area,
// whatever the y range ends up being.
func vline(p *plot.Plot, name string, x float64) error {
	l := &vLine{X: x, LineStyle: draw.LineStyle{Color: color.Black, Width: vg.Points(1), Dashes: []vg.Length{vg.Points(2), vg.Points(2)}}}
	p.Add(l)
	legend(p, name, l)
	return nil
}

// vLine is a vertical line across a plot's data area.
type vLine struct {
	X float64
	draw.LineStyle
}

// Plot implements plot.Plotter.
func (l *vLine) Plot(c draw.Canvas, p *plot.Plot) {
	trX, _ := p.Transforms(&c)
	x := trX(l.X)
	c.StrokeLine2(l.LineStyle, x, c.Min.Y, x, c.Max.Y)
}

// DataRange implements plot.DataRanger: x only, y left to the data.
func (l *vLine) DataRange() (xmin, xmax, ymin, ymax float64) {
	return l.X, l.X, math.Inf(1), math.Inf(-1)
}

// Thumbnail implements plot.Thumbnailer.
func (l *vLine) Thumbnail(c *draw.Canvas) {
	y := c.Center().Y
	c.StrokeLine2(l.LineStyle, c.Min.X, y, c.Max.X, y)
}

func stringField(raw map[string]json.RawMessage, k string) string {
	var s string
	if v, ok := raw[k]; ok {
		_ = json.Unmarshal(v, &s)
	}
	return s
}

func hasPrefixKey(raw map[string]json.RawMessage, prefix string) bool {
	for k := range raw {
		if strings.HasPrefix(k, prefix) {
			return true
		}
	}
	return false
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
