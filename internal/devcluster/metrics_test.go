package devcluster

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
)

// A scrape that fails, or reads nothing, is an error: never a 0 that an
// assertion could take for a reading.
func TestScrapeMetricFailsOnBadScrape(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, "# HELP a_total x\na_total 3\nb_gauge not-a-number\nc{l=\"x\"} 1\nc{l=\"y\"} 2.5\nd 1.5e+06\n")
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	ctx := context.Background()
	// A labelled metric (vLLM's names carry model_name) reads as the sum
	// of its series.
	for name, want := range map[string]float64{"a_total": 3, "d": 1.5e6, "c": 3.5} {
		if v, err := ScrapeMetric(ctx, srv.URL+"/metrics", name); err != nil || v != want {
			t.Fatalf("%s: %v %v, want %v", name, v, err, want)
		}
	}
	for _, c := range []struct{ url, name string }{
		{srv.URL + "/metrics", "b_gauge"},       // does not parse
		{srv.URL + "/metrics", "missing_total"}, // not exposed
		{srv.URL + "/nothing", "a_total"},       // HTTP 404
		{"http://127.0.0.1:1/metrics", "a"},     // nobody listens
	} {
		v, err := ScrapeMetric(ctx, c.url, c.name)
		if err == nil {
			t.Errorf("%s %s: read %v, want an error", c.url, c.name, v)
		}
		// Only a metric the page does not expose is ErrNoMetric: callers
		// read it as "not incremented yet", never a failed scrape.
		if missing := c.name == "missing_total"; errors.Is(err, ErrNoMetric) != missing {
			t.Errorf("%s %s: %v; ErrNoMetric should be %v", c.url, c.name, err, missing)
		}
	}
}
