"""``HostPoolGroup.destroy`` with per-pool isolation.

Stock 0.5.23 (mem_cache/pool_host/group.py) loops ``entry.host_pool.destroy()`` over its entries:
the first pool that raises skips every pool after it, so their pinned host buffers are left for
the process exit (or leaked, in a long-lived Engine). Here every pool's ``destroy()`` runs; the
failures are collected and, after all ran, logged and raised together as
:class:`HostPoolTeardownError` naming each pool and its exception.
"""

from __future__ import annotations

import logging

from ..core import metrics, roles

logger = logging.getLogger("dspark_harden.lifecycle")


class HostPoolTeardownError(RuntimeError):
    """One or more host pools failed to destroy; ``failures`` is [(pool name, exception)]."""

    def __init__(self, failures: list, total: int):
        self.failures = failures
        names = "; ".join(f"pool {name!r}: {type(exc).__name__}: {exc}" for name, exc in failures)
        super().__init__(
            f"{len(failures)} of {total} host pool(s) failed to destroy (every other pool was destroyed): {names}"
        )


def _count(outcome: str) -> None:
    try:
        ctx = roles.CONTEXT
        metrics.child("dspark_harden_hostpool_destroys_total", ctx.dp_label if ctx else "none", outcome).inc()
    except Exception:  # noqa: BLE001
        logger.debug("metric unavailable", exc_info=True)


def _pool_name(entry) -> str:
    name = getattr(entry, "name", None)
    return str(getattr(name, "value", name)) if name is not None else type(getattr(entry, "host_pool", entry)).__name__


def build_destroy(_stock):
    def destroy(self) -> None:
        failures = []
        for entry in self.entries:
            try:
                entry.host_pool.destroy()
            except Exception as exc:  # noqa: BLE001 - collected, reported after every pool ran
                failures.append((_pool_name(entry), exc))
                _count("failed")
            else:
                _count("destroyed")
        if failures:
            err = HostPoolTeardownError(failures, len(self.entries))
            logger.error("dspark-harden hostpool-teardown: %s", err)
            raise err

    return destroy
