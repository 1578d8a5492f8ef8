#!/usr/bin/env bash
# tests/gpu/test_dsv4_memory_gpu.py on the GPU machine (RUN.md "DSV4 eager-prefill memory"): SGLang 0.5.23's
# wheel without its dependency tree (its DSV4 JIT kernels), sgl-flash-mla 1.0.0 and the few pure-Python
# modules sglang.kernels imports, all carried as cp312 wheels in .whl_dsv4/; logs and figures under $OUT.
# WHL: the wheel directory (.whl_dsv4, or .whl_q8 for the Q8KV8 tests: no FlashMLA, plus CUTLASS headers)
# TESTS: the test file(s) (default the memory suite; tests/gpu/test_dsv4_selftest_gpu.py: the start-up self-tests)
WHL=${WHL:-.whl_dsv4}
TESTS=${TESTS:-tests/gpu/test_dsv4_memory_gpu.py}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
# sglang/utils.py imports IPython.display (notebook helpers only) at top level: a two-name stand-in
mkdir -p /tmp/stub/IPython && : > /tmp/stub/IPython/__init__.py
printf 'class HTML(str):\n    pass\n\n\ndef display(*args, **kwargs):\n    return None\n' > /tmp/stub/IPython/display.py
# the Q8KV8 kernel's JIT wants CUTLASS headers from flashinfer or deep_gemm: the headers of the
# nvidia-cutlass 4.2.0.0 wheel (cutlass_library/source/include), as a package named deep_gemm
[ -f $WHL/cutlass-include.tar.gz ] && tar -xzf $WHL/cutlass-include.tar.gz -C /tmp/stub
export PYTHONPATH=/tmp/site:/tmp/stub:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
set -o pipefail
python3 -m pytest --noconftest -p no:cacheprovider -v -rA -W ignore::DeprecationWarning $TESTS "$@" 2>&1 \
  | tee $OUT/dsv4_pytest.log | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed|error|^\{" ; rc=$?
exit $rc
