"""The DP2 stall board: how a scheduler stuck waiting in the exchange tells ``/health_scheduler``.

A rank that waits for a peer which is alive but not arriving cannot publish a load snapshot (its
scheduler thread is inside the exchange), so ``/health_scheduler`` would only see both ranks go
stale, without saying which one holds the other. The waiting loop itself (``Channel._keep_waiting``,
which returns to Python once per ``SGLANG_DSPARK_DP2_SHM_TIMEOUT_MS`` period) writes a record into
this board: "DP rank R waits for DP rank P in channel C since ..."; the health route turns a current
record into 503 ``dp2_stalled`` naming rank P. The record is cleared when that exchange ends.

The board is an anonymous ``memfd`` created by the main process right before it spawns the DP
controller and schedulers (:mod:`.session`), so it has no name in ``/dev/shm`` (nothing to squat on,
nothing left behind: it goes away with the last process holding it). Children reach it through
``/proc/<main pid>/fd/<fd>``, named by the inherited ``DSPARK_HARDEN_DP2_BOARD=<pid>:<fd>:<token>``
(an internal variable), and refuse it unless it is owned by this user with mode 0600, has the board's
size and carries the same magic, creator pid and random token.

Layout: a 64-byte header (magic, version, size, creator pid, token) and one slot per rank, each a
seqlock (generation counter, odd while written) around a length-prefixed JSON record.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import stat
import struct
import threading
import time
import uuid
from typing import Optional

logger = logging.getLogger("dspark_harden.dp2")

ENV = "DSPARK_HARDEN_DP2_BOARD"
MAGIC = b"DSPDP2BD"
VERSION = 1
HEADER = 64
SLOT = 1024
RANKS = 2
SIZE = HEADER + RANKS * SLOT
_HDR = struct.Struct("<8sIIi32s")  # magic, version, size, creator pid, token (ascii hex)
_SLOT = struct.Struct("<QI")  # generation, payload length
_MAX_PAYLOAD = SLOT - _SLOT.size
#: a record older than this many stall periods (plus slack) is not current: its writer stopped updating it
STALE_PERIODS = 2
STALE_SLACK_S = 10.0


class BoardError(RuntimeError):
    """The board named by the environment cannot be used (message names it and why)."""


class Board:
    """One mapping of the board (the creator's, or a child's opened through /proc)."""

    def __init__(self, fd: int, mm: mmap.mmap, spec: str, creator: bool):
        self.fd, self.mm, self.spec, self.creator = fd, mm, spec, creator
        self._lock = threading.Lock()  # the scheduler thread and the peer watch both write this rank's slot

    # -- creation / opening -------------------------------------------------------------------
    @classmethod
    def create(cls) -> "Board":
        """A new board in this (the main) process; ``spec`` is the value to export as :data:`ENV`."""
        fd = os.memfd_create("dspark_dp2_board", os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, SIZE)
            mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        token = uuid.uuid4().hex
        pid = os.getpid()
        _HDR.pack_into(mm, 0, MAGIC, VERSION, SIZE, pid, token.encode())
        return cls(fd, mm, f"{pid}:{fd}:{token}", creator=True)

    @classmethod
    def open(cls, spec: str) -> "Board":
        """Open the board named by ``spec`` (``<pid>:<fd>:<token>``); raises :class:`BoardError`."""
        parts = spec.split(":")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or len(parts[2]) != 32:
            raise BoardError(
                f"{ENV}={spec!r} is not <pid>:<fd>:<32-hex token> (it is set by the main process; do not export it)"
            )
        pid, fdno, token = int(parts[0]), int(parts[1]), parts[2]
        path = f"/proc/{pid}/fd/{fdno}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise BoardError(
                f"dp2 stall board {path} ({ENV}) cannot be opened: {exc.strerror} (the main process "
                f"{pid} is gone, or /proc hides it)"
            ) from None
        try:
            st = os.fstat(fd)
            problems = []
            if not stat.S_ISREG(st.st_mode):
                problems.append("not a regular file")
            if st.st_uid != os.geteuid():
                problems.append(f"owner uid {st.st_uid}, expected {os.geteuid()}")
            if stat.S_IMODE(st.st_mode) != 0o600:
                problems.append(f"mode {stat.S_IMODE(st.st_mode):04o}, expected 0600")
            if st.st_size != SIZE:
                problems.append(f"size {st.st_size}, expected {SIZE}")
            if problems:
                raise BoardError(f"dp2 stall board {path} ({ENV}) is not this server's: " + ", ".join(problems))
            mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            magic, version, size, creator, tok = _HDR.unpack_from(mm, 0)
            if (magic, version, size, creator, tok.decode("ascii", "replace")) != (MAGIC, VERSION, SIZE, pid, token):
                mm.close()
                raise BoardError(
                    f"dp2 stall board {path} ({ENV}) is not this server's: header magic {magic!r} "
                    f"version {version} size {size} pid {creator} token does not match"
                )
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, mm, spec, creator=False)

    def close(self) -> None:
        mm, self.mm = self.mm, None
        if mm is not None:
            mm.close()
            os.close(self.fd)

    # -- records ------------------------------------------------------------------------------
    def _write(self, rank: int, payload: bytes) -> None:
        if not 0 <= rank < RANKS:
            raise ValueError(f"rank {rank} outside 0..{RANKS - 1}")
        if len(payload) > _MAX_PAYLOAD:
            raise ValueError(f"board record of {len(payload)} bytes exceeds {_MAX_PAYLOAD}")
        off = HEADER + rank * SLOT
        with self._lock:
            gen = _SLOT.unpack_from(self.mm, off)[0]
            gen += 1 if gen % 2 == 0 else 2  # odd: being written
            _SLOT.pack_into(self.mm, off, gen, 0)
            self.mm[off + _SLOT.size : off + _SLOT.size + len(payload)] = payload
            _SLOT.pack_into(self.mm, off, gen, len(payload))
            _SLOT.pack_into(self.mm, off, gen + 1, len(payload))  # even: complete

    def publish_stall(
        self, *, rank: int, peer_rank: int, channel: str, waited_s: float, period_s: float, message: str
    ) -> None:
        rec = {
            "state": "stalled",
            "rank": rank,
            "peer_rank": peer_rank,
            "channel": channel,
            "waited_s": round(waited_s, 3),
            "period_s": period_s,
            "pid": os.getpid(),
            "updated": time.time(),
            "message": message[:600],
        }
        payload = json.dumps(rec, separators=(",", ":")).encode("utf-8", "replace")
        if len(payload) > _MAX_PAYLOAD:
            rec["message"] = message[:200]
            payload = json.dumps(rec, separators=(",", ":")).encode("utf-8", "replace")
        self._write(rank, payload)

    def clear(self, rank: int) -> None:
        self._write(rank, b"")

    def read(self) -> list:
        """Every record on the board (consistent snapshots of each slot)."""
        out = []
        for rank in range(RANKS):
            off = HEADER + rank * SLOT
            for _ in range(1000):
                g1, n = _SLOT.unpack_from(self.mm, off)
                if g1 % 2:
                    time.sleep(0)
                    continue
                data = bytes(self.mm[off + _SLOT.size : off + _SLOT.size + min(n, _MAX_PAYLOAD)])
                g2 = _SLOT.unpack_from(self.mm, off)[0]
                if g1 == g2:
                    break
            else:
                raise BoardError(f"dp2 stall board slot {rank} kept changing while read")
            if data:
                out.append(json.loads(data))
        return out


def current_stalls(board: Board, now: Optional[float] = None) -> list:
    """The records of exchanges stalled right now: written by a live process within the last
    :data:`STALE_PERIODS` stall periods (plus slack)."""
    now = time.time() if now is None else now
    out = []
    for rec in board.read():
        if rec.get("state") != "stalled":
            continue
        try:
            os.kill(int(rec["pid"]), 0)
        except ProcessLookupError:
            continue  # the waiting rank is gone: the lifecycle's child_died / staleness say why
        except PermissionError:
            pass
        if now - float(rec["updated"]) > STALE_PERIODS * float(rec["period_s"]) + STALE_SLACK_S:
            continue
        out.append(rec)
    return out


#: the board of this process: created (main process) or opened (scheduler, HTTP worker)
CURRENT: Optional[Board] = None


def create_for_launch() -> Board:
    """Main process: a fresh board for the launch about to spawn its children, exported as :data:`ENV`."""
    global CURRENT
    old = CURRENT
    board = Board.create()
    os.environ[ENV] = board.spec
    CURRENT = board
    if old is not None and old.creator:
        old.close()  # a relaunch in the same process: the previous tree is gone
    return board


def from_environment() -> Optional[Board]:
    """This process's board: the one it created, else the one :data:`ENV` names (opened once), else
    ``None`` (the launching process did not create one). Raises :class:`BoardError` for a board that
    is named but unusable."""
    global CURRENT
    spec = os.environ.get(ENV)
    if CURRENT is not None and (CURRENT.spec == spec or spec is None):
        return CURRENT
    if not spec:
        return None
    CURRENT = Board.open(spec)
    return CURRENT


def health_stalls() -> list:
    """For /health_scheduler: the current stall records ([] when DP2 runs without a board)."""
    board = from_environment()
    return [] if board is None else current_stalls(board)
