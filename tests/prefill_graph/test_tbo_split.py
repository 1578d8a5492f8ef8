"""The fixed flat-token TBO split (prefill_graph/tbo_split.py) against SGLang 0.5.23's own splitter.

Real stock objects: ``ForwardBatch`` (CPU tensors), ``compute_split_seq_index``,
``compute_split_token_index`` and ``TboForwardBatchPreparer.prepare_raw`` (with its
``filter_batch`` and two-chunk derivation). Three module globals of stock's TBO module that a live
model runner provides -- the forward context's attention backend (``prepare_raw`` only asserts its
type), the configured attention-backend pair (``compute_position`` picks torch or triton from it)
and the device -- are set to CPU stand-ins (no GPU exists here). Forked: ``get_parallel()`` is
given ``attn_tp_size=1`` process-wide and the module globals are patched.
"""

from __future__ import annotations

import random
import types

import pytest

from dspark_harden.prefill_graph import tbo_split as S
from tests.prefill_graph import tbo_stock_cases as C

pytestmark = pytest.mark.forked


def _parallel():
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_tp_size=1, moe_dense_tp_size=1)


@pytest.fixture
def stock_cpu():
    """Stock's TBO module on CPU stand-ins for a live runner's globals (tbo_stock_cases.stock_tbo_on_cpu)."""
    with C.stock_tbo_on_cpu() as T:
        yield T


def _batch(lens, prefix, *, pad_to=None, slots=None):
    """A real EXTEND ForwardBatch (tbo_stock_cases.extend_batch): request-pool indices 7, 10, 13, ...,
    token ids from 1000, KV locations from 5000."""
    return C.extend_batch(
        lens, prefix, [7 + 3 * i for i in range(len(lens))], rows=pad_to, slots=slots, ids_base=1000, loc_base=5000
    )


def _random_lens(rng, max_reqs=9, max_len=300):
    k = rng.randint(1, max_reqs)
    lens = [rng.choice([1, 2, 3, rng.randint(1, max_len)]) for _ in range(k)]
    prefix = [rng.choice([0, 0, rng.randint(0, 500)]) for _ in range(k)]
    return lens, prefix


def _stock_eager(lens, prefix):
    """Stock eager TBO of the live batch: its split and its two children."""
    from sglang.srt.batch_overlap import two_batch_overlap as T
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    fb = _batch(lens, prefix)
    fb.tbo_split_seq_index = T.compute_split_seq_index(ForwardMode.EXTEND, sum(lens), lens, None)
    token = T.compute_split_token_index(fb.tbo_split_seq_index, ForwardMode.EXTEND, lens, None)
    import torch

    T.TboForwardBatchPreparer.prepare_raw(fb, tbo_children_num_token_non_padded=torch.zeros(2, dtype=torch.int32))
    return token, fb.tbo_children


def _live(child, name):
    return [child.field(name)[i] for i in child.live_slots]


def _tokens_of(child_ids, starts, lens):
    return [child_ids[s : s + n].tolist() for s, n in zip(starts, lens)]


def test_geometry_matches_stock_eager_split_token_for_token(stock_cpu):
    """For randomized batches, the flat split at stock's own split token reproduces stock's eager
    children: per request the extend / prefix / seq lengths and request-pool index, and the tokens
    each request reads (``input_ids`` / ``out_cache_loc`` rows), token for token -- over both of
    stock's split kinds (sequence boundary and two-chunk)."""
    T = stock_cpu
    rng = random.Random(20261205)
    kinds = {"boundary": 0, "two_chunk": 0}
    for _ in range(400):
        lens, prefix = _random_lens(rng)
        if sum(lens) < 2:
            continue
        token, stock_children = _stock_eager(lens, prefix)
        kinds["two_chunk" if T._is_two_chunk_split_enabled(lens) else "boundary"] += 1
        bucket = sum(lens) + rng.choice([0, 0, rng.randint(0, 300)])
        slots = len(lens) + rng.choice([0, rng.randint(0, 6)])
        padded = _batch(lens, prefix, pad_to=bucket, slots=slots)
        mine = S.split(lens, prefix, padded.req_pool_indices.tolist(), bucket=bucket, slots=slots, split_token=token)
        for ours, stock in zip(mine, stock_children):
            # stock drops the requests with no tokens in a child (it slices the request axis); ours keeps
            # them as sentinels: compare the live slots in order
            assert _live(ours, "extend_seq_lens") == [int(x) for x in stock.extend_seq_lens_cpu if x > 0] or (
                not ours.live_slots and sum(stock.extend_seq_lens_cpu) == 0
            ), (lens, prefix, token)
            keep = [i for i, n in enumerate(stock.extend_seq_lens_cpu) if n > 0]
            assert _live(ours, "extend_prefix_lens") == [int(stock.extend_prefix_lens_cpu[i]) for i in keep]
            assert _live(ours, "seq_lens") == [int(stock.seq_lens_cpu[i]) for i in keep]
            assert _live(ours, "req_pool_indices") == [int(stock.req_pool_indices[i]) for i in keep]
            assert ours.live_tokens == sum(int(x) for x in stock.extend_seq_lens_cpu)
            # the rows each live request reads, token for token: ours index the padded bucket's rows
            # at the child's offset; stock's child holds exactly its rows
            ids = padded.input_ids[ours.token_start : ours.token_end]
            mine_tokens = _tokens_of(ids, _live(ours, "extend_start_loc"), _live(ours, "extend_seq_lens"))
            stock_starts = [sum(int(x) for x in stock.extend_seq_lens_cpu[:i]) for i in keep]
            stock_tokens = _tokens_of(stock.input_ids, stock_starts, [stock.extend_seq_lens_cpu[i] for i in keep])
            assert mine_tokens == stock_tokens, (lens, prefix, token, ours.index)
            assert padded.out_cache_loc[ours.token_start : ours.token_start + ours.live_tokens].tolist() == (
                stock.out_cache_loc.tolist()
            )
    assert kinds["boundary"] > 50 and kinds["two_chunk"] > 50, kinds


def test_stock_child_b_start_loc_is_parent_absolute_at_a_sequence_boundary(stock_cpu):
    """Where stock is inconsistent: at a sequence-boundary split, stock's eager child B keeps the
    parent's ``extend_start_loc`` (``filter_batch`` slices it without rebasing) while its rows start
    at 0; the two-chunk path rebases (``compute_position``). The graph's children are rebased in both
    cases (exclusive cumulative sum of the child's lengths)."""
    lens, prefix = [10, 20, 30], [0, 5, 0]
    token, (a, b) = _stock_eager(lens, prefix)
    assert token == 30  # boundary split after the second request
    assert b.extend_start_loc.tolist() == [30]  # parent-absolute, but child B's input_ids start at row 0
    assert len(b.input_ids) == 30
    ours = S.split(lens, prefix, [0, 1, 2], bucket=60, split_token=token)[1]
    assert ours.extend_start_loc == (0, 0, 0) and ours.extend_seq_lens == (0, 0, 30)


def test_fixed_split_invariants_randomized():
    """At the fixed split (``bucket // 2``): the request axis is kept; sentinels are true zero-length
    slots (index 0) at the exclusive cumulative start; the two children rebuild the parent token for
    token; a child past the live tokens is all sentinels with 0 live tokens; capture and replay of a
    bucket give the same child row ranges."""
    rng = random.Random(7)
    for _ in range(500):
        lens, prefix = _random_lens(rng)
        n = sum(lens)
        bucket = n + rng.choice([0, rng.randint(0, 2 * n + 2)])
        if bucket < 2:
            continue
        slots = len(lens) + rng.randint(0, 5)
        rpi = [11 + i for i in range(len(lens))]
        a, b = S.split(lens, prefix, rpi, bucket=bucket, slots=slots)
        t = bucket // 2
        assert (a.token_start, a.token_end, b.token_start, b.token_end) == (0, t, t, bucket)
        for c in (a, b):
            assert len(c.seq_lens) == slots
            assert list(c.extend_start_loc) == [sum(c.extend_seq_lens[:i]) for i in range(slots)]
            assert sum(c.extend_seq_lens) == c.live_tokens <= c.num_tokens
            for i in range(slots):
                if c.extend_seq_lens[i] == 0:
                    assert (c.seq_lens[i], c.extend_prefix_lens[i], c.req_pool_indices[i]) == (0, 0, 0)
                else:
                    assert c.seq_lens[i] == c.extend_prefix_lens[i] + c.extend_seq_lens[i]
        assert a.live_tokens == min(t, n) and b.live_tokens == max(0, n - t)
        for i, n_i in enumerate(lens):
            assert a.extend_seq_lens[i] + b.extend_seq_lens[i] == n_i
            if a.extend_seq_lens[i] and b.extend_seq_lens[i]:  # cut request: two-chunk semantics
                assert b.extend_prefix_lens[i] == prefix[i] + a.extend_seq_lens[i]
                assert b.seq_lens[i] == prefix[i] + n_i
        # token-for-token rebuild: A's live rows then B's live rows are the parent's live rows
        rows = []
        for c in (a, b):
            for i in c.live_slots:
                s = c.token_start + c.extend_start_loc[i]
                rows += list(range(s, s + c.extend_seq_lens[i]))
        assert rows == list(range(n))
        if n <= t:
            assert b.live_slots == () and b.live_tokens == 0
        # capture (slot 0 holds the whole bucket) and replay split the bucket's rows identically
        cap_a, cap_b = S.split([bucket], [0], [0], bucket=bucket, slots=slots)
        assert (cap_a.token_end, cap_b.token_start) == (a.token_end, b.token_start)


def test_bad_geometry_is_refused_with_the_geometry():
    with pytest.raises(S.TboSplitError, match="exceed the bucket"):
        S.split([10, 10], [0, 0], [0, 1], bucket=16)
    with pytest.raises(S.TboSplitError, match="request slots"):
        S.split([1, 1, 1], [0, 0, 0], [0, 1, 2], bucket=8, slots=2)
    with pytest.raises(S.TboSplitError, match="at least 2"):
        S.split([1], [0], [0], bucket=1)
    with pytest.raises(S.TboSplitError, match="negative"):
        S.split([3, -1], [0, 0], [0, 1], bucket=8)


def test_capture_children_are_stock_forward_batches_on_stable_buffers():
    """``capture_children`` over a real capture-shaped batch (slot 0 holds the bucket, sentinel tail):
    stock ``filter_batch`` builds both children (the request axis kept), their per-slot fields are
    views of the ChildBuffers, and a replay ``refresh`` rewrites those same tensors in place."""
    _parallel()
    import torch

    bucket, slots = 64, 4
    fb = _batch([bucket], [0], slots=slots)
    counts = torch.zeros(2, dtype=torch.int32)
    bufs = S.ChildBuffers(slots, "cpu")
    geo = S.capture_children(fb, counts, bufs)
    a, b = fb.tbo_children
    assert counts.tolist() == [32, 32]
    assert a.batch_size == b.batch_size == slots
    assert a.input_ids.tolist() == fb.input_ids[:32].tolist() and b.input_ids.tolist() == fb.input_ids[32:].tolist()
    assert a.extend_seq_lens.tolist() == [32, 0, 0, 0] and b.extend_prefix_lens.tolist() == [32, 0, 0, 0]
    assert a.extend_seq_lens.data_ptr() == bufs.tensors[0]["extend_seq_lens"].data_ptr()
    assert fb.tbo_split_seq_index == 0 and geo[0].live_tokens == 32
    # replay: 3 live requests, 40 tokens in the 64-token bucket
    replay = S.split([5, 30, 5], [0, 100, 0], [3, 4, 5], bucket=bucket, slots=slots)
    S.refresh(bufs, counts, replay)
    assert counts.tolist() == [32, 8]
    assert a.extend_seq_lens.tolist() == [5, 27, 0, 0] and b.extend_seq_lens.tolist() == [0, 3, 5, 0]
    assert b.extend_prefix_lens.tolist() == [0, 127, 0, 0] and b.extend_start_loc.tolist() == [0, 0, 3, 8]
    assert b.req_pool_indices.tolist() == [0, 4, 5, 0]


def test_child_view_keeps_the_request_axis():
    import torch

    fb = _batch([5, 30, 5], [0, 100, 0], pad_to=64, slots=4)
    a, b = S.split_of_view(fb, slots=4)
    va, vb = S.child_view(fb, a), S.child_view(fb, b)
    assert va.batch_size == vb.batch_size == 4
    assert va.input_ids.tolist() == list(range(1000, 1032)) and len(vb.input_ids) == 32
    assert vb.seq_lens.tolist() == [0, 130, 5, 0] and vb.seq_lens_cpu.tolist() == [0, 130, 5, 0]
    assert vb.out_cache_loc.tolist() == list(range(5032, 5064))
    assert vb.num_token_non_padded_cpu == 8 and va.num_token_non_padded_cpu == 32
    assert isinstance(va.extend_start_loc, torch.Tensor)


def test_buckets_too_small_for_the_request_axis_are_refused():
    """Each child keeps every request slot; DSV4's compressor planner requires batch_size <=
    num_q_tokens (c_plan.cuh), so a bucket below twice the slots cannot be captured with TBO."""
    S.check_bucket(32, 16)
    with pytest.raises(S.TboSplitError, match=r"bucket 31 cannot hold 16 request slots.*>= 32"):
        S.check_bucket(31, 16)
    with pytest.raises(S.TboSplitError, match=r"buckets \[8, 16\]"):
        S.check_buckets([8, 16, 32, 64], 16)
    from dspark_harden.prefill_graph import tbo_graph

    args = types.SimpleNamespace(
        cuda_graph_config=types.SimpleNamespace(prefill=types.SimpleNamespace(bs=[16, 64], full_prefill_max_req=16))
    )
    assert "buckets [16]" in tbo_graph.bucket_problem(args)
    args.cuda_graph_config.prefill.full_prefill_max_req = None  # resolved later: the capture hook checks
    assert tbo_graph.bucket_problem(args) == ""


def test_gpu_fixture_is_current():
    """tests/gpu/data/tbo_stock_children.json (the stock side of the H200 planner test) is what the
    real stock splitter produces today: regenerate with ``python -m tests.prefill_graph.tbo_stock_cases``."""
    from pathlib import Path

    committed = (Path(__file__).resolve().parents[2] / C.FIXTURE).read_text().strip()
    assert committed == C.render().strip(), "stale: python -m tests.prefill_graph.tbo_stock_cases > " + C.FIXTURE


def test_load_batch_hook_refreshes_the_children_buffers_and_counts_from_the_live_batch():
    """``tbo_graph.build_load_batch``: after stock's load, the children's per-slot buffers and the two
    ``num_token_non_padded`` counts the captured graph reads hold this replay's split of the bucket."""
    import torch

    from dspark_harden.prefill_graph import tbo_graph

    bucket, slots = 64, 4
    live = _batch([5, 30, 5], [0, 100, 0])
    static = types.SimpleNamespace(input_ids=torch.zeros(bucket, dtype=torch.int64))
    plugin = types.SimpleNamespace(
        _tbo_children_num_token_non_padded=torch.zeros(2, dtype=torch.int32),
        _dspark_child_buffers=S.ChildBuffers(slots, "cpu"),
    )
    runner = types.SimpleNamespace(tbo_plugin=plugin)
    load = tbo_graph.build_load_batch(lambda self, fb, **kw: (static, "read-ends"), active=lambda: True)
    assert load(runner, live) == (static, "read-ends")
    bufs = plugin._dspark_child_buffers.tensors
    assert plugin._tbo_children_num_token_non_padded.tolist() == [32, 8]
    assert bufs[0]["extend_seq_lens"].tolist() == [5, 27, 0, 0] and bufs[1]["extend_seq_lens"].tolist() == [0, 3, 5, 0]
    assert bufs[1]["extend_prefix_lens"].tolist() == [0, 127, 0, 0]
    assert bufs[1]["req_pool_indices"].tolist() == [0, 10, 13, 0]  # _batch's request-pool indices 7, 10, 13
    # switch off: stock only, nothing refreshed
    plugin._tbo_children_num_token_non_padded.zero_()
    tbo_graph.build_load_batch(lambda self, fb, **kw: (static, None), active=lambda: False)(runner, live)
    assert plugin._tbo_children_num_token_non_padded.tolist() == [0, 0]


def test_out_graph_hook_plans_both_children_from_the_fixed_split_even_an_empty_one():
    """``tbo_graph.build_out_graph`` on the real ``TboAttnBackend`` class: an EXTEND replay view plans
    the primary on the parent view and *both* children on request-axis views of the fixed split --
    also child B when it holds no live token (stock skips a zero-size child, which would leave the
    plan of an earlier, larger replay in its captured buffers)."""
    from sglang.srt.layers.attention.tbo_backend import TboAttnBackend

    from dspark_harden.prefill_graph import tbo_graph

    calls = []

    class Rec:
        token_to_kv_pool = req_to_token_pool = kv_index_translator = None

        def __init__(self, name):
            self.name = name

        def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
            calls.append((self.name, forward_batch))

    backend = TboAttnBackend(Rec("primary"), [Rec("a"), Rec("b")])
    hook = tbo_graph.build_out_graph(
        lambda self, fb, in_capture=False: calls.append(("stock", fb)), active=lambda: True
    )
    view = _batch([10, 6], [0, 3], pad_to=64, slots=4)  # 16 live tokens <= 32: child B empty
    hook(backend, view)
    assert [c[0] for c in calls] == ["primary", "a", "b"]
    a, b = calls[1][1], calls[2][1]
    assert a.batch_size == b.batch_size == 4
    assert a.extend_seq_lens.tolist() == [10, 6, 0, 0] and b.extend_seq_lens.tolist() == [0, 0, 0, 0]
    assert b.num_token_non_padded_cpu == 0 and b.seq_lens.tolist() == [0, 0, 0, 0]
    calls.clear()
    hook(backend, view, in_capture=True)  # capture: the batch's own children, as stock
    assert [c[0] for c in calls] == ["stock"]


def test_capture_hook_on_a_capture_prepare_shaped_batch_where_stock_asserts(stock_cpu, monkeypatch):
    """The capture hook on a batch with the fields ``PrefillCudaGraphRunner.capture_prepare`` sets
    (0.5.23 L1600-1676: full backend, bucket 256 in slot 0, 16 zero-length request slots, DP gather
    tensors, ``max_seq_len_override``, ``full_prefill_cuda_graph_capture``), on the real
    ``TboCudaGraphRunnerPlugin`` with TBO enabled: stock's own ``capture_one_batch_size`` asserts
    (``compute_split_seq_index(EXTEND, extend_lens=None)``); the hook builds both children through
    stock's ``filter_batch`` (which refuses unknown fields) and keeps ``max_seq_len_override`` on the
    parent and both children."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

    from dspark_harden.prefill_graph import tbo_graph

    T = stock_cpu
    monkeypatch.setattr(T, "is_tbo_enabled", lambda: True)
    bucket, slots = 256, 16
    lens = [bucket] + [0] * (slots - 1)
    tokens = torch.tensor([bucket, bucket], dtype=torch.int32)
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=slots,
        input_ids=torch.zeros(bucket, dtype=torch.int64),
        req_pool_indices=torch.arange(slots),
        seq_lens=torch.tensor(lens),
        next_token_logits_buffer=torch.zeros(slots, 8),
        orig_seq_lens=torch.tensor(lens),
        seq_lens_cpu=torch.tensor(lens),
        out_cache_loc=torch.zeros(bucket, dtype=torch.int64),
        seq_lens_sum=bucket,
        return_logprob=False,
        extend_num_tokens=bucket,
        extend_seq_lens=torch.tensor(lens),
        extend_prefix_lens=torch.zeros(slots, dtype=torch.int64),
        extend_start_loc=torch.tensor([0] + [bucket] * (slots - 1)),
        extend_prefix_lens_cpu=[0] * slots,
        extend_seq_lens_cpu=list(lens),
        extend_logprob_start_lens_cpu=list(lens),
        positions=torch.zeros(bucket, dtype=torch.int64),
        global_num_tokens_gpu=tokens,
        global_num_tokens_for_logprob_gpu=tokens,
        global_num_tokens_cpu=[bucket, bucket],
        global_dp_buffer_len=2 * bucket,
        capture_hidden_mode=CaptureHiddenMode.NULL,
        num_token_non_padded=torch.tensor(bucket, dtype=torch.int32),
        global_num_token_non_padded_cpu=bucket,
        attn_tp_sequence_sharded=False,
        global_forward_mode=ForwardMode.EXTEND,
        max_seq_len_override=4096,
        full_prefill_cuda_graph_capture=True,
    )
    plugin = T.TboCudaGraphRunnerPlugin()
    with pytest.raises(AssertionError):
        T.TboCudaGraphRunnerPlugin.capture_one_batch_size(plugin, batch, num_tokens=bucket)  # stock
    batch.tbo_split_seq_index = None
    hook = tbo_graph.build_capture_one_batch_size(
        T.TboCudaGraphRunnerPlugin.capture_one_batch_size, active=lambda: True
    )
    hook(plugin, batch, bucket)
    a, b = batch.tbo_children
    assert a.batch_size == b.batch_size == slots and len(a.input_ids) == len(b.input_ids) == 128
    assert plugin._tbo_children_num_token_non_padded.tolist() == [128, 128]
    assert int(a.num_token_non_padded) == int(b.num_token_non_padded) == 128
    counts = plugin._tbo_children_num_token_non_padded  # the children read the buffer every replay refreshes
    assert a.num_token_non_padded.data_ptr() == counts.data_ptr()
    assert b.num_token_non_padded.data_ptr() == counts.data_ptr() + counts.element_size()
    assert batch.max_seq_len_override == a.max_seq_len_override == b.max_seq_len_override == 4096
    assert a.global_dp_buffer_len == 128 and b.full_prefill_cuda_graph_capture
    assert b.extend_prefix_lens.tolist()[:2] == [128, 0] and b.seq_lens.tolist()[:2] == [256, 0]
    # a bucket too small for the request axis is refused before stock's planner would be
    small = types.SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, input_ids=torch.zeros(16, dtype=torch.int64), seq_lens=torch.zeros(slots)
    )
    with pytest.raises(S.TboSplitError, match="cannot hold 16 request slots"):
        hook(plugin, small, 16)
