package jepsen

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/lumen-project/lumen/internal/devcluster"
)

// gatewayCounters are the gateway's counters of its request path (issue
// 16) that a run sums over every gateway incarnation: each is scraped just
// before a gateway-kill and once more after the streams end.
var gatewayCounters = []string{
	`lumen_gateway_placements_total{path="replica"}`,
	`lumen_gateway_placements_total{path="controller"}`,
	`lumen_gateway_placement_fallbacks_total{why="no_table"}`,
	`lumen_gateway_placement_fallbacks_total{why="no_worker"}`,
	`lumen_gateway_placement_refusals_total{reason="worker_unavailable"}`,
	`lumen_gateway_placement_refusals_total{reason="other"}`,
	`lumen_gateway_placement_refusals_total{reason="unconfirmed"}`,
	`lumen_gateway_set_holder_total{result="applied"}`,
	`lumen_gateway_set_holder_total{result="not_applied"}`,
	`lumen_gateway_set_holder_total{result="failed"}`,
}

// GatewayPaths is what the gateways' request path did over a run: the sum
// of their counters (a counter a gateway does not expose yet reads 0), and
// the scrapes that failed.
type GatewayPaths struct {
	Counts      map[string]float64
	ScrapeFails []string
}

func (p GatewayPaths) get(name string) float64 { return p.Counts[name] }

func (p GatewayPaths) String() string {
	g := p.get
	return fmt.Sprintf("placements: %g started before their commit (replica), %g waited for it (controller; %g with no table, %g with no eligible worker); refusals after the start: %g worker_unavailable, %g other, %g unconfirmed; SetHolder: %g applied, %g not applied, %g failed",
		g(gatewayCounters[0]), g(gatewayCounters[1]), g(gatewayCounters[2]), g(gatewayCounters[3]),
		g(gatewayCounters[4]), g(gatewayCounters[5]), g(gatewayCounters[6]),
		g(gatewayCounters[7]), g(gatewayCounters[8]), g(gatewayCounters[9]))
}

// scrapeGateway adds gw's counters to e.gwPaths (before it is killed, and
// at the end).
func (e *env) scrapeGateway(ctx context.Context, gw *devcluster.Gateway) {
	sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	url := "http://" + gw.Addr + "/metrics"
	got := map[string]float64{}
	var fails []string
	for _, name := range gatewayCounters {
		v, err := devcluster.ScrapeMetric(sctx, url, name)
		switch {
		case err == nil:
			got[name] = v
		case errors.Is(err, devcluster.ErrNoMetric):
			// A counter not incremented yet is not exposed.
		default:
			fails = append(fails, fmt.Sprintf("%s: %v", gw.Name, err))
		}
		if len(fails) > 0 {
			break
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.gwPaths.Counts == nil {
		e.gwPaths.Counts = map[string]float64{}
	}
	for k, v := range got {
		e.gwPaths.Counts[k] += v
	}
	e.gwPaths.ScrapeFails = append(e.gwPaths.ScrapeFails, fails...)
}

// CheckGatewayPath: the run exercised the gateways' request path off
// consensus — streams completed and some of them started before their
// placement committed. A run whose gateways always waited for the commit
// tested the old path only, and its serving verdict says nothing of the
// new one.
func CheckGatewayPath(p GatewayPaths, streams []Stream) Verdict {
	v := Verdict{Checker: "gateway-path", OK: true, Note: p.String()}
	done := 0
	for _, s := range streams {
		if s.Done {
			done++
		}
	}
	if len(p.ScrapeFails) > 0 {
		v.Note += fmt.Sprintf("; %d scrapes failed (%s)", len(p.ScrapeFails), p.ScrapeFails[0])
	}
	if done > 0 && p.get(gatewayCounters[0]) == 0 && len(p.ScrapeFails) == 0 {
		v.fail("%d streams completed, none started before its placement committed: the gateways never took the replica's path (%s)", done, p.String())
	}
	return v
}
