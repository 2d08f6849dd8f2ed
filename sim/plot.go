package sim

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/lumen-project/lumen/internal/plot"
)

// WriteSVG plots a figure with internal/plot (gonum/plot): TTFT mean, TTFT
// p99 and recovery time of each strategy (and the failure-free runs)
// against the swept parameter, the paper's curves. `lumen plot` draws the
// same from the figure's JSON.
func (f *Figure) WriteSVG(w io.Writer) error { return renderSVG(w, f.Name, len(f.Points), f) }

// WriteSVG plots the degradation figure with internal/plot: stop-and-restart's
// TTFT mean, TPOT mean and TTFT p99 degradation and its cluster recovery
// against the load, a line per setup and reload, the seed's 4.0× and 1.6×
// as dashed lines. `lumen plot` draws the same from the figure's JSON.
func (d *Degradation) WriteSVG(w io.Writer) error { return renderSVG(w, d.Name, len(d.Points), d) }

// WriteSVG plots the llumnix figure (internal/plot).
func (f *LlumnixFigure) WriteSVG(w io.Writer) error {
	return renderSVG(w, f.Name, len(f.Points), f)
}

// renderSVG draws a figure of points from its JSON with internal/plot, as
// `lumen plot` does.
func renderSVG(w io.Writer, name string, points int, fig any) error {
	if points == 0 {
		return fmt.Errorf("%w: figure %s has nothing to plot", ErrInvalid, name)
	}
	data, err := json.Marshal(fig)
	if err != nil {
		return err
	}
	svg, err := plot.Render(data)
	if err != nil {
		return fmt.Errorf("figure %s: %w", name, err)
	}
	_, err = w.Write(svg)
	return err
}
