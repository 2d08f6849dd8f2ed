#!/usr/bin/env python3
"""figure-summary.py FIGURE.json ...: issue 22's 64-worker figures
(lumen sim -figure failures|proportional|load -stress -json F), one line a
point: stop-and-restart's degradation over the affected requests
(affected TTFT and TPOT against the failure-free reference), lumen's TTFT
mean and p99 against every other failed column and the oracle's gain over
stop-and-restart, and a line for every column lumen is behind on TTFT mean
or p99 ("lumen never behind any of its ablations at any point")."""
import json
import sys

OTHERS = ["stop-and-restart", "recompute", "fixed-checkpoint", "lumen-no-spec"]


def rel(a, b):
    return 100.0 * (a - b) / b


def main():
    for path in sys.argv[1:]:
        d = json.load(open(path))
        print(f"{path}: {d.get('name')} ({d.get('x_label')})")
        for p in d["points"]:
            cs = p["columns"]
            lu, sr = cs["lumen"], cs["stop-and-restart"]
            deg_t = sr["affected_ttft_mean_ms"] / sr["reference_affected_ttft_mean_ms"]
            deg_p = sr["affected_tpot_mean_ms"] / sr["reference_affected_tpot_mean_ms"]
            parts = []
            behind = []
            for o in OTHERS:
                if o not in cs:
                    continue
                m = rel(lu["ttft_mean_ms"], cs[o]["ttft_mean_ms"])
                q = rel(lu["ttft_p99_ms"], cs[o]["ttft_p99_ms"])
                parts.append(f"vs {o} {m:+.1f}% / {q:+.1f}%")
                if m > 0:
                    behind.append(f"{o} mean {m:+.1f}%")
                if q > 0:
                    behind.append(f"{o} p99 {q:+.1f}%")
            orc = ""
            if "oracle" in cs:
                om = rel(cs["oracle"]["ttft_mean_ms"], sr["ttft_mean_ms"])
                gap = sr["ttft_mean_ms"] - cs["oracle"]["ttft_mean_ms"]
                closed = 100.0 * (sr["ttft_mean_ms"] - lu["ttft_mean_ms"]) / gap if gap else float("nan")
                orc = f"; oracle vs SR {om:+.1f}%, gap closed {closed:.0f}%"
            print(f"  x={p['x']}: SR x{deg_t:.2f} TTFT, x{deg_p:.2f} TPOT; lumen TTFT mean / p99 " + ", ".join(parts) + orc)
            if behind:
                print(f"  x={p['x']}: lumen behind: " + "; ".join(behind))


if __name__ == "__main__":
    main()
