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
        fresh=True,  # what the role's process imported: the warm interpreter holds the scheduler's modules
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


def _launch_server_help(env: dict):
    """SGLang's real main-process entry point: ``python -m sglang.launch_server`` runs
    ``load_plugins()`` at module level, before it parses (here: ``--help``) its arguments."""
    import os
    import subprocess
    import sys

    full = dict(os.environ)
    full.pop("DSPARK_HARDEN_ROLE", None)
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"], env=full, capture_output=True, text=True, timeout=300
    )


def test_role_variable_left_in_a_real_launch_stops_startup():
    """Item 7 of "Fail closed and bounded everywhere": DSPARK_HARDEN_ROLE is inherited by every SGLang
    child; left exported in a launch it used to bind the main process as a scheduler. Now SGLang's own
    main entry point refuses to start, naming the variable and the real role."""
    r = _launch_server_help({"SGLANG_PLUGINS": "dspark_harden", "DSPARK_HARDEN_ROLE": "scheduler"})
    assert r.returncode != 0
    err = r.stdout + r.stderr
    assert "DSPARK_HARDEN_ROLE=scheduler is set, but SGLang started this process as its main" in err, err[-3000:]
    ok = _launch_server_help({"SGLANG_PLUGINS": "dspark_harden", "DSPARK_HARDEN_ROLE": "main"})
    assert ok.returncode == 0, (ok.stdout + ok.stderr)[-3000:]  # agreeing value: harmless
    plain = _launch_server_help({"SGLANG_PLUGINS": "dspark_harden"})
    assert plain.returncode == 0 and "dspark-harden" in plain.stderr + plain.stdout


def test_unknown_caller_without_a_role_is_refused_not_bound_as_main():
    """No SGLang process function on the stack and no role given: refuse instead of falling back to
    'main' (which would silently skip every other role's patches)."""
    rc, result, out = run_py(
        """
        from sglang.srt.plugins import load_plugins
        try:
            load_plugins()
        except SystemExit as exc:
            emit({"exit": str(exc)})
            raise
        emit({"exit": None})
        """,
        env={"SGLANG_PLUGINS": "dspark_harden"},
    )
    assert rc != 0 and result and result["exit"], out[-3000:]
    assert "cannot tell which SGLang process called load_plugins()" in result["exit"]
    assert "Refusing to bind as 'main'" in result["exit"]


def test_bad_role_value_is_named():
    rc, result, out = run_py(
        """
        from dspark_harden import entry
        try:
            entry.load()
        except SystemExit as exc:
            emit({"exit": str(exc)})
        """,
        env={"DSPARK_HARDEN_ROLE": "worker"},
    )
    assert result and "DSPARK_HARDEN_ROLE='worker' is not a role" in result["exit"], out[-3000:]


@pytest.mark.parametrize(
    "path,fn,entry",
    [
        ("/v/site-packages/sglang/srt/entrypoints/engine.py", "__init__", "engine"),
        ("/v/site-packages/sglang/srt/entrypoints/engine.py", "_launch_subprocesses", "engine"),
        ("/v/site-packages/sglang/launch_server.py", "<module>", "server"),
        ("/v/site-packages/sglang/cli/serve.py", "serve", "server"),
    ],
)
def test_main_entry_tells_the_users_engine_process_from_a_server(monkeypatch, path, fn, entry):
    """Issue 39: only a process the server owns is made a child subreaper (lifecycle.main): the caller of
    ``load_plugins()`` decides, from code compiled under the stock file name and function."""
    from dspark_harden.core import roles

    monkeypatch.delenv("DSPARK_HARDEN_ROLE", raising=False)
    ns = {"detect_context": roles.detect_context}
    if fn == "<module>":
        exec(compile("ctx = detect_context()\n", path, "exec"), ns)
        ctx = ns["ctx"]
    else:
        exec(compile(f"def {fn}():\n    return detect_context()\n", path, "exec"), ns)
        ctx = ns[fn]()
    assert ctx.role.value == "main" and ctx.main_entry == entry
