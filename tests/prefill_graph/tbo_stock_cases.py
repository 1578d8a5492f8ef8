"""Stock eager TBO children for the H200 planner test (tests/gpu/test_prefill_graph_tbo_gpu.py).

The GPU machine cannot import SGLang's scheduler stack (only its DSV4 JIT kernels), so the stock
side of that test -- ``compute_split_seq_index`` / ``compute_split_token_index`` /
``TboForwardBatchPreparer.prepare_raw`` on randomized EXTEND batches -- is computed here with the
real stock code and written to ``tests/gpu/data/tbo_stock_children.json``;
``test_tbo_split.py::test_gpu_fixture_is_current`` regenerates it and fails when it is stale.

    python -m tests.prefill_graph.tbo_stock_cases > tests/gpu/data/tbo_stock_children.json
"""

from __future__ import annotations

import contextlib
import json
import random
import types

FIXTURE = "tests/gpu/data/tbo_stock_children.json"


@contextlib.contextmanager
def stock_tbo_on_cpu():
    """Stock's TBO module with the three globals a live model runner provides set to CPU stand-ins --
    the forward context's attention backend (``prepare_raw`` only asserts its type), the attention
    backend pair (``compute_position`` picks torch or triton from it) and the device -- restored on
    exit; ``get_parallel()`` gets ``attn_tp_size=1`` process-wide (callers run forked or as a script)."""
    from sglang.srt.batch_overlap import two_batch_overlap as T
    from sglang.srt.layers.attention.tbo_backend import TboAttnBackend
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_tp_size=1, moe_dense_tp_size=1)
    backend = TboAttnBackend.__new__(TboAttnBackend)
    saved = (T.get_attn_backend, T.attention_backends, T.get_device)
    T.get_attn_backend = lambda: backend
    T.attention_backends = lambda: ("torch_native", "torch_native")
    T.get_device = lambda: types.SimpleNamespace(device="cpu")
    try:
        yield T
    finally:
        T.get_attn_backend, T.attention_backends, T.get_device = saved


def extend_batch(lens, prefix, rpi, *, rows=None, slots=None, ids_base=0, loc_base=0):
    """A real EXTEND ``ForwardBatch`` (CPU): live requests in slot order, optionally padded to ``rows``
    bucket rows and ``slots`` request slots with zero-length sentinels (the full backend's replay
    layout); sentinel slots have request-pool index 0."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    k = len(lens)
    rows = sum(lens) if rows is None else rows
    r = k if slots is None else slots
    sl = [a + b for a, b in zip(lens, prefix)] + [0] * (r - k)
    el = list(lens) + [0] * (r - k)
    pl = list(prefix) + [0] * (r - k)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=r,
        input_ids=torch.arange(ids_base, ids_base + rows),
        req_pool_indices=torch.tensor(list(rpi[:k]) + [0] * (r - k)),
        seq_lens=torch.tensor(sl),
        seq_lens_cpu=torch.tensor(sl),
        out_cache_loc=torch.arange(loc_base, loc_base + rows),
        seq_lens_sum=sum(sl),
        positions=torch.arange(rows),
        extend_num_tokens=rows,
        extend_seq_lens=torch.tensor(el),
        extend_prefix_lens=torch.tensor(pl),
        extend_start_loc=torch.tensor([sum(el[:i]) for i in range(r)]),
        extend_prefix_lens_cpu=pl,
        extend_seq_lens_cpu=el,
        extend_logprob_start_lens_cpu=el,
        return_logprob=False,
    )


def stock_cases(n: int = 40, seed: int = 20261205) -> list:
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    rng = random.Random(seed)
    out = []
    with stock_tbo_on_cpu() as T:
        while len(out) < n:
            k = rng.randint(1, 12)
            lens = [rng.choice([1, 3, rng.randint(1, 700)]) for _ in range(k)]
            prefix = [rng.choice([0, rng.randint(1, 1500)]) for _ in range(k)]
            rpi = rng.sample(range(1, 64), k)
            n_tok = sum(lens)
            fb = extend_batch(lens, prefix, rpi)
            fb.tbo_split_seq_index = T.compute_split_seq_index(ForwardMode.EXTEND, n_tok, lens, None)
            token = T.compute_split_token_index(fb.tbo_split_seq_index, ForwardMode.EXTEND, lens, None)
            if token <= 0 or token >= n_tok:
                continue  # stock runs one child only: nothing to compare per child
            T.TboForwardBatchPreparer.prepare_raw(
                fb, tbo_children_num_token_non_padded=torch.zeros(2, dtype=torch.int32)
            )
            children = [
                dict(
                    extend_lens=[int(x) for x in c.extend_seq_lens_cpu],
                    prefix_lens=[int(x) for x in c.extend_prefix_lens_cpu],
                    seq_lens=[int(x) for x in c.seq_lens_cpu],
                    req_pool_indices=[int(x) for x in c.req_pool_indices],
                    tokens=int(sum(c.extend_seq_lens_cpu)),
                )
                for c in fb.tbo_children
            ]
            out.append(
                dict(lens=lens, prefix=prefix, req_pool_indices=rpi, split_token=int(token), stock_children=children)
            )
    return out


def render() -> str:
    """One case per line."""
    cases = ",\n  ".join(json.dumps(c, separators=(",", ":")) for c in stock_cases())
    return '{"generated_by": "python -m tests.prefill_graph.tbo_stock_cases",\n "cases": [\n  ' + cases + "\n ]\n}"


if __name__ == "__main__":
    print(render())
