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


# the sampled shapes (9 of them, not every shape): up to DSV4's prefill chunk of 16,384 tokens x 128 heads
SHAPES = [(1, 64), (7, 64), (128, 128), (1024, 64), (4096, 64), (4096, 128), (8192, 128), (16384, 64), (16384, 128)]


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("eps", [1e-6, None], ids=["norm", "no-norm"])
@pytest.mark.parametrize("tokens,heads", SHAPES)
def test_fused_q_norm_rope_in_place_is_bit_identical(freqs, tokens, heads, eps, pos_dtype):
    fn = _norm_rope()
    torch.manual_seed(tokens * 131 + heads)
    q = torch.randn((tokens, heads, HEAD_DIM), dtype=torch.bfloat16, device=DEV)
    pos = torch.randint(0, MAX_POS, (tokens,), device=DEV, dtype=pos_dtype)
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
    w = torch.randn((q_lora, heads * HEAD_DIM), dtype=torch.bfloat16, device=DEV) / q_lora**0.5
    return SimpleNamespace(
        wq_b=lambda x: (x @ w, None),
        n_local_heads=heads,
        head_dim=HEAD_DIM,
        use_mega_attention=False,
        q_head_norm=True,
        eps=1e-6,
        freqs_cis=freqs,
    )


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
    ours(
        layer,
        torch.randn((16, 1024), dtype=torch.bfloat16, device=DEV),
        torch.zeros(16, dtype=torch.int64, device=DEV),
        fp8_out,
    )
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


@pytest.mark.parametrize("tokens", [8192, 16384])
def test_reserved_pool_serves_what_a_fragmented_default_pool_cannot(tokens):
    import flash_mla
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd as stock

    from dspark_harden.dsv4_memory.pool import SparsePrefillPool, caller_owned_output_supported

    assert not caller_owned_output_supported(flash_mla.flash_mla_sparse_fwd)  # 1.0.0: allocating API only
    heads = 128
    q, kv, idx, lens, sink = _sparse_inputs(tokens, heads)
    kwargs = dict(d_v=512, attn_sink=sink, topk_length=lens)
    ref = [t.clone() for t in stock(q, kv, idx, HEAD_DIM**-0.5, **kwargs)]
    pool = SparsePrefillPool(tokens=tokens, heads=heads, d_v=512, device=torch.device(DEV)).reserve()
    # out bf16 [tokens, 128, 512] + max_logits and lse fp32 [tokens, 128]: 1 GiB + 8 MiB at 8k, 2 GiB + 16 MiB at 16k
    assert pool.reserved_bytes == (tokens // 8192) * ((1 << 30) + 8 * (1 << 20))

    def pooled():
        """(outputs identical to the unreserved call, allocator counters before and after the call alone:
        the comparison itself allocates, so it runs outside the measured window)"""
        torch.cuda.synchronize()
        before = _segments()
        out = pool.run(stock, q, kv, idx, HEAD_DIM**-0.5, **kwargs)
        torch.cuda.synchronize()
        after = _segments()
        # compared in 512-token slices: a whole-tensor torch.equal needs a temporary larger than the slack
        # the memory-fraction cap leaves in the fragmented phases
        same = all(torch.equal(a[i : i + 512], b[i : i + 512]) for a, b in zip(out, ref) for i in range(0, tokens, 512))
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
            torch.empty((tokens, heads, 512), dtype=torch.bfloat16, device=DEV)  # a fresh 1 or 2 GiB block
        seg1, retry1, oom1 = _segments()
        figures["default_pool_fresh_output_block"] = {"oom": oom1 - oom0, "alloc_retries": retry1 - retry0}
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
            figures[phase] = {
                "new_segments": after[0] - before[0],
                "alloc_retries": after[1] - before[1],
                "ooms": after[2] - before[2],
            }
            assert after == before, (phase, before, after)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        del blocks
        torch.cuda.empty_cache()
    figures["served"] = pool.served
    figures["reserved_bytes"] = pool.reserved_bytes
    _report(f"sparse_prefill_pool_{tokens}x128", figures)


def test_pool_refuses_a_call_larger_than_the_reservation_naming_both_sizes():
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd as stock

    from dspark_harden.dsv4_memory.pool import SparsePrefillPool, SparsePrefillPoolError

    pool = SparsePrefillPool(tokens=1024, heads=64, d_v=512, device=torch.device(DEV)).reserve()
    q, kv, idx, lens, _ = _sparse_inputs(1025, 64)
    with pytest.raises(SparsePrefillPoolError, match="1025 tokens x 64 heads x d_v 512 does not fit the reserved 1024"):
        pool.run(stock, q, kv, idx, HEAD_DIM**-0.5, d_v=512, topk_length=lens)
    q, kv, idx, lens, _ = _sparse_inputs(512, 64)
    half = pool.run(stock, q, kv, idx, HEAD_DIM**-0.5, d_v=512, topk_length=lens)
    again = pool.run(stock, q, kv, idx, HEAD_DIM**-0.5, d_v=512, topk_length=lens)  # the other half of the block
    del half, again
    q, kv, idx, lens, _ = _sparse_inputs(1024, 64)
    first = pool.run(stock, q, kv, idx, HEAD_DIM**-0.5, d_v=512, topk_length=lens)  # kept alive: fills the slot
    with pytest.raises(SparsePrefillPoolError, match="did not come from the reservation"):
        pool.run(stock, q, kv, idx, HEAD_DIM**-0.5, d_v=512, topk_length=lens)
    del first
    assert pool.refused == 2 and pool.served == 3


def test_pool_serves_calls_on_another_stream_than_its_reservation_and_orders_block_reuse():
    """SGLang's overlap scheduler runs the forward on its own ``forward_stream`` while the reservation
    is made at backend init: the caching allocator never hands a block cached on one stream to an
    allocation on another. Calls from a side stream are served from the reservation (run on its
    stream, ordered both ways), bit-identical; a consumer queued on the side stream behind a long
    kernel still reads the earlier output after the next call reused its block."""
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd as stock

    from dspark_harden.dsv4_memory.pool import SparsePrefillPool

    tokens, heads = 4096, 128
    scale = HEAD_DIM**-0.5
    pool = SparsePrefillPool(tokens=tokens, heads=heads, d_v=512, device=torch.device(DEV)).reserve()
    side = torch.cuda.Stream()
    seen, refs = [], []
    for i in range(3):
        q, kv, idx, lens, sink = _sparse_inputs(tokens, heads)
        q.mul_(1 + 0.5 * i)  # each call's output differs from the previous one's
        kw = dict(d_v=512, attn_sink=sink, topk_length=lens)
        refs.append(stock(q, kv, idx, scale, **kw)[0][:64].clone())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = pool.run(stock, q, kv, idx, scale, **kw)
            torch.cuda._sleep(20_000_000)  # the consumer is late on the side stream ...
            seen.append(out[0][:64].clone())  # ... and reads this output after it
            del out  # the next call reuses the block: its kernels must wait for this consumer
    torch.cuda.synchronize()
    assert pool.cross_stream == 3 and pool.served == 3 and pool.refused == 0
    assert all(torch.equal(a, b) for a, b in zip(seen, refs))
    assert not torch.equal(refs[0], refs[1])
    _report("pool_cross_stream", {"served": pool.served, "cross_stream": pool.cross_stream})


_CAPTURE_PROBE = r"""
import json, torch
from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd as stock
from dspark_harden.dsv4_memory.pool import SparsePrefillPool
torch.manual_seed(11)
T, H, D = 4096, 128, 512
q = torch.randn((T, H, D), dtype=torch.bfloat16, device="cuda")
kv = torch.randn((4096, 1, D), dtype=torch.bfloat16, device="cuda")
idx = torch.randint(0, 4096, (T, 1, 256), dtype=torch.int32, device="cuda")
lens = torch.randint(1, 257, (T,), dtype=torch.int32, device="cuda")
kw = dict(d_v=D, topk_length=lens)
ref = [t.clone() for t in stock(q, kv, idx, D ** -0.5, **kw)]
pool = SparsePrefillPool(tokens=T, heads=H, d_v=D, device=torch.device("cuda")).reserve()
res = {}
try:
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        stock(q, kv, idx, D ** -0.5, **kw)
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    with torch.cuda.graph(g):
        with torch.cuda.use_mem_pool(pool.pool):  # the pool as it was before the capture rule
            out = stock(q, kv, idx, D ** -0.5, **kw)
    g.replay(); torch.cuda.synchronize()
    res["captured"] = True
    res["outputs_inside_our_pool"] = [pool._inside(t) for t in out]
    res["replay_equals_eager"] = all(torch.equal(a, b) for a, b in zip(out, ref))
except Exception as exc:
    res["captured"] = False
    res["error"] = f"{type(exc).__name__}: {exc}"[:400]
print("PROBE " + json.dumps(res))
"""


def test_which_pool_wins_when_a_captured_call_runs_inside_use_mem_pool():
    """The finding behind the capture rule (run in a child process: a failed capture can leave the
    CUDA context unusable): capture stock's call inside ``use_mem_pool(our pool)`` and report where
    its outputs landed."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _CAPTURE_PROBE], capture_output=True, text=True, timeout=300, env=os.environ.copy()
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")]
    assert lines, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    probe = json.loads(lines[-1][6:])
    _report("capture_inside_use_mem_pool", probe)
    assert "captured" in probe


def test_pool_leaves_captured_calls_to_the_graph_pool_and_no_eager_output_aliases_a_captured_one():
    """A prefill-sized call (4,096 tokens x 128 heads) captured through the pool's ``run`` goes to stock
    (counted ``captured``), so its outputs live in the graph's private pool: they overlap no reserved
    block and no later eager (pool-served) output; a replay after an eager call leaves the eager
    outputs untouched and reproduces the eager reference bit for bit."""
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd as stock

    from dspark_harden.dsv4_memory.pool import SparsePrefillPool

    tokens, heads = 4096, 128
    q, kv, idx, lens, sink = _sparse_inputs(tokens, heads)
    kw = dict(d_v=512, attn_sink=sink, topk_length=lens)
    scale = HEAD_DIM**-0.5
    ref = [t.clone() for t in stock(q, kv, idx, scale, **kw)]
    pool = SparsePrefillPool(tokens=tokens, heads=heads, d_v=512, device=torch.device(DEV)).reserve()

    def ranges(ts):
        return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts]

    def overlap(a, b):
        return any(lo < hi2 and lo2 < hi for lo, hi in a for lo2, hi2 in b)

    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        warm = pool.run(stock, q, kv, idx, scale, **kw)  # eager warm-up, served from the pool
        del warm
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    served = pool.served
    with torch.cuda.graph(g):
        cap = pool.run(stock, q, kv, idx, scale, **kw)
    assert pool.captured == 1 and pool.served == served
    g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(cap, ref))
    cap_ranges = ranges(cap)
    assert not overlap(cap_ranges, pool.ranges), "a captured output sits in a reserved block"
    torch.manual_seed(99)
    q2 = torch.randn_like(q)
    eager = pool.run(stock, q2, kv, idx, scale, **kw)
    eager_ref = [t.clone() for t in eager]
    assert pool.served == served + 1
    assert not overlap(ranges(eager), cap_ranges), "an eager output aliases a captured one"
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, eager_ref)), "a replay wrote into an eager output"
    assert all(torch.equal(a, b) for a, b in zip(cap, ref))
    _report(
        "pool_under_capture",
        {
            "captured": pool.captured,
            "served": pool.served,
            "tokens": tokens,
            "heads": heads,
            "captured_outputs_in_reservation": False,
        },
    )


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
    return dict(
        compress_ratio=ratio,
        req_pool_indices=torch.tensor(rng.sample(range(rows), b), dtype=torch.int64, device=DEV),
        seq_lens=torch.tensor(seq, dtype=torch.int64, device=lens_dev),
        extend_lens=torch.tensor(ext, dtype=torch.int64, device=lens_dev),
        req_to_token=torch.randint(0, n_full, (rows, cols), dtype=torch.int32, device=DEV),
        full_to_state=torch.randperm(n_full, device=DEV),
        swa_page_size=256,
        ring_size=128 if ratio == 4 else 256,
        num_q_tokens=sum(ext),
    )


def _gen_args(g):
    return [
        g[k]
        for k in (
            "compress_ratio",
            "req_pool_indices",
            "seq_lens",
            "extend_lens",
            "req_to_token",
            "full_to_state",
            "swa_page_size",
            "ring_size",
            "num_q_tokens",
        )
    ]


def _sorted_rows(t):
    """The GPU-input planner appends entries with atomicAdd: their order is not deterministic."""
    return sorted(bytes(r) for r in t.cpu().numpy())


def _same_prefill_plan(a, b, gpu_lens):
    for x, y in ((a.plan_c, b.plan_c), (a.plan_w, b.plan_w)):
        if x.shape != y.shape or not (_sorted_rows(x) == _sorted_rows(y) if gpu_lens else torch.equal(x, y)):
            return False
    return True


@pytest.mark.parametrize("gpu_lens", [False, True], ids=["cpu-lens", "gpu-lens"])
def test_planner_guards_pass_valid_plans_bit_for_bit_and_refuse_bad_ones(gpu_lens):
    """The wrapped ``CompressorPrefillPlan.generate`` (device-side guarded planner, guarded_c_plan.cuh via
    SGLang's JIT) against the real stock one: 40 random valid geometries (b 1..16, 2048 int32 columns, c4
    and c128, host or device int64 lengths) give stock's plan (byte-identical with host lengths, the same
    multiset of entries with device lengths) and publish no violation; crafted violations are refused on
    the host before launch where the host can see them (host lengths; the sync mode) and otherwise reported
    by the device guard naming the reason; per-call time stock / device guard / sync mode."""
    from sglang.kernels.ops.attention.dsv4.compress import CompressorPrefillPlan

    from dspark_harden.dsv4_memory import planner as PL
    from dspark_harden.dsv4_memory import planner_device as PD

    stock = CompressorPrefillPlan.generate
    guarded = PL.unwrap(PL.build_prefill_generate(stock, lambda ok: None))
    synced = PL.unwrap(PL.build_prefill_generate(stock, lambda ok: None, sync_checks=True))
    PD.ensure_state()
    PD.check()
    rng = random.Random(17 + gpu_lens)
    for i in range(40):
        g = _plan_inputs(rng, gpu_lens=gpu_lens)
        if gpu_lens and i % 4 == 0:  # zero-length entries (padding / sentinels): legal on the GPU path
            ext = g["extend_lens"].clone()
            ext[::3] = 0
            if int(ext.sum()) == 0:
                ext[-1] = 1
            g["extend_lens"], g["num_q_tokens"] = ext, max(int(ext.sum()), len(ext))
        a = stock(*_gen_args(g))
        b = guarded(*_gen_args(g))
        torch.cuda.synchronize()
        assert _same_prefill_plan(a, b, gpu_lens), i
        PD.check()  # nothing published for a valid plan
    g = _plan_inputs(rng, gpu_lens=gpu_lens)
    g["compress_ratio"], g["ring_size"] = 4, 128
    bad = {  # change -> (host message, device message)
        "num_q": (
            dict(num_q_tokens=g["num_q_tokens"] - 1),
            "more than num_q_tokens",
            "adding up to more than num_q_tokens",
        ),
        "rid": (dict(req_pool_indices=g["req_pool_indices"] + 4096), "outside req_to_token's", "req_to_token read"),
        "f2s": (dict(full_to_state=g["full_to_state"][:16]), "outside full_to_state", "full_to_state read"),
    }
    seen = {}
    for name, (change, host_msg, device_msg) in bad.items():
        with pytest.raises(PL.PlannerBoundsError, match=host_msg):
            synced(*_gen_args({**g, **change}))
        if not gpu_lens and name == "num_q":  # host lengths: refused on the host without a sync
            with pytest.raises(PL.PlannerBoundsError, match="refused before launch.*" + host_msg):
                guarded(*_gen_args({**g, **change}))
            continue
        guarded(*_gen_args({**g, **change}))  # launched: clamped / planned empty on the device
        with pytest.raises(PL.PlannerBoundsError, match="device-side guard.*" + device_msg):
            PD.check()
        seen[name] = device_msg
    if gpu_lens:  # a batch over num_q_tokens is planned empty: nothing appended past the buffers
        over = guarded(*_gen_args({**g, "num_q_tokens": g["num_q_tokens"] - 1}))
        torch.cuda.synchronize()
        assert bool((over.plan_c.view(torch.int32)[:, 0] == -1).all()), "an over-full batch planned entries"
        with pytest.raises(PL.PlannerBoundsError):
            PD.check()
    # overhead per call: median of alternating blocks
    times = {"stock": [], "guarded": [], "sync_mode": []}
    for _ in range(5):
        for name, fn in (("stock", stock), ("guarded", guarded), ("sync_mode", synced)):
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(*_gen_args(g))
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
    PD.check()
    med = {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}
    _report(f"planner_generate_us_{'gpu' if gpu_lens else 'cpu'}_lens", dict(med, device_reported=sorted(seen)))


def test_decode_planner_guard():
    """The wrapped ``CompressorDecodePlan.generate``: the stock plan for valid input; a sequence past the
    columns is reported by the device guard after the launch (no sync in the call), refused before the
    launch in the sync mode."""
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan

    from dspark_harden.dsv4_memory import planner as PL
    from dspark_harden.dsv4_memory import planner_device as PD

    stock = CompressorDecodePlan.generate
    guarded = PL.unwrap(PL.build_decode_generate(stock, lambda ok: None))
    synced = PL.unwrap(PL.build_decode_generate(stock, lambda ok: None, sync_checks=True))
    PD.ensure_state()
    PD.check()
    rng = random.Random(3)
    g = _plan_inputs(rng, gpu_lens=True)
    args = [4, g["req_pool_indices"], g["req_to_token"], g["full_to_state"], g["seq_lens"], 256, 128]
    a, b = stock(*args), guarded(*args)
    assert torch.equal(a.plan_d, b.plan_d)
    PD.check()
    args[4] = g["seq_lens"] + g["req_to_token"].numel()  # past the whole allocation
    with pytest.raises(PL.PlannerBoundsError, match="refused before launch.*columns"):
        synced(*args)
    guarded(*args)
    with pytest.raises(PL.PlannerBoundsError, match="req_to_token read outside its allocation"):
        PD.check()


def test_guarded_plans_do_not_synchronize_and_the_report_needs_no_sync():
    """With 50 ms of GPU work queued ahead (``torch.cuda._sleep``), a guarded eager decode plan and a
    guarded GPU-input prefill plan return while that work is still running (an event recorded before
    them is not complete), and so does the sync mode's negative control only after it finished; a bad
    plan's report reaches the host without any sync: ``check_pending`` (a host memory read) raises
    within 2 s of polling after the GPU drains."""
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan, CompressorPrefillPlan

    from dspark_harden.dsv4_memory import planner as PL
    from dspark_harden.dsv4_memory import planner_device as PD

    PD.ensure_state()
    PD.check()
    rng = random.Random(5)
    g = _plan_inputs(rng, gpu_lens=True)
    dargs = [4, g["req_pool_indices"], g["req_to_token"], g["full_to_state"], g["seq_lens"], 256, 128]
    gargs = _gen_args({**g, "compress_ratio": 4, "ring_size": 128})
    dec = PL.unwrap(PL.build_decode_generate(CompressorDecodePlan.generate, lambda ok: None))
    pre = PL.unwrap(PL.build_prefill_generate(CompressorPrefillPlan.generate, lambda ok: None))
    dec_sync = PL.unwrap(PL.build_decode_generate(CompressorDecodePlan.generate, lambda ok: None, sync_checks=True))
    dec(*dargs), pre(*gargs)  # JIT and allocator warm
    torch.cuda.synchronize()
    cycles = 50_000_000  # ~25-50 ms on an H200

    def returns_before_the_gpu(fn, args):
        ahead = torch.cuda.Event()
        torch.cuda._sleep(cycles)
        ahead.record()
        fn(*args)
        busy = not ahead.query()
        torch.cuda.synchronize()
        return busy

    assert returns_before_the_gpu(dec, dargs), "the guarded decode plan waited for the GPU"
    assert returns_before_the_gpu(pre, gargs), "the guarded prefill plan waited for the GPU"
    assert not returns_before_the_gpu(dec_sync, dargs), "negative control: the sync mode must wait"
    bad = list(dargs)
    bad[4] = g["seq_lens"] + g["req_to_token"].numel()  # past the whole allocation
    torch.cuda._sleep(cycles)
    dec(*bad)
    t0 = time.perf_counter()
    with pytest.raises(PL.PlannerBoundsError, match="req_to_token read outside its allocation"):
        while time.perf_counter() - t0 < 2.0:
            PD.check_pending()
            time.sleep(0.001)
    waited = time.perf_counter() - t0
    _report("guard_report_without_sync", {"seconds_until_reported": round(waited, 4)})


def test_device_guarded_prefill_plan_captured_and_replayed():
    """The GPU-input prefill plan (the prefill-graph path) captured through the wrapper in a CUDA graph
    with static inputs (b=32, 2048 int32 columns, num_q bucket 1024, c4): replayed with new valid
    lengths, underfilled buckets and zero-length entries it equals the stock plan computed eagerly on the
    same inputs (multiset of entries) with nothing reported; replays with lengths past the bucket, an
    extend longer than its sequence, a request row past req_to_token or locations past full_to_state are
    reported after the replay naming the reason, and the over-full replay planned no entry."""
    from sglang.kernels.ops.attention.dsv4.compress import CompressorPrefillPlan

    from dspark_harden.dsv4_memory import planner as PL
    from dspark_harden.dsv4_memory import planner_device as PD

    stock = CompressorPrefillPlan.generate
    guarded = PL.unwrap(PL.build_prefill_generate(stock, lambda ok: None))
    PD.ensure_state()
    PD.check()
    rng = random.Random(77)
    b, rows, cols, n_full, bucket = 32, 48, 2048, 1 << 16, 1024
    s_rid = torch.zeros(b, dtype=torch.int64, device=DEV)
    s_seq = torch.ones(b, dtype=torch.int64, device=DEV)
    s_ext = torch.ones(b, dtype=torch.int64, device=DEV)
    s_r2t = torch.zeros((rows, cols), dtype=torch.int32, device=DEV)
    s_f2s = torch.zeros(n_full, dtype=torch.int64, device=DEV)

    def fill(total=None, zeros=False):
        s_rid.copy_(torch.tensor(rng.sample(range(rows), b), dtype=torch.int64))
        s_r2t.copy_(torch.randint(0, n_full, (rows, cols), dtype=torch.int32))
        s_f2s.copy_(torch.randperm(n_full))
        total = total or rng.randint(b, bucket)
        ext = [1] * b
        for _ in range(total - b):
            ext[rng.randrange(b)] += 1
        if zeros:
            for j in range(0, b, 5):
                ext[j] = 0
        seq = [e + rng.randint(0, cols - 1 - e) for e in ext]
        s_ext.copy_(torch.tensor(ext, dtype=torch.int64))
        s_seq.copy_(torch.tensor(seq, dtype=torch.int64))

    def args():
        return [4, s_rid, s_seq, s_ext, s_r2t, s_f2s, 256, 128, bucket, True]

    fill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        guarded(*args())
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = guarded(*args())
    for k in range(8):
        fill(total=bucket if k == 0 else None, zeros=k % 3 == 2)
        graph.replay()
        torch.cuda.synchronize()
        assert _same_prefill_plan(captured, stock(*args()), True), k
        PD.check()
    cases = []
    fill(total=bucket)
    s_ext[0] += 5  # 5 tokens past the bucket
    s_seq[0] += 5
    graph.replay()
    torch.cuda.synchronize()
    assert bool((captured.plan_c.view(torch.int32)[:, 0] == -1).all()), "over-full replay planned entries"
    assert bool((captured.plan_w.view(torch.int32)[:, 0] == -1).all())
    with pytest.raises(PL.PlannerBoundsError, match="adding up to more than num_q_tokens"):
        PD.check()
    cases.append("num_q")
    fill()
    s_ext[1] = s_seq[1] + 3
    graph.replay()
    with pytest.raises(PL.PlannerBoundsError, match="extend length < 0 or larger than its sequence"):
        PD.check()
    cases.append("lens")
    fill()
    s_rid[2] = rows + 100
    graph.replay()
    with pytest.raises(PL.PlannerBoundsError, match="req_to_token read outside its allocation"):
        PD.check()
    cases.append("r2t")
    fill()
    s_r2t[int(s_rid[3])].fill_(n_full + 9)
    graph.replay()
    with pytest.raises(PL.PlannerBoundsError, match="full_to_state read outside its allocation"):
        PD.check()
    cases.append("f2s")
    fill()
    graph.replay()
    PD.check()
    _report("device_guarded_prefill_replay", {"valid_replays": 8, "caught": cases})


def test_metadata_report_wrapper_fails_the_next_step_after_a_bad_replay():
    """``build_metadata_report`` around a stand-in forward-metadata builder (the real DSV4 backend needs the
    model): after a replayed decode plan read past ``req_to_token``, the next build raises naming the
    reason (after the GPU drained; no sync in the wrapper) and the stand-in is not called; the build after
    that passes."""
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan

    from dspark_harden.dsv4_memory import planner as PL
    from dspark_harden.dsv4_memory import planner_device as PD

    built = []
    build = PL.build_metadata_report(lambda self, fb, in_capture=False: built.append(fb))
    build(None, "warm")
    PD.check()
    dec = PL.unwrap(PL.build_decode_generate(CompressorDecodePlan.generate, lambda ok: None))
    g = _plan_inputs(random.Random(9), gpu_lens=True)
    s_seq = g["seq_lens"].clone()
    dargs = [4, g["req_pool_indices"], g["req_to_token"], g["full_to_state"], s_seq, 256, 128]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dec(*dargs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec(*dargs)
    graph.replay()
    torch.cuda.synchronize()
    build(None, "step-1")
    s_seq[0] = g["req_to_token"].shape[1] * 4096  # past the allocation
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(PL.PlannerBoundsError, match="req_to_token read outside its allocation"):
        build(None, "step-2")
    build(None, "step-3")
    assert built == ["warm", "step-1", "step-3"]


def _peak_and_time(fn, args, reps=20):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return peak, statistics.median(times) * 1e6


def test_planner_guards_at_production_shapes_bounded_temporaries():
    """b=256 with a 256 x 131,072 int32 ``req_to_token`` (128 MiB) and 4M full locations: the decode
    plan (c4, GPU lengths) and a prefill plan (c4, 64 requests, host lengths, 1..256-token extends at
    contexts up to 131,072). Plans bit-identical to stock; the extra peak (``max_memory_allocated``
    above the stock call's) of the device guard and of the sync mode stays O(num_q_tokens + batch), far
    below one batch x columns int64 temporary (256 MiB here); time per call stock / device guard /
    sync mode reported."""
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan, CompressorPrefillPlan

    from dspark_harden.dsv4_memory import planner as PL
    from dspark_harden.dsv4_memory import planner_device as PD

    PD.ensure_state()
    rng = random.Random(256)
    b, cols, n_full = 256, 131072, 1 << 22
    r2t = torch.randint(0, n_full, (b, cols), dtype=torch.int32, device=DEV)
    f2s = torch.randperm(n_full, device=DEV)
    rid = torch.tensor(rng.sample(range(b), b), dtype=torch.int64, device=DEV)
    seq = torch.tensor([rng.randint(1, cols) for _ in range(b)], dtype=torch.int64, device=DEV)
    figures = {}
    pb = 64
    pseq = [rng.randint(256, cols) for _ in range(pb)]
    pext = [rng.randint(1, 256) for _ in range(pb)]
    n = sum(pext)
    cases = {
        "decode_b256": (CompressorDecodePlan.generate, PL.build_decode_generate, [4, rid, r2t, f2s, seq, 256, 128]),
        "prefill_b64": (
            CompressorPrefillPlan.generate,
            PL.build_prefill_generate,
            [4, rid[:pb], torch.tensor(pseq), torch.tensor(pext), r2t, f2s, 256, 128, n],
        ),
    }
    for name, (stock, builder, args) in cases.items():
        guard = PL.unwrap(builder(stock, lambda ok: None))
        sync = PL.unwrap(builder(stock, lambda ok: None, sync_checks=True))
        a, g = stock(*args), guard(*args)
        torch.cuda.synchronize()
        for attr in ("plan_d",) if name.startswith("decode") else ("plan_c", "plan_w"):
            assert torch.equal(getattr(a, attr), getattr(g, attr)), (name, attr)
        ps, ts = _peak_and_time(stock, args)
        pg, tg = _peak_and_time(guard, args)
        py, ty = _peak_and_time(sync, args)
        figures[name] = {
            "stock_peak_bytes": ps,
            "guard_peak_bytes": pg,
            "sync_mode_peak_bytes": py,
            "stock_us": round(ts, 1),
            "guard_us": round(tg, 1),
            "sync_mode_us": round(ty, 1),
        }
        bound = (1 << 20) if name.startswith("decode") else 64 * (n + 4 * pb) * 8 + (1 << 20)
        assert max(pg, py) - ps <= bound, figures
    PD.check()
    _report("planner_guards_production_shapes", figures)


# --- (d) Q8KV8 sparse prefill (SM90; the H200's own prefill path) ----------------------------------


def _q8_inputs(tokens, heads=128, s_kv=4096, topk=512):
    g = torch.Generator(device=DEV).manual_seed(23)
    q = (torch.randn((tokens, heads, HEAD_DIM), device=DEV, generator=g) * 0.5).to(torch.float8_e4m3fn)
    kv = (torch.randn((s_kv + 1, 1, HEAD_DIM), device=DEV, generator=g) * 0.5).to(torch.float8_e4m3fn)
    idx = torch.randint(0, s_kv + 1, (tokens, 1, topk), dtype=torch.int32, device=DEV, generator=g)
    lens = torch.randint(1, topk + 1, (tokens,), dtype=torch.int32, device=DEV, generator=g)
    sink = torch.randn((heads,), dtype=torch.float32, device=DEV, generator=g)
    one = torch.ones((), dtype=torch.float32, device=DEV)
    return (q, kv, idx, HEAD_DIM**-0.5, one, one), dict(d_v=512, attn_sink=sink, topk_length=lens)


@pytest.mark.parametrize("tokens", [8192, 16384])
def test_q8kv8_prefill_from_the_reservation_is_bit_identical_and_allocates_nothing(tokens):
    """The real SM90 Q8KV8 kernel (sglang/kernels/ops/attention/sparse_mla_q8kv8_prefill_sm90.py, JIT):
    fp8 q [tokens, 128, 512], kv [4097, 1, 512], top-k 512 int32, sink and lengths; outputs from the
    reservation's slices equal the allocating call bit for bit, and in a default pool fragmented so that
    a fresh output block OOMs the reserved call makes 0 new segments, 0 retries, 0 OOMs. Oversize and
    held-slot calls are refused naming both sizes."""
    from sglang.kernels.ops.attention.sparse_mla_q8kv8_prefill_sm90 import sparse_mla_q8kv8_prefill_fwd as stock

    from dspark_harden.dsv4_memory.pool import Q8KV8Reservation, SparsePrefillPoolError

    args, kw = _q8_inputs(tokens)
    ref = [t.clone() for t in stock(*args, **kw)]
    torch.cuda.synchronize()
    res = Q8KV8Reservation(tokens=tokens, heads=128, d_v=512, device=torch.device(DEV)).reserve()
    out = res.run(stock, *args, **kw)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert out[0].data_ptr() == res.bufs[0][0].data_ptr()
    held = out[0][:, :100]  # what the backend returns (o[:, :active_heads]) holds the slot
    del out
    with pytest.raises(SparsePrefillPoolError, match="still held by earlier outputs"):
        res.run(stock, *args, **kw)
    del held
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    big = torch.empty(6 << 30, dtype=torch.uint8, device=DEV)
    del big
    blocks = [torch.empty(256 << 20, dtype=torch.uint8, device=DEV) for _ in range(24)]
    del blocks[::2]
    figures = {}
    try:
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + (512 << 20)) / total))
        seg0, retry0, oom0 = _segments()
        # any cached free block that could still hold a fresh output is pinned first, so that the
        # precondition (a fresh output block OOMs) holds by construction, not by luck
        pinned = []
        for _ in range(16):
            try:
                pinned.append(torch.empty((tokens, 128, 512), dtype=torch.bfloat16, device=DEV))
            except torch.OutOfMemoryError:
                break
        else:
            pytest.fail("16 fresh output blocks fit under the cap: the harness did not fragment anything")
        seg1, retry1, oom1 = _segments()
        before = _segments()
        out = res.run(stock, *args, **kw)
        torch.cuda.synchronize()
        after = _segments()
        same = all(torch.equal(a[i : i + 512], b[i : i + 512]) for a, b in zip(out, ref) for i in range(0, tokens, 512))
        del out
        figures = {
            "default_pool_fresh_output_block": {
                "oom": oom1 - oom0,
                "alloc_retries": retry1 - retry0,
                "cached_blocks_pinned_first": len(pinned),
            },
            "reserved_call": {
                "new_segments": after[0] - before[0],
                "alloc_retries": after[1] - before[1],
                "ooms": after[2] - before[2],
            },
            "identical": same,
        }
        assert oom1 - oom0 == 1 and same and after == before, figures
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        del blocks
        pinned = None
        torch.cuda.empty_cache()
    bigger, bkw = _q8_inputs(tokens + 64)
    with pytest.raises(
        SparsePrefillPoolError,
        match=f"{tokens + 64} tokens x 128 heads x d_v 512 does not fit the reserved {tokens} tokens",
    ):
        res.run(stock, *bigger, **bkw)
    figures.update(served=res.served, refused=res.refused, reserved_bytes=res.reserved_bytes)
    assert (res.served, res.refused) == (2, 2)
    _report(f"q8kv8_reservation_{tokens}x128", figures)


# --- (e) device-side guard of the decode planner, eager and under graph replay ---------------------


def test_device_guarded_decode_plan_bit_identical_eager_and_replayed_and_catches_bad_geometry_in_replay():
    """``dsv4_memory/csrc/guarded_c_plan.cuh`` through SGLang's JIT: (1) eager, 40 random geometries
    (b 1..16, 2048 columns, c4 and c128) and b=256 x 131,072 columns, zero-length entries (seq_len 0 on
    rows >= 1: stock reads the previous row's last entry, in bounds) and repeated lengths: plan_d equal
    to stock's bit for bit, flag clear; (2) captured in a CUDA graph with static inputs, replayed with new
    valid inputs: equal to stock eagerly on the same inputs; then out-of-bounds geometry written into the
    static inputs (sequence past the columns of the last row; locations past full_to_state) is caught by
    the flag after the replay, naming the reason; (3) per-plan time stock vs guarded, eager and replayed."""
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan

    from dspark_harden.dsv4_memory import planner_device as PD
    from dspark_harden.dsv4_memory.planner import PlannerBoundsError

    stock = CompressorDecodePlan.generate
    rng = random.Random(41)
    for i in range(42):
        if i < 40:
            g = _plan_inputs(rng, gpu_lens=True)
            ratio = g["compress_ratio"]
            args = [
                ratio,
                g["req_pool_indices"],
                g["req_to_token"],
                g["full_to_state"],
                g["seq_lens"],
                256,
                128 if ratio == 4 else 256,
            ]
        else:
            b, cols, n_full = 256, 131072, 1 << 22
            r2t = torch.randint(0, n_full, (b, cols), dtype=torch.int32, device=DEV)
            seq = torch.tensor([rng.randint(1, cols) for _ in range(b)], dtype=torch.int64, device=DEV)
            if i == 41:  # zero-length entries (not on row 0) and repeated lengths
                seq[1::7] = 0
                seq[2::5] = 4096
            rid = torch.tensor(rng.sample(range(b), b), dtype=torch.int64, device=DEV)
            if i == 41:
                rid[seq == 0] = torch.arange(1, int((seq == 0).sum()) + 1, device=DEV)
            args = [4, rid, r2t, torch.randperm(n_full, device=DEV), seq, 256, 128]
        assert torch.equal(stock(*args).plan_d, PD.generate_decode(*args).plan_d), i
        PD.check()
    # (2) replay
    b, rows, cols, n_full = 64, 80, 4096, 1 << 18
    s_rid = torch.zeros(b, dtype=torch.int64, device=DEV)
    s_r2t = torch.zeros((rows, cols), dtype=torch.int32, device=DEV)
    s_f2s = torch.zeros(n_full, dtype=torch.int64, device=DEV)
    s_seq = torch.ones(b, dtype=torch.int64, device=DEV)

    def fill(valid=True):
        s_rid.copy_(torch.tensor(rng.sample(range(rows), b), dtype=torch.int64))
        s_r2t.copy_(torch.randint(0, n_full, (rows, cols), dtype=torch.int32))
        s_f2s.copy_(torch.randperm(n_full))
        s_seq.copy_(torch.randint(1, cols + 1, (b,), dtype=torch.int64))

    fill()
    gargs = [4, s_rid, s_r2t, s_f2s, s_seq, 256, 128]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        PD.generate_decode(*gargs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = PD.generate_decode(*gargs)
    for _ in range(5):
        fill()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.plan_d, stock(*gargs).plan_d)
        PD.check()
    fill()
    last = int(s_rid.argmax())  # the request on the last row: its sequence runs past the allocation
    s_rid[last] = rows - 1
    s_seq[last] = cols + 10
    graph.replay()
    with pytest.raises(PlannerBoundsError, match="req_to_token read outside its allocation"):
        PD.check()
    PD.check()  # cleared
    fill()
    s_r2t[int(s_rid[3])].fill_(n_full + 7)  # every location of one request past full_to_state
    graph.replay()
    with pytest.raises(PlannerBoundsError, match="full_to_state read outside its allocation"):
        PD.check()
    # (3) time per plan
    times = {"stock_eager": [], "guarded_eager": [], "stock_replay": [], "guarded_replay": []}
    sgraph = torch.cuda.CUDAGraph()
    fill()
    with torch.cuda.stream(side):
        stock(*gargs)
    torch.cuda.synchronize()
    with torch.cuda.graph(sgraph):
        stock(*gargs)
    for _ in range(5):
        for name, fn in (
            ("stock_eager", lambda: stock(*gargs)),
            ("guarded_eager", lambda: PD.generate_decode(*gargs)),
            ("stock_replay", sgraph.replay),
            ("guarded_replay", graph.replay),
        ):
            for _ in range(50):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
    PD.check()
    _report("device_guarded_decode_plan_us", {k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()})
