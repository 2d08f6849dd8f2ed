package plot

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"image/color"
	"math"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
)

// figures are the keys of one strategy's column that the plots read
// (bench/recovery.go's recoveryFigures, sim.Figures).
type figures struct {
	TTFTMeanMs float64 `json:"ttft_mean_ms"`
	TTFTP99Ms  float64 `json:"ttft_p99_ms"`
	RecoveryS  float64 `json:"recovery_s"`
	Series     *Series `json:"series,omitempty"`
	// ExcessVsOracle is a failed column's TTFT excess over its reference
	// as a multiple of the oracle's (issue 27; the simulator's columns).
	ExcessVsOracle *struct {
		TTFTMean *float64 `json:"ttft_mean"`
		TTFTP99  *float64 `json:"ttft_p99"`
	} `json:"excess_vs_oracle,omitempty"`
}

// oracleGoal is issue 27's goal: a column's excess at most this multiple
// of the oracle's.
const oracleGoal = 1.2

// excessGetters are the two excess_vs_oracle panels' values; ok is false
// where a column has none (the oracle, the failure-free columns, a JSON
// from before the oracle, or an oracle with no excess to divide by).
var excessGetters = []struct {
	title string
	get   func(*figures) (float64, bool)
}{
	{"TTFT mean excess vs the oracle's (x)", func(f *figures) (float64, bool) {
		if f.ExcessVsOracle == nil || f.ExcessVsOracle.TTFTMean == nil {
			return 0, false
		}
		return *f.ExcessVsOracle.TTFTMean, true
	}},
	{"TTFT p99 excess vs the oracle's (x)", func(f *figures) (float64, bool) {
		if f.ExcessVsOracle == nil || f.ExcessVsOracle.TTFTP99 == nil {
			return 0, false
		}
		return *f.ExcessVsOracle.TTFTP99, true
	}},
}

// Series is a run's time series in bins of BinS seconds: the requests
// that arrived in each bin, their mean TTFT (0 when none arrived), and the
// mean number of requests waiting at the live workers. FailAtS is when the
// failure was injected (0: none). `lumen bench recovery` writes it under
// "series" in each strategy's figures.
type Series struct {
	BinS       float64   `json:"bin_s"`
	FailAtS    float64   `json:"fail_at_s,omitempty"`
	TS         []float64 `json:"t_s"`
	Arrivals   []int     `json:"arrivals"`
	TTFTMeanMs []float64 `json:"ttft_mean_ms"`
	Waiting    []float64 `json:"waiting_mean"`
}

// paperFigure is the simulator's -figure JSON.
type paperFigure struct {
	Name   string `json:"name"`
	XLabel string `json:"x_label"`
	Points []struct {
		X       float64             `json:"x"`
		Columns map[string]*figures `json:"columns"`
	} `json:"points"`
}

func figurePanels(data []byte) ([]*plot.Plot, error) {
	var f paperFigure
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	cols := map[string]bool{}
	for _, p := range f.Points {
		for c := range p.Columns {
			cols[c] = true
		}
	}
	names := strategyOrder(sortedKeys(cols))
	var out []*plot.Plot
	for _, m := range []struct {
		title string
		get   func(*figures) float64
	}{
		{"TTFT mean (ms)", func(f *figures) float64 { return f.TTFTMeanMs }},
		{"TTFT p99 (ms)", func(f *figures) float64 { return f.TTFTP99Ms }},
		{"recovery (s)", func(f *figures) float64 { return f.RecoveryS }},
	} {
		p := newPlot(fmt.Sprintf("%s: %s", f.Name, m.title), f.XLabel, m.title)
		var lines []line
		for _, c := range names {
			l := line{name: c}
			for _, pt := range f.Points {
				if v := pt.Columns[c]; v != nil {
					l.xy = append(l.xy, plotter.XY{X: pt.X, Y: m.get(v)})
				}
			}
			lines = append(lines, l)
		}
		if err := addLines(p, lines, true); err != nil {
			return nil, err
		}
		var xs []float64
		for _, pt := range f.Points {
			xs = append(xs, pt.X)
		}
		logX(p, xs)
		out = append(out, p)
	}
	// Each failed column's excess over its reference as a multiple of the
	// oracle's, the floor at 1 and the goal dashed.
	for _, m := range excessGetters {
		var lines []line
		for _, c := range names {
			l := line{name: c}
			for _, pt := range f.Points {
				if v := pt.Columns[c]; v != nil {
					if y, ok := m.get(v); ok {
						l.xy = append(l.xy, plotter.XY{X: pt.X, Y: y})
					}
				}
			}
			if len(l.xy) > 0 {
				lines = append(lines, l)
			}
		}
		if len(lines) == 0 {
			continue // a figure from before the oracle
		}
		p := newPlot(fmt.Sprintf("%s: %s", f.Name, m.title), f.XLabel, "x the oracle's excess")
		if err := addLines(p, lines, true); err != nil {
			return nil, err
		}
		x0, x1 := f.Points[0].X, f.Points[len(f.Points)-1].X
		if err := hline(p, "the floor (oracle)", 1, x0, x1, colour(oracleName, 0)); err != nil {
			return nil, err
		}
		if err := hline(p, fmt.Sprintf("goal: %.1fx", oracleGoal), oracleGoal, x0, x1, color.Black); err != nil {
			return nil, err
		}
		var xs []float64
		for _, pt := range f.Points {
			xs = append(xs, pt.X)
		}
		logX(p, xs)
		out = append(out, p)
	}
	return out, nil
}

// oracleName is the simulator's oracle column (recoverystudy.OracleColumn).
const oracleName = "oracle"

// isSetups reports whether raw is setup → strategy → figures.
func isSetups(raw map[string]json.RawMessage) bool {
	if len(raw) == 0 {
		return false
	}
	for _, v := range raw {
		var cols map[string]map[string]json.RawMessage
		if json.Unmarshal(v, &cols) != nil || len(cols) == 0 {
			return false
		}
		for _, c := range cols {
			if c["ttft_mean_ms"] == nil {
				return false
			}
		}
	}
	return true
}

func setupsPanels(data []byte) ([]*plot.Plot, error) {
	var s map[string]map[string]*figures
	if err := json.Unmarshal(data, &s); err != nil {
		return nil, err
	}
	setups := sortedKeys(s)
	cols := map[string]bool{}
	for _, c := range s {
		for k := range c {
			cols[k] = true
		}
	}
	names := strategyOrder(sortedKeys(cols))
	var out []*plot.Plot
	for _, m := range []struct {
		title string
		get   func(*figures) float64
	}{
		{"TTFT mean (ms)", func(f *figures) float64 { return f.TTFTMeanMs }},
		{"TTFT p99 (ms)", func(f *figures) float64 { return f.TTFTP99Ms }},
		{"recovery (s)", func(f *figures) float64 { return f.RecoveryS }},
	} {
		p := newPlot(m.title+" per strategy", "setup", m.title)
		vals := make([][]float64, len(names))
		for i, c := range names {
			for _, st := range setups {
				v := 0.0
				if f := s[st][c]; f != nil {
					v = m.get(f)
				}
				vals[i] = append(vals[i], v)
			}
		}
		if err := addBars(p, setups, names, vals); err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	for _, m := range excessGetters {
		var cols []string
		for _, c := range names {
			for _, st := range setups {
				if f := s[st][c]; f != nil {
					if _, ok := m.get(f); ok {
						cols = append(cols, c)
						break
					}
				}
			}
		}
		if len(cols) == 0 {
			continue // no oracle ran
		}
		p := newPlot(m.title+" per strategy", "setup", "x the oracle's excess")
		vals := make([][]float64, len(cols))
		for i, c := range cols {
			for _, st := range setups {
				v := 0.0
				if f := s[st][c]; f != nil {
					v, _ = m.get(f)
				}
				vals[i] = append(vals[i], v)
			}
		}
		if err := addBars(p, setups, cols, vals); err != nil {
			return nil, err
		}
		if err := hline(p, fmt.Sprintf("goal: %.1fx", oracleGoal), oracleGoal, -0.5, float64(len(setups))-0.5, color.Black); err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	for _, st := range setups {
		series := map[string]*Series{}
		for c, f := range s[st] {
			if f.Series != nil {
				series[c] = f.Series
			}
		}
		if len(series) > 0 {
			ps, err := seriesPanels(st, series)
			if err != nil {
				return nil, err
			}
			out = append(out, ps...)
		}
	}
	return out, nil
}

// seriesPanels are TTFT and queue length over time, a line per strategy,
// the failure marked.
func seriesPanels(setup string, series map[string]*Series) ([]*plot.Plot, error) {
	names := strategyOrder(sortedKeys(series))
	ttft := newPlot(setup+": TTFT of the requests arriving", "time (s), 5 s moving mean", "TTFT mean (ms)")
	queue := newPlot(setup+": requests waiting at live workers", "time (s), 5 s moving mean", "queue length")
	var tl, ql []line
	failAt := 0.0
	for _, c := range names {
		s := series[c]
		if len(s.TS) != len(s.TTFTMeanMs) || len(s.TS) != len(s.Waiting) || len(s.TS) != len(s.Arrivals) {
			return nil, fmt.Errorf("%s/%s: series of unequal lengths", setup, c)
		}
		t, q := line{name: c}, line{name: c}
		// A 5 s window (the recovery rule's) ending at each bin: TTFT
		// weighted by arrivals, the queue by bins.
		w := 5
		if s.BinS > 0 {
			w = max(1, int(math.Round(5/s.BinS)))
		}
		for i, x := range s.TS {
			var sum, qsum float64
			n := 0
			lo := max(0, i-w+1)
			for j := lo; j <= i; j++ {
				sum += s.TTFTMeanMs[j] * float64(s.Arrivals[j])
				n += s.Arrivals[j]
				qsum += s.Waiting[j]
			}
			if n > 0 {
				t.xy = append(t.xy, plotter.XY{X: x, Y: sum / float64(n)})
			}
			q.xy = append(q.xy, plotter.XY{X: x, Y: qsum / float64(i-lo+1)})
		}
		tl, ql = append(tl, t), append(ql, q)
		failAt = math.Max(failAt, s.FailAtS)
	}
	for _, pl := range []struct {
		p     *plot.Plot
		lines []line
	}{{ttft, tl}, {queue, ql}} {
		if err := addLines(pl.p, pl.lines, false); err != nil {
			return nil, err
		}
		pl.p.Y.Min = 0
		if failAt > 0 {
			if err := vline(pl.p, "failure", failAt); err != nil {
				return nil, err
			}
		}
	}
	return []*plot.Plot{ttft, queue}, nil
}

// seriesCSVHeader starts the simulator's -csv output (sim.SeriesHeader).
const seriesCSVHeader = "setup,column,t_s,arrivals,ttft_mean_ms,waiting_mean"

func csvSeriesPanels(data []byte, failAtS float64) ([]*plot.Plot, error) {
	rows, err := csv.NewReader(bytes.NewReader(data)).ReadAll()
	if err != nil {
		return nil, err
	}
	bySetup := map[string]map[string]*Series{}
	for i, r := range rows[1:] {
		if len(r) != 6 {
			return nil, fmt.Errorf("line %d: %d fields, want 6", i+2, len(r))
		}
		var v [4]float64
		for j := range v {
			if v[j], err = strconv.ParseFloat(r[2+j], 64); err != nil {
				return nil, fmt.Errorf("line %d: %w", i+2, err)
			}
		}
		if bySetup[r[0]] == nil {
			bySetup[r[0]] = map[string]*Series{}
		}
		s := bySetup[r[0]][r[1]]
		if s == nil {
			s = &Series{FailAtS: failAtS}
			bySetup[r[0]][r[1]] = s
		}
		s.TS, s.Arrivals = append(s.TS, v[0]), append(s.Arrivals, int(v[1]))
		s.TTFTMeanMs, s.Waiting = append(s.TTFTMeanMs, v[2]), append(s.Waiting, v[3])
	}
	var out []*plot.Plot
	for _, st := range sortedKeys(bySetup) {
		ps, err := seriesPanels(st, bySetup[st])
		if err != nil {
			return nil, err
		}
		out = append(out, ps...)
	}
	return out, nil
}

// migrationPanels: `lumen bench migration`'s downtime against the
// sequence length, one decode step as a line; and its burst, off and on.
func migrationPanels(data []byte) ([]*plot.Plot, error) {
	var m map[string]float64
	if err := json.Unmarshal(data, &flatNumbers{m: &m}); err != nil {
		return nil, err
	}
	var lengths []int
	for k := range m {
		if n, ok := strings.CutPrefix(k, "downtime_client_ms_"); ok {
			if v, err := strconv.Atoi(n); err == nil {
				lengths = append(lengths, v)
			}
		}
	}
	sort.Ints(lengths)
	groups := make([]string, len(lengths))
	for i, n := range lengths {
		groups[i] = strconv.Itoa(n)
	}
	var out []*plot.Plot
	p := newPlot("live migration: downtime vs sequence length", "sequence length (tokens)", "ms")
	var series []string
	var vals [][]float64
	for _, c := range []struct{ key, name string }{
		{"downtime_ms_", "downtime (gateway: source's last token → destination's first)"},
		{"downtime_client_ms_", "client-visible gap"},
		{"downtime_stop_copy_ms_", "stop-and-copy"},
		{"migration_ms_", "whole migration"},
	} {
		row := make([]float64, len(lengths))
		found := false
		for i, n := range lengths {
			v, ok := m[c.key+strconv.Itoa(n)]
			row[i], found = v, found || ok
		}
		if found {
			series, vals = append(series, c.name), append(vals, row)
		}
	}
	if err := addBars(p, groups, series, vals); err != nil {
		return nil, err
	}
	if step, ok := m["decode_step_ms"]; ok && len(lengths) > 0 {
		if err := hline(p, "one decode step", step, -0.5, float64(len(lengths))-0.5, palette[3]); err != nil {
			return nil, err
		}
	}
	if rc, ok := m["recompute_ms_8192"]; ok {
		if err := hline(p, "recompute 8192 tokens instead", rc, -0.5, float64(len(lengths))-0.5, palette[1]); err != nil {
			return nil, err
		}
	}
	out = append(out, p)
	if _, ok := m["burst_p99_ttft_ms_off"]; ok {
		b := newPlot("burst: migration off vs on", "", "ms")
		groups := []string{"TTFT p99", "TTFT mean", "TPOT"}
		vals := [][]float64{
			{m["burst_p99_ttft_ms_off"], m["burst_mean_ttft_ms_off"], m["tpot_without_migration_ms"]},
			{m["burst_p99_ttft_ms_on"], m["burst_mean_ttft_ms_on"], m["tpot_during_migration_ms"]},
		}
		if err := addBars(b, groups, []string{"off", "on"}, vals); err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, nil
}

// burstPanels: `lumen sim -figure burst`, off and on per cluster and load.
func burstPanels(data []byte) ([]*plot.Plot, error) {
	var f struct {
		Points []struct {
			Workers int                        `json:"workers"`
			Load    float64                    `json:"load"`
			RawOff  map[string]json.RawMessage `json:"off"`
			RawOn   map[string]json.RawMessage `json:"on"`
		} `json:"points"`
	}
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	num := func(m map[string]json.RawMessage, k string) float64 {
		var v float64
		_ = json.Unmarshal(m[k], &v)
		return v
	}
	var groups []string
	for _, p := range f.Points {
		groups = append(groups, fmt.Sprintf("%dw@%g", p.Workers, p.Load))
	}
	var out []*plot.Plot
	for _, m := range []struct{ key, title string }{{"ttft_p99_ms", "TTFT p99 (ms)"}, {"ttft_mean_ms", "TTFT mean (ms)"}, {"throughput_tok_s", "tokens/s"}} {
		p := newPlot("burst, migration off vs on: "+m.title, "workers @ load", m.title)
		vals := [][]float64{{}, {}}
		for _, pt := range f.Points {
			vals[0] = append(vals[0], num(pt.RawOff, m.key))
			vals[1] = append(vals[1], num(pt.RawOn, m.key))
		}
		if err := addBars(p, groups, []string{"off", "on"}, vals); err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// llumnixPanels: `lumen sim -figure llumnix` (issue 23), one group of bars
// per trace and rate, one bar per column (round-robin, infaas++, lumen).
func llumnixPanels(data []byte) ([]*plot.Plot, error) {
	var f struct {
		Arrivals string `json:"arrivals"`
		Points   []struct {
			Trace   string                                `json:"trace"`
			Rate    float64                               `json:"rate_per_s"`
			Columns map[string]map[string]json.RawMessage `json:"columns"`
		} `json:"points"`
	}
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	cols := []string{"round-robin", "infaas++", "lumen"}
	var groups []string
	for _, p := range f.Points {
		groups = append(groups, fmt.Sprintf("%s@%g", p.Trace, p.Rate))
	}
	var out []*plot.Plot
	for _, m := range []struct{ key, title string }{
		{"prefill_p99_ms", "P99 prefill (s)"}, {"prefill_mean_ms", "mean prefill (s)"}, {"e2e_mean_ms", "mean end-to-end (s)"},
		{"decode_p99_ms", "P99 decode (ms)"}, {"preemption_loss_per_request_ms", "preemption loss per request (s)"},
		{"fragmentation_pct", "fragmentation (%)"},
	} {
		p := newPlot(fmt.Sprintf("llumnix (%s arrivals): %s", f.Arrivals, m.title), "trace @ req/s", m.title)
		scale := 1.0
		if strings.HasSuffix(m.title, "(s)") {
			scale = 1e-3
		}
		vals := make([][]float64, len(cols))
		for i, c := range cols {
			for _, pt := range f.Points {
				var v float64
				_ = json.Unmarshal(pt.Columns[c][m.key], &v)
				vals[i] = append(vals[i], v*scale)
			}
		}
		if err := addBars(p, groups, cols, vals); err != nil {
			return nil, err
		}
		if len(groups) > 6 {
			// Many groups: their names stand upright under the bars.
			p.X.Tick.Label.Rotation = math.Pi / 2
			p.X.Tick.Label.XAlign, p.X.Tick.Label.YAlign = -1, -0.5
		}
		out = append(out, p)
	}
	return out, nil
}

// llumnixPriorityPanels: `lumen sim -figure llumnix -priority-fraction`
// (issue 23, Llumnix's priority experiment), one group of bars per trace
// and rate, one bar per column (infaas++, lumen, lumen+priority): the
// high-priority class's prefill P99 (beside the floor no schedule can
// beat: its prompts prefilled alone) and mean, the normal class's mean
// prefill and end-to-end.
func llumnixPriorityPanels(data []byte) ([]*plot.Plot, error) {
	var f struct {
		Arrivals string  `json:"arrivals"`
		Fraction float64 `json:"priority_fraction"`
		Points   []struct {
			Trace   string                                `json:"trace"`
			Rate    float64                               `json:"rate_per_s"`
			Columns map[string]map[string]json.RawMessage `json:"columns"`
		} `json:"points"`
	}
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	cols := []string{"infaas++", "lumen", "lumen+priority"}
	var groups []string
	for _, p := range f.Points {
		groups = append(groups, fmt.Sprintf("%s@%g", p.Trace, p.Rate))
	}
	const floor = "high-priority floor"
	var out []*plot.Plot
	for _, m := range []struct{ key, title string }{
		{"high_prefill_p99_ms", "high-priority P99 prefill (ms)"}, {"high_prefill_mean_ms", "high-priority mean prefill (ms)"},
		{"normal_prefill_mean_ms", "normal mean prefill (ms)"}, {"normal_e2e_mean_ms", "normal mean end-to-end (s)"},
	} {
		p := newPlot(fmt.Sprintf("llumnix priorities (%.0f%% high, %s arrivals): %s", 100*f.Fraction, f.Arrivals, m.title), "trace @ req/s", m.title)
		scale := 1.0
		if strings.HasSuffix(m.title, "(s)") {
			scale = 1e-3
		}
		names := cols
		if m.key == "high_prefill_p99_ms" {
			names = append(slices.Clone(cols), floor)
		}
		vals := make([][]float64, len(names))
		for i, c := range names {
			for _, pt := range f.Points {
				key, col := m.key, c
				if c == floor {
					key, col = "high_prefill_p99_floor_ms", "lumen"
				}
				var v float64
				_ = json.Unmarshal(pt.Columns[col][key], &v)
				vals[i] = append(vals[i], v*scale)
			}
		}
		if err := addBars(p, groups, names, vals); err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// specKPanels: `lumen sim -figure spec-k`, tokens/s against a fixed K per
// acceptance and batch, adaptive K as a point at its mean K.
func specKPanels(data []byte) ([]*plot.Plot, error) {
	var f struct {
		Points []struct {
			Alpha     float64   `json:"alpha"`
			Batch     int       `json:"batch"`
			Fixed     []float64 `json:"fixed_tok_s"`
			Adaptive  float64   `json:"adaptive_tok_s"`
			AdaptiveK float64   `json:"adaptive_k_mean"`
		} `json:"points"`
	}
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	byAlpha := map[float64][]int{}
	for i, p := range f.Points {
		byAlpha[p.Alpha] = append(byAlpha[p.Alpha], i)
	}
	alphas := make([]float64, 0, len(byAlpha))
	for a := range byAlpha {
		alphas = append(alphas, a)
	}
	sort.Float64s(alphas)
	var out []*plot.Plot
	for _, a := range alphas {
		p := newPlot(fmt.Sprintf("speculation, acceptance %g: fixed K vs adaptive", a), "K (drafts per step)", "tokens/s")
		var lines, adaptive []line
		for _, i := range byAlpha[a] {
			pt := f.Points[i]
			l := line{name: fmt.Sprintf("batch %d, fixed K", pt.Batch)}
			for k, v := range pt.Fixed {
				l.xy = append(l.xy, plotter.XY{X: float64(k), Y: v})
			}
			lines = append(lines, l)
			adaptive = append(adaptive, line{name: fmt.Sprintf("batch %d, adaptive", pt.Batch), xy: plotter.XYs{{X: pt.AdaptiveK, Y: pt.Adaptive}}})
		}
		if err := addLines(p, lines, true); err != nil {
			return nil, err
		}
		for i, l := range adaptive {
			sc, err := plotter.NewScatter(l.xy)
			if err != nil {
				return nil, err
			}
			sc.Color, sc.Radius = colour(lines[i].name, i), 6
			p.Add(sc)
			legend(p, l.name, sc)
		}
		p.Y.Min = 0
		out = append(out, p)
	}
	return out, nil
}

// flatKey is a flat key read as NAME UNIT [_N]: read_p99_ms,
// gateway_ttft_p99_ms_100 (N: the streams, the sequence length).
var flatKey = regexp.MustCompile(`^(.+?)(_per_s|_ms|_s|_pct)(?:_(\d+))?$`)

// flatPanels plots any flat object of numbers (`lumen bench controller`,
// gateway, pacing): bars by the unit the key ends with; keys that end with
// a number after their unit (gateway_ttft_p99_ms_100) as groups by that
// number, a bar per name.
func flatPanels(data []byte) ([]*plot.Plot, error) {
	var m map[string]float64
	if err := json.Unmarshal(data, &flatNumbers{m: &m}); err != nil {
		return nil, err
	}
	units := []struct{ suffix, title string }{{"_per_s", "per second"}, {"_ms", "milliseconds"}, {"_s", "seconds"}, {"_pct", "percent"}}
	plain := map[string]map[string]float64{}           // unit → name → value
	grouped := map[string]map[string]map[int]float64{} // unit → name → N → value
	for k, v := range m {
		g := flatKey.FindStringSubmatch(k)
		if g == nil {
			continue
		}
		name, unit := g[1], g[2]
		if g[3] == "" {
			if plain[unit] == nil {
				plain[unit] = map[string]float64{}
			}
			plain[unit][name] = v
			continue
		}
		n, _ := strconv.Atoi(g[3])
		if grouped[unit] == nil {
			grouped[unit] = map[string]map[int]float64{}
		}
		if grouped[unit][name] == nil {
			grouped[unit][name] = map[int]float64{}
		}
		grouped[unit][name][n] = v
	}
	var out []*plot.Plot
	for _, u := range units {
		if vals := plain[u.suffix]; len(vals) > 0 {
			names := sortedKeys(vals)
			p := newPlot(u.title, "", u.title)
			v := make([]float64, len(names))
			for j, k := range names {
				v[j] = vals[k]
			}
			b, err := plotter.NewBarChart(plotter.Values(v), 14)
			if err != nil {
				return nil, err
			}
			b.Color, b.LineStyle.Width = palette[0], 0
			p.Add(b)
			p.NominalX(names...)
			p.X.Min, p.X.Max = -0.5, float64(len(names))-0.5
			noVerticalGrid(p)
			p.X.Tick.Label.Rotation = math.Pi / 6
			p.X.Tick.Label.XAlign, p.X.Tick.Label.YAlign = -1, -0.5
			p.Y.Min = 0
			out = append(out, p)
		}
		if series := grouped[u.suffix]; len(series) > 0 {
			ns := map[int]bool{}
			for _, byN := range series {
				for n := range byN {
					ns[n] = true
				}
			}
			var sortedN []int
			for n := range ns {
				sortedN = append(sortedN, n)
			}
			sort.Ints(sortedN)
			groups := make([]string, len(sortedN))
			for i, n := range sortedN {
				groups[i] = strconv.Itoa(n)
			}
			names := sortedKeys(series)
			vals := make([][]float64, len(names))
			for i, name := range names {
				for _, n := range sortedN {
					vals[i] = append(vals[i], series[name][n])
				}
			}
			p := newPlot(u.title+", by the number each key ends with", "", u.title)
			if err := addBars(p, groups, names, vals); err != nil {
				return nil, err
			}
			out = append(out, p)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: no key ends with _per_s, _ms, _s or _pct (and an optional _N)", ErrUnknown)
	}
	return out, nil
}

// flatNumbers decodes the numeric fields of an object, skipping others.
type flatNumbers struct{ m *map[string]float64 }

func (f *flatNumbers) UnmarshalJSON(b []byte) error {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return err
	}
	*f.m = map[string]float64{}
	for k, v := range raw {
		var x float64
		if json.Unmarshal(v, &x) == nil {
			(*f.m)[k] = x
		}
	}
	return nil
}

// degradationPanels: `lumen sim -figure degradation`, stop-and-restart's
// degradation (affected requests over the failure-free run's same
// requests) against the load, a line per setup and reload; the seed's
// TTFT and TPOT degradation as dashed lines.
func degradationPanels(data []byte) ([]*plot.Plot, error) {
	var f struct {
		PaperTTFTX float64 `json:"paper_ttft_x"`
		PaperTPOTX float64 `json:"paper_tpot_x"`
		Points     []struct {
			Setup            string  `json:"setup"`
			Load             float64 `json:"load"`
			Reload           string  `json:"reload"`
			ReloadS          float64 `json:"reload_s"`
			TTFTMeanX        float64 `json:"ttft_mean_x"`
			TTFTP99X         float64 `json:"ttft_p99_x"`
			TPOTMeanX        float64 `json:"tpot_mean_x"`
			ClusterRecoveryS float64 `json:"cluster_recovery_s"`
		} `json:"points"`
	}
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	if len(f.Points) == 0 {
		return nil, fmt.Errorf("%w: a degradation figure without points", ErrUnknown)
	}
	// A line per setup and reload, in the order of the points; the
	// reload's length in its name, the x axis being the load.
	var names []string
	index := map[string]int{}
	lineOf := make([]int, len(f.Points))
	lo, hi := math.Inf(1), math.Inf(-1)
	for i, p := range f.Points {
		name := fmt.Sprintf("%s, %s reload (%.0f s)", p.Setup, p.Reload, p.ReloadS)
		k, ok := index[name]
		if !ok {
			k = len(names)
			index[name], names = k, append(names, name)
		}
		lineOf[i] = k
		lo, hi = math.Min(lo, p.Load), math.Max(hi, p.Load)
	}
	if hi == lo {
		lo, hi = lo-0.05, hi+0.05
	}
	const x = "offered load (fraction of saturated throughput)"
	var out []*plot.Plot
	for _, m := range []struct {
		title, unit string
		paper       float64
		get         func(i int) float64
	}{
		{"stop-and-restart: TTFT mean, affected / failure-free", "x", f.PaperTTFTX, func(i int) float64 { return f.Points[i].TTFTMeanX }},
		{"stop-and-restart: TPOT mean, affected / failure-free", "x", f.PaperTPOTX, func(i int) float64 { return f.Points[i].TPOTMeanX }},
		{"stop-and-restart: TTFT p99, affected / failure-free", "x", 0, func(i int) float64 { return f.Points[i].TTFTP99X }},
		{"stop-and-restart: cluster recovery", "s", 0, func(i int) float64 { return f.Points[i].ClusterRecoveryS }},
	} {
		p := newPlot(m.title, x, m.unit)
		lines := make([]line, len(names))
		for i, n := range names {
			lines[i].name = n
		}
		for i, pt := range f.Points {
			lines[lineOf[i]].xy = append(lines[lineOf[i]].xy, plotter.XY{X: pt.Load, Y: m.get(i)})
		}
		if err := addLines(p, lines, true); err != nil {
			return nil, err
		}
		if m.paper > 0 {
			if err := hline(p, fmt.Sprintf("the seed: %.1fx", m.paper), m.paper, lo, hi, color.Black); err != nil {
				return nil, err
			}
		}
		// Ratios from 1x to tens of x: on a log scale, the lines near the
		// seed's stay apart.
		ymin, ymax := math.Inf(1), 0.0
		for i := range f.Points {
			ymin, ymax = math.Min(ymin, m.get(i)), math.Max(ymax, m.get(i))
		}
		if m.unit == "x" && ymin > 0 && ymax/ymin >= 8 {
			p.Y.Scale, p.Y.Tick.Marker = plot.LogScale{}, plot.LogTicks{Prec: -1}
		} else {
			p.Y.Min = 0
		}
		out = append(out, p)
	}
	return out, nil
}

// prefixPanels: `lumen sim -figure prefix` (issue 25), per workload the
// TTFT p90 and the output tokens/s against the offered rate, freeness
// alone against prefix-aware placement.
func prefixPanels(data []byte) ([]*plot.Plot, error) {
	var f struct {
		Runs []struct {
			Workload string `json:"workload"`
			Points   []struct {
				Rate    float64                       `json:"rate"`
				Columns map[string]map[string]float64 `json:"columns"`
			} `json:"points"`
		} `json:"runs"`
	}
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	cols := []string{"freeness", "prefix-aware"}
	var out []*plot.Plot
	for _, r := range f.Runs {
		for _, m := range []struct{ key, title string }{
			{"ttft_p90_ms", "TTFT p90 (s)"}, {"output_tokens_s", "output tokens/s"}, {"cache_hit_pct", "cache hits (%)"},
		} {
			p := newPlot(fmt.Sprintf("prefix caching, %s: %s", r.Workload, m.title), "offered requests/s", m.title)
			scale := 1.0
			if strings.HasSuffix(m.title, "(s)") {
				scale = 1e-3
			}
			var lines []line
			for _, c := range cols {
				l := line{name: c}
				for _, pt := range r.Points {
					if v, ok := pt.Columns[c][m.key]; ok {
						l.xy = append(l.xy, plotter.XY{X: pt.Rate, Y: v * scale})
					}
				}
				lines = append(lines, l)
			}
			if err := addLines(p, lines, true); err != nil {
				return nil, err
			}
			out = append(out, p)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: a prefix figure with no runs", ErrUnknown)
	}
	return out, nil
}

// llumnixBenchPanels: `lumen bench migration -phases llumnix` (issue 23),
// the real processes beside the simulator on the same arrivals: each
// latency for INFaaS++ (migration off) and lumen.
func llumnixBenchPanels(data []byte) ([]*plot.Plot, error) {
	var f map[string]float64
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	series := []string{"infaas++ (real)", "lumen (real)", "infaas++ (sim)", "lumen (sim)"}
	keys := []string{"prefill_p99_ms_infaas", "prefill_p99_ms_lumen", "sim_prefill_p99_ms_infaas", "sim_prefill_p99_ms_lumen"}
	var out []*plot.Plot
	for _, m := range []struct{ key, title string }{
		{"prefill_p99_ms", "P99 prefill (s)"}, {"prefill_mean_ms", "mean prefill (s)"}, {"e2e_mean_ms", "mean end-to-end (s)"}, {"decode_p99_ms", "P99 decode (s)"},
	} {
		p := newPlot(fmt.Sprintf("llumnix phase, %g workers at %g req/s: %s", f["llumnix_workers"], f["llumnix_rate_per_s"], m.title), "", m.title)
		vals := make([][]float64, len(series))
		for i, k := range keys {
			k = strings.Replace(k, "prefill_p99_ms", m.key, 1)
			vals[i] = []float64{f[k] / 1e3}
		}
		if err := addBars(p, []string{m.key}, series, vals); err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, nil
}

// cellsPanels: `lumen sim -figure cells` (issue 26), per cell count the
// TTFT and the busiest cell's Raft writes against one quorum's measured
// placements a second.
func cellsPanels(data []byte) ([]*plot.Plot, error) {
	var f struct {
		Workers int     `json:"workers"`
		Quiet   float64 `json:"quorum_placements_per_s"`
		Loaded  float64 `json:"loaded_quorum_placements_per_s"`
		Runs    []struct {
			Cells    int     `json:"cells"`
			Mean     float64 `json:"ttft_mean_ms"`
			P99      float64 `json:"ttft_p99_ms"`
			Dispatch float64 `json:"max_cell_dispatch_per_s"`
			Commands float64 `json:"max_cell_commands_per_s"`
		} `json:"runs"`
	}
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, err
	}
	if len(f.Runs) == 0 {
		return nil, fmt.Errorf("%w: a cells figure with no runs", ErrUnknown)
	}
	var groups []string
	var mean, p99, disp, cmds, quiet, loaded []float64
	for _, r := range f.Runs {
		groups = append(groups, fmt.Sprintf("%d cells", r.Cells))
		mean, p99 = append(mean, r.Mean), append(p99, r.P99)
		disp, cmds = append(disp, r.Dispatch), append(cmds, r.Commands)
		quiet, loaded = append(quiet, f.Quiet), append(loaded, f.Loaded)
	}
	ttft := newPlot(fmt.Sprintf("cells, %d workers: TTFT", f.Workers), "", "ms")
	if err := addBars(ttft, groups, []string{"TTFT mean", "TTFT p99"}, [][]float64{mean, p99}); err != nil {
		return nil, err
	}
	raft := newPlot(fmt.Sprintf("cells, %d workers: the busiest cell's writes", f.Workers), "", "per second")
	if err := addBars(raft, groups, []string{"Dispatch", "all commands", "one quorum's placements (quiet)", "one quorum's placements (loaded)"},
		[][]float64{disp, cmds, quiet, loaded}); err != nil {
		return nil, err
	}
	return []*plot.Plot{ttft, raft}, nil
}
