"""Feature ``health-scheduler``: GET /health_scheduler (RoutePatch on the main process's app).

200 only when every expected DP rank has published exactly one fresh load snapshot; 503 with a
JSON body ``{"status", "reason", "message", ...}`` otherwise. See docs/health.md.
"""

from __future__ import annotations

import logging
import time

from ..core import metrics
from ..core.feature import Feature
from ..core.hookspecs import hookimpl
from ..core.patch import Kind, Role, RoutePatch
from ..core.settings import Setting, flag01, positive_float
from . import verdict as V

logger = logging.getLogger("dspark_harden.health")

FEATURE = "health-scheduler"
SWITCH = "DSPARK_HARDEN_HEALTH_SCHEDULER"
MAX_STALENESS = "DSPARK_HARDEN_HEALTH_MAX_STALENESS_S"
MAX_FUTURE_SKEW = "DSPARK_HARDEN_HEALTH_MAX_FUTURE_SKEW_S"
PATH = "/health_scheduler"
APP_TARGET = "sglang.srt.entrypoints.http_server:app"

# Defaults (docs/health.md explains them). An idle stock scheduler publishes on every idle loop
# (forced, ~1 s apart with --sleep-on-idle because IdleSleeper polls for 1 s, far more often
# without it); a busy one publishes on every extend batch (forced) and every
# --load-snapshot-publish-interval (15) decode steps, i.e. well under a second on a GPU. 30 s
# tolerates a long prefill chunk, a long grammar compile or a GC pause by an order of magnitude
# and still flags a stopped or wedged scheduler within half a minute. Future skew of 5 s only
# absorbs wall-clock adjustments between processes of one host.
DEFAULT_MAX_STALENESS_S = 30.0
DEFAULT_MAX_FUTURE_SKEW_S = 5.0


@hookimpl
def dspark_metrics():
    from .metrics import GROUP

    return [GROUP]


@hookimpl
def dspark_features():
    return [
        Feature(
            name=FEATURE,
            area="health",
            description="GET /health_scheduler: 200 only when every DP rank published one fresh load snapshot",
            switch=SWITCH,
            default_on=True,
            roles=frozenset({Role.MAIN}),
        )
    ]


@hookimpl
def dspark_settings():
    return [
        Setting(
            SWITCH, flag01, True, "1: register GET /health_scheduler in the HTTP server. 0: do not.", feature=FEATURE
        ),
        Setting(
            MAX_STALENESS,
            positive_float,
            DEFAULT_MAX_STALENESS_S,
            "/health_scheduler answers 503 (reason stale) when a DP rank's newest load snapshot is "
            "older than this many seconds. Stock schedulers publish about once a second when idle "
            "and several times a second when busy.",
            feature=FEATURE,
            accepts="positive seconds",
        ),
        Setting(
            MAX_FUTURE_SKEW,
            positive_float,
            DEFAULT_MAX_FUTURE_SKEW_S,
            "/health_scheduler answers 503 (reason future_timestamp) when a snapshot is dated more "
            "than this many seconds in the future.",
            feature=FEATURE,
            accepts="positive seconds",
        ),
    ]


def _count(outcome: str) -> None:
    metrics.get("dspark_harden_health_scheduler_checks_total").labels(outcome).inc()


_LAST_REASON = [V.OK]


def _log_transition(result: V.Verdict) -> None:
    """Log when the answer changes (probes poll every few seconds: no log flood)."""
    if result.reason == _LAST_REASON[0]:
        return
    _LAST_REASON[0] = result.reason
    if result.ok:
        logger.info("/health_scheduler healthy again: %s", result.message)
    elif result.reason not in (V.STARTING, V.SHUTTING_DOWN, V.NO_STATE):
        logger.warning("/health_scheduler 503 (%s): %s", result.reason, result.message)


def _dp2_stalls() -> list:
    """Current stalls of the inter-rank exchanges, as every feature reports them through the
    ``dspark_health_stalls`` hook (the native DP2 exchange answers from its stall board)."""
    from ..core import binder

    return [s for answer in binder.hooks().dspark_health_stalls() for s in (answer or ())]


def make_endpoint(max_staleness_s: float, max_future_skew_s: float):
    async def health_scheduler():
        """Per-DP-rank scheduler liveness from load snapshots; sends no inference request."""
        from fastapi.responses import JSONResponse
        from sglang.srt.entrypoints import http_server

        state = http_server.get_global_state()
        tm = getattr(state, "tokenizer_manager", None) if state is not None else None
        result = V.evaluate_server(
            tm,
            now_fn=time.time,
            max_staleness_s=max_staleness_s,
            max_future_skew_s=max_future_skew_s,
            dp2_stalls_fn=_dp2_stalls,
        )
        try:
            _count(result.reason)
        except Exception:  # noqa: BLE001 - a metrics problem must not change the health answer
            logger.debug("health metric update failed", exc_info=True)
        _log_transition(result)
        return JSONResponse(status_code=result.status_code, content=result.to_dict())

    return health_scheduler


def route_patch(settings) -> RoutePatch:
    return RoutePatch(
        feature=FEATURE,
        target=APP_TARGET,
        kind=Kind.ROUTE,
        roles={Role.MAIN},
        build=lambda _stock: make_endpoint(settings[MAX_STALENESS], settings[MAX_FUTURE_SKEW]),
        fingerprint=None,
        why="stock has /health (no scheduler check by default) and /health_generate (an inference "
        "request); neither tells which DP rank's scheduler stopped publishing",
        retire_when="SGLang ships a non-inference per-DP-rank scheduler health route",
        path=PATH,
        methods=("GET",),
    )


@hookimpl
def dspark_patches(role, settings):
    if role is not Role.MAIN or not settings[SWITCH]:
        return []
    return [route_patch(settings)]
