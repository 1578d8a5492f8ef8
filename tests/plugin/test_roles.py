"""Each process role binds only what it needs: the plugin must not drag scheduler-side or DeepSeek-V4 /
DSpark modules into the detokenizer, DP controller or main process."""

from __future__ import annotations

import pytest

from ._proc import run_py

HEAVY = (
    "sglang.srt.layers.attention.deepseek_v4_backend",
    "sglang.srt.speculative.dspark_components.dspark_worker_v2",
    "sglang.srt.speculative.dspark_components.dspark_planner",
    "sglang.srt.models.deepseek_v4",
)
SCHEDULER_ONLY = ("sglang.srt.managers.scheduler",)


@pytest.mark.parametrize("role", ["detokenizer", "controller", "main"])
def test_role_imports_only_what_it_needs(role):
    rc, result, out = run_py(
        """
        import sys
        before = set(sys.modules)
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from dspark_harden.core import binder
        rep = binder.STATE.report
        emit({"ok": rep.ok, "role": rep.role, "mods": sorted(m for m in sys.modules if m.startswith("sglang.srt"))})
        """,
        env={"SGLANG_PLUGINS": "dspark_harden", "DSPARK_HARDEN_ROLE": role},
    )
    assert rc == 0 and result["ok"] and result["role"] == role, out[-3000:]
    leaked = [m for m in HEAVY if m in result["mods"]]
    assert not leaked, f"{role} process imported {leaked}"
    if role == "detokenizer":
        assert not [m for m in SCHEDULER_ONLY if m in result["mods"]]


def test_load_is_reentrant():
    rc, result, out = run_py(
        """
        from dspark_harden import entry
        from dspark_harden.core import binder
        first = entry.load()
        n = len(binder.STATE.patches)
        second = entry.load()
        emit({"same": first is second, "n": n, "n2": len(binder.STATE.patches)})
        """,
        env={"DSPARK_HARDEN_ROLE": "controller"},
    )
    assert rc == 0 and result == {"same": True, "n": result["n"], "n2": result["n"]}, out[-3000:]
