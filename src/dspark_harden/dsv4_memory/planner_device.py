"""Device-side bounds guard for the DSV4 compress decode planner, for the plans a CUDA graph replays.

The host-side guards (:mod:`.planner`) cannot run inside a replayed decode graph: the plan kernel is
recorded at capture and replayed without Python. ``csrc/guarded_c_plan.cuh`` is the stock
``plan_compress_decode_kernel`` (SGLang 0.5.23 ``c_plan.cuh``) plus bounds checks on the two
``req_to_token`` reads and the two ``full_to_state`` reads of every request, compiled by SGLang's own
JIT (``sglang.kernels.jit.utils.load_jit``) against the stock header it includes. For every input whose
reads stay inside their allocations it writes the stock plan bit for bit; otherwise it clamps the
offending index (every location in the plan stays in bounds) and ORs a reason bit into a per-device
``int32[1]`` error flag. The flag is a static tensor, so a captured plan keeps setting the same flag
on every replay; :func:`check` reads it (a device sync: call it where the scheduler syncs anyway)
and raises :class:`~.common.PlannerBoundsError` naming the reason, clearing it first.

Needs CUDA and SGLang's JIT toolchain (nvcc); nothing imports this module on a CPU host.
"""

from __future__ import annotations

import functools
import pathlib
import threading
from typing import Any

from .common import PlannerBoundsError

CSRC = pathlib.Path(__file__).resolve().parent / "csrc" / "guarded_c_plan.cuh"
REASONS = {1: "a req_to_token read outside its allocation", 2: "a full_to_state read outside its allocation"}
_FLAGS: dict = {}
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _module() -> Any:
    from sglang.kernels.jit.utils import load_jit
    from sglang.kernels.jit.utils.compile.paths import KERNEL_PATH

    return load_jit(
        "dspark_harden_guarded_compress_plan",
        cuda_files=[str(CSRC)],
        cuda_wrappers=[("plan_decode_guarded", "plan_compress_decode_guarded")],
        extra_include_paths=[str(KERNEL_PATH / "csrc")],
    )


def flag_for(device: Any) -> Any:
    """The static error flag of ``device`` (created once, zero, never reallocated: captured graphs
    keep its address)."""
    import torch

    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with _LOCK:
        flag = _FLAGS.get(dev.index)
        if flag is None:
            flag = _FLAGS[dev.index] = torch.zeros(1, dtype=torch.int32, device=dev)
        return flag


def generate_decode(
    compress_ratio,
    req_pool_indices,
    req_to_token,
    full_to_state,
    seq_lens,
    swa_page_size,
    ring_size,
    use_req_ring=False,
):
    """``CompressorDecodePlan.generate`` with the device-side guard (same arguments and result)."""
    import torch
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan

    plan_d = _module().plan_decode_guarded(
        req_pool_indices,
        req_to_token,
        full_to_state,
        seq_lens,
        flag_for(req_pool_indices.device),
        int(compress_ratio),
        int(swa_page_size),
        int(ring_size),
        bool(use_req_ring),
    )
    return CompressorDecodePlan(compress_ratio, torch.from_dlpack(plan_d))


def check(device: Any = None) -> None:
    """Read (a device sync) and clear the error flag; raise naming the reasons when it was set."""
    import torch

    flag = flag_for(device if device is not None else torch.device("cuda", torch.cuda.current_device()))
    value = int(flag.item())
    if value:
        flag.zero_()
        reasons = [text for bit, text in REASONS.items() if value & bit]
        raise PlannerBoundsError(
            "DSV4 compress decode plan (device-side guard) would have indexed past an allocation since the last "
            f"check: {'; '.join(reasons)} (flag {value}; the batch's plan entries were clamped in bounds and are "
            "not valid: fail the batch)"
        )
