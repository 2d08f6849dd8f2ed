package gpu

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"
)

var h100 = Device{Name: "NVIDIA H100 80GB HBM3", MemoryBytes: 80e9}

// TestDiscover checks both paths: with a driver, real devices; without, the
// profile's device and a reason that says so.
func TestDiscover(t *testing.T) {
	d := Discover(h100)
	if len(d.Devices) == 0 {
		t.Fatal("no device at all")
	}
	if !d.NVML {
		if !d.Devices[0].Emulated || d.Devices[0].Name != h100.Name || !strings.Contains(d.Reason, "emulating") {
			t.Fatalf("fallback %+v", d)
		}
		if _, err := Watch(context.Background(), nil); err == nil {
			t.Fatal("Watch without NVML did not fail")
		}
		return
	}
	for _, dev := range d.Devices {
		if dev.Emulated || dev.UUID == "" || !strings.HasPrefix(dev.UUID, "GPU-") || dev.MemoryBytes == 0 || dev.Name == "" {
			t.Fatalf("NVML device %+v", dev)
		}
		t.Logf("GPU %d: %s %s, %d MiB", dev.Index, dev.Name, dev.UUID, dev.MemoryBytes>>20)
	}
}

// TestNVMLWatch needs a GPU: it registers for XID and ECC events and waits a
// moment (a healthy GPU reports none).
func TestNVMLWatch(t *testing.T) {
	d := Discover(h100)
	if !d.NVML {
		t.Skipf("no NVIDIA driver on this machine (%s); the NVML path runs where a GPU exists", d.Reason)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var uuids []string
	for _, dev := range d.Devices {
		uuids = append(uuids, dev.UUID)
	}
	ch, err := Watch(ctx, uuids)
	if err != nil {
		if os.Getenv("LUMEN_REQUIRE_NVML_EVENTS") != "" {
			t.Fatal(err)
		}
		t.Skipf("NVML events not available here: %v", err)
	}
	for ev := range ch {
		t.Logf("health event: %+v", ev)
	}
}

// TestFaultFile: each complete line appended to the file is a fault, in
// order; lines that are not faults are skipped.
func TestFaultFile(t *testing.T) {
	path := t.TempDir() + "/faults"
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := FaultFile{Path: path, Poll: 5 * time.Millisecond}.Watch(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("xid 79 GPU-1\nnonsense\necc-double-bit\nxid 4"), 0o644); err != nil {
		t.Fatal(err)
	}
	want := []HealthEvent{{Kind: "xid", Code: 79, UUID: "GPU-1"}, {Kind: "ecc-double-bit"}}
	for _, w := range want {
		ev := <-ch
		if ev.Kind != w.Kind || ev.Code != w.Code || ev.UUID != w.UUID {
			t.Fatalf("fault %+v, want %+v", ev, w)
		}
	}
	select {
	case ev := <-ch:
		t.Fatalf("a line without its newline was read: %+v", ev)
	case <-time.After(30 * time.Millisecond):
	}
	if _, err := ParseFault("xid"); err == nil {
		t.Fatal("an xid without its number parsed")
	}
	cancel()
	for range ch {
	}
}
