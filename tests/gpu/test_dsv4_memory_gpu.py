"""DSV4 eager-prefill memory on a real GPU with SGLang 0.5.23's own DSV4 kernels (H200; see RUN.md).

(a) ``fused_q_norm_rope`` (sglang/kernels/jit/csrc/deepseek_v4/main_norm_rope.cuh, JIT) in place vs
    out of place, bit for bit, over DSV4 shapes and both ``eps`` branches, plus a negative control: an
    output overlapping the input at an offset (unsafe by construction) must be caught by the same
    comparison. The in-place ``_compute_q_b`` replacement runs against a stand-in layer object (a
    real DSV4 layer needs the model's weights): its ``wq_b`` is a real bf16 GEMM.
(b) the sparse-prefill pool with the real ``flash_mla_sparse_fwd`` (sgl-flash-mla 1.0.0): in a
    default pool fragmented under ``set_per_process_memory_fraction`` a fresh contiguous output
    allocation fails, while the reserved path serves the call with zero new segments and no allocator
    retry — also after ``empty_cache()`` and after capturing a CUDA graph of another shape — with
    outputs bit-identical to the unreserved call.
(c) the planner guards around the real ``CompressorPrefillPlan.generate`` / ``CompressorDecodePlan.generate``
    (c_plan.cuh, JIT): every valid randomized geometry gives the stock plan bit for bit, every crafted
    out-of-bounds one is refused before launch; the per-call overhead is printed.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine: RUN.md)")

DEV = "cuda"
HEAD_DIM, ROPE_DIM = 512, 64
MAX_POS = 65536
REPORT = os.environ.get("OUT")


def _report(name: str, obj) -> None:
    line = json.dumps({name: obj})
    print(line)
    if REPORT:
        with open(os.path.join(REPORT, "dsv4_memory_figures.jsonl"), "a") as fh:
            fh.write(line + "\n")


def _freqs():
    g = torch.Generator(device="cpu").manual_seed(0)
    ang = torch.rand((MAX_POS, ROPE_DIM // 2), generator=g) * 6.283
    return torch.polar(torch.ones_like(ang), ang).to(DEV)


@pytest.fixture(scope="module")
def freqs():
    return _freqs()


def _norm_rope():
    from sglang.kernels.ops.attention.dsv4 import fused_q_norm_rope

    return fused_q_norm_rope


SHAPES = [(1, 64), (7, 64), (128, 128), (1024, 64), (4096, 64), (4096, 128), (8192, 128), (16384, 64)]


@pytest.mark.parametrize("eps", [1e-6, None], ids=["norm", "no-norm"])
@pytest.mark.parametrize("tokens,heads", SHAPES)
def test_fused_q_norm_rope_in_place_is_bit_identical(freqs, tokens, heads, eps):
    fn = _norm_rope()
    torch.manual_seed(tokens * 131 + heads)
    q = torch.randn((tokens, heads, HEAD_DIM), dtype=torch.bfloat16, device=DEV)
    pos = torch.randint(0, MAX_POS, (tokens,), device=DEV, dtype=torch.int64 if tokens % 2 else torch.int32)
    ref = torch.empty_like(q)
    fn(q.clone(), ref, eps, freqs, pos)
    inplace = q.clone()
    fn(inplace, inplace, eps, freqs, pos)
    torch.cuda.synchronize()
    assert torch.equal(inplace, ref)


def test_negative_control_an_offset_overlap_is_detected(freqs):
    """Output at rows [1, T] of a buffer whose rows [0, T-1] are the input: each (token, head) warp
    writes into the *next* token's input, which another warp may not have loaded yet. The same
    comparison that passes the aliased call must fail this one."""
    fn = _norm_rope()
    tokens, heads = 8192, 128
    torch.manual_seed(5)
    buf = torch.randn((tokens + 1, heads, HEAD_DIM), dtype=torch.bfloat16, device=DEV)
    pos = torch.randint(0, MAX_POS, (tokens,), device=DEV)
    ref = torch.empty((tokens, heads, HEAD_DIM), dtype=torch.bfloat16, device=DEV)
    fn(buf[:-1].clone(), ref, 1e-6, freqs, pos)
    mismatched_runs = 0
    for _ in range(3):
        work = buf.clone()
        fn(work[:-1], work[1:], 1e-6, freqs, pos)
        torch.cuda.synchronize()
        mismatched_runs += int(not torch.equal(work[1:], ref))
    _report("negative_control_mismatched_runs_of_3", mismatched_runs)
    assert mismatched_runs == 3


def _layer(heads: int, freqs, q_lora: int = 1024):
    torch.manual_seed(heads)
    w = (torch.randn((q_lora, heads * HEAD_DIM), dtype=torch.bfloat16, device=DEV) / q_lora ** 0.5)
    return SimpleNamespace(wq_b=lambda x: (x @ w, None), n_local_heads=heads, head_dim=HEAD_DIM,
                           use_mega_attention=False, q_head_norm=True, eps=1e-6, freqs_cis=freqs)


def _stock_q_head_norm(self, q, positions, q_out=None):
    """sglang 0.5.23 ``MQALayer._compute_q_b``, q_head_norm branch (models/deepseek_v4.py), verbatim."""
    q, _ = self.wq_b(q)
    q = q.view(-1, self.n_local_heads, self.head_dim)
    if q_out is None:
        q_out = torch.empty_like(q)
    _norm_rope()(q, q_out, self.eps, self.freqs_cis, positions)
    return q_out


def test_in_place_compute_q_b_matches_stock_and_saves_one_buffer_per_call(freqs):
    from dspark_harden.dsv4_memory.qnorm import CALLS, build_compute_q_b, saved_bytes

    ours = build_compute_q_b(_stock_q_head_norm, lambda: None)
    saved = {}
    for tokens in (4096, 8192, 16384):
        layer = _layer(128, freqs)
        x = torch.randn((tokens, 1024), dtype=torch.bfloat16, device=DEV)
        pos = torch.randint(0, MAX_POS, (tokens,), device=DEV)
        _stock_q_head_norm(layer, x, pos)  # warm-up: JIT module, cuBLAS workspace
        peaks = {}
        outs = {}
        for name, fn in (("stock", _stock_q_head_norm), ("ours", ours)):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            outs[name] = fn(layer, x, pos)
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - base
        assert torch.equal(outs["stock"], outs["ours"])
        saved[tokens] = peaks["stock"] - peaks["ours"]
        assert saved[tokens] == saved_bytes(tokens, 128), (tokens, peaks)
        del outs
    n = CALLS["inplace"]
    assert n >= 3
    layer = _layer(64, freqs)
    fp8_out = torch.empty((16, 64, HEAD_DIM), dtype=torch.float8_e4m3fn, device=DEV)
    ours(layer, torch.randn((16, 1024), dtype=torch.bfloat16, device=DEV),
         torch.zeros(16, dtype=torch.int64, device=DEV), fp8_out)
    assert CALLS["inplace"] == n  # a caller-provided output (the FP8 branch) goes to stock untouched
    _report("q_norm_rope_saved_bytes_per_layer_call_128_heads", saved)


# --- (b) sparse-prefill pool -------------------------------------------------------------------


def _sparse_inputs(tokens, heads, s_kv=4096, topk=256):
    torch.manual_seed(11)
    q = torch.randn((tokens, heads, HEAD_DIM), dtype=torch.bfloat16, device=DEV)
    kv = torch.randn((s_kv, 1, HEAD_DIM), dtype=torch.bfloat16, device=DEV)
    idx = torch.randint(0, s_kv, (tokens, 1, topk), dtype=torch.int32, device=DEV)
    lens = torch.randint(1, topk + 1, (tokens,), dtype=torch.int32, device=DEV)
    sink = torch.randn((heads,), dtype=torch.float32, device=DEV)
    return q, kv, idx, lens, sink


def _segments() -> tuple:
    s = torch.cuda.memory_stats()
    return s.get("segment.all.current", 0), s.get("num_alloc_retries", 0), s.get("num_ooms", 0)


def test_reserved_pool_serves_what_a_fragmented_default_pool_cannot():
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd as stock

    from dspark_harden.dsv4_memory.pool import SparsePrefillPool, caller_owned_output_supported

    import flash_mla

    assert not caller_owned_output_supported(flash_mla.flash_mla_sparse_fwd)  # 1.0.0: allocating API only
    tokens, heads = 8192, 128
    q, kv, idx, lens, sink = _sparse_inputs(tokens, heads)
    kwargs = dict(d_v=512, attn_sink=sink, topk_length=lens)
    ref = [t.clone() for t in stock(q, kv, idx, HEAD_DIM ** -0.5, **kwargs)]
    pool = SparsePrefillPool(tokens=tokens, heads=heads, d_v=512, device=torch.device(DEV)).reserve()
    assert pool.reserved_bytes == (1 << 30) + 8 * (1 << 20)

    def pooled():
        """(outputs identical to the unreserved call, allocator counters before and after the call alone:
        the comparison itself allocates, so it runs outside the measured window)"""
        torch.cuda.synchronize()
        before = _segments()
        out = pool.run(stock, q, kv, idx, HEAD_DIM ** -0.5, **kwargs)
        torch.cuda.synchronize()
        after = _segments()
        # compared in 512-token slices: a whole-tensor torch.equal needs a temporary larger than the slack
        # the memory-fraction cap leaves in the fragmented phases
        same = all(torch.equal(a[i:i + 512], b[i:i + 512]) for a, b in zip(out, ref) for i in range(0, tokens, 512))
        del out
        return same, before, after

    assert pooled()[0]
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    big = torch.empty(6 << 30, dtype=torch.uint8, device=DEV)
    del big  # one cached 6 GiB segment ...
    blocks = [torch.empty(256 << 20, dtype=torch.uint8, device=DEV) for _ in range(24)]
    del blocks[::2]  # ... split into 256 MiB blocks, every other one freed: holes pinned by live blocks
    figures = {}
    try:
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + (512 << 20)) / total))
        seg0, retry0, oom0 = _segments()
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty((tokens, heads, 512), dtype=torch.bfloat16, device=DEV)  # a fresh 1 GiB block
        seg1, retry1, oom1 = _segments()
        figures["default_pool_fresh_1GiB"] = {"oom": oom1 - oom0, "alloc_retries": retry1 - retry0}
        assert oom1 - oom0 == 1 and seg1 == seg0
        for phase in ("fragmented", "after_empty_cache", "after_graph_capture"):
            if phase == "after_empty_cache":
                torch.cuda.empty_cache()
            if phase == "after_graph_capture":
                a = torch.randn((512, 384), device=DEV)
                g = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    a @ a.T  # warm-up outside capture
                torch.cuda.current_stream().wait_stream(s)
                with torch.cuda.graph(g):
                    b = a @ a.T
                g.replay()
                torch.cuda.synchronize()
                del b
            same, before, after = pooled()
            assert same, phase
            figures[phase] = {"new_segments": after[0] - before[0], "alloc_retries": after[1] - before[1],
                              "ooms": after[2] - before[2]}
            assert after == before, (phase, before, after)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        del blocks
        torch.cuda.empty_cache()
    figures["served"] = pool.served
    figures["reserved_bytes"] = pool.reserved_bytes
    _report("sparse_prefill_pool", figures)


def test_pool_refuses_a_call_larger_than_the_reservation_naming_both_sizes():
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd as stock

    from dspark_harden.dsv4_memory.pool import SparsePrefillPool, SparsePrefillPoolError

    pool = SparsePrefillPool(tokens=1024, heads=64, d_v=512, device=torch.device(DEV)).reserve()
    q, kv, idx, lens, _ = _sparse_inputs(1025, 64)
    with pytest.raises(SparsePrefillPoolError, match="1025 tokens x 64 heads x d_v 512 does not fit the reserved 1024"):
        pool.run(stock, q, kv, idx, HEAD_DIM ** -0.5, d_v=512, topk_length=lens)
    q, kv, idx, lens, _ = _sparse_inputs(512, 64)
    half = pool.run(stock, q, kv, idx, HEAD_DIM ** -0.5, d_v=512, topk_length=lens)
    again = pool.run(stock, q, kv, idx, HEAD_DIM ** -0.5, d_v=512, topk_length=lens)  # the other half of the block
    del half, again
    q, kv, idx, lens, _ = _sparse_inputs(1024, 64)
    first = pool.run(stock, q, kv, idx, HEAD_DIM ** -0.5, d_v=512, topk_length=lens)  # kept alive: fills the slot
    with pytest.raises(SparsePrefillPoolError, match="did not come from the reservation"):
        pool.run(stock, q, kv, idx, HEAD_DIM ** -0.5, d_v=512, topk_length=lens)
    del first
    assert pool.refused == 2 and pool.served == 3


# --- (c) planner guards --------------------------------------------------------------------------


def _plan_inputs(rng, *, gpu_lens: bool):
    b = rng.randint(1, 16)
    rows, cols, n_full = b + rng.randint(0, 8), 2048, 1 << 16
    seq = [rng.randint(1, cols) for _ in range(b)]
    ext = [rng.randint(1, s) for s in seq]
    if gpu_lens:  # the GPU-input path (MTP / graph capture) has short uniform or general extends
        ext = [min(e, 64) for e in ext]
    ratio = rng.choice([4, 128])
    lens_dev = DEV if gpu_lens else "cpu"
    return dict(compress_ratio=ratio,
                req_pool_indices=torch.tensor(rng.sample(range(rows), b), dtype=torch.int64, device=DEV),
                seq_lens=torch.tensor(seq, dtype=torch.int64, device=lens_dev),
                extend_lens=torch.tensor(ext, dtype=torch.int64, device=lens_dev),
                req_to_token=torch.randint(0, n_full, (rows, cols), dtype=torch.int32, device=DEV),
                full_to_state=torch.randperm(n_full, device=DEV),
                swa_page_size=256, ring_size=128 if ratio == 4 else 256, num_q_tokens=sum(ext))


def _gen_args(g):
    return [g[k] for k in ("compress_ratio", "req_pool_indices", "seq_lens", "extend_lens", "req_to_token",
                           "full_to_state", "swa_page_size", "ring_size", "num_q_tokens")]


@pytest.mark.parametrize("gpu_lens", [False, True], ids=["cpu-lens", "gpu-lens"])
def test_planner_guards_pass_valid_plans_bit_for_bit_and_refuse_bad_ones(gpu_lens):
    from sglang.kernels.ops.attention.dsv4.compress import CompressorPrefillPlan

    from dspark_harden.dsv4_memory import planner as PL

    stock = CompressorPrefillPlan.generate
    guarded = PL.unwrap(PL.build_prefill_generate(stock, lambda ok: None))
    rng = random.Random(17 + gpu_lens)
    def rows(t):  # the GPU-input planner appends entries with atomicAdd: their order is not deterministic
        return sorted(bytes(r) for r in t.cpu().numpy()) if gpu_lens else t

    for _ in range(40):
        g = _plan_inputs(rng, gpu_lens=gpu_lens)
        a = stock(*_gen_args(g))
        b = guarded(*_gen_args(g))
        torch.cuda.synchronize()
        for x, y in ((a.plan_c, b.plan_c), (a.plan_w, b.plan_w)):
            assert x.shape == y.shape and (rows(x) == rows(y) if gpu_lens else torch.equal(x, y))
    g = _plan_inputs(rng, gpu_lens=gpu_lens)
    g["compress_ratio"], g["ring_size"] = 4, 128
    bad = {
        "more than num_q_tokens": dict(num_q_tokens=g["num_q_tokens"] - 1),
        "outside req_to_token's": dict(req_pool_indices=g["req_pool_indices"] + 4096),
        "outside full_to_state": dict(full_to_state=g["full_to_state"][:16]),
    }
    for frag, change in bad.items():
        with pytest.raises(PL.PlannerBoundsError, match=frag):
            guarded(*_gen_args({**g, **change}))
    # overhead per call: median of alternating blocks, guarded vs stock
    times = {"stock": [], "guarded": []}
    for _ in range(5):
        for name, fn in (("stock", stock), ("guarded", guarded)):
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(*_gen_args(g))
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
    med = {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}
    _report(f"planner_generate_us_{'gpu' if gpu_lens else 'cpu'}_lens", med)


def test_decode_planner_guard():
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan

    from dspark_harden.dsv4_memory import planner as PL

    stock = CompressorDecodePlan.generate
    guarded = PL.unwrap(PL.build_decode_generate(stock, lambda ok: None))
    rng = random.Random(3)
    g = _plan_inputs(rng, gpu_lens=True)
    args = [4, g["req_pool_indices"], g["req_to_token"], g["full_to_state"], g["seq_lens"], 256, 128]
    a, b = stock(*args), guarded(*args)
    assert torch.equal(a.plan_d, b.plan_d)
    args[4] = g["seq_lens"] + 4096
    with pytest.raises(PL.PlannerBoundsError, match="columns"):
        guarded(*args)
