"""Features ``dsv4-sparse-prefill-pool``, ``dsv4-inplace-q-norm-rope``, ``dsv4-planner-guards``.

All three are opt-in, scheduler-only and need CUDA (explicitly enabled without it: startup stops
naming the reason). Patches, fingerprinted against sglang 0.5.23:

* ``flash_mla_interface.flash_mla_sparse_fwd`` (wrap): the call runs inside the private memory pool
  reserved for the largest sparse-prefill shape (:mod:`.pool`); the DSV4 backend imports the
  function from the module at every call, so the module attribute is the one it uses;
* ``DeepseekV4AttnBackend.__init__`` (wrap, bound with any of the three, owned by the first enabled one):
  reserve that pool once per process, after the weights are loaded and before graph capture (the
  attention backend is created between the two), then run each enabled feature's start-up self-test on
  the device (:mod:`.selftest`);
* ``MQALayer._compute_q_b`` (wrap): the ``q_head_norm`` path runs ``fused_q_norm_rope`` in place
  (:mod:`.qnorm`); every other branch calls stock;
* ``CompressorPrefillPlan.generate`` / ``CompressorDecodePlan.generate`` (wrap): the device-side guarded
  planners (:mod:`.planner_device`) with the free host checks before the launch (:mod:`.planner`);
  ``DeepseekV4AttnBackend.init_forward_metadata`` / ``init_forward_metadata_out_graph`` (wrap): the guard's
  report read (no sync) at every forward-metadata build, eager and graph replay;
  ``SchedulerBatchResultProcessor.process_batch_result_prefill`` / ``_decode`` and the PD prefill server's
  ``process_batch_result_disagg_prefill`` (wrap): the report read again at the step's result sync (after the
  wait for the step's result copy), before stock appends or streams a token of the step.
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
        return (
            "the installed FlashMLA's flash_mla_sparse_fwd takes caller-owned outputs; this dspark-harden "
            "release knows only sgl-flash-mla 1.0.0's allocating API and will not guess the new one"
        )
    return None


def _available(settings: Any) -> Optional[str]:
    return _cuda_reason()


def kernel_source_drift(allow: tuple = ()) -> list[str]:
    """``"<file> (expected X, found Y)"`` for each stock kernel source the planner guard copies or relies on
    whose installed text changed (sglang/kernels/jit/csrc), and each drifted ``generate_online``; names
    (``deepseek_v4/c_plan.cuh``, a ``generate_online`` target) or ``all`` in ``allow`` are skipped."""
    import hashlib
    import importlib.util
    import pathlib

    from ..core.patch import source_drift

    spec = importlib.util.find_spec("sglang")
    root = pathlib.Path(next(iter(spec.submodule_search_locations))) / "kernels" / "jit" / "csrc"
    out = []
    for rel, expected in S.KERNEL_SOURCES.items():
        if "all" in allow or rel in allow:
            continue
        try:
            found = hashlib.sha256((root / rel).read_bytes()).hexdigest()[:16]
        except OSError as exc:
            found = f"unreadable: {exc}"
        if found != expected:
            out.append(f"{root / rel} (expected {expected}, found {found})")
    return out + source_drift({}, text=dict(S.ONLINE_PLAN_SOURCES), allow=allow)


def _guards_available(settings: Any) -> Optional[str]:
    reason = _cuda_reason()
    if reason:
        return reason
    drifted = kernel_source_drift(tuple(settings.get("DSPARK_HARDEN_ALLOW_DRIFT", ()) or ()))
    if drifted:
        return (
            "the stock planner sources the device-side guard copies (c_plan.cuh) or relies on (generate_online "
            "reads no req_to_token) changed: " + "; ".join(drifted) + " (DSPARK_HARDEN_ALLOW_DRIFT names them)"
        )
    return None


@hookimpl
def dspark_features():
    common = dict(area="dsv4-memory", default_on=False, roles=frozenset({Role.SCHEDULER}))
    return [
        Feature(
            name=S.POOL_FEATURE,
            switch=S.POOL,
            available=_pool_available,
            description="DSV4 sparse-prefill FlashMLA outputs served from a private CUDA memory pool reserved "
            "at start-up for the largest shape (no fresh contiguous block after fragmentation)",
            **common,
        ),
        Feature(
            name=S.QNORM_FEATURE,
            switch=S.QNORM,
            available=_available,
            description="DSV4 q_head_norm Q norm + RoPE in place (one tokens x heads x 512 buffer less per layer call)",
            **common,
        ),
        Feature(
            name=S.GUARDS_FEATURE,
            switch=S.GUARDS,
            available=_guards_available,
            description="every DSV4 compress plan (eager, captured, replayed) through a device-side guarded planner: "
            "no device sync, out-of-bounds indices clamped and the step failed at its result sync, before its tokens "
            "are released",
            **common,
        ),
    ]


@hookimpl
def dspark_settings():
    return list(S.SETTINGS)


def prefill_graph_bucket_max() -> Optional[int]:
    """The largest prefill CUDA-graph bucket (tokens) this process captures, from the published runtime
    config (``cuda_graph_config.prefill``), or None when prefill graphs are off. Under DP attention a
    replayed prefill is padded to its bucket (MAX_LEN: the smallest bucket >= the largest rank's tokens),
    and an idle rank's dummy extend covers the whole bucket, so sparse-prefill calls see up to this many
    tokens even when the chunk is smaller."""
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import get_prefill_num_tokens_to_capture
    from sglang.srt.runtime_context import get_exec

    cfg = get_exec().graph.cuda_graph_config.prefill
    if str(cfg.backend).lower() in (Backend.DISABLED, "none") or not cfg.bs:
        return None
    return int(max(get_prefill_num_tokens_to_capture(cfg.bs)))


def pool_capacity(settings: Any, server_args: Any, bucket_max: Optional[int] = None) -> int:
    """Tokens to reserve: the explicit capacity, else the chunk (``--chunked-prefill-size``, or
    ``--max-prefill-tokens`` without chunking), raised to the largest prefill-graph bucket when prefill
    graphs are on. An explicit capacity below that bucket stops start-up naming both."""
    if settings[S.POOL_TOKENS]:
        tokens = int(settings[S.POOL_TOKENS])
        if bucket_max is not None and tokens < bucket_max:
            from .pool import SparsePrefillPoolError

            raise SparsePrefillPoolError(
                f"DSPARK_HARDEN_DSV4_SPARSE_PREFILL_TOKENS={tokens} cannot hold the largest prefill CUDA-graph "
                f"bucket ({bucket_max} tokens): under DP attention a replayed prefill is padded to its bucket and "
                f"an idle rank's dummy extend covers the whole bucket; raise it to >= {bucket_max} or unset it"
            )
        return tokens
    chunk = getattr(server_args, "chunked_prefill_size", None)
    tokens = int(chunk) if chunk is not None and chunk > 0 else int(server_args.max_prefill_tokens)
    return max(tokens, bucket_max or 0)


def _local_heads(model_runner: Any) -> int:
    from sglang.srt.layers.dp_attention import get_attention_tp_size

    return int(model_runner.model_config.num_attention_heads) // int(get_attention_tp_size())


def _uses_q8kv8(backend: Any) -> bool:
    from sglang.srt.layers.attention.dsv4.sparse_prefill_utils import use_dsv4_q8kv8_sparse_prefill

    return bool(use_dsv4_q8kv8_sparse_prefill(getattr(backend, "dsv4_prefill_backend", "auto")))


def reserve_for_backend(backend: Any, model_runner: Any, settings: Any) -> None:
    from . import metrics as m
    from . import pool as P

    if getattr(backend, "mega_attn", False):
        raise P.SparsePrefillPoolError(
            "DSPARK_HARDEN_DSV4_SPARSE_PREFILL_POOL=1 with the DeepSeek V4 MegaAttention backend: its prefill "
            "(DeepseekV4MegaAttnBackend._forward_mega_prefill -> flash_mla_mega_prefill) allocates its outputs itself "
            "and the pool does not cover it; turn the pool off or use the standard DSV4 attention backend"
        )
    tokens = pool_capacity(settings, model_runner.server_args, prefill_graph_bucket_max())
    common = dict(tokens=tokens, d_v=int(backend.head_dim_v), device=backend.device, slots=int(settings[S.POOL_SLOTS]))
    if _uses_q8kv8(backend):  # Q8KV8 prefill never calls flash_mla_sparse_fwd: no MemPool reservation
        from sglang.kernels.ops.attention.sparse_mla_q8kv8_prefill_sm90 import q8kv8_padded_num_heads

        attr, what = "Q8", "Q8KV8 outputs of "
        want = P.Q8KV8Reservation(heads=int(q8kv8_padded_num_heads(_local_heads(model_runner))), **common)
    else:
        attr, what = "POOL", ""
        want = P.SparsePrefillPool(heads=_local_heads(model_runner), **common)
    cur = getattr(P, attr)
    if cur is not None:
        if want.tokens <= cur.tokens and want.heads == cur.heads and want.d_v == cur.d_v:
            return  # another DSV4 backend of this process (multi-step / draft): same reservation
        raise P.SparsePrefillPoolError(
            f"a second DSV4 attention backend needs {what}{want.tokens} tokens x {want.heads} heads x d_v {want.d_v}, "
            f"the process reserved {cur.tokens} x {cur.heads} x {cur.d_v}"
        )
    setattr(P, attr, want.reserve())
    m.pool_reserved(getattr(P, attr).reserved_bytes)


def _build_backend_init(settings: Any):
    def build(stock):
        def __init__(self, model_runner, *args, **kwargs):
            stock(self, model_runner, *args, **kwargs)
            if settings[S.POOL]:
                reserve_for_backend(self, model_runner, settings)
            from .selftest import run_for_backend

            run_for_backend(self, model_runner, settings)

        return __init__

    return build


def _backend_init_owner(settings: Any) -> Optional[str]:
    """The feature the ``DeepseekV4AttnBackend.__init__`` wrap is bound for: the first enabled of the three
    (the pool's reservation and every enabled feature's self-test run there; a target binds once)."""
    return next(
        (
            f
            for f, switch in ((S.POOL_FEATURE, S.POOL), (S.QNORM_FEATURE, S.QNORM), (S.GUARDS_FEATURE, S.GUARDS))
            if settings[switch]
        ),
        None,
    )


def _build_sparse_fwd(stock):
    from . import metrics as m
    from .pool import build_sparse_fwd

    return build_sparse_fwd(stock, m.pool_call, m.pool_refused, m.pool_captured)


def _build_q8kv8_fwd(stock):
    from . import metrics as m
    from .pool import build_q8kv8_fwd

    return build_q8kv8_fwd(stock, m.pool_call, m.pool_refused, m.pool_captured)


def _build_q_b(stock):
    from . import metrics as m
    from .qnorm import build_compute_q_b

    return build_compute_q_b(stock, m.qnorm_call)


def _build_plan(kind: str, settings: Any):
    def build(stock):
        from . import metrics as m
        from . import planner

        builder = planner.build_prefill_generate if kind == "prefill" else planner.build_decode_generate
        return builder(planner.unwrap(stock), m.planner_check, sync_checks=settings[S.GUARDS_SYNC])

    return build


def _build_metadata_report(stock):
    from .planner import build_metadata_report

    return build_metadata_report(stock)


def _build_result_check(stock):
    from .planner import build_result_check

    return build_result_check(stock)


def patches(role: Role, settings: Any) -> list:
    if role is not Role.SCHEDULER:
        return []
    out = []
    if settings[S.POOL]:
        common = dict(feature=S.POOL_FEATURE, roles={Role.SCHEDULER})
        out += [
            Patch(
                target=S.FLASH_MLA_TARGET,
                kind=Kind.WRAP,
                build=_build_sparse_fwd,
                fingerprint=S.FLASH_MLA_FINGERPRINT,
                requires_cuda=True,
                why="sgl-flash-mla 1.0.0 allocates the sparse-prefill output (1 GiB at 8k tokens x 128 heads) and "
                "its statistics on every layer call; after fragmentation a fresh contiguous block may not exist",
                retire_when="FlashMLA's sparse prefill takes caller-owned outputs and SGLang's DSV4 backend passes a "
                "reserved workspace",
                **common,
            ),
            Patch(
                target=S.Q8KV8_TARGET,
                kind=Kind.WRAP,
                build=_build_q8kv8_fwd,
                fingerprint=S.Q8KV8_FINGERPRINT,
                requires_cuda=True,
                why="the SM90 Q8KV8 sparse prefill (H200's prefill path) allocates fresh out / max_logits / lse on "
                "every layer call although it takes caller-owned outputs",
                retire_when="SGLang's DSV4 backend passes reserved outputs to sparse_mla_q8kv8_prefill_fwd",
                **common,
            ),
        ]
    owner = _backend_init_owner(settings)
    if owner is not None:
        out.append(
            Patch(
                target=S.BACKEND_INIT_TARGET,
                kind=Kind.WRAP,
                build=_build_backend_init(settings),
                fingerprint=S.BACKEND_INIT_FINGERPRINT,
                feature=owner,
                roles={Role.SCHEDULER},
                why="reserve the sparse-prefill pool (when on) after the weights load and before graph capture, and "
                "run each enabled DSV4 feature's start-up self-test on the device there (its kernels are "
                "per-architecture code proven on sm_90 only)",
                retire_when="the pool's and the other patches' conditions; the self-tests go with their features",
            )
        )
    if settings[S.QNORM]:
        out.append(
            Patch(
                target=S.Q_B_TARGET,
                kind=Kind.WRAP,
                build=_build_q_b,
                fingerprint=S.Q_B_FINGERPRINT,
                feature=S.QNORM_FEATURE,
                roles={Role.SCHEDULER},
                why="stock allocates q_out = torch.empty_like(q) per layer call for an out-of-place fused_q_norm_rope "
                "although the kernel is alias-safe",
                retire_when="SGLang's _compute_q_b runs fused_q_norm_rope in place",
            )
        )
    if settings[S.GUARDS]:
        common = dict(feature=S.GUARDS_FEATURE, roles={Role.SCHEDULER})
        out += [
            Patch(
                target=S.PREFILL_PLAN_TARGET,
                kind=Kind.WRAP,
                build=_build_plan("prefill", settings),
                fingerprint=S.PREFILL_PLAN_FINGERPRINT,
                why="the GPU-input prefill planner appends one plan entry per extend token into buffers sized "
                "num_q_tokens and trusts extend/sequence lengths and req_to_token indices unchecked",
                retire_when="c_plan.cuh validates its inputs on every path",
                **common,
            ),
            Patch(
                target=S.DECODE_PLAN_TARGET,
                kind=Kind.WRAP,
                build=_build_plan("decode", settings),
                fingerprint=S.DECODE_PLAN_FINGERPRINT,
                why="the decode planner indexes req_to_token[rid, seq_len - 1] and full_to_state unchecked",
                retire_when="c_plan.cuh validates its inputs on every path",
                **common,
            ),
        ]
        out += [
            Patch(
                target=target,
                kind=Kind.WRAP,
                build=_build_metadata_report,
                fingerprint=fp,
                why="report the device-side planner guard's violations (a pinned mirror, no sync) at every "
                "forward-metadata build, graph replays included, and create its counters before any capture",
                retire_when="c_plan.cuh validates its inputs on every path",
                **common,
            )
            for target, fp in (
                (S.METADATA_TARGET, S.METADATA_FINGERPRINT),
                (S.METADATA_OUT_GRAPH_TARGET, S.METADATA_OUT_GRAPH_FINGERPRINT),
            )
        ]
        out += [
            Patch(
                target=target,
                kind=Kind.WRAP,
                build=_build_result_check,
                fingerprint=fp,
                why="the guard's report reaches the host a step or two after the plan that hit it; the step's "
                "result sync (the copy stock waits for before appending and streaming its tokens) is the first "
                "point where the mirror is exact for the step: read it there, before the tokens are released",
                retire_when="c_plan.cuh validates its inputs on every path",
                **common,
            )
            for target, fp in S.RESULT_SYNC_TARGETS.items()
        ]
    return out


@hookimpl
def dspark_patches(role, settings):
    return patches(role, settings)


#: what each feature's start-up self-test proves on the device (:mod:`.selftest`), for ``check``
SELF_TESTS = {
    S.POOL_FEATURE: "a pooled sparse-prefill call into NaN-filled reserved blocks = a fresh allocation, bit for bit",
    S.QNORM_FEATURE: "in-place Q norm + RoPE = out of place, bit for bit, at a live layer's heads",
    S.GUARDS_FEATURE: "guarded plans = stock's bit for bit, and a crafted out-of-bounds plan caught",
}


@hookimpl
def dspark_process_bound(role, settings, report):
    """Say what the bound features reserve / save, what each proves at start-up, and the compute capabilities
    the DSV4 GPU suites ran on against this host's GPU (``dspark-harden check`` shows it)."""
    from .pool import reservation_bytes
    from .qnorm import saved_bytes

    if not any(f.name in SELF_TESTS and f.status in ("bound", "disabled", "unavailable") for f in report.features):
        return
    from ..core import roles
    from .selftest import host_device_line

    # the host's GPU line (an nvidia-smi run) is for `dspark-harden check` only: a serving process -- every
    # SGLang process of an image with the plugin installed, DSV4 or not -- spawns nothing for it (a bound
    # feature's self-test names the device and compute capability itself)
    in_server = roles.CONTEXT is not None and roles.CONTEXT.server_args is not None
    device_line = "" if in_server else host_device_line()
    for feat in report.features:
        if feat.status not in ("bound", "disabled", "unavailable"):
            continue
        prefix = "" if feat.status == "bound" else f"{feat.detail}; when enabled: "
        if feat.name == S.POOL_FEATURE:
            tokens = settings[S.POOL_TOKENS]
            slots = settings[S.POOL_SLOTS]
            example = reservation_bytes(tokens or 8192, 128, 512, slots)
            feat.detail = prefix + (
                f"reserves {slots} x {tokens or '--chunked-prefill-size'} tokens x local heads x "
                f"(512 x 2 + 8) bytes at model init (e.g. {tokens or 8192} tokens x 128 heads: "
                f"{example} bytes)"
            )
        elif feat.name == S.QNORM_FEATURE:
            feat.detail = prefix + (
                "saves tokens x heads x 512 x 2 bytes per layer call (128 heads: "
                + ", ".join(f"{t // 1024}k tokens {saved_bytes(t, 128)} bytes" for t in (4096, 8192, 16384))
                + ")"
            )
        if feat.name in SELF_TESTS:
            tail = f"start-up self-test: {SELF_TESTS[feat.name]}" + (f"; {device_line}" if device_line else "")
            feat.detail = f"{feat.detail}; {tail}" if feat.detail else tail
