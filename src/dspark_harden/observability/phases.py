"""Scheduler-loop phase metrics: accumulated seconds, call counts and a rolling maximum per phase.

Stock SGLang 0.5.23 only exports exclusive wall time per stage
(``sglang:scheduler_stage_seconds_total{category}``, no counts, no maxima). We wrap the six
methods the scheduler loop (``event_loop_normal`` / ``event_loop_overlap``) calls once per
iteration — the same methods SGLang decorates with ``scheduler_stage_method`` — with a timer:

=======================  ===================================================================
phase                    target
=======================  ===================================================================
recv_requests            ``SchedulerRequestReceiver.recv_requests``
process_input_requests   ``Scheduler.process_input_requests``
get_next_batch_to_run    ``Scheduler.get_next_batch_to_run``
run_batch                ``Scheduler.run_batch``
process_batch_result     ``Scheduler.process_batch_result``
idle                     ``Scheduler.on_idle`` (includes the ``--sleep-on-idle`` poll)
check_hicache_events     ``UnifiedRadixCache.check_hicache_events`` (the HiCache poll, inside
                         ``get_next_batch_to_run``; only with ``--enable-hierarchical-cache``)
=======================  ===================================================================

The ``check_hicache_events`` wrapper also tells :data:`.hicache.SAMPLER` which tree this scheduler
polls; every flush then samples that tree's in-flight transfers into
``dspark_harden_hicache_ongoing_{operations,tokens}`` (see :mod:`.hicache`).

Times are inclusive (a phase's seconds include what it calls). Each call costs two
``perf_counter()`` reads and a few list updates on the scheduler thread; the values are pushed
to the (multiprocess, mmap-backed) Prometheus metrics at most once per flush interval
(``DSPARK_HARDEN_METRICS_FLUSH_INTERVAL_S``, default 1 s), when a phase ends. The idle phase ends
at least once per second even with ``--sleep-on-idle`` (SGLang's idle poll times out after 1 s),
so an idle server keeps flushing. ``*_max_seconds`` is the longest single call in the latest
flush window (0 when the phase did not run in it).

The recorder is single-threaded by design: every wrapped method runs on the scheduler thread.
Only the first attention-TP rank of each DP group records (like SGLang's own scheduler metrics
collector), so ranks sharing a ``dp_rank`` label never double count.
"""

from __future__ import annotations

import atexit
import functools
import time
from typing import Any, Callable, Optional

from ..core import metrics
from ..core.patch import Kind, Patch, Role
from .metrics import PHASE_FEATURE, SCHEDULER_PHASES

FEATURE = PHASE_FEATURE

# (phase, target, fingerprint of the stock sglang 0.5.23 source)
TARGETS = (
    (
        "recv_requests",
        "sglang.srt.managers.scheduler_components.request_receiver:SchedulerRequestReceiver.recv_requests",
        "0846535320be2d19",
    ),
    ("process_input_requests", "sglang.srt.managers.scheduler:Scheduler.process_input_requests", "f02ae3a75f271380"),
    ("get_next_batch_to_run", "sglang.srt.managers.scheduler:Scheduler.get_next_batch_to_run", "9c5ef634896394e9"),
    ("run_batch", "sglang.srt.managers.scheduler:Scheduler.run_batch", "c314c0d4b02c8565"),
    ("process_batch_result", "sglang.srt.managers.scheduler:Scheduler.process_batch_result", "a67c683e53477b43"),
    ("idle", "sglang.srt.managers.scheduler:Scheduler.on_idle", "2286eb316401a990"),
    (
        "check_hicache_events",
        "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.check_hicache_events",
        "56ec760049eed244",
    ),
)
assert tuple(t[0] for t in TARGETS) == SCHEDULER_PHASES

SECONDS = "dspark_harden_scheduler_phase_seconds_total"
CALLS = "dspark_harden_scheduler_phase_calls_total"
MAX = "dspark_harden_scheduler_phase_max_seconds"


class PhaseRecorder:
    """Per-process accumulator; :meth:`flush` pushes deltas to Prometheus."""

    def __init__(
        self,
        phases: tuple = SCHEDULER_PHASES,
        *,
        dp_label: str = "none",
        interval_s: float = 1.0,
        enabled: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"flush interval must be positive, got {interval_s}")
        self.phases = tuple(phases)
        self.dp_label = dp_label
        self.interval_s = interval_s
        self.enabled = enabled
        self.clock = clock
        n = len(self.phases)
        self.seconds = [0.0] * n
        self.calls = [0] * n
        self.max = [0.0] * n
        self._next_flush = clock() + interval_s
        self._children: Optional[list] = None
        self.flushes = 0
        # called at every flush, after the phase values (scheduler thread): gauges sampled from live state
        self.samplers: list = []

    def index(self, phase: str) -> int:
        return self.phases.index(phase)

    def observe(self, i: int, dt: float, now: float) -> None:
        """Record one call of phase ``i`` that took ``dt`` seconds and ended at ``now``."""
        if not self.enabled:
            return
        self.seconds[i] += dt
        self.calls[i] += 1
        if dt > self.max[i]:
            self.max[i] = dt
        if now >= self._next_flush:
            self.flush(now)

    def _resolve(self) -> list:
        if self._children is None:
            sec, calls, mx = metrics.get(SECONDS), metrics.get(CALLS), metrics.get(MAX)
            self._children = [
                (sec.labels(self.dp_label, p), calls.labels(self.dp_label, p), mx.labels(self.dp_label, p))
                for p in self.phases
            ]
        return self._children

    def flush(self, now: Optional[float] = None) -> None:
        if not self.enabled:
            return
        children = self._resolve()
        for i, (sec, calls, mx) in enumerate(children):
            n = self.calls[i]
            if n:
                sec.inc(self.seconds[i])
                calls.inc(n)
                self.seconds[i], self.calls[i] = 0.0, 0
            mx.set(self.max[i])
            self.max[i] = 0.0
        for sampler in self.samplers:
            sampler()
        self._next_flush = (self.clock() if now is None else now) + self.interval_s
        self.flushes += 1


RECORDER: Optional[PhaseRecorder] = None


def recorder() -> PhaseRecorder:
    """This process's recorder (created on first use from the process context and settings)."""
    global RECORDER
    if RECORDER is None:
        RECORDER = PhaseRecorder()
        atexit.register(_flush_at_exit)
    return RECORDER


def configure(*, dp_label: str, interval_s: float, enabled: bool) -> PhaseRecorder:
    from .hicache import SAMPLER

    rec = recorder()
    rec.dp_label, rec.interval_s, rec.enabled = dp_label, interval_s, enabled
    rec._children = None
    SAMPLER.configure(dp_label)
    if SAMPLER not in rec.samplers:
        rec.samplers.append(SAMPLER)
    rec._next_flush = rec.clock() + interval_s
    return rec


def _flush_at_exit() -> None:
    rec = RECORDER
    if rec is not None and rec.enabled and any(rec.calls):
        try:
            rec.flush()
        except Exception:  # noqa: BLE001 - interpreter shutdown: never raise from atexit
            pass


def records_here(server_args: Any, tp_rank: Optional[int]) -> bool:
    """True on the first attention-TP rank of a DP group (every rank under DP2 / attention-TP1)."""
    if server_args is None or tp_rank is None:
        return True
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    # sglang 0.5.23 resolves "--dp-size N --enable-dp-attention" into attn_dp_size=N, dp_size=1
    attn_dp = int(getattr(server_args, "attn_dp_size", 0) or 0)
    if attn_dp <= 1:
        dp = int(getattr(server_args, "dp_size", 1) or 1)
        attn_dp = dp if getattr(server_args, "enable_dp_attention", False) else 1
    attn_tp = max(1, tp // attn_dp)
    return tp_rank % attn_tp == 0


def timed(stock: Callable, phase: str) -> Callable:
    """Wrap ``stock`` (a plain function taking ``self``) so each call is recorded under ``phase``.

    The hot path is inlined (no method call per observation): two clock reads, three list
    updates, one comparison with the next flush time.
    """
    rec = recorder()
    i = rec.index(phase)
    clock = time.perf_counter
    seconds, calls, longest = rec.seconds, rec.calls, rec.max  # mutated in place by flush()

    @functools.wraps(stock)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return stock(*args, **kwargs)
        finally:
            if rec.enabled:
                now = clock()
                dt = now - t0
                seconds[i] += dt
                calls[i] += 1
                if dt > longest[i]:
                    longest[i] = dt
                if now >= rec._next_flush:
                    rec.flush(now)

    wrapper.__dspark_phase__ = phase
    return wrapper


def timed_hicache_poll(stock: Callable) -> Callable:
    """:func:`timed` under ``check_hicache_events`` that also hands the polled tree to the HiCache sampler."""
    from .hicache import SAMPLER

    inner = timed(stock, "check_hicache_events")
    watch = SAMPLER.watch

    @functools.wraps(stock)
    def check_hicache_events(self: Any, *args: Any, **kwargs: Any) -> Any:
        watch(self)
        return inner(self, *args, **kwargs)

    check_hicache_events.__dspark_phase__ = "check_hicache_events"
    return check_hicache_events


def _build(phase: str) -> Callable:
    if phase == "check_hicache_events":
        return timed_hicache_poll
    return functools.partial(timed, phase=phase)


def patches() -> list[Patch]:
    out = []
    for phase, target, fp in TARGETS:
        out.append(
            Patch(
                feature=FEATURE,
                target=target,
                kind=Kind.WRAP,
                roles={Role.SCHEDULER},
                build=_build(phase),
                fingerprint=fp,
                why=f"scheduler phase metrics: seconds, calls and rolling max of '{phase}' per dp_rank "
                "(stock exports exclusive stage seconds only)",
                retire_when="SGLang's scheduler_stage_method exports per-stage call counts and maxima with a dp_rank label",
            )
        )
    return out
