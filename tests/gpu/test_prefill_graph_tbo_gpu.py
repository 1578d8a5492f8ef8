"""TBO prefill-graph children against SGLang 0.5.23's DSV4 kernels on a real GPU (H100 / H200).

The GPU machine runs SGLang's DSV4 JIT kernels (``sglang.kernels``, carried as in run_dsv4_on_device.sh)
but not its scheduler stack, and no DSV4 weights or ``DeepseekV4AttnBackend`` (under CUDA its import
closure needs sgl_kernel, which cannot be carried, and a synthetic model runner; docs/prefill_graph.md).
So the backend itself is not run here; what runs is (1) the part of the child attention metadata the
sentinels and the fixed split reach: ``CompressorPrefillPlan.generate`` (c_plan.cuh, the GPU-input path the
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
  -- the reason :func:`tbo_split.check_bucket` refuses such buckets before capture;

and (2) both children's attention forward -- KV write + SGLang's ``flash_mla_sparse_fwd`` -- captured
once per bucket and replayed with refreshed child buffers, against stock's eager children (below).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from tests.gpu.graphs import KINDS

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


def _valid(rows: torch.Tensor, req_pool_indices=None) -> list:
    """Valid plan entries (first u32 != 0xFFFFFFFF), as a sorted multiset of bytes (the GPU planner
    appends with atomics: order is not deterministic).

    With ``req_pool_indices`` (compress plans): an entry with ``buffer_len == 0`` keeps its stage-0
    batch id in ``read_page_1`` (c_plan.cuh resolves pages only for ``buffer_len > 0``; c4_v2.cuh /
    c128_v2.cuh read the buffer pages only for ``i < buffer_len``, so the field is dead there). That
    id indexes the child's request axis, which a request-axis-kept child numbers differently from
    stock's compacted child; it is compared as the request it names (its request-pool index)."""
    rows = rows[rows.view(torch.int32)[:, 0] != -1].cpu()
    if req_pool_indices is not None:
        words = rows.view(torch.int32).clone()  # seq_len, ragged_id | buffer_len << 16, read_page_0, read_page_1
        dead = (words[:, 1] >> 16) & 0xFFFF == 0
        rpi = torch.tensor(list(req_pool_indices), dtype=torch.int32)
        words[dead, 3] = rpi[words[dead, 3].long()]
        rows = words.view(torch.uint8)
    return sorted(bytes(r) for r in rows.numpy())


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
            assert _valid(a.plan_c, stock["req_pool_indices"]) == _valid(b.plan_c, child.req_pool_indices), (
                "compress",
                case,
                child.index,
            )
            assert _valid(a.plan_w) == _valid(b.plan_w), ("write", case, child.index)
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
    # c_plan.cuh's RuntimeCheck(batch_size < kMaxTokens && batch_size <= num_q_tokens && ...) names
    # only its file and line; the same call with 16 rows passes, so 8 rows < 16 slots is what it refuses
    _plan(4, 128, [0] * 16, [0] * 16, [0] * 16, 16, tables)
    with pytest.raises(RuntimeError, match=r"c_plan\.cuh:\d+ in .*plan_compress_prefill"):
        _plan(4, 128, [0] * 16, [0] * 16, [0] * 16, 8, tables)
    with pytest.raises(S.TboSplitError, match="batch_size <= num_q_tokens"):
        S.check_bucket(16, 16)


# --- the child attention forward: eager stock children vs one capture of both children (two kinds) -----
#
# ``DeepseekV4AttnBackend`` does not import on the GPU machine (module docstring), so its metadata
# builder is stood in for by two independent constructions of the same sparse-prefill inputs: the
# captured body derives every row's request, position, KV write location and top-k key indices on the
# device from the :class:`tbo_split.ChildBuffers` and the two ``num_token_non_padded`` counts (the only
# per-replay inputs a captured child reads); the eager reference builds them per request on the host
# from stock's eager children (the real splitter, ``tests/gpu/data/tbo_stock_children.json``: stock's
# own split token, live requests only). The attention itself is SGLang's ``flash_mla_sparse_fwd``
# (sgl-flash-mla 1.0.0), fed a KV cache the body writes first at the rows' cache locations (the
# ``set_kv_buffer`` side effect of a prefill step).
HEADS, D_QK, TOPK = 64, 512, 256
SLOTS = 16


def _attn_tables():
    g = torch.Generator(device=DEV).manual_seed(5)
    # injective: no two (request, position) share a cache row; row 0 is the padding rows' dummy slot
    r2t = (torch.randperm(ROWS * COLS, device=DEV, generator=g) + 1).to(torch.int32).view(ROWS, COLS)
    kv0 = torch.randn((ROWS * COLS + 1, 1, D_QK), dtype=torch.bfloat16, device=DEV, generator=g)
    return r2t, kv0


def _sparse(q, kv, idx, lens):
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd

    return flash_mla_sparse_fwd(q, kv, idx[:, None, :], D_QK**-0.5, d_v=512, topk_length=lens)[0]


def _graph_child(q, k, bufs, count, r2t, kv):
    """One child's captured attention: every per-row quantity from the address-stable slot buffers."""
    rows = q.shape[0]
    r = torch.arange(rows, device=DEV)
    ext, start = bufs["extend_seq_lens"], bufs["extend_start_loc"]
    slot = torch.searchsorted(start + ext, r, right=True).clamp_(max=ext.numel() - 1)
    live = r < count
    pos = (bufs["extend_prefix_lens"][slot] + r - start[slot]).clamp_(0, COLS - 1)
    req = r2t[bufs["req_pool_indices"][slot]]  # [rows, COLS]
    loc = torch.where(live, req.gather(1, pos[:, None])[:, 0].long(), 0)
    kv.index_copy_(0, loc, k[:, None, :])
    keys = pos[:, None] - torch.arange(TOPK, device=DEV)[None, :]
    ok = live[:, None] & (keys >= 0)
    idx = torch.where(ok, req.gather(1, keys.clamp(min=0)), -1).to(torch.int32)
    return _sparse(q, kv, idx, ok.sum(1).to(torch.int32))


def _eager_stock_children(case, q, k, r2t, kv):
    """Stock's eager TBO children, one after the other, live requests only: per request its tokens'
    positions, cache rows and causal top-k keys (latest first), built on the host. Returns the output
    rows in parent row order."""
    out, row = [], 0
    for child in case["stock_children"]:
        n = child["tokens"]
        if n == 0:
            continue
        loc, idx = [], []
        for rpi, pre, ext in zip(child["req_pool_indices"], child["prefix_lens"], child["extend_lens"]):
            pos = torch.arange(pre, pre + ext, device=DEV)
            keys = pos[:, None] - torch.arange(TOPK, device=DEV)[None, :]
            loc.append(r2t[rpi, pos].long())
            idx.append(torch.where(keys >= 0, r2t[rpi][keys.clamp(min=0)], -1).to(torch.int32))
        loc, idx = torch.cat(loc), torch.cat(idx)
        kv.index_copy_(0, loc, k[row : row + n, None, :])
        out.append(_sparse(q[row : row + n], kv, idx, (idx >= 0).sum(1).to(torch.int32)))
        row += n
    return torch.cat(out)


class _ChildGraph:
    """Both children of one bucket captured once (fixed split at ``bucket // 2``), under ``kind``
    (tests/gpu/graphs.py: one CUDA graph, or SGLang's breakable graph with an eager break between the
    children); a replay refreshes the static inputs the way the runner does (q / k rows,
    :func:`tbo_split.refresh`)."""

    def __init__(self, bucket, r2t, kv, kind):
        from dspark_harden.prefill_graph import tbo_split as S
        from tests.gpu import graphs

        self.bucket = bucket
        self.q = torch.zeros((bucket, HEADS, D_QK), dtype=torch.bfloat16, device=DEV)
        self.k = torch.zeros((bucket, D_QK), dtype=torch.bfloat16, device=DEV)
        self.buffers = S.ChildBuffers(SLOTS, torch.device(DEV))
        self.counts = torch.zeros((2,), dtype=torch.int32, device=DEV)
        capture = S.split([bucket], [0], [1], bucket=bucket, slots=SLOTS)  # the capture batch: one full request
        S.refresh(self.buffers, self.counts, capture)
        t = S.split_token_index(bucket)
        a, b = self.buffers.tensors

        def between_children():
            return None

        def body():
            out_a = _graph_child(self.q[:t], self.k[:t], a, self.counts[0], r2t, kv)
            graphs.eager_break(kind, between_children)()
            return [out_a, _graph_child(self.q[t:], self.k[t:], b, self.counts[1], r2t, kv)]

        self.graph, self.out = graphs.capture(kind, body)

    def replay(self, case, q, k, *, refresh=True, counts=None):
        from dspark_harden.prefill_graph import tbo_split as S

        n = q.shape[0]
        self.q[:n].copy_(q)
        self.k[:n].copy_(k)
        children = S.split(case["lens"], case["prefix"], case["req_pool_indices"], bucket=self.bucket, slots=SLOTS)
        if refresh:
            S.refresh(self.buffers, self.counts, children)
        if counts is not None:
            self.counts.copy_(torch.tensor(counts, dtype=torch.int32))
        self.graph.replay()
        torch.cuda.synchronize()
        return children, torch.cat([o[: c.live_tokens] for o, c in zip(self.out, children)])


def _bucket_of(n):
    b = 512
    while b < n:
        b *= 2
    return b


@pytest.mark.parametrize("kind", KINDS)
def test_child_attention_replay_is_bit_identical_to_stock_eager_children(kind):
    """Per bucket, cases replayed largest first (so a smaller batch, and a child B with no live token,
    replays over a larger one's buffers): every live row's attention output and the whole KV cache
    (less the padding rows' dummy row 0) are bit-identical to stock's eager children on the same
    inputs. Two negative controls in the same run show the comparison can fail: a replay without
    :func:`tbo_split.refresh` and a replay whose counts stay at the previous larger batch's."""
    r2t, kv0 = _attn_tables()
    cases = [c for c in _cases() if len(c["lens"]) <= SLOTS]
    by_bucket = {}
    for c in cases:
        by_bucket.setdefault(_bucket_of(sum(c["lens"])), []).append(c)
    g = torch.Generator(device=DEV).manual_seed(7)
    compared = rows = empty_b = 0
    stats = {}
    for bucket, group in sorted(by_bucket.items()):
        group.sort(key=lambda c: -sum(c["lens"]))
        kv_graph = kv0.clone()
        graph = _ChildGraph(bucket, r2t, kv_graph, kind)
        prev = None
        for case in group:
            n = sum(case["lens"])
            q, k = _rand_qk(n, g)
            kv_eager = kv0.clone()
            ref = _eager_stock_children(case, q, k, r2t, kv_eager)
            kv_graph.copy_(kv0)
            children, got = graph.replay(case, q, k)
            assert torch.equal(got, ref), (bucket, case["lens"], (got.float() - ref.float()).abs().max().item())
            assert torch.equal(kv_graph[1:], kv_eager[1:]), (bucket, case["lens"])
            empty_b += children[1].live_tokens == 0
            compared += 1
            rows += n
            # negative controls (once per bucket, on a case of another geometry than the previous one)
            if prev is not None and "stale_buffers" not in stats.get(bucket, {}):
                kv_graph.copy_(kv0)
                graph.replay(prev, *_rand_qk(sum(prev["lens"]), g))  # the larger batch's buffers and counts
                kv_graph.copy_(kv0)
                _, stale = graph.replay(case, q, k, refresh=False)
                stale_kv = not torch.equal(kv_graph[1:], kv_eager[1:])
                stats.setdefault(bucket, {})["stale_buffers"] = (not torch.equal(stale, ref)) or stale_kv
                prev_children = graph.replay(prev, *_rand_qk(sum(prev["lens"]), g))[0]
                kv_graph.copy_(kv0)
                graph.replay(case, q, k, counts=[c.live_tokens for c in prev_children])
                stats[bucket]["stale_counts"] = not torch.equal(kv_graph[1:], kv_eager[1:])
            prev = case
    print(
        json.dumps(
            {"kind": kind, "child_attention_cases": compared, "rows": rows, "empty_child_b": empty_b, "controls": stats}
        )
    )
    assert compared >= 30 and empty_b >= 1
    assert stats and all(s["stale_buffers"] and s["stale_counts"] for s in stats.values()), stats


def _rand_qk(n, g):
    return (
        torch.randn((n, HEADS, D_QK), dtype=torch.bfloat16, device=DEV, generator=g),
        torch.randn((n, D_QK), dtype=torch.bfloat16, device=DEV, generator=g),
    )
