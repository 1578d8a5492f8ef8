"""Settings, the TBO upstream probes and refusal, the bench CLI and the self-check report."""

from __future__ import annotations

import json
import sys
import types

import pytest

from dspark_harden.core.settings import SettingsError, load_settings
from dspark_harden.prefill_graph import settings as S
from dspark_harden.prefill_graph import tbo
from dspark_harden.prefill_graph import trace as T
from tests.harness import warm

# --- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", S.padding_factor.bad_examples)
def test_bad_padding_factor_rejected_by_name(raw):
    with pytest.raises(SettingsError) as info:
        load_settings(S.SETTINGS, {S.PADDING: raw})
    assert S.PADDING in str(info.value) and "1 < f <= 8" in str(info.value)


@pytest.mark.parametrize("raw,value", [("1.01", 1.01), ("2", 2.0), ("4", 4.0), (" 8 ", 8.0), ("8.0", 8.0)])
def test_good_padding_factors(raw, value):
    assert load_settings(S.SETTINGS, {S.PADDING: raw})[S.PADDING] == value


def test_defaults_on_and_four():
    s = load_settings(S.SETTINGS, {})
    assert s[S.SWITCH] is True and s[S.PADDING] == 4.0


# --- TBO ---------------------------------------------------------------------------------------


def test_tbo_upstream_probes_hold_on_stock_0_5_23():
    ok, detail = tbo.probe_idle_votes_tbo()
    assert ok, detail
    ok, detail = tbo.probe_decode_tbo_capture()
    assert ok, detail
    unsupported, detail = tbo.probe_prefill_tbo_unsupported()
    assert unsupported, detail


@pytest.mark.forked  # patches SGLang's TboDPAttentionPreparer
def test_idle_vote_probe_detects_a_veto(monkeypatch):
    from sglang.srt.batch_overlap import two_batch_overlap as two

    def vetoing(self, local_batch):  # the seed's Bugbot finding: an idle peer votes "cannot run TBO"
        return local_batch is not None and not local_batch.forward_mode.is_idle(), 0

    monkeypatch.setattr(two.TboDPAttentionPreparer, "prepare_all_gather", vetoing)
    ok, detail = tbo.probe_idle_votes_tbo()
    assert not ok and "vetoes TBO" in detail and "absent/none" in detail and "idle/none" in detail


@pytest.mark.forked  # patches inspect.getsource process-wide
def test_decode_capture_probe_detects_a_model_condition(monkeypatch):
    src = (
        "def capture_one_batch_size(self, batch, num_tokens):\n    if not is_tbo_enabled():\n        return\n"
        "    if self.model_type != 'deepseek_v4':\n        return\n"
    )
    monkeypatch.setattr(tbo.inspect, "getsource", lambda obj: src)
    ok, detail = tbo.probe_decode_tbo_capture()
    assert not ok and "model_type" in detail


def _scheduler(*, backend="full", tbo=False, dp=True, dp_rank=0):
    """This process as a DP scheduler with these server args (``roles.CONTEXT``; forked tests only)."""
    from dspark_harden.core import roles
    from dspark_harden.core.patch import Role

    sa = _args(backend, tbo_on=tbo)
    sa.enable_dp_attention = dp
    roles.CONTEXT = roles.ProcessContext(role=Role.SCHEDULER, server_args=sa, tp_rank=0, dp_rank=dp_rank)


def _args(backend, tbo_on=True):
    prefill = types.SimpleNamespace(backend=backend)
    return types.SimpleNamespace(
        enable_two_batch_overlap=tbo_on,
        cuda_graph_config=types.SimpleNamespace(prefill=prefill),
        tp_size=2,  # --tp 2 --dp 2: the geometry the feature applies to (issue 39)
        dp_size=2,
    )


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_tbo_with_prefill_graph_is_refused_with_the_reason(backend):
    msg = tbo.refusal(_args(backend))
    assert msg and "compute_split_seq_index asserts" in msg and "DSPARK_HARDEN_PREFILL_GRAPH_TBO=1" in msg


def test_tbo_opt_in_serves_full_and_still_refuses_breakable():
    assert tbo.refusal(_args("full"), allow_full=True) is None
    msg = tbo.refusal(_args("breakable"), allow_full=True)
    assert msg and "full prefill backend only" in msg


@pytest.mark.parametrize("args", [_args("disabled"), _args("full", tbo_on=False)])
def test_no_refusal_without_the_combination(args):
    assert tbo.refusal(args) is None


@pytest.mark.forked
@pytest.mark.parametrize("explicit", [False, True])
def test_tbo_with_full_prefill_graph_is_unavailable_by_default_and_refused_when_explicit(explicit):
    """Issue 39: by default a TBO server keeps stock behaviour (``unavailable``, nothing raised);
    ``DSPARK_HARDEN_PREFILL_GRAPH=1`` refuses at bind time naming the combination."""
    from dspark_harden.core import binder
    from dspark_harden.core.patch import Role
    from dspark_harden.prefill_graph import feature

    _scheduler(backend="full", tbo=True, dp=True, dp_rank=0)
    report = binder.bind(Role.SCHEDULER, environ={"DSPARK_HARDEN_PREFILL_GRAPH": "1"} if explicit else {})
    st = next(f for f in report.features if f.name == feature.FEATURE)
    assert st.status == ("failed" if explicit else "unavailable"), st
    assert "two-batch overlap" in st.detail and not st.targets
    feature.dspark_process_bound(role=Role.SCHEDULER, settings=binder.STATE.settings, report=report)  # no raise


TBO_TARGETS = ("TBO_CAPTURE_TARGET", "TBO_OUT_GRAPH_TARGET", "LOAD_BATCH_TARGET")


@pytest.mark.forked
def test_tbo_opt_in_binds_the_tbo_hooks_on_the_real_classes_and_starts():
    """DSPARK_HARDEN_PREFILL_GRAPH_TBO=1 with the full backend: the three TBO hooks bind on the real
    stock classes (fingerprints checked by the binder), startup passes, the runtime gate is on, and the
    decode path of the capture hook is stock's (Bugbot #2: it must not return early for decode)."""
    from dspark_harden.core import binder
    from dspark_harden.core.patch import Role
    from dspark_harden.prefill_graph import admission, feature, tbo_graph

    _scheduler(backend="full", tbo=True, dp=True, dp_rank=0)
    report = binder.bind(Role.SCHEDULER, environ={"DSPARK_HARDEN_PREFILL_GRAPH_TBO": "1"})
    st = next(f for f in report.features if f.name == feature.FEATURE)
    assert st.status == "bound", st
    feature.dspark_process_bound(role=Role.SCHEDULER, settings=binder.STATE.settings, report=report)
    assert tbo_graph.ACTIVE and admission.RUNTIME.tbo_graphs
    assert "fixed flat split" in st.detail
    from sglang.srt.batch_overlap.two_batch_overlap import TboCudaGraphRunnerPlugin
    from sglang.srt.layers.attention.tbo_backend import TboAttnBackend
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    for fn in (
        TboCudaGraphRunnerPlugin.capture_one_batch_size,
        TboAttnBackend.init_forward_metadata_out_graph,
        PrefillCudaGraphRunner.load_batch,
    ):
        assert getattr(fn, "__wrapped__", None) is not None, fn
    # decode capture goes to stock unchanged (which, with TBO off in this process, returns at once)
    calls = []
    wrapped = tbo_graph.build_capture_one_batch_size(lambda *a: calls.append(a), active=lambda: True)
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    batch = types.SimpleNamespace(forward_mode=ForwardMode.DECODE)
    wrapped("plugin", batch, 8)
    assert calls == [("plugin", batch, 8)]


@pytest.mark.forked
def test_tbo_hooks_are_not_bound_by_default():
    from sglang.srt.layers.attention.tbo_backend import TboAttnBackend

    from dspark_harden.core import binder
    from dspark_harden.core.patch import Role

    _scheduler(backend="full", tbo=False, dp=True, dp_rank=0)
    binder.bind(Role.SCHEDULER, environ={})
    assert getattr(TboAttnBackend.init_forward_metadata_out_graph, "__wrapped__", None) is None


@pytest.mark.forked
@pytest.mark.parametrize(
    "backend,dp,expect",
    [
        ("disabled", True, "prefill CUDA graphs are not enabled"),
        ("full", False, "DP attention is off"),
    ],
)
def test_feature_unavailable_where_preconditions_are_absent(backend, dp, expect):
    from dspark_harden.core import binder
    from dspark_harden.core.patch import Role
    from dspark_harden.prefill_graph import feature

    _scheduler(backend=backend, tbo=False, dp=dp, dp_rank=0)
    report = binder.bind(Role.SCHEDULER, environ={})
    st = next(f for f in report.features if f.name == feature.FEATURE)
    assert st.status == "unavailable" and expect in st.detail, st
    explicit = binder.bind(Role.SCHEDULER, environ={S.SWITCH: "1"})  # explicitly on: fail closed
    st = next(f for f in explicit.features if f.name == feature.FEATURE)
    assert st.status == "failed" and expect in st.detail


# --- bench -------------------------------------------------------------------------------------


def _cli(*args, timeout=600):
    proc = warm.run([sys.executable, "-m", "dspark_harden", "bench", "prefill-admission", *args], timeout=timeout)
    return proc


BENCH_STEPS = 300


def _known_reasons():
    from dspark_harden.prefill_graph import bench as B
    from dspark_harden.prefill_graph import decision as D

    return set(D.REASONS) | {B.EAGER_VOTE, "eager_uniform", "forward_raw", "no_extend_forward"}


@pytest.fixture(scope="module")
def bench_json():
    proc = _cli("--json", "--steps", str(BENCH_STEPS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_json_shape_and_judgement(bench_json):
    """On real ForwardBatches (see bench.py): harden never splits, stock splits on its own path,
    and every prefill token is either covered or attributed to exactly one eager reason."""
    assert set(bench_json) == {"batches", "stock", "harden"}
    assert bench_json["batches"] == BENCH_STEPS
    steps = T.generate(T.TraceShape(steps=BENCH_STEPS))
    total = sum(r.extend_tokens for s in steps for r in s.ranks)
    for side in ("stock", "harden"):
        r = bench_json[side]
        assert set(r) == {"graph_token_coverage", "splits", "padding_overhead", "eager_tokens_by_reason"}
        assert isinstance(r["splits"], int) and 0.0 <= r["graph_token_coverage"] <= 1.0
        assert set(r["eager_tokens_by_reason"]) <= _known_reasons(), r["eager_tokens_by_reason"]
        eager = sum(r["eager_tokens_by_reason"].values())
        assert abs((1 - r["graph_token_coverage"]) * total - eager) <= total * 1e-6 + 1, (eager, total, r)
        assert not any(k.startswith("divergence:") for k in r["eager_tokens_by_reason"])
    assert bench_json["harden"]["splits"] == 0
    assert bench_json["stock"]["splits"] > 0
    assert "forward_raw" not in bench_json["harden"]["eager_tokens_by_reason"]  # would be a harden split
    assert bench_json["harden"]["graph_token_coverage"] > bench_json["stock"]["graph_token_coverage"]
    assert bench_json["stock"]["eager_tokens_by_reason"]["dp_verdict"] > 0


def test_bench_trace_file_replays_the_same_steps(tmp_path, bench_json):
    path = tmp_path / "trace.jsonl"
    T.write_jsonl(T.generate(T.TraceShape(steps=BENCH_STEPS)), str(path))
    proc = _cli("--json", "--trace", str(path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == bench_json  # a count: deterministic


def test_bench_breakable_backend_converts_decoding_peers(tmp_path):
    path = tmp_path / "decode.jsonl"
    T.write_jsonl(
        [
            T.Step((T.RankStep("decode", seq=(900, 17, 3000)), T.RankStep("extend", (T.TraceReq(extend=600),)))),
            T.Step((T.RankStep("extend", (T.TraceReq(extend=600),)), T.RankStep("decode", seq=(40, 41)))),
            # one decode row: stock's vote bounds its local padding (bucket 4 > 2 x 1) inside the
            # conversion branch, where the local count is the batch size: both ranks eager (no split)
            T.Step((T.RankStep("extend", (T.TraceReq(extend=600),)), T.RankStep("decode", seq=(40,)))),
        ],
        str(path),
    )
    full = json.loads(_cli("--json", "--trace", str(path)).stdout.strip().splitlines()[-1])
    brk = json.loads(_cli("--json", "--trace", str(path), "--backend", "breakable").stdout.strip().splitlines()[-1])
    # full backend: a decoding peer's stock vote is eager (no converted decode tails in full's request slots)
    assert full["harden"]["graph_token_coverage"] == 0.0 and full["harden"]["eager_tokens_by_reason"] == {
        "forward_mode": 1800
    }
    assert brk["harden"]["eager_tokens_by_reason"] == {"forward_mode": 600} and brk["harden"]["splits"] == 0
    assert brk["harden"]["graph_token_coverage"] == round(1200 / 1800, 6)


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_bench_replays_real_traffic_shapes_the_generator_never_makes(tmp_path, backend):
    """Issue 39: all-decode steps (stock's SUM_LEN custom all-reduce check reads the TP group's
    ``ca_comm``), all-idle steps, one rank idle, logprob-heavy prefills and cached prefixes up to a 131k
    context (the world's pools are sized from the trace). Every prefill token is covered or attributed."""
    L = T.TraceReq
    steps = [
        T.Step((T.RankStep("decode", seq=(100, 200)), T.RankStep("decode", seq=(300,)))),
        T.Step((T.RankStep("idle"), T.RankStep("idle"))),
        T.Step((T.RankStep("extend", (L(extend=500, prefix=60000),)), T.RankStep("idle"))),
        T.Step(
            (
                T.RankStep("extend", (L(extend=300, logprob=True), L(extend=200, prefix=100, logprob=True))),
                T.RankStep("decode", seq=(131000,)),
            )
        ),
        T.Step((T.RankStep("extend", (L(extend=1000, prefix=130000),)), T.RankStep("extend", (L(extend=64),)))),
        T.Step((T.RankStep("decode", seq=(50,)), T.RankStep("decode", seq=tuple(range(7, 300))))),
    ]
    path = tmp_path / "traffic.jsonl"
    T.write_jsonl(steps, str(path))
    proc = _cli("--json", "--trace", str(path), "--backend", backend)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["batches"] == 3  # the steps with a prefill
    total = 500 + 300 + 200 + 1000 + 64
    for side in ("stock", "harden"):
        r = out[side]
        eager = sum(r["eager_tokens_by_reason"].values())
        assert abs((1 - r["graph_token_coverage"]) * total - eager) <= 1, (side, r)


def test_bench_rejects_a_bad_trace_naming_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"ranks": [{"mode": "idle"}, {"mode": "extend", "reqs": [{"extend": 5}]}]}\n'
        '{"ranks": [{"mode": "extend", "reqs": [{"extend": 0}]}, {"mode": "idle"}]}\n'
    )
    proc = _cli("--trace", str(path))
    assert proc.returncode == 2 and f"{path}:2" in proc.stderr and "extend must be an integer >= 1" in proc.stderr


def test_bench_buckets_and_factor_options():
    proc = _cli("--buckets", "64,4096", "--factor", "9")
    assert proc.returncode == 2 and "1 < f <= 8" in proc.stderr
    proc = _cli("--backend", "tc_piecewise")
    assert proc.returncode == 2 and "--backend" in proc.stderr
    proc = _cli("--steps", "0")
    assert proc.returncode == 2 and "positive integer" in proc.stderr
    proc = _cli("--buckets", "64,4096", "--trace", "/nonexistent/trace.jsonl")
    assert proc.returncode == 2 and "nonexistent" in proc.stderr


def test_bench_and_cli_modules_do_not_import_the_feature_module():
    code = (
        "import sys; import dspark_harden.prefill_graph.bench, dspark_harden.prefill_graph.bench_cli; "
        "print('dspark_harden.prefill_graph.feature' in sys.modules)"
    )
    out = warm.run([sys.executable, "-c", code], timeout=300)  # the warm interpreter imported nothing of the plugin
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


def test_trace_round_trip():
    steps = T.generate(
        T.TraceShape(steps=50, seed=3, p_hidden=0.2, p_pool=0.2, p_embeds=0.2, p_logprob=0.5, p_mm=0.2, p_replace=0.2)
    )
    again = [T.parse_step(T.step_to_json(s)) for s in steps]
    assert again == steps


# --- self-check --------------------------------------------------------------------------------


def test_check_reports_the_feature_bound_with_its_padding_factor():
    from dspark_harden.cli.check import run_child

    rep = run_child("scheduler")
    assert rep["ok"], rep["errors"]
    st = {f["name"]: f for f in rep["features"]}
    feat = st["prefill-graph-dp"]
    assert feat["status"] == "bound" and feat["switch"] == S.SWITCH and feat["default_on"] is True
    assert "padding factor 4" in feat["detail"] and "refused at startup" in feat["detail"]
    assert {t["target"] for t in feat["targets"] if t["bound"]} == {
        "sglang.srt.managers.scheduler_components.dp_attn:_local_prefill_cuda_graph_vote",
        "sglang.srt.managers.scheduler_components.dp_attn:_update_gather_batch",
        "sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner.can_run_graph",
    }
    assert st["tbo-idle-rank-vote"]["status"] == "upstream"
    assert st["tbo-decode-graph-capture"]["status"] == "upstream"


def test_check_fails_on_a_bad_padding_factor():
    import os

    from dspark_harden.cli.check import run_child

    rep = run_child("scheduler", env={**os.environ, S.PADDING: "1"})
    assert not rep.get("ok", False) and any(S.PADDING in e and "1 < f <= 8" in e for e in rep["errors"]), rep


@pytest.mark.forked
def test_validation_binds_the_execute_wrapper_and_configures_the_schedule():
    """DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE=N binds the WRAP of PrefillCudaGraphRunner.execute on the
    real class and configures the validator from the four settings; a bad value fails naming it."""
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    from dspark_harden.core import binder
    from dspark_harden.core.patch import Role
    from dspark_harden.core.settings import SettingsError
    from dspark_harden.prefill_graph import feature, validate

    _scheduler(backend="full", tbo=False, dp=True, dp_rank=1)
    env = {
        "DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE": "50",
        "DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE_FIRST": "3",
        "DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE_TOLERANCE": "0",
        "DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE_ACTION": "count",
    }
    report = binder.bind(Role.SCHEDULER, environ=env)
    feature.dspark_process_bound(role=Role.SCHEDULER, settings=binder.STATE.settings, report=report)
    assert getattr(PrefillCudaGraphRunner.execute, "__wrapped__", None) is not None
    v = validate.VALIDATOR
    assert (v.schedule.every, v.schedule.first, v.tolerance, v.action, v.dp_rank) == (50, 3, 0.0, "count", 1)
    assert v.on_outcome is not None  # the metric recorder
    from dspark_harden.prefill_graph import settings as S

    for name, bad in (
        ("DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE_ACTION", "ignore"),
        ("DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE_TOLERANCE", "1.5"),
        ("DSPARK_HARDEN_PREFILL_GRAPH_VALIDATE", "-1"),
        ("DSPARK_HARDEN_PREFILL_GRAPH_TBO", "yes"),
    ):
        with pytest.raises(SettingsError, match=name):
            load_settings(S.SETTINGS, {name: bad})
