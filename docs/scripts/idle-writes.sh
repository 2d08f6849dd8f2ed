#!/bin/sh
# idle-writes.sh WORKERS [SECONDS]: issue 26's idle Raft writes on real
# processes. Starts `lumen dev` with WORKERS synthetic workers and one
# gateway, waits until it is ready and 10 s more, then reads
# lumen_controller_fsm_apply_seconds_count on ctl1 (every applied command,
# by type) twice, SECONDS apart (default 60), and prints the commands
# applied per second by type. No request is sent.
set -eu
W=${1:?usage: idle-writes.sh WORKERS [SECONDS]}
T=${2:-60}
LUMEN=${LUMEN:-./bin/lumen}
DIR=$(mktemp -d)
PORT=$((20000 + $$ % 20000))
: >"$DIR/dev.out"
"$LUMEN" dev -dir "$DIR" -engine synthetic -workers "$W" -http "127.0.0.1:$PORT" >"$DIR/dev.out" 2>&1 &
DEV=$!
trap 'kill -INT $DEV 2>/dev/null; wait $DEV 2>/dev/null; rm -rf "$DIR"' EXIT
i=0
until grep -q "Ctrl-C stops everything" "$DIR/dev.out"; do
	i=$((i + 1))
	if [ $i -gt 600 ] || ! kill -0 $DEV 2>/dev/null; then
		cat "$DIR/dev.out"
		exit 1
	fi
	sleep 0.5
done
DASH=$(sed -n 's|.*dashboard *http://\([^/]*\)/ui.*|\1|p' "$DIR/dev.out" | head -1)
sleep 10
scrape() { curl -fsS "http://$DASH/metrics" | sed -n 's/^lumen_controller_fsm_apply_seconds_count{command="\([a-z_]*\)"} \([0-9.e+]*\)$/\1 \2/p'; }
scrape >"$DIR/a"
sleep "$T"
scrape >"$DIR/b"
echo "lumen dev, $W workers, idle for ${T}s: commands applied on ctl1 per second, by type"
join -a 2 -e 0 -o 0,1.2,2.2 "$DIR/a" "$DIR/b" | awk -v t="$T" '{d = $3 - $2; tot += d; printf "  %-22s %6d  %6.2f/s\n", $1, d, d / t} END {printf "  %-22s %6d  %6.2f/s\n", "all", tot, tot / t}'
