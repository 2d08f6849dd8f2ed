package plot

import (
	"encoding/json"
	"fmt"
	"regexp"
	"sort"
	"strconv"

	"gonum.org/v1/plot"
)

// replicaRun names one run of issue 24's failure-domain study
// (bench-results/sim-issue24-*.json): failure pattern, replication factor
// R and seed, e.g. "nodeplus1-r2-s3".
var replicaRun = regexp.MustCompile(`^(.+)-r(\d+)-s(\d+)$`)

// replicaPatterns orders and labels the study's failure patterns; others
// follow in name order under their own name.
var replicaPatterns = map[string]struct {
	rank  int
	label string
}{
	"one": {0, "1 worker"}, "two": {1, "2 workers"}, "node-blind": {2, "node, blind"},
	"node-aware": {3, "node"}, "nodeplus1": {4, "node+1"},
}

// isReplicas: a setups-shaped JSON (run → column → figures) whose every
// run is named pattern-rR-sS.
func isReplicas(raw map[string]json.RawMessage) bool {
	if !isSetups(raw) {
		return false
	}
	for k := range raw {
		if !replicaRun.MatchString(k) {
			return false
		}
	}
	return true
}

type replicaFigures struct {
	TTFTMeanMs       float64  `json:"ttft_mean_ms"`
	RestoredFraction *float64 `json:"restored_fraction"`
	LiveFraction     *float64 `json:"checkpoint_live_fraction"`
}

// replicasPanels plots, per failure pattern and R (the groups, means over
// the seeds): the fraction of the interrupted requests restored from a
// checkpoint (lumen and DéjàVu's fixed-checkpoint), the fraction whose
// plan found a live copy, the TTFT mean of lumen, stop-and-restart and
// fixed-checkpoint, and lumen's TTFT relative to stop-and-restart's.
func replicasPanels(data []byte) ([]*plot.Plot, error) {
	var runs map[string]map[string]*replicaFigures
	if err := json.Unmarshal(data, &runs); err != nil {
		return nil, err
	}
	type group struct {
		pattern string
		r       int
	}
	// sums[group][column][metric] over the seeds, with their counts.
	type acc struct{ sum, n [3]float64 }
	sums := map[group]map[string]*acc{}
	for name, cols := range runs {
		m := replicaRun.FindStringSubmatch(name)
		r, err := strconv.Atoi(m[2])
		if err != nil {
			return nil, fmt.Errorf("run %s: %w", name, err)
		}
		g := group{m[1], r}
		if sums[g] == nil {
			sums[g] = map[string]*acc{}
		}
		for c, f := range cols {
			if f == nil {
				continue
			}
			a := sums[g][c]
			if a == nil {
				a = &acc{}
				sums[g][c] = a
			}
			for k, v := range []*float64{f.RestoredFraction, f.LiveFraction, &f.TTFTMeanMs} {
				if v != nil {
					a.sum[k] += *v
					a.n[k]++
				}
			}
		}
	}
	groups := make([]group, 0, len(sums))
	for g := range sums {
		groups = append(groups, g)
	}
	rank := func(p string) int {
		if x, ok := replicaPatterns[p]; ok {
			return x.rank
		}
		return len(replicaPatterns)
	}
	sort.Slice(groups, func(i, j int) bool {
		a, b := groups[i], groups[j]
		if rank(a.pattern) != rank(b.pattern) {
			return rank(a.pattern) < rank(b.pattern)
		}
		if a.pattern != b.pattern {
			return a.pattern < b.pattern
		}
		return a.r < b.r
	})
	labels := make([]string, len(groups))
	for i, g := range groups {
		l := g.pattern
		if x, ok := replicaPatterns[g.pattern]; ok {
			l = x.label
		}
		labels[i] = fmt.Sprintf("%s R=%d", l, g.r)
	}
	mean := func(g group, col string, k int) float64 {
		if a := sums[g][col]; a != nil && a.n[k] > 0 {
			return a.sum[k] / a.n[k]
		}
		return 0
	}
	var out []*plot.Plot
	for _, m := range []struct {
		title, y string
		metric   int
		cols     []string
	}{
		{"interrupted requests restored from a checkpoint", "restored fraction", 0, []string{"lumen", "fixed-checkpoint"}},
		{"interrupted requests whose plan found a live copy", "live-copy fraction", 1, []string{"lumen", "fixed-checkpoint"}},
		{"TTFT mean by failure and R", "TTFT mean (ms)", 2, []string{"lumen", "stop-and-restart", "fixed-checkpoint"}},
	} {
		var cols []string
		for _, c := range m.cols {
			for _, g := range groups {
				if a := sums[g][c]; a != nil && a.n[m.metric] > 0 {
					cols = append(cols, c)
					break
				}
			}
		}
		if len(cols) == 0 {
			continue
		}
		p := newPlot(m.title+" (mean over seeds)", "failure pattern, checkpoint copies R", m.y)
		vals := make([][]float64, len(cols))
		for i, c := range cols {
			for _, g := range groups {
				vals[i] = append(vals[i], mean(g, c, m.metric))
			}
		}
		if err := addBars(p, labels, cols, vals); err != nil {
			return nil, err
		}
		p.X.Tick.Label.Rotation = 0.5
		p.X.Tick.Label.XAlign, p.X.Tick.Label.YAlign = -1, -0.5
		out = append(out, p)
	}
	// lumen's TTFT mean relative to stop-and-restart's in the same run
	// (the same arrivals), averaged over the seeds: the runs differ more
	// between seeds than lumen from stop-and-restart within one.
	rel := map[group][2]float64{}
	for name, cols := range runs {
		m := replicaRun.FindStringSubmatch(name)
		r, _ := strconv.Atoi(m[2])
		l, sr := cols["lumen"], cols["stop-and-restart"]
		if l == nil || sr == nil || sr.TTFTMeanMs <= 0 {
			continue
		}
		g := group{m[1], r}
		x := rel[g]
		rel[g] = [2]float64{x[0] + 100*(l.TTFTMeanMs/sr.TTFTMeanMs-1), x[1] + 1}
	}
	if len(rel) > 0 {
		p := newPlot("lumen's TTFT mean vs stop-and-restart's (mean over seeds)", "failure pattern, checkpoint copies R", "% (negative: lumen lower)")
		vals := [][]float64{nil}
		lo := 0.0
		for _, g := range groups {
			v := 0.0
			if x := rel[g]; x[1] > 0 {
				v = x[0] / x[1]
			}
			vals[0] = append(vals[0], v)
			lo = min(lo, v)
		}
		if err := addBars(p, labels, []string{"lumen"}, vals); err != nil {
			return nil, err
		}
		p.Y.Min = lo * 1.15
		p.X.Tick.Label.Rotation = 0.5
		p.X.Tick.Label.XAlign, p.X.Tick.Label.YAlign = -1, -0.5
		out = append(out, p)
	}
	return out, nil
}
