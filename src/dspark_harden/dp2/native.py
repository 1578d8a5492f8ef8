"""Thin Python wrapper over the C11 exchange (``dspark_harden._dp2_native``, cffi API mode).

Every native call returns an error code plus a message; :func:`_check` turns a non-zero code into
a :class:`Dp2Error` carrying the code, its stable name and the native message. The ABI stamp
compiled into the library is checked at import: a stale ``.so`` refuses to load.
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Sequence

from .._dp2_native import ffi, lib

logger = logging.getLogger("dspark_harden.dp2")

EXPECTED_ABI = 5
ERRBUF = 512


def verify_abi(compiled: int, header: int) -> None:
    """Refuse a library whose compiled ABI stamp (or header constant) differs from this wrapper's."""
    if compiled != EXPECTED_ABI or header != EXPECTED_ABI:
        raise ImportError(
            f"dspark_harden._dp2_native ABI {compiled} does not match the Python wrapper (expects "
            f"{EXPECTED_ABI}, header says {header}); rebuild with `pip install -e .`"
        )


verify_abi(lib.dspark_dp2_abi_version(), lib.DSPARK_DP2_ABI_VERSION)

# code -> stable name (metric label values; docs/dp2.md lists each with its meaning)
CODE_NAMES = {
    lib.DSPARK_DP2_E_ARG: "bad_argument",
    lib.DSPARK_DP2_E_SHM: "shm",
    lib.DSPARK_DP2_E_MISMATCH: "mismatch",
    lib.DSPARK_DP2_E_OWNED: "owned",
    lib.DSPARK_DP2_E_FORK: "used_after_fork",
    lib.DSPARK_DP2_E_CLOSED: "closed",
    lib.DSPARK_DP2_E_POISONED: "poisoned",
    lib.DSPARK_DP2_E_OWNERSHIP: "ownership_changed",
    lib.DSPARK_DP2_E_CLOCK: "clock",
    lib.DSPARK_DP2_E_SEQUENCE: "sequence_divergence",
    lib.DSPARK_DP2_E_PEER_DIED: "peer_died",
    lib.DSPARK_DP2_E_PEER_CLOSED: "peer_closed",
    lib.DSPARK_DP2_E_TIMEOUT: "timeout",
    lib.DSPARK_DP2_E_FUTEX: "futex",
    lib.DSPARK_DP2_E_LAPPED: "lapped",
    lib.DSPARK_DP2_E_ARRIVAL: "missing_arrival",
    lib.DSPARK_DP2_E_UNLINK: "unlink",
    lib.DSPARK_DP2_E_CALLER: "caller_error",
    lib.DSPARK_DP2_STALLED: "stalled",
}
# Python-side failures (schema, geometry, misuse) share the errors metric under this name.
PY_ERROR = "python_check"


class Dp2Error(RuntimeError):
    """A native DP2 exchange failure. ``code`` is the C error code, ``name`` its stable name."""

    def __init__(self, code: int, message: str):
        self.code = code
        self.name = CODE_NAMES.get(code, PY_ERROR if code < 0 else f"code_{code}")
        super().__init__(message)


def _check(rc: int, err, what: str) -> None:
    """Raise :class:`Dp2Error` for a non-zero native return code."""
    if rc != 0:
        msg = ffi.string(err).decode("utf-8", "replace") or f"{what} failed with code {rc}"
        raise Dp2Error(rc, msg)


def _check_out_tensor(t, width: int) -> None:
    """The C side writes 2*width int64 values through ``data_ptr()``: only a contiguous int64 CPU tensor of
    exactly that size is safe (a CUDA pointer would be written as host memory)."""
    import torch

    problems = []
    if t.device.type != "cpu":
        problems.append(f"device {t.device} (must be cpu)")
    if t.dtype != torch.int64:
        problems.append(f"dtype {t.dtype} (must be torch.int64)")
    if not t.is_contiguous():
        problems.append("not contiguous")
    if t.numel() != 2 * width:
        problems.append(f"{t.numel()} elements (must be 2*width = {2 * width})")
    if problems:
        raise ValueError("dp2 out_tensor unusable: " + ", ".join(problems))


def shm_name_for(session_id: str, channel: str) -> str:
    buf = ffi.new("char[]", 64)
    if lib.dspark_dp2_name_for(session_id.encode(), channel.encode(), buf, 64) != 0:
        raise ValueError("bad session id / channel")
    return ffi.string(buf).decode()


class Channel:
    """One open end (rank 0 or 1) of a two-process exchange of ``width`` int64 values.

    Hot path: :meth:`exchange` packs the row with one ``struct.pack_into`` into the request buffer
    bound to the native handle at open (``dspark_dp2_bind``), makes the one-argument native call
    ``dspark_dp2_exchange_bound(handle)`` (cffi passes one argument without building an argument
    tuple: ~70 ns here against ~200-400 ns for the six-argument ``dspark_dp2_exchange``) and reads
    both rows (rank order) back with one ``struct.unpack_from``, as a flat Python list. Stats of the
    last call are in :attr:`stats` (a native struct).
    """

    def __init__(
        self,
        session_id: str,
        channel: str,
        *,
        rank: int,
        width: int,
        timeout_ms: int,
        spin_ns: int = 50_000,
        config_digest: int = 0,
        world_size: int = 2,
        out_tensor=None,
        hard_timeout_ms: int = 0,
        on_stall=None,
        on_stall_end=None,
        peer_stop_ms: int = 60_000,
    ):
        """``timeout_ms``: how long to wait for a peer that never attached, and the period after which a
        wait for a peer that is attached and provably alive reports a stall (``on_stall(message,
        waited_s)``, default: a WARNING log line) and keeps waiting. ``hard_timeout_ms`` > 0: after that
        long, a stalled exchange fails (code ``timeout``) and poisons the channel; 0 = wait as long as the
        peer is alive. ``on_stall_end(waited_s)``: called once when an exchange that reported a stall ends
        (completed or failed). ``peer_stop_ms`` > 0: a peer whose process is stopped / traced (state T) or in
        uninterruptible sleep (state D) that long without a break is treated as dead (code ``peer_died``,
        published so both ranks stop); 0 = off."""
        if hard_timeout_ms < 0:
            raise ValueError(f"hard_timeout_ms must be >= 0, got {hard_timeout_ms}")
        self.hard_timeout_ms = hard_timeout_ms
        if peer_stop_ms < 0:
            raise ValueError(f"peer_stop_ms must be >= 0, got {peer_stop_ms}")
        self._on_stall = on_stall
        self._on_stall_end = on_stall_end
        self.peer_stop_ms = peer_stop_ms
        self.stalls = 0
        self.session_id, self.channel, self.rank, self.width = session_id, channel, rank, width
        self.timeout_ms = timeout_ms
        self._h = None
        self._bound_req = self._bound_out = None
        # the output buffer is validated before the rank slot is taken, so a bad buffer leaves nothing owned
        # request buffer of the bound call: [0] the output row (always 0 here), [1..width] the local row
        self._req = ffi.new("int64_t[]", 1 + width)
        self._req_buf = ffi.buffer(self._req)
        self._local = self._req + 1
        self._pack_into = struct.Struct(f"<{1 + max(width, 0)}q").pack_into
        if out_tensor is None:
            self._out = ffi.new("int64_t[]", 2 * width)
        else:
            _check_out_tensor(out_tensor, width)
            # results land directly in this CPU tensor; kept alive here
            self._out_tensor = out_tensor
            self._out = ffi.cast("int64_t *", out_tensor.data_ptr())
        self._err = ffi.new("char[]", ERRBUF)
        self._stall_periods = 0
        handle = ffi.new("dspark_dp2_channel **")
        rc = lib.dspark_dp2_open(
            session_id.encode(),
            channel.encode(),
            rank,
            world_size,
            width,
            timeout_ms,
            spin_ns,
            config_digest & 0xFFFFFFFFFFFFFFFF,
            handle,
            self._err,
            ERRBUF,
        )
        _check(rc, self._err, "dspark_dp2_open")
        self._h = handle[0]
        rc = lib.dspark_dp2_set_peer_stop_limit(self._h, peer_stop_ms, self._err, ERRBUF)
        if rc:
            err = Dp2Error(rc, ffi.string(self._err).decode("utf-8", "replace"))
            self.close()
            raise err
        self._pid = os.getpid()
        self.stats = ffi.new("dspark_dp2_stats *")
        self._n_out = 2 * width
        self._unpack_from = struct.Struct(f"<{2 * width}q").unpack_from
        self._out_buf = ffi.buffer(self._out, 8 * 2 * width)
        try:
            self.bind(self._req, self._out, 1)
        except Dp2Error:
            self.close()  # part of open: leave nothing owned
            raise
        self._xb = lib.dspark_dp2_exchange_bound
        name = ffi.new("char[]", 64)
        lib.dspark_dp2_shm_name(self._h, name, 64)
        self.shm_name = ffi.string(name).decode()

    @property
    def closed(self) -> bool:
        return self._h is None

    def bind(self, req, out_base, rows: int) -> None:
        """Point the one-argument hot call at ``req`` (1 + width int64: output row, then the local row) and
        ``rows`` result rows of 2*width int64 at ``out_base`` (cdata pointers the caller keeps alive)."""
        rc = lib.dspark_dp2_bind(self._h, req, out_base, rows, self.stats, self._err, ERRBUF)
        if rc:
            raise Dp2Error(rc, ffi.string(self._err).decode("utf-8", "replace"))
        # the native side holds these pointers: keep the objects they point into alive here
        self._bound_req, self._bound_out = req, out_base

    def exchange(self, values: Sequence[int]) -> list:
        h = self._h
        if h is None:
            raise Dp2Error(
                lib.DSPARK_DP2_E_CLOSED, f"dp2 channel {self.channel} rank {self.rank}: handle already closed"
            )
        if self._bound_out is not self._out:  # another user (MlpSync's result pool) bound the handle
            self.bind(self._req, self._out, 1)
        try:
            self._pack_into(self._req_buf, 0, 0, *values)
        except struct.error:
            # not exactly width ints in int64 range: cffi's own conversion raises the usual TypeError /
            # OverflowError / ValueError (or converts what struct does not, e.g. an object with __int__)
            self._req[0] = 0
            self._local[0 : self.width] = values
        rc = self._xb(h)
        if rc == lib.DSPARK_DP2_STALLED:
            rc = self._keep_waiting(h)
        if rc:
            _check(rc, self._err, "dspark_dp2_exchange")
        return list(self._unpack_from(self._out_buf))

    def _keep_waiting(self, h) -> int:
        """The peer is alive but late: report the stall each timeout period and keep waiting, until it
        arrives, something fails, or the hard limit is reached. The rows land in the output row the
        stalled (bound) exchange named."""
        try:
            return self._wait_periods(h)
        finally:
            if self._on_stall_end is not None:
                try:
                    self._on_stall_end(self._stall_periods * self.timeout_ms / 1000.0)
                except Exception:  # noqa: BLE001 - a reporting failure must not mask the outcome
                    logger.exception("dp2: stall-end callback failed")

    def _wait_periods(self, h) -> int:
        self._stall_periods = periods = 0
        while True:
            periods += 1
            self._stall_periods = periods
            self.stalls += 1
            waited_ms = periods * self.timeout_ms
            msg = ffi.string(self._err).decode("utf-8", "replace")
            try:
                if self._on_stall is not None:
                    self._on_stall(msg, waited_ms / 1000.0)
                else:
                    logger.warning(
                        "dspark-harden dp2: %s; still waiting (hard limit %s)",
                        msg,
                        f"{self.hard_timeout_ms} ms" if self.hard_timeout_ms else "none",
                    )
            except Exception:  # noqa: BLE001 - a reporting failure must not break the exchange
                logger.exception("dp2: stall callback failed")
            if self.hard_timeout_ms and waited_ms >= self.hard_timeout_ms:
                text = (
                    f"{msg}; gave up at the hard limit of {self.hard_timeout_ms} ms "
                    f"(SGLANG_DSPARK_DP2_SHM_HARD_TIMEOUT_MS)"
                )
                self.poison(text)
                raise Dp2Error(lib.DSPARK_DP2_E_TIMEOUT, text)
            rc = lib.dspark_dp2_wait_bound(h)
            if rc != lib.DSPARK_DP2_STALLED:
                return rc

    def poison(self, message: str) -> Dp2Error:
        """Publish a caller-detected problem so the peer stops too; returns the error to raise."""
        if self._h is None:
            return Dp2Error(lib.DSPARK_DP2_E_CLOSED, message)
        rc = lib.dspark_dp2_poison(self._h, message.encode("utf-8", "replace")[:200], self._err, ERRBUF)
        return Dp2Error(rc, ffi.string(self._err).decode("utf-8", "replace"))

    def peer_state(self) -> tuple:
        """``(dead, pid, state, why)`` of the peer: pid 0 when it is not attached (or closed), ``state`` its
        /proc process state letter ('?' unknown). Safe from another thread of this process while the
        channel stays open (the caller serialises against :meth:`close`)."""
        h = self._h
        if h is None:
            return False, 0, "?", ""
        pid, state, why = ffi.new("int32_t *"), ffi.new("char[1]"), ffi.new("char[]", 256)
        dead = lib.dspark_dp2_peer_state(h, pid, state, why, 256)
        return dead == 1, int(pid[0]), state[0].decode("ascii", "replace"), ffi.string(why).decode("utf-8", "replace")

    def declare_peer_dead(self, message: str) -> Dp2Error:
        """Publish code ``peer_died`` with ``message`` (both ranks stop); returns the error to raise."""
        if self._h is None:
            return Dp2Error(lib.DSPARK_DP2_E_CLOSED, message)
        err = ffi.new("char[]", ERRBUF)  # own buffer: callable from a watcher thread
        rc = lib.dspark_dp2_declare_peer_dead(self._h, message.encode("utf-8", "replace")[:250], err, ERRBUF)
        return Dp2Error(rc, ffi.string(err).decode("utf-8", "replace"))

    def shared_error(self) -> int:
        return -1 if self._h is None else lib.dspark_dp2_shared_error(self._h)

    def close(self) -> None:
        """Idempotent. In a forked child only the child's copy is dropped (shared state untouched)."""
        h, self._h = self._h, None
        if h is None:
            return
        err = ffi.new("char[]", ERRBUF)
        _check(lib.dspark_dp2_close(h, err, ERRBUF), err, "dspark_dp2_close")

    # -- fault injection (tests only) --------------------------------------------------------
    def debug_set_start_time(self, rank: int, value: int) -> None:
        lib.dspark_dp2_debug_set_start_time(self._h, rank, value)

    def debug_skip_sequence(self, delta: int, publish: bool) -> None:
        lib.dspark_dp2_debug_skip_sequence(self._h, delta, int(publish))

    def debug_set_pid(self, rank: int, pid: int) -> None:
        lib.dspark_dp2_debug_set_pid(self._h, rank, pid)

    def debug_hold_until_peer_closed(self) -> None:
        lib.dspark_dp2_debug_hold_until_peer_closed(self._h)
