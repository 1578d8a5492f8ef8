"""The bridge into xgrammar: a ``GrammarCompiler`` stand-in that goes through the disk cache.

:class:`PersistentCompiler` replaces ``XGrammarGrammarBackend.grammar_compiler``. Every compile
entry point that SGLang's four dispatch methods use (``compile_json_schema`` incl. the builtin
"any JSON" grammar, ``compile_grammar``, ``compile_regex``, ``compile_structural_tag``) resolves:

1. published entry present -> validate (checksum, scope, key) -> serialized: deserialize with
   the live TokenizerInfo (source ``disk``); marker: compile locally (source ``local_compile``);
2. absent -> take the entry's exclusive file lock (one compile per key across processes),
   re-check, compile natively (source ``compile``), hand the result back at once and let the
   background publisher serialize, *measure* the load time, choose serialized entry or
   compile-locally marker, publish atomically and release the lock.

The adaptive decision: a serialized entry is kept only when loading it (checksum + deserialize,
measured right after serialising) costs at most ``load_ratio`` x the native compile time (the
smaller of the request's compile and one re-compile the publisher times next to the trial load,
so a burst of concurrent compiles cannot inflate the budget);
otherwise a 145-byte marker records the measurements and peers compile locally instead of
waiting on a slow read. Grammars whose predicted JSON size (``PREDICT_SERIALIZED_PER_MEMORY_BYTE``
x the compiled grammar's memory size, read at ``PREDICT_LOAD_BYTES_PER_SECOND``) already
exceeds that budget are marked without paying for serialisation.

The last resolution of the calling thread is available from :func:`take_resolution` (the service
reads it to label its lookup metric by source).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from . import disk
from . import metrics as gm

logger = logging.getLogger("dspark_harden.grammar")

# Measured on xgrammar 0.2.7 (32k byte-level BPE): serialized JSON is 1.4x..14x the compiled
# grammar's memory size and deserialises at 13..60 MB/s; the prediction uses the optimistic ends,
# so it only skips serialisation when even the best case would be too slow.
PREDICT_SERIALIZED_PER_MEMORY_BYTE = 1.4
PREDICT_LOAD_BYTES_PER_SECOND = 60e6

_TLS = threading.local()


@dataclass
class Resolution:
    source: str  # disk | compile | local_compile
    seconds: float
    lock_wait: float = 0.0
    phases: dict = field(default_factory=dict)
    path: Optional[str] = None
    key_hex: str = ""


def take_resolution() -> Optional[Resolution]:
    r = getattr(_TLS, "last", None)
    _TLS.last = None
    return r


def _record(res: Resolution) -> None:
    _TLS.last = res
    gm.observe_phases(res.phases)


@dataclass(frozen=True)
class Policy:
    load_ratio: float = 0.7
    max_entry_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if not self.load_ratio > 0:
            raise ValueError(f"load_ratio must be positive, got {self.load_ratio}")
        if self.max_entry_bytes <= 0:
            raise ValueError(f"max_entry_bytes must be positive, got {self.max_entry_bytes}")


def xgrammar_version() -> str:
    return importlib.metadata.version("xgrammar")


def tokenizer_digest(tokenizer_info: Any) -> str:
    return hashlib.sha256(tokenizer_info.serialize_json().encode()).hexdigest()


def scope_for(tokenizer_info: Any, *, vocab_size: int, override_stop_tokens: Any, compiler: dict) -> dict:
    """Every dimension that decides whether a compiled grammar is reusable."""
    stops = override_stop_tokens
    if isinstance(stops, int):
        stops = [stops]
    return disk.scope_document(
        xgrammar=xgrammar_version(),
        tokenizer_sha256=tokenizer_digest(tokenizer_info),
        vocab_size=int(vocab_size),
        stop_token_ids=sorted(int(t) for t in tokenizer_info.stop_token_ids),
        override_stop_tokens=None if stops is None else [int(t) for t in stops],
        compiler=compiler,
    )


class _Publisher:
    """One background thread per cache: serialise, measure, publish, release the entry lock."""

    def __init__(self, owner: "PersistentCompiler"):
        self._owner = owner
        self._q: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._start_lock = threading.Lock()

    def submit(self, job: tuple) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dspark-grammar-publish", daemon=True)
                self._thread.start()
        self._q.put(job)

    def flush(self) -> None:
        self._q.join()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            try:
                self._owner._publish(*job)
            except BaseException:  # noqa: BLE001 - never let the publisher thread die
                logger.exception("dspark-harden: grammar cache publisher failed")
            finally:
                self._q.task_done()


class PersistentCompiler:
    """Drop-in for ``xgrammar.GrammarCompiler`` backed by a :class:`disk.Namespace`."""

    def __init__(self, inner: Any, tokenizer_info: Any, namespace: disk.Namespace, policy: Policy,
                 inner_threads: int = 8):
        self.inner = inner
        self.inner_threads = inner_threads
        self.tokenizer_info = tokenizer_info
        self.ns = namespace
        self.policy = policy
        self._publisher = _Publisher(self)
        self.native_compiles = 0  # native compile calls made through this object
        self._count_lock = threading.Lock()
        self.stored: dict[str, str] = {}  # key digest -> "serialized" | "marker" (this process's publishes)

    # -- xgrammar GrammarCompiler surface --------------------------------------------------
    def compile_json_schema(self, schema: Any, **kwargs: Any):
        if isinstance(schema, dict):
            schema_text = json.dumps(schema)
        elif isinstance(schema, str):
            schema_text = schema
        else:  # pydantic model classes: not cacheable by text
            return self._native(lambda: self.inner.compile_json_schema(schema, **kwargs))
        return self._get(["json_schema", schema_text, _kw(kwargs)],
                         lambda: self.inner.compile_json_schema(schema, **kwargs))

    def compile_builtin_json_grammar(self):
        return self._get(["builtin_json"], self.inner.compile_builtin_json_grammar)

    def compile_grammar(self, grammar: Any, **kwargs: Any):
        if not isinstance(grammar, str):
            return self._native(lambda: self.inner.compile_grammar(grammar, **kwargs))
        return self._get(["ebnf", grammar, _kw(kwargs)], lambda: self.inner.compile_grammar(grammar, **kwargs))

    def compile_regex(self, regex: Any):
        if not isinstance(regex, str):
            return self._native(lambda: self.inner.compile_regex(regex))
        return self._get(["regex", regex], lambda: self.inner.compile_regex(regex))

    def compile_structural_tag(self, *args: Any, **kwargs: Any):
        text = None
        if len(args) == 1 and not kwargs:
            tag = args[0]
            if isinstance(tag, str):
                text = tag
            elif isinstance(tag, dict):
                text = json.dumps(tag)
            elif hasattr(tag, "model_dump_json"):
                text = tag.model_dump_json()
        fn = lambda: self.inner.compile_structural_tag(*args, **kwargs)  # noqa: E731
        if text is None:
            return self._native(fn)
        return self._get(["structural_tag", text], fn)

    def clear_cache(self) -> None:
        self.inner.clear_cache()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    # -- resolution ------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait until every queued publication finished (tests, bench, shutdown)."""
        self._publisher.flush()

    def _count(self) -> None:
        with self._count_lock:
            self.native_compiles += 1

    def _native(self, fn: Callable[[], Any]):
        t = time.perf_counter()
        self._count()
        cg = fn()
        dt = time.perf_counter() - t
        _record(Resolution("compile", dt, phases={"native_compile": dt}))
        return cg

    def _get(self, parts: list, fn: Callable[[], Any]):
        key_hex = disk.key_digest(parts)
        t0 = time.perf_counter()
        got = self.ns.read(key_hex)
        if got is not None:
            return self._from_entry(key_hex, got, fn, t0, 0.0)
        lock = self.ns.entry_lock(key_hex)
        tw = time.perf_counter()
        lock.acquire()
        wait = time.perf_counter() - tw
        gm.observe_lock_wait(wait)
        handed_off = False
        try:
            got = self.ns.read(key_hex)
            if got is not None:
                lock.release()
                handed_off = True
                return self._from_entry(key_hex, got, fn, t0, wait)
            tc = time.perf_counter()
            self._count()
            cg = fn()
            compile_s = time.perf_counter() - tc
            self._publisher.submit((key_hex, lock, cg, compile_s, fn))
            handed_off = True
        finally:
            if not handed_off:
                lock.release()
        total = time.perf_counter() - t0
        _record(Resolution("compile", total, wait, {"native_compile": compile_s}, self.ns.entry_path(key_hex), key_hex))
        return cg

    def _from_entry(self, key_hex: str, got: tuple, fn: Callable[[], Any], t0: float, wait: float):
        path, data = got
        phases = {"disk_read": time.perf_counter() - t0}
        tv = time.perf_counter()
        try:
            entry = disk.decode_entry(path, data, self.ns.scope_hex, key_hex)
        except disk.CorruptEntryError:
            gm.inc_corrupt()
            raise
        phases["verify"] = time.perf_counter() - tv
        if entry.kind == disk.KIND_MARKER:
            tc = time.perf_counter()
            self._count()
            cg = fn()
            phases["native_compile"] = time.perf_counter() - tc
            _record(Resolution("local_compile", time.perf_counter() - t0, wait, phases, path, key_hex))
            return cg
        td = time.perf_counter()
        try:
            from xgrammar import CompiledGrammar

            cg = CompiledGrammar.deserialize_json(entry.payload.decode("utf-8"), self.tokenizer_info)
        except Exception as exc:  # noqa: BLE001 - any rejection is a corrupt entry
            gm.inc_corrupt()
            raise disk.CorruptEntryError(path, f"xgrammar rejected the serialized grammar: {type(exc).__name__}: {exc}") from None
        phases["deserialize"] = time.perf_counter() - td
        _record(Resolution("disk", time.perf_counter() - t0, wait, phases, path, key_hex))
        return cg

    # -- publication (publisher thread) ----------------------------------------------------
    def _publish(self, key_hex: str, lock: Any, cg: Any, compile_s: float, fn: Callable[[], Any]) -> None:
        try:
            self._publish_locked(key_hex, cg, compile_s, fn)
        finally:
            lock.release()

    def decide(self, cg: Any, compile_s: float, key_hex: str, fn: Optional[Callable[[], Any]] = None
               ) -> tuple[bytes, str, dict]:
        """(entry bytes, "serialized" | "marker", phases) for a freshly compiled grammar.

        The compile time the request observed may be inflated by a burst of concurrent compiles;
        so the publisher compiles once more (``fn``) right before the trial load, in the same
        thread, and compares the load against the smaller of the two compile times."""
        from xgrammar import CompiledGrammar

        phases: dict = {}
        if fn is not None:
            tr = time.perf_counter()
            fn()
            recompile_s = time.perf_counter() - tr
            phases["measure_compile"] = recompile_s
            compile_s = min(compile_s, recompile_s)
        budget = compile_s * self.policy.load_ratio
        compile_ns = max(1, int(compile_s * 1e9))
        predicted = cg.memory_size_bytes * PREDICT_SERIALIZED_PER_MEMORY_BYTE / PREDICT_LOAD_BYTES_PER_SECOND
        if predicted > budget:
            m = disk.Marker("predicted_slow", compile_ns, 0, int(predicted * 1e9))
            return disk.encode_marker(self.ns.scope_hex, key_hex, m), "marker", phases
        ts = time.perf_counter()
        try:
            payload = cg.serialize_json().encode("utf-8")
        except Exception as exc:  # noqa: BLE001
            logger.warning("dspark-harden: serialising a compiled grammar failed (%s); storing a marker", exc)
            m = disk.Marker("serialize_failed", compile_ns, 0, 0)
            return disk.encode_marker(self.ns.scope_hex, key_hex, m), "marker", phases
        phases["serialize"] = time.perf_counter() - ts
        if len(payload) > self.policy.max_entry_bytes:
            m = disk.Marker("too_large", compile_ns, len(payload), 0)
            return disk.encode_marker(self.ns.scope_hex, key_hex, m), "marker", phases
        data = disk.encode_entry(self.ns.scope_hex, key_hex, disk.KIND_SERIALIZED, payload)
        tl = time.perf_counter()
        entry = disk.decode_entry("<measure>", data, self.ns.scope_hex, key_hex)
        CompiledGrammar.deserialize_json(entry.payload.decode("utf-8"), self.tokenizer_info)
        load_s = time.perf_counter() - tl
        phases["measure_load"] = load_s
        if load_s > budget:
            m = disk.Marker("slow_load", compile_ns, len(payload), int(load_s * 1e9))
            return disk.encode_marker(self.ns.scope_hex, key_hex, m), "marker", phases
        return data, "serialized", phases

    def _publish_locked(self, key_hex: str, cg: Any, compile_s: float, fn: Callable[[], Any]) -> None:
        if os.path.exists(self.ns.entry_path(key_hex)):
            return  # published meanwhile (cannot happen while we hold the lock, kept defensive)
        data, stored, phases = self.decide(cg, compile_s, key_hex, fn)
        tw = time.perf_counter()
        try:
            total, pruned = self.ns.publish(key_hex, data)
        except disk.PruneError as exc:
            gm.inc_disk_error("prune")
            logger.error("dspark-harden: %s", exc)
            return
        except OSError as exc:
            gm.inc_disk_error("publish")
            logger.error("dspark-harden: publishing grammar cache entry %s failed: %s", key_hex, exc)
            return
        phases["entry_write_account"] = time.perf_counter() - tw
        gm.observe_phases(phases)
        gm.inc_stored(stored)
        gm.set_disk_bytes(total)
        if pruned is not None:
            gm.inc_evictions("disk", "prune", pruned.removed)
        self.stored[key_hex] = stored


def _kw(kwargs: dict) -> dict:
    out = {}
    for k, v in sorted(kwargs.items()):
        out[k] = list(v) if isinstance(v, tuple) else v
    return out
