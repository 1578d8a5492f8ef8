"""Issue 21 item 7 on a real server: a real SGLang 0.5.23 DP2 CPU server (tiny DeepseekV3,
``--dp-size 2 --tp-size 2 --enable-dp-attention``) with the native DP2 exchange, whose DP rank 1
scheduler is SIGSTOPped.

Rank 0 then waits for rank 1 in the exchange. Stock (and the exchange before this fix) would hold it
for up to 30 minutes with WARNINGs only, and ``/health_scheduler`` could at best call both ranks
stale. Now: within a stall period (``SGLANG_DSPARK_DP2_SHM_TIMEOUT_MS=3000`` here) rank 0 publishes
the stall and ``/health_scheduler`` answers 503 ``dp2_stalled`` naming DP rank 1; once rank 1 has
been stopped for ``SGLANG_DSPARK_DP2_SHM_PEER_STOP_MS`` rank 0 fails with the named error
(``peer_died``: ``is stopped (state T)``), published to shared state, and the server exits with the
lifecycle's scheduler exit code 3.

Server: the shared ``dp2_native_server`` (tests/harness/shared.py: its stall period and stop limit are this
drill's), as its last user: the drill ends it (rank 1 stopped, the server exits with code 3). Its leftover
check (no segment of this server's session left) is also the end-to-end test's (tests/dp2/test_e2e.py), which
served on the same server before.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest
import requests

from dspark_harden.dp2.metrics import DP2_CHANNELS
from dspark_harden.dp2.native import shm_name_for
from tests.harness.shared import DP2_NATIVE_PERIOD_MS, DP2_NATIVE_STOP_MS

from .servers import mapped_dp2_segments, session_of

# not host_exclusive: the leftover check below is this server's own segments (the ones its processes map, and
# the names its session id gives), so tests of the other pytest-xdist worker may create and remove theirs meanwhile
pytestmark = [pytest.mark.server]

PERIOD_MS = DP2_NATIVE_PERIOD_MS
STOP_MS = DP2_NATIVE_STOP_MS


def _health(server):
    r = requests.get(server.url + "/health_scheduler", timeout=10)
    return r.status_code, r.json()


@pytest.mark.timeout(1500)
@pytest.mark.shared_order(1)  # the last user of the shared server: it ends it
def test_stopped_rank_1_is_named_by_health_then_fails_both_ranks(dp2_native_server):
    server = dp2_native_server
    pid1 = None
    own_names: set = set()
    mapped: set = set()
    try:
        deadline = time.monotonic() + 120
        while _health(server)[0] != 200:
            assert time.monotonic() < deadline, _health(server)
            time.sleep(0.5)
        # this server's segments: the names its session id gives, and what its ranks map (both ranks are alive)
        session = session_of(server)
        own_names = {shm_name_for(session, channel) for channel in DP2_CHANNELS}
        mapped = mapped_dp2_segments(server.pid)
        assert shm_name_for(session, "mlp") in mapped and mapped <= own_names, (session, mapped, own_names)
        pid1 = server.process_titled("sglang::scheduler_DP1_")
        os.kill(pid1, signal.SIGSTOP)
        t0 = time.monotonic()
        # one stall period after rank 0 starts waiting (it exchanges on every idle step), plus slack for
        # a loaded 2-core host; well before the stop limit
        deadline = t0 + PERIOD_MS / 1000 + 25.0
        code, body = _health(server)
        while not (code == 503 and body.get("reason") == "dp2_stalled") and time.monotonic() < deadline:
            time.sleep(0.25)
            code, body = _health(server)
        assert (code, body.get("reason")) == (503, "dp2_stalled"), (body, server.log_tail())
        assert body["bad_ranks"] == [1], body
        assert body["message"].startswith(
            "DP rank 1 stalled: alive but not taking part in the scheduler steps; DP rank 0 has waited"
        ), body
        # named by the peer watch (rank 0 blocked in stock's per-iteration gloo control broadcast) or by the
        # exchange's own stall report (rank 0 waiting in the exchange): either names rank 1's pid and state
        assert f"(pid {pid1})" in body["message"] and "process state T" in body["message"], body
        named = time.monotonic() - t0
        assert named < STOP_MS / 1000, named

        # past the stop limit: rank 0 fails like a dead peer, the server exits with the scheduler code
        deadline = t0 + STOP_MS / 1000 + 120.0
        pattern = re.compile(
            rf"peer died: rank 1 pid {pid1} is stopped \(state T\) for \d+\.\d s, longer than the "
            rf"limit of {STOP_MS} ms \(SGLANG_DSPARK_DP2_SHM_PEER_STOP_MS\)"
        )
        while not pattern.search(server.log_text()) and server.proc.poll() is None:
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.2)
        os.kill(pid1, signal.SIGCONT)  # rank 1 may now see the published error itself (poisoned) before teardown
        rc = server.wait_exit(timeout=180)
        log = server.log_text()
        assert pattern.search(log), server.log_tail()
        assert time.monotonic() - t0 >= STOP_MS / 1000 - 1.0
        assert "Dp2Error" in log
        assert rc == 3, (rc, server.log_tail())
        # what each rank said (shown with -s): rank 0 the named error, rank 1 'poisoned' if it ran before teardown
        sys.stderr.write(
            "".join(
                line + "\n"
                for line in log.splitlines()
                if re.search(r"peer died|channel poisoned|exiting with code|exit code", line)
            )
        )
    finally:
        if pid1 is not None:
            try:
                os.kill(pid1, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.stop()
        server.remove_workdir()
    left = {"/" + n for n in os.listdir("/dev/shm")} & (own_names | mapped)
    assert not left, (left, sorted(os.listdir("/dev/shm")))
