package placer

import "math/bits"

// hashTab maps uint64 keys to uint32 values: open addressing with linear
// probing over two flat arrays, no pointers. PrefixIndex keeps millions of
// page hashes in them (1,024 workers, 30,000 requests in flight), where a
// Go map's lookup cost two to three cache misses and a call each; here one
// probe is mostly one miss, and a loop of independent lookups lets the
// processor overlap them. Key 0 is held aside (the arrays use it for
// empty).
type hashTab struct {
	keys    []uint64
	vals    []uint32
	n       int
	shift   uint // 64 − log2(len(keys))
	zero    bool
	zeroVal uint32
}

func (t *hashTab) slot(k uint64) uint64 { return (k * 0x9E3779B97F4A7C15) >> t.shift }

// len is how many keys the table holds.
func (t *hashTab) len() int {
	if t.zero {
		return t.n + 1
	}
	return t.n
}

func (t *hashTab) get(k uint64) (uint32, bool) {
	if k == 0 {
		return t.zeroVal, t.zero
	}
	if t.keys == nil {
		return 0, false
	}
	mask := uint64(len(t.keys) - 1)
	for i := t.slot(k); ; i = (i + 1) & mask {
		switch t.keys[i] {
		case k:
			return t.vals[i], true
		case 0:
			return 0, false
		}
	}
}

func (t *hashTab) put(k uint64, v uint32) {
	if k == 0 {
		t.zero, t.zeroVal = true, v
		return
	}
	if 2*(t.n+1) > len(t.keys) {
		t.grow()
	}
	mask := uint64(len(t.keys) - 1)
	for i := t.slot(k); ; i = (i + 1) & mask {
		switch t.keys[i] {
		case k:
			t.vals[i] = v
			return
		case 0:
			t.keys[i], t.vals[i] = k, v
			t.n++
			return
		}
	}
}

func (t *hashTab) grow() {
	old, oldV := t.keys, t.vals
	size := max(16, 2*len(old))
	t.keys, t.vals, t.n = make([]uint64, size), make([]uint32, size), 0
	t.shift = uint(64 - bits.Len(uint(size-1)))
	for i, k := range old {
		if k != 0 {
			t.put(k, oldV[i])
		}
	}
}

// del removes k, shifting back the keys probed past it.
func (t *hashTab) del(k uint64) {
	if k == 0 {
		t.zero, t.zeroVal = false, 0
		return
	}
	if t.keys == nil {
		return
	}
	mask := uint64(len(t.keys) - 1)
	i := t.slot(k)
	for ; t.keys[i] != k; i = (i + 1) & mask {
		if t.keys[i] == 0 {
			return
		}
	}
	for j := (i + 1) & mask; t.keys[j] != 0; j = (j + 1) & mask {
		h := t.slot(t.keys[j])
		// keys[j] stays unless its home h lies cyclically outside (i, j].
		if (i < j && (h <= i || h > j)) || (i > j && h <= i && h > j) {
			t.keys[i], t.vals[i] = t.keys[j], t.vals[j]
			i = j
		}
	}
	t.keys[i] = 0
	t.n--
}

// touch loads the home slot of each key, so that the gets that follow
// find them cached: the loads do not depend on each other, and the
// processor overlaps their misses. It returns a value made of them, so
// that they are not left out.
func (t *hashTab) touch(ks []uint64) uint64 {
	if t.keys == nil {
		return 0
	}
	var sum uint64
	for _, k := range ks {
		sum += t.keys[t.slot(k)]
	}
	return sum
}

// each calls f for every key.
func (t *hashTab) each(f func(k uint64, v uint32)) {
	if t.zero {
		f(0, t.zeroVal)
	}
	for i, k := range t.keys {
		if k != 0 {
			f(k, t.vals[i])
		}
	}
}
