package workload

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"time"
)

// ErrTrace: a trace file cannot be read.
var ErrTrace = errors.New("workload: bad trace")

// azureTimeLayouts are the TIMESTAMP formats of the Azure LLM inference
// traces (2023: "2023-11-16 18:15:46.6805900"; 2024 adds a zone).
var azureTimeLayouts = []string{"2006-01-02 15:04:05.9999999", "2006-01-02 15:04:05.9999999-07:00", "2006-01-02 15:04:05"}

// ReadAzureTrace reads a CSV trace in the Azure LLM inference 2023 format
// (TIMESTAMP, ContextTokens, GeneratedTokens; other columns are ignored)
// into arrivals offset from the first, sorted by time. Prompt token ids are
// drawn from seed (the trace has lengths only).
func ReadAzureTrace(r io.Reader, seed uint64) ([]Request, error) {
	cr := csv.NewReader(r)
	cr.FieldsPerRecord = -1
	head, err := cr.Read()
	if err != nil {
		return nil, fmt.Errorf("%w: header: %v", ErrTrace, err)
	}
	col := map[string]int{}
	for i, h := range head {
		col[strings.TrimSpace(h)] = i
	}
	ti, ok1 := col["TIMESTAMP"]
	ci, ok2 := col["ContextTokens"]
	gi, ok3 := col["GeneratedTokens"]
	if !ok1 || !ok2 || !ok3 {
		return nil, fmt.Errorf("%w: the header %q lacks TIMESTAMP, ContextTokens or GeneratedTokens", ErrTrace, head)
	}
	type row struct {
		at             time.Time
		prompt, output int
	}
	var rows []row
	for line := 2; ; line++ {
		rec, err := cr.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%w: line %d: %v", ErrTrace, line, err)
		}
		if len(rec) <= max(ti, ci, gi) {
			return nil, fmt.Errorf("%w: line %d has %d fields", ErrTrace, line, len(rec))
		}
		var at time.Time
		for _, layout := range azureTimeLayouts {
			if at, err = time.Parse(layout, strings.TrimSpace(rec[ti])); err == nil {
				break
			}
		}
		if err != nil {
			return nil, fmt.Errorf("%w: line %d: TIMESTAMP %q: %v", ErrTrace, line, rec[ti], err)
		}
		p, err1 := strconv.Atoi(strings.TrimSpace(rec[ci]))
		o, err2 := strconv.Atoi(strings.TrimSpace(rec[gi]))
		if err1 != nil || err2 != nil || p < 1 || o < 1 {
			return nil, fmt.Errorf("%w: line %d: token counts %q, %q must be positive integers", ErrTrace, line, rec[ci], rec[gi])
		}
		rows = append(rows, row{at, p, o})
	}
	if len(rows) == 0 {
		return nil, fmt.Errorf("%w: no requests", ErrTrace)
	}
	sort.SliceStable(rows, func(i, j int) bool { return rows[i].at.Before(rows[j].at) })
	// Lazy: the ids are drawn again when a call needs them, not held.
	src := rand.NewPCG(seed, 0x7472616365)
	tok := func(x uint32) int32 { return 32 + int32(x%95) }
	out := make([]Request, len(rows))
	for i, r := range rows {
		out[i] = Lazy(r.at.Sub(rows[0].at), r.prompt, r.output, src, tok)
	}
	return out, nil
}

// Rescale compresses or stretches a trace's arrival times so that its mean
// rate is rate per second, and keeps the arrivals before d.
func Rescale(trace []Request, rate float64, d time.Duration) []Request {
	if len(trace) < 2 || rate <= 0 {
		return trace
	}
	span := trace[len(trace)-1].At
	if span <= 0 {
		return trace
	}
	native := float64(len(trace)-1) / span.Seconds()
	k := native / rate
	var out []Request
	for _, r := range trace {
		at := time.Duration(float64(r.At) * k)
		if at >= d {
			break
		}
		r.At = at
		out = append(out, r)
	}
	return out
}
