"""Two DP ranks, each a process driving the DSpark mask pipeline under a busy compute stream, exchange
their MLPSyncBatchInfo-shaped rows (11 int64) through the native DP2 channel every step (issue
"Two-GPU DP2 run", item 2).

The product runs the two ranks on two GPUs; this test takes the GPU count it finds: with two or more
devices rank r uses cuda:r, with one both ranks share cuda:0 (each process has its own CUDA context
and streams) and the report says so. Stand-ins as in test_dspark_masks_gpu.py: no DSpark draft model
(random draft chains), ``torch.cuda._sleep`` plays the target verify, synthetic step-stamped masks in
the 10k-step overwrite check. Real: xgrammar grammars and the native traversal in the mask-equality
phase, the cffi-built shared-memory/futex exchange, real processes, real CUDA streams and events.

Per rank: (1) 200 steps with real grammar masks, every mask equal to the synchronous CPU path;
(2) 10,000 steps of the slot-overwrite stress (a side-stream consumer reading late), the exchange on
every step, every peer row and every entry of every draft copy checked, then its own negative control:
2,000 steps that release the slot on the compute stream before the late (up to ~1 ms) side-stream
consumer read it must show overwritten masks on both ranks; (3) 10,000 exchanges with no GPU work (the idle figure, same run).
Exchange p50/p99/p99.9/max of (2) and (3) are printed and written to $OUT/dp2_two_ranks.json.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import uuid

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

W = 11
SLEEP = 200_000


def _row(rank: int, step: int) -> list:
    return [rank * 1_000_000_000 + step * 16 + j for j in range(W)]


def _pct(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def _rank_main(rank: int, session: str, stress_steps: int, q) -> None:
    try:
        q.put(_rank(rank, session, stress_steps))
    except BaseException as exc:  # noqa: BLE001
        import traceback

        q.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"})


def _rank(rank: int, session: str, stress_steps: int) -> dict:
    from dspark_harden.dp2.native import Channel
    from dspark_harden.dspark_masks.pipeline import MaskPipeline
    from dspark_harden.dspark_masks.traversal import ChainTraverser
    from dspark_harden.dspark_masks.workload import NativeFactory, native_jobs

    n_dev = torch.cuda.device_count()
    dev = torch.device("cuda", rank if n_dev >= 2 else 0)
    torch.cuda.set_device(dev)
    ch = Channel(session, "mlp", rank=rank, width=W, timeout_ms=60_000, spin_ns=50_000, config_digest=17)
    bad_rows = []

    def exchange(step):
        out = ch.exchange(_row(rank, step))
        if out[:W] != _row(0, step) or out[W:] != _row(1, step):
            bad_rows.append(step)
        return ch.stats.total_ns

    # (1) real grammar masks under a busy compute stream
    factory = NativeFactory(vocab=2048, pad=64)
    V = factory.vocab_size
    bs, chain = 32, 8
    traverser, reference = ChainTraverser("native", threads=4), ChainTraverser("scalar")
    pipe = MaskPipeline(dev, capacity=bs)
    verify = torch.empty((bs, chain), dtype=torch.int64, device=dev)
    mask_mismatch = []
    for step in range(200):
        exchange(step)
        matchers, roots, draft = factory.batch(bs, chain, seed=1000 * rank + step)
        ref = torch.empty((bs * chain, (V + 31) // 32), dtype=torch.int32)
        reference.traverse(native_jobs(matchers, roots, draft, V), draft, ref, V)
        torch.cuda._sleep(SLEEP)
        verify.copy_(draft.to(dev))
        ticket = pipe.begin(verify)
        torch.cuda._sleep(SLEEP)

        def fill(host_draft, host_mask):
            jobs = native_jobs(matchers, roots, host_draft, V)
            if not jobs:
                return False
            traverser.traverse(jobs, host_draft, host_mask, V)
            return True

        mask = pipe.finish(ticket, fill, V)
        got = ref.new_full(ref.shape, -1) if mask is None else mask.cpu()
        if not torch.equal(got, ref):
            mask_mismatch.append(step)
        pipe.consumed(ticket)
    pipe.close()
    traverser.close()

    # (2) slot-overwrite stress, exchange on every step; then its negative control on the same ranks:
    # the slot released before the late side-stream consumer read it must show overwritten masks
    def stress(steps: int, early_release: bool, step0: int, sleep_max: int = 40_000):
        rng = random.Random(rank + 17 * early_release)
        sbs, schain, vocab = 4, 4, 32 * 64
        words, rows = (vocab + 31) // 32, sbs * schain
        pipe = MaskPipeline(dev, capacity=sbs)
        results = torch.empty((steps, rows, words), dtype=torch.int32, device=dev)
        sverify = torch.empty((sbs, schain), dtype=torch.int64, device=dev)
        base_ids = torch.arange(rows, dtype=torch.int64, device=dev).view(sbs, schain)
        base_cpu = base_ids.cpu()
        row_ids = torch.arange(rows, dtype=torch.int32).view(rows, 1)
        col_ids = torch.arange(words, dtype=torch.int32).view(1, words)
        compute, side = torch.cuda.current_stream(dev), torch.cuda.Stream(dev)
        busy, bad = [], []
        for step in range(steps):
            if rng.random() < 0.5:
                torch.cuda._sleep(rng.randrange(sleep_max))
            torch.add(base_ids, step * 1000, out=sverify)
            ticket = pipe.begin(sverify)
            busy.append(exchange(step0 + step))  # while this rank's GPU streams are busy

            def sfill(host_draft, host_mask, step=step):
                if not torch.equal(host_draft, base_cpu + step * 1000):  # every draft entry, not one
                    bad.append(step)
                torch.add(row_ids * 131 + col_ids, step * 7919, out=host_mask)
                return True

            mask = pipe.finish(ticket, sfill, vocab)
            if early_release:
                pipe.consumed(ticket)  # released on the compute stream before the side stream read it
            with torch.cuda.stream(side):
                side.wait_stream(compute)
                torch.cuda._sleep(rng.randrange(sleep_max))
                results[step].copy_(mask)
                if not early_release:
                    pipe.consumed(ticket)
        torch.cuda.synchronize(dev)
        expected = (row_ids * 131 + col_ids).to(dev)
        got = results - torch.arange(steps, dtype=torch.int32, device=dev).view(steps, 1, 1) * 7919
        pipe.close()
        return (got != expected).flatten(1).any(1).nonzero().flatten().tolist(), bad, busy

    overwritten, bad_drafts, busy_ns = stress(stress_steps, False, 200)
    # (a late consumer: up to 2M cycles, ~1 ms, as in the single-rank negative control)
    neg_overwritten, _, _ = stress(2_000, True, 200 + stress_steps, sleep_max=2_000_000)
    stress_steps_total = stress_steps + 2_000

    # (3) idle exchanges, same processes
    idle_ns = [exchange(200 + stress_steps_total + i) for i in range(10_000)]
    ch.close()
    us = lambda v, p: round(_pct(v, p) / 1e3, 2)  # noqa: E731
    return {
        "rank": rank,
        "device": str(dev),
        "devices_visible": n_dev,
        "mask_steps": 200,
        "mask_mismatches": mask_mismatch,
        "stress_steps": stress_steps,
        "overwritten": overwritten[:20],
        "n_overwritten": len(overwritten),
        "negative_control_steps": 2_000,
        "negative_control_overwritten": len(neg_overwritten),
        "bad_drafts": bad_drafts[:20],
        "bad_rows": bad_rows[:20],
        "n_bad_rows": len(bad_rows),
        "exchange_us_under_gpu_load": {
            "p50": us(busy_ns, 0.5),
            "p99": us(busy_ns, 0.99),
            "p99.9": us(busy_ns, 0.999),
            "max": us(busy_ns, 1.0),
        },
        "exchange_us_idle": {
            "p50": us(idle_ns, 0.5),
            "p99": us(idle_ns, 0.99),
            "p99.9": us(idle_ns, 0.999),
            "max": us(idle_ns, 1.0),
        },
    }


def test_two_ranks_mask_pipeline_with_native_dp2_exchange_every_step():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    session = f"gpu2-{uuid.uuid4().hex}"
    procs = [ctx.Process(target=_rank_main, args=(r, session, 10_000, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = sorted((q.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=60)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "dp2_two_ranks.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    print(json.dumps(results))
    for r in results:
        assert r["mask_mismatches"] == [], r
        assert r["n_overwritten"] == 0 and r["bad_drafts"] == [], r
        assert r["negative_control_overwritten"] > 0, r  # the check can see an overwrite on these ranks
        assert r["n_bad_rows"] == 0, r
    assert all(p.exitcode == 0 for p in procs)
