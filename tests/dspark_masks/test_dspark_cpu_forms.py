"""The CPU test platform's forms of the stock pieces the DSpark path needs (issue 23, item 1),
each against the contract of the stock op it replaces. Work in progress: with these forms a real
``python -m sglang.launch_server --speculative-algorithm DSPARK`` server on the CPU platform starts,
runs the target prefill and the draft KV injection through the real ``DSparkWorkerV2``, and fails
in the first draft forward (see docs/testing.md, "DSpark on the CPU platform").
"""

from __future__ import annotations

import inspect

import torch

from dspark_testsupport import cpu_platform as C


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
    C.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([1, 4]), torch.tensor([3, 7]),
                                   torch.tensor([10, 11, 20, 21, 22]), 8)
    assert req_to_token[2, 1:3].tolist() == [10, 11] and req_to_token[0, 4:7].tolist() == [20, 21, 22]
    assert int(req_to_token.sum()) == 10 + 11 + 20 + 21 + 22


def test_speculative_cache_locs_cpu_form():
    req_to_token = torch.arange(24, dtype=torch.int32).view(3, 8)
    out = C.speculative_cache_locs_cpu(req_pool_indices=torch.tensor([1, 2]), req_to_token=req_to_token,
                                       start_offset=torch.tensor([2, 5]), end_offset=torch.tensor([4, 7]),
                                       batch_size=2, draft_token_num=2, device="cpu")
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
    assert ("DSpark speculative decoding only supports CUDA" in src)
    # the form's code differs from stock only by the gate: it now calls the out-of-tree check first
    assert "_check_oot_speculative_algorithm" in form.__code__.co_names
    assert "_check_oot_speculative_algorithm" not in stock.__code__.co_names
