package main

import (
	"flag"
	"fmt"
	"path/filepath"

	"github.com/lumen-project/lumen/worker/engine"
)

func init() {
	register("model init", "write a seeded target model and its draft (safetensors) into DIR", runModelInit)
}

func runModelInit(args []string) error {
	fs := flag.NewFlagSet("model init", flag.ContinueOnError)
	seed := fs.Uint64("seed", engine.DefaultSeed, "random seed of the weights")
	dir, rest := splitFirst(args)
	if err := fs.Parse(rest); err != nil {
		return err
	}
	if dir == "" {
		dir = engine.DefaultModelDir()
	}
	target, draft, err := engine.InitModel(dir, *seed)
	if err != nil {
		return err
	}
	for _, w := range []*engine.Weights{target, draft} {
		c := w.Config
		fmt.Printf("%-18s %d layers, hidden %d, %d/%d heads, ffn %d, vocab %d: %.2f M params, %d KV bytes/token\n",
			c.Name, c.Layers, c.Hidden, c.Heads, c.KVHeads, c.FFN, c.Vocab, float64(c.Params())/1e6, c.KVBytesPerToken())
	}
	rate, err := engine.DraftAgreement(dir, 16, 48)
	if err != nil {
		return err
	}
	fmt.Printf("greedy agreement of the draft with the target: %.1f%% (16 prompts × 48 tokens)\n", rate*100)
	fmt.Printf("wrote %s and %s\n", filepath.Join(dir, engine.TargetFile), filepath.Join(dir, engine.DraftFile))
	return nil
}
