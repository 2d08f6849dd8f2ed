package e2e

import (
	"bufio"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// metricsClient gives up on a worker that does not answer (a paused one).
var metricsClient = &http.Client{Timeout: 2 * time.Second}

// metricValue reads one unlabelled metric from a Prometheus endpoint.
func metricValue(t *testing.T, url, name string) float64 {
	t.Helper()
	resp, err := metricsClient.Get(url)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, name+" ") {
			v, _ := strconv.ParseFloat(strings.TrimPrefix(line, name+" "), 64)
			return v
		}
	}
	return 0
}
