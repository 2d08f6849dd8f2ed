package placer

import (
	"math/rand/v2"
	"testing"
)

// TestHashTabMatchesMap: random puts, gets and deletes over a small key
// space (so probes collide and deletions shift) agree with a Go map (seed
// printed).
func TestHashTabMatchesMap(t *testing.T) {
	seed := uint64(rand.Uint32())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 3))
	var tab hashTab
	ref := map[uint64]uint32{}
	for step := range 200000 {
		k := uint64(rng.IntN(3000))
		if rng.IntN(2) == 0 {
			k *= 1 << 40 // keys that share low bits
		}
		switch rng.IntN(3) {
		case 0:
			v := rng.Uint32()
			tab.put(k, v)
			ref[k] = v
		case 1:
			tab.del(k)
			delete(ref, k)
		default:
			v, ok := tab.get(k)
			if w, wok := ref[k]; ok != wok || v != w {
				t.Fatalf("step %d: get(%d) = %d, %v; want %d, %v", step, k, v, ok, w, wok)
			}
		}
		if tab.len() != len(ref) {
			t.Fatalf("step %d: %d keys, want %d", step, tab.len(), len(ref))
		}
	}
	n := 0
	tab.each(func(k uint64, v uint32) {
		n++
		if ref[k] != v {
			t.Fatalf("each: %d = %d, want %d", k, v, ref[k])
		}
	})
	if n != len(ref) {
		t.Fatalf("each saw %d keys, want %d", n, len(ref))
	}
}
