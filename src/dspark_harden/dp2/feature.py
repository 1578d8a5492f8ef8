"""Feature ``dp2-native-exchange``: pluggy hooks (feature, settings, patches, startup, CLI).

Opt-in (``SGLANG_DSPARK_DP2_SHM_MLP_SYNC=1``). Validated strictly at startup in every process
that can see the configuration: session id present (in the main process a per-launch id is derived
when unset: :mod:`.session`), conflicting sync switches off, and (where
``server_args`` is known: DP controller, schedulers) the geometry DP2 / attention-TP1 / CP1 /
PP1 / one node / no elastic EP. Schedulers then open their channels when the plugin is bound;
the two ranks' configurations are compared by the native open (digest + timeout + width), so a
disagreement stops startup on the second rank and poisons the channel for the first.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..core import roles
from ..core.feature import Feature, bound_status
from ..core.hookspecs import hookimpl
from ..core.patch import Kind, Patch, Role
from . import session
from . import settings as S

logger = logging.getLogger("dspark_harden.dp2")

FEATURE = S.FEATURE
MLP_TARGET = "sglang.srt.managers.scheduler_components.dp_attn:MLPSyncBatchInfo.all_gather"
MLP_FINGERPRINT = "3d756e918ca607da"
VERIFY_TARGET = (
    "sglang.srt.speculative.dspark_components.dspark_planner:DSparkVerifyPlanner._maybe_gather_dp_verify_tier"
)
VERIFY_FINGERPRINT = "92166f7e192f044f"

# SGLang switches that select another sync path; both must be off (stock parsing) when enabled.
CONFLICTING_SWITCHES = ("SGLANG_SCHEDULER_SKIP_ALL_GATHER", "SGLANG_NCCL_ALL_GATHER_IN_OVERLAP_SCHEDULER_SYNC_BATCH")


def geometry_problems(server_args: Any) -> list:
    """Every reason ``server_args`` is not DP2 / attention-TP1 / CP1 on one node (empty: fine)."""
    out = []
    g = lambda name, default=None: getattr(server_args, name, default)  # noqa: E731
    if not g("enable_dp_attention", False):
        out.append("--enable-dp-attention is off (the native exchange replaces the DP-attention MLP sync)")
    if g("dp_size") != 2:
        out.append(f"--dp-size is {g('dp_size')}, must be 2")
    if g("tp_size") != 2:
        out.append(f"--tp-size is {g('tp_size')}, must be 2 (attention TP 1 with DP 2)")
    if (g("attn_cp_size", 1) or 1) != 1:
        out.append(f"attention CP size is {g('attn_cp_size')}, must be 1")
    if (g("pp_size", 1) or 1) != 1:
        out.append(f"--pp-size is {g('pp_size')}, must be 1")
    if (g("nnodes", 1) or 1) != 1:
        out.append(f"--nnodes is {g('nnodes')}, must be 1 (shared memory is per host)")
    if g("elastic_ep_backend") is not None:
        out.append(f"elastic EP ({g('elastic_ep_backend')}) uses the WORLD all-reduce sync, not the DP2 all-gather")
    return out


def conflicting_switches() -> list:
    from sglang.srt.environ import envs

    return [f"{name} is on" for name in CONFLICTING_SWITCHES if getattr(envs, name).get()]


def _available(settings) -> Optional[str]:
    problems = []
    ctx = roles.CONTEXT
    if not settings[S.SESSION_ID] and ctx is not None and ctx.role is not Role.MAIN and ctx.server_args is not None:
        # the main process exports a per-launch id before it spawns us (dp2/session.py)
        problems.append(
            f"{S.SESSION_ID} is not set in this {ctx.role.value} process: the main process "
            f"derives one per launch when dspark-harden is loaded there (SGLANG_PLUGINS must "
            f"include dspark_harden in the launching process), or export one"
        )
    try:
        problems.extend(conflicting_switches())
    except Exception as exc:  # noqa: BLE001
        problems.append(f"cannot read SGLang's sync switches: {type(exc).__name__}: {exc}")
    if ctx is not None and ctx.server_args is not None:
        problems.extend(geometry_problems(ctx.server_args))
        if ctx.role is Role.SCHEDULER:
            if ctx.tp_rank not in (0, 1):
                problems.append(f"scheduler tp_rank {ctx.tp_rank!r} is not 0 or 1")
            elif ctx.dp_rank is not None and ctx.dp_rank != ctx.tp_rank:
                problems.append(f"scheduler dp_rank {ctx.dp_rank} != tp_rank {ctx.tp_rank}")
    return "; ".join(problems) or None


def dspark_configured() -> bool:
    """True when this scheduler runs DSpark speculative decoding, or when unknown (self-check
    children without server_args bind every target to prove they resolve)."""
    ctx = roles.CONTEXT
    if ctx is None or ctx.server_args is None:
        return True
    algo = getattr(ctx.server_args, "speculative_algorithm", None)
    return str(algo or "").upper() == "DSPARK"


FEATURES = [
    Feature(
        name=FEATURE,
        area="dp2-exchange",
        description="native C11 shared-memory + futex DP2 exchange for the scheduler MLP sync and DSpark verify tier",
        switch=S.SWITCH,
        default_on=False,
        available=_available,
    )
]


def _mlp_builder(stock):
    from .mlp_sync import build_all_gather

    return build_all_gather(stock)


def _verify_builder(stock):
    from .verify_tier import build_verify_tier

    return build_verify_tier(stock)


@hookimpl
def dspark_metrics():
    from .metrics import GROUP

    return [GROUP]


@hookimpl
def dspark_features():
    return FEATURES


@hookimpl
def dspark_settings():
    return S.SETTINGS


@hookimpl
def dspark_patches(role, settings):
    if not settings[S.SWITCH]:
        return []
    if role is Role.MAIN:
        return [
            Patch(
                feature=FEATURE,
                target=session.LAUNCH_TARGET,
                kind=Kind.WRAP,
                roles={Role.MAIN},
                build=session.build_launch_subprocesses(settings[S.SESSION_ID]),
                fingerprint=session.LAUNCH_FINGERPRINT,
                why=f"the native exchange needs a session id unique per server; when {S.SESSION_ID} is unset "
                "the main process derives one per launch, before the schedulers are spawned",
                retire_when="SGLang ships a shared-memory DP2 MLP sync that names its own segments",
            )
        ]
    if role is not Role.SCHEDULER:
        return []
    patches = [
        Patch(
            feature=FEATURE,
            target=MLP_TARGET,
            kind=Kind.REPLACE,
            roles={Role.SCHEDULER},
            build=_mlp_builder,
            fingerprint=MLP_FINGERPRINT,
            why="per-step gloo all-gather of the MLP sync row costs ~1.3 ms (p99 ~7 ms) on two co-located "
            "ranks; the native shared-memory exchange does the same in microseconds, fail-closed",
            retire_when="SGLang ships a shared-memory DP2 MLP sync (single_node_dp2_sync) upstream",
        )
    ]
    if dspark_configured():
        patches.append(
            Patch(
                feature=FEATURE,
                target=VERIFY_TARGET,
                kind=Kind.REPLACE,
                roles={Role.SCHEDULER},
                build=_verify_builder,
                fingerprint=VERIFY_FINGERPRINT,
                why="DSpark's verify-tier gather is a second per-step gloo collective; it must switch together "
                "with the MLP sync so both ranks take the same path",
                retire_when="SGLang folds the verify tier into the MLP sync row or ships a native DP2 channel",
            )
        )
    return patches


@hookimpl
def dspark_process_bound(role, settings, report):
    if role is not Role.SCHEDULER or not settings[S.SWITCH] or bound_status(report, FEATURE) is None:
        return
    ctx = roles.CONTEXT
    if ctx is None or ctx.server_args is None:
        logger.info("dspark-harden dp2: no server_args in this process (self-check); channels not opened")
        return
    from . import mlp_sync, verify_tier
    from .channels import RUNTIME

    RUNTIME.configure(
        session_id=settings[S.SESSION_ID],
        timeout_ms=settings[S.TIMEOUT_MS],
        spin_us=settings[S.SPIN_US],
        export=settings[S.METRICS],
        rank=ctx.tp_rank,
        dp_label=ctx.dp_label,
        hard_timeout_ms=settings[S.HARD_TIMEOUT_MS],
        peer_stop_ms=settings[S.PEER_STOP_MS],
    )
    mlp_sync.start(RUNTIME)
    RUNTIME.start_watch("mlp")  # a stopped peer is noticed wherever this scheduler is blocked (dp2/watch.py)
    bound_targets = {t.target for f in report.features if f.name == FEATURE for t in f.targets if t.bound}
    if VERIFY_TARGET in bound_targets:
        verify_tier.start(RUNTIME)


@hookimpl
def dspark_health_stalls():
    from .board import health_stalls

    return health_stalls()


@hookimpl
def dspark_pair_exchange(channel, width, fields):
    from .channels import RUNTIME, pair_exchange

    if RUNTIME.session_id is None or RUNTIME.rank is None:
        return None  # the native exchange is not configured in this process
    return pair_exchange(RUNTIME, channel, width, fields)


@hookimpl
def dspark_cli(subparsers, bench_subparsers):
    p = bench_subparsers.add_parser(
        "dp2", help="native DP2 exchange vs gloo, and the whole MLPSyncBatchInfo.all_gather call"
    )
    p.add_argument(
        "--iters", type=int, default=20000, help="calls per block (default 20000, as the seed's speed table)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds, each one block of every path, stock and ours alternating first (default 5)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--spin-us", type=int, default=50, help="native spin budget before futex wait (default 50)")
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="do not pin the two processes to different CPUs (default: pinned, like two schedulers on their own cores)",
    )

    def run(args):
        from .bench import main

        return main(args)

    p.set_defaults(func=run)
