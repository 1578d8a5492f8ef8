"""``sglang serve`` with the plugin active: the second stock launch path (issue 27 item 2).

Real parts, as in test_server_plugin.py: stock SGLang 0.5.23 started through its own ``sglang serve``
console script (``sglang.cli.serve:serve`` calls ``load_plugins()`` itself, then runs the same
``launch_server`` machinery) on the CPU DP2 harness (tiny DeepseekV3, --dp-size 2 --tp-size 2
--enable-dp-attention, the test CPU platform), real ZMQ, gloo, xgrammar, HTTP, SIGTERM and /dev/shm.
``python -m sglang.launch_server`` is every other server test's path; the offline ``sglang.Engine``
path is tests/lifecycle/test_engine_shutdown.py. One server start (~1 min on 2 cores).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import sys
import time

import pytest

from tests.harness.server import SGLangServer
from tests.integration.test_server_plugin import BOUNDED_SCHEMA, DP2_ROLES
from tests.lifecycle import drills as D

pytestmark = [pytest.mark.server, pytest.mark.timeout(1200)]


def test_sglang_serve_binds_every_role_answers_json_and_exits_clean():
    config = dataclasses.replace(D.config(True, "launch-serve"), launcher="serve")
    shm_before = D.shm_entries()
    server = SGLangServer(config).start()
    try:
        assert server.command()[1] == "serve" and os.path.basename(server.command()[0]) == "sglang"
        roles = collections.Counter(server.plugin_roles())
        assert dict(roles) == DP2_ROLES, (
            f"sglang serve: expected one 'dspark-harden ... active in <role> process' line per process "
            f"{DP2_ROLES}, found {dict(roles)}\n{server.log_tail(8000)}"
        )
        for rank in (0, 1):
            out = server.generate(
                "Answer in JSON:",
                max_new_tokens=64,
                routed_dp_rank=rank,
                sampling_params={"json_schema": json.dumps(BOUNDED_SCHEMA)},
            )
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
            assert out["meta_info"]["dp_rank"] == rank, out["meta_info"]
            value = json.loads(out["text"])
            assert set(value) == set(BOUNDED_SCHEMA["required"]), value
            assert isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue"), value
        log_offset = len(server.log_text())
        t_event = time.monotonic()
        os.kill(server.pid, signal.SIGTERM)
        drill = D.finish(
            D.Drill("sglang serve SIGTERM"),
            server,
            shm_before=shm_before,
            log_offset=log_offset,
            t_event=t_event,
            load=None,
        )
    finally:
        server.stop()
    sys.stderr.write(drill.summary() + "\n")
    assert drill.returncode == 0, drill.summary() + "\n" + drill.log_after[-4000:]
    assert not drill.leftover_pids and not drill.leftover_shm and not drill.leftover_sockets, drill.summary()
    assert not drill.warning_lines and drill.tracebacks == 0, "\n".join(drill.warning_lines[:20])
