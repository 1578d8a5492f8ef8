#!/usr/bin/env bash
# Run a command N times in a row with two busy-loop processes beside it (docs/testing.md, "Under load"):
#   scripts/under_load.sh 20 -- python -m pytest -q tests/dp2/test_differential.py
#   scripts/under_load.sh 1 -- .ci/run
# Stops at the first failing run; prints one line per run and the busy loops' CPU share at the end.
set -uo pipefail
n="${1:?usage: under_load.sh N -- command...}"
shift
[[ "${1:-}" == "--" ]] && shift
(( $# )) || { echo "usage: under_load.sh N -- command..." >&2; exit 2; }

busy=()
for _ in 1 2; do
  ( while :; do :; done ) &
  busy+=("$!")
done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT

log="$(mktemp -t under-load-XXXXXX.log)"
passed=0
for ((i = 1; i <= n; i++)); do
  t0=$(date +%s)
  if "$@" >"$log" 2>&1; then
    passed=$((passed + 1))
    echo "run $i/$n: ok ($(( $(date +%s) - t0 )) s, load $(cut -d' ' -f1 /proc/loadavg))"
  else
    rc=$?
    echo "run $i/$n: FAILED rc=$rc ($(( $(date +%s) - t0 )) s); its output: $log"
    tail -n 40 "$log"
    exit 1
  fi
done
echo "$passed/$n green with two busy loops beside the command"
rm -f "$log"
