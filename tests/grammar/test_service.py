"""In-memory grammar service: one compile per canonical key, private matcher copies, LRU limits,
no deadlock on already-finished futures, failures and timeouts never cached.

Real XGrammarGrammarBackend + real xgrammar compiles; the service is attached to the backend
object directly (no class patching, see conftest)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Executor, Future

import pytest

from dspark_harden.grammar.schemas import BENCH_SCHEMAS, variants
from dspark_harden.grammar.service import GrammarCompileTimeout, GrammarService, grammar_nbytes

from .conftest import persistent_backend, service_for, stock_backend

SCHEMA = json.dumps(dict(BENCH_SCHEMAS)["nested"])


def _result(value_and_hit):
    value, hit = value_and_hit
    return value if hit else value.result(timeout=120)


def _count_dispatch(backend):
    calls = []
    real = backend._init_value_dispatch

    def counting(key, require_reasoning):
        calls.append(key)
        return real(key, require_reasoning)

    backend._init_value_dispatch = counting
    return calls


def test_threads_same_key_one_compile_private_matchers(hf_tokenizer, cache_dir):
    backend = persistent_backend(hf_tokenizer, cache_dir)
    calls = _count_dispatch(backend)
    svc = service_for(backend)
    gate = threading.Barrier(16)
    out = [None] * 16

    def worker(i):
        gate.wait()
        out[i] = svc.lookup(("json", SCHEMA), False)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    futures = [f for f, hit in out if not hit]
    grammars = [_result(x) for x in out]
    assert len(calls) == 1 and svc.compiles == 1
    assert backend.grammar_compiler.native_compiles == 1
    assert len({id(f) for f in futures}) == len(futures)  # independently cancellable futures
    assert len({id(g) for g in grammars}) == 16
    assert len({id(g.matcher) for g in grammars}) == 16  # every request has its own matcher
    assert sorted(f.source for f in futures).count("compile") == 1
    assert {f.source for f in futures} <= {"compile", "inflight"}
    # a matcher advanced by one request does not move another's
    tok = hf_tokenizer.encode("{", add_special_tokens=False)[0]
    assert grammars[0].matcher.accept_token(tok)
    assert grammars[1].matcher.fill_next_token_bitmask is not None
    import xgrammar as xg

    m0 = xg.allocate_token_bitmask(1, len(hf_tokenizer))
    m1 = xg.allocate_token_bitmask(1, len(hf_tokenizer))
    grammars[1].matcher.fill_next_token_bitmask(m1)
    grammars[2].matcher.fill_next_token_bitmask(m0)
    assert bool((m0 == m1).all())


def test_whitespace_and_key_order_variants_one_compile(hf_tokenizer, cache_dir):
    backend = persistent_backend(hf_tokenizer, cache_dir)
    calls = _count_dispatch(backend)
    svc = service_for(backend)
    results = [svc.lookup(("json", s), False) for s in variants(json.loads(SCHEMA)) * 2]
    grammars = [_result(r) for r in results]
    assert len(calls) == 1 and backend.grammar_compiler.native_compiles == 1
    assert len({str(g.ctx.grammar) for g in grammars}) == 1
    # later lookups are memory hits with fresh copies
    value, hit = svc.lookup(("json", variants(json.loads(SCHEMA))[3]), False)
    assert hit and value.matcher is not grammars[0].matcher


class InlineExecutor(Executor):
    """Runs submitted work at once: every future is already finished when callbacks attach."""

    def submit(self, fn, *args, **kwargs):
        f = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001
            f.set_exception(exc)
        return f


def test_already_finished_future_does_not_deadlock(hf_tokenizer, cache_dir):
    backend = persistent_backend(hf_tokenizer, cache_dir)
    svc = service_for(backend)
    svc.pool = InlineExecutor()
    done = []

    def run():
        for i in range(5):
            f, hit = svc.lookup(("regex", f"[a-z]{{{i + 1}}}"), False)
            assert not hit and f.done()
            done.append(f.result(timeout=0))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "lookup deadlocked on an already-finished compile future"
    assert len(done) == 5
    assert len(svc) == 5  # and every result landed in the cache
    value, hit = svc.lookup(("regex", "[a-z]{1}"), False)
    assert hit


def test_lru_evicts_by_entries_in_lru_order(hf_tokenizer, cache_dir):
    backend = persistent_backend(hf_tokenizer, cache_dir)
    svc = service_for(backend, max_entries=2)
    keys = [("regex", r) for r in ("a+", "b+", "c+")]
    _result(svc.lookup(keys[0], False))
    _result(svc.lookup(keys[1], False))
    assert svc.lookup(keys[0], False)[1]  # touch a+: b+ is now least recent
    _result(svc.lookup(keys[2], False))
    assert len(svc) == 2 and keys[0] in svc and keys[2] in svc and keys[1] not in svc
    assert svc.evictions == 1


def test_lru_evicts_by_bytes(hf_tokenizer, cache_dir):
    backend = persistent_backend(hf_tokenizer, cache_dir)
    probe = service_for(backend)
    a = _result(probe.lookup(("json", SCHEMA), False))
    b_schema = json.dumps(dict(BENCH_SCHEMAS)["defs_ref"])
    b = _result(probe.lookup(("json", b_schema), False))
    na, nb = grammar_nbytes(a), grammar_nbytes(b)
    assert na > 0 and nb > 0 and probe.nbytes == na + nb
    svc = service_for(backend, max_bytes=na + nb - 1)
    _result(svc.lookup(("json", SCHEMA), False))
    _result(svc.lookup(("json", b_schema), False))
    assert len(svc) == 1 and ("json", b_schema) in svc and svc.nbytes == nb
    # an object larger than the whole limit evicts itself
    tiny = service_for(backend, max_bytes=1)
    _result(tiny.lookup(("json", SCHEMA), False))
    assert len(tiny) == 0 and tiny.nbytes == 0


def test_failed_compile_is_not_cached(hf_tokenizer, cache_dir):
    backend = persistent_backend(hf_tokenizer, cache_dir)
    svc = service_for(backend)
    for _ in range(2):
        f, hit = svc.lookup(("no_such_type", "x"), False)
        assert not hit
        with pytest.raises(ValueError, match="Invalid key_type"):
            f.result(timeout=60)
    assert svc.compiles == 2 and len(svc) == 0


def test_invalid_grammar_is_cached_like_stock(hf_tokenizer, cache_dir):
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    stock = stock_backend(hf_tokenizer)
    f, _ = stock.get_cached_or_future_value(("json", "{bad"), False)
    stock_value = f.result()
    backend = persistent_backend(hf_tokenizer, cache_dir)
    svc = service_for(backend)
    ours = _result(svc.lookup(("json", "{bad"), False))
    assert isinstance(ours, InvalidGrammarObject) and ours.error_message == stock_value.error_message
    value, hit = svc.lookup(("json", "{bad"), False)
    assert hit and isinstance(value, InvalidGrammarObject)


def test_timeout_fails_request_and_does_not_poison_cache(hf_tokenizer, cache_dir):
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    backend = persistent_backend(hf_tokenizer, cache_dir)
    release = threading.Event()
    real = backend._init_value_dispatch

    def slow(key, require_reasoning):
        release.wait(120)
        return real(key, require_reasoning)

    backend._init_value_dispatch = slow
    svc = service_for(backend, timeout_s=0.05)
    key = ("json", SCHEMA)
    f, hit = svc.lookup(key, False)
    assert not hit
    threading.Event().wait(0.1)
    assert f.done()  # deadline passed: the request's own future failed
    with pytest.raises(GrammarCompileTimeout, match="DSPARK_HARDEN_GRAMMAR_COMPILE_TIMEOUT"):
        f.result(timeout=0)
    # stock GrammarManager's own poll timeout would now cache this; we ignore it
    svc.set_cache(key, InvalidGrammarObject("Grammar preprocessing timed out"))
    assert key not in svc
    release.set()
    # the compile continues; a retry joins or hits it and succeeds
    svc.timeout_s = None
    retry = _result(svc.lookup(key, False))
    assert not isinstance(retry, InvalidGrammarObject) and retry.matcher is not None
    value, hit = svc.lookup(key, False)
    assert hit and svc.compiles == 1


def test_reset_clears_and_running_compile_does_not_reinsert(hf_tokenizer, cache_dir):
    backend = persistent_backend(hf_tokenizer, cache_dir)
    svc = service_for(backend)
    _result(svc.lookup(("regex", "x+"), False))
    assert len(svc) == 1
    svc.reset()
    assert len(svc) == 0 and svc.nbytes == 0


def test_invalid_limits_rejected(hf_tokenizer):
    backend = stock_backend(hf_tokenizer)
    for kw in ({"workers": 0}, {"max_bytes": -1}, {"max_entries": 0}, {"timeout_s": 0.0}):
        args = dict(workers=1, max_bytes=1, max_entries=1, timeout_s=None)
        args.update(kw)
        with pytest.raises(ValueError, match="positive"):
            GrammarService(backend, **args)


def test_submit_failure_fails_every_waiter_and_is_not_cached(hf_tokenizer, cache_dir):
    backend = persistent_backend(hf_tokenizer, cache_dir)
    svc = service_for(backend)
    svc.pool.shutdown(wait=True)
    f, hit = svc.lookup(("regex", "q+"), False)
    assert not hit
    with pytest.raises(RuntimeError, match="shutdown"):
        f.result(timeout=10)
    assert len(svc) == 0 and ("regex", "q+") not in svc._inflight


def test_copy_failure_fails_every_waiter_instead_of_hanging(hf_tokenizer, cache_dir):
    """issue 18: ``_resolve`` runs as a future callback; an exception from ``copy()`` (or
    ``maybe_init_reasoning()``) was swallowed by concurrent.futures and the request never resolved."""
    backend = persistent_backend(hf_tokenizer, cache_dir)
    real = backend._init_value_dispatch
    release = threading.Event()

    def dispatch(key, require_reasoning):
        release.wait(120)
        grammar = real(key, require_reasoning)

        def broken_copy():
            raise MemoryError("no room for a matcher")

        grammar.copy = broken_copy  # the prototype is real; only its per-request copy fails
        return grammar

    backend._init_value_dispatch = dispatch
    svc = service_for(backend)
    key = ("regex", "copyfail[0-9]+")
    owner, _ = svc.lookup(key, False)
    joiner, _ = svc.lookup(key, True)
    release.set()
    for f in (owner, joiner):
        with pytest.raises(RuntimeError, match="preparing this request's matcher failed: MemoryError"):
            f.result(timeout=60)
    assert key not in svc._inflight


def test_cancelled_compile_fails_waiters_and_drops_the_inflight_marker(hf_tokenizer, cache_dir):
    """issue 18: a compile task cancelled before it ran (pool shut down with queued work) made
    ``_finish`` raise CancelledError from ``task.exception()`` before popping the in-flight marker:
    its waiters hung and every later lookup of the key joined the dead compile."""
    backend = persistent_backend(hf_tokenizer, cache_dir)
    real = backend._init_value_dispatch
    started, release = threading.Event(), threading.Event()

    def dispatch(key, require_reasoning):
        if key[1] == "busy+":
            started.set()
            release.wait(120)
        return real(key, require_reasoning)

    backend._init_value_dispatch = dispatch
    svc = service_for(backend, workers=1)
    busy, _ = svc.lookup(("regex", "busy+"), False)
    assert started.wait(60)
    key = ("regex", "queued[a-z]+")
    queued, _ = svc.lookup(key, False)  # waits in the pool's queue behind "busy+"
    joiner, _ = svc.lookup(key, False)
    svc.shutdown()  # cancel_futures=True: the queued compile is cancelled, never run
    try:
        for f in (queued, joiner):
            with pytest.raises(RuntimeError, match="cancelled before it ran"):
                f.result(timeout=30)
        assert key not in svc._inflight
        # a later lookup is a new owner (not a joiner of the dead compile): it fails at once on
        # the shut-down pool instead of waiting forever
        later, hit = svc.lookup(key, False)
        assert not hit
        with pytest.raises(RuntimeError, match="shutdown"):
            later.result(timeout=30)
        assert svc.compiles == 3
    finally:
        release.set()
    assert busy.result(timeout=120) is not None
