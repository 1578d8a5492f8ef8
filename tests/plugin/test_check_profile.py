"""``dspark-harden check --profile dsv4-dspark-dp2``: fails unless the deployment's features reach their
statuses in the scheduler role (docs/deploy-dsv4-dspark-dp2.md). Each case runs the real CLI: a real
check child binds against the real sglang 0.5.23 (subprocesses; nothing binds in the pytest process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dspark_harden.cli.profiles import DSV4_DSPARK_DP2

CUDA_ONLY = sorted(n.feature for n in DSV4_DSPARK_DP2.needs if n.cuda)
SWITCHES = {n.switch: "1" for n in DSV4_DSPARK_DP2.needs if n.switch and not n.cuda}  # a host without CUDA exports
OPT_IN = ["DSPARK_HARDEN_DSPARK_MASKS", "DSPARK_HARDEN_DSPARK_RESULTS", "SGLANG_DSPARK_DP2_SHM_MLP_SYNC"]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSPARK_HARDEN_", "SGLANG_DSPARK_"))}
    env.update(SGLANG_PLUGINS="dspark_harden", **extra)
    return env


def _cases() -> dict:
    """Every profile check this module asserts on: name -> (env, extra args)."""
    cuda = _cuda()
    cases = {
        # with CUDA the full profile (the DSV4 switches on too); without, everything else, and the verdict
        # says what was left out
        "passes": (_env(**DSV4_DSPARK_DP2.env()), ("--json",))
        if cuda
        else (_env(**SWITCHES), ("--json", "--skip-cuda-features")),
        "partial_table": (_env(**SWITCHES), ("--skip-cuda-features",)),
        "default_off": (_env(**{**SWITCHES, "DSPARK_HARDEN_PREFILL_GRAPH": "0"}), ("--skip-cuda-features",)),
        "dsv4_not_bound": (_env(**(SWITCHES if cuda else DSV4_DSPARK_DP2.env())), ()),
    }
    for missing in OPT_IN + ["DSPARK_HARDEN_PREFILL_GRAPH"]:
        cases[f"missing:{missing}"] = (
            _env(**{k: v for k, v in SWITCHES.items() if k != missing}),
            ("--skip-cuda-features",),
        )
    return cases


@pytest.fixture(scope="module")
def checks() -> dict:
    """The module's real `check --profile` runs, started together (each is a fresh interpreter importing
    SGLang on one core; at most four at once): name -> (rc, stdout, stderr)."""
    from ._proc import run_concurrently

    cases = _cases()
    argv = [sys.executable, "-m", "dspark_harden", "check", "--role", "scheduler", "--profile", DSV4_DSPARK_DP2.name]
    done = run_concurrently([([*argv, *args], env) for env, args in cases.values()], timeout=600, parallel=4)
    return {name: (p.returncode, p.stdout, p.stderr) for name, p in zip(cases, done)}


def test_profile_passes_with_the_deployment_switches(checks):
    assert CUDA_ONLY == ["dsv4-inplace-q-norm-rope", "dsv4-planner-guards", "dsv4-sparse-prefill-pool"]
    assert set(OPT_IN) < set(SWITCHES) and "DSPARK_HARDEN_PREFILL_GRAPH" in SWITCHES
    rc, out, err = checks["passes"]
    result = json.loads(out)
    prof = result["profile"]
    assert rc == 0 and result["ok"] and prof["ok"] and prof["problems"] == [], (out[-3000:], err[-2000:])
    assert prof["role"] == "scheduler"
    assert sorted(prof["met"]) == sorted(n.feature for n in DSV4_DSPARK_DP2.needs if not n.cuda or _cuda())
    assert sorted(prof["skipped"]) == ([] if _cuda() else CUDA_ONLY)
    bound = {f["name"] for f in result["features"] if f["status"] == "bound"}
    assert {"dp2-native-exchange", "dspark-masks", "dspark-result-materializer", "prefill-graph-dp"} <= bound

    assert prof["notes"] == list(DSV4_DSPARK_DP2.notes) and len(prof["notes"]) == 1
    rc, out, _ = checks["partial_table"]
    assert f"NOTE: {DSV4_DSPARK_DP2.notes[0]}" in out.splitlines(), out[-3000:]
    assert "NOTE: TBO prefill graphs do not apply to DeepSeek V4 on sglang 0.5.23" in out

    if not _cuda():
        assert rc == 0
        assert (
            "profile dsv4-dspark-dp2 (scheduler role): PARTIAL (--skip-cuda-features): 17 feature(s) as needed, "
            "not checked (CUDA only): dsv4-sparse-prefill-pool, dsv4-inplace-q-norm-rope, dsv4-planner-guards" in out
        ), out[-2000:]


@pytest.mark.parametrize("missing", OPT_IN + ["DSPARK_HARDEN_PREFILL_GRAPH"])
def test_profile_fails_naming_the_feature_whose_switch_is_missing(checks, missing):
    rc, out, err = checks[f"missing:{missing}"]
    need = next(n for n in DSV4_DSPARK_DP2.needs if n.switch == missing)
    assert rc == 1, out[-2000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("PROFILE: ")]
    if missing in OPT_IN:  # opt-in: not bound at all
        want = f"PROFILE: {need.feature} ({need.why}) is disabled ({missing}=0): export {missing}=1"
    else:  # on by default: bound, but startup would skip it as unavailable instead of refusing
        want = (
            f"PROFILE: {need.feature} ({need.why}) binds by default, but {missing} is not exported as 1: only "
            f"an explicit 1 makes startup refuse when the server's arguments leave the feature unavailable "
            f"(unset, it is skipped as unavailable): export {missing}=1"
        )
    assert lines == [want], out[-3000:]
    assert "profile dsv4-dspark-dp2 (scheduler role): FAILED: 16 feature(s) as needed, 1 not" in out


def test_profile_fails_naming_a_default_feature_switched_off(checks):
    rc, out, _ = checks["default_off"]
    assert rc == 1
    assert (
        "PROFILE: prefill-graph-dp (one DP decision for prefill CUDA graphs, no rank-local eager fallback) is "
        "disabled (DSPARK_HARDEN_PREFILL_GRAPH=0): export DSPARK_HARDEN_PREFILL_GRAPH=1"
    ) in out


def test_profile_names_the_dsv4_features_that_do_not_bind(checks):
    """Without CUDA they cannot bind (switched on: failed, needs CUDA); with CUDA, left switched off: disabled."""
    cuda = _cuda()
    rc, out, _ = checks["dsv4_not_bound"]
    assert rc == 1
    lines = [ln for ln in out.splitlines() if ln.startswith("PROFILE: ")]
    assert [ln.split(" ")[1] for ln in lines] == [
        "dsv4-sparse-prefill-pool",
        "dsv4-inplace-q-norm-rope",
        "dsv4-planner-guards",
    ], out[-3000:]
    if cuda:
        assert all(" is disabled (DSPARK_HARDEN_DSV4_" in ln for ln in lines), lines
    else:
        assert all(
            "is failed, the profile needs it bound: enabled by DSPARK_HARDEN_DSV4_" in ln and "needs CUDA" in ln
            for ln in lines
        ), lines


def test_the_tbo_note_is_true_of_the_live_code():
    """What the profile's TBO note says, re-checked on sglang 0.5.23 and the plugin (no subprocess): the full
    prefill runner calls the attention backend's ``init_forward_metadata_out_graph`` at capture and at every
    replay, and DSV4's raises NotImplementedError for an EXTEND batch before reading anything else; the
    plugin's TBO opt-in serves the full backend only (breakable stays refused). A release that changes either
    turns this red: then the note (and docs/deploy-dsv4-dspark-dp2.md, "Trade-offs") must change."""
    import inspect
    import types

    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner import prefill_cuda_graph_runner as pg

    from dspark_harden.prefill_graph import tbo

    assert "TBO prefill graphs do not apply to DeepSeek V4" in DSV4_DSPARK_DP2.notes[0]
    runner = inspect.getsource(pg.PrefillCudaGraphRunner)
    assert runner.count("attn_backend.init_forward_metadata_out_graph(") == 2  # capture and replay (full)
    backend = object.__new__(DeepseekV4AttnBackend)
    with pytest.raises(NotImplementedError, match="unsupported forward_mode=<ForwardMode.EXTEND"):
        DeepseekV4AttnBackend.init_forward_metadata_out_graph(
            backend, types.SimpleNamespace(forward_mode=ForwardMode.EXTEND), in_capture=True
        )
    ns = types.SimpleNamespace

    def args(backend):
        return ns(enable_two_batch_overlap=True, cuda_graph_config=ns(prefill=ns(backend=backend)))

    assert tbo.refusal(args("breakable"), allow_full=True) == tbo.REFUSAL_BREAKABLE
    assert tbo.refusal(args("full"), allow_full=True) is None


def test_profile_bad_input():
    proc = subprocess.run(
        [sys.executable, "-m", "dspark_harden", "check", "--profile", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "invalid choice: 'nope' (choose from 'dsv4-dspark-dp2')" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "dspark_harden", "check", "--role", "main", "--profile", "dsv4-dspark-dp2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "is judged in the scheduler role, which --role leaves out" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "dspark_harden", "check", "--skip-cuda-features"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--skip-cuda-features applies only with --profile" in proc.stderr


def test_deploy_page_names_every_variable_and_exports_every_profile_switch():
    """docs/deploy-dsv4-dspark-dp2.md stays complete: every variable the built-in features declare appears,
    and the recipe exports every switch of the profile as 1 (no server needed: the declarations only)."""
    import re

    from dspark_harden.cli.ledger import env_rows

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "docs", "deploy-dsv4-dspark-dp2.md"), encoding="utf-8").read()
    missing = [
        r["name"]
        for r in env_rows(load_extensions=False)
        if f"`{r['name']}`" not in text and not re.search(rf"^export {r['name']}=", text, re.M)
    ]
    assert missing == [], f"variables missing from docs/deploy-dsv4-dspark-dp2.md: {missing}"
    exported = dict(re.findall(r"^export ([A-Z_0-9]+)=(\S+)", text, re.M))
    assert {k: exported.get(k) for k in DSV4_DSPARK_DP2.env()} == DSV4_DSPARK_DP2.env()
    assert exported["SGLANG_PLUGINS"] == "dspark_harden"
    assert "dspark-harden check --profile dsv4-dspark-dp2" in text


def test_deploy_page_metrics_exist():
    """Every metric family the deploy page tells an operator to query is declared (no typo'd proof)."""
    import re

    from dspark_harden.core import metrics

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "docs", "deploy-dsv4-dspark-dp2.md"), encoding="utf-8").read()
    named = set(re.findall(r"\b(dspark_harden_[a-z0-9_]+)", text))
    declared = set(metrics.registry())
    assert len(named) >= 20 and sorted(named - declared) == []
