"""Peer watch: a side thread of each scheduler that notices a DP2 peer which is alive but cannot run.

The exchange itself judges its peer while it waits (native/dp2_exchange.c: death, pid reuse, and a
process stopped / traced / in uninterruptible sleep for longer than
``SGLANG_DSPARK_DP2_SHM_PEER_STOP_MS``). But a stopped peer does not always leave this rank waiting
*in the exchange*: stock SGLang runs other per-iteration cross-rank collectives (under DP attention
the control-request ``broadcast_pyobj`` over the full TP group's gloo group, unless
``--enable-dp-attention-local-control-broadcast``; the model's own collectives), and a scheduler
blocked in one of those would sit there for the gloo timeout (30 min) with no message at all.

So this thread, independent of where the scheduler thread is blocked, reads the peer's process
state (pid + start time + ``/proc/<pid>/stat``, through the native handle) a few times per second:

* peer in state T / t / D for one stall period (``SGLANG_DSPARK_DP2_SHM_TIMEOUT_MS``): publish the
  stall on the health board (:mod:`.board`), so ``/health_scheduler`` answers 503 ``dp2_stalled``
  naming the peer's DP rank; cleared when the peer runs again;
* for longer than ``SGLANG_DSPARK_DP2_SHM_PEER_STOP_MS``: publish ``peer_died`` to the channel's shared
  state (the peer fails with ``poisoned`` as soon as it runs; a scheduler thread waiting in the
  exchange fails at once), then give this process's scheduler thread :data:`GRACE_S` to fail on its
  own; if it does not (it is blocked outside the exchange), log the error at CRITICAL and exit the
  process with :data:`EXIT_CODE`, which SGLang (and the lifecycle feature) treats as a scheduler death.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger("dspark_harden.dp2")

STUCK_STATES = {"T": "stopped", "t": "stopped by a tracer", "D": "in uninterruptible sleep"}
#: seconds the scheduler thread gets to fail on its own after the peer was declared dead
GRACE_S = 5.0
#: exit status of a scheduler the watch ends because its thread is blocked outside the exchange
EXIT_CODE = 1


def _flush_logs() -> None:
    for h in list(logging.getLogger().handlers) + list(logger.handlers):
        try:
            h.flush()
        except Exception:  # noqa: BLE001
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


class PeerWatch:
    """Watches the peer of ``runtime``'s channel ``channel`` (see the module docstring)."""

    def __init__(
        self,
        runtime,
        channel: str = "mlp",
        *,
        interval_s: Optional[float] = None,
        grace_s: float = GRACE_S,
        exit_fn: Callable[[int], None] = os._exit,
    ):
        self.rt, self.channel = runtime, channel
        period_s = runtime.timeout_ms / 1000.0
        self.period_s = period_s
        self.interval_s = interval_s if interval_s is not None else max(0.05, min(0.5, period_s / 4))
        self.grace_s, self.exit_fn = grace_s, exit_fn
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.declared: Optional[str] = None

    def start(self) -> "PeerWatch":
        self._thread = threading.Thread(target=self._run, name="dspark-dp2-peer-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self, join_timeout: float = 5.0) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(join_timeout)

    def _state(self):
        rt = self.rt
        with rt.lock:
            ch = rt.channels.get(self.channel)
            if ch is None or ch.closed:
                return None
            return ch.peer_state()

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # noqa: BLE001 - the watch must never take the scheduler down by accident
            logger.exception("dspark-harden dp2: peer watch failed; the exchange still checks its peer itself")

    def _loop(self) -> None:
        rt = self.rt
        rank, peer_rank = rt.rank, 1 - rt.rank
        since: Optional[float] = None
        seen_state = ""
        published = False
        while not self._stop.wait(self.interval_s):
            st = self._state()
            if st is None:
                return
            dead, pid, state, _why = st
            now = time.monotonic()
            if dead or pid <= 0 or state not in STUCK_STATES:
                since = None
                if published:
                    rt.board_clear()
                    published = False
                continue
            if since is None or state != seen_state:
                since, seen_state = now, state
                continue
            stuck_s = now - since
            what = STUCK_STATES[state]
            if stuck_s >= self.period_s:
                published = rt.board_publish(
                    self.channel,
                    stuck_s,
                    f"peer rank {peer_rank} (pid {pid}) is {what} (process state {state}) for {stuck_s:.1f} s; "
                    f"rank {rank} cannot finish a scheduler step without it",
                )
            if rt.peer_stop_ms and stuck_s * 1000.0 >= rt.peer_stop_ms:
                self._declare(pid, what, state, stuck_s)
                return

    def _declare(self, pid: int, what: str, state: str, stuck_s: float) -> None:
        rt = self.rt
        msg = (
            f"peer died: rank {1 - rt.rank} pid {pid} is {what} (state {state}) for {stuck_s:.1f} s, longer than "
            f"the limit of {rt.peer_stop_ms} ms (SGLANG_DSPARK_DP2_SHM_PEER_STOP_MS)"
        )
        with rt.lock:
            ch = rt.channels.get(self.channel)
            exc = ch.declare_peer_dead(msg) if ch is not None and not ch.closed else None
        self.declared = msg
        rt.count_error(self.channel, "peer_died")
        logger.error("dspark-harden dp2: %s", exc if exc is not None else msg)
        # a scheduler thread waiting in the exchange now fails within one wait slice and the process exits
        if rt.failed.wait(self.grace_s):
            return
        logger.critical(
            "dspark-harden dp2: %s; this scheduler (DP rank %d) is blocked outside the DP2 exchange (in a stock "
            "cross-rank collective) and cannot fail on its own: exiting with code %d",
            msg,
            rt.rank,
            EXIT_CODE,
        )
        _flush_logs()
        self.exit_fn(EXIT_CODE)
