#!/usr/bin/env bash
# Start-up time of `xds-server status` (against a closed admin port: start-up plus one refused
# connect), 10 runs each of two checkouts, alternating. Usage: bash benchmarks/cli_start.sh OLD NEW
# (each a checkout of this repository; the .venv of NEW runs both: `python -m` imports from the cwd).
OLD=${1:?usage: cli_start.sh OLD NEW}; NEW=${2:?usage: cli_start.sh OLD NEW}
PY=$NEW/.venv/bin/python
for i in 1 2 3 4 5 6 7 8 9 10; do
  for d in "$OLD" "$NEW"; do
    s=$(date +%s.%N); (cd "$d" && $PY -m xds_server.cli status --admin 127.0.0.1:1 >/dev/null 2>&1); e=$(date +%s.%N)
    echo "$d $(echo "$e - $s" | bc)"
  done
done | awk '{a[$1]+=$2; n[$1]++; if(!($1 in mn)||$2<mn[$1])mn[$1]=$2} END {for(k in a) printf "%s mean %.3f s min %.3f s (n=%d)\n", k, a[k]/n[k], mn[k], n[k]}'
