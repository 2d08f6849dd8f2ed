package jepsen

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/lumen-project/lumen/gateway"
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
	unconfirmedCounter,
	`lumen_gateway_set_holder_total{result="applied"}`,
	`lumen_gateway_set_holder_total{result="not_applied"}`,
	`lumen_gateway_set_holder_total{result="failed"}`,
}

// unconfirmedCounter counts the placements a gateway gave up waiting for
// (no controller answered within its dispatch deadline).
const unconfirmedCounter = `lumen_gateway_placement_refusals_total{reason="unconfirmed"}`

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

// unconfirmedBound is how long a placement may stay unconfirmed: the
// gateways' dispatch deadline, past which a gateway gives up on a
// Dispatch's answer and counts it unconfirmed (the request runs on with no
// placement, no holder and no recovery). Any such placement fails the run.
var unconfirmedBound = gateway.DefaultConfig().DispatchTimeout

// scrapeTries is how many times scrapeGateway asks a gateway before it
// records the scrape as failed.
const scrapeTries = 3

// scrapeGateway adds gw's counters to e.gwPaths (before it is killed, and
// at the end). A gateway that does not answer is asked again, a few times;
// one that never answers is a failed scrape, which fails gateway-path.
func (e *env) scrapeGateway(ctx context.Context, gw *devcluster.Gateway) {
	url := "http://" + gw.Addr + "/metrics"
	var got map[string]float64
	var fails []string
	for try := 0; try < scrapeTries; try++ {
		if try > 0 {
			sleepCtx(ctx, 200*time.Millisecond)
		}
		got, fails = scrapeOnce(ctx, url, gw.Name)
		if len(fails) == 0 {
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

// scrapeOnce reads every gateway counter from url: the values, or the
// failure (none read).
func scrapeOnce(ctx context.Context, url, name string) (map[string]float64, []string) {
	sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	got := map[string]float64{}
	for _, counter := range gatewayCounters {
		v, err := devcluster.ScrapeMetric(sctx, url, counter)
		switch {
		case err == nil:
			got[counter] = v
		case errors.Is(err, devcluster.ErrNoMetric):
			// A counter not incremented yet is not exposed.
		default:
			return nil, []string{fmt.Sprintf("%s: %v", name, err)}
		}
	}
	return got, nil
}

// CheckGatewayPath: the run exercised the gateways' request path off
// consensus — streams completed and some of them started before their
// placement committed — and no placement stayed unconfirmed past the
// gateways' dispatch deadline (unconfirmedBound). A run whose gateways
// always waited for the commit tested the old path only, and its serving
// verdict says nothing of the new one; a request that ran unconfirmed ran
// with no placement, holder or recovery. Counters that could not be read
// (a failed scrape) fail the run: what they would have said is unknown.
func CheckGatewayPath(p GatewayPaths, streams []Stream) Verdict {
	v := Verdict{Checker: "gateway-path", OK: true, Note: p.String()}
	done := 0
	for _, s := range streams {
		if s.Done {
			done++
		}
	}
	if len(p.ScrapeFails) > 0 {
		v.fail("%d gateway scrapes failed after %d tries each (%s): the counters of the gateways' path are unknown", len(p.ScrapeFails), scrapeTries, p.ScrapeFails[0])
	}
	if done > 0 && p.get(gatewayCounters[0]) == 0 {
		v.fail("%d streams completed, none started before its placement committed: the gateways never took the replica's path (%s)", done, p.String())
	}
	if n := p.get(unconfirmedCounter); n > 0 {
		v.fail("%g placements stayed unconfirmed past the gateways' dispatch deadline (%s): their requests ran with no placement, holder or recovery", n, unconfirmedBound)
	}
	return v
}
