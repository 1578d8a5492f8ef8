"""``sglang serve`` with the plugin active: the second stock launch path (issue 27 item 2).

Real parts, as in test_server_plugin.py: stock SGLang 0.5.23 started through its own ``sglang serve``
console script (``sglang.cli.serve:serve`` calls ``load_plugins()`` itself, then runs the same
``launch_server`` machinery) on the CPU DP2 harness (tiny DeepseekV3, --dp-size 2 --tp-size 2
--enable-dp-attention, the test CPU platform), real ZMQ, gloo, xgrammar, HTTP, SIGTERM and /dev/shm.
``python -m sglang.launch_server`` is every other server test's path; the offline ``sglang.Engine``
path is tests/lifecycle/test_engine_shutdown.py. One server start (~1 min on 2 cores).

Server: its own. The launch path (``sglang serve``) is what is tested, and every shared server is started
through ``python -m sglang.launch_server``; the ``SGLANG_PLUGINS``-empty side of issue 39's matrix runs on
this same start (tests/integration/test_matrix.py), so it costs no second one.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import pytest

from tests.harness.server import PLUGIN_ACTIVE_RE, SGLangServer
from tests.integration.test_server_plugin import answer_bounded_json, assert_plugin_in_every_role
from tests.lifecycle import drills as D

# not host_exclusive: its /dev/shm leftovers are the new entries its own server's processes mapped
# (dspark_harden.devtools.shmwatch)
pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]


def test_sglang_serve_binds_every_role_answers_json_and_exits_clean():
    """Also the "installed, not named" path (issue 39): ``SGLANG_PLUGINS`` empty, which stock reads as
    "load every installed plugin"; each process says so on its presence line."""
    config = dataclasses.replace(D.config(True, "launch-serve"), launcher="serve", plugins="")
    server = SGLangServer(config, watch_shm=True).start()
    try:
        cmd = server.command()
        assert cmd[1] == "serve" and os.path.basename(cmd[0]) == "sglang", cmd
        assert_plugin_in_every_role(server)
        presence = [ln for ln in server.log_text().splitlines() if PLUGIN_ACTIVE_RE.search(ln)]
        assert presence and all(
            "loaded because SGLANG_PLUGINS is unset (stock SGLang loads every installed plugin)" in ln
            for ln in presence
        ), presence
        for rank in (0, 1):
            answer_bounded_json(server, rank)
        drill = D.signal_drill(server, "sglang serve SIGTERM", target="main", sig=signal.SIGTERM, lengths=None)
    finally:
        server.stop()
    sys.stderr.write(drill.summary() + "\n")
    assert drill.returncode == 0, drill.summary() + "\n" + drill.log_after[-4000:]
    assert not drill.leftover_pids and not drill.leftover_shm and not drill.leftover_sockets, drill.summary()
    assert not drill.warning_lines and drill.tracebacks == 0, "\n".join(drill.warning_lines[:20])
