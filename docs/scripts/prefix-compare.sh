#!/usr/bin/env bash
# The prefix cache's effect and prefix routing's, apart, on real processes
# (issue 25; docs/benchmarks.md): for each repetition, `lumen dev` (3
# controllers, 2 transformer workers, one gateway) is started three times,
# fresh, with the workers' cache and the gateway's routing
#   off/off   -prefix-cache off -prefix-routing off
#   on/off    -prefix-cache on  -prefix-routing off   (the cache alone)
#   on/on     -prefix-cache on  -prefix-routing on
# and each time prefix-run.py sends the same shared-prefix requests (GROUPS
# groups' contexts, USERS users each). Per run it keeps, in OUTDIR:
#   NAME.json           prefix-run.py's TTFTs and texts
#   NAME.wK.metrics     worker K's prefix-cache, preemption and
#                       out-of-pages counters after the run
#   NAME.dev.log        lumen dev's output
# with NAME = cache-C-routing-R-REP. prefix-summary.py OUTDIR tables them.
#
# usage: docs/scripts/prefix-compare.sh OUTDIR GROUPS USERS KV_PAGES REPS
#   KV_PAGES: each worker's KV cache in 16-token pages (lumen dev -kv-pages;
#   below what the groups' contexts need, the caches are under pressure)
# env: LUMEN (default ./bin/lumen), PORT (the gateway's, default 18282)
set -euo pipefail
if [ $# -ne 5 ]; then
	echo "usage: $0 OUTDIR GROUPS USERS KV_PAGES REPS" >&2
	exit 2
fi
out=$1 groups=$2 users=$3 pages=$4 reps=$5
for v in "$groups" "$users" "$pages" "$reps"; do
	case $v in '' | *[!0-9]* | 0) echo "$0: GROUPS, USERS, KV_PAGES and REPS must be positive integers, got '$v'" >&2; exit 2 ;; esac
done
here=$(cd "$(dirname "$0")" && pwd)
lumen=${LUMEN:-./bin/lumen}
port=${PORT:-18282}
[ -x "$lumen" ] || { echo "$0: no lumen binary at $lumen (go build -o bin/lumen ./cmd/lumen, or set LUMEN)" >&2; exit 2; }
mkdir -p "$out"
commit=$(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "commit $commit, $groups groups x $users users, $pages KV pages a worker, $reps repetitions" | tee "$out/README"

pid=
dir=
stop() {
	if [ -n "$pid" ]; then
		kill -INT "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
		pid=
	fi
	if [ -n "$dir" ]; then
		rm -rf "$dir"
		dir=
	fi
}
trap stop EXIT

# waitfor CMD...: runs CMD every 100 ms until it succeeds, for at most 2 min.
waitfor() {
	for _ in $(seq 1 1200); do
		if "$@" >/dev/null 2>&1; then
			return 0
		fi
		if ! kill -0 "$pid" 2>/dev/null; then
			echo "$0: lumen dev exited; its log: $log" >&2
			return 1
		fi
		sleep 0.1
	done
	echo "$0: timed out waiting for: $*" >&2
	return 1
}

for rep in $(seq 1 "$reps"); do
	for cfg in off/off on/off on/on; do
		cache=${cfg%/*} routing=${cfg#*/}
		name=cache-$cache-routing-$routing-$rep
		log=$out/$name.dev.log
		dir=$(mktemp -d)
		"$lumen" dev -dir "$dir" -prefix-cache "$cache" -prefix-routing "$routing" -kv-pages "$pages" \
			-http "127.0.0.1:$port" >"$log" 2>&1 &
		pid=$!
		waitfor grep -q 'metrics http://' "$log"
		waitfor curl -sf "http://127.0.0.1:$port/readyz"
		python3 "$here/prefix-run.py" "$port" "$out/$name.json" "$groups" "$users"
		k=0
		for url in $(grep -o 'metrics http://[^ ]*' "$log" | awk '{print $2}'); do
			k=$((k + 1))
			curl -sf "$url" | grep -E '^lumen_worker_(prefix_cache_(queries|hits)_total|step_out_of_pages_total|num_preemptions_total)' \
				>"$out/$name.w$k.metrics" || true
		done
		stop
	done
done
echo "done: python3 $here/prefix-summary.py $out"
