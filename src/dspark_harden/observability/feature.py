"""Observability features: build info, per-feature bound gauges, series pre-creation, scheduler
phase metrics, and the ``metrics-lint`` / ``dashboard`` CLI commands.

Two switches:

* ``DSPARK_HARDEN_METRICS`` (feature ``observability``, every role): publishes
  ``dspark_harden_build_info`` and ``dspark_harden_feature_bound`` from the BindReport and
  pre-creates the declared label combinations of every family whose feature is active in the
  process. In the main process SGLang sets ``PROMETHEUS_MULTIPROC_DIR`` only after plugins are
  loaded, so the feature wraps ``sglang.srt.entrypoints.engine._set_envs_and_config`` and publishes
  right after it (see :mod:`dspark_harden.core.metrics`, "readiness").
* ``DSPARK_HARDEN_SCHEDULER_PHASE_METRICS`` (feature ``scheduler-phase-metrics``, schedulers):
  see :mod:`dspark_harden.observability.phases`. Needs SGLang ``--enable-metrics`` (without it
  nothing exports the values: the feature is ``unavailable``, or fails startup when the switch
  was set to 1 explicitly).
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any, Optional

from ..core import feature as F
from ..core import metrics, roles
from ..core.feature import Feature
from ..core.hookspecs import hookimpl
from ..core.patch import Kind, Patch, Role
from ..core.settings import Setting, flag01, positive_float
from . import phases

SWITCH = "DSPARK_HARDEN_METRICS"
PHASE_SWITCH = "DSPARK_HARDEN_SCHEDULER_PHASE_METRICS"
FLUSH = "DSPARK_HARDEN_METRICS_FLUSH_INTERVAL_S"

ENV_TARGET = "sglang.srt.entrypoints.engine:_set_envs_and_config"
ENV_FINGERPRINT = "b3ddd8a51c625a11"


def _phase_metrics_available(settings: Any) -> Optional[str]:
    ctx = roles.CONTEXT
    server_args = ctx.server_args if ctx is not None else None
    if server_args is not None and not getattr(server_args, "enable_metrics", False):
        return "SGLang --enable-metrics is off (nothing would export the phase metrics)"
    return None


FEATURES = [
    Feature(
        name="observability",
        area="platform",
        description="build info, per-feature bound gauges and pre-created series in every process",
        switch=SWITCH,
        default_on=True,
    ),
    Feature(
        name=phases.FEATURE,
        area="scheduler",
        description="seconds, calls and rolling max per scheduler-loop phase and dp_rank",
        switch=PHASE_SWITCH,
        default_on=True,
        available=_phase_metrics_available,
        roles=frozenset({Role.SCHEDULER}),
    ),
]

SETTINGS = [
    Setting(
        SWITCH,
        flag01,
        True,
        "Publish dspark_harden_build_info / dspark_harden_feature_bound and pre-create the "
        "declared series of active features in every SGLang process.",
        feature="observability",
    ),
    Setting(
        PHASE_SWITCH,
        flag01,
        True,
        "Time the scheduler-loop phases (recv_requests, process_input_requests, "
        "get_next_batch_to_run, run_batch, process_batch_result, idle) per dp_rank. "
        "Needs SGLang --enable-metrics.",
        feature=phases.FEATURE,
    ),
    Setting(
        FLUSH,
        positive_float,
        1.0,
        "Seconds between pushes of accumulated scheduler-phase values to Prometheus; also the "
        "window of dspark_harden_scheduler_phase_max_seconds.",
        feature=phases.FEATURE,
    ),
]


@hookimpl
def dspark_metrics():
    from .metrics import GROUPS

    return list(GROUPS)


@hookimpl
def dspark_features():
    return FEATURES


@hookimpl
def dspark_settings():
    return SETTINGS


def _configured_after(stock):
    @functools.wraps(stock)
    def set_envs_and_config(*args, **kwargs):
        result = stock(*args, **kwargs)
        metrics.configured()
        return result

    return set_envs_and_config


ENV_PATCH_KW = dict(
    feature="observability",
    target=ENV_TARGET,
    kind=Kind.WRAP,
    roles={Role.MAIN},
    fingerprint=ENV_FINGERPRINT,
    why="SGLang sets PROMETHEUS_MULTIPROC_DIR in the main process after plugins load; publish the "
    "main process's dspark metrics (and allow creating any) only once it has",
    retire_when="SGLang offers a hook after its Prometheus set-up (or sets the directory before load_plugins)",
)


@hookimpl
def dspark_patches(role, settings):
    out = []
    if settings[SWITCH] and role is Role.MAIN:
        out.append(Patch(build=_configured_after, **ENV_PATCH_KW))
    if settings[PHASE_SWITCH] and role is Role.SCHEDULER:
        out.extend(phases.patches())
    return out


def _version() -> str:
    from .. import __version__

    return __version__


def sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def publish(role: str, report: Any, dp_label: str) -> list[str]:
    """Set build info and the bound gauges from ``report``; pre-create active families' series."""
    metrics.child("dspark_harden_build_info", _version(), sglang_version()).set(1)
    bound = metrics.get("dspark_harden_feature_bound")
    for feat in report.features:
        bound.labels(feat.name, role, feat.status).set(1 if feat.status == F.BOUND else 0)
    active = [f.name for f in report.features if f.status in (F.BOUND, F.UPSTREAM)]
    return metrics.precreate_process(role, active, dp_label)


@hookimpl
def dspark_process_bound(role, settings, report):
    ctx = roles.CONTEXT
    dp_label = ctx.dp_label if ctx is not None else "none"
    statuses = {f.name: f.status for f in report.features}
    if role is Role.SCHEDULER and statuses.get(phases.FEATURE) == F.BOUND:
        phases.configure(
            dp_label=dp_label,
            interval_s=settings[FLUSH],
            enabled=phases.records_here(getattr(ctx, "server_args", None), getattr(ctx, "tp_rank", None)),
        )
    if not settings[SWITCH]:
        return
    if role is Role.MAIN and statuses.get("observability") == F.BOUND:
        metrics.defer_until_configured()
    metrics.when_ready(functools.partial(publish, role.value, report, dp_label))


@hookimpl
def dspark_cli(subparsers, bench_subparsers):
    from . import cli

    cli.register(subparsers, bench_subparsers)
