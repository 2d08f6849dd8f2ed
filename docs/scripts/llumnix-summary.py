#!/usr/bin/env python3
"""llumnix-summary.py DIR COMMIT: the goals table of docs/benchmarks.md's
"Issue 23" section from the runs docs/scripts/llumnix-sweep.sh wrote in DIR:
for each arrival process and rate set, lumen's gains against infaas++ at the
best point (trace and rate) of the mean over the seeds, as Llumnix reports
its largest gaps; preemption loss as the mean over points; throughput at the
worst point; and lumen's migration downtime against its decode step."""
import glob
import json
import os
import re
import statistics
import sys

GOALS = [  # key, label, goal, better
    ("prefill_p99_x", "P99 prefill × (goal 14.8)", 14.8, max),
    ("prefill_mean_x", "mean prefill × (goal 7.7)", 7.7, max),
    ("e2e_mean_x", "mean end-to-end × (goal 1.5)", 1.5, max),
    ("decode_p99_x", "P99 decode × (goal 2.0)", 2.0, max),
]


def main():
    d, c = sys.argv[1], sys.argv[2]
    runs = {}
    for f in glob.glob(os.path.join(d, f"sim-llumnix-*-seed*-{c}.json")):
        m = re.match(rf"sim-llumnix-(llumnix|saturation)-(\w+)-seed(\d+)-{c}\.json", os.path.basename(f))
        if m:
            runs.setdefault((m.group(2), m.group(1)), {})[int(m.group(3))] = json.load(open(f))
    arrivals = sorted({a for a, _ in runs}, key=lambda a: (a != "poisson", a))
    header = ["goal"] + [f"{a}, {'Llumnix rates' if r == 'llumnix' else 'saturation'}"
                         for a in arrivals for r in ("llumnix", "saturation") if (a, r) in runs]
    rows = {g[1]: [] for g in GOALS}
    extra = {"preemption loss −70% (mean over points)": [], "throughput no more than 1% lower (worst point)": [],
             "downtime p50 / decode mean (lumen, mean over points)": [], "seeds": []}
    for a in arrivals:
        for r in ("llumnix", "saturation"):
            if (a, r) not in runs:
                continue
            seeds = runs[(a, r)]
            # A point is a trace's k-th rate: at saturation the rates are
            # fractions of each seed's own measured saturation, so they
            # differ between seeds; the label is seed 1's (or the first).
            points = {}
            for s, data in sorted(seeds.items()):
                nth = {}
                for p in data["points"]:
                    k = nth[p["trace"]] = nth.get(p["trace"], -1) + 1
                    points.setdefault((p["trace"], k), []).append(p)
            points = {(ps[0]["trace"], ps[0]["rate_per_s"]): ps for ps in points.values()}
            mean = {k: {g: statistics.mean(p["gains_vs_infaas"][g] for p in ps) for g in ps[0]["gains_vs_infaas"]}
                    for k, ps in points.items()}
            for key, label, goal, better in GOALS:
                k = better(mean, key=lambda k: mean[k][key])
                v = mean[k][key]
                rows[label].append(f"{v:.2f}× ({k[0]} at {k[1]:g}){'' if v >= goal else ': missed'}")
            loss = statistics.mean(m["preemption_loss_per_req_pct"] for m in mean.values())
            extra["preemption loss −70% (mean over points)"].append(f"{loss:+.1f}%{'' if loss <= -70 else ': missed'}")
            worst = min(m["throughput_pct"] for m in mean.values())
            extra["throughput no more than 1% lower (worst point)"].append(f"{worst:+.2f}%{'' if worst >= -1 else ': missed'}")
            dts, decs = [], []
            for ps in points.values():
                for p in ps:
                    lu = p["columns"]["lumen"]
                    if "downtime_p50_ms" in lu:
                        dts.append(lu["downtime_p50_ms"])
                        decs.append(lu["decode_mean_ms"])
            if dts:
                extra["downtime p50 / decode mean (lumen, mean over points)"].append(
                    f"{statistics.mean(dts):.0f} / {statistics.mean(decs):.0f} ms ({statistics.mean(dts) / statistics.mean(decs):.2f} steps)")
            else:
                extra["downtime p50 / decode mean (lumen, mean over points)"].append("—")
            extra["seeds"].append(",".join(str(s) for s in sorted(seeds)))
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for label, cells in list(rows.items()) + list(extra.items()):
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
