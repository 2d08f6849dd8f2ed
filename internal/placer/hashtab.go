package placer

import "math/bits"

// hashTab maps uint64 keys to uint32 values: open addressing with linear
// probing over one flat array of entries, no pointers. PrefixIndex keeps
// millions of page hashes in them (1,024 workers, 30,000 requests in
// flight), where a Go map's lookup cost two to three cache misses and a
// call each; here a probe is mostly one cache line (key and value side by
// side), and a loop of independent lookups (touch) lets the processor
// overlap the misses. Key 0 is held aside (the array uses it for empty).
// The table grows past three quarters full.
type hashTab struct {
	ents    []hashEnt
	n       int
	shift   uint // 64 − log2(len(ents))
	zero    bool
	zeroVal uint32
}

type hashEnt struct {
	k uint64
	v uint32
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
	if t.ents == nil {
		return 0, false
	}
	mask := uint64(len(t.ents) - 1)
	for i := t.slot(k); ; i = (i + 1) & mask {
		switch e := &t.ents[i]; e.k {
		case k:
			return e.v, true
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
	if 4*(t.n+1) > 3*len(t.ents) {
		t.grow()
	}
	mask := uint64(len(t.ents) - 1)
	for i := t.slot(k); ; i = (i + 1) & mask {
		switch e := &t.ents[i]; e.k {
		case k:
			e.v = v
			return
		case 0:
			e.k, e.v = k, v
			t.n++
			return
		}
	}
}

func (t *hashTab) grow() {
	old := t.ents
	size := max(16, 2*len(old))
	t.ents, t.n = make([]hashEnt, size), 0
	t.shift = uint(64 - bits.Len(uint(size-1)))
	for _, e := range old {
		if e.k != 0 {
			t.put(e.k, e.v)
		}
	}
}

// del removes k, shifting back the keys probed past it.
func (t *hashTab) del(k uint64) {
	if k == 0 {
		t.zero, t.zeroVal = false, 0
		return
	}
	if t.ents == nil {
		return
	}
	mask := uint64(len(t.ents) - 1)
	i := t.slot(k)
	for ; t.ents[i].k != k; i = (i + 1) & mask {
		if t.ents[i].k == 0 {
			return
		}
	}
	for j := (i + 1) & mask; t.ents[j].k != 0; j = (j + 1) & mask {
		h := t.slot(t.ents[j].k)
		// ents[j] stays unless its home h lies cyclically outside (i, j].
		if (i < j && (h <= i || h > j)) || (i > j && h <= i && h > j) {
			t.ents[i] = t.ents[j]
			i = j
		}
	}
	t.ents[i] = hashEnt{}
	t.n--
}

// touch loads the home slot of each key, so that the gets that follow
// find them cached: the loads do not depend on each other, and the
// processor overlaps their misses. It returns a value made of them, so
// that they are not left out.
func (t *hashTab) touch(ks []uint64) uint64 {
	if t.ents == nil {
		return 0
	}
	var sum uint64
	for _, k := range ks {
		sum += t.ents[t.slot(k)].k
	}
	return sum
}

// each calls f for every key.
func (t *hashTab) each(f func(k uint64, v uint32)) {
	if t.zero {
		f(0, t.zeroVal)
	}
	for _, e := range t.ents {
		if e.k != 0 {
			f(e.k, e.v)
		}
	}
}
