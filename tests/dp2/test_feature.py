"""Strict enablement of the native DP2 exchange: settings, geometry, conflicting switches, and
binding through the real binder (real ServerArgs, real stock classes) in isolated processes."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from dspark_harden.core.settings import SettingsError, load_settings
from dspark_harden.dp2 import settings as S
from dspark_harden.dp2.feature import geometry_problems
from tests.harness import warm


def _args(**kw):
    from sglang.srt.server_args import ServerArgs

    base = dict(model_path="dummy", dp_size=2, tp_size=2, enable_dp_attention=True)
    base.update(kw)
    return ServerArgs(**base)


def test_settings_are_strict():
    vals = load_settings(S.SETTINGS, {})
    assert vals[S.SWITCH] is False and vals[S.TIMEOUT_MS] == 30000 and vals[S.SESSION_ID] is None
    for name, bad in [
        (S.SWITCH, "true"),
        (S.TIMEOUT_MS, "0"),
        (S.TIMEOUT_MS, "-5"),
        (S.SESSION_ID, "  "),
        (S.SPIN_US, "-1"),
        (S.METRICS, "yes"),
        (S.LIBRARY, "/tmp/x.so"),
    ]:
        with pytest.raises(SettingsError, match=name):
            load_settings(S.SETTINGS, {name: bad})


def test_geometry_validation_names_each_problem():
    assert geometry_problems(_args()) == []
    assert any("--dp-size is 4" in p for p in geometry_problems(_args(dp_size=4, tp_size=4)))
    assert any("--tp-size is 4" in p for p in geometry_problems(_args(tp_size=4)))
    assert any("--enable-dp-attention is off" in p for p in geometry_problems(_args(enable_dp_attention=False)))
    assert any("--nnodes is 2" in p for p in geometry_problems(_args(nnodes=2)))
    assert any("--pp-size is 2" in p for p in geometry_problems(_args(pp_size=2)))


_BIND_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from sglang.srt.server_args import ServerArgs
    from dspark_harden.core import binder, roles
    from dspark_harden.core.patch import Role
    from dspark_harden.core.roles import ProcessContext
    from dspark_harden import entry

    case = json.loads(sys.argv[1])
    sa = ServerArgs(model_path="dummy", **case["args"])
    if case.get("spec"):
        sa.speculative_algorithm = case["spec"]
    roles.CONTEXT = ProcessContext(role=Role.SCHEDULER, server_args=sa, tp_rank=case.get("rank", 0), dp_rank=case.get("rank", 0))
    report = binder.bind(Role.SCHEDULER)
    out = {"ok": report.ok, "failures": report.failures()}
    if report.ok:
        entry._notify_bound(Role.SCHEDULER, report)
        from sglang.srt.managers.scheduler_components import dp_attn
        from dspark_harden.dp2 import channels
        out["mlp_replaced"] = getattr(dp_attn.MLPSyncBatchInfo.all_gather, "__dspark_patch__", None)
        out["channels"] = sorted(channels.RUNTIME.channels)
        out["shm"] = [c.shm_name for c in channels.RUNTIME.channels.values()]
        out["planner_imported"] = "sglang.srt.speculative.dspark_components.dspark_planner" in sys.modules
        channels.RUNTIME.close_all()
        binder.revert_all()
        out["reverted"] = not hasattr(dp_attn.MLPSyncBatchInfo.all_gather, "__dspark_patch__")
    print("RESULT " + json.dumps(out))
    """
)


def _bind(case: dict, env: dict) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_DSPARK_DP2")}
    e.update(env)
    r = warm.run(
        [sys.executable, "-c", _BIND_SCRIPT, json.dumps(case)], capture_output=True, text=True, env=e, timeout=600
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


ON = {"SGLANG_DSPARK_DP2_SHM_MLP_SYNC": "1"}
GOOD = {"dp_size": 2, "tp_size": 2, "enable_dp_attention": True}


@pytest.mark.timeout(1200)
def test_binding_refuses_bad_geometry_missing_session_and_conflicting_switches():
    sid = {"SGLANG_DSPARK_DP2_SHM_SESSION_ID": f"bind-{os.getpid()}"}
    res = _bind({"args": {"dp_size": 4, "tp_size": 4, "enable_dp_attention": True}}, {**ON, **sid})
    assert not res["ok"] and any("--dp-size is 4, must be 2" in f for f in res["failures"]), res
    res = _bind({"args": GOOD}, ON)
    assert not res["ok"] and any("SGLANG_DSPARK_DP2_SHM_SESSION_ID is not set" in f for f in res["failures"]), res
    res = _bind({"args": GOOD}, {**ON, **sid, "SGLANG_SCHEDULER_SKIP_ALL_GATHER": "1"})
    assert not res["ok"] and any("SGLANG_SCHEDULER_SKIP_ALL_GATHER is on" in f for f in res["failures"]), res


@pytest.mark.timeout(1200)
def test_binding_good_geometry_opens_channels_and_skips_dspark_when_not_configured():
    sid = {"SGLANG_DSPARK_DP2_SHM_SESSION_ID": f"bind-ok-{os.getpid()}"}
    res = _bind({"args": GOOD}, {**ON, **sid})
    assert res["ok"], res
    assert res["mlp_replaced"].endswith("MLPSyncBatchInfo.all_gather")
    assert res["channels"] == ["mlp"]
    assert res["planner_imported"] is False  # DSpark not configured: its planner is never imported
    assert res["reverted"] is True
    res = _bind({"args": GOOD, "spec": "DSPARK"}, {**ON, **sid})
    assert res["ok"], res
    assert res["channels"] == ["mlp", "verify_tier"]
    for name in res["shm"]:
        assert not os.path.exists("/dev/shm" + name)


def test_disabled_by_default_binds_nothing():
    from dspark_harden.core.patch import Role
    from dspark_harden.dp2.feature import dspark_patches

    settings = load_settings(S.SETTINGS, {})
    assert dspark_patches(role=Role.SCHEDULER, settings=settings) == []
