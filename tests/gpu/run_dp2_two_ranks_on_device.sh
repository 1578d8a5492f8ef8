#!/usr/bin/env bash
# tests/gpu/test_dp2_mask_pipeline_two_ranks.py on the GPU machine (RUN.md "Two DP ranks"): carries .whl/
# (xgrammar set + cffi + the 2048-token tokenizer), builds both cffi modules there, writes $OUT/dp2_two_ranks.json.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src DSPARK_HARDEN_MODEL_CACHE=$PWD/.whl/models PYTHONUNBUFFERED=1
nvidia-smi -L; nproc
python3 -c "
import importlib.util as u
s = u.spec_from_file_location('dsh_build', 'native/build.py'); m = u.module_from_spec(s); s.loader.exec_module(m)
print(m.dp2_ffibuilder.compile(tmpdir='.')); print(m.traverse_ffibuilder.compile(tmpdir='.'))" > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
cp dspark_harden/_dp2_native*.so dspark_harden/_traverse_native*.so src/dspark_harden/ && ls src/dspark_harden/*.so
set -o pipefail
python3 -m pytest --noconftest -p no:cacheprovider -v -rA -s -W ignore::DeprecationWarning tests/gpu/test_dp2_mask_pipeline_two_ranks.py 2>&1 \
  | tee $OUT/dp2_two_ranks_pytest.log | grep -E "PASS|FAIL|ERROR|passed|failed|error|^\[" ; exit $?
