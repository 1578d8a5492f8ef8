"""Eager-reference validation of prefill-graph replays (prefill_graph/validate.py).

Stand-ins (no GPU or DSV4 weights here, so no captured graph can run): the KV pool and request pool
are small objects holding real torch tensors in stock's shapes (per-layer K/V buffers of
``size + 1`` rows, a per-request state tensor), and the "graph" and "eager" forwards are one torch
module with a stateful side buffer -- it writes its tokens' KV rows and *accumulates* into its
requests' state rows, so running it twice without the restore is visible. The wrapper is also
exercised bound to the real ``PrefillCudaGraphRunner`` class (forked).
"""

from __future__ import annotations

import types

import pytest
import torch

from dspark_harden.prefill_graph import validate as V


class _KvPool:
    def __init__(self, size=64, layers=3):
        g = torch.Generator().manual_seed(1)
        self.size = size
        self.k_buffer = [torch.randn(size + 1, 2, 4, generator=g) for _ in range(layers)]
        self.v_buffer = [torch.randn(size + 1, 2, 4, generator=g) for _ in range(layers)]
        self.page_size = 1


class _ReqPool:
    def __init__(self, size=8):
        self.size = size
        self.state = torch.randn(size, 5, generator=torch.Generator().manual_seed(2))
        self.req_to_token = torch.zeros(size, 32, dtype=torch.int32)


class _Model(torch.nn.Module):
    """A prefill body with side effects: KV rows written at ``loc``, request state accumulated."""

    def __init__(self, kv, req, skew=0.0):
        super().__init__()
        self.kv, self.req, self.skew = kv, req, skew

    def forward(self, x, loc, rpi):
        h = torch.tanh(x * 1.5) + self.skew
        for layer, (k, v) in enumerate(zip(self.kv.k_buffer, self.kv.v_buffer)):
            k[loc] = h.view(-1, 1, 1).expand(-1, 2, 4) * (layer + 1)
            v[loc] = -h.view(-1, 1, 1).expand(-1, 2, 4)
        self.req.state[rpi] += h.sum()  # read-modify-write: not idempotent
        return _out(h.unsqueeze(1).repeat(1, 3), hidden=h)


def _out(logits, hidden=None):
    """Stock's runner output type (a dataclass the validator walks field by field)."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    return LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden)


def _fb(n=6, prefix=0):
    return types.SimpleNamespace(
        input_ids=torch.arange(n),
        out_cache_loc=torch.tensor([3, 9, 10, 11, 40, 63][:n]),
        req_pool_indices=torch.tensor([1, 5]),
        extend_prefix_lens_cpu=[prefix, 0],
        extend_seq_lens_cpu=[2, n - 2],
        forward_mode=None,
        batch_size=2,
    )


def _pools():
    return _KvPool(), _ReqPool()


def _touched(kv, req, fb):
    return V.TouchedRows.discover({"kv": (kv, fb.out_cache_loc), "req": (req, fb.req_pool_indices)})


def test_touched_rows_save_restore_is_exact_and_touches_nothing_else():
    kv, req = _pools()
    fb = _fb()
    before = [t.clone() for t in kv.k_buffer + kv.v_buffer + [req.state, req.req_to_token]]
    rows = _touched(kv, req, fb)
    assert len(rows.entries) == 2 * 3 + 2  # six K/V buffers, state and req_to_token
    rows.save()
    _Model(kv, req)(torch.randn(6), fb.out_cache_loc, fb.req_pool_indices)
    assert not torch.equal(kv.k_buffer[0], before[0]) and not torch.equal(req.state, before[6])
    rows.restore()
    assert rows.saved is None  # the copy is dropped at once (not held while eager runs)
    with pytest.raises(RuntimeError, match="before save"):
        rows.restore()
    after = kv.k_buffer + kv.v_buffer + [req.state, req.req_to_token]
    for a, b in zip(after, before):
        assert torch.equal(a, b)  # bit-exact, every row (untouched rows never written)


def test_discover_skips_tensors_too_short_for_the_rows():
    short = torch.zeros(4, 2)
    obj = type("Pool", (), {"__module__": "sglang.fake"})()
    obj.short, obj.long = short, torch.zeros(100, 2)
    rows = V.TouchedRows.discover({"p": (obj, torch.tensor([0, 50]))})
    assert rows.labels == ["p.long"]
    with pytest.raises(ValueError, match="negative index"):
        V.TouchedRows.discover({"p": (obj, torch.tensor([-1, 2]))})


def test_schedule_first_k_then_every_nth_per_bucket():
    s = V.Schedule(every=3, first=2)
    got = [s.due(64) for _ in range(10)]
    assert got == [True, True, False, False, True, False, False, True, False, False]
    assert [s.due(128) for _ in range(3)] == [True, True, False]  # another bucket starts its own count
    assert s.due(64) is True  # and 64's count went on: its 11th replay (2 + 3 x 3)
    with pytest.raises(ValueError):
        V.Schedule(every=0, first=1)


def test_compare_tolerance_shape_dtype_nan_and_missing():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert V.compare([("x", a)], [("x", a + 0.01)], 0.02) == []
    assert V.compare([("x", a)], [("x", a + 0.1)], 0.02)[0].startswith("x: max |graph - eager|")
    assert V.compare([("x", a)], [("x", a.clone())], 0.0) == []
    assert "differ" not in "".join(V.compare([("x", a)], [("x", a)], 0.0))
    assert V.compare([("x", a)], [("x", a.double())], 1.0)[0].startswith("x: graph")
    nan = a.clone()
    nan[1] = float("nan")
    assert "NaN" in V.compare([("x", nan)], [("x", a)], 1.0)[0]
    assert V.compare([("x", a), ("y", a)], [("x", a)], 1.0) == ["y: only in the graph output"]
    ints = torch.tensor([1, 2, 3])
    assert V.compare([("i", ints)], [("i", ints + torch.tensor([0, 0, 1]))], 1.0) == ["i: 1 of 3 elements differ"]


def _validator(action="raise", tol=0.0):
    seen = []
    return V.Validator(V.Schedule(1, 0), tol, action, dp_rank=0, on_outcome=seen.append), seen


def _run(v, kv, req, fb, *, graph_model, eager_model, x):
    return v.run(
        bucket=8,
        graph=lambda: graph_model(x, fb.out_cache_loc, fb.req_pool_indices),
        eager=lambda: eager_model(x, fb.out_cache_loc, fb.req_pool_indices),
        touched=_touched(kv, req, fb),
        geometry=lambda: {"batch_size": 2, "num_tokens": 6},
    )


def test_validated_step_matches_and_leaves_exactly_one_application_of_the_side_effects():
    kv, req = _pools()
    ref_kv, ref_req = _pools()
    fb, x = _fb(), torch.randn(6, generator=torch.Generator().manual_seed(3))
    v, seen = _validator()
    m = _Model(kv, req)
    out = _run(v, kv, req, fb, graph_model=m, eager_model=m, x=x)
    assert seen == ["match"]
    expect = _Model(ref_kv, ref_req)(x, fb.out_cache_loc, fb.req_pool_indices)  # one plain run
    assert torch.equal(out.next_token_logits, expect.next_token_logits)
    assert torch.equal(req.state, ref_req.state)  # accumulated once, not twice
    for a, b in zip(kv.k_buffer + kv.v_buffer, ref_kv.k_buffer + ref_kv.v_buffer):
        assert torch.equal(a, b)


def test_without_the_restore_the_double_application_is_reported(monkeypatch):
    """Mutation: a save/restore that does not restore -- the eager run accumulates on top of the
    graph's write and the validator reports the state rows (this test shows restore is needed)."""
    kv, req = _pools()
    fb, x = _fb(), torch.randn(6)
    monkeypatch.setattr(V.TouchedRows, "restore", lambda self: None)
    v, seen = _validator()
    m = _Model(kv, req)
    with pytest.raises(V.PrefillGraphValidationError, match=r"req\.state"):
        _run(v, kv, req, fb, graph_model=m, eager_model=m, x=x)
    assert seen == ["mismatch"]


def test_mismatch_raises_naming_bucket_and_geometry_or_is_counted():
    kv, req = _pools()
    fb, x = _fb(), torch.randn(6)
    v, seen = _validator("raise", tol=0.02)
    with pytest.raises(V.PrefillGraphValidationError) as info:
        _run(v, kv, req, fb, graph_model=_Model(kv, req, skew=0.5), eager_model=_Model(kv, req), x=x)
    msg = str(info.value)
    assert "bucket 8" in msg and "next_token_logits" in msg and "'num_tokens': 6" in msg and "k_buffer" in msg
    v2, seen2 = _validator("count", tol=0.02)
    out = _run(v2, kv, req, fb, graph_model=_Model(kv, req, skew=0.5), eager_model=_Model(kv, req), x=x)
    assert seen2 == ["mismatch"] and v2.counts["mismatch"] == 1
    assert torch.allclose(out.next_token_logits[:, 0], torch.tanh(x * 1.5))  # the eager (reference) result
    # within tolerance: a match
    v3, seen3 = _validator("raise", tol=0.02)
    _run(v3, kv, req, fb, graph_model=_Model(kv, req, skew=0.001), eager_model=_Model(kv, req), x=x)
    assert seen3 == ["match"]


def test_graph_output_aliasing_the_eager_buffer_is_copied_before_eager_runs():
    """A graph output living in a buffer the eager run rewrites (stock shares next_token_logits_buffer)
    is cloned first: a differing graph result is still seen."""
    kv, req = _pools()
    fb = _fb()
    shared = torch.zeros(6, 3)

    def graph():
        shared.copy_(torch.ones(6, 3))
        return _out(shared)

    def eager():
        shared.copy_(torch.zeros(6, 3))
        return _out(shared)

    v, seen = _validator("count")
    v.run(bucket=8, graph=graph, eager=eager, touched=_touched(kv, req, fb), geometry=dict)
    assert seen == ["mismatch"]


@pytest.mark.forked
def test_execute_wrapper_on_the_real_runner_class_schedules_and_skips_prefix_steps():
    """``build_execute`` bound on the real ``PrefillCudaGraphRunner`` (stock's ``_pad_to_bucket`` and
    capture sizes from stock's default capture configuration): replays with a cached prefix are not
    validated; the schedule counts per bucket; a validated replay returns the eager result."""
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    from dspark_harden.prefill_graph import runner as R

    runner = R.build_runner(R.capture_config())
    assert isinstance(runner, PrefillCudaGraphRunner)
    kv, req = _pools()
    model = _Model(kv, req)
    x = torch.randn(6)
    eager_calls = []

    def eager_execute(fb, pp_proxy_tensors=None):
        eager_calls.append(fb)
        return model(x, fb.out_cache_loc, fb.req_pool_indices)

    runner.model_runner = types.SimpleNamespace(
        token_to_kv_pool=kv, req_to_token_pool=req, eager_runner=types.SimpleNamespace(execute=eager_execute)
    )
    v = V.Validator(V.Schedule(every=2, first=1), 0.0, "raise", dp_rank=0)
    stock_calls = []

    def stock(self, fb, **kw):
        stock_calls.append(fb)
        return model(x, fb.out_cache_loc, fb.req_pool_indices)

    execute = V.build_execute(stock, v)
    with_prefix = _fb(prefix=16)
    execute(runner, with_prefix)
    assert v.counts == {} and len(stock_calls) == 1  # a cached prefix: not validated
    for _ in range(4):
        execute(runner, _fb())
    assert v.counts["match"] == 2  # replays 1 (first) and 3 (every 2nd after)
    assert len(eager_calls) == 2 and len(stock_calls) == 5
    bucket = runner._pad_to_bucket(6, runner.capture_num_tokens)
    assert v.schedule.seen[bucket] == 4
