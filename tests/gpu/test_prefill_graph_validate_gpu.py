"""Prefill-graph validation (``dspark_harden.prefill_graph.validate``) over a captured CUDA graph and a breakable graph (H100 / H200).

Stand-in (no SGLang server, model or DSV4 weights run on the GPU machine): a torch module shaped like a
prefill body with side effects -- bf16 hidden ``[T=256, 512]`` through two GEMMs, KV rows written at
``out_cache_loc`` into per-layer bf16 K/V buffers ``[4097, 8, 64]`` x 4 layers, and a read-modify-write
fp32 per-request state ``[64, 128]`` (like a compressor / ring state) at ``req_pool_indices`` -- captured
two ways (tests/gpu/graphs.py): one ``torch.cuda.CUDAGraph``, and SGLang 0.5.23's own breakable CUDA
graph with the state's read-modify-write as an eager break (re-run eagerly at every replay, between two
captured segments). The validator replays the graph, restores the touched rows, runs the same module
eagerly, and compares.

* graph vs eager of the same module: ``match`` at tolerance 0.02, and the side state after the validated
  step equals one eager application on a copy of the pools, bit for bit (not two: the restore works);
* the restore disabled (mutation): the state rows report a mismatch;
* an eager body that differs (scaled weights): a mismatch naming ``next_token_logits``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.gpu.graphs import KINDS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

T, D, H, HD, SLOTS, REQS, LAYERS = 256, 512, 8, 64, 4097, 64, 4


class _Pools:
    def __init__(self, dev):
        g = torch.Generator(device=dev).manual_seed(5)
        self.k_buffer = [torch.randn(SLOTS, H, HD, device=dev, generator=g).bfloat16() for _ in range(LAYERS)]
        self.v_buffer = [torch.randn(SLOTS, H, HD, device=dev, generator=g).bfloat16() for _ in range(LAYERS)]
        self.state = torch.randn(REQS, 128, device=dev, generator=g)


class _Body(torch.nn.Module):
    def __init__(self, pools, dev, scale=1.0, brk=lambda fn: fn):
        super().__init__()
        self.brk = brk  # how the state update runs: inline, or as a breakable graph's eager break
        g = torch.Generator(device=dev).manual_seed(9)
        self.w1 = (torch.randn(D, D, device=dev, generator=g) / D**0.5 * scale).bfloat16()
        self.w2 = (torch.randn(D, H * HD, device=dev, generator=g) / D**0.5).bfloat16()
        self.pools = pools

    def forward(self, x, loc, rpi, tok_req):
        h = torch.relu(x @ self.w1)
        kv = (h @ self.w2).view(-1, H, HD)
        for layer in range(LAYERS):
            self.pools.k_buffer[layer].index_copy_(0, loc, kv * (layer + 1))
            self.pools.v_buffer[layer].index_copy_(0, loc, -kv)
        per_req = torch.zeros(REQS, 128, device=x.device).index_add_(0, tok_req, h[:, :128].float())

        def update_state():  # read-modify-write; no tensor arguments (the break keeps them by closure)
            self.pools.state.index_add_(0, rpi, per_req.index_select(0, rpi))

        self.brk(update_state)()
        return h.float()


def _setup(kind):
    from dspark_harden.prefill_graph import validate as V
    from tests.gpu import graphs

    dev = torch.device("cuda")
    pools = _Pools(dev)
    body = _Body(pools, dev, brk=lambda fn: graphs.eager_break(kind, fn))
    x = torch.randn(T, D, device=dev).bfloat16()
    loc = torch.randperm(SLOTS - 1, device=dev)[:T] + 1
    rpi = torch.tensor([3, 17, 40, 41], device=dev)
    tok_req = rpi.repeat_interleave(T // 4)
    # capture (after a warm-up on a side stream, as stock does); the side effects of both are undone
    saved = copy.deepcopy(pools.__dict__)
    graph, static_out = graphs.capture(kind, lambda: body(x, loc, rpi, tok_req))
    for k, v in saved.items():
        cur = getattr(pools, k)
        if isinstance(cur, list):
            for a, b in zip(cur, v):
                a.copy_(b)
        else:
            cur.copy_(v)
    torch.cuda.synchronize()
    fb = type("FB", (), {})()
    fb.out_cache_loc, fb.req_pool_indices, fb.extend_prefix_lens_cpu = loc, rpi, [0, 0, 0, 0]
    return V, pools, body, graph, static_out, (x, loc, rpi, tok_req), fb


def _run(V, pools, graph, static_out, eager, fb, *, tol=0.02, action="raise"):
    seen = []
    v = V.Validator(V.Schedule(1, 0), tol, action, dp_rank=0, on_outcome=seen.append)
    touched = V.TouchedRows.discover({"kv": (pools, fb.out_cache_loc), "req": (pools, fb.req_pool_indices)})
    holder = {}

    def replay():
        graph.replay()
        return {"next_token_logits": static_out}

    def run_eager():
        holder["out"] = {"next_token_logits": eager()}
        return holder["out"]

    try:
        v.run(bucket=T, graph=replay, eager=run_eager, touched=touched, geometry=dict)
    except V.PrefillGraphValidationError as exc:
        return seen, str(exc)
    torch.cuda.synchronize()
    return seen, ""


def _one_eager_application(pools, inputs, scale=1.0):
    ref = copy.deepcopy(pools)
    _Body(ref, torch.device("cuda"), scale)(*inputs)
    torch.cuda.synchronize()
    return ref


def _same(a, b):
    return all(
        torch.equal(x, y) for x, y in zip(a.k_buffer + a.v_buffer + [a.state], b.k_buffer + b.v_buffer + [b.state])
    )


@pytest.mark.parametrize("kind", KINDS)
def test_graph_vs_eager_matches_and_leaves_one_application_of_the_side_state(kind):
    V, pools, body, graph, static_out, inputs, fb = _setup(kind)
    ref = _one_eager_application(pools, inputs)
    seen, err = _run(V, pools, graph, static_out, lambda: body(*inputs), fb)
    assert seen == ["match"], err
    assert _same(pools, ref), "side state after a validated step is not exactly one application"


@pytest.mark.parametrize("kind", KINDS)
def test_without_restore_the_state_rows_mismatch(kind, monkeypatch):
    V, pools, body, graph, static_out, inputs, fb = _setup(kind)
    monkeypatch.setattr(V.TouchedRows, "restore", lambda self: None)
    seen, err = _run(V, pools, graph, static_out, lambda: body(*inputs), fb)
    assert seen == ["mismatch"] and "state" in err, err


@pytest.mark.parametrize("kind", KINDS)
def test_a_differing_eager_body_is_reported(kind):
    V, pools, body, graph, static_out, inputs, fb = _setup(kind)
    other = _Body(pools, torch.device("cuda"), scale=1.5)
    seen, err = _run(V, pools, graph, static_out, lambda: other(*inputs), fb)
    assert seen == ["mismatch"] and "next_token_logits" in err, err
