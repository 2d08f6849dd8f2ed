#!/usr/bin/env python3
"""issue24-summary.py DIR [MERGED.json]: the tables of docs/benchmarks.md's
"Issue 24" section from the runs docs/scripts/issue24-study.sh wrote in DIR,
and, when MERGED is given, one JSON of every run (run name -> column ->
figures) for `lumen plot` (internal/plot/replicas.go)."""
import glob
import json
import os
import sys

PATTERNS = [  # run prefix, label, R
    ("one-r1", "one random worker", 1),
    ("node-blind-r1", "node of 8, domain-blind", 1),
    ("node-aware-r1", "node of 8, domain-aware", 1),
    ("two-r1", "two random workers", 1),
    ("two-r2", "two random workers", 2),
    ("nodeplus1-r1", "node + one worker", 1),
    ("nodeplus1-r2", "node + one worker", 2),
]


def load(d):
    runs = {}
    for f in sorted(glob.glob(os.path.join(d, "*-s*.json"))):
        name = os.path.basename(f)[: -len(".json")]
        data = json.load(open(f))
        runs[name] = data[next(iter(data))]  # the one setup, "custom"
    return runs


def pct(a, b):
    return f"{(a / b - 1) * 100:+.1f}%"


def main():
    d = sys.argv[1]
    runs = load(d)
    if len(sys.argv) > 2:
        json.dump(runs, open(sys.argv[2], "w"), indent=1, sort_keys=True)
    print("| failure | R | seed | interrupted | restored (lumen) | checkpointed (lumen) | live copy (lumen) "
          "| restored (fixed-ckpt) | tokens recomputed lumen / FC | TTFT mean lumen / S&R ms | lumen vs S&R "
          "| affected TTFT lumen / S&R ms | lumen vs S&R |")
    print("|" + "---|" * 13)
    means = {}
    for prefix, label, r in PATTERNS:
        for name in sorted(n for n in runs if n.rsplit("-s", 1)[0] == prefix):
            seed = name.rsplit("-s", 1)[1]
            c = runs[name]
            lu, sr, fc = c["lumen"], c["stop-and-restart"], c["fixed-checkpoint"]
            row = [lu["restored_fraction"], lu.get("checkpointed_fraction", float("nan")),
                   lu["checkpoint_live_fraction"], fc["restored_fraction"],
                   lu["ttft_mean_ms"], sr["ttft_mean_ms"],
                   lu["common_affected_ttft_mean_ms"], sr["common_affected_ttft_mean_ms"]]
            means.setdefault((prefix, label, r), []).append(row)
            print(f"| {label} | {r} | {seed} | {lu['interrupted']} | {row[0]:.3f} | {row[1]:.3f} | {row[2]:.3f} "
                  f"| {row[3]:.3f} | {lu['tokens_recomputed']:.0f} / {fc['tokens_recomputed']:.0f} "
                  f"| {row[4]:.1f} / {row[5]:.1f} | {pct(row[4], row[5])} "
                  f"| {row[6]:.1f} / {row[7]:.1f} | {pct(row[6], row[7])} |")
    print()
    print("| failure | R | seeds | restored (lumen) | checkpointed (lumen) | live copy (lumen) | restored (fixed-ckpt) "
          "| TTFT lumen / S&R ms | lumen vs S&R | affected TTFT lumen / S&R ms | lumen vs S&R |")
    print("|" + "---|" * 11)
    for (prefix, label, r), rows in means.items():
        m = [sum(x[i] for x in rows) / len(rows) for i in range(len(rows[0]))]
        print(f"| {label} | {r} | {len(rows)} | {m[0]:.3f} | {m[1]:.3f} | {m[2]:.3f} | {m[3]:.3f} "
              f"| {m[4]:.1f} / {m[5]:.1f} | {pct(m[4], m[5])} | {m[6]:.1f} / {m[7]:.1f} | {pct(m[6], m[7])} |")
    print()
    print("Steady state, the lumen-no-failure column of the node-and-one-worker runs:")
    print()
    print("| seed | R | TTFT mean ms | TTFT p99 ms | TPOT mean ms | checkpoint host memory mean / peak GB "
          "| checkpoint bytes sent TB |")
    print("|" + "---|" * 7)
    for name in sorted(n for n in runs if n.startswith("nodeplus1-")):
        nf = runs[name]["lumen-no-failure"]
        r = 2 if "-r2-" in name else 1
        print(f"| {name.rsplit('-s', 1)[1]} | {r} | {nf['ttft_mean_ms']:.2f} | {nf['ttft_p99_ms']:.1f} "
              f"| {nf['tpot_mean_ms']:.3f} | {nf['checkpoint_host_mean_bytes'] / 1e9:.0f} / "
              f"{nf['checkpoint_host_peak_bytes'] / 1e9:.0f} | {nf['checkpoint_bytes_sent'] / 1e12:.2f} |")


if __name__ == "__main__":
    main()
