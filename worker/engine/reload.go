package engine

import (
	"fmt"
	"time"
)

// The reload of a replacement node (docs/calibration.md, "Transfers and
// model loads"): weights from cold storage at 0.3–0.5 GB/s, taken at the
// middle, and an engine initialisation with cold compilation caches of
// 30–90 s, the middle again.
const (
	ColdDiskBytesPerSec = 0.4e9
	ColdEngineInit      = 60 * time.Second
)

// DecodeRefContext is the context per row, in tokens, at which the
// profiles' DecodePerSeqMs holds with DecodeContext: 1,400, the
// conversation trace's mean prompt and half its mean output, rounded
// (docs/calibration.md, "Step times": the fitted 0.114 ms of a Qwen3-14B
// row is a 1.4k-token KV read, 0.07 ms, and its share of compute and
// sampling).
const DecodeRefContext = 1400

// ReloadKind is how a failed worker's model comes back.
type ReloadKind int

// Reload kinds.
const (
	// ReloadWarm is a restart on the same host: the weights in the page
	// cache, the compilation caches warm (Profile.LoadTime as it is).
	ReloadWarm ReloadKind = iota
	// ReloadCold is a replacement node: cold storage and cold caches
	// (ColdDiskBytesPerSec, ColdEngineInit of the profile).
	ReloadCold
	// ReloadFixed takes Reload.Duration for the whole reload of the
	// target, its host-to-GPU copy as the profile's.
	ReloadFixed
)

// Reload is a failed worker's reload: what `-reload warm|cold|DURATION`
// says. The zero value is warm.
type Reload struct {
	Kind     ReloadKind
	Duration time.Duration // ReloadFixed
}

// ParseReload reads warm, cold or a duration (Go's syntax, like 3m).
func ParseReload(s string) (Reload, error) {
	switch s {
	case "warm", "":
		return Reload{}, nil
	case "cold":
		return Reload{Kind: ReloadCold}, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return Reload{}, fmt.Errorf("%w: reload %q: use warm, cold or a positive duration like 3m", ErrBadInput, s)
	}
	return Reload{Kind: ReloadFixed, Duration: d}, nil
}

// String is what ParseReload reads.
func (r Reload) String() string {
	switch r.Kind {
	case ReloadCold:
		return "cold"
	case ReloadFixed:
		return r.Duration.String()
	}
	return "warm"
}

// WithReload returns p with its load times as r says: warm is p; cold
// reads the weights at ColdDiskBytesPerSec and initialises in
// ColdEngineInit (each kept when 0); a fixed duration makes LoadTime that
// long, the host-to-GPU copy (HotswapTime) as it is and the host stage
// (HostLoadTime: the disk read and the initialisation, stretched alike)
// the rest. Step times do not change. It fails when the duration is not
// longer than the copy.
func (p Profile) WithReload(r Reload) (Profile, error) {
	switch r.Kind {
	case ReloadWarm:
	case ReloadCold:
		if p.ColdDiskBytesPerSec > 0 {
			p.DiskBytesPerSec = p.ColdDiskBytesPerSec
		}
		if p.ColdEngineInit > 0 {
			p.EngineInit = p.ColdEngineInit
		}
	case ReloadFixed:
		copyTime, host := p.HotswapTime(), p.HostLoadTime()
		if r.Duration <= copyTime || host <= 0 {
			return p, fmt.Errorf("%w: a reload of %s is not longer than %s's copy of its weights to the GPU (%s)", ErrBadInput, r.Duration, p.Name, copyTime)
		}
		// The host stage (the disk read, then the initialisation) takes
		// the rest, both parts stretched alike.
		f := float64(r.Duration-copyTime) / float64(host)
		p.DiskBytesPerSec /= f
		p.EngineInit = time.Duration(float64(p.EngineInit) * f)
	default:
		return p, fmt.Errorf("%w: reload kind %d", ErrBadInput, r.Kind)
	}
	return p, nil
}
