"""Start-up self-tests of the DSV4 GPU features on the device they run on (issue 41, item 2).

Every GPU result of these features so far is from sm_90 (H100 / H200: ``settings.GPU_RUNS``), while the
kernels they rely on are per-architecture code: FlashMLA's sparse prefill, the JIT-built compress
planner, and ``fused_q_norm_rope``, whose alias safety (what ``dsv4-inplace-q-norm-rope`` rests on) was
read from one kernel source and would fail silently. So each enabled feature proves itself on the actual
device, once per process, in the wrap of ``DeepseekV4AttnBackend.__init__`` (:mod:`.feature`): after the
weights are loaded and the device is set up, before CUDA-graph capture and before the first request.
Each check runs the feature's own code (the same builders / reservation the bound patches use) against
stock SGLang's path on fixed, seeded inputs at the model's geometry:

* ``dsv4-inplace-q-norm-rope``: the in-place ``_compute_q_b`` (:func:`.qnorm.build_compute_q_b`) vs stock
  ``MQALayer._compute_q_b`` (out of place), bit for bit, at a live ``q_head_norm`` layer's heads, head dim,
  ``eps`` and ``freqs_cis`` (:func:`check_qnorm`); the in-place result must alias its input;
* ``dsv4-sparse-prefill-pool``: a pooled sparse-prefill call (the reservation's ``run``), made after the
  reserved blocks were filled with NaN, vs stock's freshly allocating call, all three outputs bit for bit,
  at the reservation's heads and ``d_v`` (:func:`check_pool`; the Q8KV8 reservation likewise);
* ``dsv4-planner-guards``: the guarded decode and prefill plans (host- and device-resident lengths) vs
  stock's, bit for bit (the GPU-input prefill's rows compared as a multiset: stock appends them with
  atomicAdd), at the model's compress ratios, page / ring sizes and index dtypes; then a crafted
  out-of-bounds decode plan and an over-full GPU-input prefill plan must each be caught
  (:func:`check_planner`).

A check that fails raises :class:`SelfTestError` naming the feature, the device, its compute capability,
and whether any GPU suite ever ran on that capability: the scheduler's start-up fails there. Without CUDA,
or for a feature that is not enabled, nothing runs (recorded as ``skipped`` in :data:`RESULTS`). Timings:
each check's ``seconds`` excludes ``load_seconds`` (the first call of each kernel: JIT build / module load,
which the first request would otherwise pay).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from . import settings as S

logger = logging.getLogger("dspark_harden.dsv4_memory")

SWITCHES = {S.POOL_FEATURE: S.POOL, S.QNORM_FEATURE: S.QNORM, S.GUARDS_FEATURE: S.GUARDS}
QNORM_TOKENS = 128  # x the layer's heads x head dim: 128 x 64 x 512 = 8,192 warps, several waves on any GPU
POOL_TOKENS, POOL_TOPK, POOL_KV = 128, 512, 1024  # top-k 512: a multiple of every FlashMLA arch's block


class SelfTestError(RuntimeError):
    pass


@dataclass
class Result:
    feature: str
    status: str  # passed / skipped (failed ones raise)
    device: str
    seconds: float = 0.0
    load_seconds: float = 0.0
    detail: str = ""
    figures: dict = field(default_factory=dict)


RESULTS: list = []  # every self-test of this process, in order
_DONE: set = set()  # (feature, device index, geometry): one run per process
_LOCK = threading.Lock()


def _record(res: Result) -> Result:
    with _LOCK:
        RESULTS.append(res)
    return res


def device_info(device: Any) -> tuple:
    """``(name, "sm_XY" or None, label)`` of ``device`` (a CUDA device, or anything else: no capability)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type, None, f"{dev.type} (no CUDA compute capability)"
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(idx)
    name = torch.cuda.get_device_name(idx)
    cc = f"sm_{major}{minor}"
    return name, cc, f"{name} ({cc}, cuda:{idx})"


def proven_note(cc: Optional[str]) -> str:
    proven = S.proven_ccs()
    runs = ", ".join(f"{c} ({', '.join(cards)})" for c, cards in proven.items()) or "none"
    if cc is None:
        return f"the DSV4 GPU suites have run on {runs}"
    where = "among them" if cc in proven else "never run by any DSV4 GPU suite"
    return f"the DSV4 GPU suites have run on {runs}; {cc} is {where}"


def refusal(feature: str, label: str, cc: Optional[str], problem: str) -> str:
    """The message of a failed self-test (the scheduler's start-up stops with it)."""
    return (
        f"dspark-harden: start-up self-test of feature {feature} failed on {label}: {problem}. "
        f"({proven_note(cc)}.) The feature's kernel path is not proven on this device: set "
        f"{SWITCHES.get(feature, 'its switch')}=0 to run stock SGLang's path, and report the device"
    )


def _fail(feature: str, device: Any, problem: str) -> None:
    _, cc, label = device_info(device)
    raise SelfTestError(refusal(feature, label, cc, problem))


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _bits_equal(a: Any, b: Any) -> bool:
    """Bit for bit (NaN-safe): same shape and dtype, same bytes."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _first_difference(a: Any, b: Any) -> str:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    diff = (a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).reshape(a.shape[0], -1)
    rows = diff.any(dim=1).nonzero().flatten()
    return f"{int(diff.sum())} byte(s) differ, in {rows.numel()} of {a.shape[0]} rows (first row {int(rows[0])})"


def _gen(seed: int):
    import torch

    return torch.Generator(device="cpu").manual_seed(seed)


# --- dsv4-inplace-q-norm-rope ---------------------------------------------------------------------


class _QShim:
    """The attributes ``_compute_q_b`` reads on its ``q_head_norm`` path, taken from a live layer, with an
    identity ``wq_b`` returning a fresh copy of the fixed input (the real projection's output is fresh too),
    so stock and the in-place path see the same bytes. ``last`` is the projection handed out last."""

    def __init__(self, heads: int, head_dim: int, eps: float, freqs_cis: Any) -> None:
        self.n_local_heads, self.head_dim, self.eps, self.freqs_cis = heads, head_dim, eps, freqs_cis
        self.q_head_norm, self.use_mega_attention = True, False
        self.last = None

    def wq_b(self, x):
        self.last = x.clone()
        return self.last, None


def check_qnorm(
    ours: Callable,
    stock: Callable,
    *,
    heads: int,
    head_dim: int,
    eps: float,
    freqs_cis: Any,
    device: Any,
    tokens: int = QNORM_TOKENS,
    seed: int = 0,
) -> Result:
    """``ours`` (the in-place ``_compute_q_b``) vs ``stock`` (``MQALayer._compute_q_b``) on seeded bf16
    inputs of ``tokens x heads x head_dim`` and positions over ``freqs_cis``: bit for bit, the result
    aliasing its projection (the in-place path ran), and different from the input (the kernel ran)."""
    import torch

    feature = S.QNORM_FEATURE
    g = _gen(seed)
    x = torch.randn((tokens, heads * head_dim), generator=g).to(torch.bfloat16).to(device)
    pos = torch.randint(0, int(freqs_cis.shape[0]), (tokens,), generator=g, dtype=torch.int64).to(device)
    shim = _QShim(heads, head_dim, eps, freqs_cis)
    t0 = time.perf_counter()
    stock(shim, x, pos)  # first call: the kernel's JIT module loads here
    _sync(device)
    t1 = time.perf_counter()
    ref = stock(shim, x, pos)
    got = ours(shim, x, pos)
    projection = shim.last
    _sync(device)
    seconds = time.perf_counter() - t1
    if got.data_ptr() != projection.data_ptr():
        _fail(feature, device, "the in-place path did not write its result over its input (it did not run in place)")
    if not _bits_equal(got, ref):
        _fail(
            feature,
            device,
            f"fused_q_norm_rope in place differs from out of place at {tokens} tokens x {heads} heads x "
            f"{head_dim} (eps {eps}): {_first_difference(got, ref)}; input aliased to output is not safe here",
        )
    if _bits_equal(ref, x.view(tokens, heads, head_dim)):
        _fail(feature, device, "the kernel left its input unchanged: the comparison proves nothing")
    return Result(
        feature,
        "passed",
        device_info(device)[2],
        seconds,
        t1 - t0,
        f"in place = out of place bit for bit: {tokens} tokens x {heads} heads x {head_dim}, eps {eps}",
        {"tokens": tokens, "heads": heads, "head_dim": head_dim},
    )


# --- dsv4-sparse-prefill-pool ---------------------------------------------------------------------


def flashmla_inputs(heads: int, d_qk: int, device: Any, *, tokens=POOL_TOKENS, topk=POOL_TOPK, s_kv=POOL_KV, seed=1):
    """``(args, kwargs)`` of a DSV4-shaped ``flash_mla_sparse_fwd`` call (bf16 q / kv, int32 top-k
    indices and lengths, fp32 attention sink), seeded."""
    import torch

    g = _gen(seed)
    q = torch.randn((tokens, heads, d_qk), generator=g).to(torch.bfloat16).to(device)
    kv = torch.randn((s_kv, 1, d_qk), generator=g).to(torch.bfloat16).to(device)
    idx = torch.randint(0, s_kv, (tokens, 1, topk), generator=g, dtype=torch.int32).to(device)
    lens = torch.randint(1, topk + 1, (tokens,), generator=g, dtype=torch.int32).to(device)
    sink = torch.randn((heads,), generator=g, dtype=torch.float32).to(device)
    return (q, kv, idx, d_qk**-0.5), {"attn_sink": sink, "topk_length": lens}


def q8kv8_inputs(heads: int, d_qk: int, device: Any, *, tokens=POOL_TOKENS, topk=POOL_TOPK, s_kv=POOL_KV, seed=1):
    """``(args, kwargs)`` of a ``sparse_mla_q8kv8_prefill_fwd`` call (fp8 q / kv, unit scales), seeded."""
    import torch

    g = _gen(seed)
    q = (torch.randn((tokens, heads, d_qk), generator=g) * 0.5).to(torch.float8_e4m3fn).to(device)
    kv = (torch.randn((s_kv + 1, 1, d_qk), generator=g) * 0.5).to(torch.float8_e4m3fn).to(device)
    idx = torch.randint(0, s_kv + 1, (tokens, 1, topk), generator=g, dtype=torch.int32).to(device)
    lens = torch.randint(1, topk + 1, (tokens,), generator=g, dtype=torch.int32).to(device)
    sink = torch.randn((heads,), generator=g, dtype=torch.float32).to(device)
    one = torch.ones((), dtype=torch.float32).to(device)
    return (q, kv, idx, d_qk**-0.5, one, one), {"attn_sink": sink, "topk_length": lens}


def check_pool(pooled: Callable, stock: Callable, args: tuple, kwargs: dict, *, d_v: int, device: Any) -> Result:
    """``pooled(*args, d_v=, **kwargs)`` (the reservation's path) vs ``stock`` (a fresh allocation): a first
    pooled call's outputs are filled with NaN and dropped, so the compared call reuses poisoned reserved
    blocks; its three outputs must equal stock's bit for bit."""
    feature = S.POOL_FEATURE
    t0 = time.perf_counter()
    stock(*args, d_v=d_v, **kwargs)  # first call: module / JIT load
    _sync(device)
    t1 = time.perf_counter()
    ref = [t.clone() for t in stock(*args, d_v=d_v, **kwargs)]
    first = pooled(*args, d_v=d_v, **kwargs)
    ptrs = [t.data_ptr() for t in first]
    for t in first:
        t.fill_(float("nan"))
    del first, t  # nothing may hold the poisoned blocks: the next call must get them back
    got = pooled(*args, d_v=d_v, **kwargs)
    _sync(device)
    seconds = time.perf_counter() - t1
    reused = [t.data_ptr() for t in got] == ptrs
    for name, a, b in zip(("output", "max_logits", "lse"), got, ref):
        if not _bits_equal(a, b):
            _fail(
                feature,
                device,
                f"the pooled sparse-prefill {name} differs from a fresh allocation's "
                f"({tuple(args[0].shape)} q, d_v {d_v}): {_first_difference(a, b)}",
            )
    del got
    q = args[0]
    return Result(
        feature,
        "passed",
        device_info(device)[2],
        seconds,
        t1 - t0,
        f"pooled = fresh allocation bit for bit (out, max_logits, lse): {q.shape[0]} tokens x {q.shape[1]} heads "
        f"x {q.shape[2]} {str(q.dtype).replace('torch.', '')}, d_v {d_v}, top-k {args[2].shape[-1]}",
        {"tokens": int(q.shape[0]), "heads": int(q.shape[1]), "d_v": d_v, "poisoned_blocks_reused": reused},
    )


def _quiet(res: Any, run: Callable) -> Any:
    """Run ``run()`` and put the reservation's counters back: a self-test call is no request."""
    names = ("served", "refused", "captured", "high_water_tokens", "cross_stream")
    keep = {k: getattr(res, k) for k in names if hasattr(res, k)}
    try:
        return run()
    finally:
        for k, v in keep.items():
            setattr(res, k, v)


def check_reservation(res: Any, stock: Callable, *, device: Any) -> Result:
    """:func:`check_pool` for a live reservation (:class:`.pool.SparsePrefillPool` or
    :class:`.pool.Q8KV8Reservation`) at its heads and ``d_v``."""
    from .pool import Q8KV8Reservation, SparsePrefillPoolError

    q8 = isinstance(res, Q8KV8Reservation)
    args, kwargs = (q8kv8_inputs if q8 else flashmla_inputs)(
        res.heads, 512, device, tokens=min(POOL_TOKENS, res.tokens)
    )

    def pooled(*a, d_v, **kw):
        try:
            return res.run(stock, *a, d_v=d_v, **kw)
        except SparsePrefillPoolError as exc:
            _fail(S.POOL_FEATURE, device, f"the reservation refused a call it must serve: {exc}")

    out = _quiet(res, lambda: check_pool(pooled, stock, args, kwargs, d_v=res.d_v, device=device))
    out.detail = ("Q8KV8 " if q8 else "FlashMLA ") + out.detail
    return out


# --- dsv4-planner-guards --------------------------------------------------------------------------


@dataclass
class PlanGeometry:
    """What the DSV4 backend passes the compress planners (compressor_v2.py), read from the live pool."""

    ratios: tuple = (4, 128)
    swa_page_size: int = 256
    ring_sizes: dict = field(default_factory=lambda: {4: 128, 128: 256})
    unified_kv: bool = False
    r2t_dtype: Any = None  # torch.int32 unless given
    f2s_dtype: Any = None  # torch.int64 unless given


def _plan_case(rng: random.Random, g: PlanGeometry, ratio: int, device: Any, *, gpu_lens: bool, b=8, cols=1024):
    import torch

    rows, n_full = b + 8, 1 << 14
    seq = [rng.randint(1, cols) for _ in range(b)]
    ext = [min(rng.randint(1, s), 64) for s in seq]
    lens_dev = device if gpu_lens else "cpu"
    tg = _gen(rng.randint(0, 1 << 30))
    return dict(
        compress_ratio=ratio,
        req_pool_indices=torch.tensor(rng.sample(range(rows), b), dtype=torch.int64).to(device),
        seq_lens=torch.tensor(seq, dtype=torch.int64).to(lens_dev),
        extend_lens=torch.tensor(ext, dtype=torch.int64).to(lens_dev),
        req_to_token=torch.randint(0, n_full, (rows, cols), generator=tg).to(g.r2t_dtype or torch.int32).to(device),
        full_to_state=torch.randperm(n_full, generator=tg).to(g.f2s_dtype or torch.int64).to(device),
        swa_page_size=g.swa_page_size,
        ring_size=g.ring_sizes[ratio],
        num_q_tokens=sum(ext),
        use_req_ring=ratio == 4 and g.unified_kv,
    )


_PREFILL_KEYS = (
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
_DECODE_KEYS = ("compress_ratio", "req_pool_indices", "req_to_token", "full_to_state", "seq_lens", "swa_page_size")


def _prefill_args(c: dict) -> tuple:
    return tuple(c[k] for k in _PREFILL_KEYS), {"use_req_ring": c["use_req_ring"]}


def _decode_args(c: dict) -> tuple:
    return tuple(c[k] for k in _DECODE_KEYS) + (c["ring_size"],), {"use_req_ring": c["use_req_ring"]}


def _sorted_rows(t: Any) -> list:
    return sorted(bytes(r) for r in t.cpu().numpy())


def _same_plan(a: Any, b: Any, attrs: tuple, multiset: bool) -> Optional[str]:
    for attr in attrs:
        x, y = getattr(a, attr), getattr(b, attr)
        same = x.shape == y.shape and (_sorted_rows(x) == _sorted_rows(y) if multiset else _bits_equal(x, y))
        if not same:
            return f"{attr} {tuple(y.shape)} differs from stock's {tuple(x.shape)}"
    return None


def check_planner(
    ours: dict,
    stock: dict,
    report: Callable,
    bounds_error: type,
    *,
    geometry: PlanGeometry,
    device: Any,
    seed: int = 0,
) -> Result:
    """``ours`` / ``stock``: ``{"decode": generate, "prefill": generate}`` (``CompressorDecodePlan.generate``
    / ``CompressorPrefillPlan.generate`` shaped). ``report()`` raises ``bounds_error`` for a violation the
    guard published since the last call (``planner_device.check``). For each ratio of ``geometry``: a decode
    plan, a prefill plan with host lengths and one with device lengths equal stock's and publish nothing;
    then a decode request reading past ``req_to_token`` and a GPU-input prefill batch over ``num_q_tokens``
    must each be caught (by the call itself, or by ``report()`` after it)."""
    feature = S.GUARDS_FEATURE
    rng = random.Random(seed)
    t0 = time.perf_counter()
    warm_d = _plan_case(rng, geometry, geometry.ratios[0], device, gpu_lens=True)
    warm_p = _plan_case(rng, geometry, geometry.ratios[0], device, gpu_lens=False)
    for fns in (stock, ours):  # first calls: SGLang's JIT planner and the guarded one load (or build) here
        a, kw = _decode_args(warm_d)
        fns["decode"](*a, **kw)
        a, kw = _prefill_args(warm_p)
        fns["prefill"](*a, **kw)
    _sync(device)
    try:
        report()
    except bounds_error as exc:
        _fail(feature, device, f"the guard reported a violation for a valid warm-up plan: {exc}")
    t1 = time.perf_counter()
    plans = 0
    for ratio in geometry.ratios:
        for kind, gpu_lens in (("decode", True), ("prefill", False), ("prefill", True)):
            case = _plan_case(rng, geometry, ratio, device, gpu_lens=gpu_lens)
            a, kw = (_decode_args if kind == "decode" else _prefill_args)(case)
            want, got = stock[kind](*a, **kw), ours[kind](*a, **kw)
            _sync(device)
            attrs = ("plan_d",) if kind == "decode" else ("plan_c", "plan_w")
            problem = _same_plan(want, got, attrs, multiset=kind == "prefill" and gpu_lens)
            where = f"c{ratio} {kind} plan ({'device' if gpu_lens else 'host'} lengths, b {case['seq_lens'].numel()})"
            if problem:
                _fail(feature, device, f"the guarded {where} is not stock's: {problem}")
            try:
                report()
            except bounds_error as exc:
                _fail(feature, device, f"the guard reported a violation for a valid {where}: {exc}")
            plans += 1
    caught = {}
    ratio = geometry.ratios[0]
    bad_decode = _plan_case(rng, geometry, ratio, device, gpu_lens=True)
    rows, cols = (int(n) for n in bad_decode["req_to_token"].shape)
    bad_decode["req_pool_indices"][0] = rows - 1  # the last row: reading past its columns leaves the allocation
    bad_decode["seq_lens"][0] = cols + 10
    bad_prefill = _plan_case(rng, geometry, ratio, device, gpu_lens=True)
    bad_prefill["num_q_tokens"] -= 1  # one more extend token than the plan buffers hold
    for name, kind, case, expect in (
        ("decode past req_to_token", "decode", bad_decode, "req_to_token"),
        ("prefill over num_q_tokens", "prefill", bad_prefill, "num_q_tokens"),
    ):
        a, kw = (_decode_args if kind == "decode" else _prefill_args)(case)
        message = None
        try:
            ours[kind](*a, **kw)
            _sync(device)
            report()
        except bounds_error as exc:
            message = str(exc)
        if message is None or expect not in message:
            _fail(
                feature,
                device,
                f"a crafted out-of-bounds c{ratio} plan ({name}) was not caught"
                + (f" as such (got: {message})" if message else ""),
            )
        caught[name] = message.split(": ", 1)[-1][:120]
    seconds = time.perf_counter() - t1
    return Result(
        feature,
        "passed",
        device_info(device)[2],
        seconds,
        t1 - t0,
        f"{plans} guarded plans = stock's (c{'/c'.join(map(str, geometry.ratios))}, decode, prefill host and "
        f"device lengths); caught: {', '.join(caught)}",
        {"plans": plans, "caught": sorted(caught)},
    )


# --- wiring: run at the DSV4 backend's construction -----------------------------------------------


def stock_of(obj: Any) -> Any:
    """The stock callable under dspark-harden's wrappers (``__wrapped__`` of what our patches stamped)."""
    func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    while getattr(func, "__dspark_patch__", None) and getattr(func, "__wrapped__", None) is not None:
        func = func.__wrapped__
    return func


def _qnorm_layer(model_runner: Any) -> Any:
    """The first live ``MQALayer`` whose ``_compute_q_b`` takes the in-place path (``q_head_norm``, not
    MegaAttention), or None."""
    from sglang.srt.models.deepseek_v4 import MQALayer

    model = getattr(model_runner, "model", None)
    for mod in model.modules() if model is not None else ():
        if isinstance(mod, MQALayer) and mod.q_head_norm and not mod.use_mega_attention:
            return mod
    return None


def _run_qnorm(backend: Any, model_runner: Any, device: Any) -> Result:
    from sglang.srt.models.deepseek_v4 import MQALayer

    from .qnorm import build_compute_q_b

    layer = _qnorm_layer(model_runner)
    if layer is None:
        return Result(
            S.QNORM_FEATURE, "skipped", device_info(device)[2], detail="no q_head_norm MQA layer in this model"
        )
    stock = stock_of(MQALayer.__dict__["_compute_q_b"])
    return check_qnorm(
        build_compute_q_b(stock, lambda: None),
        stock,
        heads=int(layer.n_local_heads),
        head_dim=int(layer.head_dim),
        eps=float(layer.eps),
        freqs_cis=layer.freqs_cis,
        device=device,
    )


def _run_pool(backend: Any, model_runner: Any, device: Any) -> list:
    from . import pool as P

    out = []
    if P.POOL is not None:
        from sglang.kernels.ops.attention import flash_mla_interface

        out.append(check_reservation(P.POOL, stock_of(flash_mla_interface.flash_mla_sparse_fwd), device=device))
    if P.Q8 is not None:
        from sglang.kernels.ops.attention import sparse_mla_q8kv8_prefill_sm90 as q8

        out.append(check_reservation(P.Q8, stock_of(q8.sparse_mla_q8kv8_prefill_fwd), device=device))
    return out


def plan_geometry(backend: Any) -> PlanGeometry:
    """The planner arguments the DSV4 backend would pass (compressor_v2.py), from its live KV pool."""
    pool = backend.token_to_kv_pool
    ratios = tuple(r for r in (4, 128) if r in tuple(getattr(backend, "present_ratios", (4, 128)))) or (4, 128)
    f2s = getattr(pool, "full_to_swa_index_mapping", None)
    return PlanGeometry(
        ratios=ratios,
        swa_page_size=int(pool.swa_page_size),
        ring_sizes={r: int(pool.get_ring_size(compress_ratio=r)) for r in ratios},
        unified_kv=bool(getattr(pool, "_unified_kv", False)),
        r2t_dtype=backend.req_to_token.dtype,
        f2s_dtype=f2s.dtype if f2s is not None else None,
    )


def _run_guards(backend: Any, model_runner: Any, device: Any, settings: Any) -> Result:
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan, CompressorPrefillPlan

    from . import planner as PL
    from . import planner_device as PD

    PD.ensure_state(device)
    PD.check(device)  # nothing pending before the test
    sync = bool(settings[S.GUARDS_SYNC])
    stock = {
        "decode": stock_of(CompressorDecodePlan.__dict__["generate"]),
        "prefill": stock_of(CompressorPrefillPlan.__dict__["generate"]),
    }
    ours = {
        "decode": PL.unwrap(PL.build_decode_generate(stock["decode"], lambda ok: None, sync_checks=sync)),
        "prefill": PL.unwrap(PL.build_prefill_generate(stock["prefill"], lambda ok: None, sync_checks=sync)),
    }
    return check_planner(
        ours, stock, lambda: PD.check(device), PL.PlannerBoundsError, geometry=plan_geometry(backend), device=device
    )


def run_for_backend(backend: Any, model_runner: Any, settings: Any) -> list:
    """Each enabled DSV4 feature's self-test on ``backend.device``, once per process and geometry (called
    from the wrap of ``DeepseekV4AttnBackend.__init__``). Raises :class:`SelfTestError` on a failure;
    without CUDA records each enabled feature as ``skipped`` and runs nothing."""
    enabled = [f for f, switch in SWITCHES.items() if settings[switch]]
    if not enabled:
        return []
    import torch

    device = torch.device(getattr(backend, "device", "cpu"))
    if device.type != "cuda" or not torch.cuda.is_available():
        why = "no CUDA device (torch.cuda.is_available() is False)" if not torch.cuda.is_available() else ""
        return [
            _record(Result(f, "skipped", str(device), detail=why or f"the backend's device is {device}"))
            for f in enabled
        ]
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    out = []
    for feature in enabled:
        if feature == S.POOL_FEATURE:
            from . import pool as P

            key = (feature, device.index, tuple(id(r) for r in (P.POOL, P.Q8)))
        else:
            key = (feature, device.index)
        if key in _DONE:
            continue
        if feature == S.QNORM_FEATURE:
            results = [_run_qnorm(backend, model_runner, device)]
        elif feature == S.POOL_FEATURE:
            results = _run_pool(backend, model_runner, device)
        else:
            results = [_run_guards(backend, model_runner, device, settings)]
        _DONE.add(key)
        for res in results:
            _record(res)
            logger.info(
                "dspark-harden: start-up self-test %s %s on %s: %s (%.1f ms; first-call load %.2f s)",
                res.feature,
                res.status,
                res.device,
                res.detail,
                res.seconds * 1e3,
                res.load_seconds,
            )
        out += results
    return out


def host_device_line() -> str:
    """One line for ``dspark-harden check``: the local GPU and its compute capability against
    :func:`.settings.proven_ccs`, read with ``nvidia-smi`` (no CUDA context in the calling process), or
    that there is none."""
    import shutil
    import subprocess

    proven = S.proven_ccs()
    runs = ", ".join(f"{c} ({', '.join(cards)})" for c, cards in proven.items()) or "none"
    head = f"DSV4 GPU suites ran on {runs}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return f"{head}; this host: no NVIDIA GPU (no nvidia-smi): the start-up self-tests do not run here"
    try:
        proc = subprocess.run(
            [smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        rows = [ln.rsplit(",", 1) for ln in proc.stdout.strip().splitlines() if "," in ln]
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{head}; this host: nvidia-smi failed ({type(exc).__name__}: {exc})"
    if proc.returncode != 0 or not rows:
        return f"{head}; this host: nvidia-smi reported no GPU ({(proc.stderr or proc.stdout).strip()[:200]})"
    seen = []
    for name, cap in rows:
        cc = "sm_" + cap.strip().replace(".", "")
        state = "among them" if cc in proven else "NOT among them: the start-up self-test is the first proof there"
        item = f"{name.strip()} {cc} ({state})"
        if item not in seen:
            seen.append(item)
    return f"{head}; this host: " + "; ".join(seen)
