#!/usr/bin/env python3
"""setups-summary.py FILE... : issue 22's headline table from `lumen sim
-setups w4,w8,w8_f4 -seed S -json FILE` runs (one file a seed): per setup,
the means over the files of lumen's TTFT (mean, p99), TPOT, cluster
recovery and interrupted recovery against stop-and-restart and
fixed-checkpoint (relative change of the means), the oracle's against
stop-and-restart and the share of the gap lumen closes, then every place
(seed or mean) where lumen is behind a baseline or an ablation on TTFT mean
or p99, whole run or common affected requests."""
import json
import statistics
import sys

KEYS = [("ttft_mean_ms", "TTFT"), ("ttft_p99_ms", "p99"), ("tpot_mean_ms", "TPOT"),
        ("cluster_recovery_s", "cluster recovery"), ("interrupted_recovery_mean_s", "interrupted recovery")]
OTHERS = ["stop-and-restart", "recompute", "fixed-checkpoint", "lumen-no-spec"]
BEHIND = ["ttft_mean_ms", "ttft_p99_ms", "common_affected_ttft_mean_ms", "common_affected_ttft_p99_ms"]


def rel(a, b):
    return (a / b - 1) * 100 if b else float("nan")


def main():
    runs = [json.load(open(f)) for f in sys.argv[1:]]
    for setup in ["w4", "w8", "w8_f4"]:
        rs = [r[setup] for r in runs if setup in r]
        if not rs:
            continue
        m = {c: {k: statistics.mean(r[c][k] for r in rs) for k in rs[0][c] if isinstance(rs[0][c][k], (int, float))}
             for c in rs[0]}
        lu, sr, fc = m["lumen"], m["stop-and-restart"], m["fixed-checkpoint"]

        # The mean over the seeds of each seed's relative change (the
        # published tables' figure), then in brackets the change of the
        # seeds' means.
        def vs(o):
            return ", ".join(f"{n} {statistics.mean(rel(r['lumen'][k], r[o][k]) for r in rs):+.1f}% "
                             f"[{rel(lu[k], m[o][k]):+.1f}%]" for k, n in KEYS)
        print(f"{setup} ({len(rs)} seeds): lumen vs stop-and-restart: {vs('stop-and-restart')}")
        print(f"{setup}: lumen vs fixed-checkpoint: {vs('fixed-checkpoint')}")
        if "oracle" in m:
            o = m["oracle"]
            gap = (sr["ttft_mean_ms"] - lu["ttft_mean_ms"]) / (sr["ttft_mean_ms"] - o["ttft_mean_ms"]) * 100
            orel = statistics.mean(rel(r["oracle"]["ttft_mean_ms"], r["stop-and-restart"]["ttft_mean_ms"]) for r in rs)
            print(f"{setup}: oracle vs stop-and-restart: TTFT {orel:+.1f}% [{rel(o['ttft_mean_ms'], sr['ttft_mean_ms']):+.1f}%], "
                  f"TPOT {rel(o['tpot_mean_ms'], sr['tpot_mean_ms']):+.1f}%; gap closed {gap:.0f}% (of the means)")
        ref = m.get("no-checkpoint-no-failure")
        if ref:
            print(f"{setup}: stop-and-restart's degradation over the affected requests: TTFT "
                  f"{sr['affected_ttft_mean_ms'] / sr['reference_affected_ttft_mean_ms']:.1f}x, TPOT "
                  f"{sr['affected_tpot_mean_ms'] / sr['reference_affected_tpot_mean_ms']:.2f}x")
        for name, cols in [("mean", m)] + [(f"seed {i + 1}", r) for i, r in enumerate(rs)]:
            bad = [f"{k} vs {o} {rel(cols['lumen'][k], cols[o][k]):+.1f}%" for o in OTHERS for k in BEHIND
                   if o in cols and cols["lumen"][k] > cols[o][k]]
            if bad:
                print(f"{setup} {name}: lumen behind: " + "; ".join(bad))
        print()


if __name__ == "__main__":
    main()
