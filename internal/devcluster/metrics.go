package devcluster

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// metricsClient gives up on a process that does not answer (a paused one).
var metricsClient = &http.Client{Timeout: 2 * time.Second}

// ScrapeMetric reads one unlabelled metric from the Prometheus endpoint at
// url. A failed scrape, an answer other than 200, a value that does not
// parse or a metric not exposed is an error, never a 0.
func ScrapeMetric(ctx context.Context, url, name string) (float64, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := metricsClient.Do(req)
	if err != nil {
		return 0, fmt.Errorf("devcluster: scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("devcluster: scrape %s: HTTP %d", url, resp.StatusCode)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			if err != nil {
				return 0, fmt.Errorf("devcluster: scrape %s: %s: %w", url, name, err)
			}
			return v, nil
		}
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("devcluster: scrape %s: %w", url, err)
	}
	return 0, fmt.Errorf("devcluster: scrape %s: no unlabelled metric %s", url, name)
}

// Metric reads one unlabelled metric of the worker (ScrapeMetric).
func (w *Worker) Metric(ctx context.Context, name string) (float64, error) {
	return ScrapeMetric(ctx, "http://"+w.HTTPAddr+"/metrics", name)
}
