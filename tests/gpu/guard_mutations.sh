#!/usr/bin/env bash
# Mutations of the device-side planner guard (dsv4_memory/csrc/guarded_c_plan.cuh, planner.py), run on the
# GPU machine after run_dsv4_on_device.sh has installed the carried wheels into /tmp/site (RUN.md). Each
# mutation is applied to this checkout's copy, the tests named with it must go red (SGLang's JIT keys its
# cache on the source text, so a mutated .cuh is recompiled), and the file is restored. Exits 1 when any
# mutation leaves its tests green or does not apply.
set -u
export PYTHONPATH=/tmp/site:/tmp/stub:$PWD/src PYTHONUNBUFFERED=1
CUH=src/dspark_harden/dsv4_memory/csrc/guarded_c_plan.cuh
PLANNER=src/dspark_harden/dsv4_memory/planner.py
survivors=0

mutate() { # name file old new -k-expression
    local name=$1 file=$2 old=$3 new=$4 sel=$5
    cp "$file" /tmp/mutation.orig
    if ! python3 - "$file" "$old" "$new" <<'PY'; then
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"pattern found {text.count(old)} times")
open(path, "w").write(text.replace(old, new))
PY
        echo "MUTATION $name: DID NOT APPLY"
        survivors=$((survivors + 1))
        return
    fi
    python3 -m pytest --noconftest -p no:cacheprovider -q -x -W ignore::DeprecationWarning \
        tests/gpu/test_dsv4_memory_gpu.py -k "$sel" >"$OUT/mutation_$name.log" 2>&1
    local rc=$?
    cp /tmp/mutation.orig "$file"
    if [ $rc -eq 1 ] || [ $rc -ge 128 ]; then  # a failed test, or a crash (illegal address)
        echo "MUTATION $name: red ($(grep -m1 -E '^E ' "$OUT/mutation_$name.log" | sed 's/^E *//' | cut -c1-160))"
    else
        echo "MUTATION $name: SURVIVED (pytest rc $rc)"
        survivors=$((survivors + 1))
    fi
}

mutate no_length_sanitising "$CUH" 'ext_out[tx] = (s_bad || over) ? 0 : ext;' 'ext_out[tx] = ext;' \
    "device_guarded_prefill or pass_valid_plans"
mutate num_q_not_counted "$CUH" 'if (over) atomicAdd(counts + kGuardNumQ, 1);' '' \
    "device_guarded_prefill or pass_valid_plans"
mutate lens_not_counted "$CUH" 'if (s_bad) atomicAdd(counts + kGuardLens, 1);' '' \
    "device_guarded_prefill"
mutate mirror_never_written "$CUH" 'if (threadIdx.x < kGuardReasons) mirror[threadIdx.x] = counts[threadIdx.x];' \
    '(void)counts; (void)mirror;' "do_not_synchronize or metadata_report"
mutate report_not_read_per_step "$PLANNER" 'planner_device.report(planner_device.ensure_state())' \
    'planner_device.ensure_state()' "metadata_report"
echo "mutations surviving or not applied: $survivors"
[ $survivors -eq 0 ]
