"""``dspark-harden check --profile dsv4-dspark-dp2``: fails unless the deployment's features reach their
statuses in the scheduler role (docs/deploy-dsv4-dspark-dp2.md). Each case runs the real CLI: a real
check child binds against the real sglang 0.5.23 (subprocesses; nothing binds in the pytest process)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from dspark_harden.cli.profiles import DSV4_DSPARK_DP2
from tests.harness import warm

CUDA_ONLY = sorted(n.feature for n in DSV4_DSPARK_DP2.needs if n.cuda)
# a host without CUDA exports these (the operator's choice, prefill graphs, is not among them)
SWITCHES = {n.switch: "1" for n in DSV4_DSPARK_DP2.needs if n.switch and not n.cuda and not n.choice}
OPT_IN = ["DSPARK_HARDEN_DSPARK_MASKS", "DSPARK_HARDEN_DSPARK_RESULTS", "SGLANG_DSPARK_DP2_SHM_MLP_SYNC"]
PG, PG_SWITCH = "prefill-graph-dp", "DSPARK_HARDEN_PREFILL_GRAPH"
# the launch arguments of docs/deploy-dsv4-dspark-dp2.md's recipe without prefill graphs (the model paths do
# not exist here: the check judges them as given, before resolution, and says so); with prefill graphs: + PREFILL
LAUNCH = [
    "--model-path", "/models/DeepSeek-V4-Flash", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention",
    "--enable-dp-lm-head", "--speculative-algorithm", "DSPARK",
    "--speculative-draft-model-path", "/models/DeepSeek-V4-Flash-DSpark", "--grammar-backend", "xgrammar",
    "--enable-dp-attention-local-control-broadcast", "--enable-metrics", "--host", "0.0.0.0", "--port", "30000",
]  # fmt: skip
PREFILL = ["--cuda-graph-backend-prefill", "breakable"]


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
    # with CUDA the full profile (the DSV4 switches on too); without, everything else, and the verdict says
    # what was left out
    base, skip = (DSV4_DSPARK_DP2.env(), ()) if cuda else (SWITCHES, ("--skip-cuda-features",))
    cases = {
        "passes": (_env(**base), ("--json", *skip)),
        "partial_table": (_env(**SWITCHES, **{PG_SWITCH: "1"}), ("--skip-cuda-features",)),
        # a default feature switched off fails the profile; the optional one switched off does not
        "default_off": (
            _env(**{**SWITCHES, "DSPARK_HARDEN_GRAMMAR": "0", PG_SWITCH: "0"}),
            ("--skip-cuda-features",),
        ),
        "dsv4_not_bound": (_env(**(SWITCHES if cuda else DSV4_DSPARK_DP2.env())), ()),
        # the recipe's two launch commands: without prefill graphs, and with them (switch exported)
        "launch_without": (_env(**base), ("--json", *skip, "--", *LAUNCH)),
        "launch_with": (_env(**base, **{PG_SWITCH: "1"}), ("--json", *skip, "--", *LAUNCH, *PREFILL)),
        # half a choice: the flag without the switch (binds by default: not fail-closed), the switch without
        # the flag (the explicit switch fails)
        "launch_with_unexported": (_env(**base), (*skip, "--", *LAUNCH, *PREFILL)),
        "launch_switch_without_flag": (_env(**base, **{PG_SWITCH: "1"}), (*skip, "--", *LAUNCH)),
    }
    for missing in OPT_IN:
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


def _optional_line(out: str) -> list:
    return [ln for ln in out.splitlines() if ln.startswith("OPTIONAL: ")]


def test_profile_passes_with_the_deployment_switches(checks):
    assert CUDA_ONLY == ["dsv4-inplace-q-norm-rope", "dsv4-planner-guards", "dsv4-sparse-prefill-pool"]
    assert set(OPT_IN) < set(SWITCHES) and PG_SWITCH not in SWITCHES and PG_SWITCH not in DSV4_DSPARK_DP2.env()
    rc, out, err = checks["passes"]
    result = json.loads(out)
    prof = result["profile"]
    assert rc == 0 and result["ok"] and prof["ok"] and prof["problems"] == [], (out[-3000:], err[-2000:])
    assert prof["role"] == "scheduler"
    # prefill graphs not chosen (switch unset, no launch arguments): optional, not a problem
    want = sorted(n.feature for n in DSV4_DSPARK_DP2.needs if (not n.cuda or _cuda()) and not n.choice)
    assert sorted(prof["met"]) == want and PG not in prof["met"]
    assert prof["optional"] == [
        f"{PG} not chosen ({PG_SWITCH} is not exported as 1 and no launch arguments were given (check ... -- "
        f"ARGS)): {DSV4_DSPARK_DP2.needs[[n.feature for n in DSV4_DSPARK_DP2.needs].index(PG)].choice}"
    ]
    assert sorted(prof["skipped"]) == ([] if _cuda() else CUDA_ONLY)
    bound = {f["name"] for f in result["features"] if f["status"] == "bound"}
    assert {"dp2-native-exchange", "dspark-masks", "dspark-result-materializer", PG} <= bound

    assert prof["notes"] == list(DSV4_DSPARK_DP2.notes) and len(prof["notes"]) == 1
    rc, out, _ = checks["partial_table"]  # prefill graphs chosen by the switch: judged like any need
    assert f"NOTE: {DSV4_DSPARK_DP2.notes[0]}" in out.splitlines(), out[-3000:]
    assert "NOTE: TBO prefill graphs do not apply to DeepSeek V4 on sglang 0.5.23" in out
    assert _optional_line(out) == [], out[-3000:]

    if not _cuda():
        assert rc == 0
        assert (
            "profile dsv4-dspark-dp2 (scheduler role): PARTIAL (--skip-cuda-features): 17 feature(s) as needed, "
            "not checked (CUDA only): dsv4-sparse-prefill-pool, dsv4-inplace-q-norm-rope, dsv4-planner-guards" in out
        ), out[-2000:]


def test_prefill_graphs_are_the_operators_choice_judged_against_the_launch_arguments(checks):
    """The recipe's two launch commands through ``check --profile dsv4-dspark-dp2 -- ARGS``: without
    ``--cuda-graph-backend-prefill breakable`` prefill-graph-dp is unavailable (stock's DSV4 default) and the
    profile passes saying what is lost and gained; with it (and the switch exported) it must bind and counts as
    needed. Half a choice fails: the flag without the switch, or the switch without the flag."""
    need = next(n for n in DSV4_DSPARK_DP2.needs if n.feature == PG)
    assert "lost: prefill CUDA graphs" in need.choice and "gained: no c4-indexer scratch" in need.choice
    n_all = len([n for n in DSV4_DSPARK_DP2.needs if not n.cuda or _cuda()])

    rc, out, err = checks["launch_without"]
    result = json.loads(out)
    prof, feats = result["profile"], {f["name"]: f for f in result["features"]}
    assert rc == 0 and result["ok"] and prof["ok"] and prof["problems"] == [], (out[-3000:], err[-2000:])
    assert result["launch"]["argv"] == LAUNCH and result["launch"]["resolution"].startswith("not resolvable")
    assert feats[PG]["status"] == "unavailable" and "prefill CUDA graphs are not enabled" in feats[PG]["detail"]
    assert PG not in prof["met"] and len(prof["met"]) == n_all - 1
    assert len(prof["optional"]) == 1 and prof["optional"][0].startswith(
        f"{PG} not chosen (the launch arguments leave it unavailable: prefill CUDA graphs are not enabled"
    )
    assert prof["optional"][0].endswith(need.choice)

    rc, out, err = checks["launch_with"]
    result = json.loads(out)
    prof, feats = result["profile"], {f["name"]: f for f in result["features"]}
    assert rc == 0 and result["ok"] and prof["ok"] and prof["problems"] == [], (out[-3000:], err[-2000:])
    assert result["launch"]["argv"] == LAUNCH + PREFILL
    assert feats[PG]["status"] == "bound" and PG in prof["met"] and len(prof["met"]) == n_all
    assert prof["optional"] == []

    rc, out, _ = checks["launch_with_unexported"]
    assert rc == 1
    assert [ln for ln in out.splitlines() if ln.startswith("PROFILE: ")] == [
        f"PROFILE: {PG} ({need.why}) binds by default, but {PG_SWITCH} is not exported as 1: only an explicit 1 "
        f"makes startup refuse when the server's arguments leave the feature unavailable (unset, it is skipped "
        f"as unavailable): export {PG_SWITCH}=1"
    ], out[-3000:]
    assert _optional_line(out) == []

    rc, out, _ = checks["launch_switch_without_flag"]
    lines = [ln for ln in out.splitlines() if ln.startswith("PROFILE: ")]
    assert rc == 1 and len(lines) == 1, out[-3000:]
    assert lines[0].startswith(f"PROFILE: {PG} ({need.why}) is failed, the profile needs it bound: ")
    assert "prefill CUDA graphs are not enabled" in lines[0]
    assert lines[0].endswith(f"(it is the operator's choice in this profile: leave {PG_SWITCH} unset to go without it)")


@pytest.mark.parametrize("missing", OPT_IN)
def test_profile_fails_naming_the_feature_whose_switch_is_missing(checks, missing):
    rc, out, err = checks[f"missing:{missing}"]
    need = next(n for n in DSV4_DSPARK_DP2.needs if n.switch == missing)
    assert rc == 1, out[-2000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("PROFILE: ")]
    want = f"PROFILE: {need.feature} ({need.why}) is disabled ({missing}=0): export {missing}=1"
    assert lines == [want], out[-3000:]
    assert (
        "profile dsv4-dspark-dp2 (scheduler role): FAILED: 15 feature(s) as needed, 1 not, 1 optional not chosen" in out
    )


def test_profile_fails_naming_a_default_feature_switched_off(checks):
    """A default-on feature switched off fails the profile; the optional one switched off is only reported."""
    rc, out, _ = checks["default_off"]
    assert rc == 1
    assert [ln for ln in out.splitlines() if ln.startswith("PROFILE: ")] == [
        "PROFILE: grammar-service (canonical keys, bounded LRU, one compile per key, persistent cache) is "
        "disabled (DSPARK_HARDEN_GRAMMAR=0): export DSPARK_HARDEN_GRAMMAR=1"
    ], out[-3000:]
    need = next(n for n in DSV4_DSPARK_DP2.needs if n.feature == PG)
    assert _optional_line(out) == [f"OPTIONAL: {PG} not chosen ({PG_SWITCH}=0): {need.choice}"], out[-3000:]
    assert "FAILED: 15 feature(s) as needed, 1 not, 1 optional not chosen" in out


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
    proc = warm.run(
        [sys.executable, "-m", "dspark_harden", "check", "--profile", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "invalid choice: 'nope' (choose from 'dsv4-dspark-dp2')" in proc.stderr
    proc = warm.run(
        [sys.executable, "-m", "dspark_harden", "check", "--role", "main", "--profile", "dsv4-dspark-dp2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "is judged in the scheduler role, which --role leaves out" in proc.stderr
    proc = warm.run(
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
    # the operator's choice is not exported by the recipe: it says how to choose it (switch and flag together)
    assert PG_SWITCH not in exported
    assert f"export {PG_SWITCH}=1" in text and " ".join(PREFILL) in text
    assert 'dspark-harden check --profile dsv4-dspark-dp2 -- "${ARGS[@]}"' in text
    # the launch arguments this module checks are the recipe's
    recipe = text[text.index("ARGS=(") : text.index(")", text.index("ARGS=("))]
    assert recipe.split()[1:] == LAUNCH, recipe


def test_deploy_page_metrics_exist():
    """Every metric family the deploy page tells an operator to query is declared (no typo'd proof)."""
    import re

    from dspark_harden.core import metrics

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "docs", "deploy-dsv4-dspark-dp2.md"), encoding="utf-8").read()
    named = set(re.findall(r"\b(dspark_harden_[a-z0-9_]+)", text))
    declared = set(metrics.registry())
    assert len(named) >= 20 and sorted(named - declared) == []
