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
func (f *Figure) WriteSVG(w io.Writer) error {
	if len(f.Points) == 0 {
		return fmt.Errorf("%w: figure %s has nothing to plot", ErrInvalid, f.Name)
	}
	data, err := json.Marshal(f)
	if err != nil {
		return err
	}
	svg, err := plot.Render(data)
	if err != nil {
		return fmt.Errorf("figure %s: %w", f.Name, err)
	}
	_, err = w.Write(svg)
	return err
}

// WriteSVG plots the degradation figure with internal/plot: stop-and-restart's
// TTFT mean, TPOT mean and TTFT p99 degradation and its cluster recovery
// against the load, a line per setup and reload, the seed's 4.0× and 1.6×
// as dashed lines. `lumen plot` draws the same from the figure's JSON.
func (d *Degradation) WriteSVG(w io.Writer) error {
	if len(d.Points) == 0 {
		return fmt.Errorf("%w: figure %s has nothing to plot", ErrInvalid, d.Name)
	}
	data, err := json.Marshal(d)
	if err != nil {
		return err
	}
	svg, err := plot.Render(data)
	if err != nil {
		return fmt.Errorf("figure %s: %w", d.Name, err)
	}
	_, err = w.Write(svg)
	return err
}

// WriteSVG plots the llumnix figure (internal/plot).
func (f *LlumnixFigure) WriteSVG(w io.Writer) error {
	if len(f.Points) == 0 {
		return fmt.Errorf("%w: figure %s has nothing to plot", ErrInvalid, f.Name)
	}
	data, err := json.Marshal(f)
	if err != nil {
		return err
	}
	svg, err := plot.Render(data)
	if err != nil {
		return err
	}
	_, err = w.Write(svg)
	return err
}
