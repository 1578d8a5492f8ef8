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
class SparsePrefillPool:
    """``slots`` reserved (out, max_logits, lse) block sets of ``tokens x heads (x d_v)``."""

    tokens: int
    heads: int
    d_v: int
    device: Any
    slots: int = 1
    pool: Any = None
    ranges: list = field(default_factory=list)  # (start, end) device addresses of reserved blocks
    served: int = 0
    refused: int = 0
    high_water_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def reserved_bytes(self) -> int:
        return reservation_bytes(self.tokens, self.heads, self.d_v, self.slots)

    def reserve(self) -> "SparsePrefillPool":
        import torch

        if not torch.cuda.is_available():
            raise SparsePrefillPoolError("the sparse-prefill pool needs CUDA (torch.cuda.is_available() is False)")
        dev = torch.device(self.device)
        if dev.index is None:  # the backend's device is often plain "cuda": the pool needs an index
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.pool = torch.cuda.MemPool()
        keep = []
        try:
            with torch.cuda.use_mem_pool(self.pool, device=self.device):
                for _ in range(self.slots):
                    keep.append(torch.empty((self.tokens, self.heads, self.d_v), dtype=torch.bfloat16, device=self.device))
                    keep.append(torch.empty((self.tokens, self.heads), dtype=torch.float32, device=self.device))
                    keep.append(torch.empty((self.tokens, self.heads), dtype=torch.float32, device=self.device))
        except torch.OutOfMemoryError as exc:
            raise SparsePrefillPoolError(
                f"could not reserve the sparse-prefill output pool: {self.tokens} tokens x {self.heads} heads x "
                f"d_v {self.d_v} x {self.slots} slot(s) = {self.reserved_bytes} bytes ({exc}); lower "
                f"DSPARK_HARDEN_DSV4_SPARSE_PREFILL_TOKENS / --chunked-prefill-size or --mem-fraction-static"
            ) from None
        self.ranges = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in keep]
        del keep  # the blocks return to the pool's cache; its segments stay reserved for the calls
        logger.info("dspark-harden: sparse-prefill output pool reserved: %d tokens x %d heads x %d x %d slot(s) = %d bytes",
                    self.tokens, self.heads, self.d_v, self.slots, self.reserved_bytes)
        return self

    def _inside(self, t: Any) -> bool:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        return any(lo <= start and end <= hi for lo, hi in self.ranges)

    def check_geometry(self, s_q: int, h_q: int, d_v: int) -> None:
        if s_q > self.tokens or h_q != self.heads or d_v != self.d_v:
            with self._lock:
                self.refused += 1
            raise SparsePrefillPoolError(
                f"sparse-prefill call of {s_q} tokens x {h_q} heads x d_v {d_v} does not fit the reserved "
                f"{self.tokens} tokens x {self.heads} heads x d_v {self.d_v}; raise "
                f"DSPARK_HARDEN_DSV4_SPARSE_PREFILL_TOKENS (or lower --chunked-prefill-size)"
            )

    def run(self, stock: Callable, q: Any, *args: Any, d_v: int, **kwargs: Any):
        import torch

        s_q, h_q = int(q.shape[0]), int(q.shape[1])
        self.check_geometry(s_q, h_q, d_v)
        with torch.cuda.use_mem_pool(self.pool, device=q.device):
            result = stock(q, *args, d_v=d_v, **kwargs)
        outside = [name for name, t in zip(("output", "max_logits", "lse"), result)
                   if t is not None and not self._inside(t)]
        if outside:
            with self._lock:
                self.refused += 1
            raise SparsePrefillPoolError(
                f"sparse-prefill {', '.join(outside)} of a {s_q}-token call did not come from the reservation "
                f"({self.slots} slot(s) of {self.tokens} tokens): more sparse-prefill outputs are alive at once "
                f"than reserved; raise DSPARK_HARDEN_DSV4_SPARSE_PREFILL_SLOTS"
            )
        with self._lock:
            self.served += 1
            self.high_water_tokens = max(self.high_water_tokens, s_q)
        return result


POOL: Optional[SparsePrefillPool] = None  # this scheduler's reservation (one per process)


def build_sparse_fwd(stock: Callable, on_call: Callable[[SparsePrefillPool], None],
                     on_refused: Callable[[], None] = lambda: None) -> Callable:
    """The patched ``flash_mla_interface.flash_mla_sparse_fwd``: same signature, pool-served."""

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, *,
                             use_legacy=True):
        pool = POOL
        if pool is None:
            raise SparsePrefillPoolError(
                "DSPARK_HARDEN_DSV4_SPARSE_PREFILL_POOL=1 but no sparse-prefill pool was reserved in this "
                "process (the DeepSeek V4 attention backend was never created: is the model DeepSeek V4?)"
            )
        try:
            result = pool.run(stock, q, kv, indices, sm_scale, d_v=d_v, attn_sink=attn_sink, topk_length=topk_length,
                              use_legacy=use_legacy)
        except SparsePrefillPoolError:
            on_refused()
            raise
        on_call(pool)
        return result

    return flash_mla_sparse_fwd
