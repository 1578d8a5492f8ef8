"""Per-process channel manager: opens the native channels of this scheduler, records metrics.

One :class:`Dp2Runtime` per scheduler process (``RUNTIME``), configured when the plugin is bound
(``dspark_process_bound``). Channels are opened eagerly at that point (non-blocking: create or
attach), so a configuration mismatch between the two ranks stops startup; the first exchange
happens on the first scheduler step. Closing is registered with ``atexit`` (and is a no-op in a
forked child, which never touches the parent's shared state).
"""

from __future__ import annotations

import atexit
import bisect
import hashlib
import logging
import threading
import time
from typing import Optional

from .metrics import DP2_HIST_EDGES_NS, DP2_HIST_EDGES_S
from .native import PY_ERROR, Channel, Dp2Error, lib

logger = logging.getLogger("dspark_harden.dp2")

PHASES = ("call_total", "exchange_total", "peer_wait", "arrival_skew", "post_latest_arrival")
FLUSH_INTERVAL_S = 1.0
HIST_BUCKETS = len(DP2_HIST_EDGES_S) + 1


def check_hist_edges() -> None:
    """The native call buckets with its own edges: they must be the declared family's (fail closed)."""
    native = tuple(int(lib.dspark_dp2_hist_edge_ns(b)) for b in range(int(lib.DSPARK_DP2_HIST_BUCKETS) - 1))
    if native != DP2_HIST_EDGES_NS or int(lib.DSPARK_DP2_HIST_BUCKETS) != HIST_BUCKETS:
        raise Dp2Error(-1, f"dp2: the native histogram edges {native} are not the declared {DP2_HIST_EDGES_NS}")


def config_digest(channel: str, width: int, fields: tuple, geometry: tuple) -> int:
    """64-bit digest of everything both ranks must agree on (checked by the native open)."""
    from .. import __version__

    doc = repr((channel, width, tuple(fields), tuple(geometry), __version__)).encode()
    return int.from_bytes(hashlib.sha256(doc).digest()[:8], "little")


class _Acc:
    """Per-channel metrics: the native call accumulates its own phase sums/maxima in the stats
    struct; Python adds only the whole-call time. Flushed to Prometheus at most once per second."""

    __slots__ = ("channel", "label", "export", "stats", "call_sum", "call_max", "call_hist", "deadline")

    def __init__(self, channel: str, label: str, export: bool, stats):
        self.channel, self.label, self.export, self.stats = channel, label, export, stats
        self.call_sum = self.call_max = 0.0
        # the whole call's histogram counts (bucket i: <= DP2_HIST_EDGES_S[i]; last: above); the native
        # phases are bucketed by the native call itself (stats.acc_hist)
        self.call_hist = [0] * HIST_BUCKETS
        self.deadline = time.perf_counter() + FLUSH_INTERVAL_S

    def record(self, call_s: float, now: float) -> None:
        self.call_sum += call_s
        if call_s > self.call_max:
            self.call_max = call_s
        self.call_hist[bisect.bisect_left(DP2_HIST_EDGES_S, call_s)] += 1
        if now >= self.deadline:
            self.flush(now)

    def flush(self, now: Optional[float] = None) -> None:
        self.deadline = (now if now is not None else time.perf_counter()) + FLUSH_INTERVAL_S
        st = self.stats
        calls = st.acc_calls
        sums = [self.call_sum] + [st.acc_sum_ns[i] * 1e-9 for i in range(4)]
        maxes = [self.call_max] + [st.acc_max_ns[i] * 1e-9 for i in range(4)]
        futex = st.acc_futex_waits
        hists = [self.call_hist] + [list(st.acc_hist[i]) for i in range(4)]
        st.acc_calls = st.acc_futex_waits = 0
        for i in range(4):
            st.acc_sum_ns[i] = 0
            st.acc_max_ns[i] = 0
            for b in range(HIST_BUCKETS):
                st.acc_hist[i][b] = 0
        self.call_sum = self.call_max = 0.0
        self.call_hist = [0] * HIST_BUCKETS
        if not self.export or not calls:
            return
        from ..core import metrics

        ch, dp = self.channel, self.label
        metrics.get("dspark_harden_dp2_exchange_calls_total").labels(ch, dp).inc(calls)
        if futex:
            metrics.get("dspark_harden_dp2_exchange_futex_waits_total").labels(ch, dp).inc(futex)
        secs = metrics.get("dspark_harden_dp2_exchange_seconds_total")
        mx = metrics.get("dspark_harden_dp2_exchange_max_seconds")
        hist = metrics.get("dspark_harden_dp2_exchange_phase_seconds")
        for i, phase in enumerate(PHASES):
            secs.labels(ch, dp, phase).inc(sums[i])
            mx.labels(ch, dp, phase).set(maxes[i])
            metrics.add_histogram_counts(hist.labels(ch, dp, phase), hists[i], sums[i])
        metrics.get("dspark_harden_dp2_exchange_sequence").labels(ch, dp).set(st.sequence)

    def error(self, name: str) -> None:
        self.flush()
        if self.export:
            from ..core import metrics

            metrics.get("dspark_harden_dp2_exchange_errors_total").labels(self.channel, self.label, name).inc()


class Dp2Runtime:
    """The open channels of this process (at most one per channel name)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.channels: dict[str, Channel] = {}
        self.accs: dict[str, _Acc] = {}
        self.session_id: Optional[str] = None
        self.timeout_ms = 30000
        self.hard_timeout_ms = 1_800_000
        self.spin_ns = 50_000
        self.export = True
        self.rank: Optional[int] = None
        self.dp_label = "none"
        self.peer_stop_ms = 60_000
        #: the stall board /health_scheduler reads (:mod:`.board`); None when the launcher made none
        self.board = None
        #: set when a Dp2Error is raised to the scheduler (the peer watch then leaves the exit to it)
        self.failed = threading.Event()
        self.watch = None
        self._atexit = False

    def configure(
        self,
        *,
        session_id: str,
        timeout_ms: int,
        spin_us: int,
        export: bool,
        rank: int,
        dp_label: str,
        hard_timeout_ms: int = 1_800_000,
        peer_stop_ms: int = 60_000,
        use_board: bool = True,
    ) -> None:
        if rank not in (0, 1):
            raise Dp2Error(-1, f"dp2: this scheduler's rank must be 0 or 1, got {rank!r}")
        self.session_id, self.timeout_ms, self.spin_ns = session_id, timeout_ms, spin_us * 1000
        self.hard_timeout_ms, self.peer_stop_ms = hard_timeout_ms, peer_stop_ms
        self.export, self.rank, self.dp_label = export, rank, dp_label
        self.board = None
        if use_board:
            from . import board

            try:
                self.board = board.from_environment()
            except board.BoardError as exc:
                raise Dp2Error(-1, f"dp2: {exc}") from None
            if self.board is None:
                logger.info(
                    "dspark-harden dp2: no stall board (%s unset: the launching process did not create "
                    "one); /health_scheduler cannot name a rank that stalls the exchange",
                    board.ENV,
                )

    def open(self, name: str, *, width: int, digest: int, out_tensor=None) -> Channel:
        with self.lock:
            ch = self.channels.get(name)
            if ch is not None:
                return ch
            if self.session_id is None or self.rank is None:
                raise Dp2Error(-1, "dp2: runtime not configured (the plugin did not bind in this process)")
            check_hist_edges()
            ch = Channel(
                self.session_id,
                name,
                rank=self.rank,
                width=width,
                timeout_ms=self.timeout_ms,
                spin_ns=self.spin_ns,
                config_digest=digest,
                out_tensor=out_tensor,
                hard_timeout_ms=self.hard_timeout_ms,
                on_stall=self._stall_reporter(name),
                on_stall_end=self._stall_end(name),
                peer_stop_ms=self.peer_stop_ms,
            )
            self.channels[name] = ch
            self.accs[name] = _Acc(name, self.dp_label, self.export, ch.stats)
            if self.export:
                from ..core import metrics

                metrics.get("dspark_harden_dp2_exchange_enabled").labels(name, self.dp_label).set(1)
            if not self._atexit:
                atexit.register(self.close_all)
                self._atexit = True
            logger.info(
                "dspark-harden dp2: opened channel %s (%s) as rank %d, width %d", name, ch.shm_name, self.rank, width
            )
            return ch

    def _stall_reporter(self, name: str):
        def report(message: str, waited_s: float) -> None:
            logger.warning(
                "dspark-harden dp2: channel %s: %s; still waiting (hard limit %s)",
                name,
                message,
                f"{self.hard_timeout_ms} ms" if self.hard_timeout_ms else "none",
            )
            if self.export:
                from ..core import metrics

                metrics.get("dspark_harden_dp2_exchange_stalls_total").labels(name, self.dp_label).inc()
            self.board_publish(name, waited_s, message)

        return report

    def _stall_end(self, name: str):
        def end(waited_s: float) -> None:
            self.board_clear()
            logger.warning("dspark-harden dp2: channel %s: the exchange that stalled for %.1f s ended", name, waited_s)

        return end

    # -- health board / peer watch ---------------------------------------------------------------
    def board_publish(self, channel: str, waited_s: float, message: str) -> bool:
        """Publish 'this rank waits for the peer' on the health board; False without a board."""
        if self.board is None or self.rank is None:
            return False
        try:
            self.board.publish_stall(
                rank=self.rank,
                peer_rank=1 - self.rank,
                channel=channel,
                waited_s=waited_s,
                period_s=self.timeout_ms / 1000.0,
                message=message,
            )
            return True
        except Exception:  # noqa: BLE001 - health reporting must not break the exchange
            logger.exception("dp2: publishing the stall to the health board failed")
            return False

    def board_clear(self) -> None:
        if self.board is not None and self.rank is not None:
            try:
                self.board.clear(self.rank)
            except Exception:  # noqa: BLE001
                logger.exception("dp2: clearing the health board failed")

    def count_error(self, name: str, code: str) -> None:
        if self.export:
            try:
                from ..core import metrics

                metrics.get("dspark_harden_dp2_exchange_errors_total").labels(name, self.dp_label, code).inc()
            except Exception:  # noqa: BLE001
                logger.debug("dp2: error metric failed", exc_info=True)

    def start_watch(self, channel: str = "mlp", **kw):
        """Start the peer watch (dp2/watch.py) on ``channel`` (once per process)."""
        from .watch import PeerWatch

        if self.watch is None:
            self.watch = PeerWatch(self, channel, **kw).start()
        return self.watch

    def record_error(self, name: str, exc: BaseException) -> None:
        self.failed.set()
        acc = self.accs.get(name)
        code = exc.name if isinstance(exc, Dp2Error) else PY_ERROR
        if acc is not None:
            try:
                acc.error(code)
            except Exception:  # noqa: BLE001 - metrics must not mask the real error
                logger.exception("dp2: recording error metric failed")

    def close_all(self) -> None:
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.stop()
        with self.lock:
            for name, ch in list(self.channels.items()):
                acc = self.accs.get(name)
                try:
                    if acc is not None:
                        acc.flush()
                        if acc.export:
                            from ..core import metrics

                            metrics.get("dspark_harden_dp2_exchange_enabled").labels(name, self.dp_label).set(0)
                except Exception:  # noqa: BLE001 - closing must still happen
                    pass
                try:
                    ch.close()
                except Dp2Error as exc:
                    logger.error("dp2: closing channel %s: %s", name, exc)
            self.channels.clear()


RUNTIME = Dp2Runtime()


def pair_exchange(runtime: "Dp2Runtime", channel: str, width: int, fields: tuple):
    """``exchange(row) -> [row0, row1]`` over a dedicated native channel opened for the one call
    (session / rank / timeouts of ``runtime``); the ``dspark_pair_exchange`` hook's answer."""

    def exchange(row) -> list:
        ch = Channel(
            runtime.session_id,
            channel,
            rank=runtime.rank,
            width=width,
            timeout_ms=runtime.timeout_ms,
            spin_ns=runtime.spin_ns,
            config_digest=config_digest(channel, width, tuple(fields), (2, 1, 1)),
            hard_timeout_ms=runtime.hard_timeout_ms,
        )
        try:
            flat = ch.exchange(list(row))
        finally:
            ch.close()
        return [flat[:width], flat[width:]]

    return exchange
