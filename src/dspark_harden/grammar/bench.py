"""``dspark-harden bench grammar``: stock XGrammarGrammarBackend vs the grammar service, same run.

1. A burst of concurrent JSON-schema requests (every schema of :data:`schemas.BENCH_SCHEMAS` in
   four spellings — compact, pretty, trailing newline, keywords reordered — each ``--duplicates``
   times) goes through a stock ``XGrammarGrammarBackend`` exactly as the scheduler issues it (every
   lookup before any result is cached). ``stock_compiles`` counts its compile dispatches.
2. The same burst through a patched backend (grammar service + empty disk cache):
   ``harden_compiles`` counts native xgrammar compiles; ``cold_s`` is the time to resolve it.
3. Simulated restart: three fresh processes share the now-populated disk cache. One resolves the
   burst alone (``warm_s``: the same work as ``cold_s``, so ``cold_over_warm`` compares like with
   like); then the other two resolve it at the same moment (a DP2 restart) and
   ``warm_restart_s`` is the slower one's time. Each waits for its preload of the populated cache
   (``DSPARK_HARDEN_GRAMMAR_DISK_PRELOAD``) before its burst, and reports it. ``phases`` breaks each burst down by phase
   (thread-seconds summed over compile tasks) and the solo process's start-up (spawn, imports,
   tokenizer, patches, backend incl. the service's own start-up steps).
4. Per schema, once both bursts are done, one restarted process alternates REPEATS times between
   a native compile (plain xgrammar compiler, no cache: ``compile_s``) and a resolution through
   the persistent cache (read + verify + deserialize, or marker + compile: ``warm_s``), medians
   of each; ``stored`` says what the disk holds (serialized grammar or compile-locally marker).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from typing import Any

from . import schemas as S

REPEATS = 5


def _r(x: float | None, nd: int = 5) -> float | None:
    return None if x is None else round(x, nd)


def _burst(duplicates: int) -> list[tuple[str, str]]:
    out = []
    for _ in range(duplicates):
        for name, schema in S.BENCH_SCHEMAS:
            for text in S.variants(schema):
                out.append((name, text))
    return out


def _load_tokenizer(vocab: int):
    from transformers import AutoTokenizer

    from ..devtools.tiny_models import ensure_tokenizer

    return AutoTokenizer.from_pretrained(ensure_tokenizer(vocab))


def _backend(tok):
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    return XGrammarGrammarBackend(tok, vocab_size=len(tok), model_eos_token_ids=[tok.eos_token_id])


def _resolve_burst(backend, burst, cpu: list | None = None) -> float:
    """Wall seconds to resolve ``burst``; with ``cpu`` (a list), this process's CPU seconds over the
    same span (every thread: compile workers, xgrammar's own threads) are appended to it -- the
    figure the other users of a shared machine disturb least."""
    c = time.process_time()
    t = time.perf_counter()
    pending = [backend.get_cached_or_future_value(("json", text), False) for _, text in burst]
    for value, hit in pending:
        if not hit:
            value = value.result()
        if value is None or type(value).__name__ == "InvalidGrammarObject":
            raise RuntimeError(f"bench schema failed to compile: {value!r}")
    wall = time.perf_counter() - t
    if cpu is not None:
        cpu.append(time.process_time() - c)
    return wall


def _per_schema(backend) -> dict:
    """Per schema, interleaved in one process: native compile (a plain xgrammar compiler, no
    cache) vs resolution through the persistent cache (read + verify + deserialize, or read the
    marker + compile). Medians of REPEATS alternating runs, so both see the same machine load."""
    from xgrammar import GrammarCompiler

    from . import xgr
    from .canonical import canonical_string

    plain = GrammarCompiler(
        backend._tokenizer_info, max_threads=backend.grammar_compiler.inner_threads, cache_enabled=False
    )
    kw = {"any_whitespace": backend.any_whitespace, "max_whitespace_cnt": backend.max_whitespace_cnt}
    out = {}
    for name, schema in S.BENCH_SCHEMAS:
        text = canonical_string("json", json.dumps(schema))
        comp, warm, check = [], [], []
        for _ in range(REPEATS):
            t = time.perf_counter()
            cg = plain.compile_json_schema(text, **kw)
            comp.append(time.perf_counter() - t)
            # the service's empty-language check, as it runs on every resolved grammar
            obj = types.SimpleNamespace(ctx=cg, vocab_size=backend.vocab_size, matcher=True, override_stop_tokens=None)
            t = time.perf_counter()
            xgr.empty_language_problem("json", obj)
            check.append(time.perf_counter() - t)
            xgr.take_resolution()
            backend.grammar_compiler.compile_json_schema(text, **kw)
            res = xgr.take_resolution()
            warm.append(res.seconds)
        out[name] = {
            "compile_s": statistics.median(comp),
            "warm_s": statistics.median(warm),
            "source": res.source,
            "empty_check_s": statistics.median(check),
            "memory_bytes": int(cg.memory_size_bytes),
        }
    return out


def _patches(cache_dir: str, claims: bool = False):
    from ..core.manager import feature_patches, feature_settings, make_manager
    from ..core.patch import Role
    from . import settings as F

    env = {k: v for k, v in os.environ.items() if k.startswith("DSPARK_HARDEN_GRAMMAR")}
    env[F.DISK_DIR] = cache_dir
    env[F.DISK] = "1"
    if claims:  # --processes measures the host-wide claims (opt-in on a server)
        env[F.DISK_CLAIMS] = "1"
    pm = make_manager(load_extensions=False)
    settings = feature_settings(pm, F.FEATURE, environ=env)
    return feature_patches(pm, F.FEATURE, Role.SCHEDULER, settings)


def _run_children(procs: list, q: Any, *, what: str, wait_s: float, join_s: float) -> dict:
    """Start ``procs``, collect one result dict per child from ``q`` (``{"idx": ..., ...}``) for at
    most ``wait_s`` (stopping early when a child exits non-zero), join each for ``join_s`` and kill
    what is left; raises naming ``what`` when a child reported an error or none arrived."""
    for p in procs:
        p.start()
    results: dict = {}
    deadline = time.monotonic() + wait_s
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            r = q.get(timeout=5)
        except Exception:  # noqa: BLE001 - queue.Empty
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            continue
        results[r["idx"]] = r
    for p in procs:
        p.join(timeout=join_s)
        if p.is_alive():
            p.kill()
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors or len(results) < len(procs):
        raise RuntimeError(f"{what} failed: {errors or 'no result'}")
    return results


def _startup_phases(t_spawn: float, t_entry: float, marks: list, backend) -> dict:
    """Seconds of a restarted process's start-up, in order: ``process_start`` (spawn to the child's
    first line: interpreter, unpickling), then each of ``marks`` [(name, monotonic end)], then the
    service's own start-up phases (of ``backend``) split out of ``backend_init``."""
    out = {"process_start": t_entry - t_spawn}
    prev = t_entry
    for name, t in marks:
        out[name] = t - prev
        prev = t
    ours = dict(getattr(backend, "_dspark_grammar_init_s", {}))
    if "backend_init" in out:  # stock's part: TokenizerInfo.from_huggingface and its GrammarCompiler
        out["backend_init_stock"] = out.pop("backend_init") - sum(ours.values())
    out.update({f"backend_init_{k}": v for k, v in ours.items()})
    return {k: round(v, 4) for k, v in out.items()}


class _timed_tokenizer_info:
    """Times ``xgrammar.TokenizerInfo.from_huggingface`` (what stock's XGrammarGrammarBackend builds its
    tokenizer info with) while the block runs, in this bench process only; restored on exit."""

    def __enter__(self) -> dict:
        from xgrammar import TokenizerInfo

        self._cls, self._orig, out = TokenizerInfo, TokenizerInfo.__dict__["from_huggingface"], {"s": 0.0}
        fn = self._orig.__func__

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                out["s"] += time.perf_counter() - t

        TokenizerInfo.from_huggingface = staticmethod(timed)
        return out

    def __exit__(self, *exc) -> None:
        self._cls.from_huggingface = self._orig


def _restart_child(idx: int, vocab: int, cache_dir: str, duplicates: int, barrier, out_q, t_spawn: float = 0.0) -> None:
    """A restarted scheduler-shaped process. Process 0 resolves the burst alone (``warm_s``), then
    processes 1 and 2 resolve it at the same moment (a DP2 restart: ``warm_restart_s``); then process
    0 measures per schema while the other two wait."""
    t_entry = time.monotonic()
    try:
        marks = []
        import sglang.srt.constrained.xgrammar_backend  # noqa: F401 - timed: SGLang, torch, xgrammar

        marks.append(("imports", time.monotonic()))
        tok = _load_tokenizer(vocab)
        marks.append(("tokenizer_load", time.monotonic()))
        patches = _patches(cache_dir)
        for p in patches:
            p.apply()
        marks.append(("patches", time.monotonic()))
        with _timed_tokenizer_info() as tinfo:  # stock's TokenizerInfo construction, inside its init
            backend = _backend(tok)
        marks.append(("backend_init", time.monotonic()))
        # the preload of the most recently used entries (DSPARK_HARDEN_GRAMMAR_DISK_PRELOAD), which a
        # server runs in the background while it finishes starting: waited for here, and reported
        backend.grammar_compiler.wait_preload()
        marks.append(("preload", time.monotonic()))
        startup = _startup_phases(t_spawn, t_entry, marks, backend)
        startup["backend_init_stock_tokenizer_info"] = round(tinfo["s"], 4)
        burst = _burst(duplicates)
        service = backend._dspark_grammar
        barrier.wait()  # everyone started
        burst_s, cpu = None, []
        if idx == 0:
            burst_s = _resolve_burst(backend, burst, cpu)
            backend.grammar_compiler.flush()  # its demotions (xgr.py) land before the pair starts
        barrier.wait()  # the solo burst is done
        if idx > 0:
            burst_s = _resolve_burst(backend, burst, cpu)
            backend.grammar_compiler.flush()
        barrier.wait()  # every burst done: measure per schema in isolation
        demoted = sum(
            o.get("status") == "published" and o.get("reason") == "slow_load_served"
            for o in backend.grammar_compiler.persister.outcomes.values()
        )
        phases = {k: round(v, 4) for k, v in sorted(service.phase_seconds.items())}
        sources = dict(service.sources)
        per = {}
        if idx == 0:
            per = _per_schema(backend)
        measured_at = time.monotonic()
        # processes 1 and 2 end only once process 0 has measured per schema: their ends (the interpreter's
        # and the persistence helper's teardown) took a core from that measurement, a single-threaded
        # load losing more of it than a two-thread compile (formats read 53-66 ms from disk against a
        # 52-58 ms compile while they ended, 25-29 ms once they waited)
        barrier.wait(timeout=600)
        out_q.put(
            {
                "idx": idx,
                "measured_at": measured_at,  # CLOCK_MONOTONIC: one clock for every process of the host
                "released_at": time.monotonic(),
                "burst_s": burst_s,
                "cpu_s": cpu[0],
                "per": per,
                "startup_s": startup,
                "thread_s": phases,
                "sources": sources,
                "native_compiles": backend.grammar_compiler.native_compiles,
                "demoted": demoted,
                "preload": {k: _r(v, 4) for k, v in backend.grammar_compiler.preload_stats.items()},
            }
        )
    except BaseException as exc:  # noqa: BLE001
        out_q.put({"idx": idx, "error": f"{type(exc).__name__}: {exc}"})
        barrier.abort()  # no sibling waits on a process that failed
        raise


def _rss_bytes() -> int:
    """This process's resident set size now (/proc/self/statm)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssPeak:
    """Peak resident set size of this process while the block runs (sampled every 5 ms from
    /proc/self/statm; getrusage's ru_maxrss is a lifetime peak and cannot separate two phases)."""

    def __init__(self):
        import threading

        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _rss(self) -> int:
        return _rss_bytes()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            self._stop.wait(0.005)

    def __enter__(self) -> "_RssPeak":
        self.peak = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


def run(vocab: int = 32000, duplicates: int = 2, cache_dir: str | None = None, log=print) -> dict:
    own_dir = cache_dir is None
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="dspark-grammar-bench-")
    try:
        return _run(vocab, duplicates, cache_dir, log)
    finally:
        if own_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)


def count_compiles(backend) -> dict:
    """Count a grammar backend's ``_init_value_dispatch`` calls (one per compile it starts) in the
    returned dict's ``"n"`` (an instance attribute wraps the bound method; nothing else changes)."""
    calls = {"n": 0}
    dispatch = backend._init_value_dispatch

    def counting(key, require_reasoning):
        calls["n"] += 1
        return dispatch(key, require_reasoning)

    backend._init_value_dispatch = counting
    return calls


def _run(vocab: int, duplicates: int, cache_dir: str, log) -> dict:
    tok = _load_tokenizer(vocab)
    burst = _burst(duplicates)
    log(f"burst: {len(burst)} requests over {len(S.BENCH_SCHEMAS)} schemas, vocab {len(tok)}")

    # 1. stock
    stock = _backend(tok)
    calls = count_compiles(stock)
    with _RssPeak() as stock_rss:
        stock_s = _resolve_burst(stock, burst)
    stock_compiles = calls["n"]
    log(f"stock: {stock_compiles} compiles, {stock_s:.3f} s")

    stock.executor.shutdown(wait=True)
    del stock

    # 2. ours, cold disk cache
    patches = _patches(cache_dir)
    for p in patches:
        p.apply()
    try:
        ours = _backend(tok)
        with _RssPeak() as harden_rss:  # the burst and all of its persistence
            cold_cpu: list = []
            cold_s = _resolve_burst(ours, burst, cold_cpu)
            harden_compiles = ours.grammar_compiler.native_compiles
            ours.grammar_compiler.flush()
        cold_thread_s, cold_sources = dict(ours._dspark_grammar.phase_seconds), dict(ours._dspark_grammar.sources)
        outcomes = list(ours.grammar_compiler.persister.outcomes.values())
        ratios = [o["ratio"] for o in outcomes if o.get("ratio")]
        markers: dict = {}
        for o in outcomes:
            if o.get("stored") == "marker":
                markers[o.get("reason") or "unknown"] = markers.get(o.get("reason") or "unknown", 0) + 1
        ns = ours.grammar_compiler.ns
        from .canonical import canonical_string
        from .disk import KIND_SERIALIZED, decode_entry, key_digest

        stored, facts, keys = {}, {}, {}
        helper_outcomes = ours.grammar_compiler.persister.outcomes
        for name, schema in S.BENCH_SCHEMAS:
            canon = canonical_string("json", json.dumps(schema))
            parts = [
                "json_schema",
                canon,
                {"any_whitespace": ours.any_whitespace, "max_whitespace_cnt": ours.max_whitespace_cnt},
            ]
            key_hex = keys[name] = key_digest(parts)
            got = ns.read(key_hex)
            if got is None:
                stored[name] = "missing"
            else:
                entry = decode_entry(got[0], got[1], ns.scope_hex, None)
                stored[name] = "serialized" if entry.kind == KIND_SERIALIZED else "marker"
            # what the persistence helper measured to decide (the disk-cache policy's inputs)
            o = helper_outcomes.get(key_hex, {})
            ph = o.get("phases", {})
            facts[name] = {
                "entry_bytes": len(got[1]) if got is not None else 0,
                "serialized_bytes": o.get("serialized_bytes"),
                "reason": o.get("reason") or None,
                "helper_compile_s": _r(ph.get("measure_compile")),
                "serialize_s": _r(ph.get("serialize")),
                "trial_load_s": _r(ph.get("measure_load")),
                # the compile time the decision used (always a cold one: docs/grammar.md) and whose
                "decision_compile_s": _r(o.get("decision_compile_s")),
                "decision_basis": o.get("decision_basis"),
            }
        ours._dspark_grammar.shutdown()
        ours.grammar_compiler.close()
    finally:
        for p in reversed(patches):
            p.revert()
    log(f"harden cold: {harden_compiles} compiles, {cold_s:.3f} s; stored {stored}")

    cold_phases = {k: round(v, 4) for k, v in sorted(cold_thread_s.items())}

    # 3. restart: three fresh processes share the disk cache; process 0 resolves the burst alone
    # (warm_s: the same work as cold_s), then processes 1 and 2 at once (a DP2 restart)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(3)
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_restart_child, args=(i, vocab, cache_dir, duplicates, barrier, q, time.monotonic()))
        for i in range(3)
    ]
    results = _run_children(procs, q, what="restart processes", wait_s=900, join_s=30)
    warm_s = results[0]["burst_s"]
    warm_restart_s = max(results[i]["burst_s"] for i in (1, 2))
    per = results[0]["per"]
    # whether processes 1 and 2 were still waiting (not ending) when process 0 finished measuring
    per_schema_alone = all(results[i]["released_at"] >= results[0]["measured_at"] for i in (1, 2))
    # serialized entries a restarted process loaded slower than the compile recorded in them, replaced
    # by slow_load_served markers (xgr.py): what the disk holds once every restart is done
    demoted = {}
    for name, key_hex in keys.items():
        got = ns.read(key_hex)
        marker = decode_entry(got[0], got[1], ns.scope_hex, key_hex).marker if got is not None else None
        demoted[name] = marker is not None and marker.reason == "slow_load_served"
    log(
        f"restart: alone {warm_s:.3f} s, pair {[round(results[i]['burst_s'], 3) for i in (1, 2)]} s, "
        f"native compiles {[results[i]['native_compiles'] for i in range(3)]}"
    )

    return {
        "vocab": len(tok),
        "requests": len(burst),
        "distinct_schemas": len(S.BENCH_SCHEMAS),
        "stock_compiles": stock_compiles,
        "harden_compiles": harden_compiles,
        "cold_s": round(cold_s, 4),
        # one restarted process, the same burst as cold_s, alone on the machine
        "warm_s": round(warm_s, 4),
        "cold_over_warm": round(cold_s / warm_s, 2),
        # as if every request had arrived when the backend was built and waited for the whole preload
        "cold_over_warm_with_preload": round(cold_s / (warm_s + results[0]["preload"].get("wall_s", 0.0)), 2),
        "cold_over_warm_cpu": round(cold_cpu[0] / results[0]["cpu_s"], 2),  # the serving process's CPU seconds
        # two restarted processes resolving the burst at the same moment (the slower one): twice
        # cold_s's work on the same cores
        "warm_restart_s": round(warm_restart_s, 4),
        "cold_over_warm_restart": round(cold_s / warm_restart_s, 2),
        # where the time goes. thread_s: seconds summed over compile tasks by phase (disk_read, verify,
        # deserialize, native_compile (markers, misses), empty_check, dispatch (SGLang's grammar object
        # around the compiler), copy (every request's private copy)); startup_s: a restarted process
        # from spawn to a ready backend (not in warm_s, the same for a cold start)
        "phases": {
            "cold": {
                "wall_s": round(cold_s, 4),
                "cpu_s": round(cold_cpu[0], 4),
                "thread_s": cold_phases,
                "sources": cold_sources,
            },
            "warm": {
                "wall_s": round(warm_s, 4),
                "cpu_s": round(results[0]["cpu_s"], 4),
                "thread_s": results[0]["thread_s"],
                "sources": results[0]["sources"],
                "startup_s": results[0]["startup_s"],
            },
            "warm_restart": [
                {
                    "wall_s": round(results[i]["burst_s"], 4),
                    "cpu_s": round(results[i]["cpu_s"], 4),
                    "thread_s": results[i]["thread_s"],
                    "sources": results[i]["sources"],
                }
                for i in (1, 2)
            ],
        },
        # the serving process (this one) during the plugin's cold burst incl. persistence, and stock's burst
        "peak_rss_bytes": harden_rss.peak,
        "stock_peak_rss_bytes": stock_rss.peak,
        "max_serialized_memory_ratio": round(max(ratios), 2) if ratios else None,
        "markers_by_reason": markers,
        # each restarted process's preload (solo, then the pair): entries, bytes, wall_s, cpu_s, used by
        # the burst, demoted, corrupt, markers skipped
        "preload": [results[i]["preload"] for i in range(3)],
        # demotions to slow_load_served markers by the solo restart's burst, by the pair's bursts, and
        # in all (the per-schema measurement's loads included)
        "demoted": {
            "warm": results[0]["demoted"],
            "warm_restart": results[1]["demoted"] + results[2]["demoted"],
            "total": sum(demoted.values()),
        },
        # true when processes 1 and 2 still waited while process 0 measured per schema (below)
        "per_schema_alone": per_schema_alone,
        # per schema: compile_s (native), warm_s (through the disk cache), both medians of REPEATS in a
        # restarted process; stored (the policy's decision) with the helper's measurements behind it;
        # memory_bytes (the compiled grammar's memory_size_bytes: what the LRU accounts); empty_check_s
        "per_schema": [
            {
                "name": name,
                "compile_s": round(per[name]["compile_s"], 5),
                "warm_s": round(per[name]["warm_s"], 5),
                "stored": stored[name],
                "demoted": demoted[name],
                "memory_bytes": per[name]["memory_bytes"],
                "empty_check_s": round(per[name]["empty_check_s"], 6),
                **facts[name],
            }
            for name, _ in S.BENCH_SCHEMAS
        ],
    }


def distinct_schema(i: int) -> str:
    """The i-th of an endless family of distinct, valid JSON schemas (6-12 typed properties)."""
    props = {
        f"field_{i}_{j}": (
            {"type": "string", "maxLength": 8 + j}
            if j % 3 == 0
            else {"type": "integer", "minimum": j}
            if j % 3 == 1
            else {"type": "array", "items": {"type": "number"}, "maxItems": 3}
        )
        for j in range(6 + i % 7)
    }
    return json.dumps({"title": f"s{i}", "type": "object", "properties": props, "required": list(props)[:3]})


def scheduler_backend(variant: str, vocab: int, env: dict, cache_dir: str):
    """A scheduler-shaped process's grammar backend: stock's ``XGrammarGrammarBackend``, or (``harden``)
    the same with the grammar service's patches applied in this process under ``env``."""
    tok = _load_tokenizer(vocab)
    if variant == "harden":
        os.environ.update(env)
        for p in _patches(cache_dir):
            p.apply()
    return _backend(tok)


def resolve_like_scheduler(backend, i: int, schema: str) -> float:
    """One JSON-schema request as a scheduler resolves it: lookup, wait, after a miss a copy put back
    (``set_cache``), then the request ends. Returns the lookup-to-grammar seconds; raises when the
    schema (the ``i``-th of the bench's family) did not compile."""
    key = ("json", schema)
    t = time.perf_counter()
    value, hit = backend.get_cached_or_future_value(key, False)
    grammar = value if hit else value.result()
    seconds = time.perf_counter() - t
    if grammar is None or type(grammar).__name__ == "InvalidGrammarObject":
        raise RuntimeError(f"schema {i} failed to compile: {grammar!r}")
    if not hit:
        backend.set_cache(key, grammar.copy())  # as the scheduler does
    return seconds


def _memory_child(variant: str, n: int, vocab: int, env: dict, cache_dir: str, out_q) -> None:
    """One process resolves ``n`` distinct schemas one at a time as the scheduler does (lookup,
    wait, private copy, then the request ends); RSS after every tenth (after ``gc.collect``)."""
    import gc

    try:
        backend = scheduler_backend(variant, vocab, env, cache_dir)
        gc.collect()
        points = [(0, _rss_bytes(), 0)]
        step = max(1, n // 10)
        per_schema = []  # seconds to resolve each new schema (lookup to result)
        t0 = time.perf_counter()
        for i in range(n):
            per_schema.append(resolve_like_scheduler(backend, i, distinct_schema(i)))
            if (i + 1) % step == 0 or i + 1 == n:
                gc.collect()
                service = getattr(backend, "_dspark_grammar", None)
                points.append((i + 1, _rss_bytes(), service.nbytes if service is not None else None))
        seconds = time.perf_counter() - t0
        compiler = getattr(backend.grammar_compiler, "inner", backend.grammar_compiler)
        xgr_cache = {"limit_bytes": int(compiler.cache_limit_bytes), "size_bytes": int(compiler.get_cache_size_bytes())}
        out_q.put(
            {
                "variant": variant,
                "points": points,
                "seconds": seconds,
                "per_schema_s": per_schema,
                "xgr_cache": xgr_cache,
            }
        )
    except BaseException as exc:  # noqa: BLE001
        out_q.put({"variant": variant, "error": f"{type(exc).__name__}: {exc}"})
        raise


def run_memory(n: int, vocab: int = 32000, cache_bytes: int | None = None, log=print) -> dict:
    """``bench grammar --distinct N``: the memory of a scheduler's grammar path after N distinct
    schemas, stock (its xgrammar compiler keeps every compiled grammar: ``cache_limit_bytes=-1``)
    vs the grammar service (LRU bounded by ``DSPARK_HARDEN_GRAMMAR_CACHE_BYTES``; ``cache_bytes``
    overrides it here), each in a fresh spawned process. RSS growth over the start in MiB."""
    from ..core.manager import feature_settings, make_manager
    from .settings import CACHE_BYTES, FEATURE

    env = {k: v for k, v in os.environ.items() if k.startswith("DSPARK_HARDEN_GRAMMAR")}
    if cache_bytes is not None:
        env[CACHE_BYTES] = str(cache_bytes)
    # the limit the service child will run with (the setting's own parsing and default)
    limit = feature_settings(make_manager(load_extensions=False), FEATURE, environ=env)[CACHE_BYTES]
    ctx = mp.get_context("spawn")
    out: dict = {"distinct_schemas": n, "vocab": vocab, "cache_bytes_limit": limit}
    cache_dir = tempfile.mkdtemp(prefix="dspark-grammar-memory-")
    try:
        for variant in ("stock", "harden"):
            q = ctx.Queue()
            proc = ctx.Process(target=_memory_child, args=(variant, n, vocab, env, cache_dir, q))
            proc.start()
            got = q.get(timeout=3600)
            proc.join(60)
            if "error" in got:
                raise RuntimeError(f"{variant}: {got['error']}")
            base = got["points"][0][1]
            mib = 2**20
            out[variant] = {
                "rss_growth_mib": [[i, round((r - base) / mib, 1)] for i, r, _ in got["points"]],
                "final_growth_mib": round((got["points"][-1][1] - base) / mib, 1),
                "seconds": round(got["seconds"], 2),
                # each new schema's resolution, ms: median, fastest, slowest, and the first (a cold compile)
                "per_schema_ms": {
                    "median": round(statistics.median(got["per_schema_s"]) * 1e3, 2),
                    "min": round(min(got["per_schema_s"]) * 1e3, 2),
                    "max": round(max(got["per_schema_s"]) * 1e3, 2),
                    "first": round(got["per_schema_s"][0] * 1e3, 2),
                },
                # the xgrammar compiler's own cache: limit (-1: unbounded or off) and what it holds at the end
                "xgr_cache": got["xgr_cache"],
            }
            if variant == "harden":
                out[variant]["accounted_mib"] = round(got["points"][-1][2] / mib, 1)
            log(
                f"{variant}: +{out[variant]['final_growth_mib']} MiB after {n} distinct schemas, "
                f"median {out[variant]['per_schema_ms']['median']} ms per schema"
            )
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return out


def _percentile(values: list, q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def _processes_child(idx: int, vocab: int, cache_dir: str, duplicates: int, barrier, out_q) -> None:
    """One scheduler-shaped process of ``bench grammar --processes N`` (real patches, real backend)."""
    try:
        tok = _load_tokenizer(vocab)
        for p in _patches(cache_dir, claims=True):
            p.apply()
        backend = _backend(tok)
        pc = backend.grammar_compiler
        # warm-up with a key of this process's own (not in the burst): xgrammar loaded, the persistence
        # helper started and the claim estimate measured -- a scheduler that has served for a while
        value, hit = backend.get_cached_or_future_value(("regex", f"warm-{idx}-{os.getpid()}-[a-z]{{1,4}}"), False)
        if not hit:
            value.result()
        pc.flush()
        base_compiles, base_claims, base_waits = pc.native_compiles, dict(pc.claim_outcomes), len(pc.claim_waits)
        base_markers = pc.marker_compiles
        burst = _burst(duplicates)
        barrier.wait()
        burst_s = _resolve_burst(backend, burst)
        compiles = pc.native_compiles - base_compiles
        markers = pc.marker_compiles - base_markers
        pc.flush()
        barrier.wait()  # every burst done: measure compile times alone
        compile_s = {}
        if idx == 0:
            from xgrammar import GrammarCompiler

            from .canonical import canonical_string

            plain = GrammarCompiler(backend._tokenizer_info, max_threads=pc.inner_threads, cache_enabled=False)
            kw = {"any_whitespace": backend.any_whitespace, "max_whitespace_cnt": backend.max_whitespace_cnt}
            for name, schema in S.BENCH_SCHEMAS:
                text = canonical_string("json", json.dumps(schema))
                runs = []
                for _ in range(3):
                    t = time.perf_counter()
                    plain.compile_json_schema(text, **kw)
                    runs.append(time.perf_counter() - t)
                compile_s[name] = statistics.median(runs)
        out_q.put(
            {
                "idx": idx,
                "burst_s": burst_s,
                "native_compiles": compiles,
                "marker_compiles": markers,
                "requests": len(burst),
                "claims": {k: v - base_claims.get(k, 0) for k, v in pc.claim_outcomes.items()},
                "waits": list(pc.claim_waits)[base_waits:],
                "compile_s": compile_s,
                "estimate_s": pc.persister.publish_estimate(),
            }
        )
        pc.close()
    except BaseException as exc:  # noqa: BLE001
        out_q.put({"idx": idx, "error": f"{type(exc).__name__}: {exc}"})
        raise


def run_processes(n: int = 2, vocab: int = 32000, duplicates: int = 2, log=print) -> dict:
    """``bench grammar --processes N``: N real scheduler-shaped processes (spawned, real patches) share
    one empty disk cache and resolve the same burst at the same moment. ``host_compiles`` is every
    native compile on the serving path across them (the persistence helpers' re-compiles are not
    serving work and are not counted), against ``distinct_schemas``. Each process has one compile
    task per canonical key (its requests of one key join it); ``claim_wait_s`` summarises how long
    those tasks waited on another process's claim (all tasks, a task that met no claim counting 0,
    and only the tasks that waited), next to the schemas' compile times."""
    if n < 2:
        raise ValueError("--processes needs at least 2")
    ctx = mp.get_context("spawn")
    cache_dir = tempfile.mkdtemp(prefix="dspark-grammar-processes-")
    try:
        barrier = ctx.Barrier(n)
        q = ctx.Queue()
        procs = [
            ctx.Process(target=_processes_child, args=(i, vocab, cache_dir, duplicates, barrier, q)) for i in range(n)
        ]
        results = _run_children(procs, q, what="bench processes", wait_s=1200, join_s=60)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    distinct = len(S.BENCH_SCHEMAS)
    tasks = distinct * n  # one compile task per canonical key per process
    waited = [s for r in results.values() for _, s in r["waits"]]
    everyone = waited + [0.0] * max(0, tasks - len(waited))
    claims: dict = {}
    for r in results.values():
        for k, v in r["claims"].items():
            claims[k] = claims.get(k, 0) + v
    compile_s = sorted(results[0]["compile_s"].values())
    out = {
        "processes": n,
        "requests_per_process": results[0]["requests"],
        "distinct_schemas": distinct,
        "host_compiles": sum(r["native_compiles"] for r in results.values()),
        "compiles_per_process": [results[i]["native_compiles"] for i in range(n)],
        # of host_compiles: keys a peer's helper published as compile-locally markers (the adaptive policy
        # judged loading them slower than compiling), compiled again where used, by design
        "marker_compiles": sum(r["marker_compiles"] for r in results.values()),
        "claims": claims,
        "claim_wait_s": {
            "all_tasks": {
                "n": len(everyone),
                "p50": round(_percentile(everyone, 0.5), 4),
                "p99": round(_percentile(everyone, 0.99), 4),
                "max": round(max(everyone, default=0.0), 4),
            },
            "waited": {
                "n": len(waited),
                "p50": round(_percentile(waited, 0.5), 4),
                "p99": round(_percentile(waited, 0.99), 4),
            },
        },
        "compile_s": {"median": round(statistics.median(compile_s), 4), "max": round(compile_s[-1], 4)},
        "burst_s": [round(results[i]["burst_s"], 4) for i in range(n)],
        "claim_estimate_s": [round(results[i]["estimate_s"], 4) for i in range(n)],
    }
    log(
        f"{n} processes: host compiles {out['host_compiles']} for {distinct} distinct schemas "
        f"({out['marker_compiles']} of them for compile-locally markers); claims {claims}; "
        f"wait p99 {out['claim_wait_s']['all_tasks']['p99']} s vs compile median {out['compile_s']['median']} s"
    )
    return out


def run_handoff(vocab: int = 32000, repeats: int = 5, log=print) -> dict:
    """The floor of any cross-process handoff of a compiled grammar (xgrammar's only serialisation is
    JSON): per bench schema, compile (one compiler thread, no cache) vs serialize + durable write (temp
    file, fsync, rename, directory fsync) + read + deserialize, medians of ``repeats``. A waiter that
    waits for another process's publication of a key pays at least the read + deserialize after the
    publisher's compile + serialize + write; where that handoff alone costs more than the compile, no
    wait rule can give both one compile host-wide and an added wait below one compile time."""
    import xgrammar as xgr

    tok = _load_tokenizer(vocab)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    rows = []
    with tempfile.TemporaryDirectory(prefix="dsh-handoff-") as root:
        path = os.path.join(root, "entry")
        for name, schema in S.BENCH_SCHEMAS:
            text = json.dumps(schema)
            t: dict = {k: [] for k in ("compile", "serialize", "write", "read", "deserialize")}
            size = 0
            for _ in range(max(1, repeats)):
                compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                t0 = time.perf_counter()
                grammar = compiler.compile_json_schema(text)
                t["compile"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                blob = grammar.serialize_json()
                t["serialize"].append(time.perf_counter() - t0)
                size = len(blob)
                t0 = time.perf_counter()
                with open(path + ".tmp", "w") as fh:
                    fh.write(blob)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.rename(path + ".tmp", path)
                dfd = os.open(root, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
                t["write"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                with open(path) as fh:
                    blob = fh.read()
                t["read"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                xgr.CompiledGrammar.deserialize_json(blob, info)
                t["deserialize"].append(time.perf_counter() - t0)
            ms = {k: statistics.median(v) * 1e3 for k, v in t.items()}
            handoff = ms["serialize"] + ms["write"] + ms["read"] + ms["deserialize"]
            rows.append(
                {
                    "schema": name,
                    **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
                    "handoff_ms": round(handoff, 3),
                    "handoff_over_compile": round(handoff / ms["compile"], 3) if ms["compile"] > 0 else None,
                    "bytes": size,
                }
            )
    slower = [r["schema"] for r in rows if r["handoff_ms"] > r["compile_ms"]]
    out = {
        "vocab": len(tok),
        "repeats": max(1, repeats),
        "distinct_schemas": len(rows),
        "per_schema": rows,
        "handoff_slower_than_compile": slower,
    }
    log(f"{len(slower)} of {len(rows)} bench schemas cost more to hand off than to compile: {slower}")
    return out


def main(args: Any) -> int:
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    if getattr(args, "handoff", False):
        result = run_handoff(vocab=args.vocab, repeats=args.repeats, log=log)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
        return 0
    if getattr(args, "processes", None):
        result = run_processes(args.processes, vocab=args.vocab, duplicates=args.duplicates, log=log)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
        return 0
    if getattr(args, "distinct", None):
        result = run_memory(args.distinct, vocab=args.vocab, cache_bytes=args.cache_bytes, log=log)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
        return 0
    result = run(vocab=args.vocab, duplicates=args.duplicates, cache_dir=args.dir, log=log)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
        worst = max(p["warm_s"] / p["compile_s"] for p in result["per_schema"])
        print(
            f"stock compiles {result['stock_compiles']} vs harden {result['harden_compiles']} "
            f"(distinct {result['distinct_schemas']}); cold {result['cold_s']} s vs warm {result['warm_s']} s "
            f"({result['cold_over_warm']:.2f}x; {result['cold_over_warm_with_preload']:.2f}x with the preload's "
            f"{result['preload'][0].get('wall_s', 0)} s), two restarted processes at once {result['warm_restart_s']} s "
            f"({result['cold_over_warm_restart']:.2f}x); worst warm/compile {worst:.2f}; "
            f"demoted {result['demoted']}"
        )
    return 0
