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
from ..core.patch import Kind, Patch, Role
from ..core.settings import Setting, flag01, positive_int
from . import controller as C
from . import scheduler as S
from . import tokenizer as T

logger = logging.getLogger("dspark_harden.ingress")

ATOMIC = "atomic-routed-batch"
LOOP = "dp-controller-blocking-loop"
ATOMIC_SWITCH = "DSPARK_HARDEN_ATOMIC_ROUTED_BATCH"
LOOP_SWITCH = "DSPARK_HARDEN_DP_CONTROLLER_LOOP"
POLL_MS = "DSPARK_HARDEN_DP_CONTROLLER_POLL_MS"
DEFAULT_POLL_MS = 100

HEALTH_SWITCH = "DSPARK_HARDEN_HEALTH_SCHEDULER"  # declared by dspark_harden.health
APP_PATH_VAR = "SGLANG_HTTP_SERVER_APP_PATH"  # SGLang's own variable (read, and set when unset)
STOCK_APP_PATH = "sglang.srt.entrypoints.http_server:app"
OUR_APP_PATH = "dspark_harden.ingress.app:app"

TM = "sglang.srt.managers.tokenizer_manager:TokenizerManager"
DPC = "sglang.srt.managers.data_parallel_controller:DataParallelController"
SCHED = "sglang.srt.managers.scheduler:Scheduler"


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
    return [
        Setting(ATOMIC_SWITCH, flag01, True,
                "1: under DP attention, a batch routed to one DP rank is tokenized and sent as one "
                "message and the DP controller forwards it whole; invalid ranks get HTTP 400. 0: stock.",
                feature=ATOMIC),
        Setting(LOOP_SWITCH, flag01, True,
                "1: the DP controller waits for requests in a bounded socket poll instead of a busy "
                "loop. 0: stock busy loop (one core at 100 % even when idle).", feature=LOOP),
        Setting(POLL_MS, positive_int, DEFAULT_POLL_MS,
                "Upper bound in milliseconds on one idle wait of the DP controller loop. A request "
                "wakes the loop at once; the bound only sets how often an idle controller wakes to "
                "feed its soft watchdog (it is shortened to a quarter of the watchdog timeout).",
                feature=LOOP, accepts="positive integer (ms)"),
    ]


def patches(role: Role, settings) -> list:
    out: list = []
    if settings[ATOMIC_SWITCH]:
        common = dict(feature=ATOMIC, retire_when="SGLang keeps uniformly routed batches together under DP "
                      "attention and validates routed ranks without raising in the controller loop")
        out += [
            Patch(target=f"{TM}._should_use_batch_tokenization", kind=Kind.WRAP, roles={Role.MAIN},
                  build=T.build_should_use_batch_tokenization, fingerprint="985048d584a54418",
                  why="stock tokenizes and sends each item of a routed batch as its own message under "
                      "DP attention", **common),
            Patch(target=f"{DPC}.dispatch_batch_generate", kind=Kind.WRAP, roles={Role.CONTROLLER},
                  build=C.build_dispatch_batch_generate, fingerprint="5b71c953037d28e8",
                  why="stock dispatches each item of a batch separately (one ZMQ send per item) and "
                      "raises on an inactive routed rank, which SIGQUITs the server", **common),
            Patch(target=f"{DPC}.dispatching_with_trace", kind=Kind.WRAP, roles={Role.CONTROLLER},
                  build=C.build_dispatching_with_trace, fingerprint="ad797206fa05c8f3",
                  why="an inactive routed_dp_rank raises ValueError in the controller loop, which "
                      "kills the server; answer that request with a 400 instead", **common),
            Patch(target=f"{SCHED}.handle_batch_generate_request", kind=Kind.WRAP, roles={Role.SCHEDULER},
                  build=S.build_handle_batch_generate_request, fingerprint="4eb6d77d4759ebd9",
                  why="count batch messages per DP rank where they arrive (observability only)", **common),
        ]
    if settings[LOOP_SWITCH]:
        poll_ms = settings[POLL_MS]
        out.append(
            Patch(feature=LOOP, target=f"{DPC}.event_loop", kind=Kind.REPLACE, roles={Role.CONTROLLER},
                  build=lambda _stock: C.build_event_loop(poll_ms), fingerprint="804af740481d2c51",
                  why="stock event_loop is a non-blocking busy loop: one core at 100 % when idle",
                  retire_when="SGLang's DP controller blocks on its socket (zmq poll) when idle")
        )
    return [p for p in out if role in p.roles]


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
    return (f"{APP_PATH_VAR}={current!r}: multi-tokenizer HTTP workers (--tokenizer-worker-num > 1) "
            f"would import that app and run without dspark-harden's tokenizer patch and "
            f"/health_scheduler. Unset it (dspark-harden then sets {OUR_APP_PATH}), point it at "
            f"{OUR_APP_PATH}, or disable {ATOMIC_SWITCH} and {HEALTH_SWITCH}.")


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
    p = bench_subparsers.add_parser(
        "controller",
        help="idle CPU and dispatch latency of the stock vs the blocking DP controller loop (one run)",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--idle-seconds", type=float, default=3.0,
                   help="idle window per loop (CPU is scaled to 10 s); default 3")
    p.add_argument("--requests", type=int, default=300, help="requests timed per loop; default 300")
    p.add_argument("--dp-size", type=int, default=2)

    def run(args) -> int:
        import json

        from .bench import run_controller_bench

        result = run_controller_bench(idle_seconds=args.idle_seconds, n_requests=args.requests,
                                      dp_size=args.dp_size)
        if args.json:
            print(json.dumps(result))
        else:
            for k, v in result.items():
                print(f"{k:32s} {v:.3f}")
        return 0

    p.set_defaults(func=run)
