"""Mutation runs of the bind-time applicability checks (issue 39): each mutation drops one precondition
or one guard, the named test runs (it must fail), the file is restored. Not collected by pytest.
Usage: python tests/plugin/mutations.py [A1 A2 ...]"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests._mutations import REPO, run  # noqa: E402

ROOT = os.path.join(REPO, "src", "dspark_harden") + os.sep
APP = "tests/plugin/test_applicability.py"
MUTS = [
    (
        "A1 the geometry precondition dropped (any DP attention geometry binds)",
        "prefill_graph/feature.py",
        "    if (attn_dp, attn_tp) != (2, 1):",
        "    if False:",
        APP + "::test_four_gloo_ranks_at_the_default_are_unavailable_and_never_raise",
    ),
    (
        "A2 the speculative precondition dropped (EAGLE binds, as before issue 39)",
        "prefill_graph/feature.py",
        "    spec = speculative_refusal(view)\n",
        "    spec = None\n",
        APP + "::test_default_on_features_decide_from_the_real_server_args",
    ),
    (
        "A3 the TBO precondition dropped",
        "prefill_graph/feature.py",
        "    refused = tbo.refusal(view, allow_full=tbo_switch)\n",
        "    refused = None\n",
        APP + "::test_default_on_features_decide_from_the_real_server_args",
    ),
    (
        "A4 the grammar backend precondition dropped (llguidance servers get the service)",
        "grammar/feature.py",
        '    if backend != "xgrammar":',
        "    if False:",
        APP + "::test_default_on_features_decide_from_the_real_server_args",
    ),
    (
        "A5 an explicit switch whose precondition fails is only unavailable (no refusal)",
        "core/binder.py",
        "            if feat.explicitly_enabled(settings):",
        "            if False:",
        APP + "::test_an_explicit_switch_refuses_at_bind_time_naming_switch_precondition_and_flag",
    ),
    (
        "A6 the prefill-graph configuration check expects exactly 2 rows again",
        "prefill_graph/config_digest.py",
        "    size = dist.get_world_size(group)\n    local",
        "    size = dist.get_world_size(group)\n    assert size == 2, size\n    local",
        APP + "::test_four_gloo_ranks_at_the_default_are_unavailable_and_never_raise",
    ),
    (
        "A7 the vote builds the O(batch) view before asking stock",
        "prefill_graph/admission.py",
        "        if ok or rt.on_view is not None:",
        "        if True:",
        "tests/prefill_graph/test_guard_and_patches.py::test_the_vote_asks_stock_before_building_the_schedule_view",
    ),
    (
        "A8 an Engine caller becomes a child subreaper again",
        "lifecycle/main.py",
        "        self.subreaper = proctree.become_subreaper() if owns_process else False",
        "        self.subreaper = proctree.become_subreaper()",
        "tests/lifecycle/test_lifecycle_units.py::test_only_a_process_the_server_owns_becomes_a_subreaper",
    ),
    (
        "A9 the world no longer sized from the trace (a 130k prefix)",
        "prefill_graph/bench.py",
        ", sizes=W.Sizes.for_trace(steps))",
        ")",
        "tests/prefill_graph/test_settings_tbo_bench.py::test_bench_replays_real_traffic_shapes_the_generator_never_makes",
    ),
]

if __name__ == "__main__":
    sys.exit(1 if run(ROOT, MUTS, timeout=600, summary=True) else 0)
