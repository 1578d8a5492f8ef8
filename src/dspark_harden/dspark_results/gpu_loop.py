"""A stand-in DSpark decode loop on CUDA, shared by ``bench dspark-results`` and tests/gpu.

Stand-in for what cannot exist on the GPU machine (no SGLang server, no DSpark model there): the
*graph-output buffers* of one DSpark verify step. Like the outputs of a replayed CUDA graph, they
are fixed device tensors that every step rewrites in place, at the end of its forward, after a
busy GEMM chain on the forward stream:

* ``next_token_ids`` ``[bs * stride]`` int64: ``step * 100003 + i``
* ``accept_lens`` ``[bs]`` int32: ``(step + j) % stride + 1``
* ``block_accept_lens`` ``[bs]`` int32: ``(3 * step + j) % stride + 1``
* ``cap_lens`` ``[bs]`` int32: ``(5 * step + j) % (stride + 1)``

Each rewrite is several in-place kernels (a half, a spacer, the other half; copy, add, remainder,
add), so a copy that overlaps a rewrite reads a torn value, and a copy that runs after it reads the
next step's. :meth:`StandInDecode.expected` is the closed form a host list must equal.

:meth:`StandInDecode.enqueue_copy` is stock's ``Scheduler._copy_result_to_cpu`` for this result
(0.5.23, DSpark branch): ``copy_stream.wait_stream(forward_stream)``, then on ``copy_stream`` one
pinned-host ``async_d2h`` per tensor (``torch.empty(pin_memory=True).copy_(non_blocking=True)`` and
``record_stream``) and ``copy_done = torch.cuda.Event(); copy_done.record()`` — the forward stream
never waits for it. With ``issue_later=True`` the wait is taken here but the copies are issued by a
later call (:func:`issue_copy`), from another thread: stock's ``AsyncD2HCopyWorker`` shape, which
stock keeps DSpark off on purpose.

Torch only (no SGLang import).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

TOKEN_MUL = 100003
FIELDS = ("next_token_ids", "accept_lens", "block_accept_lens", "cap_lens")


def _async_d2h(torch: Any, tensor: Any) -> Any:
    """sglang.srt.utils.common.async_d2h (0.5.23) for a CUDA tensor."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    tensor.record_stream(torch.cuda.current_stream())
    return host


class StandInDecode:
    """``bs`` requests x ``stride`` draft tokens; each step's forward is ``busy_ms`` of GPU work on the
    forward stream followed by the in-place rewrite of the graph-output buffers. ``kind="sleep"``: one
    ``torch.cuda._sleep`` kernel (a replayed CUDA graph: one cheap launch, long GPU time, the host runs
    ahead); ``kind="gemm"``: bf16 2048^2 GEMMs (many launches: the host and the GPU keep pace)."""

    def __init__(
        self, bs: int = 64, stride: int = 8, busy_ms: float = 1.0, device: str = "cuda", kind: str = "sleep"
    ) -> None:
        if kind not in ("sleep", "gemm"):
            raise ValueError(f"busy kind {kind!r}: expected 'sleep' or 'gemm'")
        self.kind = kind
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("the DSpark result stand-in loop needs CUDA")
        self.torch = torch
        self.bs, self.stride = int(bs), int(stride)
        self.device = torch.device(device)
        self.forward_stream = torch.cuda.Stream(self.device)
        self.copy_stream = torch.cuda.Stream(self.device)
        n = self.bs * self.stride
        self.next_token_ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.accept_lens = torch.ones(self.bs, dtype=torch.int32, device=self.device)
        self.block_accept_lens = torch.ones(self.bs, dtype=torch.int32, device=self.device)
        self.cap_lens = torch.ones(self.bs, dtype=torch.int32, device=self.device)
        self._iota64 = torch.arange(n, dtype=torch.int64, device=self.device)
        self._iota32 = torch.arange(self.bs, dtype=torch.int32, device=self.device)
        self._a = torch.randn((2048, 2048), dtype=torch.bfloat16, device=self.device)
        self._b = torch.randn((2048, 2048), dtype=torch.bfloat16, device=self.device)
        self._c = torch.empty((2048, 2048), dtype=torch.bfloat16, device=self.device)
        self.busy_units = self._calibrate(busy_ms)  # GEMMs per step, or _sleep cycles per step

    def _gemm(self, count: int) -> None:
        for _ in range(count):
            self.torch.matmul(self._a, self._b, out=self._c)

    def _calibrate(self, busy_ms: float) -> int:
        """GEMMs per step, or ``_sleep`` cycles per step."""
        torch = self.torch
        unit = 1_000_000
        with torch.cuda.stream(self.forward_stream):
            self._gemm(8)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if self.kind == "gemm":
                self._gemm(64)
            else:
                torch.cuda._sleep(unit)
            end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        if busy_ms <= 0:
            return 0
        if self.kind == "gemm":
            return max(1, round(busy_ms / (ms / 64)))
        return max(1, int(unit * busy_ms / ms))

    def busy(self, fraction: float = 1.0) -> None:
        """GPU work on the forward stream (``fraction`` of one step's busy time)."""
        with self.torch.cuda.stream(self.forward_stream):
            if self.kind == "gemm":
                self._gemm(max(0, round(self.busy_units * fraction)))
            elif fraction > 0:
                self.torch.cuda._sleep(max(1, int(self.busy_units * fraction)))

    def rewrite(self, step: int) -> None:
        """The end of step ``step``'s forward: the graph-output buffers rewritten in place."""
        half = self.next_token_ids.shape[0] // 2
        with self.torch.cuda.stream(self.forward_stream):
            self.torch.add(self._iota64[:half], step * TOKEN_MUL, out=self.next_token_ids[:half])
            self.torch.matmul(self._a[:256, :256], self._b[:256, :256])  # a spacer between the halves
            self.torch.add(self._iota64[half:], step * TOKEN_MUL, out=self.next_token_ids[half:])
            for buf, mul, mod, plus in (
                (self.accept_lens, 1, self.stride, 1),
                (self.block_accept_lens, 3, self.stride, 1),
                (self.cap_lens, 5, self.stride + 1, 0),
            ):
                buf.copy_(self._iota32)
                buf.add_(mul * step)
                buf.remainder_(mod)
                if plus:
                    buf.add_(plus)

    def forward(self, step: int) -> None:
        self.busy()
        self.rewrite(step)

    def expected(self, step: int) -> dict:
        n, s = self.bs * self.stride, self.stride
        return {
            "next_token_ids": [step * TOKEN_MUL + i for i in range(n)],
            "accept_lens": [(step + j) % s + 1 for j in range(self.bs)],
            "block_accept_lens": [(3 * step + j) % s + 1 for j in range(self.bs)],
            "cap_lens": [(5 * step + j) % (s + 1) for j in range(self.bs)],
        }

    def enqueue_copy(self, step: int, issue_later: bool = False) -> Any:
        """Stock ``_copy_result_to_cpu`` for this step's result (see the module docstring)."""
        event = self.torch.cuda.Event()
        result = SimpleNamespace(
            step=step, logits_output=None, copy_done=event, copy_event=event, **{f: getattr(self, f) for f in FIELDS}
        )
        self.copy_stream.wait_stream(self.forward_stream)
        if not issue_later:
            issue_copy(self, result)
        return result

    def drain(self) -> None:
        self.torch.cuda.synchronize(self.device)


def issue_copy(loop: StandInDecode, result: Any) -> None:
    """``GenerationBatchResult.copy_to_cpu`` on the copy stream (the fields this loop carries)."""
    torch = loop.torch
    with torch.cuda.stream(loop.copy_stream):
        for f in FIELDS:
            setattr(result, f, _async_d2h(torch, getattr(result, f)))
        result.copy_event.record()  # (copy_done may already be the materializer's done object)


def stock_lists(result: Any) -> dict:
    """What stock's consumers do on the scheduler thread for a DSpark decode result:
    ``copy_done.synchronize()`` then ``.tolist()`` of each list (``_resolve_spec_v2_tokens``)."""
    result.copy_done.synchronize()
    return {f: getattr(result, f).tolist() for f in FIELDS}


def record_lists(record: Any) -> dict:
    return {f: getattr(record, f) for f in FIELDS}


def spin_cpu(seconds: float) -> None:
    """Scheduler-thread Python work between the launch and the consumer (holds the GIL)."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def classify(got: dict, loop: StandInDecode, step: int) -> str:
    """``ok``, ``torn`` (next_token_ids mixes steps) or ``other-step`` (a whole other step's values,
    or lengths that match no step here)."""
    if got == loop.expected(step):
        return "ok"
    steps = {v // TOKEN_MUL for v in got["next_token_ids"]}
    return "torn" if len(steps) > 1 else "other-step"
