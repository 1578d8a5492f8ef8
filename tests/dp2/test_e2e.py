"""End to end: a real SGLang 0.5.23 server on CPU (tiny DeepseekV3, ``--dp-size 2 --tp-size 2
--enable-dp-attention``, tests/harness) with the native DP2 exchange enabled serves requests on
both ranks; its metrics show native exchanges on both ranks and no error; the live
``MLPSyncBatchInfo.all_gather`` is the replacement (which never calls the stock gloo path: the
feature is reported bound in the scheduler role); shutdown leaves no shared-memory object.

The server is the run's shared DP2 server (``dp2_server``: the native exchange is in its configuration, its
session id derived by its main process) instead of one of its own (issue 42: one server start fewer). Its
shutdown, and with it the check that no ``dspark_dp2_`` segment of it (nor any other) is left, is the
shared server's last test, tests/ingress/test_e2e_dp2.py::test_zz_health_scheduler_503_while_shutting_down
(``host_exclusive``), which names the segments from the session id in the server's log.
"""

from __future__ import annotations

import re
import time

import pytest

pytestmark = pytest.mark.server

SESSION_RE = re.compile(r"derived (auto-\d+-[0-9a-f]{16}) for this launch")


def _samples(text: str, name: str) -> dict:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            key = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels)))
            out[key] = float(value)
    return out


@pytest.mark.timeout(1500)
def test_native_exchange_serves_a_real_dp2_server_and_cleans_up(dp2_server):
    server = dp2_server
    # its shutdown and the segment check: the shared server's last test (module docstring)
    sessions = SESSION_RE.findall(server.log_text())
    assert len(sessions) == 1, server.log_tail(4000)
    ranks_seen = set()
    calls = {}
    deadline = time.monotonic() + 300
    i = 0
    while time.monotonic() < deadline:
        # route alternately to each rank; the other rank runs idle steps and still exchanges
        out = server.generate(f"def f{i}(x):", max_new_tokens=16, routed_dp_rank=i % 2)
        ranks_seen.add(out["meta_info"].get("dp_rank", i % 2))
        i += 1
        calls = _samples(server.metrics_text(), "dspark_harden_dp2_exchange_calls_total")
        got = {dict(k).get("dp_rank"): v for k, v in calls.items() if dict(k).get("channel") == "mlp"}
        if i >= 4 and got.get("0", 0) > 0 and got.get("1", 0) > 0:
            break
    got = {dict(k).get("dp_rank"): v for k, v in calls.items() if dict(k).get("channel") == "mlp"}
    assert got.get("0", 0) > 0 and got.get("1", 0) > 0, calls
    assert ranks_seen == {0, 1}
    text = server.metrics_text()
    errors = _samples(text, "dspark_harden_dp2_exchange_errors_total")
    assert errors and all(v == 0 for v in errors.values()), {k: v for k, v in errors.items() if v}
    enabled = _samples(text, "dspark_harden_dp2_exchange_enabled")
    assert {dict(k)["dp_rank"] for k, v in enabled.items() if v == 1 and dict(k)["channel"] == "mlp"} == {"0", "1"}
    bound = _samples(text, "dspark_harden_feature_bound")
    assert any(
        dict(k).get("feature") == "dp2-native-exchange"
        and dict(k).get("role") == "scheduler"
        and dict(k).get("status") == "bound"
        and v == 1
        for k, v in bound.items()
    ), bound
    seconds = _samples(text, "dspark_harden_dp2_exchange_seconds_total")
    assert any(dict(k).get("phase") == "exchange_total" and v > 0 for k, v in seconds.items())
    log = server.log_text()
    assert "Dp2Error" not in log
