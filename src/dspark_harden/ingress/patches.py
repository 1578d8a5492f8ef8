"""The ingress features' patch objects (declared, fingerprinted against sglang 0.5.23): built here
so the feature module and the bench both use them without importing each other."""

from __future__ import annotations

from ..core.patch import Kind, Patch, Role
from . import controller as C
from . import scheduler as S
from . import tokenizer as T
from .settings import ATOMIC, ATOMIC_SWITCH, DEFAULT_SPIN_US, LOOP, LOOP_SWITCH, POLL_MS, SPIN_US

TM = "sglang.srt.managers.tokenizer_manager:TokenizerManager"
DPC = "sglang.srt.managers.data_parallel_controller:DataParallelController"
SCHED = "sglang.srt.managers.scheduler:Scheduler"


def patches(role: Role, settings) -> list:
    out: list = []
    if settings[ATOMIC_SWITCH]:
        common = dict(
            feature=ATOMIC,
            retire_when="SGLang keeps uniformly routed batches together under DP "
            "attention and validates routed ranks without raising in the controller loop",
        )
        out += [
            Patch(
                target=f"{TM}._should_use_batch_tokenization",
                kind=Kind.WRAP,
                roles={Role.MAIN},
                build=T.build_should_use_batch_tokenization,
                fingerprint="985048d584a54418",
                why="stock tokenizes and sends each item of a routed batch as its own message under DP attention",
                **common,
            ),
            Patch(
                target=f"{DPC}.dispatch_batch_generate",
                kind=Kind.WRAP,
                roles={Role.CONTROLLER},
                build=C.build_dispatch_batch_generate,
                fingerprint="5b71c953037d28e8",
                why="stock dispatches each item of a batch separately (one ZMQ send per item) and "
                "raises on an inactive routed rank, which SIGQUITs the server",
                **common,
            ),
            Patch(
                target=f"{DPC}.dispatching_with_trace",
                kind=Kind.WRAP,
                roles={Role.CONTROLLER},
                build=C.build_dispatching_with_trace,
                fingerprint="ad797206fa05c8f3",
                why="an inactive routed_dp_rank raises ValueError in the controller loop, which "
                "kills the server; answer that request with a 400 instead",
                **common,
            ),
            Patch(
                target=f"{SCHED}.handle_batch_generate_request",
                kind=Kind.WRAP,
                roles={Role.SCHEDULER},
                build=S.build_handle_batch_generate_request,
                fingerprint="4eb6d77d4759ebd9",
                why="count batch messages per DP rank where they arrive (observability only)",
                **common,
            ),
        ]
    if settings[LOOP_SWITCH]:
        poll_ms, spin_us = settings[POLL_MS], settings.get(SPIN_US, DEFAULT_SPIN_US)
        out.append(
            Patch(
                feature=LOOP,
                target=f"{DPC}.event_loop",
                kind=Kind.REPLACE,
                roles={Role.CONTROLLER},
                build=lambda _stock: C.build_event_loop(poll_ms, spin_us),
                fingerprint="804af740481d2c51",
                why="stock event_loop is a non-blocking busy loop: one core at 100 % when idle",
                retire_when="SGLang's DP controller blocks on its socket (zmq poll) when idle",
            )
        )
    return [p for p in out if role in p.roles]
