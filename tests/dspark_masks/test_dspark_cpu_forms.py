"""The CPU test platform's forms of the stock pieces the DSpark path needs (issue 23, item 1),
each against the contract of the stock op it replaces. With these forms a real
``python -m sglang.launch_server --speculative-algorithm DSPARK`` server on the CPU platform serves,
single rank and DP2 (tests/dspark_masks/test_dspark_server.py; docs/testing.md, "DSpark on the CPU
platform").
"""

from __future__ import annotations

import inspect

import pytest
import torch

from dspark_testsupport import cpu_platform as C

#: forked: these install CPU forms over stock SGLang / torch attributes, and the attention forms run
#: torch ops large enough to start torch's OpenMP pool; in the pytest parent that pool makes every
#: later forked test that runs a parallel torch op deadlock in the child (seen: a suite run hung in
#: test_integration.py's ``logits.clone()`` for 7 minutes).
pytestmark = pytest.mark.forked


def test_kv_copy_cpu_form_moves_rows_of_every_layer_reading_sources_first():
    layers = [torch.arange(6 * 4, dtype=torch.int32).view(6, 4).clone() for _ in range(2)]
    want = [t.clone() for t in layers]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers], dtype=torch.int64)
    tgt, src = torch.tensor([1, 2]), torch.tensor([2, 5])  # row 2 is both a source and a target
    C.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for w in want:
        w[[1, 2]] = w[[2, 5]].clone()
    assert all(torch.equal(a, b) for a, b in zip(layers, want))


def test_assign_req_to_token_pool_cpu_form():
    req_to_token = torch.zeros((3, 8), dtype=torch.int32)
    C.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        req_to_token,
        torch.tensor([1, 4]),
        torch.tensor([3, 7]),
        torch.tensor([10, 11, 20, 21, 22]),
        8,
    )
    assert req_to_token[2, 1:3].tolist() == [10, 11] and req_to_token[0, 4:7].tolist() == [20, 21, 22]
    assert int(req_to_token.sum()) == 10 + 11 + 20 + 21 + 22


def test_speculative_cache_locs_cpu_form():
    req_to_token = torch.arange(24, dtype=torch.int32).view(3, 8)
    out = C.speculative_cache_locs_cpu(
        req_pool_indices=torch.tensor([1, 2]),
        req_to_token=req_to_token,
        start_offset=torch.tensor([2, 5]),
        end_offset=torch.tensor([4, 7]),
        batch_size=2,
        draft_token_num=2,
        device="cpu",
    )
    assert out.dtype == torch.int64 and out.tolist() == [10, 11, 21, 22]


def test_record_stream_cpu_form_is_a_no_op_on_cpu_tensors_only():
    before = torch.Tensor.record_stream
    try:
        C.install_record_stream_cpu_form()
        C.install_record_stream_cpu_form()  # idempotent
        t = torch.zeros(2)
        t.record_stream(torch.get_device_module("cpu").current_stream())  # stock raises "unknown parameter type"
    finally:
        torch.Tensor.record_stream = before


def test_dspark_handler_cpu_form_replaces_exactly_the_device_gate(monkeypatch):
    import sglang.srt.arg_groups.speculative_hook as H

    stock = H._handle_dspark
    monkeypatch.setattr(H, "_handle_dspark", stock)
    assert C.DSPARK_DEVICE_GATE in inspect.getsource(stock)
    assert C.install_dspark_cpu_handler() is True and C.install_dspark_cpu_handler() is False
    form = H._handle_dspark
    assert form.__wrapped__ is stock and form.__dspark_cpu_form__
    src = inspect.getsource(stock)
    assert "DSpark speculative decoding only supports CUDA" in src
    # the form's code differs from stock only by the gate: it now calls the out-of-tree check first
    assert "_check_oot_speculative_algorithm" in form.__code__.co_names
    assert "_check_oot_speculative_algorithm" not in stock.__code__.co_names


def _verify_setup(causal: bool, *, nq=4, nkv=2, hd=8, prefixes=(5, 3), n=4, seed=0):
    """A real ``MHATokenToKVPool`` on CPU, a req_to_token table whose block slots are the batch's
    ``out_cache_loc`` (as ``assign_extend_cache_locs`` leaves them), and a TARGET_VERIFY batch."""
    import types

    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.draft_worker_common import make_draft_block_spec_info

    g = torch.Generator().manual_seed(seed)
    pool = MHATokenToKVPool(
        size=64,
        page_size=1,
        dtype=torch.float32,
        head_num=nkv,
        head_dim=hd,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    req_to_token = torch.zeros((4, 32), dtype=torch.int32)
    rows, slot, out_cache_loc = [2, 0], 1, []
    for row, prefix in zip(rows, prefixes):
        ids = torch.arange(slot, slot + prefix + n, dtype=torch.int32)
        slot += prefix + n
        req_to_token[row, : prefix + n] = ids
        out_cache_loc.append(ids[prefix:].to(torch.int64))
    # the injected context K/V (prefix slots); the block's slots hold stale values the forward overwrites
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=g))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=g))
    bs = len(rows)
    layer = types.SimpleNamespace(
        layer_id=0,
        tp_q_head_num=nq,
        tp_k_head_num=nkv,
        tp_v_head_num=nkv,
        qk_head_dim=hd,
        v_head_dim=hd,
        head_dim=hd,
        scaling=hd**-0.5,
        is_cross_attention=False,
        sliding_window_size=-1,
        logit_cap=0.0,
        attn_type=AttentionType.DECODER if causal else AttentionType.ENCODER_ONLY,
        k_scale=None,
        v_scale=None,
    )
    fb = types.SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY,
        spec_info=make_draft_block_spec_info(draft_token_num=n, device="cpu"),
        seq_lens=torch.tensor(prefixes),
        req_pool_indices=torch.tensor(rows),
        out_cache_loc=torch.cat(out_cache_loc),
    )
    backend = types.SimpleNamespace(
        token_to_kv_pool=pool,
        req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
        swa_out_cache_loc=None,
    )
    q = torch.randn((bs * n, nq * hd), generator=g)
    k = torch.randn((bs * n, nkv, hd), generator=g)  # RadixAttention.forward hands K/V over as [tokens, heads, dim]
    v = torch.randn((bs * n, nkv, hd), generator=g)
    return backend, layer, fb, q, k, v


@pytest.mark.parametrize("causal", [False, True], ids=["encoder_only_block", "causal_block"])
def test_target_verify_cpu_form_equals_stock_extend_sdpa_over_prefix_plus_block(causal):
    """Differential: the CPU form on a TARGET_VERIFY batch == stock ``TorchNativeAttnBackend.
    _run_sdpa_forward_extend`` run on the same pool as an EXTEND of the block over its prefix
    (``extend_prefix_lens = seq_lens``, ``extend_seq_lens = n``, KV length prefix + n): the
    computation FlashInfer/Triton perform for the draft block (bidirectional for ENCODER_ONLY,
    bottom-right causal otherwise)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    backend, layer, fb, q, k, v = _verify_setup(causal)
    got = C.target_verify_attention_cpu(backend, q, k, v, layer, fb, save_kv_cache=True)
    n = 4
    # the block K/V were written at out_cache_loc
    assert torch.equal(backend.token_to_kv_pool.k_buffer[0][fb.out_cache_loc], k)
    want = torch.empty((q.shape[0], 4, 8))
    TorchNativeAttnBackend._run_sdpa_forward_extend(
        object.__new__(TorchNativeAttnBackend),
        q.view(-1, 4, 8),
        want,
        backend.token_to_kv_pool.get_key_buffer(0),
        backend.token_to_kv_pool.get_value_buffer(0),
        backend.req_to_token_pool.req_to_token,
        fb.req_pool_indices,
        fb.seq_lens + n,
        fb.seq_lens,
        torch.full_like(fb.seq_lens, n),
        scaling=layer.scaling,
        enable_gqa=True,
        causal=causal,
    )
    torch.testing.assert_close(got.view(-1, 4, 8), want, rtol=1e-5, atol=1e-5)
    # the two masks really differ (the test would not see a mask mix-up otherwise)
    layer.attn_type = _verify_setup(not causal)[1].attn_type
    flipped = C.target_verify_attention_cpu(backend, q, k, v, layer, fb, save_kv_cache=True)
    assert not torch.allclose(flipped, got)


def test_target_verify_cpu_form_refuses_what_it_does_not_reproduce():
    backend, layer, fb, q, k, v = _verify_setup(False)
    layer.sliding_window_size = 8
    with pytest.raises(C.TargetVerifyCpuFormError, match="sliding window"):
        C.target_verify_attention_cpu(backend, q, k, v, layer, fb)
    layer.sliding_window_size = -1
    fb.spec_info.custom_mask = torch.ones(4, dtype=torch.bool)
    with pytest.raises(C.TargetVerifyCpuFormError, match="custom_mask"):
        C.target_verify_attention_cpu(backend, q, k, v, layer, fb)


def test_target_verify_cpu_form_is_installed_for_target_verify_only():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    stock = TorchNativeAttnBackend.__dict__["forward_extend"]
    try:
        assert C.install_target_verify_cpu_form() and not C.install_target_verify_cpu_form()
        assert TorchNativeAttnBackend.forward_extend is C._torch_native_forward_extend_cpu_form
        assert C._STOCK_TORCH_NATIVE_FORWARD_EXTEND is stock
    finally:
        TorchNativeAttnBackend.forward_extend = stock
