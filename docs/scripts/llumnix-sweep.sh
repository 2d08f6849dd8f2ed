#!/bin/sh
# llumnix-sweep.sh OUT COMMIT [SEEDS]: issue 23's Llumnix evaluation in the
# simulator (docs/benchmarks.md, "Issue 23"): every trace, Poisson and Gamma
# arrivals of CV 2, 4, 6 and 8, at Llumnix's request rates and at 0.85-1 of
# the simulated saturation, each seed. One JSON a run, named as the docs
# name them; a run already written is skipped, so an interrupted sweep
# resumes. docs/scripts/llumnix-summary.py OUT COMMIT tabulates them.
set -eu
OUT=${1:?usage: llumnix-sweep.sh OUT COMMIT [SEEDS]}
C=${2:?usage: llumnix-sweep.sh OUT COMMIT [SEEDS]}
SEEDS=${3:-"1 2 3"}
LUMEN=${LUMEN:-./bin/lumen}
mkdir -p "$OUT"
for A in poisson gamma:2 gamma:4 gamma:6 gamma:8; do
	tag=$(echo "$A" | tr -d ':')
	for R in llumnix saturation; do
		for S in $SEEDS; do
			f="$OUT/sim-llumnix-$R-$tag-seed$S-$C.json"
			[ -s "$f" ] && continue
			echo "== $R $A seed $S"
			$LUMEN sim -figure llumnix -rates "$R" -arrivals "$A" -seed "$S" -json "$f.tmp" >"$f.log" 2>&1
			mv "$f.tmp" "$f"
		done
	done
done
