#!/usr/bin/env python3
"""Tables what docs/scripts/prefix-compare.sh wrote (issue 25; docs/benchmarks.md).

usage: python3 docs/scripts/prefix-summary.py OUTDIR

For each cache / routing configuration: the median over the repetitions of
the TTFT mean, p50 and p90 (ms, of every request of a run), of the share of
the prompt tokens looked up that the workers' prefix caches held (both
workers' lumen_worker_prefix_cache_hits_total over queries_total), and of
the outputs differing from the off/off run of the same repetition (the
oracle: greedy outputs are identical however a request was served); the
preemptions and the steps short of pages, summed over every run.
"""
import glob
import json
import os
import re
import statistics
import sys

CONFIGS = [("off", "off"), ("on", "off"), ("on", "on")]


def pct(xs, q):
    """The q-quantile of xs by linear interpolation between ranks."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def counters(out, name):
    """Sums each worker counter of run name over its workers."""
    sums = {}
    for path in glob.glob(os.path.join(out, name + ".w*.metrics")):
        for line in open(path):
            m = re.match(r"^(\w+)(\{[^}]*\})?\s+(\S+)", line)
            if m:
                sums[m.group(1)] = sums.get(m.group(1), 0.0) + float(m.group(3))
    return sums


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: prefix-summary.py OUTDIR")
    out = sys.argv[1]
    runs = {}
    for path in glob.glob(os.path.join(out, "cache-*-routing-*-*.json")):
        m = re.match(r"cache-(on|off)-routing-(on|off)-(\d+)\.json$", os.path.basename(path))
        if m:
            runs[(m.group(1), m.group(2), int(m.group(3)))] = json.load(open(path))
    if not runs:
        sys.exit("prefix-summary.py: no cache-C-routing-R-REP.json in %s (run prefix-compare.sh first)" % out)
    reps = sorted({r for _, _, r in runs})
    if os.path.exists(os.path.join(out, "README")):
        print(open(os.path.join(out, "README")).read().strip())
    print()
    print("| cache / routing | runs | TTFT mean ms | p50 | p90 | hit tokens | outputs differing | preemptions | steps short of pages |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for cache, routing in CONFIGS:
        means, p50s, p90s, hits, diffs = [], [], [], [], []
        preempt = short = 0
        n = 0
        for rep in reps:
            run = runs.get((cache, routing, rep))
            if run is None:
                continue
            n += 1
            ttft = [1000 * t for t in run["ttft"] if t is not None]
            means.append(statistics.mean(ttft))
            p50s.append(pct(ttft, 0.5))
            p90s.append(pct(ttft, 0.9))
            c = counters(out, "cache-%s-routing-%s-%d" % (cache, routing, rep))
            q = c.get("lumen_worker_prefix_cache_queries_total", 0)
            if q > 0:
                hits.append(100 * c.get("lumen_worker_prefix_cache_hits_total", 0) / q)
            preempt += int(c.get("lumen_worker_num_preemptions_total", 0))
            short += int(c.get("lumen_worker_step_out_of_pages_total", 0))
            ref = runs.get(("off", "off", rep))
            if ref is not None and (cache, routing) != ("off", "off"):
                diffs.append(sum(a != b for a, b in zip(run["text"], ref["text"])) + abs(len(run["text"]) - len(ref["text"])))
        if n == 0:
            continue
        hit = "%.0f%%" % statistics.median(hits) if hits else "—"
        diff = "%d" % statistics.median(diffs) if diffs else "—"
        print("| %s / %s | %d | %.0f | %.0f | %.0f | %s | %s | %d | %d |" % (cache, routing, n, statistics.median(means),
              statistics.median(p50s), statistics.median(p90s), hit, diff, preempt, short))


if __name__ == "__main__":
    main()
