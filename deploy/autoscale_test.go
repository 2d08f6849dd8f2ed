package deploy

import (
	"context"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	autoscalingv2 "k8s.io/api/autoscaling/v2"
	"sigs.k8s.io/yaml"
)

// adapterValuesFile is the Prometheus adapter's Helm values: the external
// metrics the autoscale overlay's HorizontalPodAutoscaler reads.
const adapterValuesFile = "prometheus/adapter-values.yaml"

// adapterRule is one rule of the adapter's configuration (its docs'
// config.md), as the chart's rules.external list holds it.
type adapterRule struct {
	SeriesQuery string `json:"seriesQuery"`
	Resources   struct {
		Overrides map[string]struct {
			Resource string `json:"resource"`
		} `json:"overrides"`
	} `json:"resources"`
	Name struct {
		Matches string `json:"matches"`
		As      string `json:"as"`
	} `json:"name"`
	MetricsQuery string `json:"metricsQuery"`
}

func adapterRules(t *testing.T) []adapterRule {
	t.Helper()
	b, err := os.ReadFile(adapterValuesFile)
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Rules struct {
			Default  *bool         `json:"default"`
			External []adapterRule `json:"external"`
		} `json:"rules"`
	}
	if err := yaml.Unmarshal(b, &v); err != nil {
		t.Fatalf("%s: %v", adapterValuesFile, err)
	}
	if v.Rules.Default == nil || *v.Rules.Default {
		t.Errorf("%s: rules.default is not false: the chart's default rules would export every series of the namespace besides these", adapterValuesFile)
	}
	if len(v.Rules.External) == 0 {
		t.Fatalf("%s: no rules.external", adapterValuesFile)
	}
	return v.Rules.External
}

// TestAutoscaler: every HorizontalPodAutoscaler of the overlays scales the
// workers' StatefulSet — whose preStop hook drains a removed worker by
// migration (TestWorkers) — which leaves its replica count to it; keeps two
// workers at least (a drain by migration needs a destination); paces its
// scale-down; and reads only external metrics the adapter's rules define.
// At least one overlay has one (deploy/k8s/overlays/autoscale).
func TestAutoscaler(t *testing.T) {
	rules := map[string]adapterRule{}
	for _, r := range adapterRules(t) {
		if r.Name.As == "" {
			t.Errorf("%s: a rule for %q names no metric (name.as)", adapterValuesFile, r.SeriesQuery)
		}
		rules[r.Name.As] = r
	}
	ps := procs(t)
	n := 0
	for _, o := range renderAll(t) {
		for _, h := range o.hpas {
			n++
			where := o.dir + ": HorizontalPodAutoscaler " + h.Name
			ref := h.Spec.ScaleTargetRef
			var worker *proc
			for _, p := range ps {
				if p.ov == o && p.sub == "worker" && p.w.kind == ref.Kind && p.w.name == ref.Name {
					worker = p
				}
			}
			if ref.APIVersion != "apps/v1" || worker == nil {
				t.Errorf("%s: scales %s %s (%s), not the overlay's workers' StatefulSet", where, ref.Kind, ref.Name, ref.APIVersion)
				continue
			}
			if worker.w.sts.Spec.Replicas != nil {
				t.Errorf("%s: %s sets replicas (%d): every kubectl apply would undo the autoscaler's count", where, ref.Name, *worker.w.sts.Spec.Replicas)
			}
			if h.Spec.MinReplicas == nil || *h.Spec.MinReplicas < 2 {
				t.Errorf("%s: minReplicas %v: keep two workers at least, so that a drain by migration has a destination", where, h.Spec.MinReplicas)
			} else if h.Spec.MaxReplicas < *h.Spec.MinReplicas {
				t.Errorf("%s: maxReplicas %d below minReplicas %d", where, h.Spec.MaxReplicas, *h.Spec.MinReplicas)
			}
			if b := h.Spec.Behavior; b == nil || b.ScaleDown == nil || b.ScaleDown.StabilizationWindowSeconds == nil || *b.ScaleDown.StabilizationWindowSeconds <= 0 || !podsPolicy(b.ScaleDown) {
				t.Errorf("%s: no paced scale-down (a stabilization window and a Pods policy): each removal drains a worker by migration", where)
			}
			if len(h.Spec.Metrics) == 0 {
				t.Errorf("%s: no metric", where)
			}
			for _, m := range h.Spec.Metrics {
				if m.Type != autoscalingv2.ExternalMetricSourceType || m.External == nil {
					t.Errorf("%s: a %s metric: the cluster's freeness is one series, an external metric", where, m.Type)
					continue
				}
				if _, ok := rules[m.External.Metric.Name]; !ok {
					t.Errorf("%s: external metric %q: no rule of %s defines it (it defines %v)", where, m.External.Metric.Name, adapterValuesFile, sortedKeys(rules))
				}
				if m.External.Target.Type != autoscalingv2.ValueMetricType || m.External.Target.Value == nil {
					t.Errorf("%s: %s: target %s: the rules compute one value for the whole cluster (type Value)", where, m.External.Metric.Name, m.External.Target.Type)
				}
			}
		}
	}
	if n == 0 {
		t.Error("no overlay has a HorizontalPodAutoscaler: the autoscaling example is gone")
	}
}

func podsPolicy(r *autoscalingv2.HPAScalingRules) bool {
	for _, p := range r.Policies {
		if p.Type == autoscalingv2.PodsScalingPolicy && p.Value > 0 && p.PeriodSeconds > 0 {
			return true
		}
	}
	return false
}

// TestAdapterRulesExported: every series the adapter's rules read is one
// the running processes export, with the labels the rules match on (or
// ones Prometheus attaches); each rule's resources map only labels
// Prometheus attaches; and the autoscaler's ratio is Llumnix's band,
// scaling out below a mean freeness of 10 and in above 60.
func TestAdapterRulesExported(t *testing.T) {
	rules := adapterRules(t)
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
	band := false
	for _, r := range rules {
		where := adapterValuesFile + ": rule " + r.Name.As
		series, err := selectors(r.SeriesQuery)
		if err != nil || len(series) != 1 {
			t.Errorf("%s: seriesQuery %q: want one series selector (%v)", where, r.SeriesQuery, err)
			continue
		}
		if r.Name.Matches != "" {
			if re, err := regexp.Compile(r.Name.Matches); err != nil || !re.MatchString(series[0].metric) {
				t.Errorf("%s: name.matches %q does not match the series %s (%v)", where, r.Name.Matches, series[0].metric, err)
			}
		}
		for l := range r.Resources.Overrides {
			if !tl[l] {
				t.Errorf("%s: resources map label %q, which Prometheus does not attach (it attaches %v)", where, l, sortedKeys(tl))
			}
		}
		// The adapter's template: the series, and the matchers of the
		// autoscaler's namespace.
		q := strings.NewReplacer("<<.Series>>", series[0].metric, "<<.LabelMatchers>>", `namespace="lumen"`, "<<.GroupBy>>", "namespace").Replace(r.MetricsQuery)
		sels, err := selectors(q)
		if err != nil || len(sels) == 0 {
			t.Errorf("%s: metricsQuery %q reads no metric (%v)", where, r.MetricsQuery, err)
		}
		for _, s := range append(series, sels...) {
			labels, ok := have[s.metric]
			if !ok {
				t.Errorf("%s: %s is not exported by any lumen process", where, s.metric)
				continue
			}
			for _, l := range s.labels {
				if !labels[l] && !tl[l] {
					t.Errorf("%s: %s has no label %q (it has %v; Prometheus adds %v)", where, s.metric, l, sortedKeys(labels), sortedKeys(tl))
				}
			}
		}
		band = band || strings.Contains(r.MetricsQuery, "< bool 10)") && strings.Contains(r.MetricsQuery, "> bool 60)")
	}
	if !band {
		t.Errorf("%s: no rule scales on Llumnix's band (a mean freeness below 10 out, above 60 in)", adapterValuesFile)
	}
}
