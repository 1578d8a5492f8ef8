"""Feature ``prefill-graph-dp``: pluggy hooks (feature, settings, patches, startup, CLI).

On by default (``DSPARK_HARDEN_PREFILL_GRAPH=1``) wherever DP attention and a breakable/full
prefill CUDA graph are both enabled; elsewhere it reports ``unavailable`` with the reason (and
fails startup if it was switched on explicitly). Scheduler processes only. ``dspark-harden check``
children have no ``server_args``: they bind every target to prove it resolves and matches its
fingerprint. See docs/prefill_graph.md.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..core import roles
from ..core.feature import Feature, bound_status
from ..core.hookspecs import hookimpl
from ..core.patch import Kind, Patch, Role
from . import settings as S

logger = logging.getLogger("dspark_harden.prefill_graph")

FEATURE = S.FEATURE
VOTE_TARGET = "sglang.srt.managers.scheduler_components.dp_attn:_local_prefill_cuda_graph_vote"
VOTE_FINGERPRINT = "d8d2567ffd94fd3c"
GATHER_TARGET = "sglang.srt.managers.scheduler_components.dp_attn:_update_gather_batch"
GATHER_FINGERPRINT = "5037741d20e87480"
GUARD_TARGET = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner.can_run_graph"
GUARD_FINGERPRINT = "17b6d0a2d992c430"
EXECUTE_TARGET = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner.execute"
EXECUTE_FINGERPRINT = "789565427f919f88"
LOAD_BATCH_TARGET = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner.load_batch"
LOAD_BATCH_FINGERPRINT = "f587ddb3656b1b0f"
TBO_CAPTURE_TARGET = "sglang.srt.batch_overlap.two_batch_overlap:TboCudaGraphRunnerPlugin.capture_one_batch_size"
TBO_CAPTURE_FINGERPRINT = "d85b8103b94a70ff"
TBO_OUT_GRAPH_TARGET = "sglang.srt.layers.attention.tbo_backend:TboAttnBackend.init_forward_metadata_out_graph"
TBO_OUT_GRAPH_FINGERPRINT = "b280af1179e37533"
#: DSPARK_HARDEN_PREFILL_GRAPH_TBO=1: (target, fingerprint, tbo_graph builder, why)
TBO_PATCHES = (
    (
        TBO_CAPTURE_TARGET,
        TBO_CAPTURE_FINGERPRINT,
        "build_capture_one_batch_size",
        "stock splits a prefill capture batch with extend_lens=None (asserts); EXTEND captures get the fixed "
        "flat-token split with children on the captured request axis (decode graphs: stock)",
    ),
    (
        TBO_OUT_GRAPH_TARGET,
        TBO_OUT_GRAPH_FINGERPRINT,
        "build_out_graph",
        "stock plans TBO children of a replay view with the uniform per-sequence split (asserts for EXTEND) or "
        "from the live batch's eager children; the replayed graph holds the fixed split",
    ),
    (
        LOAD_BATCH_TARGET,
        LOAD_BATCH_FINGERPRINT,
        "build_load_batch",
        "no prefill replay_prepare exists: the children's per-slot buffers and num_token_non_padded counts "
        "the captured graph reads must be refreshed on every replay",
    ),
)
# read-only: the guard and the schedule-time views reproduce logic of these stock sources; a change to
# any of them is drift (probe below). Each entry says what the decision mirrors from it.
MIRRORED = {
    # the two extra prefill-graph conditions (token_indices_to_pool, CP) and the eager fallback
    "sglang.srt.model_executor.model_runner:ModelRunner._forward_raw": "1281a6b06f680b78",
    # MAX_LEN + shared bucket, the idle rank's dummy extend, the decode relabel, and the hybrid-SSM
    # IDLE -> TARGET_VERIFY relabel (modelled: finalize keeps such idle ranks out, decision.finalize)
    "sglang.srt.model_executor.forward_batch_info:ForwardBatch.prepare_mlp_sync_batch": "ec41c6440f6cdec8",
    # the capture mode a batch gets (worker override, else request/server mode, draft NULL)
    "sglang.srt.model_executor.forward_batch_info:ForwardBatch.init_new": "a8507017588bae5b",
    # token_indices_to_pool only for prefill-only batches in which every request carries it
    "sglang.srt.model_executor.forward_batch_info:ForwardBatch._maybe_init_non_generation_fields": "a7736e6c97b1feb5",
    # the breakable decode -> extend conversion the decode view predicts (and when it happens)
    "sglang.srt.managers.schedule_batch:ScheduleBatch.convert_decode_to_extend": "b0acf2ad64192053",
    "sglang.srt.managers.scheduler_components.dp_attn:SchedulerDPAttnAdapter.maybe_convert_decode_to_extend": "2a530b1ae1d139fd",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner.can_replay_locally": "05e05454a5bc1cd5",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner._has_inactive_dp_rank": "a754ed52a0911d49",
    # which runners get prefill graphs: a draft runner only when its worker forces it (item: draft runners)
    "sglang.srt.model_executor.model_runner_components.cuda_graph_setup:capture_prefill_graph": "8216b95b70a93038",
}
# the speculative workers' capture_hidden_mode overrides (decision.WORKER_CAPTURE), and the one worker
# that forces draft prefill graphs (refused under this feature); read from the source text (no import)
MIRRORED_TEXT = {
    "sglang.srt.speculative.dspark_components.dspark_worker_v2:DSparkWorkerV2.forward_batch_generation": "82d94dc48a0a67a3",
    "sglang.srt.speculative.dspark_components.dspark_worker_v2:DSparkWorkerV2._forward_prefill": "e6ae0c518dee24fc",
    "sglang.srt.speculative.eagle_worker_v2:EagleDraftWorker.init_cuda_graphs": "2e9c46c198c4f202",
}


def probe_mirrored_sources() -> tuple:
    from ..core.patch import source_drift

    drifted = source_drift(MIRRORED, text=MIRRORED_TEXT)
    if drifted:
        return False, "stock sources the prefill-graph decision reproduces changed: " + "; ".join(drifted)
    return True, f"{len(MIRRORED) + len(MIRRORED_TEXT)} mirrored stock sources match their fingerprints"


def speculative_algorithm_name(server_args: Any) -> str:
    raw = getattr(server_args, "speculative_algorithm", None)
    if raw is None:
        return "NONE"
    return str(getattr(raw, "name", raw)).upper()


def speculative_refusal(server_args: Any) -> Optional[str]:
    """Why this speculative configuration is refused under the feature (``None``: modelled)."""
    from .decision import WORKER_CAPTURE

    name = speculative_algorithm_name(server_args)
    if name in WORKER_CAPTURE:
        return None
    return (
        f"speculative algorithm {name} with prefill CUDA graphs under DP attention is refused: the one DP "
        f"prefill-graph decision models the capture_hidden_mode a speculative worker passes to "
        f"ForwardBatch.init_new only for {', '.join(WORKER_CAPTURE)}, and covers the target runner only, while "
        f"EAGLE-family workers also capture draft prefill graphs (EagleDraftWorker.init_cuda_graphs with the "
        f"breakable backend) whose batches would inherit the target's verdict for buckets no admission "
        f"checked. Use DSPARK_HARDEN_PREFILL_GRAPH=0 (stock admission) or --cuda-graph-backend-prefill disabled"
    )


def _resolved(server_args: Any) -> Any:
    try:
        from sglang.srt.arg_groups.model_override_base import resolved_view

        return resolved_view(server_args)
    except Exception:  # noqa: BLE001 - unresolved args (tests): read the raw fields
        return None


def prefill_backend(server_args: Any) -> Optional[str]:
    from .tbo import prefill_backend as from_config

    view = _resolved(server_args)
    backend = from_config(view) if view is not None else None
    if backend is None:
        backend = from_config(server_args)
    if backend is None:
        raw = getattr(server_args, "cuda_graph_backend_prefill", None)
        backend = None if raw is None else str(raw).lower()
    return backend


def dp_attention(server_args: Any) -> bool:
    if getattr(server_args, "enable_dp_attention", False):
        return True
    view = _resolved(server_args)
    return bool(view is not None and (getattr(view, "attn_dp_size", 1) or 1) > 1)


def geometry(server_args: Any) -> tuple:
    """``(tp_size, attn_dp_size, attn_tp_size)`` of the resolved server arguments."""
    view = _resolved(server_args) or server_args
    tp = int(getattr(view, "tp_size", 1) or 1)
    attn_dp = int(getattr(view, "attn_dp_size", 0) or 0)
    if attn_dp <= 1 and getattr(view, "enable_dp_attention", False):  # unresolved: the deprecated flag
        attn_dp = int(getattr(view, "dp_size", 1) or 1)
    attn_dp = max(1, attn_dp)
    attn_cp = int(getattr(view, "attn_cp_size", 1) or 1)
    return tp, attn_dp, max(1, tp // attn_dp // attn_cp)


def preconditions(server_args: Any, *, tbo_switch: bool = False) -> list:
    """Why the feature cannot apply to this server (empty: it applies). Each entry names the launch flag
    (or the switch) to change; decided at bind time from the process's real ``ServerArgs``, so nothing the
    arguments already tell is left to fail after the weights load."""
    out = []
    if not dp_attention(server_args):
        out.append(
            "DP attention is off (--enable-dp-attention / --attn-dp-size): no DP prefill-graph decision to share"
        )
        return out
    backend = prefill_backend(server_args)
    if backend not in ("full", "breakable"):
        out.append(
            f"prefill CUDA graphs are not enabled (cuda_graph_config[prefill].backend={backend}; "
            "--cuda-graph-backend-prefill breakable|full)"
        )
        return out
    tp, attn_dp, attn_tp = geometry(server_args)
    if (attn_dp, attn_tp) != (2, 1):
        out.append(
            f"the shared decision is built and checked for two DP attention ranks with attention-TP 1 "
            f"(--tp 2 --dp 2 --enable-dp-attention); this server has --tp {tp} with {attn_dp} attention-DP "
            f"rank(s) of attention-TP {attn_tp}: other geometries keep stock's admission until the decision is "
            f"proven on them"
        )
    view = _resolved(server_args) or server_args
    spec = speculative_refusal(view)
    if spec:
        out.append(spec)
    from . import tbo

    refused = tbo.refusal(view, allow_full=tbo_switch)
    if refused:
        out.append(refused)
    return out


def _available(settings) -> Optional[str]:
    server_args = roles.judged_server_args()
    if server_args is None:
        return None  # self-check child: bind everything to prove the targets
    problems = preconditions(server_args, tbo_switch=settings[S.TBO])
    if problems:
        return "; ".join(problems)
    try:
        from sglang.srt.environ import envs

        if envs.SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION.get():
            problems.append(
                "SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION is on: it switches padding to per-rank SUM_LEN "
                "after the vote, so no shared bucket exists"
            )
    except Exception as exc:  # noqa: BLE001
        problems.append(f"cannot read SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION: {type(exc).__name__}: {exc}")
    return "; ".join(problems) or None


FEATURES = [
    Feature(
        name=FEATURE,
        area="prefill-graph",
        description="one DP prefill CUDA-graph decision: every forward-time check in the min-reduced vote, "
        "padding on the shared bucket, idle ranks as participants, no rank-local eager fallback",
        switch=S.SWITCH,
        default_on=True,
        available=_available,
        roles=frozenset({Role.SCHEDULER}),
    ),
    Feature(
        name="tbo-idle-rank-vote",
        area="prefill-graph",
        description="an idle or absent batch votes can-run-TBO in TboDPAttentionPreparer.prepare_all_gather",
        upstream_probe=lambda: __import__("dspark_harden.prefill_graph.tbo", fromlist=["x"]).probe_idle_votes_tbo(),
        roles=frozenset({Role.SCHEDULER}),
    ),
    Feature(
        name="tbo-decode-graph-capture",
        area="prefill-graph",
        description="decode-graph TBO capture is skipped only when TBO is off (not per model)",
        upstream_probe=lambda: __import__("dspark_harden.prefill_graph.tbo", fromlist=["x"]).probe_decode_tbo_capture(),
        roles=frozenset({Role.SCHEDULER}),
    ),
]


def _vote_builder(stock):
    from .admission import build_vote

    return build_vote(stock)


def _gather_builder(stock):
    from .admission import build_update_gather

    return build_update_gather(stock)


def _guard_builder(stock):
    from .admission import build_guard

    return build_guard(stock)


def _execute_builder(stock):
    from .validate import build_execute

    return build_execute(stock)


def _tbo_builder(name):
    def build(stock):
        from . import tbo_graph

        return getattr(tbo_graph, name)(stock)

    return build


@hookimpl
def dspark_features():
    return FEATURES


@hookimpl
def dspark_settings():
    return S.SETTINGS


@hookimpl
def dspark_stock_sources():
    """The read-only stock sources the decision reproduces (MIRRORED, MIRRORED_TEXT): port-report lists them."""
    from ..core.porting import StockSource

    return [
        StockSource(FEATURE, target, fp, "reproduced by the shared prefill-graph decision")
        for target, fp in {**MIRRORED, **MIRRORED_TEXT}.items()
    ]


@hookimpl
def dspark_metrics():
    from .metrics import GROUP

    return [GROUP]


def patches(*, tbo: bool = False, validate: bool = False) -> list:
    common = dict(feature=FEATURE, kind=Kind.WRAP, roles={Role.SCHEDULER})
    extra = []
    if validate:
        extra.append(
            Patch(
                target=EXECUTE_TARGET,
                build=_execute_builder,
                fingerprint=EXECUTE_FINGERPRINT,
                **common,
                why=f"{S.VALIDATE}: validated replays run stock's eager forward on the same batch (touched "
                "rows saved and restored) and compare outputs and side state",
                retire_when="stock ships an eager-reference validation of prefill-graph replays at serving time",
            )
        )
    if tbo:
        extra += [
            Patch(
                target=target,
                build=_tbo_builder(builder),
                fingerprint=fp,
                **common,
                why=why,
                retire_when="stock captures prefill graphs with TBO",
            )
            for target, fp, builder, why in TBO_PATCHES
        ]
    return extra + [
        Patch(
            target=VOTE_TARGET,
            build=_vote_builder,
            fingerprint=VOTE_FINGERPRINT,
            **common,
            why="stock's min-reduced vote skips forward-time checks (capture_hidden_mode, the backend's "
            "can_run_prefill_cuda_graph hook, token_indices_to_pool, CP) and bounds padding on the local "
            "count; any skipped check can turn one rank eager after a shared 'graph' verdict",
            retire_when="the stock vote evaluates every can_run_graph / _forward_raw condition (upstream #37561 class)",
        ),
        Patch(
            target=GATHER_TARGET,
            build=_gather_builder,
            fingerprint=GATHER_FINGERPRINT,
            **common,
            why="bucket, padding bound (factor x global max) and idle-participant validity must be derived "
            "from gathered values so every rank reaches the same verdict and bucket",
            retire_when="stock finalises the DP prefill-graph verdict from the gathered table",
        ),
        Patch(
            target=GUARD_TARGET,
            build=_guard_builder,
            fingerprint=GUARD_FINGERPRINT,
            **common,
            why="after a shared 'graph' verdict stock falls back to eager on one rank without telling its "
            "peer (ModelRunner._forward_raw): collectives mismatch (hang or wrong tokens)",
            retire_when="ModelRunner._forward_raw refuses a rank-local eager fallback under a DP graph verdict",
        ),
    ]


@hookimpl
def dspark_patches(role, settings):
    if role is not Role.SCHEDULER or not settings[S.SWITCH]:
        return []
    return patches(tbo=settings[S.TBO], validate=settings[S.VALIDATE] > 0)


@hookimpl
def dspark_process_bound(role, settings, report):
    if role is not Role.SCHEDULER:
        return
    st = bound_status(report, FEATURE)
    if st is None:
        return
    from ..core.binder import refuse

    ctx = roles.CONTEXT
    factor = settings[S.PADDING]
    present, detail = probe_mirrored_sources()
    allow = settings["DSPARK_HARDEN_ALLOW_DRIFT"]
    if not present and "all" not in allow:
        refuse(report, role, FEATURE, f"{detail} (DSPARK_HARDEN_ALLOW_DRIFT=all overrides)", st)
    from .tbo import probe_prefill_tbo_unsupported

    unsupported, tbo_detail = probe_prefill_tbo_unsupported()
    tbo_on = settings[S.TBO]
    st.detail = (
        f"padding factor {factor:g} ({S.PADDING}); {detail}; prefill graphs with TBO: "
        f"{'fixed flat split (' + S.TBO + '=1)' if tbo_on else 'refused at startup'} "
        f"(stock {'cannot capture them' if unsupported else 'may now support them: revisit'}: {tbo_detail})"
        + (f"; eager validation every {settings[S.VALIDATE]} replays" if settings[S.VALIDATE] else "")
    )
    if ctx is None or ctx.server_args is None:
        return
    view = _resolved(ctx.server_args) or ctx.server_args
    from . import config_digest, metrics, tbo_graph, validate
    from .admission import RUNTIME

    tbo_graph.ACTIVE = RUNTIME.tbo_graphs = bool(tbo_on and getattr(view, "enable_two_batch_overlap", False))
    if RUNTIME.tbo_graphs:
        problem = tbo_graph.bucket_problem(view)
        if problem:
            refuse(report, role, FEATURE, problem, st)
    if settings[S.VALIDATE]:
        validate.VALIDATOR = validate.Validator(
            schedule=validate.Schedule(settings[S.VALIDATE], settings[S.VALIDATE_FIRST]),
            tolerance=settings[S.VALIDATE_TOLERANCE],
            action=settings[S.VALIDATE_ACTION],
            dp_rank=ctx.dp_rank,
        )
    RUNTIME.factor = factor
    RUNTIME.dp_rank = ctx.dp_rank
    rec = metrics.attach(RUNTIME, dp_label=ctx.dp_label)
    if validate.VALIDATOR is not None:
        validate.VALIDATOR.on_outcome = rec.validation
    RUNTIME.config_check = lambda runner: config_digest.check(runner, factor)


@hookimpl
def dspark_cli(subparsers, bench_subparsers):
    from .bench_cli import add_bench_parser

    add_bench_parser(bench_subparsers)
