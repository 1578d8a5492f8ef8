"""Other SGLang releases: ``dspark-harden port-report`` and the one-line out-of-range verdict.

Hermetic: the "other release" is the installed stock sglang 0.5.23 re-published as 0.5.22 in a tmp
overlay (every file a symlink to the installed one, so it imports and runs exactly like stock) with
its own dist-info, one patch target's method edited (a comment line added: its source text changes)
one read-only stock source a feature mirrors edited the same way (hook ``dspark_stock_sources``), and one
target's method renamed away (missing). port-report must name exactly those three with the diffs of the
edits; `check` and a real plugin startup (SGLang's own ``load_plugins()``) must open with the
verdict line. The real 0.5.22 wheel's report is measured in docs/porting.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from dspark_harden.cli import port_report
from dspark_harden.core import porting
from dspark_harden.core.patch import SUPPORTED_SGLANG
from tests.harness import warm

EDITED = "sglang.srt.managers.scheduler:Scheduler.run_batch"
MIRRORED = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner._has_inactive_dp_rank"
REMOVED = "sglang.srt.utils.watchdog:SubprocessWatchdog._check_processes"
MARK = "# port-report test: this line is new in the other release"


def _materialize(overlay_pkg: str, rel: str) -> str:
    """Replace the symlink of one module in the overlay by a real copy (to edit it)."""
    path = os.path.join(overlay_pkg, rel)
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    os.unlink(path)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path


@pytest.fixture(scope="module")
def other_release(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-other")
    stock = os.path.dirname(importlib.util.find_spec("sglang").origin)
    pkg = os.path.join(root, "sglang")
    subprocess.run(["cp", "-rs", stock, pkg], check=True)
    dist = os.path.join(root, "sglang-0.5.22.dist-info")
    os.makedirs(dist)
    with open(os.path.join(dist, "METADATA"), "w") as fh:
        fh.write("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.22\n")

    path = _materialize(pkg, "srt/managers/scheduler.py")
    text = open(path, encoding="utf-8").read()
    new, n = re.subn(r"(\n    def run_batch\(\n(?:.*\n)*?.*\):\n)", r"\1        " + MARK + "\n", text, count=1)
    assert n == 1, "Scheduler.run_batch signature not found in stock scheduler.py"
    open(path, "w", encoding="utf-8").write(new)

    path = _materialize(pkg, "srt/model_executor/runner/prefill_cuda_graph_runner.py")
    text = open(path, encoding="utf-8").read()
    new, n = re.subn(
        r"(\n    def _has_inactive_dp_rank\((?:.*\n)*?.*\):\n)", r"\1        " + MARK + "\n", text, count=1
    )
    assert n == 1, "PrefillCudaGraphRunner._has_inactive_dp_rank not found"
    open(path, "w", encoding="utf-8").write(new)

    path = _materialize(pkg, "srt/utils/watchdog.py")
    text = open(path, encoding="utf-8").read()
    assert text.count("def _check_processes(") == 1
    open(path, "w", encoding="utf-8").write(text.replace("def _check_processes(", "def _check_processes_v2(", 1))
    return str(root)


def _env(overlay: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = overlay + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["SGLANG_PLUGINS"] = "dspark_harden"
    return env


def test_port_report_names_exactly_the_changed_and_missing_targets_with_a_diff(other_release):
    total = len(porting.fingerprinted_targets())
    rep = port_report.report(sglang=other_release)
    assert rep["sglang_version"] == "0.5.22" and rep["in_supported_range"] is False
    assert rep["baseline_version"] == "0.5.23"  # the installed release: the diffs' "before"
    assert rep["targets"] == total and total >= 50
    rows = {r["target"]: r for r in rep["rows"]}
    assert sorted(rows) == sorted([EDITED, MIRRORED, REMOVED])
    assert (rep["changed"], rep["missing"]) == (2, 1)
    assert rows[MIRRORED]["kind"] == "mirrored" and rows[MIRRORED]["feature"] == "prefill-graph-dp"
    assert [ln for ln in rows[MIRRORED]["diff"].splitlines() if ln.startswith("+") and not ln.startswith("+++")] == [
        "+    " + MARK
    ]

    edited = rows[EDITED]
    assert edited["status"] == porting.CHANGED and edited["found"] != edited["expected"]
    added = [ln for ln in edited["diff"].splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert added == ["+    " + MARK]  # the diff is of the target's text: exactly the one new line
    assert edited["diff"].startswith(
        "--- sglang-0.5.23/sglang/srt/managers/scheduler.py:Scheduler.run_batch\n"
        "+++ sglang-0.5.22/sglang/srt/managers/scheduler.py:Scheduler.run_batch\n"
    )

    removed = rows[REMOVED]
    assert removed["status"] == porting.MISSING and removed["found"] is None
    assert "'_check_processes' is not defined in the class SubprocessWatchdog body" in removed["detail"]
    assert removed["diff"].splitlines()[2].startswith("@@ -1,") and "+++ sglang-0.5.22/(missing)" in removed["diff"]


def test_port_report_cli_exit_status_and_bad_input(other_release, tmp_path):
    cmd = [sys.executable, "-m", "dspark_harden", "port-report"]
    proc = warm.run(cmd + ["--sglang", other_release, "--no-diff"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith(
        f"port-report: sglang 0.5.22 at {other_release}/sglang (supported: {SUPPORTED_SGLANG}): 3 of "
    ) and first.endswith("(2 changed, 1 missing)")
    assert "====" not in proc.stdout  # --no-diff

    proc = warm.run(cmd + ["--json"], capture_output=True, text=True, timeout=120)  # the installed 0.5.23
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert (rep["changed"], rep["missing"], rep["rows"]) == (0, 0, [])

    for path, want in (
        (tmp_path / "nope", "no such file or directory"),
        (tmp_path, "no SGLang package there"),
        (other_release + "/sglang-0.5.22.dist-info/METADATA", "not a directory"),
    ):
        proc = warm.run(cmd + ["--sglang", str(path)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and want in proc.stderr and proc.stdout == "", (path, proc.stderr)
    proc = warm.run(
        cmd + ["--sglang", other_release, "--baseline", other_release], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "is not the supported release" in proc.stderr


def test_port_report_of_the_installed_other_release_without_a_baseline(other_release):
    """Run where the *installed* SGLang is the other release: the list is complete, the diffs need a baseline
    (NOTE says how to get one), and --baseline to the supported release restores them."""
    env = _env(other_release)
    cmd = [sys.executable, "-m", "dspark_harden", "port-report", "--json"]
    proc = warm.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["sglang"] == os.path.join(other_release, "sglang") and rep["baseline"] is None
    assert sorted(r["target"] for r in rep["rows"]) == sorted([EDITED, MIRRORED, REMOVED])
    assert all(r["diff"] is None for r in rep["rows"])
    assert rep["notes"] and "pass --baseline PATH" in rep["notes"][0]
    stock_root = os.path.dirname(os.path.dirname(importlib.util.find_spec("sglang").origin))
    proc = warm.run(cmd + ["--baseline", stock_root], env=env, capture_output=True, text=True, timeout=120)
    rep = json.loads(proc.stdout)
    assert proc.returncode == 1 and rep["baseline_version"] == "0.5.23" and rep["notes"] == []
    assert all(r["diff"] for r in rep["rows"])


def _verdict(total: int) -> str:
    return porting.verdict_line("0.5.22", 3, total)


def test_out_of_range_check_opens_with_the_verdict_line(other_release):
    total = len(porting.fingerprinted_targets())
    proc = warm.run(
        [sys.executable, "-m", "dspark_harden", "check", "--role", "scheduler"],
        env=_env(other_release),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == _verdict(total)
    assert lines[0] == (
        f"sglang 0.5.22 is outside the supported range {SUPPORTED_SGLANG}: 3 of {total} patch "
        f"targets' stock source changed (`dspark-harden port-report` lists them with diffs)"
    )
    assert lines[1] == "dspark-harden check against sglang 0.5.22: FAILED"
    # the per-target detail follows, and says which targets' source changed
    assert (
        f"{EDITED} [scheduler] UNBOUND: sglang 0.5.22 is outside the range this patch was written for "
        f"({SUPPORTED_SGLANG}); its stock source changed" in proc.stdout
    )
    assert (
        "Scheduler.get_next_batch_to_run [scheduler] UNBOUND: sglang 0.5.22 is outside the range this patch "
        "was written for (>=0.5.23,<0.5.24); its stock source is unchanged" in proc.stdout
    )


def test_out_of_range_startup_refusal_opens_with_the_verdict_line(other_release):
    """A real plugin startup: SGLang's own loader (the overlay's stock code) in a scheduler-role process."""
    total = len(porting.fingerprinted_targets())
    env = _env(other_release)
    env["DSPARK_HARDEN_ROLE"] = "scheduler"
    code = (
        "import sglang.srt.plugins as p; assert p.__file__.startswith(%r), p.__file__; p.load_plugins()" % other_release
    )
    proc = warm.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    tail = proc.stderr.splitlines()
    i = tail.index(_verdict(total))  # printed by SystemExit (BindError), after the logged copies
    assert tail[i + 1].startswith("dspark-harden refuses to start (scheduler process, sglang 0.5.22): ")
    assert tail[-1].startswith("  - ")  # the per-target detail comes after the verdict


def test_stock_sources_hook_declares_the_mirrored_sources_and_they_match_the_installed_release():
    from dspark_harden.core.hookspecs import hookimpl
    from dspark_harden.core.manager import make_manager

    pm = make_manager()
    declared = {s.target: s for group in pm.hook.dspark_stock_sources() for s in group or []}
    assert declared[MIRRORED].feature == "prefill-graph-dp"
    assert declared["sglang.srt.managers.async_d2h_copy_worker:HostCopyDone"].feature == "dspark-result-materializer"
    targets = porting.fingerprinted_targets(pm)
    assert {t for t, _, kind, _ in targets if kind == "mirrored"} == set(declared) - {
        p.target for p in porting.declared_patches(pm) if p.fingerprint
    }
    rows = porting.compare(porting.SglangTree.installed(), targets)
    assert [r.target for r in rows if r.status != porting.SAME] == []  # recorded = the installed 0.5.23 text

    class Bad:
        @hookimpl
        def dspark_stock_sources(self):
            return [("prefill-graph-dp", MIRRORED, "0" * 16)]

    with pytest.raises(porting.PortError, match="dspark_stock_sources returned .* not a StockSource"):
        porting.fingerprinted_targets(make_manager(extra=(Bad(),)))
