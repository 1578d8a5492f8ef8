"""Property and crafted-pair tests of the DP2 prefill-graph decision through the real stock functions.

Real: ``dp_attn._local_prefill_cuda_graph_vote``, ``MLPSyncBatchInfo`` row packing,
``dp_attn._update_gather_batch``, ``PrefillCudaGraphRunner.can_run_graph`` / ``can_replay_locally``
/ ``_has_inactive_dp_rank`` on an object of the real runner class whose state comes from stock's
default capture configuration (buckets for --chunked-prefill-size 16384, 32 full-backend request
slots, chunked-prefix variants), and the real DeepSeek-V4 backend hooks
(``can_run_prefill_cuda_graph`` / ``vote_prefill_cuda_graph``) bound to a stand-in backend.
Stand-ins, because they need a GPU or a running engine: each rank's ScheduleBatch (TraceBatch),
the two-row exchange (stacked in-process), and the ForwardBatch after
``ForwardBatch.prepare_mlp_sync_batch`` (``decision.after_mlp_sync``). See
``dspark_harden.prefill_graph.bench``.
"""

from __future__ import annotations

import random

import pytest

from dspark_harden.prefill_graph import bench as B
from dspark_harden.prefill_graph import decision as D
from dspark_harden.prefill_graph import trace as T

N_PAIRS = 10_000


@pytest.fixture(scope="module")
def sim():
    return B.Simulator(B.capture_config())


def _random_steps(n: int, seed: int) -> list:
    """Random DP2 pairs, with the flags that only forward time checks far more frequent than in
    production so every check is exercised many times."""
    shapes = [
        T.TraceShape(steps=n // 2, seed=seed, p_hidden=0.05, p_pool=0.05, p_embeds=0.03, p_logprob=0.3,
                     p_peer_decode=0.15, p_peer_idle=0.4, p_peer_prefill=0.45, p_small_batch_burst=0.05),
        T.TraceShape(steps=n - n // 2, seed=seed + 1, max_len=512, max_prefix=16384, p_cached=0.8,
                     p_hidden=0.02, p_pool=0.02, p_peer_idle=0.6, p_peer_prefill=0.3, p_peer_decode=0.1),
    ]
    return [s for shape in shapes for s in T.generate(shape)]


@pytest.fixture(scope="module")
def results(sim):
    steps = _random_steps(N_PAIRS, seed=2026)
    assert len(steps) >= N_PAIRS
    out = []
    for step in steps:
        stock = sim._side(step, harden=False)
        # the bucket each rank would pad to, recorded by the finalisation on both ranks
        for rt in sim.rts:
            rt.last = None
        harden = sim._side(step, harden=True)
        out.append((step, stock, harden, [rt.last for rt in sim.rts]))
    return out


def test_harden_never_splits_same_verdict_and_bucket(results):
    graph_steps = 0
    for step, _stock, harden, last in results:
        assert harden["raised"] == [], (step, harden)
        assert harden["decisions"][0] == harden["decisions"][1], (step, harden)
        if last[0] is not None or last[1] is not None:
            assert last[0] == last[1], (step, last)  # same verdict, same bucket, same reason on both ranks
        graph_steps += harden["decisions"][0]
    assert graph_steps > len(results) // 3  # the property is not vacuous: most steps replay the graph


def test_stock_splits_on_random_pairs(results):
    """Documents the bug: stock 0.5.23 lets one rank run eager alone."""
    splits = sum(stock["decisions"][0] != stock["decisions"][1] for _, stock, _, _ in results)
    assert splits > 100


def test_where_stock_agrees_on_graph_within_2x_padding_harden_agrees(results):
    compared = 0
    for step, stock, harden, last in results:
        if not (stock["decisions"][0] and stock["decisions"][1]):
            continue
        n_max = max(T.num_tokens(r) for r in step.ranks)
        bucket = D.stock_bucket(B.capture_config().buckets, n_max)
        if bucket > 2 * n_max:
            continue
        compared += 1
        assert harden["decisions"] == [True, True], (step, stock, harden)
        assert last[0].bucket == bucket == last[1].bucket
        assert harden["executed"] == stock["executed"]
    assert compared > 2000


# --- crafted pairs: one per forward-time check ---------------------------------------------------

def _req(**kw):
    return T.TraceReq(**{"extend": 900, **kw})


IDLE = T.RankStep("idle")

# check -> (step, capture-config overrides). For these stock's vote does not evaluate the check,
# so one rank runs eager alone: stock splits.
SPLITTING = {
    "capture_hidden_mode": (T.Step((T.RankStep("extend", (_req(hidden=True),)), IDLE)), {}),
    "capture_hidden_mode/both_busy": (
        T.Step((T.RankStep("extend", (_req(hidden=True),)), T.RankStep("extend", (_req(extend=700),)))), {}),
    "token_indices_to_pool": (T.Step((T.RankStep("extend", (_req(pool=True),)), IDLE)), {}),
    "token_indices_to_pool/both_busy": (
        T.Step((T.RankStep("extend", (_req(extend=300),)), T.RankStep("extend", (_req(pool=True),)))), {}),
    # the idle rank's dummy extend covers the whole bucket (seq_len 3072 > 3000): it alone fails
    "max_context": (T.Step((T.RankStep("extend", (_req(extend=2900),)), IDLE)), {"max_seq_len": 3000}),
    "backend_hook": (T.Step((IDLE, T.RankStep("extend", (_req(extend=2900),)))), {"backend_seq_limit": 3000}),
}

# For these stock's vote already evaluates the check (min-reduced): stock sends both ranks eager.
CONSISTENT = {
    "request_slots": T.Step((T.RankStep("extend", tuple(T.TraceReq(extend=2) for _ in range(40))), IDLE)),
    "input_embeds": T.Step((T.RankStep("extend", (_req(embeds=True),)), IDLE)),
    "prefix": T.Step((T.RankStep("extend", (_req(prefix=9000),)), T.RankStep("extend", (_req(),)))),
    "num_tokens": T.Step((T.RankStep("extend", (_req(extend=16384), _req(extend=1))), IDLE)),
    "forward_mode": T.Step((T.RankStep("extend", (_req(),)), T.RankStep("decode", seq=(100, 200)))),
    # whole-extend logprob tail beyond the DSV4 late-layer capacity (backend vote_prefill_cuda_graph)
    "backend_hook/late_tail": T.Step((T.RankStep("extend", tuple(_req(extend=300, logprob=True) for _ in range(30))), IDLE)),
}


def _sim_for(overrides: dict):
    over = dict(overrides)
    limit = over.pop("backend_seq_limit", None)
    cfg = B.capture_config(**({"max_seq_len": limit} if limit else over), max_running_requests=64)
    sim = B.Simulator(cfg)
    if limit:
        sim.runner.max_seq_len = None  # only the backend hook knows the limit
    return sim


def _reasons(sim, step):
    seen = {}
    for i, rt in enumerate(sim.rts):
        rt.on_decision = lambda dec, local, tokens, i=i: seen.__setitem__(i, local or dec.reason)
    side = sim._side(step, harden=True)
    return side, seen


@pytest.mark.parametrize("name", sorted(SPLITTING))
def test_crafted_pair_stock_splits_harden_agrees(name):
    step, overrides = SPLITTING[name]
    check = name.split("/")[0]
    sim = _sim_for(overrides)
    stock = sim._side(step, harden=False)
    assert stock["decisions"][0] != stock["decisions"][1], f"stock no longer splits on {name}: {stock}"
    harden, reasons = _reasons(sim, step)
    assert harden["decisions"] == [False, False] and harden["raised"] == []
    assert check in reasons.values() or (check in ("max_context", "backend_hook") and "idle_participant" in reasons.values()), reasons
    # the failing check is named at schedule time (metrics reason) on the rank it applies to
    if check in ("max_context", "backend_hook"):
        fails = D.local_failures(sim.runner, D.dummy_extend_view(3072, server_mode=sim.server_mode), num_tokens=3072,
                                 schedule_time=True)
        assert check in fails


@pytest.mark.parametrize("name", sorted(CONSISTENT))
def test_crafted_pair_checks_the_stock_vote_already_covers(name):
    step = CONSISTENT[name]
    check = name.split("/")[0]
    sim = _sim_for({})
    stock = sim._side(step, harden=False)
    assert stock["decisions"] == [False, False], f"{name}: {stock}"
    harden, reasons = _reasons(sim, step)
    assert harden["decisions"] == [False, False] and harden["raised"] == []
    assert check in reasons.values(), reasons


def test_padding_is_judged_on_the_shared_bucket():
    sim = _sim_for({})
    # 1 token per rank: bucket 4 is > 2 x 1, stock's local bound refuses; 4 <= 4 x 1 on the global max
    step = T.Step((T.RankStep("extend", (T.TraceReq(extend=1),)), T.RankStep("extend", (T.TraceReq(extend=1),))))
    assert sim._side(step, harden=False)["decisions"] == [False, False]
    assert sim._side(step, harden=True)["decisions"] == [True, True]
    # a tiny rank next to a large one replays the large one's bucket on both ranks
    step = T.Step((T.RankStep("extend", (T.TraceReq(extend=10),)), T.RankStep("extend", (T.TraceReq(extend=5000),))))
    assert sim._side(step, harden=True)["decisions"] == [True, True]
    # sparse buckets and f=2: 4096 > 2 x 1000 -> eager on both ranks, reason "padding" on both
    tight = B.Simulator(B.capture_config([64, 4096]), factor=2.0)
    step = T.Step((T.RankStep("extend", (T.TraceReq(extend=1000),)), IDLE))
    assert tight._side(step, harden=True)["decisions"] == [False, False]
    assert tight.rts[0].last.reason == "padding" and tight.rts[1].last.reason == "padding"


def test_random_seed_independence():
    """Another seed, fewer pairs: still no split and no guard raise (guards against a lucky seed)."""
    sim = B.Simulator(B.capture_config())
    rng = random.Random(7)
    for step in _random_steps(1000, seed=rng.randint(0, 10**6)):
        side = sim._side(step, harden=True)
        assert side["raised"] == [] and side["decisions"][0] == side["decisions"][1]
