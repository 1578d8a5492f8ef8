#!/usr/bin/env bash
# tests/gpu/dp2_idle.py on the GPU machine (RUN.md "2026-12-02: DP2 idle maximum"): the native DP2 exchange between
# two processes with no GPU work, >= 200,000 exchanges per configuration (unpinned / one core per rank / stock's
# SGLANG_SET_CPU_AFFINITY halves / longer and no spin / busy processes on the host), p50/p99/p99.9/max per rank and
# the ten largest calls each with what explains them. Carry `.whl/` (needs only cffi + pycparser from it); builds
# `_dp2_native` there with cffi. Extra arguments go to dp2_idle.py (e.g. --only NAME,... --iters N).
# Writes $OUT/dp2_idle.json and $OUT/dp2_idle.log; exit code 1 if any exchanged value was wrong.
OUT=${OUT:-/tmp/dp2_idle_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/cffi-*.whl .whl/pycparser-*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi -L; nproc; uname -r
python3 -c "
import importlib.util as u
s = u.spec_from_file_location('dsh_build', 'native/build.py'); m = u.module_from_spec(s); s.loader.exec_module(m)
print(m.dp2_ffibuilder.compile(tmpdir='.'))" > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
cp dspark_harden/_dp2_native*.so src/dspark_harden/ && ls src/dspark_harden/_dp2_native*.so
grep -E "^(cpu |procs_running)" /proc/stat
# the scheduler facts the outliers depend on: tick rate, preemption model, steal / interrupt time accounting
zcat /proc/config.gz 2>/dev/null | grep -E "^CONFIG_HZ=|^CONFIG_PREEMPT_(NONE|VOLUNTARY|LAZY)=|^CONFIG_PREEMPT=|PARAVIRT_TIME|IRQ_TIME_ACC"
cat /sys/kernel/debug/sched/preempt 2>/dev/null
set -o pipefail
python3 tests/gpu/dp2_idle.py --deadline-s 20 --json "$OUT/dp2_idle.json" "$@" 2>&1 | tee "$OUT/dp2_idle.log"
