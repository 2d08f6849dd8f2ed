package engine

import (
	"context"
	"time"
)

// Stages load an engine's weights in the two steps progressive recovery
// keeps apart: a restarted worker reads its target's weights into host
// memory in the background while it assists a survivor with its draft,
// and only the host-to-GPU copy (HOTSWAP) stands between that and full
// service.
type Stages struct {
	// ToHost reads the weights from disk into host memory.
	ToHost func(ctx context.Context) error
	// ToDevice copies them to the device and initialises the engine; after
	// it the engine is Loaded. It runs after ToHost.
	ToDevice func(ctx context.Context) error
}

// LoadStages are the stages of an engine whose Load does everything (the
// synthetic engine has no weights to read): ToHost does nothing, ToDevice
// is Load.
func LoadStages(e Engine) Stages {
	return Stages{ToHost: func(context.Context) error { return nil }, ToDevice: e.Load}
}

// TransformerStages really read t's safetensors file into host memory
// (ToHost) and install the weights (ToDevice).
func TransformerStages(t *Transformer) Stages {
	var w *Weights
	return Stages{
		ToHost: func(ctx context.Context) error {
			var err error
			w, err = LoadWeights(t.Path())
			return err
		},
		ToDevice: func(ctx context.Context) error { return t.Install(w) },
	}
}

// HostLoadTime is the first stage of a load: the weights from disk into
// host memory (page cache) at DiskBytesPerSec, then the engine's
// initialisation (CUDA graphs, allocator), which needs no weights on the
// device yet.
func (p Profile) HostLoadTime() time.Duration {
	return time.Duration(float64(p.WeightBytes)/p.DiskBytesPerSec*float64(time.Second)) + p.EngineInit
}

// HotswapTime is the second stage: the weights from pinned host memory to
// the GPU (WeightBytes / H2DBytesPerSec), the rest of LoadTime, so that
// HostLoadTime + HotswapTime = LoadTime exactly.
func (p Profile) HotswapTime() time.Duration { return p.LoadTime() - p.HostLoadTime() }

// Paced makes each stage take at least the profile's time for it, scaled
// (HostLoadTime, HotswapTime): the stage runs, then the rest of its time
// is waited out, or until ctx ends.
func (s Stages) Paced(p Profile, scale float64) Stages {
	pace := func(f func(context.Context) error, d time.Duration) func(context.Context) error {
		return func(ctx context.Context) error {
			start := time.Now()
			if err := f(ctx); err != nil {
				return err
			}
			return sleepCtx(ctx, time.Duration(float64(d)*scale)-time.Since(start))
		}
	}
	return Stages{ToHost: pace(s.ToHost, p.HostLoadTime()), ToDevice: pace(s.ToDevice, p.HotswapTime())}
}

// sleepCtx waits d, or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
