"""``sglang serve`` with the plugin active: the second stock launch path (issue 27 item 2).

Real parts, as in test_server_plugin.py: stock SGLang 0.5.23 started through its own ``sglang serve``
console script (``sglang.cli.serve:serve`` calls ``load_plugins()`` itself, then runs the same
``launch_server`` machinery) on the CPU DP2 harness (tiny DeepseekV3, --dp-size 2 --tp-size 2
--enable-dp-attention, the test CPU platform), real ZMQ, gloo, xgrammar, HTTP, SIGTERM and /dev/shm.
``python -m sglang.launch_server`` is every other server test's path; the offline ``sglang.Engine``
path is tests/lifecycle/test_engine_shutdown.py.

Server: the shared ``dp2_serve_server`` (tests/harness/shared.py), the one shared server launched through
``sglang serve`` with ``SGLANG_PLUGINS`` empty; the plugin SIGTERM drill ends it after this test (one start
for both). The ``SGLANG_PLUGINS``-empty side of issue 39's matrix runs on this same start
(tests/integration/test_matrix.py), so it costs no second one.
"""

from __future__ import annotations

import os

import pytest

from tests.harness.server import PLUGIN_ACTIVE_RE
from tests.integration.test_server_plugin import answer_bounded_json, assert_plugin_in_every_role

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]


def test_sglang_serve_binds_every_role_and_answers_json(dp2_serve_server):
    """Also the "installed, not named" path (issue 39): ``SGLANG_PLUGINS`` empty, which stock reads as
    "load every installed plugin"; each process says so on its presence line. The same server's clean exit
    under SIGTERM (exit 0, nothing left behind, no WARNING or traceback) is the plugin SIGTERM drill's, its
    last user (tests/lifecycle/test_server_drills.py)."""
    server = dp2_serve_server
    cmd = server.command()
    assert cmd[1] == "serve" and os.path.basename(cmd[0]) == "sglang", cmd
    assert server.config.plugins == "" and server.environment()["SGLANG_PLUGINS"] == ""
    assert_plugin_in_every_role(server)
    presence = [ln for ln in server.log_text().splitlines() if PLUGIN_ACTIVE_RE.search(ln)]
    assert presence and all(
        "loaded because SGLANG_PLUGINS is unset (stock SGLang loads every installed plugin)" in ln for ln in presence
    ), presence
    for rank in (0, 1):
        answer_bounded_json(server, rank)
