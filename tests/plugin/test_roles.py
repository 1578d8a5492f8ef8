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


def test_dp_attention_rank_from_server_args():
    """Real ServerArgs fields: 0.5.23 keeps the DP-attention degree in attn_dp_size."""
    from types import SimpleNamespace as Args

    from dspark_harden.core.roles import _dp_rank_of

    assert _dp_rank_of(Args(attn_dp_size=2, tp_size=2), 1, None) == 1
    assert _dp_rank_of(Args(attn_dp_size=2, tp_size=4), 3, None) == 1
    assert _dp_rank_of(Args(enable_dp_attention=True, dp_size=2, tp_size=2), 1, None) == 1
    assert _dp_rank_of(Args(dp_size=2, tp_size=1), 0, None) is None  # DP without attention DP
    assert _dp_rank_of(Args(attn_dp_size=1, tp_size=2), 1, 5) == 5  # explicit rank wins
    assert _dp_rank_of(None, None, None) is None
