"""End to end: a real SGLang 0.5.23 server on CPU (tiny DeepseekV3, ``--dp-size 2 --tp-size 2
--enable-dp-attention``, tests/harness) with the native DP2 exchange enabled serves requests on
both ranks; its metrics show native exchanges on both ranks and no error; the live
``MLPSyncBatchInfo.all_gather`` is the replacement (which never calls the stock gloo path: the
feature is reported bound in the scheduler role); its segments are the ones its session id names.

Server: the shared ``dp2_native_server`` (tests/harness/shared.py; issue 42: one start for the session,
end-to-end and stopped-peer tests). That no segment is left behind is checked where the server ends: by
the stopped-peer drill on this server (failing exit) and by the plugin SIGTERM drill, whose server has
the native exchange too (clean exit, tests/lifecycle/test_server_drills.py). It is not the shared
``dp2_server``: a run on it failed behind the observability module's traffic (2026-12-07, f03d0ac), and
this test asserts the whole server's log free of exchange errors.
"""

from __future__ import annotations

import pytest

from dspark_harden.dp2.metrics import DP2_CHANNELS
from dspark_harden.dp2.native import shm_name_for

from .servers import mapped_dp2_segments, samples, serve_on_both_ranks, session_of

pytestmark = [pytest.mark.server]


@pytest.mark.timeout(1500)
def test_native_exchange_serves_a_real_dp2_server(dp2_native_server):
    server = dp2_native_server
    ranks_seen, before, got = serve_on_both_ranks(server, prefix="f", max_new_tokens=16)
    assert all(got.get(r, 0) > before.get(r, 0) for r in ("0", "1")), (before, got)
    assert ranks_seen == {0, 1}
    text = server.metrics_text()
    errors = samples(text, "dspark_harden_dp2_exchange_errors_total")
    assert errors and all(v == 0 for v in errors.values()), {k: v for k, v in errors.items() if v}
    enabled = samples(text, "dspark_harden_dp2_exchange_enabled")
    assert {dict(k)["dp_rank"] for k, v in enabled.items() if v == 1 and dict(k)["channel"] == "mlp"} == {"0", "1"}
    bound = samples(text, "dspark_harden_feature_bound")
    assert any(
        dict(k).get("feature") == "dp2-native-exchange"
        and dict(k).get("role") == "scheduler"
        and dict(k).get("status") == "bound"
        and v == 1
        for k, v in bound.items()
    ), bound
    seconds = samples(text, "dspark_harden_dp2_exchange_seconds_total")
    assert any(dict(k).get("phase") == "exchange_total" and v > 0 for k, v in seconds.items())
    assert "Dp2Error" not in server.log_text()
    # the segments both ranks map are the ones this server's session id names
    session = session_of(server)
    mapped = mapped_dp2_segments(server.pid)
    assert shm_name_for(session, "mlp") in mapped, (session, mapped)
    assert mapped <= {shm_name_for(session, c) for c in DP2_CHANNELS}, (session, mapped)
