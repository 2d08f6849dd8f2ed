package worker

import "testing"

// TestVLLMNames: the metrics that mean what vLLM's mean carry vLLM's names
// after lumen_worker_ and its model_name label; the others do not.
func TestVLLMNames(t *testing.T) {
	m := newMetrics("Qwen3-14B")
	m.ttft.Observe(0.1)
	m.tpot.Observe(0.01)
	m.queueDelay.Observe(0.02)
	fams, err := m.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	model := map[string]string{}
	for _, f := range fams {
		for _, s := range f.GetMetric() {
			for _, l := range s.GetLabel() {
				if l.GetName() == "model_name" {
					model[f.GetName()] = l.GetValue()
				}
			}
		}
	}
	for _, name := range []string{"lumen_worker_time_to_first_token_seconds", "lumen_worker_inter_token_latency_seconds",
		"lumen_worker_request_queue_time_seconds", "lumen_worker_num_requests_running", "lumen_worker_num_requests_waiting",
		"lumen_worker_kv_cache_usage_perc", "lumen_worker_num_preemptions_total",
		"lumen_worker_prefix_cache_queries_total", "lumen_worker_prefix_cache_hits_total"} {
		if model[name] != "Qwen3-14B" {
			t.Errorf("%s: model_name %q, want Qwen3-14B (exported: %v)", name, model[name], model)
		}
	}
	if _, ok := model["lumen_worker_kv_pages_used"]; ok {
		t.Error("lumen_worker_kv_pages_used, lumen's own, has a model_name label")
	}
}
