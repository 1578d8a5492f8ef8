"""Sparse-prefill output pool: FlashMLA's three per-call outputs come from a reservation.

sgl-flash-mla 1.0.0's ``flash_mla_sparse_fwd`` allocates ``out [s_q, h_q, d_v]`` bf16,
``max_logits [s_q, h_q]`` fp32 and ``lse [s_q, h_q]`` fp32 itself on every DSV4 layer call and has
no caller-owned-output variant (probed by signature: :func:`caller_owned_output_supported`). At
8,192 tokens x 128 heads x 512 the output alone is 1 GiB, and after decode traffic has fragmented
the caching allocator a fresh contiguous block may not exist. So the call runs inside
``torch.cuda.use_mem_pool(pool)`` of a private :class:`torch.cuda.MemPool` whose segments were
allocated once, at start-up, for ``slots`` x the largest shape: the allocator serves the call's
blocks from those cached segments and never needs a fresh ``cudaMalloc``. Only the kernel call's
own allocations are routed there (the KV scratch is stock's reused ``SparsePrefillKVBuffer``).

Under CUDA-graph capture (``torch.cuda.is_current_stream_capturing()``) the call goes to stock
untouched and is counted ``captured``: its outputs belong to the capture's private graph pool, which
SGLang's graph runner owns for the graph's lifetime. Serving a captured call from this pool instead
would leave the graph's outputs in blocks the pool hands to the next eager call, so later replays
would write into memory an eager tensor owns (tests/gpu/test_dsv4_memory_gpu.py measures which pool
wins when both are active, and checks that no eager output ever aliases a captured one).

The caching allocator serves a cached block only to an allocation on the stream that made it: a
call on another stream than the reservation's (SGLang's overlap ``forward_stream``) runs on the
reservation's stream, ordered after the caller's stream and waited for by it (``cross_stream``).

Fail closed: a call whose tokens exceed the reservation, whose heads / ``d_v`` differ from it, or
whose outputs did not land inside the reserved segments (more outputs alive than ``slots``) raises
:class:`SparsePrefillPoolError` naming both sizes; nothing falls back to a fresh allocation.
"""

from __future__ import annotations

import inspect
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .common import capturing

logger = logging.getLogger("dspark_harden.dsv4_memory")

BF16_BYTES, FP32_BYTES = 2, 4


class SparsePrefillPoolError(RuntimeError):
    pass


def caller_owned_output_supported(fn: Any) -> bool:
    """True when FlashMLA's sparse prefill takes caller-owned outputs (an ``out`` parameter)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return any(name in params for name in ("out", "output", "out_o"))


def reservation_bytes(tokens: int, heads: int, d_v: int, slots: int = 1) -> int:
    return slots * (tokens * heads * d_v * BF16_BYTES + 2 * tokens * heads * FP32_BYTES)


@dataclass
class _Reservation:
    """What both reservations share: geometry, counters and the refusals (``KIND`` names the call in
    every message)."""

    KIND = "sparse-prefill"
    tokens: int
    heads: int
    d_v: int
    device: Any
    slots: int = 1
    served: int = 0
    refused: int = 0
    captured: int = 0
    high_water_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def reserved_bytes(self) -> int:
        return reservation_bytes(self.tokens, self.heads, self.d_v, self.slots)

    def _refuse(self, message: str) -> None:
        with self._lock:
            self.refused += 1
        raise SparsePrefillPoolError(message)

    def check_geometry(self, s_q: int, h_q: int, d_v: int) -> None:
        if s_q > self.tokens or h_q != self.heads or d_v != self.d_v:
            self._refuse(
                f"{self.KIND} call of {s_q} tokens x {h_q} heads x d_v {d_v} does not fit the reserved "
                f"{self.tokens} tokens x {self.heads} heads x d_v {self.d_v}; raise "
                f"DSPARK_HARDEN_DSV4_SPARSE_PREFILL_TOKENS (or lower --chunked-prefill-size)"
            )

    def _note_captured(self) -> None:
        with self._lock:
            self.captured += 1

    def _note_served(self, s_q: int) -> None:
        with self._lock:
            self.served += 1
            self.high_water_tokens = max(self.high_water_tokens, s_q)

    def _output_sets(self, what: str) -> list:
        """``slots`` fresh (out bf16, max_logits fp32, lse fp32) sets, or a named error on OOM."""
        import torch

        try:
            return [
                (
                    torch.empty((self.tokens, self.heads, self.d_v), dtype=torch.bfloat16, device=self.device),
                    torch.empty((self.tokens, self.heads), dtype=torch.float32, device=self.device),
                    torch.empty((self.tokens, self.heads), dtype=torch.float32, device=self.device),
                )
                for _ in range(self.slots)
            ]
        except torch.OutOfMemoryError as exc:
            raise SparsePrefillPoolError(
                f"could not reserve {what}: {self.tokens} tokens x {self.heads} heads x "
                f"d_v {self.d_v} x {self.slots} slot(s) = {self.reserved_bytes} bytes ({exc}); lower "
                f"DSPARK_HARDEN_DSV4_SPARSE_PREFILL_TOKENS / --chunked-prefill-size or --mem-fraction-static"
            ) from None


@dataclass
class SparsePrefillPool(_Reservation):
    """``slots`` reserved (out, max_logits, lse) block sets of ``tokens x heads (x d_v)``."""

    pool: Any = None
    ranges: list = field(default_factory=list)  # (start, end) device addresses of reserved blocks
    cross_stream: int = 0
    stream: Any = None  # the stream the reservation was made on (its blocks serve that stream only)

    def reserve(self) -> "SparsePrefillPool":
        import torch

        if not torch.cuda.is_available():
            raise SparsePrefillPoolError("the sparse-prefill pool needs CUDA (torch.cuda.is_available() is False)")
        dev = torch.device(self.device)
        if dev.index is None:  # the backend's device is often plain "cuda": the pool needs an index
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.pool = torch.cuda.MemPool()
        self.stream = torch.cuda.current_stream(self.device)
        with torch.cuda.use_mem_pool(self.pool, device=self.device):
            keep = [t for group in self._output_sets("the sparse-prefill output pool") for t in group]
        self.ranges = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in keep]
        del keep  # the blocks return to the pool's cache; its segments stay reserved for the calls
        logger.info(
            "dspark-harden: sparse-prefill output pool reserved: %d tokens x %d heads x %d x %d slot(s) = %d bytes",
            self.tokens,
            self.heads,
            self.d_v,
            self.slots,
            self.reserved_bytes,
        )
        return self

    def _inside(self, t: Any) -> bool:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        return any(lo <= start and end <= hi for lo, hi in self.ranges)

    def run(self, stock: Callable, q: Any, *args: Any, d_v: int, **kwargs: Any):
        import torch

        if capturing():
            self._note_captured()
            return stock(q, *args, d_v=d_v, **kwargs)
        s_q, h_q = int(q.shape[0]), int(q.shape[1])
        self.check_geometry(s_q, h_q, d_v)
        cur = torch.cuda.current_stream(q.device)
        if cur == self.stream:
            with torch.cuda.use_mem_pool(self.pool, device=q.device):
                result = stock(q, *args, d_v=d_v, **kwargs)
        else:
            # The caching allocator hands a cached block only to allocations on the stream it was
            # made on, so a call on another stream (SGLang's overlap forward_stream; the reservation
            # is made at backend init) would get fresh segments. Run the call on the reservation's
            # stream, ordered after everything already queued on the caller's stream (which includes
            # every consumer of an earlier output whose block this call reuses), and make the
            # caller's stream wait for it.
            self.stream.wait_stream(cur)
            with torch.cuda.stream(self.stream), torch.cuda.use_mem_pool(self.pool, device=q.device):
                result = stock(q, *args, d_v=d_v, **kwargs)
            cur.wait_stream(self.stream)
            with self._lock:
                self.cross_stream += 1
        outside = [
            name for name, t in zip(("output", "max_logits", "lse"), result) if t is not None and not self._inside(t)
        ]
        if outside:
            self._refuse(
                f"sparse-prefill {', '.join(outside)} of a {s_q}-token call did not come from the reservation "
                f"({self.slots} slot(s) of {self.tokens} tokens): more sparse-prefill outputs are alive at once "
                f"than reserved; raise DSPARK_HARDEN_DSV4_SPARSE_PREFILL_SLOTS"
            )
        self._note_served(s_q)
        return result


def _counted(
    res: _Reservation,
    call: Callable[[], Any],
    on_call: Callable[[Any], None],
    on_refused: Callable[[], None],
    on_captured: Callable[[], None],
) -> Any:
    """Run one reservation call and report its outcome once: refused (re-raised), captured or served
    (a call the caller owns the outputs of is neither)."""
    captured, served = res.captured, res.served
    try:
        result = call()
    except SparsePrefillPoolError:
        on_refused()
        raise
    if res.captured != captured:
        on_captured()
    elif res.served != served:
        on_call(res)
    return result


POOL: Optional[SparsePrefillPool] = None  # this scheduler's reservation (one per process)


def build_sparse_fwd(
    stock: Callable,
    on_call: Callable[[SparsePrefillPool], None],
    on_refused: Callable[[], None] = lambda: None,
    on_captured: Callable[[], None] = lambda: None,
) -> Callable:
    """The patched ``flash_mla_interface.flash_mla_sparse_fwd``: same signature, pool-served."""

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, *, use_legacy=True):
        pool = POOL
        if pool is None:
            raise SparsePrefillPoolError(
                "DSPARK_HARDEN_DSV4_SPARSE_PREFILL_POOL=1 but no sparse-prefill pool was reserved in this "
                "process (the DeepSeek V4 attention backend was never created: is the model DeepSeek V4?)"
            )
        return _counted(
            pool,
            lambda: pool.run(
                stock,
                q,
                kv,
                indices,
                sm_scale,
                d_v=d_v,
                attn_sink=attn_sink,
                topk_length=topk_length,
                use_legacy=use_legacy,
            ),
            on_call,
            on_refused,
            on_captured,
        )

    return flash_mla_sparse_fwd


def _storage_uses(t: Any) -> int:
    import torch

    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


@dataclass
class Q8KV8Reservation(_Reservation):
    """Caller-owned outputs for the SM90 Q8KV8 sparse prefill (``--dsv4-prefill-backend
    flashmla_sparse_q8`` / ``SGLANG_DSV4_Q8KV8_PREFILL=1``): stock's ``sparse_mla_q8kv8_prefill_fwd``
    takes ``out=``, ``max_logits=`` and ``lse=``, so each call gets bounded slices (``[:s_q]``) of
    ``slots`` reserved (out bf16 ``[tokens, heads, d_v]``, max_logits / lse fp32 ``[tokens, heads]``)
    sets made at backend init, with ``heads`` the kernel's padded head count. No allocator is
    involved, so any stream may call it.

    A slot is free when no tensor but ours shares its storage (the caller returns ``o[:, :heads]``,
    a view that lives until the output projection drops it); a call with every slot still held,
    with more tokens than reserved or with other heads / ``d_v`` is refused naming both sizes."""

    KIND = "Q8KV8 sparse-prefill"
    bufs: list = field(default_factory=list)
    baseline: list = field(default_factory=list)

    def reserve(self) -> "Q8KV8Reservation":
        import torch

        if not torch.cuda.is_available():
            raise SparsePrefillPoolError("the Q8KV8 sparse-prefill reservation needs CUDA")
        self.bufs = self._output_sets("the Q8KV8 sparse-prefill outputs")
        self.baseline = [tuple(_storage_uses(t) for t in slot) for slot in self.bufs]
        logger.info(
            "dspark-harden: Q8KV8 sparse-prefill outputs reserved: %d tokens x %d heads x %d x %d slot(s) = %d bytes",
            self.tokens,
            self.heads,
            self.d_v,
            self.slots,
            self.reserved_bytes,
        )
        return self

    def run(
        self,
        stock: Callable,
        q: Any,
        kv: Any,
        indices: Any,
        sm_scale: float,
        q_scale: Any,
        kv_scale: Any,
        d_v: int = 512,
        attn_sink: Any = None,
        topk_length: Any = None,
        *,
        out: Any = None,
        max_logits: Any = None,
        lse: Any = None,
    ):
        args = (q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length)
        if out is not None or max_logits is not None or lse is not None:
            return stock(*args, out=out, max_logits=max_logits, lse=lse)  # the caller owns its outputs
        if capturing():
            self._note_captured()
            return stock(*args)  # the graph's private pool owns captured outputs (see the module docstring)
        s_q, h_q = int(q.shape[0]), int(q.shape[1])
        self.check_geometry(s_q, h_q, d_v)
        for slot, base in zip(self.bufs, self.baseline):
            if all(_storage_uses(t) <= b for t, b in zip(slot, base)):
                break
        else:
            self._refuse(
                f"Q8KV8 sparse-prefill call of {s_q} tokens: all {self.slots} reserved output slot(s) of {self.tokens} "
                f"tokens are still held by earlier outputs; raise DSPARK_HARDEN_DSV4_SPARSE_PREFILL_SLOTS"
            )
        o, m, lse_ = slot
        result = stock(*args, out=o[:s_q], max_logits=m[:s_q], lse=lse_[:s_q])
        self._note_served(s_q)
        return result


Q8: Optional[Q8KV8Reservation] = None  # this scheduler's Q8KV8 reservation (one per process)


def build_q8kv8_fwd(
    stock: Callable,
    on_call: Callable[[Any], None],
    on_refused: Callable[[], None] = lambda: None,
    on_captured: Callable[[], None] = lambda: None,
) -> Callable:
    """The patched ``sparse_mla_q8kv8_prefill_fwd``: same signature, outputs from the reservation."""

    def sparse_mla_q8kv8_prefill_fwd(
        q,
        kv,
        indices,
        sm_scale,
        q_scale,
        kv_scale,
        d_v=512,
        attn_sink=None,
        topk_length=None,
        *,
        out=None,
        max_logits=None,
        lse=None,
    ):
        res = Q8
        if res is None:
            raise SparsePrefillPoolError(
                "DSPARK_HARDEN_DSV4_SPARSE_PREFILL_POOL=1 but no Q8KV8 reservation was made in this process (the "
                "DeepSeek V4 backend did not select the Q8KV8 prefill at init)"
            )
        return _counted(
            res,
            lambda: res.run(
                stock,
                q,
                kv,
                indices,
                sm_scale,
                q_scale,
                kv_scale,
                d_v,
                attn_sink,
                topk_length,
                out=out,
                max_logits=max_logits,
                lse=lse,
            ),
            on_call,
            on_refused,
            on_captured,
        )

    return sparse_mla_q8kv8_prefill_fwd
