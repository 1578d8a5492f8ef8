"""pluggy hook points, SGLang's real loader, and the self-check CLI."""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
from pathlib import Path

import pluggy
import pytest

from dspark_harden.core import hookspecs
from dspark_harden.core.manager import make_manager
from tests.harness import warm

from ._proc import run_concurrently, run_py

ROOT = Path(__file__).resolve().parents[2]
HOOKS = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("dspark_")]


def test_misspelled_hook_implementation_fails_check_pending():
    class Typo:
        @hookspecs.hookimpl
        def dspark_feature(self):  # missing "s"
            return []

    with pytest.raises(pluggy.PluginValidationError, match="dspark_feature"):
        make_manager(extra=(Typo(),))


def test_every_hook_is_documented_with_its_exact_signature():
    doc = (ROOT / "docs" / "hooks.md").read_text()
    for name in HOOKS:
        sig = f"{name}{inspect.signature(getattr(hookspecs, name))}"
        assert f"`{sig}`" in doc, f"docs/hooks.md must document `{sig}`"
    documented = set(re.findall(r"`(dspark_[a-z_]+)\(", doc))
    assert documented == set(HOOKS), documented ^ set(HOOKS)


def test_every_hook_has_a_test():
    """datasette's meta-test: each hook name appears in some test under tests/."""
    text = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    untested = [h for h in HOOKS if not re.search(rf"\b{h}\b", text.replace("test_every_hook", ""))]
    assert not untested, f"hooks without a test: {untested}"


def test_hooks_are_called_with_keyword_arguments_only():
    pm = make_manager()
    with pytest.raises(TypeError):
        pm.hook.dspark_patches("scheduler", None)


def test_sglang_load_plugins_runs_the_plugin_in_a_fresh_process():
    rc, result, out = run_py(
        """
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from dspark_harden.core import binder
        rep = binder.STATE.report
        live = [(p.key, p.live_check()) for p in binder.STATE.patches]
        emit({"loaded": rep is not None, "ok": rep.ok if rep else None, "live": live,
              "features": {f.name: f.status for f in rep.features} if rep else {}})
        """,
        env={"SGLANG_PLUGINS": "dspark_harden", "DSPARK_HARDEN_ROLE": "controller"},
    )
    assert rc == 0, out[-3000:]
    assert result["loaded"] and result["ok"], out[-3000:]
    assert all(problem is None for _, problem in result["live"]), result["live"]
    assert result["features"].get("load-budget-throttle") == "upstream"


def test_other_plugin_selected_means_not_loaded_and_check_says_so():
    rc, result, out = run_py(
        """
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from dspark_harden.core import binder
        emit({"loaded": binder.STATE.report is not None})
        """,
        env={"SGLANG_PLUGINS": "someone_else"},
    )
    assert rc == 0 and result == {"loaded": False}, out[-2000:]
    proc = warm.run(
        [sys.executable, "-m", "dspark_harden", "check", "--json", "--role", "main"],
        env={**os.environ, "SGLANG_PLUGINS": "someone_else"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    data = json.loads(proc.stdout)
    assert data["ok"] is False and data["plugin_loaded"] is False
    assert any("does not name dspark_harden" in p for p in data["problems"])


def test_check_json_against_real_sglang():
    proc = warm.run(
        [sys.executable, "-m", "dspark_harden", "check", "--json"],
        env={**os.environ, "SGLANG_PLUGINS": "dspark_harden"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    data = json.loads(proc.stdout)
    assert proc.returncode == 0 and data["ok"] is True, data
    assert data["sglang_version"] == "0.5.23"
    assert data["features"], "no features reported"
    for feat in data["features"]:
        assert set(feat) >= {"name", "status", "targets"}
        assert feat["status"] in {"bound", "upstream", "disabled", "unavailable", "failed"}
        for t in feat["targets"]:
            assert set(t) >= {"target", "role", "bound", "detail"}
            assert isinstance(t["bound"], bool)


def test_check_hides_test_only_features_unless_asked_or_failed():
    """An operator's `check` does not list dspark-testsupport's feature (installed in this venv);
    --include-test-features does; a FAILED test-only feature is always shown (it fails the check)."""
    base = [sys.executable, "-m", "dspark_harden", "check", "--json", "--role", "main"]
    env = {**os.environ, "SGLANG_PLUGINS": "dspark_harden"}
    # four independent `check` processes, run at once (each spends ~15 s importing SGLang on one core)
    shown, table, everything, broken = run_concurrently(
        [
            (base, env),
            ([*base[:4], "--role", "main"], env),
            ([*base, "--include-test-features"], env),
            (base, {**env, "DSPARK_TESTFEATURE": "1", "DSPARK_TESTFEATURE_BREAK": "drift"}),
        ],
        timeout=300,
    )
    shown = json.loads(shown.stdout)
    assert "testfeature" not in {f["name"] for f in shown["features"]} and shown["hidden_test_features"] == [
        "testfeature"
    ]
    table = table.stdout
    assert "testfeature" not in table.split("(1 test-only feature(s) not shown")[0]
    assert "--include-test-features shows them" in table
    everything = json.loads(everything.stdout)
    assert "testfeature" in {f["name"] for f in everything["features"]}
    data = json.loads(broken.stdout)
    assert broken.returncode == 1 and [f["status"] for f in data["features"] if f["name"] == "testfeature"] == [
        "failed"
    ]


def test_bad_setting_makes_check_fail_naming_the_variable():
    proc = warm.run(
        [sys.executable, "-m", "dspark_harden", "check", "--json", "--role", "main"],
        env={**os.environ, "SGLANG_PLUGINS": "dspark_harden", "DSPARK_HARDEN_STRICT_EXTENSIONS": "yes"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    data = json.loads(proc.stdout)
    assert proc.returncode == 1 and not data["ok"]
    assert any("DSPARK_HARDEN_STRICT_EXTENSIONS" in p for p in data["problems"]), data


def test_env_lists_every_setting():
    from dspark_harden.core.manager import all_setting_specs

    proc = warm.run(
        [sys.executable, "-m", "dspark_harden", "env", "--json"], capture_output=True, text=True, timeout=120
    )
    rows = json.loads(proc.stdout)
    names = {r["name"] for r in rows}
    assert names == {s.name for s in all_setting_specs(make_manager())}
    assert all(r["doc"] and r["accepts"] for r in rows)


def test_patch_ledger_explains_every_patch():
    proc = warm.run(
        [sys.executable, "-m", "dspark_harden", "patches", "--json"], capture_output=True, text=True, timeout=120
    )
    rows = json.loads(proc.stdout)
    for r in rows:
        assert r["why"].strip() and r["retire_when"].strip() and r["roles"], r
        assert r["kind"] in {"wrap", "replace", "route", "attribute"}


class _Recorder:
    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    @hookspecs.hookimpl
    def dspark_process_bound(self, role, settings, report):
        self.calls.append((role, report.ok))
        if self.fail:
            raise RuntimeError("metrics directory unwritable")

    @hookspecs.hookimpl
    def dspark_cli(self, subparsers, bench_subparsers):
        p = bench_subparsers.add_parser("recorder")
        p.add_argument("--n", type=int, default=1)
        p.set_defaults(func=lambda args: self.calls.append(("bench", args.n)) or 7)


@pytest.mark.forked
def test_dspark_process_bound_runs_after_binding_and_failure_aborts():
    from dspark_harden import entry
    from dspark_harden.core import binder
    from dspark_harden.core.patch import Role

    ok = _Recorder()
    report = binder.bind(Role.DETOKENIZER, pm=make_manager(extra=(ok,)), environ={})
    entry._notify_bound(Role.DETOKENIZER, report)
    assert ok.calls == [(Role.DETOKENIZER, True)]

    bad = _Recorder(fail=True)
    binder.STATE.pm = make_manager(extra=(bad,))
    with pytest.raises(binder.BindError, match="metrics directory unwritable"):
        entry._notify_bound(Role.DETOKENIZER, report)


def test_dspark_cli_adds_commands():
    from dspark_harden.cli import build_parser

    rec = _Recorder()
    parser = build_parser(make_manager(extra=(rec,)))
    args = parser.parse_args(["bench", "recorder", "--n", "3"])
    assert args.func(args) == 7 and rec.calls == [("bench", 3)]


def test_docs_settings_is_current():
    """docs/settings.md must be regenerated (`dspark-harden env --markdown`) when a variable changes."""
    from dspark_harden.cli.ledger import env_markdown, env_rows

    expected = env_markdown(env_rows(load_extensions=False)).strip()
    assert (ROOT / "docs" / "settings.md").read_text().strip() == expected, "regenerate docs/settings.md"
