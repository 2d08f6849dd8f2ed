// Package gpu finds the machine's NVIDIA GPUs through NVML (go-nvml) and
// watches their health (XID errors, ECC errors). Without NVML — no driver,
// as on CI and on this project's development machines — it says so once and
// reports the device that the worker's timing profile describes instead.
package gpu

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Device is one GPU.
type Device struct {
	Index       int
	Name        string
	UUID        string
	MemoryBytes uint64
	// Emulated is true for the fallback device taken from a profile.
	Emulated bool
}

// Discovery is what Discover found.
type Discovery struct {
	Devices []Device
	// NVML is true when the devices came from the driver.
	NVML bool
	// Reason says why NVML was not used, when it was not.
	Reason string
}

// HealthEvent is a GPU fault NVML reported.
type HealthEvent struct {
	UUID string
	Kind string // "xid", "ecc-double-bit" or "ecc-single-bit"
	Code uint64 // the XID, for "xid"
	Time time.Time
}

var (
	initOnce sync.Once
	initRet  nvml.Return
)

func initNVML() nvml.Return {
	initOnce.Do(func() {
		defer func() {
			// go-nvml panics on some partial installations; treat it as absent.
			if r := recover(); r != nil {
				initRet = nvml.ERROR_LIBRARY_NOT_FOUND
			}
		}()
		initRet = nvml.Init()
	})
	return initRet
}

// Discover lists the GPUs. When NVML is unavailable it returns fallback as the
// one device, marked Emulated, and the reason.
func Discover(fallback Device) Discovery {
	emulated := func(reason string) Discovery {
		fallback.Emulated = true
		return Discovery{Devices: []Device{fallback}, Reason: reason}
	}
	if ret := initNVML(); ret != nvml.SUCCESS {
		return emulated(fmt.Sprintf("NVML unavailable (%s): no NVIDIA driver; emulating %s", nvml.ErrorString(ret), fallback.Name))
	}
	n, ret := nvml.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return emulated(fmt.Sprintf("NVML device count: %s; emulating %s", nvml.ErrorString(ret), fallback.Name))
	}
	if n == 0 {
		return emulated("NVML found no GPU; emulating " + fallback.Name)
	}
	var out Discovery
	out.NVML = true
	for i := 0; i < n; i++ {
		dev, ret := nvml.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return emulated(fmt.Sprintf("NVML device %d: %s", i, nvml.ErrorString(ret)))
		}
		d := Device{Index: i}
		d.Name, _ = dev.GetName()
		d.UUID, _ = dev.GetUUID()
		if mem, ret := dev.GetMemoryInfo(); ret == nvml.SUCCESS {
			d.MemoryBytes = mem.Total
		}
		out.Devices = append(out.Devices, d)
	}
	return out
}

// Watch reports XID and ECC events of the given devices until ctx ends. It
// returns an error when NVML cannot watch (no driver, or events unsupported).
func Watch(ctx context.Context, uuids []string) (<-chan HealthEvent, error) {
	if ret := initNVML(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("gpu: NVML unavailable: %s", nvml.ErrorString(ret))
	}
	set, ret := nvml.EventSetCreate()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("gpu: create NVML event set: %s", nvml.ErrorString(ret))
	}
	byHandle := map[nvml.Device]string{}
	registered := 0
	for _, uuid := range uuids {
		dev, ret := nvml.DeviceGetHandleByUUID(uuid)
		if ret != nvml.SUCCESS {
			set.Free()
			return nil, fmt.Errorf("gpu: device %s: %s", uuid, nvml.ErrorString(ret))
		}
		want := uint64(nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError | nvml.EventTypeSingleBitEccError)
		if supported, ret := dev.GetSupportedEventTypes(); ret == nvml.SUCCESS {
			want &= supported
		}
		if want == 0 {
			continue
		}
		if ret := dev.RegisterEvents(want, set); ret != nvml.SUCCESS {
			set.Free()
			return nil, fmt.Errorf("gpu: register events on %s: %s", uuid, nvml.ErrorString(ret))
		}
		byHandle[dev] = uuid
		registered++
	}
	if registered == 0 {
		set.Free()
		return nil, fmt.Errorf("gpu: none of %d devices supports XID or ECC events", len(uuids))
	}
	ch := make(chan HealthEvent, 16)
	go func() {
		defer close(ch)
		defer set.Free()
		for ctx.Err() == nil {
			data, ret := set.Wait(500)
			if ret == nvml.ERROR_TIMEOUT {
				continue
			}
			if ret != nvml.SUCCESS {
				return
			}
			ev := HealthEvent{UUID: byHandle[data.Device], Code: data.EventData, Time: time.Now()}
			switch data.EventType {
			case nvml.EventTypeXidCriticalError:
				ev.Kind = "xid"
			case nvml.EventTypeDoubleBitEccError:
				ev.Kind = "ecc-double-bit"
			case nvml.EventTypeSingleBitEccError:
				ev.Kind = "ecc-single-bit"
			default:
				continue
			}
			select {
			case ch <- ev:
			case <-ctx.Done():
				return
			}
		}
	}()
	return ch, nil
}

// HealthSource reports GPU faults: NVML's events where an NVIDIA driver
// runs, an injected source in tests and drills.
type HealthSource interface {
	// Watch reports the faults of the devices with the given UUIDs until
	// ctx ends (then the channel closes); it fails when it cannot watch.
	Watch(ctx context.Context, uuids []string) (<-chan HealthEvent, error)
}

// NVML is the driver's XID and ECC events (Watch).
type NVML struct{}

// Watch implements HealthSource.
func (NVML) Watch(ctx context.Context, uuids []string) (<-chan HealthEvent, error) {
	return Watch(ctx, uuids)
}
