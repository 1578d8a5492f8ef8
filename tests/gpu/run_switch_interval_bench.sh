#!/usr/bin/env bash
# `bench dspark-results` under three GIL switch intervals (0 = the interpreter's 5 ms, 200 µs = the default, 50 µs) in the
# regimes of run_dspark_results_on_device.sh (the third, 0.2 ms GPU / 1 ms Python, with THIRD=1), 2 runs each (torch + CUDA only; RUN.md). A wrong list
# makes the bench exit 1 and this script fail.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
rc=0
for si in 0 200 50; do
  for regime in "--busy-kind gemm --busy-ms 2.0 --cpu-ms 0.5" "--busy-ms 2.0 --cpu-ms 0.5" ${THIRD:+"--busy-ms 0.2 --cpu-ms 1.0"}; do
    for i in 1 2; do
      python3 -m dspark_harden.dspark_results.bench --json --steps 2000 --switch-interval-us $si $regime \
        >>"$OUT/bench_switch_interval.jsonl" || rc=1
      tail -1 "$OUT/bench_switch_interval.jsonl" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print(r["switch_interval_us"]["harden"], r["busy_kind"], r["busy_ms"], r["cpu_ms"], "stock", r["stock"]["blocked_us_p50"], "harden", r["harden"]["blocked_us_p50"], "ratio", r["blocked_p50_ratio_stock_over_harden"], "submit", r["harden"]["submit_us_p50"], "step", r["stock"]["step_us_p50"], r["harden"]["step_us_p50"], "thread", r["harden"]["converted_by_thread"], "identical", r["identical"])'
    done
  done
done
exit $rc
