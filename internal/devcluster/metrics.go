package devcluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// metricsClient gives up on a process that does not answer (a paused one).
var metricsClient = &http.Client{Timeout: 2 * time.Second}

// ScrapeMetric reads one metric from the Prometheus endpoint at url: the
// sum of its series (one, unlabelled, or vLLM-named ones with their
// model_name label). A failed scrape, an answer other than 200, a value
// that does not parse or a metric not exposed is an error, never a 0.
// ErrNoMetric: the scrape found no series of the metric named (a counter
// with labels is exposed only once a label value was used, unless its
// exporter initialises them).
var ErrNoMetric = errors.New("no metric")

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
	sum, found := 0.0, false
	for sc.Scan() {
		line := sc.Text()
		rest, ok := strings.CutPrefix(line, name+" ")
		if !ok {
			if labelled, ok2 := strings.CutPrefix(line, name+"{"); ok2 {
				if i := strings.LastIndex(labelled, "} "); i >= 0 {
					rest, ok = labelled[i+2:], true
				}
			}
		}
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
		if err != nil {
			return 0, fmt.Errorf("devcluster: scrape %s: %s: %w", url, name, err)
		}
		sum, found = sum+v, true
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("devcluster: scrape %s: %w", url, err)
	}
	if !found {
		return 0, fmt.Errorf("devcluster: scrape %s: %w %s", url, ErrNoMetric, name)
	}
	return sum, nil
}

// Metric reads one metric of the worker, summed over its series (ScrapeMetric).
func (w *Worker) Metric(ctx context.Context, name string) (float64, error) {
	return ScrapeMetric(ctx, "http://"+w.HTTPAddr+"/metrics", name)
}
