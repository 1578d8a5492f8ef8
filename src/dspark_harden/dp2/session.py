"""The DP2 exchange's session id without ceremony.

The session id names the shared-memory segments of one server's two DP ranks: both ranks must see
the same value and two servers on one host must never share one. An operator may export
``SGLANG_DSPARK_DP2_SHM_SESSION_ID`` (honoured as is). When it is unset, the main process derives
a fresh id for every launch — right before SGLang spawns the DP controller and schedulers
(``Engine._launch_subprocesses``, wrapped in the main role) — and exports it into its own
environment, which the children inherit. The id combines the main process's pid with 64 random
bits, so concurrent servers on one host (separate main processes, or several Engines in one
process) get different ids.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from typing import Optional

from . import board
from .settings import SESSION_ID

logger = logging.getLogger("dspark_harden.dp2")

LAUNCH_TARGET = "sglang.srt.entrypoints.engine:Engine._launch_subprocesses"
#: fingerprint_source(Engine._launch_subprocesses) in sglang 0.5.23
LAUNCH_FINGERPRINT = "ebe219a6ad22352f"
PREFIX = "auto-"


def derive() -> str:
    """A new per-launch session id (unique per server instance on this host)."""
    return f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}"


def _announce(message: str) -> None:
    """INFO, or stderr while SGLang has not configured logging yet (it does so inside the wrapped
    call): which id a launch uses must always be visible in the server log."""
    if logger.isEnabledFor(logging.INFO):
        logger.info(message)
    else:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def build_launch_subprocesses(explicit: Optional[str]):
    """WRAP builder for ``Engine._launch_subprocesses`` (a classmethod): export a fresh session id
    before the children are spawned unless the operator set one (``explicit``)."""

    def build(stock):
        func = stock.__func__ if isinstance(stock, classmethod) else stock

        def _launch_subprocesses(cls, *args, **kwargs):
            # the stall board /health_scheduler reads, reached by the children through /proc (dp2/board.py)
            board.create_for_launch()
            if explicit:
                os.environ[SESSION_ID] = explicit  # honoured as is (and restored if something changed it)
            else:
                sid = derive()
                os.environ[SESSION_ID] = sid
                _announce(
                    f"dspark-harden dp2: {SESSION_ID} unset; derived {sid} for this launch "
                    f"(inherited by its DP controller and schedulers)"
                )
            return func(cls, *args, **kwargs)

        _launch_subprocesses.__name__ = func.__name__
        _launch_subprocesses.__qualname__ = func.__qualname__
        _launch_subprocesses.__doc__ = func.__doc__
        _launch_subprocesses.__wrapped__ = func
        return classmethod(_launch_subprocesses) if isinstance(stock, classmethod) else _launch_subprocesses

    return build
