package e2e

import (
	"context"
	"testing"

	"github.com/lumen-project/lumen/internal/devcluster"
)

// metricValue reads one unlabelled metric from a Prometheus endpoint. A
// scrape that fails, a value that does not parse or a metric that is not
// there fails the test (devcluster.ScrapeMetric): a 0 read from nothing
// would let an assertion pass without checking anything.
func metricValue(t *testing.T, url, name string) float64 {
	t.Helper()
	v, err := devcluster.ScrapeMetric(context.Background(), url, name)
	if err != nil {
		t.Fatal(err)
	}
	return v
}
