"""Lifecycle features (issue 14): pluggy hooks (features, settings, metrics, patches, startup, CLI).

* ``lifecycle-shutdown`` (``DSPARK_HARDEN_LIFECYCLE``, on): draining ordered SIGTERM shutdown and
  loud, complete child death (:mod:`.main`, :mod:`.controller`, :mod:`.scheduler`);
* ``gc-freeze`` (``DSPARK_HARDEN_GC_FREEZE``, on): freeze after warm-up + pause metrics
  (:mod:`.gc_freeze`);
* ``hicache-gate`` (``SGLANG_HICACHE_GATE_CONTROL=armed``, off): :mod:`.hicache_gate`;
* ``hostpool-teardown`` (``DSPARK_HARDEN_HOSTPOOL_TEARDOWN``, on): :mod:`.hostpool`;
* ``strict-vmm`` (``DSPARK_HARDEN_STRICT_VMM``, off): :mod:`.vmm`.

See docs/lifecycle.md.
"""

from __future__ import annotations

import logging

from ..core import feature as F
from ..core import roles
from ..core.feature import Feature
from ..core.hookspecs import hookimpl
from ..core.patch import Kind, Patch, Role
from . import settings as S
from .middleware import MiddlewarePatch

logger = logging.getLogger("dspark_harden.lifecycle")

TM = "sglang.srt.managers.tokenizer_manager"
SCHED = "sglang.srt.managers.scheduler:Scheduler"
DETOK = "sglang.srt.managers.detokenizer_manager:DetokenizerManager"
ISC = "sglang.srt.managers.scheduler_components.internal_state:SchedulerInternalStateController"

FINGERPRINTS = {
    f"{TM}:SignalHandler.sigterm_handler": "aa9e788098dcc95a",
    f"{TM}:SignalHandler.running_phase_sigquit_handler": "2f553f7f0466efa2",
    f"{TM}:TokenizerManager.sigterm_watchdog": "5948a6bfcb7c5f41",
    f"{TM}:TokenizerManager.__init__": "caaa70ddd0c283eb",
    "sglang.srt.entrypoints.engine:Engine.shutdown": "cf4f2d84855fb0fc",
    "sglang.srt.utils.watchdog:SubprocessWatchdog._check_processes": "972ea6fe7bb73b10",
    "sglang.srt.utils.cuda_vmm_transport_utils:CudaVmmMemoryPool.__init__": "fa05d8982599a126",
    "sglang.srt.managers.data_parallel_controller:DataParallelController.__init__": "4485cbacac2bfdef",
    f"{SCHED}.handle_shutdown": "dd74dba3ada5c621",
    f"{SCHED}.release_host_resources": "5b8af19ff4241ba9",
    f"{SCHED}.run_event_loop": "7966bc22c946f6ee",
    f"{SCHED}.get_init_info": "e9e7f8ba9a31f1b6",
    f"{SCHED}.ingest_requests": "20d17ed5a9605536",
    "sglang.srt.mem_cache.pool_host.group:HostPoolGroup.destroy": "7c8820fdf4127922",
    f"{ISC}.set_internal_state": "3d377f4afe1fa7a4",
    f"{ISC}.get_internal_state": "19ec0b4389100261",
    f"{DETOK}.event_loop": "7cfd30754293d8ce",
    f"{DETOK}.handle_batch_token_id_out": "2de8de172d4db717",
}

FEATURES = [
    Feature(
        name=S.SHUTDOWN,
        area="lifecycle",
        description="draining ordered SIGTERM shutdown; a child's death answers every request, names the "
        "rank, leaves nothing behind and exits non-zero",
        switch=S.SHUTDOWN_SWITCH,
        default_on=True,
    ),
    Feature(
        name=S.GC_FREEZE,
        area="lifecycle",
        description="gc.freeze() once after warm-up in schedulers, detokenizer and main; gen-2 pause metrics",
        switch=S.GC_SWITCH,
        default_on=True,
        roles=frozenset({Role.MAIN, Role.SCHEDULER, Role.DETOKENIZER}),
    ),
    Feature(
        name=S.HICACHE_GATE,
        area="hicache",
        description="one-shot idle-only HiCache eviction through /set_internal_state, write-back preserving",
        switch=S.GATE_CONTROL,
        default_on=False,
        roles=frozenset({Role.SCHEDULER}),
        available=lambda settings: _gate_available(settings),
    ),
    Feature(
        name=S.HOSTPOOL,
        area="hicache",
        description="HostPoolGroup.destroy runs every pool's destroy() and reports every failure by pool",
        switch=S.HOSTPOOL_SWITCH,
        default_on=True,
        roles=frozenset({Role.SCHEDULER}),
    ),
    Feature(
        name=S.STRICT_VMM,
        area="lifecycle",
        description="refuse SGLang's silent FABRIC -> POSIX fallback of the CUDA VMM multimodal transport",
        switch=S.STRICT_VMM_SWITCH,
        default_on=False,
        roles=frozenset({Role.MAIN}),
    ),
]


def _gate_available(settings):
    """hicache-gate only where each DP group is one scheduler (attention-TP 1): hicache_gate.group_problem."""
    from .hicache_gate import available

    return available(settings)


def _patch(feature, target, kind, role, build, why, retire_when):
    return Patch(
        feature=feature,
        target=target,
        kind=kind,
        roles={role},
        build=build,
        fingerprint=FINGERPRINTS[target],
        why=why,
        retire_when=retire_when,
    )


def _builder(module: str, name: str, *args):
    """Resolve ``module.name`` lazily (patch targets and builders import SGLang only when bound)."""

    def build(stock):
        import importlib

        fn = getattr(importlib.import_module(f"dspark_harden.lifecycle.{module}"), name)
        return fn(*args)(stock) if args else fn(stock)

    return build


def _drain_gate(_stock):
    from .main import DrainGate

    return DrainGate


def shutdown_patches(role, settings) -> list:
    W, R = Kind.WRAP, Kind.REPLACE
    f = S.SHUTDOWN
    if role is Role.MAIN:
        return [
            _patch(
                f,
                f"{TM}:SignalHandler.sigterm_handler",
                R,
                role,
                _builder("main", "build_sigterm_handler"),
                "stock logs SIGTERM at WARNING and only sets gracefully_exit; the drain and the 503s start here",
                "SGLang ships a bounded drain (--shutdown-timeout) with 503 for new requests",
            ),
            _patch(
                f,
                f"{TM}:TokenizerManager.sigterm_watchdog",
                R,
                role,
                _builder("main", "build_sigterm_watchdog"),
                "stock polls every 5 s with no drain bound, then SIGKILLs the DP controller and the detokenizer "
                "and leaves their /dev/shm segments and ipc sockets behind",
                "SGLang ships an ordered shutdown where every child exits 0 and cleans up",
            ),
            _patch(
                f,
                f"{TM}:SignalHandler.running_phase_sigquit_handler",
                R,
                role,
                _builder("main", "build_sigquit_handler"),
                "stock kills the whole tree at once: in-flight requests lose their connections",
                "SGLang answers in-flight requests when a child fails",
            ),
            _patch(
                f,
                "sglang.srt.utils.watchdog:SubprocessWatchdog._check_processes",
                R,
                role,
                _builder("main", "build_check_processes"),
                "stock SIGQUITs itself on a child's death without saying which DP rank died or how",
                "SGLang's watchdog surfaces the dead rank and answers in-flight requests",
            ),
            _patch(
                f,
                f"{TM}:TokenizerManager.__init__",
                W,
                role,
                _builder("main", "build_tm_init"),
                "the lifecycle needs the tokenizer manager and port_args (ipc names) of this server",
                "retires with the other main-process lifecycle patches",
            ),
            _patch(
                f,
                "sglang.srt.entrypoints.engine:Engine.shutdown",
                W,
                role,
                _builder("main", "build_engine_shutdown"),
                "the offline Engine's shutdown kills its tree and leaves the children's /dev/shm segments and "
                "multiprocessing semaphores behind (4 entries per DP2 Engine measured here)",
                "SGLang's Engine.shutdown cleans up what its tree created",
            ),
            MiddlewarePatch(
                feature=f,
                target="sglang.srt.entrypoints.http_server:app",
                kind=Kind.ROUTE,
                roles={role},
                build=_drain_gate,
                fingerprint=None,
                why="stock keeps accepting new requests while it drains (only /health turns 503)",
                retire_when="SGLang refuses new work with 503 during shutdown",
            ),
        ]
    if role is Role.CONTROLLER:
        return [
            _patch(
                f,
                "sglang.srt.managers.data_parallel_controller:DataParallelController.__init__",
                W,
                role,
                _builder("controller", "build_controller_init"),
                "stock's controller never checks how its schedulers exited (unreachable join on node 0)",
                "SGLang's DP controller monitors its schedulers and exits with their status",
            )
        ]
    if role is Role.SCHEDULER:
        return [
            _patch(
                f,
                f"{SCHED}.handle_shutdown",
                W,
                role,
                _builder("scheduler", "build_handle_shutdown"),
                "stock never tells the detokenizer, which is SIGKILLed",
                "SGLang forwards ShutdownReq to the detokenizer",
            ),
            _patch(
                f,
                f"{SCHED}.release_host_resources",
                W,
                role,
                _builder("scheduler", "build_release_host_resources", settings[S.BARRIER_TIMEOUT_S]),
                "stock tears its process groups down with no barrier: a rank can destroy groups a peer still uses",
                "SGLang meets the peers at a CPU barrier with a timeout before abort_distributed_environment",
            ),
            _patch(
                f,
                f"{SCHED}.run_event_loop",
                W,
                role,
                _builder("scheduler", "build_run_event_loop"),
                "stock logs a loop exception, SIGQUITs its parent and exits 0: the death is not attributable",
                "SGLang's scheduler exits non-zero naming its rank on an exception",
            ),
        ]
    if role is Role.DETOKENIZER:
        return [
            _patch(
                f,
                f"{DETOK}.event_loop",
                R,
                role,
                _builder("scheduler", "build_detokenizer_event_loop"),
                "stock's detokenizer has no ShutdownReq handler and dies by SIGKILL",
                "SGLang's detokenizer handles ShutdownReq",
            )
        ]
    return []


def gc_patches(role) -> list:
    if role is Role.SCHEDULER:
        return [
            _patch(
                S.GC_FREEZE,
                f"{SCHED}.get_init_info",
                Kind.WRAP,
                role,
                _builder("gc_freeze", "build_scheduler_get_init_info"),
                "stock 0.5.23 freezes only on the HTTP path (POST /freeze_gc after the warm-up request, #34999), without "
                "a gc.collect() first, never again after a later capture's gc.unfreeze(), and then runs full "
                "collections ~3x as often (CPython's gen-2 trigger ignores frozen objects): counting batches from "
                "here feeds the plugin's freeze, re-freeze and gen-2 pacer",
                "SGLang freezes on every path (Engine too), re-freezes after capture and paces gen-2 after its freeze",
            ),
            _patch(
                S.GC_FREEZE,
                f"{SCHED}.ingest_requests",
                Kind.WRAP,
                role,
                _builder("gc_freeze", "build_scheduler_ingest_requests"),
                "the freeze runs on the scheduler thread between loop iterations, where no graph capture "
                "can start between the capture check and gc.collect()/gc.freeze()",
                "SGLang freezes on every path (Engine too), re-freezes after capture and paces gen-2 after its freeze",
            ),
        ]
    if role is Role.DETOKENIZER:
        return [
            _patch(
                S.GC_FREEZE,
                f"{DETOK}.handle_batch_token_id_out",
                Kind.WRAP,
                role,
                _builder("gc_freeze", "build_detokenizer_batch"),
                "counts the detokenizer's batches towards its warm-up before the freeze",
                "SGLang freezes on every path (Engine too), re-freezes after capture and paces gen-2 after its freeze",
            )
        ]
    return []


@hookimpl
def dspark_features():
    return FEATURES


@hookimpl
def dspark_settings():
    return S.SETTINGS


@hookimpl
def dspark_metrics():
    from .metrics import GROUPS

    return GROUPS


@hookimpl
def dspark_patches(role, settings):
    out = []
    if settings[S.SHUTDOWN_SWITCH]:
        out += shutdown_patches(role, settings)
    if settings[S.GC_SWITCH]:
        out += gc_patches(role)
    if settings[S.GATE_CONTROL] and role is Role.SCHEDULER:
        out += [
            _patch(
                S.HICACHE_GATE,
                f"{ISC}.set_internal_state",
                Kind.WRAP,
                role,
                _builder("hicache_gate", "build_set_internal_state"),
                "stock /set_internal_state has a fixed key set; the gate key runs the one-shot eviction",
                "SGLang ships an idle-only, write-back preserving eviction control",
            ),
            _patch(
                S.HICACHE_GATE,
                f"{ISC}.get_internal_state",
                Kind.WRAP,
                role,
                _builder("hicache_gate", "build_get_internal_state"),
                "shows the gate's state and last outcome in /get_internal_state",
                "retires with the gate",
            ),
        ]
    if settings[S.HOSTPOOL_SWITCH] and role is Role.SCHEDULER:
        out.append(
            _patch(
                S.HOSTPOOL,
                "sglang.srt.mem_cache.pool_host.group:HostPoolGroup.destroy",
                Kind.REPLACE,
                role,
                _builder("hostpool", "build_destroy"),
                "stock destroys pools in a loop without isolation: the first failure skips the rest",
                "SGLang isolates each pool's destroy() and reports failures",
            )
        )
    if settings[S.STRICT_VMM_SWITCH] and role is Role.MAIN:
        out.append(
            _patch(
                S.STRICT_VMM,
                "sglang.srt.utils.cuda_vmm_transport_utils:CudaVmmMemoryPool.__init__",
                Kind.WRAP,
                role,
                _builder("vmm", "build_pool_init"),
                "on one node SGLang silently falls back from FABRIC to POSIX VMM handles",
                "SGLang exposes a strict handle-type option for the VMM transport",
            )
        )
    return out


@hookimpl
def dspark_process_bound(role, settings, report):
    ctx = roles.CONTEXT
    if ctx is None or (ctx.server_args is None and role is not Role.MAIN):
        return  # self-check children: nothing runs
    if F.bound_status(report, S.SHUTDOWN) is not None:
        if role is Role.MAIN:
            from .main import MAIN

            MAIN.configure(
                drain_s=settings[S.DRAIN_S],
                death_grace_s=settings[S.DEATH_GRACE_S],
                barrier_timeout_s=settings[S.BARRIER_TIMEOUT_S],
                owns_process=ctx.main_entry != "engine",
            )
        elif role is Role.SCHEDULER:
            from .scheduler import write_rank_record

            write_rank_record()
    if F.bound_status(report, S.HICACHE_GATE) is not None and role is Role.SCHEDULER:
        from .hicache_gate import GATE

        GATE.armed = True
    if F.bound_status(report, S.GC_FREEZE) is not None and role in (Role.MAIN, Role.SCHEDULER, Role.DETOKENIZER):
        from . import gc_freeze

        # metrics wait for the process's Prometheus mode inside the freezer (flush), the freeze does not
        gc_freeze.FREEZER.configure(
            role=role.value,
            dp_label=ctx.dp_label,
            after_batches=settings[S.GC_AFTER_BATCHES],
        )
        if role is Role.MAIN:
            gc_freeze.start_main_watch()


@hookimpl
def dspark_cli(subparsers, bench_subparsers):
    p = bench_subparsers.add_parser(
        "gc",
        help="gen-2 GC pauses with no freeze, stock's freeze after warm-up and the plugin's, on a scheduler-shaped heap",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--objects",
        type=int,
        default=1_100_000,
        help="GC-tracked objects in the process, SGLang's modules included (default 1.1M, as measured upstream in #30693)",
    )
    p.add_argument("--seconds", type=float, default=4.0, help="load duration per phase (default 4 s)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds, each one phase unfrozen, one with stock's freeze and one with the plugin's, order rotating (default 3)",
    )
    p.add_argument(
        "--running",
        type=int,
        default=4800,
        help="live requests in the serving loop, ~29 GC containers each (default 4800)",
    )

    def run(args):
        from .bench import main

        return main(args)

    p.set_defaults(func=run)
