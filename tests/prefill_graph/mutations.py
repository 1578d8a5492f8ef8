"""Mutation runs of the TBO prefill-graph split, gate and validation, and of the DSpark draft-graph memory
decision (docs/prefill_graph.md): each mutation is applied to the feature's source, the named test runs (it
must fail), the file is restored. Not collected by pytest. Usage: python tests/prefill_graph/mutations.py
[T1 T2 ...]"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.join(REPO, "src", "dspark_harden", "prefill_graph") + os.sep
SPLIT = "tests/prefill_graph/test_tbo_split.py"
VAL = "tests/prefill_graph/test_validate.py"
MUTS = [
    (
        "T1 child B's prefix ignores the tokens child A took (a cut request)",
        "tbo_split.py",
        "(b_f, b, pre[i] + a, pre[i] + lens[i])",
        "(b_f, b, pre[i], pre[i] + lens[i])",
        SPLIT + "::test_geometry_matches_stock_eager_split_token_for_token",
    ),
    (
        "T2 child start locations not rebased (the parent's)",
        "tbo_split.py",
        '        f["extend_start_loc"] = list(_exclusive_cumsum(f["extend_seq_lens"]))',
        '        f["extend_start_loc"] = list(starts)',
        SPLIT + "::test_fixed_split_invariants_randomized",
    ),
    (
        "T3 a sentinel slot keeps the request's pool index",
        "tbo_split.py",
        '            f["req_pool_indices"].append(rpi[i] if live else 0)',
        '            f["req_pool_indices"].append(rpi[i])',
        SPLIT + "::test_fixed_split_invariants_randomized",
    ),
    (
        "T4 child A's live tokens ignore padding (min(t, n) -> t)",
        "tbo_split.py",
        "((a_f, 0, t, min(t, n)), (b_f, t, bucket, max(0, n - t)))",
        "((a_f, 0, t, t), (b_f, t, bucket, max(0, n - t)))",
        SPLIT + "::test_fixed_split_invariants_randomized",
    ),
    (
        "T5 the bucket check ignores the request axis",
        "tbo_split.py",
        "    return slots <= min(t, bucket - t)",
        "    return True",
        SPLIT + "::test_buckets_too_small_for_the_request_axis_are_refused",
    ),
    (
        "T6 the DP decision ignores the TBO gate",
        "admission.py",
        "        if dec.graph and rt.tbo_graphs:",
        "        if False:",
        "tests/prefill_graph/test_exchange.py::test_tbo_prefill_graph_gate_is_the_same_on_both_ranks_over_gloo_and_native_exchange",
    ),
    (
        "T7 the TBO gate reads the local vote instead of the min over ranks",
        "tbo_graph.py",
        "    can_run = min(int(x) for x in tp0_info_cpu[:, 4].tolist())",
        "    can_run = max(int(x) for x in tp0_info_cpu[:, 4].tolist())",
        "tests/prefill_graph/test_exchange.py::test_tbo_prefill_graph_gate_is_the_same_on_both_ranks_over_gloo_and_native_exchange",
    ),
    (
        "T8 the guard does not require the batch's TBO split",
        "admission.py",
        '        if rt.tbo_graphs and getattr(forward_batch, "tbo_split_seq_index", None) is None:',
        "        if False:",
        "tests/prefill_graph/test_guard_and_patches.py::test_tbo_graph_guard_requires_the_batch_tbo_split",
    ),
    (
        "T9 the replay skips planning an empty child (stock's zero-size skip)",
        "tbo_graph.py",
        "        for backend, child in zip(self.children, children, strict=True):\n",
        "        for backend, child in [(b, c) for b, c in zip(self.children, children) if c.live_tokens]:\n",
        SPLIT + "::test_out_graph_hook_plans_both_children_from_the_fixed_split_even_an_empty_one",
    ),
    (
        "T10 load_batch does not refresh the children's buffers",
        "tbo_graph.py",
        "        tbo_split.refresh(bufs, plugin._tbo_children_num_token_non_padded, children)",
        "        pass",
        SPLIT + "::test_load_batch_hook_refreshes_the_children_buffers_and_counts_from_the_live_batch",
    ),
    (
        "T11 the capture hook takes decode graphs too (Bugbot #2)",
        "tbo_graph.py",
        "        if not active() or not _is_extend(batch.forward_mode) or not T.is_tbo_enabled():",
        "        if not active():",
        "tests/prefill_graph/test_settings_tbo_bench.py::test_tbo_opt_in_binds_the_tbo_hooks_on_the_real_classes_and_starts",
    ),
    (
        "V1 validation does not restore the touched rows before eager",
        "validate.py",
        "        touched.restore()\n        eager_result = eager()",
        "        eager_result = eager()",
        VAL + "::test_validated_step_matches_and_leaves_exactly_one_application_of_the_side_effects",
    ),
    (
        "V2 the graph outputs are not copied before eager runs",
        "validate.py",
        "    return [(p, t.detach().clone()) for p, t in output_tensors(out)]",
        "    return [(p, t.detach()) for p, t in output_tensors(out)]",
        VAL + "::test_graph_output_aliasing_the_eager_buffer_is_copied_before_eager_runs",
    ),
    (
        "V3 the touched side state is not compared",
        "validate.py",
        "        diffs += touched.compare_to(graph_rows, self.tolerance)",
        "        diffs += []",
        "tests/prefill_graph/test_validate.py::test_mismatch_raises_naming_bucket_and_geometry_or_is_counted",
    ),
    (
        "V4 the schedule counts all buckets together",
        "validate.py",
        "        self.seen[key] += 1\n        n = self.seen[key]",
        "        self.seen[None] += 1\n        n = self.seen[None]",
        VAL + "::test_schedule_first_k_then_every_nth_per_bucket",
    ),
    (
        "V5 replays with a cached prefix are validated",
        "validate.py",
        '        return not any(int(p) for p in (getattr(forward_batch, "extend_prefix_lens_cpu", None) or []))',
        "        return True",
        VAL + "::test_execute_wrapper_on_the_real_runner_class_schedules_and_skips_prefix_steps",
    ),
    (
        "V6 a mismatch under action=raise is only counted",
        "validate.py",
        '            if self.action == "raise":',
        "            if False:",
        VAL + "::test_mismatch_raises_naming_bucket_and_geometry_or_is_counted",
    ),
    (
        "V7 the tolerance is ignored (any difference passes)",
        "validate.py",
        "        if nan_mismatch or worst > tolerance * scale:",
        "        if nan_mismatch:",
        VAL + "::test_compare_tolerance_shape_dtype_nan_and_missing",
    ),
    (
        "D1 the draft-graph memory wrap calls stock for every group (the per-rank decision restored)",
        "draft_graph.py",
        '        if getattr(group, "world_size", 1) <= 1:\n            return stock(',
        "        if True:\n            return stock(",
        "tests/prefill_graph/test_draft_graph.py::test_the_patch_makes_one_decision_for_the_draft_graph_group",
    ),
    (
        "D2 the startup probe's peer value is taken for a per-rank decision (the probe cannot go red)",
        "draft_graph.py",
        "    one = got is not None and got < 0\n",
        "    one = got is not None\n",
        "tests/prefill_graph/test_draft_graph.py::test_probe_red_on_stock_green_with_the_patch_round_trip",
    ),
]
sys.path.insert(0, REPO)
from tests._mutations import run  # noqa: E402

survivors = run(ROOT, MUTS, timeout=900, summary=True)
sys.exit(1 if survivors else 0)
