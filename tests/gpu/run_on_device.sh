#!/usr/bin/env bash
# How tests/gpu (and the native traversal tests that need no SGLang) run on the GPU machine: see RUN.md.
# Expects .whl/ (cp312 wheels + the 32k tokenizer, RUN.md says how to prepare it); writes logs under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit 1; export DSPARK_HARDEN_MODEL_CACHE=$PWD/.whl/models PYTHONUNBUFFERED=1; nvidia-smi -L; nproc
# both cffi modules: the two-rank test in tests/gpu needs the DP2 exchange too
python3 -c "import importlib.util as u; s=u.spec_from_file_location('dsh_build','native/build.py'); m=u.module_from_spec(s); s.loader.exec_module(m); print(m.dp2_ffibuilder.compile(tmpdir='.')); print(m.traverse_ffibuilder.compile(tmpdir='.'))" > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
cp dspark_harden/_dp2_native*.so dspark_harden/_traverse_native*.so src/dspark_harden/ && ls src/dspark_harden/*.so
set -o pipefail; python3 -m pytest --noconftest -p no:cacheprovider -v -rA -W ignore::DeprecationWarning tests/gpu --ignore=tests/gpu/test_dsv4_memory_gpu.py --ignore=tests/gpu/test_dsv4_selftest_gpu.py tests/dspark_masks/test_native_traversal.py -k "not factory and not end_is_clipped and not fail_closed" 2>&1 | tee $OUT/gpu_pytest.log | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed|error" ; rc=$?
# engine timings: every engine compared with one independent reference (workload.reference_masks);
# any engine that differs fails the run (exit 3)
python3 -c "
import json, sys
from dspark_harden.dspark_masks.bench import native_engine_times as f
ok = True
for r in (f(64, 8, threads=(2, 4, 8)), f(256, 8, steps=10, threads=(2, 4, 8, 16))):
    print(json.dumps(r))
    bad = [k for k, v in r['engines_ms'].items() if not v['identical']]
    if bad or not r['all_identical']:
        print('ENGINES DIFFER FROM THE REFERENCE: ' + ', '.join(bad), file=sys.stderr); ok = False
sys.exit(0 if ok else 3)
" 2>&1 | tee $OUT/engines.log | tail -3; erc=${PIPESTATUS[0]}
[ $rc -ne 0 ] && exit $rc
exit $erc
