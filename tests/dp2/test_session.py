"""DP2 session id without ceremony: with SGLANG_DSPARK_DP2_SHM_SESSION_ID unset the main process
derives a fresh id per launch before the schedulers spawn (they inherit it); an explicit value is
honoured. End to end: two DP2 servers with the native exchange side by side on this host, neither
with a session id exported, both serve on native exchanges with their own segments.

Servers: two of its own, launched at once. The shared ``dp2_server`` is already running when this module
starts, so it cannot be one of two launches that race for a session id; what is tested is that two
launches at the same time derive different ids.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from dspark_harden.dp2 import session
from dspark_harden.dp2.native import shm_name_for
from dspark_harden.dp2.settings import SESSION_ID
from tests.harness.server import DP2_CONFIG, SGLangServer

from ..plugin._proc import run_py


class _Engine:
    seen: list = []

    @classmethod
    def _launch_subprocesses(cls, server_args=None):
        cls.seen.append(os.environ.get(SESSION_ID))
        return cls, server_args


def _wrap(explicit):
    return session.build_launch_subprocesses(explicit)(_Engine.__dict__["_launch_subprocesses"])


def test_unset_id_is_derived_fresh_for_every_launch_and_exported_before_the_stock_call(monkeypatch):
    monkeypatch.delenv(SESSION_ID, raising=False)
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


_SESSION_RE = re.compile(r"derived (auto-\d+-[0-9a-f]{16}) for this launch")


def _group_session_ids(pgid: int) -> dict:
    """{pid: session id} of the server's process-group members whose environment (as they were
    started with it) carries SGLANG_DSPARK_DP2_SHM_SESSION_ID."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[-1].split()[2] != str(pgid):
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        value = env.get(SESSION_ID.encode())
        if value is not None:
            out[int(entry)] = value.decode()
    return out


def _mlp_calls(server) -> dict:
    out = {}
    for line in server.metrics_text().splitlines():
        if line.startswith("dspark_harden_dp2_exchange_calls_total{") and 'channel="mlp"' in line:
            rank = re.search(r'dp_rank="(\d)"', line).group(1)
            out[rank] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.server
@pytest.mark.timeout(1800)
def test_two_dp2_servers_side_by_side_without_a_session_id(monkeypatch):
    monkeypatch.delenv(SESSION_ID, raising=False)
    configs = [
        type(DP2_CONFIG)(
            **{**DP2_CONFIG.with_env(SGLANG_DSPARK_DP2_SHM_MLP_SYNC="1").__dict__, "name": f"dp2-auto-{i}"}
        )
        for i in (0, 1)
    ]
    assert all(SESSION_ID not in dict(c.env) for c in configs)
    servers = [SGLangServer(c) for c in configs]
    try:
        for s in servers:  # both launched before either is ready: the two run at once
            s.launch()
            assert SESSION_ID not in s.environment()
        for s in servers:
            s.wait_ready()
        sessions = []
        for s in servers:
            found = _SESSION_RE.findall(s.log_text())
            assert len(found) == 1, s.log_tail(4000)
            sessions.append(found[0])
        assert sessions[0] != sessions[1]
        # both ranks of each server opened the segment named by that server's id (inherited from its
        # main process); the two servers' segments differ (no collision)
        names = [shm_name_for(sid, "mlp") for sid in sessions]
        assert names[0] != names[1]
        for s, sid in zip(servers, sessions):
            inherited = _group_session_ids(s.pid)
            # DP controller, two schedulers, detokenizer (the main process set it after its own start)
            assert len(inherited) >= 4 and set(inherited.values()) == {sid}, (s.config.name, sid, inherited)
        for s in servers:
            deadline, calls = time.monotonic() + 300, {}
            i = 0
            while time.monotonic() < deadline:
                out = s.generate(f"def g{i}(y):", max_new_tokens=8, routed_dp_rank=i % 2)
                assert out["text"] is not None
                i += 1
                calls = _mlp_calls(s)
                if i >= 2 and calls.get("0", 0) > 0 and calls.get("1", 0) > 0:
                    break
            assert calls.get("0", 0) > 0 and calls.get("1", 0) > 0, (s.config.name, calls)
            assert "Dp2Error" not in s.log_text()
    finally:
        for s in servers:
            s.stop()
            s.remove_workdir()
    for sid in sessions:
        assert not os.path.exists("/dev/shm" + shm_name_for(sid, "mlp"))
