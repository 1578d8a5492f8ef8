"""Runtime helpers for the grammar service's metric families (declared in dspark_harden.metrics).

Every helper is cheap and never raises: metrics must not fail a request.
"""

from __future__ import annotations

import logging

from .. import metrics as M

logger = logging.getLogger("dspark_harden.grammar")

SOURCES = ("memory", "inflight", "disk", "compile", "local_compile")
PHASES = ("disk_read", "verify", "deserialize", "native_compile", "serialize", "measure_compile", "measure_load", "entry_write_account")


def dp_label() -> str:
    from ..core import roles

    ctx = roles.CONTEXT
    return ctx.dp_label if ctx is not None else "none"


def _safe(fn):
    def run(*args, **kwargs):
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001
            logger.debug("grammar metric update failed", exc_info=True)

    return run


@_safe
def lookup(source: str, seconds: float) -> None:
    dp = dp_label()
    M.get("dspark_harden_grammar_lookups_total").labels(dp, source).inc()
    M.get("dspark_harden_grammar_resolution_seconds").labels(dp, source).observe(seconds)


@_safe
def observe_phases(phases: dict) -> None:
    dp = dp_label()
    h = M.get("dspark_harden_grammar_phase_seconds")
    for name, sec in phases.items():
        h.labels(dp, name).observe(sec)


@_safe
def observe_lock_wait(seconds: float) -> None:
    M.get("dspark_harden_grammar_disk_lock_wait_seconds").labels(dp_label()).observe(seconds)


@_safe
def inc_corrupt() -> None:
    M.get("dspark_harden_grammar_corrupt_entries_total").labels(dp_label()).inc()


@_safe
def inc_timeout() -> None:
    M.get("dspark_harden_grammar_compile_timeouts_total").labels(dp_label()).inc()


@_safe
def inc_failure() -> None:
    M.get("dspark_harden_grammar_compile_failures_total").labels(dp_label()).inc()


@_safe
def inc_disk_error(op: str) -> None:
    M.get("dspark_harden_grammar_disk_errors_total").labels(dp_label(), op).inc()


@_safe
def inc_stored(kind: str) -> None:
    M.get("dspark_harden_grammar_disk_stored_total").labels(dp_label(), kind).inc()


@_safe
def inc_evictions(tier: str, reason: str, n: int = 1) -> None:
    if n:
        M.get("dspark_harden_grammar_evictions_total").labels(dp_label(), tier, reason).inc(n)


@_safe
def set_memory(nbytes: int, entries: int) -> None:
    dp = dp_label()
    M.get("dspark_harden_grammar_memory_cache_bytes").labels(dp).set(nbytes)
    M.get("dspark_harden_grammar_memory_cache_entries").labels(dp).set(entries)


@_safe
def set_disk_bytes(nbytes: int) -> None:
    M.get("dspark_harden_grammar_disk_cache_bytes").labels(dp_label()).set(nbytes)
