"""Differential: stock ``MLPSyncBatchInfo.all_gather`` over a real gloo group vs the hardened call
over the native channel, two spawned processes, >= 10k randomized iterations, field for field
(values AND types; only the timing ``sync_wait_seconds`` differs). Same for DSpark's verify-tier
gather against the real ``DSparkVerifyPlanner`` method.

Stand-in (see dspark_harden.dp2.harness): ``get_parallel()`` is replaced by an object exposing
only the attributes the stock methods read (``tp_group.active_ranks_cpu`` / ``.cpu_group``);
there is no scheduler runtime context outside a server.
"""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest

from dspark_harden.dp2.harness import differences, init_worker, random_info, run_pair
from tests.harness import warm

ITERS = 10_000


def _mlp_worker(rank: int, port: int, session: str, iters: int) -> dict:
    w = init_worker(rank, port, session)
    dp_attn, group, active = w.dp_attn, w.group, w.active
    stock = dp_attn.MLPSyncBatchInfo.all_gather
    assert (
        w.sync.width
        == dp_attn.MLPSyncBatchInfo(
            num_dp_ranks=2,
            tp_size=1,
            cp_size=1,
            num_tokens=0,
            num_tokens_for_logprob=0,
            can_run_decode_cuda_graph=False,
            can_run_draft_cuda_graph=False,
            can_run_prefill_cuda_graph=False,
            is_extend_in_batch=False,
            local_can_run_tbo=False,
            local_forward_mode=0,
        )
        ._get_local_tensor("cpu")
        .numel()
    )
    rng = random.Random(1000 + rank)  # per-rank inputs
    shared = random.Random(7)  # decisions both ranks must take identically
    mismatches, stats = [], {"masked": 0, "idle_rank": 0, "health": 0, "modes": set(), "coop": 0}
    for i in range(iters):
        info = random_info(dp_attn, rng, rank)
        mask = shared.random()
        active[0], active[1] = (1, 1) if mask > 0.05 else ((0, 1) if mask > 0.025 else (1, 0))
        dp_attn._ENABLE_METRICS_DP_ATTENTION = shared.random() < 0.5
        a, b = copy.copy(info), copy.copy(info)
        stock(a, "cpu", group)
        w.sync(b, "cpu", group)
        d = differences(a, b)
        if d and len(mismatches) < 5:
            mismatches.append((i, d))
        stats["masked"] += active.tolist() != [1, 1]
        stats["idle_rank"] += 0 in a.global_num_tokens
        stats["health"] += a.any_health_check
        stats["coop"] += a.dp_cooperation_info is not None
        stats["modes"].add(info.local_forward_mode)
    w.runtime.close_all()
    w.dist.destroy_process_group()
    stats["modes"] = sorted(stats["modes"])
    return {"mismatches": mismatches, "stats": stats, "iters": iters}


@pytest.mark.timeout(1800)
def test_hardened_all_gather_matches_stock_field_for_field():
    results = run_pair(_mlp_worker, (ITERS,), timeout=1700, ctx=warm.mp_context())
    for rank, res in enumerate(results):
        assert res["iters"] >= 10_000
        assert res["mismatches"] == [], f"rank {rank}: {res['mismatches']}"
        st = res["stats"]
        # the randomized inputs really covered the interesting cases
        assert st["masked"] > 100 and st["idle_rank"] > 1000 and st["health"] > 50 and st["coop"] > 1000, st
        assert len(st["modes"]) >= 5, st


def _tier_worker(rank: int, port: int, session: str, iters: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1], backend="gloo")
    from sglang.srt.speculative.dspark_components import dspark_planner

    dspark_planner.get_parallel = lambda: SimpleNamespace(tp_group=SimpleNamespace(cpu_group=group))
    from dspark_harden.dp2 import verify_tier
    from dspark_harden.dp2.channels import Dp2Runtime

    rt = Dp2Runtime()
    rt.configure(session_id=session, timeout_ms=10000, spin_us=50, export=False, rank=rank, dp_label=str(rank))
    verify_tier.start(rt)
    cls = dspark_planner.DSparkVerifyPlanner
    stock = cls._maybe_gather_dp_verify_tier
    hardened = verify_tier.build_verify_tier(stock)
    planner = object.__new__(cls)  # the real class; only the attribute the method reads is set
    rng, shared = random.Random(50 + rank), random.Random(3)
    mismatches = []
    for i in range(iters):
        planner._dp_tier_gather_enabled = shared.random() < 0.9
        extend = shared.random() < 0.2  # gathered value: identical on both ranks
        tier = rng.choice((-1, 0, rng.randint(1, 4096)))
        a = SimpleNamespace(is_extend_in_batch=extend, global_spec_verify_tier_num_tokens="untouched")
        b = SimpleNamespace(is_extend_in_batch=extend, global_spec_verify_tier_num_tokens="untouched")
        stock(planner, batch=a, local_tier_num_tokens=tier)
        hardened(planner, batch=b, local_tier_num_tokens=tier)
        ra, rb = a.global_spec_verify_tier_num_tokens, b.global_spec_verify_tier_num_tokens
        if (type(ra), ra) != (type(rb), rb) or (
            isinstance(ra, list) and [type(x) for x in ra] != [type(x) for x in rb]
        ):
            if len(mismatches) < 5:
                mismatches.append((i, ra, rb))
    # a tier below -1 is refused (and poisons the channel for both ranks)
    planner._dp_tier_gather_enabled = True
    try:
        hardened(planner, batch=SimpleNamespace(is_extend_in_batch=False), local_tier_num_tokens=-2 if rank == 0 else 0)
        refused = "no error"
    except Exception as exc:  # noqa: BLE001
        refused = f"{type(exc).__name__}: {exc}"
    rt.close_all()
    dist.destroy_process_group()
    return {"mismatches": mismatches, "refused": refused}


@pytest.mark.timeout(1200)
def test_hardened_verify_tier_gather_matches_stock():
    results = run_pair(_tier_worker, (3000,), timeout=1100, ctx=warm.mp_context())
    for rank, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {rank}: {res['mismatches']}"
    assert "verify tier must be >= -1, got -2" in results[0]["refused"]
    assert "poisoned" in results[1]["refused"] and "verify tier must be >= -1" in results[1]["refused"]


def _misuse_worker(rank: int, port: int, session: str) -> dict:
    w = init_worker(rank, port, session)
    rng = random.Random(rank)
    out = {}
    w.sync(random_info(w.dp_attn, rng, rank), "cpu", w.group)  # one good step
    try:
        # rank 0 is asked for the elastic WORLD all-reduce path, rank 1 makes a normal call
        w.sync(random_info(w.dp_attn, rng, rank), "cpu", w.group, use_all_reduce=(rank == 0))
        out["second"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["second"] = f"{getattr(exc, 'name', type(exc).__name__)}|{exc}"
    w.runtime.close_all()
    w.dist.destroy_process_group()
    return out


@pytest.mark.timeout(900)
def test_unservable_call_poisons_both_ranks():
    r0, r1 = run_pair(_misuse_worker, (), timeout=800, ctx=warm.mp_context())
    assert r0["second"].startswith("caller_error|") and "WORLD all-reduce path" in r0["second"], r0
    assert r1["second"].startswith("poisoned|") and "WORLD all-reduce path" in r1["second"], r1


def _stall_worker(rank: int, port: int, session: str) -> dict:
    """Rank 1 stalls 1.2 s before its third step (timeout period 300 ms): rank 0's hardened
    MLPSyncBatchInfo.all_gather reports stalls and completes with the same result as stock's gloo
    all-gather, instead of failing both schedulers."""
    import time

    w = init_worker(rank, port, session, timeout_ms=300)
    dp_attn, group = w.dp_attn, w.group
    stock = dp_attn.MLPSyncBatchInfo.all_gather
    rng = random.Random(77 + rank)
    mismatches = []
    for i in range(5):
        info = random_info(dp_attn, rng, rank)
        a, b = copy.copy(info), copy.copy(info)
        stock(a, "cpu", group)
        if rank == 1 and i == 2:
            time.sleep(1.2)
        w.sync(b, "cpu", group)
        if differences(a, b):
            mismatches.append(i)
    ch = w.runtime.channels["mlp"]
    out = {"mismatches": mismatches, "stalls": ch.stalls}
    w.runtime.close_all()
    w.dist.destroy_process_group()
    return out


@pytest.mark.timeout(900)
def test_a_live_peer_stalling_past_the_timeout_does_not_fail_the_hot_path():
    r0, r1 = run_pair(_stall_worker, (), timeout=800, ctx=warm.mp_context())
    assert r0["mismatches"] == [] and r1["mismatches"] == [], (r0, r1)
    assert r0["stalls"] >= 2 and r1["stalls"] == 0, (r0, r1)


def _odd_values_worker(rank: int, port: int, session: str, iters: int) -> dict:
    """Odd-typed rows: floats (refused by ``struct``: the ``int()`` slow path), numpy scalars (taken by
    ``struct`` through ``__index__``); raw ``Channel.exchange`` calls on the same channel in between rebind
    the native handle to their own buffer and back. Everything must equal stock. Mutations red: the slow
    path converting differently; ``Channel.exchange`` not rebinding."""
    import numpy as np

    w = init_worker(rank, port, session)
    dp_attn, group = w.dp_attn, w.group
    stock = dp_attn.MLPSyncBatchInfo.all_gather
    rng = random.Random(77 + rank)
    mismatches, raw_bad, odd = [], [], 0
    for i in range(iters):
        info = random_info(dp_attn, rng, rank)
        kind = i % 4
        if kind == 1:
            info.num_tokens = np.int64(info.num_tokens)
            info.can_run_decode_cuda_graph = np.bool_(info.can_run_decode_cuda_graph)
        elif kind == 2:
            info.num_tokens_for_logprob = float(info.num_tokens_for_logprob) + 0.5
            info.attention_pairs = np.int32(info.attention_pairs % (1 << 30))
        odd += kind in (1, 2)
        a, b = copy.copy(info), copy.copy(info)
        stock(a, "cpu", group)
        w.sync(b, "cpu", group)
        d = differences(a, b)
        if d and len(mismatches) < 5:
            mismatches.append((i, kind, d))
        if kind == 3:  # a raw exchange on the MLP channel between two hardened calls
            out = w.sync.channel.exchange([i] * w.sync.width)
            if out != [i] * (2 * w.sync.width) and len(raw_bad) < 5:
                raw_bad.append((i, out))
    w.runtime.close_all()
    w.dist.destroy_process_group()
    return {"mismatches": mismatches, "raw_bad": raw_bad, "odd": odd}


@pytest.mark.timeout(900)
def test_hardened_all_gather_slow_path_values_and_interleaved_raw_exchanges_match():
    results = run_pair(_odd_values_worker, (800,), timeout=800, ctx=warm.mp_context())
    for rank, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {rank}: {res['mismatches']}"
        assert res["raw_bad"] == [], f"rank {rank}: {res['raw_bad']}"
        assert res["odd"] == 400
