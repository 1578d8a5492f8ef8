"""The decision across two real processes: each rank votes with the feature's wrapper around the
real stock vote, the rows travel through the real stock ``MLPSyncBatchInfo.all_gather`` over a real
loopback gloo group AND through the native DP2 exchange (``dspark_harden.dp2``), and the real
``_update_gather_batch`` wrapped by the finalisation decides. Both ranks must reach the same
verdict and bucket on every step, and the native path must gather exactly what gloo gathers.

Each rank's batch is a real ``ScheduleBatch`` (``prefill_graph.world``: real Reqs, pools and radix
cache, stock ``prepare_for_extend`` / ``prepare_for_decode`` / ``mix_with_running``); an idle rank
gets stock's idle batch (``SchedulerDPAttnAdapter.get_idle_batch``). Stand-ins (see
``dspark_harden.dp2.harness`` and ``prefill_graph.world``): ``dp_attn.get_parallel`` exposes only
``tp_group.active_ranks_cpu``; the runner is the real class with state from stock's default capture
configuration (no GPU).
"""

from __future__ import annotations

import copy

import pytest

from tests.harness import warm

pytestmark = pytest.mark.timeout(900)

STEPS = 1500


def _tbo_vote(rank):
    """Stock ``TboDPAttentionPreparer.prepare_all_gather`` with TBO on (no a2a MoE), run on the real
    batch, then vetoed on a seeded ~1/6 of the steps per rank -- the vote a DeepEP low-latency extend
    casts (stock: ``local_can_run_tbo`` False for an extend under low-latency DeepEP)."""
    import random

    from sglang.srt.batch_overlap import two_batch_overlap as tbo
    from sglang.srt.layers.moe.utils import DeepEPMode, MoeA2ABackend

    from dspark_harden.prefill_graph.tbo import _with_globals

    prepare = _with_globals(
        tbo.TboDPAttentionPreparer.prepare_all_gather,
        is_tbo_enabled=lambda: True,
        get_deepep_mode=lambda: DeepEPMode.AUTO,
        get_moe_a2a_backend=lambda: MoeA2ABackend.NONE,
    )
    rng = random.Random(1000 + rank)

    def vote(batch):
        can_run, _mode = prepare(tbo.TboDPAttentionPreparer(), batch)
        return bool(can_run) and rng.random() > 1 / 6

    return vote


def _stock_can_run_tbo(tp0_info_cpu) -> bool:
    """Stock ``TboDPAttentionPreparer.compute_output`` on the gathered TBO columns (TBO enabled): the
    step runs TBO iff it returns a split index."""
    from sglang.srt.batch_overlap.two_batch_overlap import TboDPAttentionPreparer

    p = TboDPAttentionPreparer()
    p.enable_two_batch_overlap, p.local_tbo_split_seq_index = True, 0
    return p.compute_output(tp0_info_cpu[:, 4:6])[0] is not None


def _worker(rank, port, session, steps, tbo_graphs=False):
    from dspark_harden.dp2 import harness
    from dspark_harden.prefill_graph import admission as A
    from dspark_harden.prefill_graph import runner as R
    from dspark_harden.prefill_graph import trace as T
    from dspark_harden.prefill_graph import world as W

    cfg = R.capture_config()
    model_config = W.publish_runtime(cfg, backend="full", spec="none")
    w = harness.init_worker(rank, port, session)
    dp_attn = w.dp_attn
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    eng = W.RankEngine(rank, model_config)
    runner = R.build_runner(cfg)
    rt = A.Runtime(
        dp_rank=rank,
        bs=list(cfg.buckets),
        server_mode=CaptureHiddenMode.NULL,
        attn_tp_size=1,
        tolerates_sum_len=lambda: False,
        tbo_graphs=tbo_graphs,
    )
    tbo_vote = _tbo_vote(rank) if tbo_graphs else (lambda batch: False)
    vote = A.build_vote(R.stock(dp_attn._local_prefill_cuda_graph_vote), rt)
    update = A.build_update_gather(R.stock(dp_attn._update_gather_batch), rt)
    stock_all_gather = R.stock(dp_attn.MLPSyncBatchInfo.all_gather)
    trace = T.generate(T.TraceShape(steps=steps, seed=99, p_hidden=0.05, p_pool=0.05, p_peer_decode=0.15))
    none = SpeculativeAlgorithm.NONE
    out, mismatches, gates = [], [], []
    from dspark_harden.prefill_graph.tbo_graph import tbo_synchronized

    try:
        for step in trace:
            mine = step.ranks[rank]
            batch = W.build_batch(eng, mine, none)
            if batch is None or batch.forward_mode.is_idle():
                tokens = 0
            elif batch.forward_mode.is_decode():
                tokens = batch.batch_size()
            else:
                tokens = batch.extend_num_tokens
            ok = vote(
                local_batch=batch,
                num_tokens=tokens,
                prefill_graph_runner=runner,
                coordinated_prefill=True,
                breakable_prefill=False,
                spec_algorithm=none,
                model_config=model_config,
            )
            mode = ForwardMode.IDLE if batch is None else batch.forward_mode
            info = dp_attn.MLPSyncBatchInfo(
                num_dp_ranks=2,
                tp_size=1,
                cp_size=1,
                num_tokens=tokens,
                num_tokens_for_logprob=tokens,
                can_run_decode_cuda_graph=mode.is_decode_or_idle(),
                can_run_draft_cuda_graph=True,
                can_run_prefill_cuda_graph=ok,
                is_extend_in_batch=mode.is_extend(),
                local_can_run_tbo=tbo_vote(batch),
                local_forward_mode=mode.value,
                prefill_cuda_graph_max_prefix_len=max(batch.prefix_lens or [0]) if mode.is_extend() else 0,
            )
            native = copy.copy(info)
            stock_all_gather(info, "cpu", w.group)
            w.sync(native, "cpu", w.group)
            diff = harness.differences(info, native)
            if diff:
                mismatches.append(diff)
            if tbo_graphs:  # the TBO gate read from each exchange's table, and stock's own verdict on it
                gates.append(
                    (
                        tbo_synchronized(info.tp0_info_cpu),
                        tbo_synchronized(native.tp0_info_cpu),
                        _stock_can_run_tbo(info.tp0_info_cpu),
                    )
                )
            target = batch if batch is not None else _idle_batch(eng, model_config)
            update(target, info, True, None, skip_global_metadata=False)
            dec = rt.last if info.is_extend_in_batch else None
            rt.last = None
            out.append(
                (
                    bool(target.can_run_dp_prefill_cuda_graph),
                    None if dec is None else (dec.graph, dec.bucket, dec.reason),
                )
            )
            eng.release()
    finally:
        w.sync.channel.close()
    return {"decisions": out, "mismatches": mismatches[:5], "n_mismatch": len(mismatches), "gates": gates}


def _idle_batch(eng, model_config):
    """Stock ``SchedulerDPAttnAdapter.get_idle_batch``: an empty ScheduleBatch after prepare_for_idle."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    idle = ScheduleBatch.init_new(
        [], eng.req_to_token_pool, eng.allocator, eng.tree, model_config, False, SpeculativeAlgorithm.NONE
    )
    idle.prepare_for_idle()
    return idle


def test_both_ranks_decide_the_same_over_gloo_and_native_exchange():
    from dspark_harden.dp2 import harness

    r0, r1 = harness.run_pair(_worker, (STEPS,), ctx=warm.mp_context())
    assert r0["n_mismatch"] == 0 and r1["n_mismatch"] == 0, (r0["mismatches"], r1["mismatches"])
    assert r0["decisions"] == r1["decisions"]
    graph = sum(1 for verdict, _ in r0["decisions"] if verdict)
    assert graph > STEPS // 3
    eager_forward_checks = {d[2] for _, d in r0["decisions"] if d is not None and not d[0]}
    assert "peer_vote" in eager_forward_checks  # some steps were vetoed by one rank's forward-time check


TBO_STEPS = 500


def test_tbo_prefill_graph_gate_is_the_same_on_both_ranks_over_gloo_and_native_exchange():
    """DSPARK_HARDEN_PREFILL_GRAPH_TBO=1: each rank's ``local_can_run_tbo`` comes from stock's
    ``prepare_all_gather`` on its real batch (plus seeded vetoes, as a DeepEP low-latency extend
    casts); the TBO gate read from the gloo-gathered and the natively gathered tables agrees on every
    step and on both ranks and equals stock's own ``compute_output`` verdict on that table, and the
    shared decision sends exactly the unsynchronized admissions eager (``tbo_unsynchronized``) on both
    ranks alike."""
    from dspark_harden.dp2 import harness

    r0, r1 = harness.run_pair(_worker, (TBO_STEPS, True), ctx=warm.mp_context())
    assert r0["n_mismatch"] == 0 and r1["n_mismatch"] == 0, (r0["mismatches"], r1["mismatches"])
    assert r0["gates"] == r1["gates"]
    assert all(g == n for g, n, _ in r0["gates"]), "gloo and native tables disagree on the TBO gate"
    assert all(g == stock for g, _, stock in r0["gates"]), "the gate differs from stock's compute_output"
    assert r0["decisions"] == r1["decisions"]
    reasons = [d[2] for _, d in r0["decisions"] if d is not None]
    assert reasons.count("tbo_unsynchronized") >= 10, reasons
    assert reasons.count("admitted") >= 10
    for (verdict, _dec), (gate, _, _) in zip(r0["decisions"], r0["gates"]):
        if verdict:
            assert gate, "a graph was admitted on a step where a rank does not run TBO"
