"""End to end: a real SGLang 0.5.23 server on CPU (tiny DeepseekV3, ``--dp-size 2 --tp-size 2
--enable-dp-attention``, tests/harness) with the native DP2 exchange enabled serves requests on
both ranks; its metrics show native exchanges on both ranks and no error; the live
``MLPSyncBatchInfo.all_gather`` is the replacement (which never calls the stock gloo path: the
feature is reported bound in the scheduler role); shutdown leaves no shared-memory object.

Server: its own (one start). The shared ``dp2_server`` cannot take it: the last assertion needs the
server's stop inside the test (no shared-memory object left at shutdown), and a run on the shared server
failed behind the observability module's traffic (2026-12-07, reverted in f03d0ac).
"""

from __future__ import annotations

import os
import re
import time
import uuid

import pytest

from dspark_harden.dp2.native import shm_name_for
from tests.harness.server import DP2_CONFIG, SGLangServer

# host_exclusive: no dspark_dp2_ segment may be left on the host after its server (no test of another pytest-xdist worker runs meanwhile, tests/conftest.py)
pytestmark = [pytest.mark.server, pytest.mark.host_exclusive]

SESSION = f"e2e-{os.getpid()}-{uuid.uuid4().hex[:8]}"
CONFIG = DP2_CONFIG.with_env(SGLANG_DSPARK_DP2_SHM_MLP_SYNC="1", SGLANG_DSPARK_DP2_SHM_SESSION_ID=SESSION)
CONFIG = type(CONFIG)(**{**CONFIG.__dict__, "name": "dp2-native"})


def _samples(text: str, name: str) -> dict:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            key = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels)))
            out[key] = float(value)
    return out


@pytest.mark.timeout(1500)
def test_native_exchange_serves_a_real_dp2_server_and_cleans_up():
    server = SGLangServer(CONFIG)
    try:
        server.start()
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
    finally:
        server.stop()
        server.remove_workdir()
    for channel in ("mlp", "verify_tier"):
        assert not os.path.exists("/dev/shm" + shm_name_for(SESSION, channel))
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("dspark_dp2_")], os.listdir("/dev/shm")
