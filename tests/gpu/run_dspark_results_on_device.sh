#!/usr/bin/env bash
# tests/gpu/test_dspark_results_gpu.py and `bench dspark-results` on the GPU machine (RUN.md "DSpark
# result materializer"): torch + CUDA only; pytest 8 + pytest-forked from the carried wheels when present.
[ -d .whl_dsv4 ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_dsv4/pytest*.whl .whl_dsv4/pluggy*.whl .whl_dsv4/iniconfig*.whl .whl_dsv4/packaging*.whl .whl_dsv4/py-*.whl || exit 1; }
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
set -o pipefail
python3 -m pytest --noconftest -p no:cacheprovider -v -rA -W ignore::DeprecationWarning tests/gpu/test_dspark_results_gpu.py 2>&1 \
  | tee $OUT/dspark_results_pytest.log | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed|error|^\{|pytest-" ; rc=$?
# the bench, three regimes, 2 runs each; a wrong list makes the command exit 1 (and this script fail)
for regime in "--busy-ms 2.0 --cpu-ms 0.5" "--busy-ms 0.2 --cpu-ms 1.0" "--busy-kind gemm --busy-ms 2.0 --cpu-ms 0.5"; do
  for i in 1 2; do
    python3 -m dspark_harden.dspark_results.bench --json --steps 2000 $regime 2>&1 | tee -a $OUT/bench_dspark_results.jsonl | tail -1 || rc=1
  done
done
exit $rc
