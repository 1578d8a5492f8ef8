"""Feature ``dspark-result-materializer``: pluggy hooks (feature, settings, metrics, patches, start-up
check, bench CLI).

Opt-in (``DSPARK_HARDEN_DSPARK_RESULTS=1``), scheduler processes only, and only for a DSpark server
with overlap scheduling (elsewhere an explicit switch fails start-up, naming why). ``dspark-harden
check`` children have no ``server_args``: they bind every target to prove it resolves and matches its
fingerprint. See docs/dspark_results.md.
"""

from __future__ import annotations

from typing import Any, Optional

from ..core import roles
from ..core.feature import Feature
from ..core.hookspecs import hookimpl
from ..core.patch import Kind, Patch, Role
from .settings import FEATURE, QUEUE_SIZE, SETTINGS, SWITCH, SWITCH_INTERVAL, TIMEOUT


@hookimpl
def dspark_stock_sources():
    """The read-only stock sources the result record mirrors (integration.MIRRORED): port-report lists them."""
    from ..core.porting import StockSource
    from .integration import MIRRORED

    return [StockSource(FEATURE, target, fp, "mirrored by the DSpark result record") for target, fp in MIRRORED.items()]


def _resolved(server_args: Any, name: str) -> Any:
    try:
        from sglang.srt.arg_groups.model_override_base import resolved_view

        view = resolved_view(server_args)
        if hasattr(view, name):
            return getattr(view, name)
    except Exception:  # noqa: BLE001 - unresolved args (tests): read the raw field
        pass
    return getattr(server_args, name, None)


def preconditions(server_args: Any) -> list:
    """Why the materializer cannot apply to this server (empty: it applies)."""
    out = []
    spec = _resolved(server_args, "speculative_algorithm")
    name = str(getattr(spec, "name", spec) or "NONE").upper()
    if name != "DSPARK":
        out.append(f"speculative algorithm is {name}, not DSPARK (--speculative-algorithm DSPARK)")
    if _resolved(server_args, "disable_overlap_schedule"):
        out.append(
            "overlap scheduling is disabled (--disable-overlap-schedule or a model override): stock "
            "converts results synchronously and issues no copy to wait on"
        )
    return out


def _available(settings: Any) -> Optional[str]:
    try:
        import sglang.srt.managers.scheduler as sched
    except Exception as exc:  # noqa: BLE001
        return f"sglang's scheduler is not importable: {type(exc).__name__}: {exc}"
    if getattr(sched, "_is_hip", False):
        return "ROCm: stock's overlap loop copies results inline on HIP and bypasses Scheduler._copy_result_to_cpu"
    from .integration import probe_mirrored_sources

    allow = tuple(settings["DSPARK_HARDEN_ALLOW_DRIFT"])
    drift = probe_mirrored_sources(allow)
    if drift:
        return drift
    ctx = roles.CONTEXT
    if ctx is None or ctx.server_args is None:
        return None  # self-check child: bind everything to prove the targets
    return "; ".join(preconditions(ctx.server_args)) or None


@hookimpl
def dspark_features():
    return [
        Feature(
            name=FEATURE,
            area="dspark-results",
            description="DSpark decode results: copy enqueued behind the forward on the scheduler thread, event "
            "wait and tolist on one bounded background thread; consumers read the record",
            switch=SWITCH,
            default_on=False,
            available=_available,
            roles=frozenset({Role.SCHEDULER}),
        )
    ]


@hookimpl
def dspark_settings():
    return list(SETTINGS)


@hookimpl
def dspark_metrics():
    from .metrics import GROUP

    return [GROUP]


def patches(role: Role, settings: Any) -> list:
    if role is not Role.SCHEDULER or not settings[SWITCH]:
        return []
    from . import integration as I

    I.configure(QUEUE_SIZE, settings[TIMEOUT], settings[SWITCH_INTERVAL])
    common = dict(feature=FEATURE, roles={Role.SCHEDULER})
    return [
        Patch(
            target=I.COPY_TARGET,
            kind=Kind.WRAP,
            build=I.build_copy,
            fingerprint=I.COPY_FINGERPRINT,
            why="stock enqueues the DSpark result copy behind the forward (kept), but the event wait and every "
            "tolist() then run on the scheduler thread; the wrapper hands the recorded copy event of a "
            "DSpark decode result to the background materializer",
            retire_when="SGLang materializes spec results off the scheduler thread (AsyncD2HCopyWorker for "
            "DSpark with the enqueue kept behind the forward)",
            **common,
        ),
        Patch(
            target=I.RESOLVE_TARGET,
            kind=Kind.REPLACE,
            build=I.build_resolve,
            fingerprint=I.RESOLVE_FINGERPRINT,
            why="reads next_token_ids / accept_lens / block_accept_lens / cap_lens of a DSpark decode result from "
            "its materializer record instead of tolist() (stock for every other result)",
            retire_when="stock consumes host lists prepared off the scheduler thread",
            **common,
        ),
        Patch(
            target=I.ADVANCE_TARGET,
            kind=Kind.REPLACE,
            build=I.build_advance,
            fingerprint=I.ADVANCE_FINGERPRINT,
            why="the grammar barrier (inside the next verify) reads the DSpark decode result's lists from its "
            "record instead of synchronizing and converting on the scheduler thread",
            retire_when="stock consumes host lists prepared off the scheduler thread",
            **common,
        ),
        Patch(
            target=I.NORMALIZE_TARGET,
            kind=Kind.REPLACE,
            build=I.build_normalize,
            fingerprint=I.NORMALIZE_FINGERPRINT,
            why="under return_logprob, a DSpark decode result's logprob lists come from its record",
            retire_when="stock consumes host lists prepared off the scheduler thread",
            **common,
        ),
    ]


@hookimpl
def dspark_patches(role, settings):
    return patches(role, settings)


@hookimpl
def dspark_cli(subparsers, bench_subparsers):
    from . import bench, bench_gil

    bench.register(bench_subparsers)
    bench_gil.register(bench_subparsers)
