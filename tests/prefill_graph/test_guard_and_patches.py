"""The forward-time guard, and the feature's patches bound on the real sglang 0.5.23 classes.

The guard is exercised on a ``PrefillCudaGraphRunner`` of the real class (state from stock's
default capture configuration, see ``dspark_harden.prefill_graph.runner.build_runner``) with a
``PredictedForwardBatch`` standing in for the GPU ``ForwardBatch``. Prefill CUDA graphs cannot
capture or replay on CPU: these tests prove the decision, not a replay. Tests that bind the
patches onto SGLang's classes run forked.
"""

from __future__ import annotations

import types

import pytest
import torch

from dspark_harden.prefill_graph import admission as A
from dspark_harden.prefill_graph import decision as D
from dspark_harden.prefill_graph import runner as R


@pytest.fixture()
def runner():
    return R.build_runner(R.capture_config(max_seq_len=8192))


def _fb(bucket=1024, **over):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    fields = dict(
        forward_mode=ForwardMode.EXTEND,
        batch_size=2,
        extend_seq_lens_cpu=[600, 300],
        extend_prefix_lens_cpu=[0, 100],
        seq_lens_cpu=torch.tensor([600, 400]),
        capture_hidden_mode=CaptureHiddenMode.NULL,
        extend_logprob_start_lens_cpu=[599, 299],
        input_ids=range(bucket),
        global_num_tokens_cpu=[bucket, bucket],
        can_run_dp_prefill_cuda_graph=True,
    )
    fields.update(over)
    return D.PredictedForwardBatch(**fields)


def _stock_can_run():
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    return R.stock(PrefillCudaGraphRunner.__dict__["can_run_graph"])


def _forced(name):
    """One rank-local check forced to fail while the DP group agreed on "graph"."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    return {
        "capture_hidden_mode": dict(capture_hidden_mode=CaptureHiddenMode.FULL),
        "token_indices_to_pool": dict(token_indices_to_pool=[torch.tensor([5])]),
        "input_embeds": dict(input_embeds=object()),
        "max_context": dict(seq_lens_cpu=torch.tensor([9000, 10]), extend_prefix_lens_cpu=[0, 0]),
        "request_slots": dict(
            batch_size=40,
            extend_seq_lens_cpu=[1] * 40,
            extend_prefix_lens_cpu=[0] * 40,
            seq_lens_cpu=torch.ones(40, dtype=torch.int64),
            extend_logprob_start_lens_cpu=[0] * 40,
        ),
        "inactive_dp_rank": dict(global_num_tokens_cpu=[1024, 0]),
        "num_tokens": dict(input_ids=range(20000), global_num_tokens_cpu=[20000, 20000]),
        "prefix": dict(extend_prefix_lens_cpu=[9000, 0], seq_lens_cpu=torch.tensor([600, 300])),
    }[name]


CHECKS = [
    "capture_hidden_mode",
    "token_indices_to_pool",
    "input_embeds",
    "max_context",
    "request_slots",
    "inactive_dp_rank",
    "num_tokens",
    "prefix",
]
#: checks whose inputs are gathered / the same on every rank: eager everywhere, never a divergence
UNIFORM = ["inactive_dp_rank", "num_tokens"]


def test_guard_passes_a_batch_every_check_admits(runner):
    guard = A.build_guard(_stock_can_run(), A.Runtime(dp_rank=0))
    assert guard(runner, _fb()) is True


@pytest.mark.parametrize("check", UNIFORM)
def test_guard_runs_a_uniform_failure_eager_on_every_rank(runner, check):
    seen = []
    rt = A.Runtime(dp_rank=1, on_divergence=seen.append, on_uniform=lambda c, p: seen.append(c))
    guard = A.build_guard(_stock_can_run(), rt)
    assert guard(runner, _fb(**_forced(check))) is False  # as stock: eager, and so is every peer
    assert rt.last_guard == "eager_uniform" and seen == [check]


@pytest.mark.parametrize("check", [c for c in CHECKS if c not in UNIFORM])
def test_guard_raises_naming_the_check_under_a_shared_graph_verdict(runner, check):
    seen = []
    rt = A.Runtime(dp_rank=1, on_divergence=seen.append)
    guard = A.build_guard(_stock_can_run(), rt)
    fb = _fb(**_forced(check))
    # stock would silently run this rank eager while its peer replays the graph
    stock_local = _stock_can_run()(runner, fb) and fb.token_indices_to_pool is None
    assert stock_local is False
    with pytest.raises(D.PrefillGraphDivergence) as info:
        guard(runner, fb)
    exc = info.value
    assert exc.check == check and check in exc.failed and exc.dp_rank == 1
    msg = str(exc)
    assert "dp_rank 1" in msg and repr(check) in msg and "batch_size=" in msg and "global_num_tokens=" in msg
    assert seen == [exc]


@pytest.mark.parametrize("check", CHECKS)
def test_shared_eager_runs_eager_on_both_ranks(runner, check):
    guard = A.build_guard(_stock_can_run(), A.Runtime())
    rank0 = _fb(can_run_dp_prefill_cuda_graph=False)  # every local check passes
    rank1 = _fb(can_run_dp_prefill_cuda_graph=False, **_forced(check))  # a local check fails
    assert guard(runner, rank0) is False and guard(runner, rank1) is False


def test_tbo_graph_guard_requires_the_batch_tbo_split(runner):
    """DSPARK_HARDEN_PREFILL_GRAPH_TBO=1: graphs were captured with TBO children, so an admitted batch
    without a TBO split (tbo_split_seq_index None) raises instead of replaying; with a split it replays."""
    rt = A.Runtime(dp_rank=0, tbo_graphs=True)
    guard = A.build_guard(_stock_can_run(), rt)
    with pytest.raises(D.PrefillGraphDivergence) as info:
        guard(runner, _fb())
    assert info.value.check == "tbo_split"
    fb = _fb()
    fb.tbo_split_seq_index = 1
    assert guard(runner, fb) is True
    assert A.build_guard(_stock_can_run(), A.Runtime(dp_rank=0))(runner, _fb()) is True  # switch off


def test_guard_leaves_non_dp_batches_to_stock(runner):
    guard = A.build_guard(_stock_can_run(), A.Runtime())
    fb = _fb(global_num_tokens_cpu=None, **_forced("capture_hidden_mode"))
    assert guard(runner, fb) is False  # stock's rank-local answer: no DP group to split


def test_guard_skips_draft_runners(runner):
    guard = A.build_guard(_stock_can_run(), A.Runtime())
    runner.model_runner = types.SimpleNamespace(is_draft_worker=True, lora_manager=None)
    assert guard(runner, _fb(**_forced("capture_hidden_mode"))) is False


def test_finalize_is_a_function_of_gathered_values_only(runner):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    bs = list(R.capture_config().buckets)
    kw = dict(runner=runner, bs=bs, factor=4.0, server_mode=CaptureHiddenMode.NULL)
    a = D.finalize([900, 0], vote=True, **kw)
    b = D.finalize([900, 0], vote=True, **kw)
    assert a == b and a.graph and a.bucket == 960  # 576..1024 step 64
    assert D.finalize([900, 0], vote=False, **kw).reason == "peer_vote"
    assert D.finalize([0, 0], vote=True, **kw).reason == "no_tokens"
    assert D.finalize([20000, 5], vote=True, **kw).reason == "too_many_tokens"
    short = R.build_runner(R.capture_config(max_seq_len=930))  # the dummy extend has seq_len 960
    assert D.finalize([900, 0], vote=True, **{**kw, "runner": short}).reason == "idle_participant"
    assert D.finalize([900, 5], vote=True, **{**kw, "runner": short}).graph  # both busy: no dummy extend


# --- bound on the real classes (forked: they patch SGLang) ---------------------------------------


@pytest.mark.forked
def test_patches_bind_wrap_and_revert_on_real_sglang():
    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    from dspark_harden.prefill_graph import feature

    stock = (
        dp_attn._local_prefill_cuda_graph_vote,
        dp_attn._update_gather_batch,
        PrefillCudaGraphRunner.__dict__["can_run_graph"],
    )
    patches = feature.patches()
    for p in patches:
        p.apply()
        p.apply()  # idempotent
        assert p.live_check() is None, p.target
        assert p.found_fingerprint == p.fingerprint
    assert dp_attn._local_prefill_cuda_graph_vote.__wrapped__ is stock[0]
    assert dp_attn._update_gather_batch.__wrapped__ is stock[1]
    assert PrefillCudaGraphRunner.can_run_graph.__wrapped__ is stock[2]
    # the live class method now raises where stock ran eager alone
    runner = R.build_runner(R.capture_config())
    fb = _fb(**_forced("capture_hidden_mode"))
    with pytest.raises(D.PrefillGraphDivergence):
        runner.can_run_graph(fb)
    for p in reversed(patches):
        p.revert()
    assert (
        dp_attn._local_prefill_cuda_graph_vote,
        dp_attn._update_gather_batch,
        PrefillCudaGraphRunner.__dict__["can_run_graph"],
    ) == stock
    assert runner.can_run_graph(fb) is False  # stock again: eager alone, silently
    for p in patches:  # and again
        p.apply()
    assert PrefillCudaGraphRunner.can_run_graph.__wrapped__ is stock[2]


@pytest.mark.forked
def test_bound_vote_folds_forward_time_checks_into_the_stock_column():
    """Through the live module function (as prepare_mlp_sync_batch_raw calls it), on a real
    ScheduleBatch (prefill_graph.world: real Req / pools / radix cache, stock prepare_for_extend)."""
    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from dspark_harden.prefill_graph import feature
    from dspark_harden.prefill_graph import trace as T
    from dspark_harden.prefill_graph import world as W

    cfg = R.capture_config()
    model_config = W.publish_runtime(cfg, backend="full", spec="none")
    for p in feature.patches():
        p.apply()
    A.RUNTIME.server_mode = CaptureHiddenMode.NULL
    runner = R.build_runner(cfg)
    eng = W.RankEngine(0, model_config)
    batch = W.build_batch(eng, T.RankStep("extend", (T.TraceReq(extend=500, hidden=True),)), SpeculativeAlgorithm.NONE)
    kw = dict(
        local_batch=batch,
        num_tokens=500,
        prefill_graph_runner=runner,
        coordinated_prefill=True,
        breakable_prefill=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        model_config=model_config,
    )
    assert dp_attn._local_prefill_cuda_graph_vote.__wrapped__(**kw) is True  # stock: "graph"
    assert dp_attn._local_prefill_cuda_graph_vote(**kw) is False  # ours: the forward-time check, now
    assert A.RUNTIME.step.local_reason == "capture_hidden_mode"
    # the vote still travels as the stock 0/1 column of MLPSyncBatchInfo
    info = dp_attn.MLPSyncBatchInfo(
        num_dp_ranks=2,
        tp_size=1,
        cp_size=1,
        num_tokens=500,
        num_tokens_for_logprob=1,
        can_run_decode_cuda_graph=False,
        can_run_draft_cuda_graph=True,
        can_run_prefill_cuda_graph=dp_attn._local_prefill_cuda_graph_vote(**kw),
        is_extend_in_batch=True,
        local_can_run_tbo=False,
        local_forward_mode=1,
    )
    assert info._get_local_tensor(device="cpu").tolist()[6] == 0
    # a speculative algorithm whose worker override is not modelled: the vote refuses to guess
    with pytest.raises(D.UnmodelledWorker, match="EAGLE"):
        dp_attn._local_prefill_cuda_graph_vote(**{**kw, "spec_algorithm": SpeculativeAlgorithm.EAGLE})


@pytest.mark.forked
def test_the_vote_asks_stock_before_building_the_schedule_view(monkeypatch):
    """Issue 39: stock votes eager for most decode steps (here: the full backend, no decode->extend
    conversion); the O(batch) schedule-time view is built only where stock votes graph."""
    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from dspark_harden.prefill_graph import trace as T
    from dspark_harden.prefill_graph import world as W

    cfg = R.capture_config()
    model_config = W.publish_runtime(cfg, backend="full", spec="none")
    rt = A.Runtime(server_mode=CaptureHiddenMode.NULL, bs=list(cfg.buckets), attn_tp_size=1)
    vote = A.build_vote(R.stock(dp_attn._local_prefill_cuda_graph_vote), rt)
    built = []
    real = D.schedule_view
    monkeypatch.setattr(D, "schedule_view", lambda *a, **k: built.append(1) or real(*a, **k))
    eng = W.RankEngine(0, model_config)
    none = SpeculativeAlgorithm.NONE
    kw = dict(
        prefill_graph_runner=R.build_runner(cfg),
        coordinated_prefill=True,
        breakable_prefill=False,
        spec_algorithm=none,
        model_config=model_config,
    )
    decode = W.build_batch(eng, T.RankStep("decode", seq=tuple(range(10, 138))), none)
    assert vote(local_batch=decode, num_tokens=128, **kw) is False
    assert built == [] and rt.step.local_reason == "forward_mode"
    extend = W.build_batch(eng, T.RankStep("extend", (T.TraceReq(extend=500),)), none)
    assert vote(local_batch=extend, num_tokens=500, **kw) is True and built == [1]


# --- metrics, uniform failures and the exchange column --------------------------------------------


@pytest.mark.forked
def test_recorder_and_uniform_failures_on_real_forward_batches():
    """Metrics of the decision, and item 4: a forward-time check failing identically on every rank
    (gathered inputs) runs the step eager on every rank (outcome eager_uniform), while a failure of
    one rank alone raises PrefillGraphDivergence. Real ForwardBatches from prefill_graph.world."""
    import prometheus_client
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    from dspark_harden.core import metrics as M
    from dspark_harden.prefill_graph import metrics as PM
    from dspark_harden.prefill_graph import trace as T
    from dspark_harden.prefill_graph import world as W

    M.reset_for_tests()
    M.use(M.registry(load_extensions=False))
    assert M.precreate_process("scheduler", ["prefill-graph-dp"], "1")
    world = W.World(R.capture_config())
    PM.attach(world.runtimes[1], dp_label="1")  # this process is dp_rank 1
    idle = T.RankStep("idle")
    steps = [
        T.Step((T.RankStep("extend", (T.TraceReq(extend=900),)), T.RankStep("extend", (T.TraceReq(extend=100),)))),
        T.Step(
            (
                T.RankStep("extend", (T.TraceReq(extend=500),)),
                T.RankStep("extend", (T.TraceReq(extend=50, hidden=True),)),
            )
        ),
        T.Step((T.RankStep("extend", (T.TraceReq(extend=50),)), idle)),
    ]
    for s in steps:
        res = world.step(s, "harden")
        assert [r.raised for r in res] == [None, None]

    def value(name, **labels):
        return prometheus_client.REGISTRY.get_sample_value(name, {"dp_rank": "1", **labels})

    assert value("dspark_harden_prefill_graph_decisions_total", outcome="graph", reason="admitted") == 2
    assert value("dspark_harden_prefill_graph_decisions_total", outcome="eager", reason="capture_hidden_mode") == 1
    assert value("dspark_harden_prefill_graph_decisions_total", outcome="eager", reason="padding") == 0  # pre-created
    assert value("dspark_harden_prefill_graph_decisions_total", outcome="eager_uniform", reason="inactive_dp_rank") == 0
    assert value("dspark_harden_prefill_graph_splits_prevented_total", check="capture_hidden_mode") == 1
    assert value("dspark_harden_prefill_graph_tokens_total", kind="useful") == 100 + 0  # idle participant: 0 useful
    assert value("dspark_harden_prefill_graph_tokens_total", kind="executed") == 960 + 64
    assert value("dspark_harden_prefill_graph_bucket_tokens_count") == 2
    assert value("dspark_harden_prefill_graph_divergence_total", check="backend_hook") == 0
    # request slots per replay: rank 1 replayed two admitted steps, one request each (the idle participant's
    # dummy extend is one request too); none above 1
    slots = "dspark_harden_prefill_graph_request_slots"
    assert value(slots + "_count") == 2 and value(slots + "_sum") == 2
    assert value(slots + "_bucket", le="0.0") == 0 and value(slots + "_bucket", le="1.0") == 2
    three = T.Step(
        (T.RankStep("extend", (T.TraceReq(extend=300),)), T.RankStep("extend", (T.TraceReq(extend=40),) * 3))
    )
    assert [r.replays for r in world.step(three, "harden")] == [True, True]
    assert value(slots + "_count") == 3 and value(slots + "_sum") == 5
    assert value(slots + "_bucket", le="2.0") == 2 and value(slots + "_bucket", le="4.0") == 3

    # an admitted step; then the guard is asked again about each rank's real, padded ForwardBatch
    res = world.step(steps[0], "harden")
    fbs = [r.fb for r in res]
    assert [r.replays for r in res] == [True, True] and fbs[0].global_num_tokens_cpu == [960, 960]
    guards = [world.runners["harden", r] for r in (0, 1)]
    # (a) uniform: the gathered table (identical on every rank) shows an inactive rank
    for r in (0, 1):
        fbs[r].global_num_tokens_cpu = [960, 0]
        world.runtimes[r].pending = ("admitted-step", None, 0)
        assert guards[r].can_run_graph(fbs[r]) is False  # eager, no raise, on every rank
        assert world.runtimes[r].last_guard == "eager_uniform" and world.runtimes[r].pending is None
    assert value("dspark_harden_prefill_graph_decisions_total", outcome="eager_uniform", reason="inactive_dp_rank") == 1
    # stock, on the same batches: eager on every rank too
    assert [W.stock_replays(world.adapters["stock", r].model_runner, fbs[r]) for r in (0, 1)] == [False, False]
    # (b) one rank alone: its capture mode exceeds the captured one -> divergence on that rank only
    for r in (0, 1):
        fbs[r].global_num_tokens_cpu = [960, 960]
    fbs[1].capture_hidden_mode = CaptureHiddenMode.FULL
    assert guards[0].can_run_graph(fbs[0]) is True
    with pytest.raises(D.PrefillGraphDivergence) as info:
        guards[1].can_run_graph(fbs[1])
    assert info.value.check == "capture_hidden_mode" and world.runtimes[1].last_guard == "divergence"
    assert value("dspark_harden_prefill_graph_divergence_total", check="capture_hidden_mode") == 1
    # (c) a rank-local failure next to a uniform one: every rank fails the uniform check -> eager, no raise
    fbs[1].global_num_tokens_cpu = [960, 0]
    assert guards[1].can_run_graph(fbs[1]) is False and world.runtimes[1].last_guard == "eager_uniform"
    world.close()


def test_uniform_failures_are_only_the_gathered_or_uniform_checks(runner):
    fb = _fb(global_num_tokens_cpu=[1024, 1024])
    assert D.uniform_failures(runner, fb, ["inactive_dp_rank", "capture_hidden_mode"]) == ["inactive_dp_rank"]
    assert D.uniform_failures(runner, fb, ["num_tokens"]) == ["num_tokens"]  # every rank presents 1024 tokens
    assert D.uniform_failures(runner, _fb(global_num_tokens_cpu=[1024, 900]), ["num_tokens"]) == []  # SUM_LEN: local
    for local in (
        "capture_hidden_mode",
        "token_indices_to_pool",
        "max_context",
        "backend_hook",
        "prefix",
        "request_slots",
        "input_embeds",
        "can_run_graph",
    ):
        assert D.uniform_failures(runner, fb, [local]) == []


def test_the_vote_travels_in_the_stock_column_of_both_exchange_paths():
    """The stock all_gather and the native DP2 exchange (dp2/mlp_sync.py) both read the row schema
    from the live class: the vote stays the existing 0/1 ``can_run_prefill_cuda_graph`` column,
    min-reduced by both, and the feature adds no field."""
    import dataclasses

    from sglang.srt.managers.scheduler_components import dp_attn

    from dspark_harden.dp2.mlp_sync import live_schema

    schema = live_schema(dp_attn.MLPSyncBatchInfo)
    col = schema.columns.index("can_run_prefill_cuda_graph")
    assert schema.width == 11 and col == 6 and schema.fallback[col] == 0  # an inactive rank votes eager
    names = {f.name for f in dataclasses.fields(dp_attn.MLPSyncBatchInfo)}
    assert not any("dspark" in n or "harden" in n for n in names)


def test_bucket_choice_is_stocks_own_expression():
    import random as _r

    code = D._stock_padding_code()
    assert code["bucket"].co_filename == "<stock prepare_mlp_sync_batch>"
    bs = list(R.capture_config().buckets)
    rng = _r.Random(1)
    for _ in range(2000):
        n = rng.randint(1, 16384)
        assert D.stock_bucket(bs, n) == min(b for b in bs if b >= n)
    assert D.stock_bucket(bs, 16385) is None
    assert D.stock_forces_max_len(verdict=True, is_extend_in_batch=True, bs=bs, global_num_tokens=[900, 0])
    assert not D.stock_forces_max_len(verdict=False, is_extend_in_batch=True, bs=bs, global_num_tokens=[900, 0])
    assert not D.stock_forces_max_len(
        verdict=True, is_extend_in_batch=True, bs=bs, global_num_tokens=[900, 0], tolerates_sum_len=True
    )
    assert not D.stock_forces_max_len(verdict=True, is_extend_in_batch=True, bs=bs, global_num_tokens=[20000, 0])
