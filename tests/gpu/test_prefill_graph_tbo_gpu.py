"""TBO prefill-graph children against SGLang 0.5.23's DSV4 compressor planner on a real GPU (H200).

The GPU machine runs SGLang's DSV4 JIT kernels (``sglang.kernels``, carried as in run_dsv4_on_device.sh)
but not its scheduler stack, and no DSV4 weights or ``DeepseekV4AttnBackend`` (its import closure
needs sgl_kernel, flashinfer and transformers, far beyond what can be carried). So the attention
layer itself is not run here; what runs is the part of the child attention metadata the sentinels
and the fixed split reach: ``CompressorPrefillPlan.generate`` (c_plan.cuh, the GPU-input path the
captured graphs use, int64 device lengths, ``req_to_token [64, 4096] int32``, ``full_to_state`` a
permutation of 2**16, c4 / ring 128 and c128 / ring 256, SWA page 256).

* per child, the plan of the request-axis-kept child (:func:`tbo_split.split` at stock's own split
  token, zero-length sentinel slots, ``num_q_tokens`` = the child's bucket rows) has exactly the valid
  compress / write entries of the plan of stock's eager child (``tests/gpu/data/tbo_stock_children.json``,
  produced by the real stock splitter on CPU; ``num_q_tokens`` = its live tokens): sentinels and
  padding rows plan nothing, token for token;
* a child with no live tokens (all sentinels) plans no entry, also right after a larger plan of the
  same child shape (no stale entries survive);
* stock's planner refuses a child whose request axis exceeds its rows (``batch_size <= num_q_tokens``)
  -- the reason :func:`tbo_split.check_bucket` refuses such buckets before capture.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine: RUN.md)")

DEV = "cuda"
FIXTURE = os.path.join(os.path.dirname(__file__), "data", "tbo_stock_children.json")
N_FULL, COLS, ROWS = 1 << 16, 4096, 64
RATIOS = [(4, 128), (128, 256)]


def _tables():
    g = torch.Generator(device=DEV).manual_seed(11)
    r2t = torch.randint(0, N_FULL, (ROWS, COLS), dtype=torch.int32, device=DEV, generator=g)
    return r2t, torch.randperm(N_FULL, device=DEV, generator=g)


def _plan(ratio, ring, rpi, seq, ext, num_q, tables):
    from sglang.kernels.ops.attention.dsv4.compress import CompressorPrefillPlan

    t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEV)  # noqa: E731
    p = CompressorPrefillPlan.generate(ratio, t(rpi), t(seq), t(ext), tables[0], tables[1], 256, ring, num_q)
    torch.cuda.synchronize()
    return p


def _valid(rows: torch.Tensor) -> list:
    """Valid plan entries (first u32 != 0xFFFFFFFF), as a sorted multiset of bytes (the GPU planner
    appends with atomics: order is not deterministic)."""
    keep = rows.view(torch.int32)[:, 0] != -1
    return sorted(bytes(r) for r in rows[keep].cpu().numpy())


def _cases():
    with open(FIXTURE) as fh:
        return json.load(fh)["cases"]


@pytest.mark.parametrize("ratio,ring", RATIOS, ids=["c4", "c128"])
def test_request_axis_children_plan_exactly_what_stock_eager_children_plan(ratio, ring):
    from dspark_harden.prefill_graph import tbo_split as S

    tables = _tables()
    rng = random.Random(ratio)
    compared = entries = 0
    for case in _cases():
        lens, t_split = case["lens"], case["split_token"]
        n = sum(lens)
        bucket = n + rng.choice([0, rng.randint(1, 300)])
        slots = min(len(lens) + rng.randint(0, 6), t_split, bucket - t_split)
        if slots < len(lens):
            continue  # a child's rows cannot hold this request axis (check_bucket refuses such buckets)
        ours = S.split(lens, case["prefix"], case["req_pool_indices"], bucket=bucket, slots=slots, split_token=t_split)
        for child, stock in zip(ours, case["stock_children"]):
            assert child.live_tokens == stock["tokens"]
            if stock["tokens"] == 0:
                continue
            a = _plan(
                ratio, ring, stock["req_pool_indices"], stock["seq_lens"], stock["extend_lens"], stock["tokens"], tables
            )
            b = _plan(
                ratio,
                ring,
                list(child.req_pool_indices),
                list(child.seq_lens),
                list(child.extend_seq_lens),
                child.num_tokens,
                tables,
            )
            for x, y, what in ((a.plan_c, b.plan_c, "compress"), (a.plan_w, b.plan_w, "write")):
                assert _valid(x) == _valid(y), (what, case, child.index)
            entries += len(_valid(a.plan_w))
            compared += 1
    print(json.dumps({f"tbo_children_compared_c{ratio}": compared, "write_entries": entries}))
    assert compared >= 40 and entries > 1000


@pytest.mark.parametrize("ratio,ring", RATIOS, ids=["c4", "c128"])
def test_all_sentinel_child_plans_nothing_even_after_a_larger_plan(ratio, ring):
    from dspark_harden.prefill_graph import tbo_split as S

    tables = _tables()
    bucket, slots = 512, 16
    big = S.split([200, 150, 100], [0, 37, 900], [3, 4, 5], bucket=bucket, slots=slots)
    small = S.split([100, 60], [0, 0], [3, 4], bucket=bucket, slots=slots)  # 160 <= 256: child B empty
    assert big[1].live_tokens > 0 and small[1].live_tokens == 0
    p_big = _plan(
        ratio, ring, list(big[1].req_pool_indices), list(big[1].seq_lens), list(big[1].extend_seq_lens), 256, tables
    )
    assert len(_valid(p_big.plan_w)) > 0
    p_empty = _plan(
        ratio,
        ring,
        list(small[1].req_pool_indices),
        list(small[1].seq_lens),
        list(small[1].extend_seq_lens),
        256,
        tables,
    )
    assert _valid(p_empty.plan_c) == [] and _valid(p_empty.plan_w) == []
    # in place, as a captured graph's buffers are refreshed: copy the empty plan over the big one
    p_big.copy_(p_empty)
    torch.cuda.synchronize()
    assert _valid(p_big.plan_c) == [] and _valid(p_big.plan_w) == []


def test_stock_planner_refuses_more_request_slots_than_child_rows():
    from dspark_harden.prefill_graph import tbo_split as S

    tables = _tables()
    with pytest.raises(Exception, match="batch_size <= num_q_tokens|RuntimeCheck|num_q_tokens"):
        _plan(4, 128, [0] * 16, [0] * 16, [0] * 16, 8, tables)
    with pytest.raises(S.TboSplitError, match="batch_size <= num_q_tokens"):
        S.check_bucket(16, 16)
