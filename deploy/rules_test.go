package deploy

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

// TestVLLMCompatRules: prometheus.yml loads the vLLM compatibility rules;
// each records a vllm: name, once, from metrics the running processes
// export, and every worker metric with vLLM's model_name label has a rule.
func TestVLLMCompatRules(t *testing.T) {
	var prom struct {
		RuleFiles []string `json:"rule_files"`
	}
	b, err := os.ReadFile("prometheus/prometheus.yml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &prom); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(prom.RuleFiles, "vllm-compat.rules.yml") {
		t.Fatalf("prometheus.yml rule_files %v: want vllm-compat.rules.yml", prom.RuleFiles)
	}
	var rules struct {
		Groups []struct {
			Name  string `json:"name"`
			Rules []struct {
				Record string `json:"record"`
				Expr   string `json:"expr"`
			} `json:"rules"`
		} `json:"groups"`
	}
	b, err = os.ReadFile("prometheus/vllm-compat.rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.UnmarshalStrict(b, &rules); err != nil {
		t.Fatalf("vllm-compat.rules.yml: %v", err)
	}
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
	recorded := map[string]bool{}
	read := map[string]bool{}
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
			if !strings.HasPrefix(r.Record, "vllm:") {
				t.Errorf("record %q: want a vllm: name", r.Record)
			}
			if recorded[r.Record] {
				t.Errorf("%s recorded twice", r.Record)
			}
			recorded[r.Record] = true
			sels, err := selectors(r.Expr)
			if err != nil || len(sels) == 0 {
				t.Errorf("%s: expr %q: %v (selectors %v)", r.Record, r.Expr, err, sels)
				continue
			}
			for _, s := range sels {
				if have[s.metric] == nil {
					t.Errorf("%s: %s is not exported by any lumen process", r.Record, s.metric)
				}
				read[strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(s.metric, "_bucket"), "_sum"), "_count")] = true
			}
		}
	}
	for name, labels := range have {
		base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_sum"), "_count")
		if labels["model_name"] && !read[base] {
			t.Errorf("%s carries vLLM's model_name label but no rule gives it vLLM's name", name)
		}
	}
	t.Logf("%d rules checked", n)
}
