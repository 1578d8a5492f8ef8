"""Mutation runs of docs/dspark_results.md: each mutation is applied to the feature's source, the named
test runs (it must fail), the file is restored. Not collected by pytest. Usage:
python tests/dspark_results/mutations.py [M1 M2 ...]"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.join(REPO, "src", "dspark_harden", "dspark_results") + os.sep
MUTS = [
    (
        "M1 wait() ignores a dead thread",
        "materializer.py",
        '            if not self._thread.is_alive():\n                self._count("thread_dead")\n                raise MaterializerError(\n                    f"DSpark result of step {done.seq}: the materializer thread died',
        '            if False:\n                self._count("thread_dead")\n                raise MaterializerError(\n                    f"DSpark result of step {done.seq}: the materializer thread died',
        "tests/dspark_results/test_fail_closed.py::test_dead_thread_is_detected_at_once_not_after_the_timeout",
    ),
    (
        "M2 wait() without a deadline",
        "materializer.py",
        "            if time.perf_counter() > deadline:",
        "            if False:",
        "tests/dspark_results/test_fail_closed.py::test_copy_event_that_never_completes_raises_after_the_timeout",
    ),
    (
        "M3 wait() drops the materializer's error",
        "materializer.py",
        "        if done.error is not None:\n            raise MaterializerError(",
        "        if False:\n            raise MaterializerError(",
        "tests/dspark_results/test_fail_closed.py::test_materializer_exception_reraises_from_synchronize_naming_the_step",
    ),
    (
        "M4 worker loop does not signal a failure",
        "materializer.py",
        '            self._fail(done, exc, "materializer failed")\n',
        "            pass\n",
        "tests/dspark_results/test_fail_closed.py::test_materializer_exception_reraises_from_synchronize_naming_the_step",
    ),
    (
        "M14 the consumer converts without taking the step's claim",
        "materializer.py",
        "            if query is not None and query() and done.claim.acquire(blocking=False):",
        "            if query is not None and query() and (done.claim.acquire(blocking=False) or True):",
        "tests/dspark_results/test_fail_closed.py::test_consumer_waits_while_the_thread_converts_a_step_it_took",
    ),
    (
        "M15 the thread converts a step the consumer already claimed",
        "materializer.py",
        "            if not done.claim.acquire(blocking=False):\n                continue",
        "            if not done.claim.acquire(blocking=False) and False:\n                continue",
        "tests/dspark_results/test_fail_closed.py::test_consumer_converts_a_complete_step_the_thread_has_not_reached_and_nothing_converts_twice",
    ),
    (
        "M17 the copy wrapper decides by the batch's forward mode at copy time (TARGET_VERIFY there)",
        "integration.py",
        "        if submits(batch, batch_result):\n            # stock",
        "        if materializes(batch):\n            # stock",
        "tests/dspark_results/test_differential.py::test_resolve_and_advance_identical_to_stock",
    ),
    (
        "M18 the first materializer does not set the GIL switch interval",
        "integration.py",
        '            apply_switch_interval(_CONFIG["switch_interval_us"])',
        "            pass",
        "tests/dspark_results/test_feature.py::test_bound_patches_round_trip_and_materialize_through_the_live_classes",
    ),
    (
        "M16 a failed copy wait is not signalled",
        "materializer.py",
        '                    self._fail(done, exc, "copy wait failed")\n',
        "                    pass\n",
        "tests/dspark_results/test_fail_closed.py::test_copy_event_that_raises_reraises_naming_the_step",
    ),
    (
        "M5 record_of skips the step check",
        "materializer.py",
        "    if record.seq != seq or done.seq != seq:",
        "    if False:",
        "tests/dspark_results/test_differential.py::test_record_of_another_step_raises_naming_both_steps",
    ),
    (
        "M6 consumer accepts a result without a step",
        "materializer.py",
        "    if seq is None or mat is None:",
        "    if False:",
        "tests/dspark_results/test_differential.py::test_missing_record_raises_naming_the_consumer",
    ),
    (
        "M7 advance ignores finished requests' skip",
        "integration.py",
        "            if req.grammar is None or req.is_retracted or req.finished():\n                continue\n            accept_tokens",
        "            if req.grammar is None or req.is_retracted:\n                continue\n            accept_tokens",
        "tests/dspark_results/test_differential.py::test_resolve_and_advance_identical_to_stock",
    ),
    (
        "M8 resolve commits retracted requests",
        "integration.py",
        "            if req.is_retracted or req.finished():\n                pass",
        "            if req.finished():\n                pass",
        "tests/dspark_results/test_differential.py::test_resolve_and_advance_identical_to_stock",
    ),
    (
        "M9 resolve reads the raw run instead of the grammar-retained one",
        "integration.py",
        "                    accept_tokens = result.grammar_retained_tokens[i]",
        "                    accept_tokens = accept_tokens",
        "tests/dspark_results/test_differential.py::test_resolve_and_advance_identical_to_stock",
    ),
    (
        "M10 record drops cap_lens",
        "materializer.py",
        "        cap_lens=result.cap_lens.tolist() if result.cap_lens is not None else None,",
        "        cap_lens=None,",
        "tests/dspark_results/test_differential.py::test_resolve_and_advance_identical_to_stock",
    ),
    (
        "M11 logprob lists not taken from the record (top-k left as tensors)",
        "integration.py",
        '            logits_output.next_token_top_logprobs_val = lists["next_token_top_logprobs_val"]',
        "            pass",
        "tests/dspark_results/test_differential.py::test_logprob_lists_identical_to_stock",
    ),
    (
        "M12 wrapper leaves DSpark results to stock (no submit)",
        "integration.py",
        "        if submits(batch, batch_result):\n            # stock",
        "        if False:\n            # stock",
        "tests/dspark_results/test_differential.py::test_resolve_and_advance_identical_to_stock",
    ),
    (
        "M13 shutdown without a bounded join",
        "materializer.py",
        "        self._thread.join(max(0.0, deadline - time.perf_counter()))",
        "        self._thread.join()",
        "tests/dspark_results/test_fail_closed.py::test_copy_event_that_never_completes_raises_after_the_timeout",
    ),
]
sys.path.insert(0, REPO)
from tests._mutations import run  # noqa: E402

survivors = run(ROOT, MUTS, timeout=120, summary=False)
