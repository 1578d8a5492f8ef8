"""Persistent on-disk cache of compiled grammars, shared by every process of a host.

Layout (one *namespace* per compatibility scope)::

    <root>/<scope-digest>/
        scope.json            the scope document (human-readable; checked on open)
        entries/<key>.xgc     one entry per grammar key (0600)
        locks/<key>.lock      per-entry file lock (flock, bounded waits)
        claims/<key>.claim    "compile in progress" claim: owner pid + start time (see :mod:`.claim`)
        ledger                byte ledger: sum of the sizes of every file in entries/
        ledger.lock           serialises ledger updates and pruning
        ledger.intent         present while a ledger holder renames an entry in: a later holder that
                              finds it rescans (the ledger converges after a kill or ENOSPC)
        quarantine/           invalid entries moved aside (kept): by the scheduler that met one, or by
                              `dspark-harden grammar-cache verify --quarantine`

The scope digest is the SHA-256 of a canonical JSON document naming every dimension that makes a
compiled grammar reusable: entry format, xgrammar version, tokenizer digest, vocabulary size and
stop tokens, the compiler settings that change compiled output, and the marker policy version.

Entry file (every entry, serialized grammar or marker, carries a checksum)::

    header  88 bytes  magic "DSHXGC01", format u8, kind u8, 6 pad, scope digest (32),
                      key digest (32), payload length u64 (little endian)
    payload           kind 1: xgrammar CompiledGrammar.serialize_json() (UTF-8)
                      kind 2: compile-locally marker: reason u8, compile ns u64,
                              serialized bytes u64, measured load ns u64
    trailer 32 bytes  SHA-256 over header + payload

A read validates length, magic, format, kind, scope, key, payload length and checksum; a marker's
fields are validated too, and a serialized payload must deserialize with the live tokenizer. Any
failure raises :class:`CorruptEntryError` naming the file: the entry is never deleted, recompiled
over or served. The scheduler that meets one moves it to ``quarantine/`` (kept; ERROR line, counter) and
compiles afresh, so one bad entry costs one compile, not every later request (xgr, ``_heal``);
``dspark-harden grammar-cache verify --quarantine`` does the same for a whole namespace.

Publication: the entry is written to a temp file in ``entries/`` (no lock held), then, holding
the entry's exclusive file lock and ``ledger.lock``, ``ledger.intent`` is created, the temp file
is renamed over the final name, the ledger is updated and the intent removed. A holder that finds
an intent (its writer was killed or hit ENOSPC between rename and ledger) or an invalid ledger
recomputes the ledger from a scan, so the ledger converges. When the ledger would exceed the hard
limit, the oldest entries (by mtime, refreshed on every hit) are pruned, skipping entries whose
lock another process holds; if it still cannot get under the limit the new entry is withdrawn and
:class:`PruneError` reports it.

Bounded and safe: every lock acquisition is bounded (``lock_timeout_s``; a lock not taken in time
raises :class:`GrammarCacheLockTimeout`, naming the holder's pid when /proc/locks shows it), opening
a namespace takes no lock it would wait for, the root and every namespace directory must be real
directories owned by the effective uid and not group- or world-writable (:class:`UnsafeCacheError`,
as ssh requires of ``~/.ssh``: anyone who can write the directory could plant an entry that lets a
model emit output outside its schema, and a checksum is not a signature), and entries and lock
files are opened with ``O_NOFOLLOW`` (a planted symbolic link is refused, never followed).
Durability: every file (entry, ledger, scope) is fsynced before its rename and its directory
after it, so a crash or power loss leaves each name absent, old or complete — never torn. (The
seed skipped fsync because it ran in the request path; here publication runs in the background
helper process, so the cost is off the serving path.) A crash can at worst leave a temp file or a
stale ledger, which ``grammar-cache verify`` reports and ``prune`` repairs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import stat as stat_mod
import struct
import time
from dataclasses import dataclass
from typing import Iterator, Optional

FORMAT_VERSION = 1
MAGIC = b"DSHXGC01"
# magic, format, kind, 2 pad bytes, compile_us (a serialized entry: the cold compile it replaces, in
# microseconds, for the load-site demotion in xgr.py; 0 = not recorded), scope, key, payload length
_HEADER = struct.Struct("<8sBB2xI32s32sQ")
HEADER_SIZE = _HEADER.size  # 88
TRAILER_SIZE = 32
KIND_SERIALIZED = 1
KIND_MARKER = 2
_MARKER = struct.Struct("<BQQQ")
MARKER_REASONS = {
    1: "slow_load",
    2: "predicted_slow",
    3: "too_large",
    4: "serialize_failed",
    5: "memory_limit",
    6: "deadline",
    7: "helper_failed",
    8: "slow_load_served",
}
REASON_CODES = {v: k for k, v in MARKER_REASONS.items()}

LEDGER_MAGIC = b"DSHXGLD1"
_LEDGER = struct.Struct("<8sQ32s")

ENTRY_SUFFIX = ".xgc"
TMP_PREFIX = ".tmp-"
INTENT_NAME = "ledger.intent"
DEFAULT_LOCK_TIMEOUT_S = 5.0
# what quarantine/ keeps at most: this many entries, and no more bytes than the namespace's own bound. Enough
# evidence of a failing disk; beyond it a filesystem that corrupts every republished entry again would grow
# the quarantine by one entry per heal, forever. Past the bound a corrupt entry is removed, not kept (ERROR).
QUARANTINE_MAX_ENTRIES = 64
QUARANTINE_FULL = "removed, not kept: "  # how quarantine_entry's answer starts then (the reason follows)
# v2: persisted by a memory-capped helper process, reasons 5..7; v3: serialized entries record their compile
# time, reason 8 (a serving process's load was slower than it: demoted)
POLICY_VERSION = "adaptive-marker-v3"


class GrammarCacheError(RuntimeError):
    """Base class. Subclasses RuntimeError on purpose: SGLang's XGrammar dispatch handlers turn a
    RuntimeError into an invalid-grammar object, so the request fails visibly with this message."""


class CorruptEntryError(GrammarCacheError):
    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(
            f"persistent grammar cache entry is invalid: {path}: {reason}. Nothing was served from it "
            f"and it was not deleted; inspect with `dspark-harden grammar-cache verify`, move it aside "
            f"with `dspark-harden grammar-cache verify --quarantine`"
        )


class LedgerError(GrammarCacheError):
    def __init__(self, path: str, reason: str):
        self.path = path
        super().__init__(
            f"grammar cache byte ledger is invalid: {path}: {reason}; rebuild it with "
            f"`dspark-harden grammar-cache prune --dir {os.path.dirname(os.path.dirname(path))}`"
        )


class PruneError(GrammarCacheError):
    pass


class GrammarCacheLockTimeout(GrammarCacheError):
    """A disk-cache lock could not be taken within its bound (the holder may be stopped or wedged)."""

    def __init__(self, path: str, timeout_s: float, holder: Optional[int] = None):
        self.path, self.timeout_s, self.holder = path, timeout_s, holder
        who = f"held by pid {holder}" if holder else "held by another process"
        super().__init__(
            f"grammar cache lock {path} not taken within {timeout_s:g} s ({who}; "
            f"DSPARK_HARDEN_GRAMMAR_DISK_LOCK_TIMEOUT): the operation was skipped, nothing waits for it"
        )


class UnsafeCacheError(GrammarCacheError):
    """A cache directory or file another user could have written (or a symbolic link)."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"grammar cache path {path} is unsafe: {reason}")


class EntryTooLarge(GrammarCacheError):
    """A published entry larger than this reader's limit (written by a server with a larger one)."""

    def __init__(self, path: str, size: int, limit: int):
        self.path, self.size, self.limit = path, size, limit
        super().__init__(
            f"grammar cache entry {path} is {size} bytes, above this server's limit of {limit} "
            f"(DSPARK_HARDEN_GRAMMAR_DISK_MAX_ENTRY_BYTES + envelope): not read, compiled locally"
        )


CORRUPT_MARK = "persistent grammar cache entry is invalid"


def digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def key_digest(key_parts: list) -> str:
    return hashlib.sha256(json.dumps(key_parts, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()


def scope_document(**dims) -> dict:
    doc = {"format": FORMAT_VERSION, "policy": POLICY_VERSION}
    doc.update(dims)
    return doc


def scope_digest_of(doc: dict) -> str:
    return hashlib.sha256(
        json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    ).hexdigest()


# ----------------------------------------------------------------------------------------------
# entry encoding


@dataclass(frozen=True)
class Marker:
    reason: str
    compile_ns: int
    serialized_bytes: int
    load_ns: int


@dataclass(frozen=True)
class Entry:
    kind: int
    payload: bytes
    compile_s: float = 0.0  # a serialized entry: the cold compile it replaces (0: not recorded)

    @property
    def marker(self) -> Optional[Marker]:
        if self.kind != KIND_MARKER:
            return None
        code, c, s, n = _MARKER.unpack(self.payload)
        return Marker(MARKER_REASONS[code], c, s, n)


def encode_entry(scope_hex: str, key_hex: str, kind: int, payload: bytes, compile_s: float = 0.0) -> bytes:
    compile_us = min(0xFFFFFFFF, max(0, round(compile_s * 1e6)))
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, kind, compile_us, bytes.fromhex(scope_hex), bytes.fromhex(key_hex), len(payload)
    )
    return header + payload + digest(header + payload)


def encode_marker(scope_hex: str, key_hex: str, marker: Marker) -> bytes:
    payload = _MARKER.pack(REASON_CODES[marker.reason], marker.compile_ns, marker.serialized_bytes, marker.load_ns)
    return encode_entry(scope_hex, key_hex, KIND_MARKER, payload)


def _key_difference(written: str, expected: str) -> str:
    """Both full key digests and where they first differ (two digests can share a long prefix)."""
    i = next((n for n, (a, b) in enumerate(zip(written, expected)) if a != b), min(len(written), len(expected)))
    lo = max(0, i - 4)

    def around(h: str) -> str:
        return ("…" if lo else "") + h[lo:i] + "[" + h[i : i + 1] + "]" + h[i + 1 : i + 5] + "…"

    return (
        f"written for key {written}, not {expected}: they first differ at hex digit {i + 1} "
        f"({around(written)} vs {around(expected)})"
    )


def decode_entry(path: str, data: bytes, scope_hex: Optional[str], key_hex: Optional[str]) -> Entry:
    """Validate ``data`` read from ``path``; raise CorruptEntryError naming the file."""
    if len(data) < HEADER_SIZE + TRAILER_SIZE:
        raise CorruptEntryError(path, f"truncated: {len(data)} bytes, shorter than header + checksum")
    magic, fmt, kind, compile_us, scope_b, key_b, plen = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntryError(path, f"bad magic {magic!r} (not a dspark-harden grammar cache entry)")
    if fmt != FORMAT_VERSION:
        raise CorruptEntryError(path, f"entry format {fmt}, expected {FORMAT_VERSION}")
    if kind not in (KIND_SERIALIZED, KIND_MARKER):
        raise CorruptEntryError(path, f"unknown entry kind {kind}")
    if plen != len(data) - HEADER_SIZE - TRAILER_SIZE:
        raise CorruptEntryError(
            path, f"payload length {plen} does not match file size {len(data)} (truncated or extended)"
        )
    view = memoryview(data)  # the checksum reads the entry in place (no copy of a many-MB body)
    if digest(view[:-TRAILER_SIZE]) != view[-TRAILER_SIZE:]:
        raise CorruptEntryError(path, "checksum mismatch (bytes changed after publication)")
    if scope_hex is not None and scope_b.hex() != scope_hex:
        raise CorruptEntryError(path, f"foreign entry: written for scope {scope_b.hex()[:16]}…, not this namespace")
    if key_hex is not None and key_b.hex() != key_hex:
        raise CorruptEntryError(path, f"foreign entry: {_key_difference(key_b.hex(), key_hex)} (swapped?)")
    entry = Entry(kind, bytes(view[HEADER_SIZE:-TRAILER_SIZE]), compile_us / 1e6)
    if kind == KIND_MARKER:
        if plen != _MARKER.size:
            raise CorruptEntryError(path, f"marker payload is {plen} bytes, expected {_MARKER.size}")
        code, compile_ns, sbytes, load_ns = _MARKER.unpack(entry.payload)
        if code not in MARKER_REASONS:
            raise CorruptEntryError(path, f"marker has unknown reason code {code}")
        if compile_ns <= 0:
            raise CorruptEntryError(path, "marker records a non-positive compile time")
    elif plen == 0:
        raise CorruptEntryError(path, "empty serialized grammar")
    return entry


# ----------------------------------------------------------------------------------------------
# ledger


def encode_ledger(total: int) -> bytes:
    body = struct.pack("<8sQ", LEDGER_MAGIC, total)
    return _LEDGER.pack(LEDGER_MAGIC, total, digest(body))


def decode_ledger(path: str, data: bytes) -> int:
    if len(data) != _LEDGER.size:
        raise LedgerError(path, f"{len(data)} bytes, expected {_LEDGER.size}")
    magic, total, check = _LEDGER.unpack(data)
    if magic != LEDGER_MAGIC or digest(struct.pack("<8sQ", magic, total)) != check:
        raise LedgerError(path, "bad magic or checksum")
    return total


def write_temp(directory: str, data: bytes) -> str:
    """A complete, fsynced 0600 temp file in ``directory`` holding ``data`` (removed on failure)."""
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}")
    # O_EXCL with O_CREAT never follows a symbolic link
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            if n <= 0:
                raise OSError(errno.EIO, f"short write to {tmp}")
            view = view[n:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return tmp


def atomic_write(directory: str, final: str, data: bytes) -> None:
    """Temp file in the same directory, 0600, full write, fsync, rename over ``final``, fsync the
    directory: after a crash or power loss ``final`` is either absent, the old file, or the complete
    new one — never a zero-length or truncated entry (which, by design, would fail its grammar on
    every rank until an operator acted)."""
    tmp = write_temp(directory, data)
    try:
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# ----------------------------------------------------------------------------------------------
# the namespace


def open_nofollow(path: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """``os.open`` that refuses a symbolic link, a FIFO, a device or a directory at ``path``
    (UnsafeCacheError); O_NONBLOCK so a planted FIFO cannot hang the opener. FileNotFoundError and
    other OSErrors propagate."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeCacheError(path, "it is a symbolic link (refused, not followed)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            raise UnsafeCacheError(path, "not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path: str, limit: Optional[int] = None) -> bytes:
    """The whole regular file at ``path`` (no symlink followed); EntryTooLarge above ``limit``."""
    fd = open_nofollow(path)
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise EntryTooLarge(path, size, limit)
        chunks, got = [], 0
        while True:
            chunk = os.read(fd, max(1 << 16, size - got + 1))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
            if limit is not None and got > limit:  # grew while we read
                raise EntryTooLarge(path, got, limit)
        return b"".join(chunks)
    finally:
        os.close(fd)


def lock_holder(path: str) -> Optional[int]:
    """The pid holding a flock on ``path`` per /proc/locks (None when unknown)."""
    try:
        st = os.stat(path, follow_symlinks=False)
        with open("/proc/locks") as fh:
            lines = fh.readlines()
    except OSError:
        return None
    want = f":{st.st_ino}"
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter, not the holder
            continue
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].endswith(want):
            dev = parts[5].rsplit(":", 1)[0]
            try:
                major, minor = (int(x, 16) for x in dev.split(":"))
            except ValueError:
                continue
            if (major, minor) == (os.major(st.st_dev), os.minor(st.st_dev)):
                try:
                    return int(parts[4])
                except ValueError:
                    return None
    return None


class Flock:
    """An exclusive ``flock`` on a lock file that stays on disk (unlinking lock files races).

    Opened without following symbolic links; every blocking acquisition is bounded by
    ``timeout_s`` (:class:`GrammarCacheLockTimeout`); releasable from another thread; not
    reentrant. Interoperates with any other flock user of the same file (filelock included)."""

    def __init__(self, path: str, timeout_s: float = DEFAULT_LOCK_TIMEOUT_S):
        if not timeout_s > 0:
            raise ValueError(f"lock timeout must be positive, got {timeout_s!r}")
        self.path = path
        self.timeout_s = timeout_s
        self._fd = -1

    def acquire(self, timeout: Optional[float] = None, blocking: bool = True) -> "Flock":
        if self._fd >= 0:
            raise RuntimeError(f"{self.path}: lock already held by this object")
        limit = self.timeout_s if timeout is None else timeout
        fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT)
        end = time.monotonic() + limit
        pause = 0.001
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not blocking or time.monotonic() >= end:
                        raise GrammarCacheLockTimeout(
                            self.path, 0.0 if not blocking else limit, lock_holder(self.path)
                        ) from None
                    time.sleep(pause)
                    pause = min(pause * 2, 0.02)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # closing the only descriptor releases the flock

    def __enter__(self) -> "Flock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_dir(path: str) -> None:
    """``path`` must be a real directory (not a symbolic link) owned by the effective uid and not
    writable by group or others; else UnsafeCacheError. FileNotFoundError propagates."""
    st = os.lstat(path)
    if stat_mod.S_ISLNK(st.st_mode):
        raise UnsafeCacheError(
            path, "it is a symbolic link (the cache root and its directories must be real directories)"
        )
    if not stat_mod.S_ISDIR(st.st_mode):
        raise UnsafeCacheError(path, "not a directory")
    euid = os.geteuid()
    if st.st_uid != euid:
        raise UnsafeCacheError(path, f"owned by uid {st.st_uid}, not by this server's effective uid {euid}")
    if st.st_mode & 0o022:
        raise UnsafeCacheError(
            path,
            f"mode {stat_mod.S_IMODE(st.st_mode):04o} is group- or world-writable "
            f"(chmod go-w it, or use a private directory)",
        )


def _ensure_dir(path: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_dir(path)


def degrade_reason(exc: BaseException) -> str:
    """A short, bounded label for why the disk cache cannot be used (metric label values)."""
    if isinstance(exc, UnsafeCacheError):
        return "unsafe"
    if isinstance(exc, GrammarCacheLockTimeout):
        return "lock_timeout"
    if isinstance(exc, OSError):
        if exc.errno in (errno.EACCES, errno.EPERM):
            return "permission"
        if exc.errno == errno.EROFS:
            return "read_only"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return "no_space"
    return "error"


DEGRADE_REASONS = ("unsafe", "permission", "read_only", "no_space", "lock_timeout", "error")


def probe_root(root: str) -> Optional[tuple[str, str]]:
    """Why a server could not use ``root`` as its disk cache ((reason, message)), or None when it
    can. Changes nothing on disk (``dspark-harden check`` runs it)."""
    root = os.path.abspath(os.path.expanduser(root))
    existing = root
    while not os.path.lexists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            return "error", f"no existing parent directory of {root}"
        existing = parent
    try:
        if existing == root:
            check_dir(root)
            for name in sorted(os.listdir(root)):
                ns_dir = os.path.join(root, name)
                if os.path.isfile(os.path.join(ns_dir, "scope.json")):
                    for d in (ns_dir, os.path.join(ns_dir, "entries"), os.path.join(ns_dir, "locks")):
                        if os.path.lexists(d):
                            check_dir(d)
        where = root if existing == root else f"{root} does not exist and {existing}"
        if not os.access(existing, os.W_OK | os.X_OK, effective_ids=True):
            return "permission", f"{where} is not writable by uid {os.geteuid()}"
        st = os.statvfs(existing)
        if st.f_flag & os.ST_RDONLY:
            return "read_only", f"{where} is on a read-only file system"
        if st.f_bavail * st.f_frsize < (1 << 20):
            return "no_space", f"{where} has less than 1 MiB free"
    except (GrammarCacheError, OSError) as exc:
        return degrade_reason(exc), str(exc)
    return None


@dataclass
class PruneResult:
    before: int
    after: int
    removed: int
    skipped_locked: int
    limit: int

    @property
    def ok(self) -> bool:
        return self.after <= self.limit


class Namespace:
    """One scoped cache directory. Thread- and process-safe; holds no open files between calls.

    ``create=True`` (a server) makes the directories and the scope document, after checking the
    root and each directory it uses (:func:`check_dir`), and takes no lock it would wait for: a
    missing ledger is created only when ``ledger.lock`` is free at once, an invalid one is rebuilt
    the same way (else the next publication rebuilds it). ``create=False`` (operator commands,
    the persistence helper) opens what exists; ``secure=True`` checks its directories too."""

    def __init__(
        self,
        root: str,
        scope: dict,
        *,
        max_bytes: int,
        create: bool = True,
        lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
        secure: Optional[bool] = None,
    ):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if not lock_timeout_s > 0:
            raise ValueError(f"lock_timeout_s must be positive, got {lock_timeout_s!r}")
        self.root = os.path.abspath(os.path.expanduser(root))
        self.scope = scope
        self.scope_hex = scope_digest_of(scope)
        self.path = os.path.join(self.root, self.scope_hex)
        self.entries = os.path.join(self.path, "entries")
        self.locks = os.path.join(self.path, "locks")
        self.claims = os.path.join(self.path, "claims")
        self.quarantine = os.path.join(self.path, "quarantine")
        self.ledger_path = os.path.join(self.path, "ledger")
        self.intent_path = os.path.join(self.path, INTENT_NAME)
        self.max_bytes = max_bytes
        self.lock_timeout_s = lock_timeout_s
        self.ledger_repairs = 0  # times this object recomputed the ledger from a scan
        if create:
            self._create()
        elif secure:
            self.check_dirs()

    @classmethod
    def open_existing(
        cls, path: str, *, max_bytes: int = 1 << 62, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
    ) -> "Namespace":
        """Open a namespace directory found on disk (operator commands)."""
        path = os.path.abspath(path)
        scope = json.loads(read_file(os.path.join(path, "scope.json"), limit=1 << 20).decode("utf-8"))
        ns = cls(os.path.dirname(path), scope, max_bytes=max_bytes, create=False, lock_timeout_s=lock_timeout_s)
        if ns.path != path:
            raise GrammarCacheError(f"{path}: scope.json does not hash to the directory name ({ns.scope_hex})")
        return ns

    def check_dirs(self) -> None:
        """Root, namespace, entries/ and locks/ (and quarantine/ when present) are safe directories."""
        for d in (self.root, self.path, self.entries, self.locks):
            check_dir(d)
        if os.path.lexists(self.claims):
            check_dir(self.claims)
        if os.path.lexists(self.quarantine):
            check_dir(self.quarantine)

    def _create(self) -> None:
        if not os.path.lexists(self.root):
            os.makedirs(self.root, mode=0o700, exist_ok=True)
        check_dir(self.root)
        for d in (self.path, self.entries, self.locks, self.claims):
            _ensure_dir(d)
        if os.path.lexists(self.quarantine):
            check_dir(self.quarantine)
        scope_file = os.path.join(self.path, "scope.json")
        text = json.dumps(self.scope, sort_keys=True, indent=1, ensure_ascii=False).encode()
        if not os.path.lexists(scope_file):
            atomic_write(self.path, scope_file, text)
        try:
            self.read_ledger()
            return
        except LedgerError:
            pass
        # missing or invalid ledger: rebuild it now if nobody holds the lock, else leave it to the
        # next publication (it rescans when the ledger cannot be read) -- never wait at open
        try:
            lock = self.ledger_lock().acquire(blocking=False)
        except GrammarCacheLockTimeout:
            return
        try:
            self.ledger_repairs += 1
            self._write_ledger(self.scan_bytes())
            self._clear_intent()
        finally:
            lock.release()

    # -- paths and locks -------------------------------------------------------------------
    def entry_path(self, key_hex: str) -> str:
        return os.path.join(self.entries, key_hex + ENTRY_SUFFIX)

    def entry_lock(self, key_hex: str) -> Flock:
        # releasable from another thread: the publisher thread may release a lock it did not take
        return Flock(os.path.join(self.locks, key_hex + ".lock"), self.lock_timeout_s)

    def ledger_lock(self) -> Flock:
        return Flock(os.path.join(self.path, "ledger.lock"), self.lock_timeout_s)

    # -- entries ---------------------------------------------------------------------------
    def read(self, key_hex: str, limit: Optional[int] = None, touch: bool = True) -> Optional[tuple[str, bytes]]:
        """(path, raw bytes) of the published entry, or None when absent. A symbolic link or other
        non-regular file at the entry's name raises CorruptEntryError (refused, never followed); an
        entry above ``limit`` bytes raises EntryTooLarge without reading it. ``touch``: refresh its
        mtime (a use: the pruning order); a preload does not, its lookup does."""
        path = self.entry_path(key_hex)
        try:
            data = read_file(path, limit)
        except FileNotFoundError:
            return None
        except UnsafeCacheError as exc:
            raise CorruptEntryError(path, exc.reason) from None
        if touch:
            self.touch(key_hex)
        return path, data

    def touch(self, key_hex: str) -> None:
        """Mark the entry used now (its mtime: the pruning order, and the preload's); absent: nothing."""
        with contextlib.suppress(OSError):
            os.utime(self.entry_path(key_hex), follow_symlinks=False)

    def stage(self, data: bytes) -> str:
        """Write ``data`` to a complete temp file in entries/ (no lock held); its path."""
        return write_temp(self.entries, data)

    def publish(self, key_hex: str, data: bytes) -> tuple[int, Optional[PruneResult]]:
        """Atomically publish ``data`` (caller holds the entry lock); account; prune if needed."""
        self.check_size(key_hex, len(data))
        return self.commit(key_hex, self.stage(data), len(data))

    def check_size(self, key_hex: str, size: int) -> None:
        if size > self.max_bytes:
            # would evict every other entry and still not fit: refuse it alone, prune nothing
            raise PruneError(
                f"grammar cache entry {self.entry_path(key_hex)} ({size} bytes) is larger than the namespace's hard "
                f"limit of {self.max_bytes} bytes; it was not written"
            )

    def commit(self, key_hex: str, tmp: str, size: int) -> tuple[int, Optional[PruneResult]]:
        """Rename the staged temp file ``tmp`` (``size`` bytes) over the entry and account for it
        (caller holds the entry lock). The temp file is gone afterwards, whatever happens.

        Returns (ledger total after, prune result or None). Raises PruneError after withdrawing
        the entry when the cache cannot get under its hard limit, GrammarCacheLockTimeout when
        ``ledger.lock`` is not taken in time (nothing published), OSError on I/O failure."""
        final = self.entry_path(key_hex)
        try:
            self.check_size(key_hex, size)
            with self.ledger_lock():
                total = self._ledger_total_locked()
                try:
                    old = os.lstat(final).st_size
                except FileNotFoundError:
                    old = 0
                self._set_intent()
                os.replace(tmp, final)
                tmp = ""
                try:
                    fsync_dir(self.entries)
                    total += size - old
                    if total <= self.max_bytes:
                        self._write_ledger(total)
                        self._clear_intent()
                        return total, None
                    result = self._prune_locked(self.max_bytes, keep=final)
                except OSError:
                    # ENOSPC or EIO after the rename: withdraw the entry; the intent stays, so the next
                    # holder recomputes the ledger from a scan
                    with contextlib.suppress(OSError):
                        os.unlink(final)
                    raise
                if not result.ok:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(final)
                    self._write_ledger(self.scan_bytes())
                    self._clear_intent()
                    raise PruneError(
                        f"grammar cache {self.path} could not prune below its hard limit of {self.max_bytes} bytes "
                        f"({result.after} bytes remain, {result.skipped_locked} entries locked by other processes); "
                        f"the new entry {final} was withdrawn"
                    )
                self._clear_intent()
                return result.after, result
        finally:
            if tmp:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    # -- ledger ----------------------------------------------------------------------------
    def read_ledger(self) -> int:
        try:
            data = read_file(self.ledger_path, limit=4096)
        except FileNotFoundError:
            raise LedgerError(self.ledger_path, "missing") from None
        except (UnsafeCacheError, EntryTooLarge) as exc:
            raise LedgerError(self.ledger_path, str(exc)) from None
        return decode_ledger(self.ledger_path, data)

    def _ledger_total_locked(self) -> int:
        """The ledger's total (caller holds ledger.lock); recomputed from a scan when an earlier
        holder left an intent (killed or failed between rename and ledger update) or the ledger is
        missing or invalid — the ledger converges instead of drifting forever."""
        if not os.path.lexists(self.intent_path):
            try:
                return self.read_ledger()
            except LedgerError:
                pass
        self.ledger_repairs += 1
        return self.scan_bytes()

    def _set_intent(self) -> None:
        fd = os.open(self.intent_path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.close(fd)
        fsync_dir(self.path)  # durable before the rename it announces

    def _clear_intent(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.intent_path)

    def _write_ledger(self, total: int) -> None:
        atomic_write(self.path, self.ledger_path, encode_ledger(max(0, total)))

    def iter_entries(self) -> Iterator[os.DirEntry]:
        try:
            it = os.scandir(self.entries)
        except FileNotFoundError:
            return
        with it:
            for e in it:
                if e.name.startswith(TMP_PREFIX) or not e.name.endswith(ENTRY_SUFFIX):
                    continue
                yield e

    def scan_bytes(self) -> int:
        total = 0
        for e in self.iter_entries():
            with contextlib.suppress(FileNotFoundError):
                total += e.stat(follow_symlinks=False).st_size
        return total

    def temp_files(self) -> list[str]:
        try:
            return [os.path.join(self.entries, n) for n in os.listdir(self.entries) if n.startswith(TMP_PREFIX)]
        except FileNotFoundError:
            return []

    # -- pruning ---------------------------------------------------------------------------
    def prune(self, limit: Optional[int] = None) -> PruneResult:
        """Rescan, prune to ``limit`` (default: the hard limit) and rewrite the ledger."""
        with self.ledger_lock():
            self._set_intent()  # entries are unlinked before the ledger is rewritten
            result = self._prune_locked(self.max_bytes if limit is None else limit, keep=None)
            self._clear_intent()
            return result

    def _prune_locked(self, limit: int, keep: Optional[str]) -> PruneResult:
        items = []
        for e in self.iter_entries():
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            items.append((st.st_mtime_ns, st.st_size, e.path))
        total = sum(size for _, size, _ in items)
        before, removed, skipped = total, 0, 0
        for _mtime, size, path in sorted(items):
            if total <= limit:
                break
            if path == keep:
                continue
            lock = self.entry_lock(os.path.basename(path)[: -len(ENTRY_SUFFIX)])
            try:
                lock.acquire(blocking=False)
            except GrammarCacheError:  # locked by another process (compiling/publishing), or unsafe
                skipped += 1
                continue
            try:
                os.unlink(path)
                total -= size
                removed += 1
            except FileNotFoundError:
                total -= size
            finally:
                lock.release()
        self._write_ledger(total)
        return PruneResult(before, total, removed, skipped, limit)

    # -- verification ----------------------------------------------------------------------
    def verify_all(self, tokenizer_info=None) -> tuple[int, list[tuple[str, str]]]:
        """Check every entry's envelope (checksum, scope, key); return (n_ok, [(path, reason)]).

        With ``tokenizer_info`` (the namespace's own tokenizer; the caller checks its digest
        against the scope) every serialized entry is also deserialized by xgrammar — a payload
        that was cut or edited and re-checksummed passes the envelope check but fails here."""
        ok, bad = 0, []
        for e in self.iter_entries():
            key_hex = e.name[: -len(ENTRY_SUFFIX)]
            try:
                data = read_file(e.path)
                entry = decode_entry(e.path, data, self.scope_hex, key_hex)
                del data
                if tokenizer_info is not None and entry.kind == KIND_SERIALIZED:
                    _deserialize_check(e.path, entry.payload, tokenizer_info)
                ok += 1
            except CorruptEntryError as exc:
                bad.append((e.path, exc.reason))
            except UnsafeCacheError as exc:
                bad.append((e.path, exc.reason))
            except FileNotFoundError:
                continue
        return ok, bad

    def quarantine_full(self) -> Optional[str]:
        """Why ``quarantine/`` takes nothing more (:data:`QUARANTINE_MAX_ENTRIES` entries, or the
        namespace's ``max_bytes``), or None."""
        try:
            names = os.listdir(self.quarantine)
        except FileNotFoundError:
            return None
        held = 0
        for name in names:
            with contextlib.suppress(OSError):
                held += os.lstat(os.path.join(self.quarantine, name)).st_size
        if len(names) >= QUARANTINE_MAX_ENTRIES or held >= self.max_bytes:
            return (
                f"{self.quarantine} already keeps {len(names)} entries, {held} bytes (the bound: "
                f"{QUARANTINE_MAX_ENTRIES} entries or the cache's {self.max_bytes} bytes)"
            )
        return None

    def quarantine_entry(self, path: str, expect: Optional[bytes] = None) -> Optional[str]:
        """Move the entry at ``path`` to ``quarantine/`` (kept, never deleted there) and re-account the
        ledger; returns where it went. With ``expect`` (the bytes a reader found corrupt): only if the file
        still holds them -- ``None`` when it is gone or was replaced meanwhile (a peer quarantined or
        republished it: nothing to move). When the quarantine is full (:meth:`quarantine_full`) the entry
        is removed instead and :data:`QUARANTINE_FULL` + why returned."""
        _ensure_dir(self.quarantine)
        dest = os.path.join(self.quarantine, f"{os.path.basename(path)}.{time.time_ns()}.{os.getpid()}")
        key_hex = os.path.basename(path)[: -len(ENTRY_SUFFIX)]
        # lock order as in commit(): the entry's lock, then ledger.lock (both bounded)
        with self.entry_lock(key_hex), self.ledger_lock():
            if expect is not None:
                try:
                    with open(path, "rb") as f:
                        if f.read(len(expect) + 1) != expect:
                            return None
                except FileNotFoundError:
                    return None
            elif not os.path.lexists(path):
                return None
            full = self.quarantine_full()  # under ledger.lock, which every move holds: the bound is exact
            self._set_intent()
            if full:
                os.unlink(path)
            else:
                os.replace(path, dest)
            # rescan: a corrupted entry may no longer have the size the ledger accounted for
            self._write_ledger(self.scan_bytes())
            self._clear_intent()
        return QUARANTINE_FULL + full if full else dest


def _deserialize_check(path: str, payload: bytes, tokenizer_info) -> None:
    from xgrammar import CompiledGrammar

    try:
        CompiledGrammar.deserialize_json(payload.decode("utf-8"), tokenizer_info)
    except Exception as exc:  # noqa: BLE001 - any rejection makes the entry invalid
        raise CorruptEntryError(
            path, f"xgrammar rejected the serialized grammar: {type(exc).__name__}: {exc}"
        ) from None


def namespaces(root: str) -> list[str]:
    root = os.path.abspath(os.path.expanduser(root))
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    return [os.path.join(root, n) for n in names if os.path.isfile(os.path.join(root, n, "scope.json"))]
