"""Device-side bounds guards for the DSV4 compress planners: every plan, eager or replayed, no sync.

``csrc/guarded_c_plan.cuh`` holds guarded variants of SGLang 0.5.23's ``plan_compress_decode`` and
``plan_compress_prefill`` (``c_plan.cuh``), compiled by SGLang's own JIT
(``sglang.kernels.jit.utils.load_jit``) against the stock header they include. For every input whose
reads stay inside their allocations they write the stock plan bit for bit; otherwise they clamp the
offending read index (every location in the plan stays in bounds), plan a GPU-input prefill batch whose
lengths would append past the plan buffers as if it had no tokens, and count the violation per reason in
a device ``int32[4]`` counter. One tiny kernel queued behind each plan copies the counters into a pinned
host mirror, so a plan captured in a CUDA graph keeps publishing on every replay.

:func:`check_pending` reads the mirror (a plain host memory read: no sync, no device call) and raises
:class:`~.common.PlannerBoundsError` naming each reason whose count grew since the last report. The
planner wrappers call it before every plan and the DSV4 backend wrappers at every forward-metadata build
(eager forwards and graph replays alike): what the GPU has published by then. The result-processor
wrappers (:func:`.planner.build_result_check`) read it once more at the step's result sync, after the
wait stock does anyway for the step's result copy (every kernel queued before that copy, the step's plans
and their mirror publication included, has completed: the mirror is exact for the step) and before stock
appends or streams a token of it (:func:`report_all`): a violation fails the step that planned it, before
its tokens are released. :func:`check` synchronizes first (tests, shutdown).

The state (counters, mirror and the mirror's device address, queried once with
``cudaHostGetDevicePointer``) is created once per device outside any graph capture (:func:`ensure_state`,
called from the forward-metadata wrappers, which stock calls eagerly before every capture; it also
JIT-builds and loads the planner there); a plan captured before it exists stops with a named error
instead of capturing a zero-fill.

Needs CUDA and SGLang's JIT toolchain (nvcc); nothing imports this module on a CPU host.
"""

from __future__ import annotations

import functools
import pathlib
import threading
from dataclasses import dataclass, field
from typing import Any

from .common import PlannerBoundsError, capturing

CSRC = pathlib.Path(__file__).resolve().parent / "csrc" / "guarded_c_plan.cuh"
#: counter index -> reason (guarded_c_plan.cuh kGuard*)
REASONS = (
    "a req_to_token read outside its allocation",
    "a full_to_state read outside its allocation",
    "a prefill extend length < 0 or larger than its sequence length (GPU-input lengths)",
    "prefill extend lengths adding up to more than num_q_tokens (GPU-input lengths)",
)
_LOCK = threading.Lock()


@dataclass
class GuardState:
    counts: Any  # [4] int32 on the device, never reallocated (captured graphs keep its address)
    mirror: Any  # [4] int32 pinned host memory, written by the publish kernel behind every plan
    mirror_ptr: int  # its device address (cudaHostGetDevicePointer, queried once, outside any capture)
    view: Any  # numpy view of the mirror
    reported: list = field(default_factory=lambda: [0] * len(REASONS))


_STATES: dict = {}


@functools.lru_cache(maxsize=1)
def _module() -> Any:
    from sglang.kernels.jit.utils import load_jit
    from sglang.kernels.jit.utils.compile.paths import KERNEL_PATH

    return load_jit(
        "dspark_harden_guarded_compress_plan_v2",
        cuda_files=[str(CSRC)],
        cuda_wrappers=[
            ("plan_decode_guarded", "plan_compress_decode_guarded"),
            ("plan_prefill_guarded", "plan_compress_prefill_guarded"),
            ("mirror_device_pointer", "guard_mirror_device_pointer"),
        ],
        extra_include_paths=[str(KERNEL_PATH / "csrc")],
    )


def _index(device: Any) -> int:
    import torch

    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    return dev.index if dev.index is not None else torch.cuda.current_device()


def ensure_state(device: Any = None) -> GuardState:
    """The guard state of ``device``; created here, outside any graph capture, the first time."""
    import torch

    idx = _index(device)
    with _LOCK:
        st = _STATES.get(idx)
        if st is not None:
            return st
        if capturing():
            raise PlannerBoundsError(
                "DSV4 planner guard: a plan is being captured in a CUDA graph before the guard's counters "
                f"exist on cuda:{idx} (they are created at the first forward-metadata build, which stock "
                "runs eagerly before every capture); not capturing an unguarded or zero-filled plan "
                "(DSPARK_HARDEN_DSV4_PLANNER_GUARDS)"
            )
        with torch.cuda.device(idx):
            counts = torch.zeros(len(REASONS), dtype=torch.int32, device=torch.device("cuda", idx))
            mirror = torch.zeros(len(REASONS), dtype=torch.int32, pin_memory=True)
            ptr = int(_module().mirror_device_pointer(mirror))  # also JIT-builds and loads the planner here
            torch.cuda.synchronize(idx)
        st = _STATES[idx] = GuardState(counts, mirror, ptr, mirror.numpy())
        return st


def _state(device: Any) -> GuardState:
    st = _STATES.get(_index(device))
    return st if st is not None else ensure_state(device)


def check_pending(device: Any = None) -> None:
    """No sync: raise when the published counters grew since the last report (what the GPU has
    finished publishing so far; a plan still in flight is reported at a later call)."""
    st = _STATES.get(_index(device)) if _STATES else None
    if st is not None:
        report(st)


def report(st: GuardState, when: str = "") -> None:
    """:func:`check_pending` for a state already looked up (the per-step metadata wrapper's one lookup);
    ``when`` is appended to the message (where the report was read)."""
    now = [int(v) for v in st.view]
    if now == st.reported:
        return
    grew = [(REASONS[i], now[i] - st.reported[i]) for i in range(len(REASONS)) if now[i] != st.reported[i]]
    st.reported = now
    raise PlannerBoundsError(
        "DSV4 compress plan (device-side guard) would have indexed past an allocation since the last check: "
        + "; ".join(f"{why} (x{n})" for why, n in grew)
        + " -- the plans concerned were clamped in bounds (or planned empty) and are not valid: fail the batch"
        + (f" ({when})" if when else "")
        + " (DSPARK_HARDEN_DSV4_PLANNER_GUARDS)"
    )


def guarding() -> bool:
    """True once a guard state exists in this process (a guarded plan may have run)."""
    return bool(_STATES)


def report_all(when: str = "") -> None:
    """:func:`report` of every guard state of this process (a scheduler process has one device)."""
    for st in list(_STATES.values()):
        report(st, when)


def sync_current_streams() -> None:
    """Wait for the work queued so far on the current stream of each guarded device: what stock's
    ``.tolist()`` of a device result waits for on the non-overlap path, where the forward ran on that
    stream and no ``copy_done`` event exists."""
    import torch

    for idx in list(_STATES):
        torch.cuda.current_stream(idx).synchronize()


def check(device: Any = None) -> None:
    """:func:`check_pending` after a device sync (everything queued so far is published)."""
    import torch

    torch.cuda.synchronize(_index(device))
    check_pending(device)


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

    st = _state(req_pool_indices.device)
    plan_d = _module().plan_decode_guarded(
        req_pool_indices,
        req_to_token,
        full_to_state,
        seq_lens,
        st.counts,
        st.mirror_ptr,
        int(compress_ratio),
        int(swa_page_size),
        int(ring_size),
        bool(use_req_ring),
    )
    return CompressorDecodePlan(compress_ratio, torch.from_dlpack(plan_d))


def generate_prefill(
    compress_ratio,
    req_pool_indices,
    seq_lens,
    extend_lens,
    req_to_token,
    full_to_state,
    swa_page_size,
    ring_size,
    num_q_tokens,
    use_cuda_graph=False,
    use_req_ring=False,
):
    """``CompressorPrefillPlan.generate`` (CUDA, 0.5.23) with the device-side guard (same arguments and
    result: stock's pinned scratch for host lengths, its empty-plan shortcut only on HIP)."""
    import torch
    from sglang.kernels.ops.attention.dsv4.compress import _PREFILL_PLAN_BYTES, CompressorPrefillPlan

    is_gpu_input = seq_lens.device.type == "cuda"
    pin_buffer = torch.empty(
        0 if is_gpu_input else int(num_q_tokens) * _PREFILL_PLAN_BYTES,
        dtype=torch.uint8,
        pin_memory=not is_gpu_input,
    )
    st = _state(req_pool_indices.device)
    plan_c, plan_w = _module().plan_prefill_guarded(
        req_pool_indices,
        req_to_token,
        full_to_state,
        seq_lens,
        extend_lens,
        pin_buffer,
        st.counts,
        st.mirror_ptr,
        int(num_q_tokens),
        int(compress_ratio),
        int(swa_page_size),
        int(ring_size),
        bool(use_req_ring),
        bool(use_cuda_graph),
    )
    return CompressorPrefillPlan(compress_ratio, torch.from_dlpack(plan_c), torch.from_dlpack(plan_w), pin_buffer)
