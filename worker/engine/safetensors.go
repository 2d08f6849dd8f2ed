package engine

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
)

// ErrBadWeights: a weights file is malformed or does not match its model.
var ErrBadWeights = errors.New("engine: bad weights file")

// maxHeader bounds the JSON header of a safetensors file (as the reference
// implementation does).
const maxHeader = 100 << 20

// Tensor is one named float32 tensor.
type Tensor struct {
	Shape []int
	Data  []float32
}

type tensorInfo struct {
	Dtype       string   `json:"dtype"`
	Shape       []int    `json:"shape"`
	DataOffsets [2]int64 `json:"data_offsets"`
}

// WriteSafetensors writes tensors (float32, little-endian) and metadata in
// the safetensors format, names sorted, data contiguous.
func WriteSafetensors(path string, tensors map[string]Tensor, meta map[string]string) error {
	names := make([]string, 0, len(tensors))
	for n := range tensors {
		names = append(names, n)
	}
	sort.Strings(names)
	header := map[string]any{}
	if len(meta) > 0 {
		header["__metadata__"] = meta
	}
	var off int64
	for _, n := range names {
		t := tensors[n]
		size := int64(len(t.Data)) * 4
		header[n] = tensorInfo{Dtype: "F32", Shape: t.Shape, DataOffsets: [2]int64{off, off + size}}
		off += size
	}
	hb, err := json.Marshal(header)
	if err != nil {
		return err
	}
	for len(hb)%8 != 0 {
		hb = append(hb, ' ')
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	var lenBuf [8]byte
	binary.LittleEndian.PutUint64(lenBuf[:], uint64(len(hb)))
	if _, err := f.Write(lenBuf[:]); err != nil {
		return err
	}
	if _, err := f.Write(hb); err != nil {
		return err
	}
	buf := make([]byte, 0, 1<<16)
	for _, n := range names {
		for _, v := range tensors[n].Data {
			buf = binary.LittleEndian.AppendUint32(buf, math.Float32bits(v))
			if len(buf) >= 1<<16 {
				if _, err := f.Write(buf); err != nil {
					return err
				}
				buf = buf[:0]
			}
		}
	}
	if _, err := f.Write(buf); err != nil {
		return err
	}
	return f.Sync()
}

// ReadSafetensors reads a safetensors file of float32 tensors and says
// precisely what is wrong with a bad one.
func ReadSafetensors(path string) (map[string]Tensor, map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %v", ErrBadWeights, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, nil, err
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrBadWeights, path, fmt.Sprintf(format, args...))
	}
	var lenBuf [8]byte
	if _, err := io.ReadFull(f, lenBuf[:]); err != nil {
		return nil, nil, bad("file is %d bytes, too short for the 8-byte header length", st.Size())
	}
	hlen := binary.LittleEndian.Uint64(lenBuf[:])
	if hlen > maxHeader || int64(hlen) > st.Size()-8 {
		return nil, nil, bad("header length %d exceeds the file (%d bytes) or the %d-byte limit", hlen, st.Size(), maxHeader)
	}
	hb := make([]byte, hlen)
	if _, err := io.ReadFull(f, hb); err != nil {
		return nil, nil, bad("reading the header: %v", err)
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(hb, &raw); err != nil {
		return nil, nil, bad("header is not JSON: %v", err)
	}
	dataStart := 8 + int64(hlen)
	dataLen := st.Size() - dataStart
	meta := map[string]string{}
	type span struct {
		name       string
		begin, end int64
	}
	var spans []span
	infos := map[string]tensorInfo{}
	for name, msg := range raw {
		if name == "__metadata__" {
			if err := json.Unmarshal(msg, &meta); err != nil {
				return nil, nil, bad("__metadata__ is not a map of strings: %v", err)
			}
			continue
		}
		var ti tensorInfo
		if err := json.Unmarshal(msg, &ti); err != nil {
			return nil, nil, bad("tensor %q: %v", name, err)
		}
		if ti.Dtype != "F32" {
			return nil, nil, bad("tensor %q has dtype %s; only F32 is supported", name, ti.Dtype)
		}
		n := int64(1)
		for _, d := range ti.Shape {
			if d < 0 {
				return nil, nil, bad("tensor %q has a negative dimension in shape %v", name, ti.Shape)
			}
			n *= int64(d)
		}
		b, e := ti.DataOffsets[0], ti.DataOffsets[1]
		if b < 0 || e < b || e > dataLen {
			return nil, nil, bad("tensor %q: data offsets [%d, %d) outside the %d data bytes (file truncated?)", name, b, e, dataLen)
		}
		if e-b != n*4 {
			return nil, nil, bad("tensor %q: shape %v needs %d bytes, offsets give %d", name, ti.Shape, n*4, e-b)
		}
		infos[name] = ti
		spans = append(spans, span{name, b, e})
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i].begin < spans[j].begin })
	for i := 1; i < len(spans); i++ {
		if spans[i].begin < spans[i-1].end {
			return nil, nil, bad("tensors %q and %q overlap", spans[i-1].name, spans[i].name)
		}
	}
	data := make([]byte, dataLen)
	if _, err := io.ReadFull(f, data); err != nil {
		return nil, nil, bad("reading tensor data: %v", err)
	}
	out := make(map[string]Tensor, len(infos))
	for name, ti := range infos {
		b, e := ti.DataOffsets[0], ti.DataOffsets[1]
		vals := make([]float32, (e-b)/4)
		for i := range vals {
			vals[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[b+int64(i)*4:]))
		}
		out[name] = Tensor{Shape: ti.Shape, Data: vals}
	}
	return out, meta, nil
}
