"""The in-process grammar service behind ``BaseGrammarBackend.get_cached_or_future_value``.

One :class:`GrammarService` per grammar backend object. For a request key it:

1. canonicalises the key (:mod:`.canonical`);
2. under one mutex: LRU hit -> move to most-recent and return a private copy (``source=memory``);
   otherwise join the in-flight compile of that canonical key (``inflight``) or register a new
   one (owner);
3. outside the mutex: the owner submits exactly one compile to the bounded pool; every caller
   attaches a completion callback to the shared future (``add_done_callback`` on an already
   finished future runs the callback at once, in the caller's thread — this is why it is never
   done while holding the mutex) and receives its own :class:`RequestFuture` that resolves to
   its own matcher copy;
4. on completion, under the mutex: drop the in-flight marker; cache successful results (and
   invalid-grammar results, as stock does) at most-recent, then evict from least-recent while
   over the byte or entry limit. Exceptions and corrupt-disk-entry failures are never cached.

A compile timeout is per request: ``RequestFuture.done()`` (polled by SGLang's GrammarManager)
fails the request's own future with :class:`GrammarCompileTimeout` once its deadline passed. The
shared compile keeps running and lands in the cache, so a retry gets it; SGLang's own
poll-count timeout, which would cache ``InvalidGrammarObject("Grammar preprocessing timed out")``
permanently, is refused by :meth:`set_cache` (it never reaches the cache). Otherwise
:meth:`set_cache` keeps stock's contract: a grammar set through it is cached and served.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any, Callable, Optional

from . import metrics as gm
from . import xgr
from .canonical import canonical_key
from .disk import CORRUPT_MARK

logger = logging.getLogger("dspark_harden.grammar")


class GrammarCompileTimeout(TimeoutError):
    pass


class GrammarTooLarge(ValueError):
    pass


class RequestFuture(Future):
    """One request's view of a (possibly shared) compile, with its own deadline."""

    def __init__(self, deadline: Optional[float], timeout_s: Optional[float], key_type: str):
        super().__init__()
        self._deadline = deadline
        self._timeout_s = timeout_s
        self._key_type = key_type
        self.source: Optional[str] = None

    def done(self) -> bool:
        if super().done():
            return True
        if self._deadline is not None and time.monotonic() >= self._deadline:
            try:
                self.set_exception(
                    GrammarCompileTimeout(
                        f"{self._key_type} grammar was not compiled within {self._timeout_s:g} s "
                        f"(DSPARK_HARDEN_GRAMMAR_COMPILE_TIMEOUT); the compile continues and a retry "
                        f"will be served from the cache once it finishes"
                    )
                )
                gm.inc_timeout()
            except InvalidStateError:
                pass
            return True
        return False


class _Inflight:
    __slots__ = ("shared", "generation", "joined")

    def __init__(self, generation: int):
        self.shared: Future = Future()
        self.generation = generation
        self.joined = False  # another lookup of the key joined this compile: the key is used again


def grammar_nbytes(obj: Any) -> int:
    """Memory of a compiled grammar object: the compiled grammar's own ``memory_size_bytes``."""
    seen = 0
    while obj is not None and seen < 8:
        ctx = getattr(obj, "ctx", None)
        if ctx is not None and hasattr(ctx, "memory_size_bytes"):
            try:
                return max(0, int(ctx.memory_size_bytes))
            except Exception:  # noqa: BLE001
                return 0
        obj = getattr(obj, "grammar", None)  # ReasonerGrammarObject wraps the real grammar
        seen += 1
    return 0


def _stats_of(obj: Any) -> Any:
    for candidate in (obj, getattr(obj, "grammar", None)):
        stats = getattr(candidate, "grammar_stats", None)
        if stats is not None:
            return stats
    return None


def _is_cacheable(obj: Any) -> bool:
    if obj is None:
        return False
    msg = getattr(obj, "error_message", None)
    if isinstance(msg, str) and CORRUPT_MARK in msg:
        return False  # a corrupt disk entry: fail this request, retry after the operator repairs
    return True


# error messages of results that say nothing about the grammar itself: never cached
NOT_CACHEABLE_PREFIXES = (
    "Grammar preprocessing timed out",  # stock GrammarManager's poll-count timeout
    "Grammar compilation failed:",  # stock manager's wrapper of an exception (incl. our timeout)
)


def _refusal(value: Any) -> Optional[str]:
    """Why ``value`` must not enter the cache through ``set_cache`` (None: it may)."""
    if value is None:
        return "None"
    try:
        if not value:
            return "falsy (stock's lookup treats it as a miss)"
    except Exception:  # noqa: BLE001
        return "truth value unavailable"
    if not (callable(getattr(value, "copy", None)) and callable(getattr(value, "maybe_init_reasoning", None))):
        return "not a grammar object"
    msg = getattr(value, "error_message", None)
    if isinstance(msg, str) and (msg.startswith(NOT_CACHEABLE_PREFIXES) or CORRUPT_MARK in msg):
        return "timeout or failure result"
    return None


class GrammarService:
    def __init__(
        self,
        backend: Any,
        *,
        workers: int,
        max_bytes: int,
        max_entries: int,
        timeout_s: Optional[float],
        max_grammar_bytes: Optional[int] = None,
    ):
        for name, value in (("workers", workers), ("max_bytes", max_bytes), ("max_entries", max_entries)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"grammar service {name} must be a positive integer, got {value!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"grammar compile timeout must be positive, got {timeout_s!r}")
        self.backend = backend
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.timeout_s = timeout_s
        self.max_grammar_bytes = max_grammar_bytes
        self.refused_too_large = 0
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dspark-grammar")
        self._lock = threading.Lock()
        # canonical key -> (grammar, bytes, disk key digest or None)
        self._lru: "OrderedDict[tuple, tuple[Any, int, Optional[str]]]" = OrderedDict()
        self._bytes = 0
        self._inflight: dict[tuple, _Inflight] = {}
        self._generation = 0
        # counters for tests and the bench
        self.compiles = 0  # compile tasks submitted (one per canonical key miss)
        self.evictions = 0
        # where compile tasks spent their time (thread-seconds summed over tasks, by phase: the
        # disk cache's read/verify/deserialize/native_compile/claim_wait, the empty-language check,
        # SGLang's dispatch around the compiler, and every request's private copy) and how many
        # tasks resolved from each source: the bench's per-phase breakdown
        self._stats_lock = threading.Lock()
        self.phase_seconds: dict[str, float] = {}
        self.sources: dict[str, int] = {}

    # -- stock surface ---------------------------------------------------------------------
    def _too_large(self, key: tuple):
        """A failed request future when the grammar text is above the limit, else None."""
        limit = self.max_grammar_bytes
        text = key[1] if isinstance(key, tuple) and len(key) > 1 else None
        if limit is None or not isinstance(text, str) or len(text) <= limit // 4:
            return None  # (UTF-8 is at most 4 bytes a character: short texts need no encoding)
        n = len(text.encode("utf-8", "surrogatepass"))
        if n <= limit:
            return None
        self.refused_too_large += 1
        req = RequestFuture(None, None, str(key[0]))
        req.source = "refused"
        req.set_exception(
            GrammarTooLarge(
                f"{key[0]} grammar of {n} bytes is larger than DSPARK_HARDEN_GRAMMAR_MAX_BYTES={limit}; it was not "
                f"compiled (compile memory grows far faster than the text). Shrink the grammar or raise the limit."
            )
        )
        gm.lookup("refused", 0.0)
        return req

    def lookup(self, key: tuple, require_reasoning: bool):
        t0 = time.perf_counter()
        refused = self._too_large(key)
        if refused is not None:
            return refused, False
        ckey = canonical_key(key)
        owner = False
        with self._lock:
            hit = self._lru.get(ckey)
            if hit is not None:
                self._lru.move_to_end(ckey)
                inf = None
            else:
                inf = self._inflight.get(ckey)
                if inf is None:
                    inf = _Inflight(self._generation)
                    self._inflight[ckey] = inf
                    owner = True
                    self.compiles += 1
                else:
                    inf.joined = True
        if hit is not None:
            self._reused(hit[2])
            value = hit[0].copy()
            value.maybe_init_reasoning(require_reasoning)
            gm.lookup("memory", time.perf_counter() - t0)
            return value, True

        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        req = RequestFuture(deadline, self.timeout_s, str(ckey[0]))
        if owner:
            try:
                task = self.pool.submit(self._compile, ckey, require_reasoning, deadline)
            except BaseException as exc:  # noqa: BLE001 - e.g. pool shut down: fail, never hang joiners
                task = Future()
                task.set_exception(exc)
            task.add_done_callback(lambda f, ckey=ckey, inf=inf: self._finish(ckey, inf, f))
        shared_source = None if owner else "inflight"
        # Outside the lock: a finished future runs the callback right here.
        inf.shared.add_done_callback(lambda f: self._resolve(req, f, require_reasoning, shared_source, t0))
        return req, False

    def set_cache(self, key: tuple, value: Any) -> bool:
        """Stock's contract (``cache[key] = value``) for what can be cached: a grammar object put
        here lands in the LRU under its canonical key, replacing what was there, and is served
        as a hit (a private copy, ``maybe_init_reasoning`` as stock) to lookups by the original
        or any equivalent key. Refused (returns False, nothing changes): timeout results (stock's
        poll-count ``InvalidGrammarObject("Grammar preprocessing timed out")`` and our per-request
        timeout or any other exception the stock manager wraps as "Grammar compilation failed:"),
        corrupt-disk-entry failures, ``None``/falsy values (stock's lookup treats those as a miss)
        and objects without ``copy``/``maybe_init_reasoning``. Stock's GrammarManager calls this
        after every resolved future with a copy of the request's grammar, like stock."""
        refused = _refusal(value)
        if refused is not None:
            return False
        ckey = canonical_key(key)
        evicted = {"bytes": 0, "entries": 0}
        with self._lock:
            self._insert_locked(ckey, value, evicted)
            size, count = self._bytes, len(self._lru)
        for reason, n in evicted.items():
            gm.inc_evictions("memory", reason, n)
        gm.set_memory(size, count)
        return True

    def reset(self) -> None:
        with self._lock:
            self._lru.clear()
            self._bytes = 0
            self._generation += 1  # compiles already running will not insert
        gm.set_memory(0, 0)

    def pop(self, key: tuple, default: Any = None) -> Any:
        ckey = canonical_key(key)
        with self._lock:
            item = self._lru.pop(ckey, None)
            if item is None:
                return default
            self._bytes -= item[1]
            return item[0]

    def get(self, key: tuple, default: Any = None) -> Any:
        with self._lock:
            item = self._lru.get(canonical_key(key))
        return default if item is None else item[0]

    def __contains__(self, key: tuple) -> bool:
        with self._lock:
            return canonical_key(key) in self._lru

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def keys(self) -> list:
        with self._lock:
            return list(self._lru)

    def shutdown(self, wait: bool = False) -> None:
        """Cancel what has not started; ``wait`` also joins the workers (a running compile ends first)."""
        self.pool.shutdown(wait=wait, cancel_futures=True)

    # -- internals -------------------------------------------------------------------------
    def _compile(self, ckey: tuple, require_reasoning: bool, deadline: Optional[float] = None):
        xgr.take_resolution()  # clear anything left by an earlier task on this worker thread
        xgr.set_request_deadline(deadline)  # the owner's: a wait on another process's claim ends before it
        t = time.perf_counter()
        try:
            value = self.backend._init_value_dispatch(ckey, require_reasoning)
        finally:
            xgr.set_request_deadline(None)
        dispatched = time.perf_counter()
        res = xgr.take_resolution()
        empty = xgr.empty_language_problem(str(ckey[0]), value)
        phases = dict(res.phases) if res is not None else {}
        # SGLang's dispatch around the compiler (its grammar object and first matcher)
        phases["dispatch"] = dispatched - t - (res.seconds if res is not None else 0.0)
        phases["empty_check"] = time.perf_counter() - dispatched
        self._account(phases, res.source if res is not None else "compile")
        if empty is not None:
            from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

            logger.warning("dspark-harden grammar: refused a grammar: %s", empty)
            value = InvalidGrammarObject(empty)  # cached like stock's invalid grammars: one check per key
        source = res.source if res is not None else "compile"
        return value, source, time.perf_counter() - t, (res.key_hex or None) if res is not None else None

    def _account(self, phases: dict, source: Optional[str]) -> None:
        with self._stats_lock:
            for k, v in phases.items():
                self.phase_seconds[k] = self.phase_seconds.get(k, 0.0) + v
            if source is not None:
                self.sources[source] = self.sources.get(source, 0) + 1

    def _finish(self, ckey: tuple, inf: _Inflight, task: Future) -> None:
        """The owner's compile task finished (or was cancelled): drop the in-flight marker and
        resolve the shared future on EVERY path — a marker left behind would make every later
        lookup of the key join a compile that never completes."""
        exc: Optional[BaseException] = None
        result = None
        try:
            if task.cancelled():  # task.exception() would raise CancelledError here
                exc = RuntimeError(
                    f"{ckey[0]} grammar compile was cancelled before it ran (grammar service shut "
                    f"down); retry the request"
                )
            else:
                exc = task.exception()
                if exc is None:
                    result = task.result()
        except BaseException as e:  # noqa: BLE001 - whatever it is, fail the waiters with it
            exc = e
        value = None if exc is not None else result[0]
        key_hex = None if exc is not None else result[3]
        evicted = {"bytes": 0, "entries": 0}
        try:
            with self._lock:
                if self._inflight.get(ckey) is inf:
                    del self._inflight[ckey]
                if exc is None and _is_cacheable(value) and inf.generation == self._generation:
                    self._insert_locked(ckey, value, evicted, key_hex)
                size, count = self._bytes, len(self._lru)
            if inf.joined:
                self._reused(key_hex)
            for reason, n in evicted.items():
                gm.inc_evictions("memory", reason, n)
            gm.set_memory(size, count)
            if exc is not None:
                gm.inc_failure()
        finally:
            with self._lock:  # idempotent: also covers a failure above before the pop
                if self._inflight.get(ckey) is inf:
                    del self._inflight[ckey]
            if exc is not None:
                inf.shared.set_exception(exc)
            else:
                inf.shared.set_result(result)

    @property
    def on_reuse(self) -> Optional[Callable[[str], None]]:
        """Called with a key's disk digest when the key is used again (a memory hit, or a lookup joining
        its compile): the backend's persistent compiler publishes then what it deferred at the first
        compile. Read from the backend at each use: the feature installs that compiler after this
        service is built, and a memory-only backend has none."""
        return getattr(getattr(self.backend, "grammar_compiler", None), "persist_on_reuse", None)

    def _reused(self, key_hex: Optional[str]) -> None:
        on_reuse = self.on_reuse if key_hex is not None else None
        if on_reuse is not None:
            try:
                on_reuse(key_hex)
            except Exception:  # noqa: BLE001 - persistence is an optimisation: never fail a lookup for it
                logger.exception("dspark-harden grammar: publishing a reused grammar failed")

    def _insert_locked(self, ckey: tuple, value: Any, evicted: dict, key_hex: Optional[str] = None) -> None:
        nbytes = grammar_nbytes(value)
        old = self._lru.pop(ckey, None)
        if old is not None:
            self._bytes -= old[1]
            if key_hex is None:  # stock's set_cache after a miss re-inserts the grammar: keep its disk key
                key_hex = old[2]
        self._lru[ckey] = (value, nbytes, key_hex)
        self._bytes += nbytes
        while self._lru and (self._bytes > self.max_bytes or len(self._lru) > self.max_entries):
            reason = "bytes" if self._bytes > self.max_bytes else "entries"
            _, (_, b, _) = self._lru.popitem(last=False)
            self._bytes -= b
            evicted[reason] += 1
            self.evictions += 1

    def _resolve(
        self, req: RequestFuture, shared: Future, require_reasoning: bool, source: Optional[str], t0: float
    ) -> None:
        """Give one request its own copy. Runs as a future callback, where concurrent.futures
        would log and swallow an exception and leave the request unresolved forever: every
        failure (``copy()``, ``maybe_init_reasoning()``, ...) fails this request's future instead."""
        if req.cancelled() or Future.done(req):
            return
        try:
            exc = shared.exception()
            if exc is not None:
                req.set_exception(exc)
                return
            value, compile_source, compile_s, _ = shared.result()
            req.source = source or compile_source
            if value is not None:
                tc = time.perf_counter()
                value = value.copy()
                value.maybe_init_reasoning(require_reasoning)
                self._account({"copy": time.perf_counter() - tc}, None)
                stats = _stats_of(value)
                if stats is not None:
                    stats.is_cache_hit = req.source in ("memory", "inflight", "disk")
                    stats.compilation_time = compile_s
            req.set_result(value)
        except InvalidStateError:
            return  # timed out or cancelled concurrently
        except BaseException as err:  # noqa: BLE001
            failure = RuntimeError(
                f"{req._key_type} grammar compiled, but preparing this request's matcher failed: "
                f"{type(err).__name__}: {err}"
            )
            failure.__cause__ = err
            try:
                req.set_exception(failure)
            except InvalidStateError:
                return
            gm.inc_failure()
            return
        gm.lookup(req.source, time.perf_counter() - t0)


class CacheView:
    """What ``backend.cache`` points at while the feature is bound: the service's LRU through the
    mapping reads and writes of stock's ``dict`` (``[key]``, ``get``, ``pop``, ``clear``, ``in``,
    ``len``, iteration, ``keys``/``values``/``items``, ``[key] = value``), with its semantics: a read
    returns the very object ``set_cache`` stored (the lookup path hands out copies, as stock does), a
    missing ``[key]`` raises ``KeyError``. Keys are canonical: every spelling of a stored key reads it,
    and iteration yields the canonical keys (each one reads back with ``[key]``)."""

    _MISSING = object()

    def __init__(self, service: GrammarService):
        self._service = service

    def __getitem__(self, key):
        value = self._service.get(key, self._MISSING)
        if value is self._MISSING:
            raise KeyError(key)
        return value

    def get(self, key, default=None):
        return self._service.get(key, default)

    def __iter__(self):
        return iter(self._service.keys())  # a snapshot: the LRU may change while a caller iterates

    def values(self) -> list:
        return [v for _, v in self.items()]

    def items(self) -> list:
        out = []
        for k in self._service.keys():
            v = self._service.get(k, self._MISSING)
            if v is not self._MISSING:  # evicted since the snapshot
                out.append((k, v))
        return out

    def pop(self, key, default=None):
        return self._service.pop(key, default)

    def clear(self):
        self._service.reset()

    def keys(self):
        return self._service.keys()

    def __contains__(self, key):
        return key in self._service

    def __len__(self):
        return len(self._service)

    def __setitem__(self, key, value):
        self._service.set_cache(key, value)
