package engine

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"

	"github.com/lumen-project/lumen/tokenizer"
)

// Weights are a model's parameters. Matrices are stored [in][out], row-major,
// so a batched product reads each weight row once for every row of the batch.
type Weights struct {
	Config ModelConfig
	Embed  []float32 // [vocab][hidden]
	Layers []LayerWeights
	Norm   []float32 // [hidden]
	LMHead []float32 // [hidden][vocab]; nil when embeddings are tied
}

// LayerWeights are one transformer block's parameters.
type LayerWeights struct {
	AttnNorm []float32 // [hidden]
	WQ       []float32 // [hidden][heads*head_dim]
	WK       []float32 // [hidden][kv_heads*head_dim]
	WV       []float32 // [hidden][kv_heads*head_dim]
	WO       []float32 // [heads*head_dim][hidden]
	MLPNorm  []float32 // [hidden]
	WGate    []float32 // [hidden][ffn]
	WUp      []float32 // [hidden][ffn]
	WDown    []float32 // [ffn][hidden]
}

// shapes lists every tensor a model with config c must have.
func shapes(c ModelConfig) map[string][]int {
	h, q, kv := c.Hidden, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	m := map[string][]int{"embed.weight": {c.Vocab, h}, "norm.weight": {h}}
	if !c.TiedEmbeddings {
		m["lm_head.weight"] = []int{h, c.Vocab}
	}
	for i := 0; i < c.Layers; i++ {
		p := fmt.Sprintf("layers.%d.", i)
		m[p+"attn_norm.weight"] = []int{h}
		m[p+"wq.weight"] = []int{h, q}
		m[p+"wk.weight"] = []int{h, kv}
		m[p+"wv.weight"] = []int{h, kv}
		m[p+"wo.weight"] = []int{q, h}
		m[p+"mlp_norm.weight"] = []int{h}
		m[p+"w_gate.weight"] = []int{h, c.FFN}
		m[p+"w_up.weight"] = []int{h, c.FFN}
		m[p+"w_down.weight"] = []int{c.FFN, h}
	}
	return m
}

func (w *Weights) tensors() map[string]*[]float32 {
	m := map[string]*[]float32{"embed.weight": &w.Embed, "norm.weight": &w.Norm}
	if !w.Config.TiedEmbeddings {
		m["lm_head.weight"] = &w.LMHead
	}
	for i := range w.Layers {
		l := &w.Layers[i]
		p := fmt.Sprintf("layers.%d.", i)
		m[p+"attn_norm.weight"], m[p+"wq.weight"], m[p+"wk.weight"] = &l.AttnNorm, &l.WQ, &l.WK
		m[p+"wv.weight"], m[p+"wo.weight"], m[p+"mlp_norm.weight"] = &l.WV, &l.WO, &l.MLPNorm
		m[p+"w_gate.weight"], m[p+"w_up.weight"], m[p+"w_down.weight"] = &l.WGate, &l.WUp, &l.WDown
	}
	return m
}

// Bytes is the size of the parameters in memory.
func (w *Weights) Bytes() int64 { return w.Config.Params() * 4 }

// Save writes the weights as safetensors with the config in the metadata.
func (w *Weights) Save(path string) error {
	sh := shapes(w.Config)
	out := map[string]Tensor{}
	for name, p := range w.tensors() {
		out[name] = Tensor{Shape: sh[name], Data: *p}
	}
	return WriteSafetensors(path, out, map[string]string{"format": "lumen", "config": w.Config.marshal()})
}

// LoadWeights reads a safetensors file written for lumen and checks every
// tensor's name, dtype and shape against the config in its metadata.
func LoadWeights(path string) (*Weights, error) {
	ts, meta, err := ReadSafetensors(path)
	if err != nil {
		return nil, err
	}
	cfgJSON, ok := meta["config"]
	if !ok {
		return nil, fmt.Errorf("%w: %s: no \"config\" in __metadata__ (not written by lumen model init?)", ErrBadWeights, path)
	}
	var c ModelConfig
	if err := json.Unmarshal([]byte(cfgJSON), &c); err != nil {
		return nil, fmt.Errorf("%w: %s: config metadata: %v", ErrBadWeights, path, err)
	}
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrBadWeights, path, err)
	}
	w := &Weights{Config: c, Layers: make([]LayerWeights, c.Layers)}
	want := shapes(c)
	var missing, extra []string
	for name := range want {
		if _, ok := ts[name]; !ok {
			missing = append(missing, name)
		}
	}
	for name := range ts {
		if _, ok := want[name]; !ok {
			extra = append(extra, name)
		}
	}
	sort.Strings(missing)
	sort.Strings(extra)
	if len(missing) > 0 {
		return nil, fmt.Errorf("%w: %s: missing tensors for %s: %v", ErrBadWeights, path, c.Name, missing)
	}
	if len(extra) > 0 {
		return nil, fmt.Errorf("%w: %s: unexpected tensors for %s: %v", ErrBadWeights, path, c.Name, extra)
	}
	for name, p := range w.tensors() {
		t := ts[name]
		if fmt.Sprint(t.Shape) != fmt.Sprint(want[name]) {
			return nil, fmt.Errorf("%w: %s: tensor %s has shape %v, config %s needs %v", ErrBadWeights, path, name, t.Shape, c.Name, want[name])
		}
		*p = t.Data
	}
	return w, nil
}

// InitWeights makes seeded random weights for c. Layers from residualFrom on
// write into the residual stream at residualScale of the usual size, so a
// draft made of the layers before residualFrom agrees with the target on
// most next tokens (early-exit speculation).
func InitWeights(c ModelConfig, seed uint64, residualFrom int, residualScale float32) *Weights {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	normal := func(n int, std float64) []float32 {
		out := make([]float32, n)
		for i := range out {
			out[i] = float32(rng.NormFloat64() * std)
		}
		return out
	}
	ones := func(n int) []float32 {
		out := make([]float32, n)
		for i := range out {
			out[i] = 1
		}
		return out
	}
	h, q, kv := c.Hidden, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	w := &Weights{Config: c, Embed: normal(c.Vocab*h, 1), Norm: ones(h)}
	for i := 0; i < c.Layers; i++ {
		out := 1.0
		if i >= residualFrom {
			out = float64(residualScale)
		}
		w.Layers = append(w.Layers, LayerWeights{
			AttnNorm: ones(h),
			WQ:       normal(h*q, 1/math.Sqrt(float64(h))),
			WK:       normal(h*kv, 1/math.Sqrt(float64(h))),
			WV:       normal(h*kv, 1/math.Sqrt(float64(h))),
			WO:       normal(q*h, out/math.Sqrt(float64(q))),
			MLPNorm:  ones(h),
			WGate:    normal(h*c.FFN, 1/math.Sqrt(float64(h))),
			WUp:      normal(h*c.FFN, 1/math.Sqrt(float64(h))),
			WDown:    normal(c.FFN*h, out/math.Sqrt(float64(c.FFN))),
		})
	}
	if !c.TiedEmbeddings {
		w.LMHead = normal(h*c.Vocab, 1/math.Sqrt(float64(h)))
	}
	return w
}

// Truncated returns a model made of w's first n layers (a draft).
func (w *Weights) Truncated(name string, n int) *Weights {
	c := w.Config
	c.Name, c.Layers = name, n
	return &Weights{Config: c, Embed: w.Embed, Layers: w.Layers[:n], Norm: w.Norm, LMHead: w.LMHead}
}

// Model file names inside a model directory.
const (
	TargetFile = "target.safetensors"
	DraftFile  = "draft.safetensors"
)

// Residual scale of the layers the draft skips; InitModel's default.
const draftResidualScale = 0.35

// InitModel writes a seeded target model and its draft (the target's first
// layers, same vocabulary) into dir.
func InitModel(dir string, seed uint64) (target, draft *Weights, err error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, nil, err
	}
	tc, dc := DefaultTarget(), DefaultDraft()
	target = InitWeights(tc, seed, dc.Layers, draftResidualScale)
	draft = target.Truncated(dc.Name, dc.Layers)
	if err := target.Save(filepath.Join(dir, TargetFile)); err != nil {
		return nil, nil, err
	}
	if err := draft.Save(filepath.Join(dir, DraftFile)); err != nil {
		return nil, nil, err
	}
	return target, draft, nil
}

// DefaultModelDir is where the default model lives: $LUMEN_MODEL_DIR, or
// lumen/models/default under the user's cache directory.
func DefaultModelDir() string {
	if d := os.Getenv("LUMEN_MODEL_DIR"); d != "" {
		return d
	}
	base, err := os.UserCacheDir()
	if err != nil {
		base = os.TempDir()
	}
	return filepath.Join(base, "lumen", "models", "default")
}

// DefaultSeed seeds the default model.
const DefaultSeed = 20260601

// EnsureModel makes the default model in dir when its files are absent (no
// download, ever) and returns the target's path.
func EnsureModel(dir string) (string, error) {
	path := filepath.Join(dir, TargetFile)
	if _, err := os.Stat(path); err == nil {
		return path, nil
	}
	if _, _, err := InitModel(dir, DefaultSeed); err != nil {
		return "", fmt.Errorf("engine: make the default model in %s: %w", dir, err)
	}
	return path, nil
}

// DraftAgreement decodes prompts greedily with the target in dir and returns
// how often the draft, given the same prefix, predicts the target's next
// token.
func DraftAgreement(dir string, prompts, tokens int) (float64, error) {
	target, err := NewTransformer(TransformerConfig{Path: filepath.Join(dir, TargetFile), Pages: 1024})
	if err != nil {
		return 0, err
	}
	draft, err := NewTransformer(TransformerConfig{Path: filepath.Join(dir, DraftFile), Pages: 1024})
	if err != nil {
		return 0, err
	}
	ctx := context.Background()
	var tk tokenizer.Tokenizer
	agree, total := 0, 0
	for i := 0; i < prompts; i++ {
		prompt := tk.Encode(fmt.Sprintf("prompt %d: the cluster keeps serving", i))
		seq := SeqID(i + 1)
		tOut, err := target.Forward(ctx, []Chunk{{Seq: seq, Tokens: prompt, Sample: 1}})
		if err != nil {
			return 0, err
		}
		dOut, err := draft.Forward(ctx, []Chunk{{Seq: seq, Tokens: prompt, Sample: 1}})
		if err != nil {
			return 0, err
		}
		for n := 0; n < tokens; n++ {
			next := tOut[0][0]
			if dOut[0][0] == next {
				agree++
			}
			total++
			if tOut, err = target.Forward(ctx, []Chunk{{Seq: seq, Tokens: []int32{next}, Sample: 1}}); err != nil {
				return 0, err
			}
			if dOut, err = draft.Forward(ctx, []Chunk{{Seq: seq, Tokens: []int32{next}, Sample: 1}}); err != nil {
				return 0, err
			}
		}
		target.Release(seq)
		draft.Release(seq)
	}
	return float64(agree) / float64(total), nil
}
