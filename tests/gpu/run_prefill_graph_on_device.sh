#!/usr/bin/env bash
# tests/gpu/test_prefill_graph_tbo_gpu.py and test_prefill_graph_validate_gpu.py on the GPU machine
# (RUN.md "Prefill graphs: TBO children and validation"): SGLang 0.5.23's wheel without its dependency
# tree (its DSV4 JIT kernels) and pytest from the carried cp312 wheels in .whl_dsv4/ (carry .whl_dsv4).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl_dsv4/*.whl || exit 1
mkdir -p /tmp/stub/IPython && : > /tmp/stub/IPython/__init__.py
printf 'class HTML(str):\n    pass\n\n\ndef display(*args, **kwargs):\n    return None\n' > /tmp/stub/IPython/display.py
export PYTHONPATH=/tmp/site:/tmp/stub:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
set -o pipefail
python3 -m pytest --noconftest -p no:cacheprovider -v -rA -s -W ignore::DeprecationWarning \
  tests/gpu/test_prefill_graph_tbo_gpu.py tests/gpu/test_prefill_graph_validate_gpu.py "$@" 2>&1 \
  | tee ${OUT:-/tmp}/prefill_graph_pytest.log | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed|error|^\{|Error"
