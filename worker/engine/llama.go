package engine

import (
	"time"

	"github.com/lumen-project/lumen/internal/workload"
)

// Llumnix's instance (issue 23), the simulator's figure llumnix
// (sim.LlamaA10) and the paced workers' profile llama-7b-a10.

// The A10 and LLaMA-7B numbers the profile is derived from
// (docs/calibration.md, "Llumnix's setup").
const (
	a10MemBytes    = 24e9    // NVIDIA A10 datasheet: 24 GB GDDR6
	a10BytesPerSec = 600e9   // 600 GB/s
	a10BF16FLOPs   = 125e12  // dense BF16 tensor throughput
	llama7BParams  = 6.74e9  // LLaMA-7B (arXiv 2302.13971)
	llama7BWeights = 13.48e9 // bf16: 2 bytes a parameter
	prefillMFU     = 0.65    // as the H100 profiles' prefill (assumed)
	// llumnixStepOverheadMs is a decode step's fixed cost beyond the weight
	// read, fitted to Llumnix's measured LLaMA-7B steps: 44 ms at short
	// context, 22.5 of them the weights (docs/calibration.md). vLLM of
	// 2023 on an A10, run eagerly, without CUDA graphs: the H100
	// profiles' 2.8 ms is a CUDA-graph engine's.
	llumnixStepOverheadMs = 44 - llama7BWeights/a10BytesPerSec*1000
)

// LlamaA10 is Llumnix's instance: LLaMA-7B (32 layers, 32 KV heads of
// 128: 512 KiB of KV a token) in bf16 on one A10. A decode step reads the
// weights (13.48 GB at 600 GB/s: 22.5 ms) plus a fixed overhead that
// brings it to Llumnix's measured 44 ms at short context, each
// row costs its FLOPs at prefill's utilisation (2 × 6.74 G / 81 TFLOP/s:
// 0.166 ms) and its context's KV read (0.874 µs a token, DecodeContext on);
// prefill runs at 81 TFLOP/s / 13.5 GFLOP a token ≈ 6,000 tokens/s. The KV
// cache is 90% of 24 GB less the weights: 967 pages of 16 tokens. KV moves
// between instances at 16 GB/s, Llumnix's measured NCCL copy
// (docs/calibration.md).
var LlamaA10 = Profile{Name: "llama-7b-a10", Model: "LLaMA-7B", GPU: "NVIDIA A10 24GB GDDR6",
	Layers: 32, KVHeads: 32, HeadDim: 128, WeightBytes: llama7BWeights, GPUMemBytes: a10MemBytes,
	MaxContext:   2 * workload.LlumnixMaxLen,
	DecodeBaseMs: llama7BWeights/a10BytesPerSec*1000 + llumnixStepOverheadMs,
	DecodePerSeqMs: 2*llama7BParams/(prefillMFU*a10BF16FLOPs)*1000 +
		DecodeRefContext*float64(2*32*32*128*2)/a10BytesPerSec*1000,
	VerifyPerPosMs:      2 * llama7BParams / (prefillMFU * a10BF16FLOPs) * 1000,
	PrefillTokensPerSec: 6000,
	DecodeContext:       true, HBMBytesPerSec: a10BytesPerSec, DecodeRefContext: DecodeRefContext,
	// PCIe Gen4 x16 (the A10's): pinned copies at about 22 GB/s.
	H2DBytesPerSec: 22e9, D2HBytesPerSec: 22e9, DiskBytesPerSec: 3.8e9, EngineInit: 15 * time.Second,
	ColdDiskBytesPerSec: ColdDiskBytesPerSec, ColdEngineInit: ColdEngineInit,
	InterconnectBytesPerSec: LlumnixInterconnectBytesPerSec}

// LlumnixInterconnectBytesPerSec is Llumnix's KV copy between two LLaMA-7B
// instances over NCCL: 8 blocks (67 MB) in 6.5 ms, 32 blocks (268 MB) in
// 18.5 ms, so 16.8 GB/s at the margin; 16 GB/s.
const LlumnixInterconnectBytesPerSec = 16e9
