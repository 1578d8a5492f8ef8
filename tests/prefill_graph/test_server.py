"""The feature on the shared real DP2 CPU server (DeepseekV3 tiny, --dp-size 2 --tp-size 2
--enable-dp-attention, plugin active; see tests/harness/shared.py).

Prefill CUDA graphs cannot run on CPU: stock resolves ``cuda_graph_config[prefill].backend`` to
``disabled`` there, so each scheduler reports the feature ``unavailable`` with that reason (and
generation keeps working). That the three patches bind on the real sglang 0.5.23 is shown by
``dspark-harden check`` (test_settings_tbo_bench.py) and the forked binding tests.
"""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]


def test_each_scheduler_reports_why_the_feature_does_not_apply_on_cpu(dp2_server):
    log = dp2_server.log_text()
    # the scheduler's one presence line names the feature as unavailable and why (issue 39)
    lines = [ln for ln in log.splitlines() if re.search(r"dspark-harden \S+ active in scheduler process", ln)]
    assert len(lines) == 2, log[-4000:]
    for line in lines:
        _, sep, unavailable = line.partition("unavailable here, stock behaviour: ")
        assert sep and (
            "prefill-graph-dp (prefill CUDA graphs are not enabled (cuda_graph_config[prefill].backend=disabled"
            in unavailable
        ), line
    text = dp2_server.metrics_text()
    assert re.search(
        r'dspark_harden_feature_bound\{[^}]*feature="prefill-graph-dp"[^}]*status="unavailable"[^}]*\} 0', text
    ) or re.search(
        r'dspark_harden_feature_bound\{[^}]*status="unavailable"[^}]*feature="prefill-graph-dp"[^}]*\} 0', text
    ), [ln for ln in text.splitlines() if "prefill-graph" in ln]
    out = dp2_server.generate("def main():", max_new_tokens=4)
    assert out
