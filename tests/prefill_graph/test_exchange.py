"""The decision across two real processes: each rank votes with the feature's wrapper around the
real stock vote, the rows travel through the real stock ``MLPSyncBatchInfo.all_gather`` over a real
loopback gloo group AND through the native DP2 exchange (``dspark_harden.dp2``), and the real
``_update_gather_batch`` wrapped by the finalisation decides. Both ranks must reach the same
verdict and bucket on every step, and the native path must gather exactly what gloo gathers.

Stand-ins (see ``dspark_harden.dp2.harness`` and ``prefill_graph.bench``): ``dp_attn.get_parallel``
exposes only ``tp_group.active_ranks_cpu``; each rank's ScheduleBatch is a TraceBatch; the runner is
the real class with state from stock's default capture configuration (no GPU).
"""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.timeout(900)

STEPS = 1500


def _worker(rank, port, session, steps):
    from dspark_harden.dp2 import harness
    from dspark_harden.prefill_graph import bench as B
    from dspark_harden.prefill_graph import trace as T

    w = harness.init_worker(rank, port, session)
    sim = B.Simulator(B.capture_config())
    dp_attn = w.dp_attn
    stock_all_gather = B._stock(dp_attn.MLPSyncBatchInfo.all_gather)
    trace = T.generate(T.TraceShape(steps=steps, seed=99, p_hidden=0.05, p_pool=0.05, p_peer_decode=0.15))
    out, mismatches = [], []
    for step in trace:
        mine = step.ranks[rank]
        batch = T.schedule_batch(mine)
        vote = sim.h_vote[rank](**sim._vote_kwargs(batch, T.num_tokens(mine)))
        info = sim._infos(T.Step((mine, mine)), [batch, batch], [vote, vote])[0]
        native = copy.copy(info)
        stock_all_gather(info, "cpu", w.group)
        w.sync(native, "cpu", w.group)
        diff = harness.differences(info, native)
        if diff:
            mismatches.append(diff)
        target = batch if batch is not None else _idle_batch()
        sim.h_update[rank](target, info, True, None, skip_global_metadata=False)
        dec = sim.rts[rank].last if info.is_extend_in_batch else None
        out.append((bool(target.can_run_dp_prefill_cuda_graph),
                    None if dec is None else (dec.graph, dec.bucket, dec.reason)))
    w.sync.channel.close()
    return {"decisions": out, "mismatches": mismatches[:5], "n_mismatch": len(mismatches)}


def _idle_batch():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from dspark_harden.prefill_graph import trace as T

    return T.TraceBatch(forward_mode=ForwardMode.IDLE, reqs=[], extend_lens=[], prefix_lens=[],
                        extend_logprob_start_lens=[], return_logprob=False, seq_lens_cpu=None)


def test_both_ranks_decide_the_same_over_gloo_and_native_exchange():
    from dspark_harden.dp2 import harness

    r0, r1 = harness.run_pair(_worker, (STEPS,))
    assert r0["n_mismatch"] == 0 and r1["n_mismatch"] == 0, (r0["mismatches"], r1["mismatches"])
    assert r0["decisions"] == r1["decisions"]
    graph = sum(1 for verdict, _ in r0["decisions"] if verdict)
    assert graph > STEPS // 3
    eager_forward_checks = {d[2] for _, d in r0["decisions"] if d is not None and not d[0]}
    assert "peer_vote" in eager_forward_checks  # some steps were vetoed by one rank's forward-time check
