"""DP2 session id without ceremony: with SGLANG_DSPARK_DP2_SHM_SESSION_ID unset the main process
derives a fresh id per launch before the schedulers spawn (they inherit it); an explicit value is
honoured. End to end: two DP2 servers with the native exchange side by side on this host, neither
with a session id exported, both serve on native exchanges with their own segments.

Servers: the two shared ones with the native exchange and no session id, ``dp2_server`` and
``dp2_native_server`` (tests/harness/shared.py), both running (issue 42: two starts fewer than the two
launches of its own it had). The id is the main process's pid and 64 random bits, so what matters is two
servers that run at once, not two launches in the same second.
"""

from __future__ import annotations

import os

import pytest

from dspark_harden.dp2 import session
from dspark_harden.dp2.native import shm_name_for
from dspark_harden.dp2.settings import SESSION_ID

from ..plugin._proc import run_py
from .servers import group_session_ids, mapped_dp2_segments, serve_on_both_ranks, session_of


class _Engine:
    seen: list = []

    @classmethod
    def _launch_subprocesses(cls, server_args=None):
        cls.seen.append(os.environ.get(SESSION_ID))
        return cls, server_args


def _wrap(explicit):
    return session.build_launch_subprocesses(explicit)(_Engine.__dict__["_launch_subprocesses"])


def test_unset_id_is_derived_fresh_for_every_launch_and_exported_before_the_stock_call(monkeypatch):
    # set, then deleted: monkeypatch restores what it saw first (``delenv(..., raising=False)`` of an unset
    # variable records nothing, and the id the launch exports stayed in this process for every later server)
    monkeypatch.setenv(SESSION_ID, "placeholder")
    monkeypatch.delenv(SESSION_ID)
    _Engine.seen = []
    launch = _wrap(None).__get__(None, _Engine)
    assert launch(server_args="sa") == (_Engine, "sa")
    assert launch() == (_Engine, None)
    a, b = _Engine.seen
    assert a != b and a.startswith(f"auto-{os.getpid()}-") and b.startswith(f"auto-{os.getpid()}-")
    assert os.environ[SESSION_ID] == b  # what the children spawned by this launch inherit
    assert shm_name_for(a, "mlp") != shm_name_for(b, "mlp")


def test_explicit_id_is_honoured(monkeypatch):
    monkeypatch.setenv(SESSION_ID, "operator-set")
    _Engine.seen = []
    launch = _wrap("operator-set").__get__(None, _Engine)
    launch()
    launch()
    assert _Engine.seen == ["operator-set", "operator-set"]


def test_main_binds_the_launch_wrapper_and_schedulers_require_the_inherited_id():
    """Main role: enabled without an id binds (the wrapper on Engine._launch_subprocesses);
    a scheduler of a real server (server_args known) that did not inherit one refuses to start."""
    rc, res, out = run_py("""
        import os
        os.environ.pop("SGLANG_DSPARK_DP2_SHM_SESSION_ID", None)
        os.environ["SGLANG_DSPARK_DP2_SHM_MLP_SYNC"] = "1"
        from dspark_harden.core import binder
        from dspark_harden.core.patch import Role
        report = binder.bind(Role.MAIN)
        from sglang.srt.entrypoints.engine import Engine
        live = Engine.__dict__["_launch_subprocesses"]
        emit({"ok": report.ok, "failures": report.failures(),
              "patched": getattr(live.__func__, "__dspark_patch__", None)})
    """)
    assert rc == 0, out
    assert res["ok"], res
    assert res["patched"] == session.LAUNCH_TARGET
    rc, res, out = run_py("""
        import os
        os.environ.pop("SGLANG_DSPARK_DP2_SHM_SESSION_ID", None)
        os.environ["SGLANG_DSPARK_DP2_SHM_MLP_SYNC"] = "1"
        from sglang.srt.server_args import ServerArgs
        from dspark_harden.core import binder, roles
        from dspark_harden.core.patch import Role
        from dspark_harden.core.roles import ProcessContext
        sa = ServerArgs(model_path="dummy", dp_size=2, tp_size=2, enable_dp_attention=True)
        roles.CONTEXT = ProcessContext(role=Role.SCHEDULER, server_args=sa, tp_rank=0, dp_rank=0)
        report = binder.bind(Role.SCHEDULER)
        emit({"ok": report.ok, "failures": report.failures()})
    """)
    assert rc == 0, out
    assert not res["ok"] and any("derives one per launch" in f for f in res["failures"]), res


@pytest.mark.server
@pytest.mark.timeout(1800)
@pytest.mark.shared_order(0.5)  # in dp2_server's group, before its last user shuts it down
def test_two_dp2_servers_side_by_side_without_a_session_id(dp2_server, dp2_native_server):
    servers = [dp2_server, dp2_native_server]
    for s in servers:
        assert SESSION_ID not in dict(s.config.env) and s.proc.poll() is None
        # launched without one: the main process's environment as it started has none
        assert s.pid not in group_session_ids(s.pid, SESSION_ID), s.config.name
    offsets = [len(s.log_text()) for s in servers]
    sessions = [session_of(s) for s in servers]
    assert sessions[0] != sessions[1]
    # both ranks of each server opened the segment named by that server's id (inherited from its main
    # process); the two servers' segments differ (no collision)
    names = [shm_name_for(sid, "mlp") for sid in sessions]
    assert names[0] != names[1]
    for s, sid, name in zip(servers, sessions, names):
        inherited = group_session_ids(s.pid, SESSION_ID)
        # DP controller, two schedulers, detokenizer (the main process set it after its own start)
        assert len(inherited) >= 4 and set(inherited.values()) == {sid}, (s.config.name, sid, inherited)
        assert name in mapped_dp2_segments(s.pid), (s.config.name, name)
    # both serve at once, each on its own exchange (calls grow on both ranks of each)
    for s, offset in zip(servers, offsets):
        _ranks, before, calls = serve_on_both_ranks(s, prefix="g")
        assert all(calls.get(r, 0) > before.get(r, 0) for r in ("0", "1")), (s.config.name, before, calls)
        assert "Dp2Error" not in s.log_text()[offset:]
    assert all(s.proc.poll() is None for s in servers)
