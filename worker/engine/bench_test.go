package engine

import (
	"context"
	"fmt"
	"testing"
)

// BenchmarkDecode measures decode steps of the default model at batch 1, 8
// and 32, each sequence 128 tokens in; run with -cpu 1 for one core.
func BenchmarkDecode(b *testing.B) {
	for _, batch := range []int{1, 8, 32} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			e := newEngine(b, 2048)
			ctx := context.Background()
			chunks := make([]Chunk, batch)
			for i := range chunks {
				prompt := make([]int32, 128)
				for j := range prompt {
					prompt[j] = int32((i*31 + j*7) % 256)
				}
				chunks[i] = Chunk{Seq: SeqID(i), Tokens: prompt, Sample: 1}
			}
			out, err := e.Forward(ctx, chunks)
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for n := 0; n < b.N; n++ {
				for i := range chunks {
					chunks[i].Tokens = out[i]
				}
				if out, err = e.Forward(ctx, chunks); err != nil {
					b.Fatal(err)
				}
				if n%256 == 255 { // stay well inside the context
					b.StopTimer()
					for i := range chunks {
						_ = e.Truncate(chunks[i].Seq, 128)
					}
					b.StartTimer()
				}
			}
			b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "tokens/s")
		})
	}
}

// BenchmarkPrefill measures prefilling 512-token prompts.
func BenchmarkPrefill(b *testing.B) {
	e := newEngine(b, 2048)
	ctx := context.Background()
	prompt := make([]int32, 512)
	for j := range prompt {
		prompt[j] = int32(j % 256)
	}
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		if _, err := e.Forward(ctx, []Chunk{{Seq: 1, Tokens: prompt, Sample: 1}}); err != nil {
			b.Fatal(err)
		}
		e.Release(1)
	}
	b.ReportMetric(float64(b.N*len(prompt))/b.Elapsed().Seconds(), "tokens/s")
}
