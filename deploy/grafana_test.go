package deploy

import (
	"context"
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"sigs.k8s.io/yaml"
)

// The parts of a Grafana dashboard the tests read.
type dashboard struct {
	Title      string  `json:"title"`
	UID        string  `json:"uid"`
	Panels     []panel `json:"panels"`
	Templating struct {
		List []variable `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID         int         `json:"id"`
	Type       string      `json:"type"`
	Title      string      `json:"title"`
	Datasource *datasource `json:"datasource"`
	GridPos    struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Panels  []panel `json:"panels"` // a collapsed row's
	Targets []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
}

type datasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type variable struct {
	Name  string          `json:"name"`
	Type  string          `json:"type"`
	Query json.RawMessage `json:"query"`
}

// migrationRow is the dashboard row over live migration's metrics, which a
// binary without live migration does not export.
const migrationRow = "Live migration"

// query is one expression of the dashboard, with where it is.
type query struct {
	row, panel, expr string
}

func loadDashboard(t *testing.T) (dashboard, []query) {
	t.Helper()
	b, err := os.ReadFile("grafana/lumen.json")
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	dec := json.NewDecoder(strings.NewReader(string(b)))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("grafana/lumen.json: %v", err)
	}
	var qs []query
	ids := map[int]string{}
	row := ""
	var walk func(ps []panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			if prev, dup := ids[p.ID]; dup || p.ID == 0 {
				t.Errorf("panel %q: id %d (also %q): ids must be unique and set", p.Title, p.ID, prev)
			}
			ids[p.ID] = p.Title
			if p.GridPos.W <= 0 || p.GridPos.X+p.GridPos.W > 24 {
				t.Errorf("panel %q: gridPos %+v is off the 24-column grid", p.Title, p.GridPos)
			}
			if p.Type == "row" {
				row = p.Title
				walk(p.Panels)
				continue
			}
			if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
				t.Errorf("panel %q: datasource %+v: use the ${datasource} variable", p.Title, p.Datasource)
			}
			if len(p.Targets) == 0 {
				t.Errorf("panel %q has no queries", p.Title)
			}
			refs := map[string]bool{}
			for _, tg := range p.Targets {
				if tg.RefID == "" || refs[tg.RefID] || strings.TrimSpace(tg.Expr) == "" {
					t.Errorf("panel %q: target %q: every target needs its own refId and an expression", p.Title, tg.RefID)
				}
				refs[tg.RefID] = true
				qs = append(qs, query{row, p.Title, tg.Expr})
			}
		}
	}
	walk(d.Panels)
	return d, qs
}

// exported is what the processes export: every sample name (a histogram's
// _bucket, _sum and _count) with the label names its series carry.
type exported map[string]map[string]bool

func (e exported) add(fams map[string]*dto.MetricFamily) {
	for name, f := range fams {
		for _, m := range f.Metric {
			labels := map[string]bool{}
			for _, lp := range m.Label {
				labels[lp.GetName()] = true
			}
			samples := map[string][]string{name: nil}
			switch f.GetType() {
			case dto.MetricType_HISTOGRAM, dto.MetricType_GAUGE_HISTOGRAM:
				samples = map[string][]string{name + "_bucket": {"le"}, name + "_sum": nil, name + "_count": nil}
			case dto.MetricType_SUMMARY:
				samples = map[string][]string{name: {"quantile"}, name + "_sum": nil, name + "_count": nil}
			}
			for s, extra := range samples {
				if e[s] == nil {
					e[s] = map[string]bool{}
				}
				for l := range labels {
					e[s][l] = true
				}
				for _, l := range extra {
					e[s][l] = true
				}
			}
		}
	}
}

// targetLabels are the labels Prometheus attaches to every series it
// scrapes: job and instance, and those prometheus.yml's relabelling sets.
func targetLabels(t *testing.T) map[string]bool {
	t.Helper()
	cfg := prometheusConfig(t)
	labels := map[string]bool{"job": true, "instance": true}
	for _, sc := range cfg.ScrapeConfigs {
		for _, rc := range sc.RelabelConfigs {
			if rc.TargetLabel != "" && !strings.HasPrefix(rc.TargetLabel, "__") {
				labels[rc.TargetLabel] = true
			}
		}
		for _, st := range sc.StaticConfigs {
			for l := range st.Labels {
				labels[l] = true
			}
		}
	}
	return labels
}

// TestDashboardMetricsExported: every metric the dashboard queries — and
// every label its matchers name — is one the running processes export
// (or one Prometheus attaches). The names come from the processes' own
// /metrics after the live cluster went through a failure, a resumed
// stream and a progressive recovery; no list is kept here.
func TestDashboardMetricsExported(t *testing.T) {
	d, qs := loadDashboard(t)
	cl := liveCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	have := exported{}
	for name, labels := range live.seen {
		have[name] = map[string]bool{}
		for l := range labels {
			have[name][l] = true
		}
	}
	if err := have.scrapeAll(ctx, cl); err != nil {
		t.Fatal(err)
	}
	tl := targetLabels(t)
	skipped := 0
	checked := map[string]bool{}
	for _, q := range qs {
		if q.row == migrationRow && !live.migrations {
			skipped++
			continue
		}
		sels, err := selectors(q.expr)
		if err != nil {
			t.Errorf("%s / %s: %v", q.row, q.panel, err)
			continue
		}
		if len(sels) == 0 {
			t.Errorf("%s / %s: %q reads no metric", q.row, q.panel, q.expr)
		}
		for _, s := range sels {
			labels, ok := have[s.metric]
			if !ok {
				t.Errorf("%s / %s: %s is not exported by any lumen process", q.row, q.panel, s.metric)
				continue
			}
			checked[s.metric] = true
			for _, l := range s.labels {
				if !labels[l] && !tl[l] {
					t.Errorf("%s / %s: %s has no label %q (it has %v; Prometheus adds %v)", q.row, q.panel, s.metric, l, sortedKeys(labels), sortedKeys(tl))
				}
			}
		}
	}
	// label_values(metric, label) in the template variables.
	lv := regexp.MustCompile(`label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)`)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		m := lv.FindStringSubmatch(string(v.Query))
		if m == nil {
			t.Errorf("variable %s: query %s: want label_values(metric, label)", v.Name, v.Query)
			continue
		}
		if have[m[1]] == nil {
			t.Errorf("variable %s: %s is not exported", v.Name, m[1])
		} else if !have[m[1]][m[2]] && !tl[m[2]] {
			t.Errorf("variable %s: %s has no label %s", v.Name, m[1], m[2])
		}
	}
	if skipped > 0 {
		t.Logf("this lumen has no live migration (no `worker drain` command): %d queries of the %q row not checked", skipped, migrationRow)
	}
	t.Logf("%d queries over %d metrics checked", len(qs)-skipped, len(checked))
	if len(checked) < 20 {
		t.Errorf("only %d metrics checked: the dashboard lost its panels?", len(checked))
	}
}

// The parts of prometheus.yml the tests read.
type promConfig struct {
	ScrapeConfigs []struct {
		JobName             string `json:"job_name"`
		KubernetesSDConfigs []struct {
			Role string `json:"role"`
		} `json:"kubernetes_sd_configs"`
		StaticConfigs []struct {
			Targets []string          `json:"targets"`
			Labels  map[string]string `json:"labels"`
		} `json:"static_configs"`
		RelabelConfigs []struct {
			SourceLabels []string `json:"source_labels"`
			Action       string   `json:"action"`
			Regex        string   `json:"regex"`
			TargetLabel  string   `json:"target_label"`
		} `json:"relabel_configs"`
	} `json:"scrape_configs"`
}

func prometheusConfig(t *testing.T) promConfig {
	t.Helper()
	b, err := os.ReadFile("prometheus/prometheus.yml")
	if err != nil {
		t.Fatal(err)
	}
	var cfg promConfig
	if err := yaml.Unmarshal(b, &cfg); err != nil {
		t.Fatalf("prometheus/prometheus.yml: %v", err)
	}
	return cfg
}

// TestPrometheusScrapesManifests: the kubernetes_sd job reads every
// prometheus.io/* annotation the manifests set on lumen's pods (Prometheus
// sees an annotation a/b as __meta_kubernetes_pod_annotation_a_b), keeps
// only pods with scrape "true", and sets the labels the dashboard groups
// by.
func TestPrometheusScrapesManifests(t *testing.T) {
	cfg := prometheusConfig(t)
	read := map[string]bool{}
	keeps := false
	for _, sc := range cfg.ScrapeConfigs {
		sd := false
		for _, k := range sc.KubernetesSDConfigs {
			sd = sd || k.Role == "pod"
		}
		if !sd {
			continue
		}
		for _, rc := range sc.RelabelConfigs {
			for _, s := range rc.SourceLabels {
				read[s] = true
			}
			if rc.Action == "keep" && len(rc.SourceLabels) == 1 && rc.SourceLabels[0] == "__meta_kubernetes_pod_annotation_prometheus_io_scrape" && rc.Regex == "true" {
				keeps = true
			}
		}
	}
	if !keeps {
		t.Error("prometheus.yml: no kubernetes_sd pod job keeps only pods annotated prometheus.io/scrape: \"true\"")
	}
	sanitize := regexp.MustCompile(`[^a-zA-Z0-9_]`)
	annotations := map[string]bool{}
	for _, o := range renderAll(t) {
		for _, w := range o.workloads() {
			var ann map[string]string
			if w.sts != nil {
				ann = w.sts.Spec.Template.Annotations
			} else {
				for _, d := range o.deployments {
					if d.Name == w.name {
						ann = d.Spec.Template.Annotations
					}
				}
			}
			for k := range ann {
				if strings.HasPrefix(k, "prometheus.io/") {
					annotations[k] = true
				}
			}
			for k := range w.labels {
				annotations["label:"+k] = true
			}
		}
	}
	for k := range annotations {
		if name, ok := strings.CutPrefix(k, "label:"); ok {
			if name == "app.kubernetes.io/component" && !read["__meta_kubernetes_pod_label_"+sanitize.ReplaceAllString(name, "_")] {
				t.Errorf("prometheus.yml does not read the pods' %s label (the dashboard's component)", name)
			}
			continue
		}
		if src := "__meta_kubernetes_pod_annotation_" + sanitize.ReplaceAllString(k, "_"); !read[src] {
			t.Errorf("the manifests set %s, which prometheus.yml does not read (%s)", k, src)
		}
	}
	tl := targetLabels(t)
	for _, l := range []string{"namespace", "pod"} {
		if !tl[l] {
			t.Errorf("prometheus.yml sets no %q label; the dashboard filters and groups by it (has %v)", l, sortedKeys(tl))
		}
	}
}
