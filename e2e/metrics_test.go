package e2e

import (
	"bufio"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"
)

// metricsClient gives up on a worker that does not answer (a paused one).
var metricsClient = &http.Client{Timeout: 2 * time.Second}

// metricValue reads one unlabelled metric from a Prometheus endpoint. A
// scrape that fails, a value that does not parse or a metric that is not
// there fails the test: a 0 read from nothing would let an assertion pass
// without checking anything.
func metricValue(t *testing.T, url, name string) float64 {
	t.Helper()
	v, err := scrapeMetric(url, name)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// scrapeMetric is metricValue's reading, with the failure returned.
func scrapeMetric(url, name string) (float64, error) {
	resp, err := metricsClient.Get(url)
	if err != nil {
		return 0, fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("scrape %s: HTTP %d", url, resp.StatusCode)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, name+" "); ok {
			v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			if err != nil {
				return 0, fmt.Errorf("scrape %s: %s: %w", url, name, err)
			}
			return v, nil
		}
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("scrape %s: %w", url, err)
	}
	return 0, fmt.Errorf("scrape %s: no unlabelled metric %s", url, name)
}

// TestMetricValueFailsOnBadScrape checks that the helper cannot read 0 from
// a failed scrape.
func TestMetricValueFailsOnBadScrape(t *testing.T) {
	srv := newMetricsServer(t, "# HELP a_total x\na_total 3\nb_gauge not-a-number\nc{l=\"x\"} 1\n")
	if v, err := scrapeMetric(srv+"/metrics", "a_total"); err != nil || v != 3 {
		t.Fatalf("a_total: %v %v", v, err)
	}
	for _, c := range []struct{ url, name string }{
		{srv + "/metrics", "b_gauge"},       // does not parse
		{srv + "/metrics", "c"},             // labelled only
		{srv + "/metrics", "missing_total"}, // not exposed
		{srv + "/nothing", "a_total"},       // HTTP 404
		{"http://127.0.0.1:1/metrics", "a"}, // nobody listens
	} {
		if v, err := scrapeMetric(c.url, c.name); err == nil {
			t.Errorf("%s %s: read %v, want an error", c.url, c.name, v)
		}
	}
}

func newMetricsServer(t *testing.T, body string) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, body) })
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL
}
