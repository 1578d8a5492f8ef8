"""Features ``dsv4-sparse-prefill-pool``, ``dsv4-inplace-q-norm-rope``, ``dsv4-planner-guards``.

All three are opt-in, scheduler-only and need CUDA (explicitly enabled without it: startup stops
naming the reason). Patches, fingerprinted against sglang 0.5.23:

* ``flash_mla_interface.flash_mla_sparse_fwd`` (wrap): the call runs inside the private memory pool
  reserved for the largest sparse-prefill shape (:mod:`.pool`); the DSV4 backend imports the
  function from the module at every call, so the module attribute is the one it uses;
* ``DeepseekV4AttnBackend.__init__`` (wrap): reserve that pool once per process, after the weights
  are loaded and before graph capture (the attention backend is created between the two);
* ``MQALayer._compute_q_b`` (wrap): the ``q_head_norm`` path runs ``fused_q_norm_rope`` in place
  (:mod:`.qnorm`); every other branch calls stock;
* ``CompressorPrefillPlan.generate`` / ``CompressorDecodePlan.generate`` (wrap): host-side bounds
  checks before the planner kernels launch (:mod:`.planner`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..core.feature import Feature
from ..core.hookspecs import hookimpl
from ..core.patch import Kind, Patch, Role
from . import settings as S

logger = logging.getLogger("dspark_harden.dsv4_memory")


@hookimpl
def dspark_metrics():
    from .metrics import GROUP

    return [GROUP]


def _cuda_reason() -> Optional[str]:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return f"torch is not importable: {exc}"
    if not torch.cuda.is_available():
        return "needs CUDA: torch.cuda.is_available() is False on this host (DSV4 kernels run on NVIDIA GPUs only)"
    return None


def _pool_available(settings: Any) -> Optional[str]:
    reason = _cuda_reason()
    if reason:
        return reason
    try:
        import flash_mla
    except Exception as exc:  # noqa: BLE001
        return f"FlashMLA (sgl-flash-mla) is not importable: {type(exc).__name__}: {exc}"
    from .pool import caller_owned_output_supported

    if caller_owned_output_supported(flash_mla.flash_mla_sparse_fwd):
        return ("the installed FlashMLA's flash_mla_sparse_fwd takes caller-owned outputs; this dspark-harden "
                "release knows only sgl-flash-mla 1.0.0's allocating API and will not guess the new one")
    return None


def _available(settings: Any) -> Optional[str]:
    return _cuda_reason()


@hookimpl
def dspark_features():
    common = dict(area="dsv4-memory", default_on=False, roles=frozenset({Role.SCHEDULER}))
    return [
        Feature(name=S.POOL_FEATURE, switch=S.POOL, available=_pool_available,
                description="DSV4 sparse-prefill FlashMLA outputs served from a private CUDA memory pool reserved "
                            "at start-up for the largest shape (no fresh contiguous block after fragmentation)",
                **common),
        Feature(name=S.QNORM_FEATURE, switch=S.QNORM, available=_available,
                description="DSV4 q_head_norm Q norm + RoPE in place (one tokens x heads x 512 buffer less per "
                            "layer call)", **common),
        Feature(name=S.GUARDS_FEATURE, switch=S.GUARDS, available=_available,
                description="host-side bounds checks of the DSV4 compress planner before every launch", **common),
    ]


@hookimpl
def dspark_settings():
    return list(S.SETTINGS)


def pool_capacity(settings: Any, server_args: Any) -> int:
    if settings[S.POOL_TOKENS]:
        return int(settings[S.POOL_TOKENS])
    chunk = getattr(server_args, "chunked_prefill_size", None)
    if chunk is not None and chunk > 0:
        return int(chunk)
    return int(getattr(server_args, "max_prefill_tokens"))


def _local_heads(model_runner: Any) -> int:
    from sglang.srt.layers.dp_attention import get_attention_tp_size

    return int(model_runner.model_config.num_attention_heads) // int(get_attention_tp_size())


def reserve_for_backend(backend: Any, model_runner: Any, settings: Any) -> None:
    from . import metrics as m
    from . import pool as P

    want = P.SparsePrefillPool(
        tokens=pool_capacity(settings, model_runner.server_args), heads=_local_heads(model_runner),
        d_v=int(backend.head_dim_v), device=backend.device, slots=int(settings[S.POOL_SLOTS]),
    )
    cur = P.POOL
    if cur is not None:
        if want.tokens <= cur.tokens and want.heads == cur.heads and want.d_v == cur.d_v:
            return  # another DSV4 backend of this process (multi-step / draft): same reservation
        raise P.SparsePrefillPoolError(
            f"a second DSV4 attention backend needs {want.tokens} tokens x {want.heads} heads x d_v {want.d_v}, the "
            f"process reserved {cur.tokens} x {cur.heads} x {cur.d_v}"
        )
    P.POOL = want.reserve()
    m.pool_reserved(P.POOL.reserved_bytes)


def _build_backend_init(settings: Any):
    def build(stock):
        def __init__(self, model_runner, *args, **kwargs):
            stock(self, model_runner, *args, **kwargs)
            reserve_for_backend(self, model_runner, settings)

        return __init__

    return build


def _build_sparse_fwd(stock):
    from . import metrics as m
    from .pool import build_sparse_fwd

    return build_sparse_fwd(stock, m.pool_call, m.pool_refused)


def _build_q_b(stock):
    from . import metrics as m
    from .qnorm import build_compute_q_b

    return build_compute_q_b(stock, m.qnorm_call)


def _build_prefill_plan(stock):
    from . import metrics as m
    from .planner import build_prefill_generate, unwrap

    return build_prefill_generate(unwrap(stock), m.planner_check)


def _build_decode_plan(stock):
    from . import metrics as m
    from .planner import build_decode_generate, unwrap

    return build_decode_generate(unwrap(stock), m.planner_check)


def patches(role: Role, settings: Any) -> list:
    if role is not Role.SCHEDULER:
        return []
    out = []
    if settings[S.POOL]:
        common = dict(feature=S.POOL_FEATURE, roles={Role.SCHEDULER})
        out += [
            Patch(target=S.FLASH_MLA_TARGET, kind=Kind.WRAP, build=_build_sparse_fwd,
                  fingerprint=S.FLASH_MLA_FINGERPRINT, requires_cuda=True,
                  why="sgl-flash-mla 1.0.0 allocates the sparse-prefill output (1 GiB at 8k tokens x 128 heads) and "
                      "its statistics on every layer call; after fragmentation a fresh contiguous block may not exist",
                  retire_when="FlashMLA's sparse prefill takes caller-owned outputs and SGLang's DSV4 backend passes a "
                              "reserved workspace", **common),
            Patch(target=S.BACKEND_INIT_TARGET, kind=Kind.WRAP, build=_build_backend_init(settings),
                  fingerprint=S.BACKEND_INIT_FINGERPRINT,
                  why="reserve the sparse-prefill pool after the weights load and before graph capture",
                  retire_when="as the flash_mla_sparse_fwd patch", **common),
        ]
    if settings[S.QNORM]:
        out.append(Patch(
            target=S.Q_B_TARGET, kind=Kind.WRAP, build=_build_q_b, fingerprint=S.Q_B_FINGERPRINT,
            feature=S.QNORM_FEATURE, roles={Role.SCHEDULER},
            why="stock allocates q_out = torch.empty_like(q) per layer call for an out-of-place fused_q_norm_rope "
                "although the kernel is alias-safe",
            retire_when="SGLang's _compute_q_b runs fused_q_norm_rope in place"))
    if settings[S.GUARDS]:
        common = dict(feature=S.GUARDS_FEATURE, roles={Role.SCHEDULER})
        out += [
            Patch(target=S.PREFILL_PLAN_TARGET, kind=Kind.WRAP, build=_build_prefill_plan,
                  fingerprint=S.PREFILL_PLAN_FINGERPRINT,
                  why="the GPU-input prefill planner appends one plan entry per extend token into buffers sized "
                      "num_q_tokens and trusts extend/sequence lengths and req_to_token indices unchecked",
                  retire_when="c_plan.cuh validates its inputs on every path", **common),
            Patch(target=S.DECODE_PLAN_TARGET, kind=Kind.WRAP, build=_build_decode_plan,
                  fingerprint=S.DECODE_PLAN_FINGERPRINT,
                  why="the decode planner indexes req_to_token[rid, seq_len - 1] and full_to_state unchecked",
                  retire_when="c_plan.cuh validates its inputs on every path", **common),
        ]
    return out


@hookimpl
def dspark_patches(role, settings):
    return patches(role, settings)


@hookimpl
def dspark_process_bound(role, settings, report):
    """Say what the bound features reserve / save (``dspark-harden check`` shows it)."""
    from .pool import reservation_bytes
    from .qnorm import saved_bytes

    for feat in report.features:
        if feat.status not in ("bound", "disabled", "unavailable"):
            continue
        prefix = "" if feat.status == "bound" else f"{feat.detail}; when enabled: "
        if feat.name == S.POOL_FEATURE:
            tokens = settings[S.POOL_TOKENS]
            slots = settings[S.POOL_SLOTS]
            example = reservation_bytes(tokens or 8192, 128, 512, slots)
            feat.detail = prefix + (f"reserves {slots} x {tokens or '--chunked-prefill-size'} tokens x local heads x "
                           f"(512 x 2 + 8) bytes at model init (e.g. {tokens or 8192} tokens x 128 heads: "
                           f"{example} bytes)")
        elif feat.name == S.QNORM_FEATURE:
            feat.detail = prefix + ("saves tokens x heads x 512 x 2 bytes per layer call (128 heads: "
                           + ", ".join(f"{t // 1024}k tokens {saved_bytes(t, 128)} bytes" for t in (4096, 8192, 16384))
                           + ")")
