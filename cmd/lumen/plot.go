package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/lumen-project/lumen/internal/plot"
)

func init() {
	register("plot", "plot benchmark or simulator output (JSON, or lumen sim -csv) as SVG next to it, running nothing", runPlot)
}

func runPlot(args []string) error {
	fs := flag.NewFlagSet("plot", flag.ContinueOnError)
	outPath := fs.String("o", "", "with one file: write the SVG here (default: the file's name with .svg)")
	failAt := fs.Duration("fail-at", 0, "mark the failure at this time on lumen sim -csv series (their rows do not carry it; lumen sim's is 30s, 12s with -quick)")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: lumen plot [-o OUT.svg] FILE.json|FILE.csv ...\n\n"+
			"Plots what lumen bench recovery|migration|controller|gateway|pacing and lumen sim wrote\n"+
			"(bench-results/*.json, lumen sim -csv) without rerunning them.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	files := fs.Args()
	if len(files) == 0 {
		fs.Usage()
		return fmt.Errorf("no file to plot")
	}
	if *outPath != "" && len(files) != 1 {
		return fmt.Errorf("-o with %d files: give one file", len(files))
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		svg, err := plot.RenderWith(data, plot.Options{FailAtS: failAt.Seconds()})
		if err != nil {
			return fmt.Errorf("%s: %w", f, err)
		}
		out := *outPath
		if out == "" {
			out = plot.SVGPath(f)
		}
		if err := os.WriteFile(out, svg, 0o644); err != nil {
			return err
		}
		fmt.Println("wrote", out)
	}
	return nil
}
