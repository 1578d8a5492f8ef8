"""Host-wide "compile in progress" claims: one compile per canonical key across processes.

A process that misses a key on disk tries to *claim* it before compiling: ``claims/<key>.claim``
under the namespace, a small JSON document naming the claimant (pid + process start time from
``/proc/<pid>/stat``, a random nonce) and its estimate of how long until the entry is published
(its own measured claim-to-publication time). Nothing is locked: the claim is created complete and
non-blocking — the document is written to a private temp file in ``claims/`` and ``link()``-ed to
the claim's name, which fails with EEXIST when a claim exists and never follows a symbolic link
planted at that name (an ``O_CREAT|O_EXCL`` file written afterwards could be seen empty, or left
empty by a crash, and then name nobody). The claimant compiles and serves its own request as
before; its persistence helper publishes the entry; the claim is removed when that job ends.

A process that finds a claim *waits* for the published entry, bounded, then loads it (source
``disk``, or ``local_compile`` when the helper published a compile-locally marker). It compiles
itself instead when

* the bound passes: ``WAIT_FACTOR`` × the claim's estimate, at most ``DISK_CLAIM_WAIT``, and at most half
  of what is left of the request's own deadline (``DSPARK_HARDEN_GRAMMAR_COMPILE_TIMEOUT``), so the
  other half remains for its own compile — a stopped (SIGSTOP, frozen cgroup, debugger) claimant
  therefore holds nobody longer than that;
* the claimant is dead: its pid is gone, a zombie, or now a different process (start time differs
  — pid reuse); the dead claim is removed (only if it is still that claim: compared by nonce after
  an atomic rename aside) and the waiter claims the key itself;
* the claim was released without an entry (the publication was skipped or failed).

A claim that cannot be trusted — a symbolic link, not a regular file, owned by another uid, group-
or world-writable, larger than ``MAX_CLAIM_BYTES``, not a valid document for this key — is
refused with :class:`InvalidClaim` (the caller compiles itself; nothing is ever read from or served
because of a claim: it carries no grammar). Claims of dead processes are also cleaned when a server
opens the namespace (:func:`clean`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat as stat_mod
import time
from dataclasses import dataclass, field
from typing import Optional

from ..core import procfs
from . import disk

CLAIM_SUFFIX = ".claim"
TMP_PREFIX = ".tmp-"
ASIDE_PREFIX = ".aside-"
MAX_CLAIM_BYTES = 4096
CLAIM_VERSION = 1
WAIT_FACTOR = 2.0  # a waiter waits at most this many times the claimant's estimate ...
MAX_WAIT_S = 60.0  # ... and never longer than this (DSPARK_HARDEN_GRAMMAR_DISK_CLAIM_WAIT's default)
MIN_WAIT_S = 0.05
LEFTOVER_AGE_S = 60.0  # temp/aside files of a process killed mid-operation, removed by clean()


class InvalidClaim(disk.GrammarCacheError):
    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(
            f"grammar cache claim {path} is invalid: {reason}; ignored (this process compiles the grammar "
            f"itself; a claim carries no grammar, nothing is served from it). Remove it if it persists: "
            f"`dspark-harden grammar-cache prune` removes claims of dead processes, anything else is not ours"
        )


@dataclass(frozen=True)
class Claim:
    path: str
    key_hex: str
    pid: int
    start: int
    nonce: str
    estimate_s: float
    created: float  # wall clock (informational: the claim's age in tools)
    taken_at: float = field(default=0.0, compare=False)  # this process's monotonic time (claimant only)


def claim_path(ns: disk.Namespace, key_hex: str) -> str:
    return os.path.join(ns.claims, key_hex + CLAIM_SUFFIX)


def identity(pid: int) -> Optional[int]:
    """The start time of a live process ``pid`` (None when gone or a zombie)."""
    st = procfs.stat(pid)
    return None if st is None or st.exited else st.start


def alive(claim: Claim) -> bool:
    """The claimant still runs (stopped counts as running: the wait bound covers it)."""
    return identity(claim.pid) == claim.start


def _write_private(directory: str, data: bytes) -> str:
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if os.write(fd, data) != len(data):  # < 4 KiB to a fresh file: one write
            raise OSError(errno.EIO, f"short write to {tmp}")
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return tmp


def create(ns: disk.Namespace, key_hex: str, estimate_s: float) -> Optional[Claim]:
    """Claim ``key_hex`` for this process, or None when a claim exists. Never blocks, holds
    nothing open. No fsync: a claim outlives its process only as a dead claim, cleaned by identity."""
    me = identity(os.getpid())
    if me is None:
        raise OSError(errno.ESRCH, "cannot read this process's own /proc/self/stat start time")
    estimate_s = float(estimate_s) if math.isfinite(estimate_s) and estimate_s > 0 else MAX_WAIT_S
    nonce = os.urandom(8).hex()
    created = time.time()
    doc = {
        "v": CLAIM_VERSION,
        "key": key_hex,
        "pid": os.getpid(),
        "start": me,
        "nonce": nonce,
        "estimate_s": round(estimate_s, 6),
        "created": round(created, 3),
    }
    path = claim_path(ns, key_hex)
    tmp = _write_private(ns.claims, json.dumps(doc, sort_keys=True).encode())
    try:
        os.link(tmp, path, follow_symlinks=False)  # atomic, complete, never replaces, never follows
    except FileExistsError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return Claim(path, key_hex, os.getpid(), me, nonce, estimate_s, created, taken_at=time.monotonic())


def _parse(path: str, data: bytes, key_hex: Optional[str]) -> Claim:
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise InvalidClaim(path, f"not a claim document ({len(data)} bytes of non-JSON)") from None
    if not isinstance(doc, dict) or doc.get("v") != CLAIM_VERSION:
        raise InvalidClaim(path, "not a version-1 claim document")

    def want(name: str, types, ok=lambda v: True):
        v = doc.get(name)
        if isinstance(v, bool) or not isinstance(v, types) or not ok(v):
            raise InvalidClaim(path, f"field {name!r} is missing or invalid: {str(v)[:40]!r}")
        return v

    pid = want("pid", int, lambda v: 0 < v < 1 << 31)
    start = want("start", int, lambda v: v >= 0)
    nonce = want("nonce", str, lambda v: len(v) == 16 and all(c in "0123456789abcdef" for c in v))
    estimate = want("estimate_s", (int, float), lambda v: math.isfinite(v) and v > 0)
    created = want("created", (int, float), lambda v: math.isfinite(v))
    key = want("key", str)
    if key_hex is not None and key != key_hex:
        raise InvalidClaim(path, f"written for key {key[:16]}…, not {key_hex[:16]}… (swapped?)")
    return Claim(path, key, pid, start, nonce, float(estimate), float(created))


def read_path(path: str, key_hex: Optional[str] = None) -> Optional[Claim]:
    """The claim at ``path`` (None when absent). InvalidClaim when it cannot be trusted."""
    try:
        fd = disk.open_nofollow(path)
    except FileNotFoundError:
        return None
    except disk.UnsafeCacheError as exc:
        raise InvalidClaim(path, exc.reason) from None
    try:
        st = os.fstat(fd)
        euid = os.geteuid()
        if st.st_uid != euid:
            raise InvalidClaim(path, f"owned by uid {st.st_uid}, not by this server's effective uid {euid}")
        if st.st_mode & 0o022:
            raise InvalidClaim(path, f"mode {stat_mod.S_IMODE(st.st_mode):04o} is group- or world-writable")
        if st.st_size > MAX_CLAIM_BYTES:
            raise InvalidClaim(path, f"{st.st_size} bytes, larger than a claim ({MAX_CLAIM_BYTES})")
        data = os.read(fd, MAX_CLAIM_BYTES + 1)
    finally:
        os.close(fd)
    return _parse(path, data, key_hex)


def read(ns: disk.Namespace, key_hex: str) -> Optional[Claim]:
    return read_path(claim_path(ns, key_hex), key_hex)


def remove_if(ns: disk.Namespace, claim: Claim) -> bool:
    """Remove the claim file only while it still is ``claim`` (same nonce). The file is first renamed
    aside atomically, then checked; a newer claim someone created meanwhile is linked back (if yet
    another appeared at the name, the aside one is dropped: that costs at most one extra compile,
    never a wrong grammar). True when ``claim`` was removed."""
    aside = os.path.join(ns.claims, f"{ASIDE_PREFIX}{os.getpid()}-{os.urandom(6).hex()}")
    try:
        os.rename(claim.path, aside)
    except FileNotFoundError:
        return False
    try:
        try:
            got = read_path(aside)
        except InvalidClaim:
            got = None
        if got is not None and got.nonce == claim.nonce:
            return True
        with contextlib.suppress(OSError):
            os.link(aside, claim.path, follow_symlinks=False)
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(aside)


def bound_s(claim: Claim, max_wait_s: float = MAX_WAIT_S) -> float:
    """How long a waiter may wait on ``claim`` (before its request's own deadline caps it)."""
    return min(max_wait_s, max(MIN_WAIT_S, WAIT_FACTOR * claim.estimate_s))


def wait(ns: disk.Namespace, key_hex: str, claim: Claim, deadline: float) -> str:
    """Poll until the entry is published (``entry``), the claimant died (``dead``), the claim was
    released or replaced without an entry (``released``) or ``deadline`` (monotonic) passed
    (``expired``). Takes no lock; each poll is a few stat/read calls."""
    entry = ns.entry_path(key_hex)
    pause = 0.001
    while True:
        if os.path.lexists(entry):
            return "entry"
        if not alive(claim):
            return "entry" if os.path.lexists(entry) else "dead"
        try:
            cur = read(ns, key_hex)
        except InvalidClaim:
            cur = None
        if cur is None or cur.nonce != claim.nonce:
            return "entry" if os.path.lexists(entry) else "released"
        left = deadline - time.monotonic()
        if left <= 0:
            return "expired"
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.02)


def clean(ns: disk.Namespace) -> dict:
    """Remove claims of dead claimants and old temp/aside leftovers; count live and invalid claims
    (invalid ones are left alone and reported: they are not provably ours)."""
    out = {"removed": 0, "live": 0, "invalid": 0, "leftovers": 0}
    try:
        names = os.listdir(ns.claims)
    except FileNotFoundError:
        return out
    now = time.time()
    for name in names:
        path = os.path.join(ns.claims, name)
        if name.startswith((TMP_PREFIX, ASIDE_PREFIX)):
            try:
                st = os.lstat(path)
                if stat_mod.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and now - st.st_mtime > LEFTOVER_AGE_S:
                    os.unlink(path)
                    out["leftovers"] += 1
            except OSError:
                pass
            continue
        if not name.endswith(CLAIM_SUFFIX):
            continue
        try:
            c = read_path(path, name[: -len(CLAIM_SUFFIX)])
        except InvalidClaim:
            out["invalid"] += 1
            continue
        except OSError:
            continue
        if c is None:
            continue
        if alive(c):
            out["live"] += 1
        elif remove_if(ns, c):
            out["removed"] += 1
    return out
