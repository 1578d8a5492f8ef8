"""Installed everywhere, harmful nowhere (issue 39): default-on features decide at bind time, from the
process's real server arguments, whether they apply.

Every case parses a launch command line with SGLang 0.5.23's own parser (``prepare_server_args``) and
resolves it the way a launch does (``resolve_once``, ``--device cpu`` so resolution runs on this host;
prefill CUDA graphs and EAGLE resolve there too), then binds the scheduler role through the real binder
with that ``ServerArgs`` as the process's. A precondition that is not met leaves a default-on feature
``unavailable`` (stock behaviour, nothing bound); with its switch set explicitly to 1 the bind fails,
naming the switch, the precondition and the flag to change. The four-process gloo case runs the
prefill-graph configuration check's process-bound hook and the check itself on a real 4-rank group.

What would make these fail (each mutation run, see the issue-39 note): dropping the geometry, speculative
or TBO precondition from ``prefill_graph.feature.preconditions`` (the feature binds, and the old refusal /
the 4-rank crash returns), dropping the grammar backend precondition, or ``binder.bind`` no longer failing
an explicitly enabled unavailable feature.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys

import pytest

from dspark_harden.devtools.tiny_models import ensure_model
from tests.harness import warm

PG = "prefill-graph-dp"
GRAMMAR = "grammar-service"
DPA = ["--tp", "2", "--dp", "2", "--enable-dp-attention"]
PREFILL = ["--cuda-graph-backend-prefill", "breakable"]


def _server_args(extra: list):
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(["--model-path", ensure_model("qwen3"), "--device", "cpu", *extra])
    sa.resolve_once()
    return sa


def _bind(extra: list, environ: dict, tp_rank: int = 0):
    from dspark_harden import entry
    from dspark_harden.core import binder, roles
    from dspark_harden.core.patch import Role

    sa = _server_args(extra)
    roles.CONTEXT = roles.ProcessContext(role=Role.SCHEDULER, server_args=sa, tp_rank=tp_rank, dp_rank=0)
    report = binder.bind(Role.SCHEDULER, environ=environ)
    error = None
    try:
        binder.raise_if_failed(report)
        entry._notify_bound(Role.SCHEDULER, report)
    except binder.BindError as exc:
        error = str(exc)
    return {f.name: f for f in report.features}, error


def _preload() -> None:
    """Import what a scheduler process has imported when it binds (the check child's list) once, in the
    pytest process at collection: a forked case (pytest-forked runs fixtures in the fork too) then pays
    for its own parse, resolution and bind only (~0.3 s instead of ~14 s)."""
    import importlib

    from dspark_harden.cli._check_child import PRELOAD

    for name in (*PRELOAD, "sglang.srt.server_args", "sglang.srt.arg_groups.pipeline"):
        importlib.import_module(name)


_preload()


def _draft():
    return ["--speculative-draft-model-path", ensure_model("qwen3")]


CASES = {
    # id: (launch arguments, {feature: (status, words the detail must contain)})
    "single": ([], {PG: ("unavailable", "DP attention is off"), GRAMMAR: ("bound", "")}),
    "tp2": (["--tp", "2"], {PG: ("unavailable", "DP attention is off")}),
    "dp2-no-dp-attention": (["--dp", "2"], {PG: ("unavailable", "DP attention is off")}),
    "dp2-attention-no-prefill-graph": (DPA, {PG: ("unavailable", "prefill CUDA graphs are not enabled")}),
    "dp2-attention-prefill-graph": (DPA + PREFILL, {PG: ("bound", ""), GRAMMAR: ("bound", "")}),
    "dp4-attention": (
        ["--tp", "4", "--dp", "4", "--enable-dp-attention", *PREFILL],
        {PG: ("unavailable", "4 attention-DP rank(s) of attention-TP 1")},
    ),
    "dp2-attention-tp2": (
        ["--tp", "4", "--dp", "2", "--enable-dp-attention", *PREFILL],
        {PG: ("unavailable", "2 attention-DP rank(s) of attention-TP 2")},
    ),
    "eagle": (
        DPA + PREFILL + ["--speculative-algorithm", "EAGLE", *_draft()],
        {PG: ("unavailable", "speculative algorithm EAGLE")},
    ),
    "tbo-full": (
        DPA + ["--cuda-graph-backend-prefill", "full", "--enable-two-batch-overlap"],
        {PG: ("unavailable", "two-batch overlap")},
    ),
    "llguidance": (["--grammar-backend", "llguidance"], {GRAMMAR: ("unavailable", "grammar backend is llguidance")}),
}


@pytest.mark.forked
@pytest.mark.parametrize("case", sorted(CASES))
def test_default_on_features_decide_from_the_real_server_args(case):
    extra, expected = CASES[case]
    feats, error = _bind(extra, environ={})
    assert error is None, error  # by default nothing refuses: unavailable is a status
    for name, (status, words) in expected.items():
        assert feats[name].status == status, (name, feats[name])
        assert words in feats[name].detail, (name, feats[name].detail)
        if status == "unavailable":
            assert not feats[name].targets  # nothing of it was bound: stock behaviour


@pytest.mark.forked
@pytest.mark.parametrize(
    "case,switch,flag",
    [
        ("eagle", "DSPARK_HARDEN_PREFILL_GRAPH", "--cuda-graph-backend-prefill disabled"),
        ("dp4-attention", "DSPARK_HARDEN_PREFILL_GRAPH", "--tp 2 --dp 2 --enable-dp-attention"),
        ("tbo-full", "DSPARK_HARDEN_PREFILL_GRAPH", "--enable-two-batch-overlap"),
        ("llguidance", "DSPARK_HARDEN_GRAMMAR", "--grammar-backend xgrammar"),
    ],
)
def test_an_explicit_switch_refuses_at_bind_time_naming_switch_precondition_and_flag(case, switch, flag):
    extra, _ = CASES[case]
    _feats, error = _bind(extra, environ={switch: "1"})
    assert error is not None and f"enabled by {switch}=1 but unavailable" in error, error
    assert flag in error, error


def _four_rank_worker(rank: int, init: str, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    try:
        feats, error = _bind(["--tp", "4", "--dp", "4", "--enable-dp-attention", *PREFILL], {}, tp_rank=rank)
        from dspark_harden.prefill_graph import config_digest
        from dspark_harden.prefill_graph.admission import RUNTIME

        raised = None
        try:  # the check itself, on the real 4-rank group: rows agree, so no raise either
            config_digest.check(None, 4.0, group=dist.group.WORLD)
        except Exception as exc:  # noqa: BLE001
            raised = f"{type(exc).__name__}: {exc}"
        out.put((rank, feats[PG].status, feats[PG].detail, error, RUNTIME.config_check is None, raised))
    except BaseException as exc:  # noqa: BLE001
        out.put((rank, "crashed", f"{type(exc).__name__}: {exc}", None, None, None))
    finally:
        dist.destroy_process_group()


@pytest.mark.forked
def test_four_gloo_ranks_at_the_default_are_unavailable_and_never_raise(tmp_path):
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_four_rank_worker, args=(r, init, out)) for r in range(4)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(60)
    for rank, status, detail, error, no_check, raised in results:
        assert status == "unavailable", (rank, status, detail)
        assert "4 attention-DP rank(s)" in detail and error is None and no_check, (rank, detail, error)
        assert raised is None, (rank, raised)


def test_config_rows_of_four_ranks_name_the_first_rank_that_differs():
    from dspark_harden.prefill_graph import config_digest as C
    from dspark_harden.prefill_graph import runner as R

    a = C.payload(R.build_runner(R.capture_config()), 4.0)
    b = C.payload(R.build_runner(R.capture_config(slots=16)), 4.0)
    assert C.compare([a, a, a, a]) is None
    msg = C.compare([a, a, b, a])
    assert "request_slots: dp_rank 0 = 32, dp_rank 2 = 16" in msg


def test_the_presence_line_says_why_the_plugin_is_loaded_and_what_does_not_apply():
    from dspark_harden import entry
    from dspark_harden.core.binder import BindReport, FeatureStatus
    from dspark_harden.core.patch import Role

    report = BindReport(role="scheduler", sglang_version="0.5.23")
    report.features = [
        FeatureStatus(name="grammar-service", area="grammar", status="bound"),
        FeatureStatus(name=PG, area="prefill-graph", status="unavailable", detail="DP attention is off"),
    ]
    unset = entry.presence_line(Role.SCHEDULER, report, environ={})
    assert "loaded because SGLANG_PLUGINS is unset (stock SGLang loads every installed plugin)" in unset
    assert (
        "bound grammar-service" in unset and f"unavailable here, stock behaviour: {PG} (DP attention is off)" in unset
    )
    named = entry.presence_line(Role.SCHEDULER, report, environ={"SGLANG_PLUGINS": "other, dspark_harden"})
    assert "loaded because SGLANG_PLUGINS names it (other,dspark_harden)" in named
    from dspark_harden.devtools.server import PLUGIN_ACTIVE_RE

    assert PLUGIN_ACTIVE_RE.search(unset).group(1) == "scheduler"


def test_check_judges_a_launch_command_before_it_starts():
    """``dspark-harden check -- <launch arguments>``: one child, SGLang's own parser and resolution."""
    argv = ["--model-path", ensure_model("qwen3"), "--device", "cpu", *DPA, *PREFILL]
    argv += ["--speculative-algorithm", "EAGLE", *_draft(), "--grammar-backend", "llguidance"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_HARDEN_") and k != "SGLANG_PLUGINS"}
    cmd = [sys.executable, "-m", "dspark_harden", "check", "--json", "--role", "scheduler", "--", *argv]
    r = warm.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]  # by default: unavailable, not a refusal
    result = json.loads(r.stdout)
    feats = {f["name"]: f for f in result["features"]}
    assert feats[PG]["status"] == "unavailable" and "speculative algorithm EAGLE" in feats[PG]["detail"]
    assert feats[GRAMMAR]["status"] == "unavailable" and "llguidance" in feats[GRAMMAR]["detail"]
    assert result["launch"]["argv"] == argv and result["launch"]["resolution"].startswith("resolved")
    assert result["launch"]["loaded_because"].startswith("SGLANG_PLUGINS is unset")
