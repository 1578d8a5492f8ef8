"""The bridge into xgrammar: a ``GrammarCompiler`` stand-in that goes through the disk cache.

:class:`PersistentCompiler` replaces ``XGrammarGrammarBackend.grammar_compiler``. Every compile
entry point that SGLang's four dispatch methods use (``compile_json_schema`` incl. the builtin
"any JSON" grammar, ``compile_grammar``, ``compile_regex``, ``compile_structural_tag``) resolves:

1. published entry present -> validate (checksum, scope, key) -> serialized: deserialize with
   the live TokenizerInfo (source ``disk``); marker: compile locally (source ``local_compile``);
   invalid (a symbolic link or other non-regular file included): the request fails naming the
   file (source ``corrupt``); larger than this server's ``DISK_MAX_ENTRY_BYTES`` (a cache shared
   with a server configured larger): not read, compiled locally (source ``oversized``); an I/O
   error reading it: compiled locally (source ``compile``, counted as a read error);
2. absent -> compile natively in this process (source ``compile``, counted against the compile
   slots) and hand the result back at once; then queue the *key* (not the grammar) for
   publication by :class:`.persist.Persister`, whose helper process compiles it again, serializes,
   measures the load time, chooses serialized entry or compile-locally marker and publishes
   atomically — under an address-space limit and a deadline, off the serving process.

No cross-process lock is taken in the serving path. One compile per key host-wide comes from a
*claim* instead (:mod:`.claim`): before compiling an absent key the process claims it (a small file
naming its pid and start time, created non-blocking); a process that finds the key claimed waits,
bounded by the claimant's measured claim-to-publication time and by the request's own deadline,
for the published entry and loads it — or compiles itself when the bound passes, the claimant died,
or the claim went away without an entry. The per-entry lock is taken by the helpers,
non-blocking, so one helper host-wide persists a key.

A restarted scheduler first *preloads* (:meth:`PersistentCompiler.start_preload`): a background thread
loads the most recently used serialized entries of its namespace (the disk cache's own LRU order: a
hit refreshes an entry's mtime) into memory, bounded by count and bytes, while the server finishes
starting; a lookup of a preloaded key is then served without a read (source ``disk``, phase
``preloaded``). What no request took within ``PRELOAD_KEEP_S`` of the preload's end is dropped at the next
lookup after that (or at close): no timer thread; the bytes bound holds meanwhile.

The last resolution of the calling thread is available from :func:`take_resolution` (the service
reads it to label its lookup metric by source).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from . import claim as claim_mod
from . import disk
from . import metrics as gm
from .persist import CompileSlots, Persister, PersistSettings

logger = logging.getLogger("dspark_harden.grammar")

_TLS = threading.local()


@dataclass
class Resolution:
    source: str  # disk | compile | local_compile | oversized | corrupt
    seconds: float
    phases: dict = field(default_factory=dict)
    path: Optional[str] = None
    key_hex: str = ""


def set_request_deadline(deadline: Optional[float]) -> None:
    """The calling thread's current request deadline (monotonic; None: none): a wait on another
    process's claim never runs past it. Set by the grammar service around each compile task."""
    _TLS.deadline = deadline


def take_resolution() -> Optional[Resolution]:
    r = getattr(_TLS, "last", None)
    _TLS.last = None
    return r


#: deferred publications (keys compiled once, cheap to compile): at most this many, holding at most this many
#: bytes of key text, and never a key larger than the last (it is published at its first compile)
DEFERRED_KEPT = 4096
DEFERRED_MAX_BYTES = 16 << 20
DEFERRED_MAX_KEY_BYTES = 64 << 10
#: preloaded grammars no request took within this many seconds of the preload's end are dropped, and the
#: preload holds at most this many bytes of compiled grammars (``memory_size_bytes``; also at most the LRU's limit)
PRELOAD_KEEP_S = 600.0
PRELOAD_MAX_BYTES = 256 << 20


def _record(res: Resolution) -> None:
    _TLS.last = res
    gm.observe_phases(res.phases)


@dataclass(frozen=True)
class Policy:
    load_ratio: float = 0.5
    max_entry_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if not self.load_ratio > 0:
            raise ValueError(f"load_ratio must be positive, got {self.load_ratio}")
        if self.max_entry_bytes <= 0:
            raise ValueError(f"max_entry_bytes must be positive, got {self.max_entry_bytes}")


@functools.lru_cache(maxsize=None)
def xgrammar_version() -> str:
    return importlib.metadata.version("xgrammar")  # fixed for the life of the process


def tokenizer_digest(tokenizer_info: Any, tokenizer_json: Optional[str] = None) -> str:
    """SHA-256 of the TokenizerInfo's serialization (``tokenizer_json``: that serialization, already
    made -- it takes 25 ms at 32k tokens and ~4x that at 129k, so start-up makes it once)."""
    if tokenizer_json is None:
        tokenizer_json = tokenizer_info.serialize_json()
    return hashlib.sha256(tokenizer_json.encode()).hexdigest()


def scope_for(
    tokenizer_info: Any,
    *,
    vocab_size: int,
    override_stop_tokens: Any,
    compiler: dict,
    tokenizer_json: Optional[str] = None,
) -> dict:
    """Every dimension that decides whether a compiled grammar is reusable."""
    stops = override_stop_tokens
    if isinstance(stops, int):
        stops = [stops]
    return disk.scope_document(
        xgrammar=xgrammar_version(),
        tokenizer_sha256=tokenizer_digest(tokenizer_info, tokenizer_json),
        vocab_size=int(vocab_size),
        stop_token_ids=sorted(int(t) for t in tokenizer_info.stop_token_ids),
        override_stop_tokens=None if stops is None else [int(t) for t in stops],
        compiler=compiler,
    )


EMPTY_LANGUAGE_MARK = "admits no output at all"


def empty_language_problem(grammar_type: str, value: Any) -> Optional[str]:
    """A message when a freshly resolved SGLang xgrammar grammar object accepts no token at its start
    (not even end of sequence), else None.

    Such a grammar has an empty language — typically a ``$ref`` cycle with no base case
    (``a -> b -> a``). Stock serves it and fails in the scheduler at the first token
    (``XGrammarGrammar.accept_token`` raises "Tokens not accepted", answered 500); here it is an
    invalid grammar like any other (a 400 naming the reason), decided once per compile on a fresh
    matcher (the object's own matcher is not touched)."""
    ctx = getattr(value, "ctx", None)
    vocab = getattr(value, "vocab_size", None)
    if ctx is None or not isinstance(vocab, int) or getattr(value, "matcher", None) is None:
        return None  # not an xgrammar grammar object (invalid object, other backend)
    import xgrammar as xg

    try:
        matcher = xg.GrammarMatcher(ctx, override_stop_tokens=getattr(value, "override_stop_tokens", None))
        if matcher.is_terminated():
            return None
        mask = xg.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(mask)
        if bool(mask.any()):
            return None
    except Exception:  # noqa: BLE001 - an extra refusal only: if the check itself fails, serve as stock
        logger.warning(
            "dspark-harden grammar: the empty-language check failed; serving the grammar as stock does", exc_info=True
        )
        return None
    first = str(ctx.grammar).strip().splitlines()[:3]
    return (
        f"{grammar_type} grammar {EMPTY_LANGUAGE_MARK}: no token, not even end of sequence, can start it "
        f"(for a JSON schema: a $ref cycle with no base case, or required properties that can never be "
        f"satisfied); rules: {' | '.join(first)[:300]}"
    )


class PersistentCompiler:
    """Drop-in for ``xgrammar.GrammarCompiler`` backed by a :class:`disk.Namespace`."""

    def __init__(
        self,
        inner: Any,
        tokenizer_info: Any,
        namespace: disk.Namespace,
        policy: Policy,
        inner_threads: int = 8,
        *,
        slots: Optional[CompileSlots] = None,
        persist: Optional[PersistSettings] = None,
        claims: bool = True,
        tokenizer_json: Optional[str] = None,
        inner_cache_bytes: Optional[int] = None,
        persist_min_compile_s: float = 0.0,
    ):
        # claims: host-wide compile claims (claim.py). On for a direct construction (benches, tests);
        # a server follows DSPARK_HARDEN_GRAMMAR_DISK_CLAIMS, off by default (feature.py says why).
        # persist_min_compile_s: a key whose first compile took less is published only when it is used
        # again (on_reuse); 0 (a direct construction): every compile is published
        # (DSPARK_HARDEN_GRAMMAR_DISK_PERSIST_MIN_COMPILE_S, feature.py)
        self.inner = inner
        self.inner_threads = inner_threads
        # xgrammar's own compiler cache (DSPARK_HARDEN_GRAMMAR_XGR_CACHE_BYTES; 0: off). None: read
        # from the compiler (-1, off or unbounded, counts as off: _cold_timing also watches its size)
        if inner_cache_bytes is None:
            inner_cache_bytes = max(0, int(getattr(inner, "cache_limit_bytes", -1)))
        self.inner_cache_bytes = int(inner_cache_bytes)
        self.tokenizer_info = tokenizer_info
        # the helper rebuilds the TokenizerInfo from this; given when the caller already made it
        self._tokenizer_json = tokenizer_json
        self.ns = namespace
        self.policy = policy
        self.slots = slots if slots is not None else CompileSlots(max(1, inner_threads))
        self.persist_settings = persist if persist is not None else PersistSettings()
        self.persister = Persister(namespace, self._helper_init(), self.persist_settings, self.slots)
        weakref.finalize(self, self.persister.close)  # a discarded compiler leaves no helper process
        self.native_compiles = 0  # native compile calls made through this object
        self.marker_compiles = 0  # of which: keys whose entry is a compile-locally marker (bench, tests)
        self.persist_min_compile_s = float(persist_min_compile_s)
        # key digest -> (parts, compile_s, cold) of keys compiled once and not published yet, bounded by
        # count and by the bytes of their key text (a key larger than DEFERRED_MAX_KEY_BYTES is never deferred)
        self._deferred: "collections.OrderedDict[str, tuple]" = collections.OrderedDict()
        self._deferred_bytes = 0
        self.deferred_published = 0  # deferred keys published on reuse (bench, tests)
        self.claims_enabled = bool(claims)  # DSPARK_HARDEN_GRAMMAR_DISK_CLAIMS (the feature passes it)
        self.claim_waits: "collections.deque" = collections.deque(maxlen=65536)  # (outcome, s): bench, tests
        self.claim_outcomes: dict = {o: 0 for o in gm.CLAIM_OUTCOMES}
        self._clean_claims()
        self._count_lock = threading.Lock()
        self._warned: set = set()  # (kind, ...) already logged: one WARNING each, bounded
        # key digest -> compiled grammar loaded ahead of any request (start_preload), bounded by count and bytes
        self._preloaded: dict = {}
        self._preload_until: Optional[float] = None  # monotonic: what is left then is dropped (None: running)
        self._preload_stop = threading.Event()
        self._preload_thread: Optional[threading.Thread] = None
        self.preload_stats: dict = {}  # entries, bytes, wall_s, cpu_s, demoted, corrupt, used, dropped

    @property
    def stored(self) -> dict:
        """key digest -> "serialized" | "marker" for what this process's helper published."""
        return {k: r["stored"] for k, r in self.persister.outcomes.items() if r.get("status") == "published"}

    def _helper_init(self) -> dict:
        return {
            "tokenizer_info": self._tokenizer_json
            if self._tokenizer_json is not None
            else self.tokenizer_info.serialize_json(),
            # the serving compiler's thread count: the helper's compile wall time is then what a restarted
            # process pays (recorded in serialized entries: decision_compile_s); the job still counts as
            # one compile slot (the same CPU, spread over threads)
            "compiler_threads": self.inner_threads,
            "root": self.ns.root,
            "scope": self.ns.scope,
            "scope_hex": self.ns.scope_hex,
            "max_bytes": self.ns.max_bytes,
            "load_ratio": self.policy.load_ratio,
            "max_entry_bytes": self.policy.max_entry_bytes,
            "memory_limit_bytes": self.persist_settings.memory_limit_bytes,
            "idle_exit_s": self.persist_settings.idle_exit_s,
            "lock_timeout_s": self.persist_settings.lock_timeout_s,
        }

    def close(self, join_s: Optional[float] = None) -> None:
        self._preload_stop.set()
        self.persister.close(join_s=join_s)
        t = self._preload_thread
        if join_s is not None and t is not None and t is not threading.current_thread():
            t.join(join_s)
        self._drop_preloaded()

    # -- preload ---------------------------------------------------------------------------
    def start_preload(self, max_entries: int, max_bytes: int = PRELOAD_MAX_BYTES) -> Optional[threading.Thread]:
        """Load up to ``max_entries`` of the namespace's most recently used serialized entries (and at most
        ``max_bytes`` of compiled grammar) in a background thread; None when there is nothing to do."""
        if max_entries <= 0 or self._preload_thread is not None:
            return None
        self._preload_thread = threading.Thread(
            target=self.preload, args=(max_entries, max_bytes), name="dspark-grammar-preload", daemon=True
        )
        self._preload_thread.start()
        return self._preload_thread

    def wait_preload(self, timeout: Optional[float] = None) -> bool:
        """Wait for a started preload to end (bench, tests); True when none runs."""
        t = self._preload_thread
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True

    def preload(self, max_entries: int, max_bytes: int = PRELOAD_MAX_BYTES) -> dict:
        """Preload now, in the calling thread (what :meth:`start_preload` runs); returns :attr:`preload_stats`.
        An entry is judged as a lookup judges it: a corrupt one is moved to quarantine (before any request
        meets it), one that loaded slower than its recorded compile is demoted, a marker is skipped."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        stats = {"entries": 0, "bytes": 0, "demoted": 0, "corrupt": 0, "markers": 0}
        recent = []
        for e in self.ns.iter_entries():
            with contextlib.suppress(FileNotFoundError):
                recent.append((e.stat(follow_symlinks=False).st_mtime_ns, e.name[: -len(disk.ENTRY_SUFFIX)]))
        recent.sort(reverse=True)
        for _, key_hex in recent[:max_entries]:
            if self._preload_stop.is_set() or stats["bytes"] >= max_bytes:
                break
            cg = self._preload_one(key_hex, stats)
            if cg is None:
                continue
            size = int(getattr(cg, "memory_size_bytes", 0))
            if stats["bytes"] + size > max_bytes:
                continue
            with self._count_lock:
                self._preloaded[key_hex] = cg
            stats["entries"] += 1
            stats["bytes"] += size
        stats["wall_s"] = time.perf_counter() - t0
        stats["cpu_s"] = time.thread_time() - cpu0
        with self._count_lock:
            self._preload_until = time.monotonic() + PRELOAD_KEEP_S
            # lookups may have taken entries while it ran: their count stays
            self.preload_stats = {**stats, "used": self.preload_stats.get("used", 0), "dropped": 0}
        gm.preloaded("loaded", stats["entries"])
        if stats["entries"] or stats["corrupt"] or stats["demoted"]:
            logger.info(
                "dspark-harden: preloaded %d grammar(s) (%.1f MB) from %s in %.2f s (%.2f CPU-s); "
                "%d demoted, %d corrupt moved to quarantine",
                stats["entries"],
                stats["bytes"] / 1e6,
                self.ns.path,
                stats["wall_s"],
                stats["cpu_s"],
                stats["demoted"],
                stats["corrupt"],
            )
        if self._preload_stop.is_set():
            self._drop_preloaded()
        return self.preload_stats

    def _preload_one(self, key_hex: str, stats: dict):
        cpu0, data = time.thread_time(), None
        try:
            got = self.ns.read(key_hex, limit=self._entry_limit, touch=False)
            if got is None:
                return None
            path, data = got
            entry = disk.decode_entry(path, data, self.ns.scope_hex, key_hex)
            if entry.kind == disk.KIND_MARKER:
                stats["markers"] += 1
                return None
            cg = self._deserialize(path, entry)
        except disk.CorruptEntryError as exc:  # invalid, or a link or other non-regular file (data None)
            stats["corrupt"] += 1
            with contextlib.suppress(disk.GrammarCacheError):
                self._heal(exc, key_hex, data, time.perf_counter(), {})
            return None
        except (disk.GrammarCacheError, OSError):  # oversized here, or unreadable: a lookup decides
            return None
        stats["demoted"] += self._demote_if_slow(key_hex, data, entry, time.thread_time() - cpu0)
        return cg

    def _take_preloaded(self, key_hex: str):
        with self._count_lock:
            if not self._preloaded:
                return None
            until = self._preload_until
            if until is None or time.monotonic() < until:
                cg = self._preloaded.pop(key_hex, None)
                if cg is not None:
                    self.preload_stats["used"] = self.preload_stats.get("used", 0) + 1
                    gm.preloaded("used")
                return cg
        self._drop_preloaded()
        return None

    def _drop_preloaded(self) -> None:
        with self._count_lock:
            n, self._preloaded = len(self._preloaded), {}
            if n:
                self.preload_stats["dropped"] = self.preload_stats.get("dropped", 0) + n
        if n:
            gm.preloaded("dropped", n)

    def _clean_claims(self) -> None:
        try:
            done = claim_mod.clean(self.ns)
        except OSError as exc:
            logger.warning("dspark-harden: cleaning grammar cache claims in %s failed: %s", self.ns.claims, exc)
            return
        if done["invalid"]:
            logger.warning(
                "dspark-harden: %d grammar cache claim(s) in %s cannot be trusted (another uid, "
                "writable by others, a link or not a claim); they are ignored",
                done["invalid"],
                self.ns.claims,
            )

    # -- xgrammar GrammarCompiler surface --------------------------------------------------
    def compile_json_schema(self, schema: Any, **kwargs: Any):
        if isinstance(schema, dict):
            schema_text = json.dumps(schema)
        elif isinstance(schema, str):
            schema_text = schema
        else:  # pydantic model classes: not cacheable by text
            return self._native(lambda: self.inner.compile_json_schema(schema, **kwargs))
        return self._get(
            ["json_schema", schema_text, _kw(kwargs)], lambda: self.inner.compile_json_schema(schema, **kwargs)
        )

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
        self.persister.flush()

    def _count(self) -> None:
        with self._count_lock:
            self.native_compiles += 1

    def _compile(self, fn: Callable[[], Any]):
        with self.slots:
            self._count()
            return fn()

    def _cold_timing(self) -> bool:
        """Whether a compile just measured here was cold: no xgrammar cache could have served part of
        it. With the cache on, a compile of a schema like earlier ones takes a fraction of its cold
        time; the persistence helper's store-or-marker decision must not take that for the grammar's
        compile cost (it would store markers for grammars that load far faster than they compile in a
        restarted, cache-cold process), so the job says so and the helper decides on its own cold
        compile. Off (0) and the cache still empty: cold."""
        if self.inner_cache_bytes > 0:
            return False
        size = getattr(self.inner, "get_cache_size_bytes", None)
        try:
            return size is None or int(size()) == 0  # an unbounded cache given to us: not cold once used
        except Exception:  # noqa: BLE001 - a stand-in compiler without it: as before, cold
            return True

    def _native(self, fn: Callable[[], Any]):
        t = time.perf_counter()
        cg = self._compile(fn)
        dt = time.perf_counter() - t
        _record(Resolution("compile", dt, phases={"native_compile": dt}))
        return cg

    @property
    def _entry_limit(self) -> int:
        """The largest entry file this server reads: its DISK_MAX_ENTRY_BYTES payload and the envelope."""
        return self.policy.max_entry_bytes + disk.HEADER_SIZE + disk.TRAILER_SIZE

    def _read(self, key_hex: str, t0: float) -> tuple[Optional[tuple], Optional[str]]:
        """(entry, None), (None, None) when absent, or (None, source) when the entry is not read:
        ``oversized`` (larger than this server's entry limit: written by a server with a larger one)
        or ``compile`` after an I/O error (the disk cache is an optimisation: compile instead)."""
        try:
            return self.ns.read(key_hex, limit=self._entry_limit), None
        except disk.EntryTooLarge as exc:
            self._warn_once(("oversized", key_hex), "dspark-harden: %s", exc)
            return None, "oversized"
        except disk.CorruptEntryError as exc:  # a symbolic link or other non-regular file
            self._heal(exc, key_hex, None, t0, {})
            return None, None  # moved aside: absent now
        except OSError as exc:
            gm.inc_disk_error("read")
            self._warn_once(
                ("read", type(exc).__name__, exc.errno),
                "dspark-harden: reading grammar cache entry %s failed (%s); compiling locally",
                self.ns.entry_path(key_hex),
                exc,
            )
            return None, "compile"

    def _warn_once(self, what: tuple, msg: str, *args: Any) -> None:
        with self._count_lock:
            if what in self._warned:
                return
            if len(self._warned) < 1024:
                self._warned.add(what)
        logger.warning(msg, *args)

    def _get(self, parts: list, fn: Callable[[], Any]):
        key_hex = disk.key_digest(parts)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        cg = self._take_preloaded(key_hex)
        if cg is not None:
            self.ns.touch(key_hex)  # used: the disk cache's LRU order, as a read does
            dt = time.perf_counter() - t0
            _record(Resolution("disk", dt, {"preloaded": dt}, self.ns.entry_path(key_hex), key_hex))
            return cg
        got, skipped = self._read(key_hex, t0)
        if got is not None:
            return self._from_entry(key_hex, parts, got, fn, t0, cpu0=cpu0)
        if skipped is not None:
            tc = time.perf_counter()
            cg = self._compile(fn)
            compile_s = time.perf_counter() - tc
            _record(
                Resolution(
                    skipped,
                    time.perf_counter() - t0,
                    {"native_compile": compile_s},
                    self.ns.entry_path(key_hex),
                    key_hex,
                )
            )
            return cg
        mine, got, waited = self._claim(key_hex, t0)
        if got is not None:
            return self._from_entry(key_hex, parts, got, fn, t0, {"claim_wait": waited})
        tc = time.perf_counter()
        try:
            cg = self._compile(fn)
        except BaseException:
            if mine is not None:  # nothing will be published: its waiters must not wait for it
                claim_mod.remove_if(self.ns, mine)
            raise
        compile_s = time.perf_counter() - tc
        if mine is not None and not self._handoff_pays(cg, compile_s):
            # handing this key to another process costs more than its compile: each process compiles it,
            # nobody waits for it (a waiter sees the claim go and compiles at once)
            claim_mod.remove_if(self.ns, mine)
            self._claim_outcome("local")
            mine = None
        # a claimed key is published at once (a peer is waiting for it); submit never blocks (a full
        # queue or a spent helper budget skips)
        if mine is not None or not self._defer(key_hex, parts, compile_s):
            self.persister.submit(key_hex, parts, compile_s, claim=mine, cold=self._cold_timing())
        total = time.perf_counter() - t0
        phases = {"native_compile": compile_s}
        if waited:
            phases["claim_wait"] = waited
        _record(Resolution("compile", total, phases, self.ns.entry_path(key_hex), key_hex))
        return cg

    def _handoff_pays(self, cg: Any, compile_s: float) -> bool:
        """Whether peers should wait for this key's publication instead of compiling it (issue 40 item 4,
        the seed's adaptive policy applied per key to claims): its predicted handoff -- serialize,
        durable write, read and deserialize, scaled from this process's measured publications by the
        grammar's memory size -- within ``load_ratio`` x the compile just measured (the ratio the
        helper applies to store a serialized entry rather than a compile-locally marker)."""
        try:
            mem = int(cg.memory_size_bytes)
        except Exception:  # noqa: BLE001 - no size: judge by the write alone
            mem = 0
        return self.persister.handoff_estimate(mem) <= compile_s * self.policy.load_ratio

    def _defer(self, key_hex: str, parts: list, compile_s: float) -> bool:
        """Keep a cheap key's publication for its second use (True), or say it is published now (False):
        a restart reads back what was used more than once, or what was expensive to compile; a key seen
        once (a new schema per request, a tool set that changes every call) costs the helper nothing."""
        if compile_s >= self.persist_min_compile_s:
            return False
        size = sum(len(p) if isinstance(p, str) else 64 for p in parts)
        if size > DEFERRED_MAX_KEY_BYTES:
            return False
        with self._count_lock:
            old = self._deferred.pop(key_hex, None)
            if old is not None:
                self._deferred_bytes -= old[3]
            self._deferred[key_hex] = (parts, compile_s, self._cold_timing(), size)
            self._deferred_bytes += size
            while self._deferred and (len(self._deferred) > DEFERRED_KEPT or self._deferred_bytes > DEFERRED_MAX_BYTES):
                _, dropped = self._deferred.popitem(last=False)
                self._deferred_bytes -= dropped[3]
        gm.inc_deferred("deferred")
        return True

    def persist_on_reuse(self, key_hex: str) -> bool:
        """The grammar service saw ``key_hex`` used again: publish it if its first compile deferred it."""
        with self._count_lock:
            got = self._deferred.pop(key_hex, None)
            if got is None:
                return False
            self._deferred_bytes -= got[3]
            self.deferred_published += 1
        parts, compile_s, cold, _ = got
        gm.inc_deferred("published_on_reuse")
        return self.persister.submit(key_hex, parts, compile_s, cold=cold)

    def _claim_outcome(self, outcome: str, waited_s: Optional[float] = None) -> None:
        with self._count_lock:
            self.claim_outcomes[outcome] += 1
        if waited_s is not None:
            self.claim_waits.append((outcome, waited_s))
        gm.claim(outcome)

    def _claim(self, key_hex: str, t0: float) -> tuple[Optional[claim_mod.Claim], Optional[tuple], float]:
        """(this process's claim, None, waited) when it should compile the absent key — with the
        claim when it took one; (None, entry, waited) when another process's claim ended in a
        published entry, read here. Bounded: every round claims, loads, or finds the claimant
        gone or the bound passed."""
        waited = 0.0
        if not self.claims_enabled:
            return None, None, waited
        deadline = getattr(_TLS, "deadline", None)
        for _ in range(4):
            try:
                mine = claim_mod.create(self.ns, key_hex, self.persister.publish_estimate())
            except (disk.GrammarCacheError, OSError) as exc:
                self._claim_outcome("error")
                self._warn_once(
                    ("claim", type(exc).__name__),
                    "dspark-harden: creating grammar cache claim %s failed (%s); compiling without one",
                    claim_mod.claim_path(self.ns, key_hex),
                    exc,
                )
                return None, None, waited
            if mine is not None:
                # double-check: another process may have published the entry and released its claim
                # between this process's disk miss and its claim (a late peer would compile it again)
                got, _ = self._read(key_hex, t0)
                if got is not None:
                    claim_mod.remove_if(self.ns, mine)
                    self._claim_outcome("hit", 0.0)
                    return None, got, waited
                self._claim_outcome("claimed")
                return mine, None, waited
            try:
                other = claim_mod.read(self.ns, key_hex)
            except claim_mod.InvalidClaim as exc:
                self._claim_outcome("invalid")
                self._warn_once(("invalid-claim", exc.path, exc.reason), "dspark-harden: %s", exc)
                return None, None, waited
            except OSError:
                self._claim_outcome("error")
                return None, None, waited
            if other is None:  # released between our attempt and the read
                got, _ = self._read(key_hex, t0)
                if got is not None:
                    return None, got, waited
                continue  # try to claim it again
            if not claim_mod.alive(other):
                claim_mod.remove_if(self.ns, other)
                self._claim_outcome("claimant_dead", 0.0)
                continue
            now = time.monotonic()
            end = now + claim_mod.bound_s(other, self.persist_settings.claim_wait_s)
            if deadline is not None:  # leave the request half of what is left of it to compile itself
                end = min(end, now + max(0.0, deadline - now) / 2)
            tw = time.perf_counter()
            outcome = claim_mod.wait(self.ns, key_hex, other, end)
            dt = time.perf_counter() - tw
            waited += dt
            if outcome == "entry":
                got, _ = self._read(key_hex, t0)
                self._claim_outcome("hit", dt)
                return None, got, waited  # None (oversized, read error): compile
            if outcome == "dead":
                claim_mod.remove_if(self.ns, other)
                self._claim_outcome("claimant_dead", dt)
                continue
            if outcome == "released":  # the claimant judged the key cheaper to compile than to hand off
                self._claim_outcome("released", dt)  # (or its compile failed): compile at once, claim nothing
                return None, None, waited
            self._claim_outcome("expired", dt)
            return None, None, waited
        return None, None, waited

    def _from_entry(
        self,
        key_hex: str,
        parts: list,
        got: tuple,
        fn: Callable[[], Any],
        t0: float,
        phases: Optional[dict] = None,
        cpu0: Optional[float] = None,
    ):
        """Serve a read entry. ``cpu0``: this thread's CPU time before the read (None after a claim wait:
        not judged for demotion)."""
        path, data = got
        phases = dict(phases or {})
        phases["disk_read"] = time.perf_counter() - t0 - phases.get("claim_wait", 0.0)
        tv = time.perf_counter()
        try:
            entry = disk.decode_entry(path, data, self.ns.scope_hex, key_hex)
        except disk.CorruptEntryError as exc:
            return self._heal_and_compile(exc, key_hex, parts, data, fn, t0, phases)
        phases["verify"] = time.perf_counter() - tv
        if entry.kind == disk.KIND_MARKER:
            with self._count_lock:
                self.marker_compiles += 1
            tc = time.perf_counter()
            cg = self._compile(fn)
            phases["native_compile"] = time.perf_counter() - tc
            _record(Resolution("local_compile", time.perf_counter() - t0, phases, path, key_hex))
            return cg
        td = time.perf_counter()
        try:
            cg = self._deserialize(path, entry)
        except disk.CorruptEntryError as bad:
            return self._heal_and_compile(bad, key_hex, parts, data, fn, t0, phases)
        phases["deserialize"] = time.perf_counter() - td
        if cpu0 is not None:
            self._demote_if_slow(key_hex, data, entry, time.thread_time() - cpu0)
        _record(Resolution("disk", time.perf_counter() - t0, phases, path, key_hex))
        return cg

    def _deserialize(self, path: str, entry: disk.Entry):
        from xgrammar import CompiledGrammar

        try:
            return CompiledGrammar.deserialize_json(entry.payload.decode("utf-8"), self.tokenizer_info)
        except Exception as exc:  # noqa: BLE001 - any rejection is a corrupt entry
            raise disk.CorruptEntryError(
                path, f"xgrammar rejected the serialized grammar: {type(exc).__name__}: {exc}"
            ) from None

    def _demote_if_slow(self, key_hex: str, data: bytes, entry: disk.Entry, load_cpu: float) -> bool:
        """The helper's trial load ran in a small warm process; when this one's load (read, checksum,
        deserialize) cost more than the cold compile the entry replaces (issue 40 item 5), the next restart
        compiles it instead. Judged on this thread's CPU time (all of it single-threaded), not on waiting
        for a core on a busy host."""
        if 0 < entry.compile_s < load_cpu:
            self.persister.demote(key_hex, data, entry.compile_s, load_cpu)
            return True
        return False

    def _heal(self, exc: disk.CorruptEntryError, key_hex: str, data: Optional[bytes], t0: float, phases: dict):
        """A corrupt entry was met: move it to the namespace's quarantine (kept, never deleted; ERROR, counted)
        so later lookups compile and republish instead of failing on it forever. Raises ``exc`` (the request
        fails naming the file) when it cannot be moved; returns quietly when a peer already moved or
        replaced it."""
        gm.inc_corrupt()
        try:
            dest = self.ns.quarantine_entry(exc.path, expect=data)
        except (disk.GrammarCacheError, OSError) as err:
            _record(Resolution("corrupt", time.perf_counter() - t0, phases, exc.path, key_hex))
            logger.error("dspark-harden: %s; moving it to quarantine failed (%s): this request fails", exc, err)
            raise disk.CorruptEntryError(exc.path, f"{exc.reason}; moving it to quarantine failed: {err}") from None
        if not dest:
            where = "already moved aside or replaced by a peer"
        elif dest.startswith(disk.QUARANTINE_FULL):
            where = dest  # removed, not kept, and why
        else:
            where = f"moved to {dest}"
        logger.error("dspark-harden: %s -- %s; the grammar is compiled afresh and republished", exc, where)

    def _heal_and_compile(
        self, exc, key_hex: str, parts: list, data: bytes, fn: Callable[[], Any], t0: float, phases: dict
    ):
        """The request that met a corrupt entry is served by a fresh compile once the entry is moved aside
        (never compiled over it, never served from it); the compile is published like any miss."""
        self._heal(exc, key_hex, data, t0, phases)
        tc = time.perf_counter()
        cg = self._compile(fn)
        phases = {**phases, "native_compile": time.perf_counter() - tc}
        self.persister.submit(key_hex, parts, phases["native_compile"], claim=None, cold=self._cold_timing())
        _record(Resolution("corrupt", time.perf_counter() - t0, phases, exc.path, key_hex))
        return cg


def _kw(kwargs: dict) -> dict:
    out = {}
    for k, v in sorted(kwargs.items()):
        out[k] = list(v) if isinstance(v, tuple) else v
    return out
