package main

import (
	"flag"

	"github.com/lumen-project/lumen/demo"
)

func init() {
	register("demo", "start a local cluster, kill -9 a controller leader and a worker mid-stream, show the recovery", runDemo)
}

func runDemo(args []string) error {
	cfg := demo.DefaultConfig()
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.StringVar(&cfg.Dir, "dir", "", "data and log directory (default: a temporary one, removed afterwards)")
	fs.IntVar(&cfg.Workers, "workers", cfg.Workers, "workers")
	fs.IntVar(&cfg.Streams, "streams", cfg.Streams, "client streams")
	fs.IntVar(&cfg.MaxTokens, "max-tokens", cfg.MaxTokens, "output tokens per stream")
	if err := fs.Parse(args); err != nil {
		return err
	}
	return demo.Run(cfg)
}
