"""Ingress features: ``atomic-routed-batch`` and ``dp-controller-blocking-loop``.

See docs/ingress.md. Patches (all declared, fingerprinted against sglang 0.5.23):

* main:       ``TokenizerManager._should_use_batch_tokenization`` (wrap)
* controller: ``DataParallelController.dispatch_batch_generate`` (wrap),
              ``DataParallelController.dispatching_with_trace`` (wrap),
              ``DataParallelController.event_loop`` (replace)
* scheduler:  ``Scheduler.handle_batch_generate_request`` (wrap, metrics only)

Multi-tokenizer HTTP workers (``--tokenizer-worker-num > 1``) never run SGLang's plugin loader.
They import the app named by ``SGLANG_HTTP_SERVER_APP_PATH``; in the main process we point that
variable at :mod:`dspark_harden.ingress.app`, which binds the main-role patches (this feature's
tokenizer patch and ``/health_scheduler``) in the worker and re-exports the stock app. A
different, operator-set app path would bypass that, so startup (and ``dspark-harden check``)
refuses it while a feature that needs the workers is enabled.
"""

from __future__ import annotations

import logging
import os

from ..core import metrics
from ..core.feature import Feature
from ..core.hookspecs import hookimpl
from ..core.patch import Role
from . import controller as C
from . import scheduler as S
from .patches import DPC, SCHED, TM, patches  # noqa: F401 - the feature's patch table (re-exported)
from .settings import (  # noqa: F401 - re-exported: the feature's public names
    APP_PATH_VAR,
    ATOMIC,
    ATOMIC_SWITCH,
    DEFAULT_POLL_MS,
    DEFAULT_SPIN_US,
    HEALTH_SWITCH,
    LOOP,
    LOOP_SWITCH,
    OUR_APP_PATH,
    POLL_MS,
    SETTINGS,
    SPIN_US,
    STOCK_APP_PATH,
)

logger = logging.getLogger("dspark_harden.ingress")


@hookimpl
def dspark_metrics():
    from .metrics import GROUP

    return [GROUP]


@hookimpl
def dspark_features():
    return [
        Feature(
            name=ATOMIC,
            area="ingress",
            description="a routed HTTP batch reaches its DP scheduler as ONE message; bad ranks are a "
            "per-request 400, not a dead server",
            switch=ATOMIC_SWITCH,
            default_on=True,
            roles=frozenset({Role.MAIN, Role.CONTROLLER, Role.SCHEDULER}),
        ),
        Feature(
            name=LOOP,
            area="ingress",
            description="DP controller event loop blocks on its socket (bounded poll) instead of spinning a core",
            switch=LOOP_SWITCH,
            default_on=True,
            roles=frozenset({Role.CONTROLLER}),
        ),
    ]


@hookimpl
def dspark_settings():
    return list(SETTINGS)


@hookimpl
def dspark_patches(role, settings):
    return patches(role, settings)


def app_path_problem(settings, environ=None) -> str | None:
    """Point multi-tokenizer workers at our app module; refuse an operator-set foreign one."""
    env = os.environ if environ is None else environ
    needs_workers = settings[ATOMIC_SWITCH] or settings.get(HEALTH_SWITCH, False)
    if not needs_workers:
        return None
    current = env.get(APP_PATH_VAR)
    if current in (None, "", STOCK_APP_PATH, OUR_APP_PATH):
        env[APP_PATH_VAR] = OUR_APP_PATH
        return None
    return (
        f"{APP_PATH_VAR}={current!r}: multi-tokenizer HTTP workers (--tokenizer-worker-num > 1) "
        f"would import that app and run without dspark-harden's tokenizer patch and "
        f"/health_scheduler. Unset it (dspark-harden then sets {OUR_APP_PATH}), point it at "
        f"{OUR_APP_PATH}, or disable {ATOMIC_SWITCH} and {HEALTH_SWITCH}."
    )


@hookimpl
def dspark_process_bound(role, settings, report):
    if role is Role.MAIN:
        problem = app_path_problem(settings)
        if problem:
            raise RuntimeError(problem)
        return
    from ..core import roles

    ctx = roles.CONTEXT
    try:
        if role is Role.CONTROLLER and settings[ATOMIC_SWITCH]:
            metrics.precreate("dspark_harden_route_rejections_total", [(r,) for r in C.REJECT_REASONS])
            dp = getattr(getattr(ctx, "server_args", None), "dp_size", None) or 0
            metrics.precreate("dspark_harden_atomic_batches_total", [(str(i),) for i in range(dp)])
        elif role is Role.SCHEDULER and settings[ATOMIC_SWITCH]:
            metrics.precreate("dspark_harden_scheduler_batch_messages_total", [(S.dp_label(),)])
    except Exception:  # noqa: BLE001 - metrics must not stop startup
        logger.debug("precreating ingress metrics failed", exc_info=True)


@hookimpl
def dspark_cli(subparsers, bench_subparsers):
    from . import cli

    cli.register(subparsers, bench_subparsers)
