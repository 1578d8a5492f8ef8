"""Persistent on-disk cache of compiled grammars, shared by every process of a host.

Layout (one *namespace* per compatibility scope)::

    <root>/<scope-digest>/
        scope.json            the scope document (human-readable; checked on open)
        entries/<key>.xgc     one entry per grammar key (0600)
        locks/<key>.lock      per-entry file lock (filelock)
        ledger                byte ledger: sum of the sizes of every file in entries/
        ledger.lock           serialises ledger updates and pruning
        quarantine/           entries moved aside by `dspark-harden grammar-cache verify --quarantine`

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
over or served (the operator repairs with ``dspark-harden grammar-cache verify --quarantine``).

Publication: the entry is written to a temp file in ``entries/`` and renamed over the final
name while the writer holds the entry's exclusive file lock; then the ledger is updated under
``ledger.lock``. When the ledger would exceed the hard limit, the oldest entries (by mtime,
refreshed on every hit) are pruned, skipping entries whose lock another process holds; if it
still cannot get under the limit the new entry is withdrawn and :class:`PruneError` reports it.
Durability: every file (entry, ledger, scope) is fsynced before its rename and its directory
after it, so a crash or power loss leaves each name absent, old or complete — never torn. (The
seed skipped fsync because it ran in the request path; here publication runs in the background
helper process, so the cost is off the serving path.) A crash can at worst leave a temp file or a
stale ledger, which ``grammar-cache verify`` reports and ``prune`` repairs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass
from typing import Iterator, Optional

from filelock import FileLock, Timeout

FORMAT_VERSION = 1
MAGIC = b"DSHXGC01"
_HEADER = struct.Struct("<8sBB6x32s32sQ")
HEADER_SIZE = _HEADER.size  # 88
TRAILER_SIZE = 32
KIND_SERIALIZED = 1
KIND_MARKER = 2
_MARKER = struct.Struct("<BQQQ")
MARKER_REASONS = {1: "slow_load", 2: "predicted_slow", 3: "too_large", 4: "serialize_failed", 5: "memory_limit",
                  6: "deadline", 7: "helper_failed"}
REASON_CODES = {v: k for k, v in MARKER_REASONS.items()}

LEDGER_MAGIC = b"DSHXGLD1"
_LEDGER = struct.Struct("<8sQ32s")

ENTRY_SUFFIX = ".xgc"
TMP_PREFIX = ".tmp-"
POLICY_VERSION = "adaptive-marker-v2"  # v2: persisted by a memory-capped helper process, reasons 5..7


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

    @property
    def marker(self) -> Optional[Marker]:
        if self.kind != KIND_MARKER:
            return None
        code, c, s, l = _MARKER.unpack(self.payload)
        return Marker(MARKER_REASONS[code], c, s, l)


def encode_entry(scope_hex: str, key_hex: str, kind: int, payload: bytes) -> bytes:
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, kind, bytes.fromhex(scope_hex), bytes.fromhex(key_hex), len(payload))
    return header + payload + digest(header + payload)


def encode_marker(scope_hex: str, key_hex: str, marker: Marker) -> bytes:
    payload = _MARKER.pack(REASON_CODES[marker.reason], marker.compile_ns, marker.serialized_bytes, marker.load_ns)
    return encode_entry(scope_hex, key_hex, KIND_MARKER, payload)


def _key_difference(written: str, expected: str) -> str:
    """Both full key digests and where they first differ (two digests can share a long prefix)."""
    i = next((n for n, (a, b) in enumerate(zip(written, expected)) if a != b), min(len(written), len(expected)))
    lo = max(0, i - 4)

    def around(h: str) -> str:
        return ("…" if lo else "") + h[lo:i] + "[" + h[i:i + 1] + "]" + h[i + 1:i + 5] + "…"

    return (f"written for key {written}, not {expected}: they first differ at hex digit {i + 1} "
            f"({around(written)} vs {around(expected)})")


def decode_entry(path: str, data: bytes, scope_hex: Optional[str], key_hex: Optional[str]) -> Entry:
    """Validate ``data`` read from ``path``; raise CorruptEntryError naming the file."""
    if len(data) < HEADER_SIZE + TRAILER_SIZE:
        raise CorruptEntryError(path, f"truncated: {len(data)} bytes, shorter than header + checksum")
    magic, fmt, kind, scope_b, key_b, plen = _HEADER.unpack_from(data)
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
    body, trailer = data[:-TRAILER_SIZE], data[-TRAILER_SIZE:]
    if digest(body) != trailer:
        raise CorruptEntryError(path, "checksum mismatch (bytes changed after publication)")
    if scope_hex is not None and scope_b.hex() != scope_hex:
        raise CorruptEntryError(path, f"foreign entry: written for scope {scope_b.hex()[:16]}…, not this namespace")
    if key_hex is not None and key_b.hex() != key_hex:
        raise CorruptEntryError(path, f"foreign entry: {_key_difference(key_b.hex(), key_hex)} (swapped?)")
    entry = Entry(kind, bytes(data[HEADER_SIZE:-TRAILER_SIZE]))
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


def atomic_write(directory: str, final: str, data: bytes) -> None:
    """Temp file in the same directory, 0600, full write, fsync, rename over ``final``, fsync the
    directory: after a crash or power loss ``final`` is either absent, the old file, or the complete
    new one — never a zero-length or truncated entry (which, by design, would fail its grammar on
    every rank until an operator acted)."""
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            if n <= 0:
                raise OSError(f"short write to {tmp}")
            view = view[n:]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, final)
    except BaseException:
        if fd >= 0:
            os.close(fd)
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


def _lock(path: str) -> FileLock:
    """An flock-based lock (never a soft-lock fallback), kept on disk (unlinking lock files races),
    releasable from another thread, polling every 2 ms while blocked."""
    return FileLock(
        path, mode=0o600, thread_local=False, is_singleton=False, poll_interval=0.002,
        fallback_to_soft=False, preserve_lock_file=True,
    )


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
    """One scoped cache directory. Thread- and process-safe; holds no open files between calls."""

    def __init__(self, root: str, scope: dict, *, max_bytes: int, create: bool = True):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.root = os.path.abspath(os.path.expanduser(root))
        self.scope = scope
        self.scope_hex = scope_digest_of(scope)
        self.path = os.path.join(self.root, self.scope_hex)
        self.entries = os.path.join(self.path, "entries")
        self.locks = os.path.join(self.path, "locks")
        self.quarantine = os.path.join(self.path, "quarantine")
        self.ledger_path = os.path.join(self.path, "ledger")
        self.max_bytes = max_bytes
        if create:
            self._create()

    @classmethod
    def open_existing(cls, path: str, *, max_bytes: int = 1 << 62) -> "Namespace":
        """Open a namespace directory found on disk (operator commands)."""
        path = os.path.abspath(path)
        with open(os.path.join(path, "scope.json"), encoding="utf-8") as fh:
            scope = json.load(fh)
        ns = cls(os.path.dirname(path), scope, max_bytes=max_bytes, create=False)
        if ns.path != path:
            raise GrammarCacheError(f"{path}: scope.json does not hash to the directory name ({ns.scope_hex})")
        return ns

    def _create(self) -> None:
        for d in (self.root, self.path, self.entries, self.locks):
            os.makedirs(d, mode=0o700, exist_ok=True)
        scope_file = os.path.join(self.path, "scope.json")
        text = json.dumps(self.scope, sort_keys=True, indent=1, ensure_ascii=False).encode()
        if not os.path.exists(scope_file):
            atomic_write(self.path, scope_file, text)
        with self.ledger_lock():
            if not os.path.exists(self.ledger_path):
                atomic_write(self.path, self.ledger_path, encode_ledger(self.scan_bytes()))
            else:
                self.read_ledger()  # invalid ledger: fail at open, naming the file

    # -- paths and locks -------------------------------------------------------------------
    def entry_path(self, key_hex: str) -> str:
        return os.path.join(self.entries, key_hex + ENTRY_SUFFIX)

    def entry_lock(self, key_hex: str) -> FileLock:
        # thread_local=False: the publisher thread releases a lock a compile worker acquired.
        return _lock(os.path.join(self.locks, key_hex + ".lock"))

    def ledger_lock(self) -> FileLock:
        return _lock(os.path.join(self.path, "ledger.lock"))

    # -- entries ---------------------------------------------------------------------------
    def read(self, key_hex: str) -> Optional[tuple[str, bytes]]:
        """(path, raw bytes) of the published entry, or None when absent."""
        path = self.entry_path(key_hex)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # LRU order for pruning
        return path, data

    def publish(self, key_hex: str, data: bytes) -> tuple[int, Optional[PruneResult]]:
        """Atomically publish ``data`` (caller holds the entry lock); account; prune if needed.

        Returns (ledger total after, prune result or None). Raises PruneError after withdrawing
        the entry when the cache cannot get under its hard limit."""
        final = self.entry_path(key_hex)
        if len(data) > self.max_bytes:
            # would evict every other entry and still not fit: refuse it alone, prune nothing
            raise PruneError(
                f"grammar cache entry {final} ({len(data)} bytes) is larger than the namespace's hard limit of "
                f"{self.max_bytes} bytes; it was not written"
            )
        try:
            old = os.stat(final).st_size
        except FileNotFoundError:
            old = 0
        atomic_write(self.entries, final, data)
        delta = len(data) - old
        with self.ledger_lock():
            total = self.read_ledger() + delta
            if total <= self.max_bytes:
                self._write_ledger(total)
                return total, None
            result = self._prune_locked(self.max_bytes, keep=final)
            if not result.ok:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(final)
                self._write_ledger(self.scan_bytes())
                raise PruneError(
                    f"grammar cache {self.path} could not prune below its hard limit of {self.max_bytes} bytes "
                    f"({result.after} bytes remain, {result.skipped_locked} entries locked by other processes); "
                    f"the new entry {final} was withdrawn"
                )
            return result.after, result

    # -- ledger ----------------------------------------------------------------------------
    def read_ledger(self) -> int:
        try:
            with open(self.ledger_path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            raise LedgerError(self.ledger_path, "missing") from None
        return decode_ledger(self.ledger_path, data)

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
                total += e.stat().st_size
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
            return self._prune_locked(self.max_bytes if limit is None else limit, keep=None)

    def _prune_locked(self, limit: int, keep: Optional[str]) -> PruneResult:
        items = []
        for e in self.iter_entries():
            try:
                st = e.stat()
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
            except Timeout:
                skipped += 1  # another process is compiling or publishing this key
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
                with open(e.path, "rb") as fh:
                    data = fh.read()
                entry = decode_entry(e.path, data, self.scope_hex, key_hex)
                del data
                if tokenizer_info is not None and entry.kind == KIND_SERIALIZED:
                    _deserialize_check(e.path, entry.payload, tokenizer_info)
                ok += 1
            except CorruptEntryError as exc:
                bad.append((e.path, exc.reason))
            except FileNotFoundError:
                continue
        return ok, bad

    def quarantine_entry(self, path: str) -> str:
        os.makedirs(self.quarantine, mode=0o700, exist_ok=True)
        dest = os.path.join(self.quarantine, f"{os.path.basename(path)}.{int(time.time())}")
        key_hex = os.path.basename(path)[: -len(ENTRY_SUFFIX)]
        with self.entry_lock(key_hex):
            os.replace(path, dest)
        with self.ledger_lock():
            # rescan: a corrupted entry may no longer have the size the ledger accounted for
            self._write_ledger(self.scan_bytes())
        return dest


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
