#!/bin/sh
# issue24-study.sh OUT [SEEDS]: issue 24's failure-domain and replica study
# in the simulator (docs/benchmarks.md, "Issue 24"): 64 Qwen3-14B/H100
# workers at the seed's stress on the quick timeline, 8 a node, each
# failure pattern and replication factor at each seed, six columns on the
# same arrivals. One JSON per run in OUT (the shape `lumen sim -json`
# writes); docs/scripts/issue24-summary.py OUT tabulates them.
set -eu
OUT=${1:?usage: issue24-study.sh OUT [SEEDS]}
SEEDS=${2:-"1 2 3"}
LUMEN=${LUMEN:-./bin/lumen}
COLS=no-checkpoint-no-failure,lumen-no-failure,stop-and-restart,fixed-checkpoint,lumen-no-spec,lumen
mkdir -p "$OUT"
for S in $SEEDS; do
	# name                 arguments
	while read -r name args; do
		f="$OUT/$name-s$S.json"
		[ -s "$f" ] && continue # done in an earlier, interrupted run
		echo "== $name seed $S: $args"
		# shellcheck disable=SC2086 # args are words
		$LUMEN sim -workers 64 -stress -quick -apply-timing=false -columns $COLS -gpus-per-node 8 \
			-seed "$S" -json "$f.tmp" $args >"$OUT/$name-s$S.log" 2>&1
		mv "$f.tmp" "$f"
	done <<RUNS
one-r1        -fail 1
node-blind-r1 -fail-nodes 1 -fail 0 -domains blind
node-aware-r1 -fail-nodes 1 -fail 0
two-r1        -fail 2
two-r2        -fail 2 -checkpoint-replicas 2
nodeplus1-r1  -fail-nodes 1 -fail 1
nodeplus1-r2  -fail-nodes 1 -fail 1 -checkpoint-replicas 2
RUNS
done
