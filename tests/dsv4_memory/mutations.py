"""Mutation runs of the planner guard's check at the step's result sync (docs/dsv4_memory.md, "Planner
bounds guards"): each mutation is applied to the source, the named test runs (it must fail), the file is
restored. Not collected by pytest. Usage: python tests/dsv4_memory/mutations.py [R1 R2 ...]
(the device-side guard's own mutations run on the GPU machine: tests/gpu/guard_mutations.sh)."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.join(REPO, "src", "dspark_harden", "dsv4_memory") + os.sep
T = "tests/dsv4_memory/test_result_sync_cpu.py::"
MUTS = [
    (
        "R1 the wrapper checks after stock processed the step (its tokens appended and streamed)",
        "planner.py",
        "            guard.report_all(AT_RESULT_SYNC)\n        return stock(self, batch, result, *args, **kwargs)",
        "            out = stock(self, batch, result, *args, **kwargs)\n            guard.report_all(AT_RESULT_SYNC)\n"
        "            return out\n        return stock(self, batch, result, *args, **kwargs)",
        T + "test_a_step_whose_plan_published_a_violation_fails_at_its_result_sync_before_any_token_is_appended",
    ),
    (
        "R2 no check at the result sync",
        "planner.py",
        "            guard.report_all(AT_RESULT_SYNC)\n",
        "            pass\n",
        T + "test_a_step_whose_plan_published_a_violation_fails_at_its_result_sync_before_any_token_is_appended",
    ),
    (
        "R3 the wrapper reads the mirror without waiting for the step's result copy",
        "planner.py",
        "            if done is not None:\n                done.synchronize()",
        "            if done is not None:\n                pass",
        T + "test_a_step_whose_plan_published_a_violation_fails_at_its_result_sync_before_any_token_is_appended",
    ),
    (
        "R4 without a copy event (non-overlap) the wrapper does not wait for the stream",
        "planner.py",
        "            else:\n                guard.sync_current_streams()",
        "            else:\n                pass",
        T + "test_without_a_copy_event_the_wrapper_waits_for_the_stream_before_reading",
    ),
    (
        "R5 the feature does not bind the result-sync wraps",
        "feature.py",
        "            for target, fp in S.RESULT_SYNC_TARGETS.items()\n",
        "            for target, fp in S.RESULT_SYNC_TARGETS.items()\n            if False\n",
        T + "test_a_step_whose_plan_published_a_violation_fails_at_its_result_sync_before_any_token_is_appended",
    ),
]
sys.path.insert(0, REPO)
from tests._mutations import run  # noqa: E402

survivors = run(ROOT, MUTS, timeout=600, summary=True)
sys.exit(1 if survivors else 0)
