"""``BaseGrammarBackend.set_cache`` / ``backend.cache`` keep stock's contract under the plugin
(issue 12): differential against stock SGLang 0.5.23 on the real classes (forked: the test binds
the declared patches), for the plain XGrammar backend and through ReasonerGrammarBackend.

Stock: ``set_cache(key, value)`` is ``cache[key] = value``; a lookup of ``key`` returns
``value.copy()`` after ``maybe_init_reasoning(require_reasoning)``. The plugin does the same for
cacheable grammars (under the canonical key, so equivalent spellings hit too) and refuses what
must never be cached: timeout results and failure wrappers (stock caches those forever)."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xg

from dspark_harden.grammar.schemas import BENCH_SCHEMAS, variants

from .conftest import make_settings

SCHEMA = dict(BENCH_SCHEMAS)["nested"]


def _backends(tok):
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarBackend
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    plain = XGrammarGrammarBackend(tok, vocab_size=len(tok), model_eos_token_ids=[tok.eos_token_id])
    inner = XGrammarGrammarBackend(tok, vocab_size=len(tok), model_eos_token_ids=[tok.eos_token_id])
    parser = ReasoningParser(model_type="deepseek-r1", stream_reasoning=False, tokenizer=tok)
    return {"xgrammar": plain, "reasoner": ReasonerGrammarBackend(inner, parser, tok)}


def _mask(grammar, vocab):
    m = xg.allocate_token_bitmask(1, vocab)
    inner = getattr(grammar, "grammar", grammar)
    inner.matcher.fill_next_token_bitmask(m)
    return m


def _trace(backend, tok) -> dict:
    """Everything stock code can observe of set_cache through the stock interface."""
    spell = variants(SCHEMA)
    key = ("json", spell[0])
    out = {}
    proto = backend._init_value_dispatch(key, True)  # what the stock manager would hand back
    out["set"] = backend.set_cache(key, proto)
    out["in_cache"] = key in backend.cache
    out["len"] = len(backend.cache)
    out["get_is_value"] = backend.cache.get(key) is proto
    # the mapping reads of stock's dict: [key], iteration, keys/values/items, a missing [key]
    out["getitem_is_value"] = backend.cache[key] is proto
    out["iter_reads_back"] = [backend.cache[k] is proto for k in backend.cache]
    out["keys_values_items"] = (
        len(list(backend.cache.keys())),
        [v is proto for v in backend.cache.values()],
        [(backend.cache[k] is v, v is proto) for k, v in backend.cache.items()],
    )
    try:
        backend.cache[("json", '{"type": "string", "maxLength": 3}')]
        out["missing_getitem"] = "no error"
    except KeyError as exc:
        out["missing_getitem"] = ("KeyError", exc.args == (("json", '{"type": "string", "maxLength": 3}'),))
    for reasoning in (True, False):
        value, hit = backend.get_cached_or_future_value(key, reasoning)
        out[f"hit_{reasoning}"] = hit
        out[f"type_{reasoning}"] = type(value).__name__
        out[f"copy_{reasoning}"] = (
            value is not proto
            and getattr(value, "grammar", value).matcher is not getattr(proto, "grammar", proto).matcher
        )
        if hasattr(value, "_is_thinking"):
            out[f"thinking_{reasoning}"] = value._is_thinking()
        out[f"mask_{reasoning}"] = _mask(value, len(tok)).tolist()
    # a second set replaces the value (stock: dict assignment)
    other = backend._init_value_dispatch(key, False)
    backend.set_cache(key, other)
    out["replaced"] = backend.cache.get(key) is other and len(backend.cache) == 1
    # pop through the view, as ReasonerGrammarBackend's budget-variant eviction does
    out["pop_is_value"] = backend.cache.pop(key, None) is other
    out["after_pop"] = (key in backend.cache, len(backend.cache))
    backend.set_cache(key, other)
    backend.reset()
    out["after_reset"] = len(backend.cache)
    return out


@pytest.mark.forked
def test_set_cache_keeps_stock_contract_differential(hf_tokenizer, cache_dir):
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    from dspark_harden.core.patch import Role
    from dspark_harden.grammar import feature as F

    stock = {name: _trace(b, hf_tokenizer) for name, b in _backends(hf_tokenizer).items()}
    # stock caches a poll timeout forever: every later request for the key fails without compiling
    probe = _backends(hf_tokenizer)["xgrammar"]
    probe.set_cache(("json", "{}"), InvalidGrammarObject("Grammar preprocessing timed out"))
    value, hit = probe.get_cached_or_future_value(("json", "{}"), False)
    assert hit and isinstance(value, InvalidGrammarObject)

    patches = F.patches(Role.SCHEDULER, make_settings(cache_dir, DSPARK_HARDEN_GRAMMAR_WORKERS=2))
    for p in patches:
        p.apply()
    try:
        backends = _backends(hf_tokenizer)
        ours = {name: _trace(b, hf_tokenizer) for name, b in backends.items()}
        for name in stock:
            s, o = stock[name], ours[name]
            assert o == s, name
            assert s["hit_True"] and s["hit_False"] and s["copy_True"] and s["get_is_value"]
            assert s["getitem_is_value"] and s["iter_reads_back"] == [True]
            assert s["keys_values_items"] == (1, [True], [(True, True)]) and s["missing_getitem"] == ("KeyError", True)
        assert stock["reasoner"]["thinking_True"] and not stock["reasoner"]["thinking_False"]

        for name, backend in backends.items():
            svc = backend._dspark_grammar
            spell = variants(SCHEMA)
            proto = backend._init_value_dispatch(("json", spell[1]), False)
            backend.set_cache(("json", spell[1]), proto)
            # stored under the canonical key: every equivalent spelling is a hit, served by copy
            for s in spell:
                value, hit = backend.get_cached_or_future_value(("json", s), False)
                assert hit and value is not proto, (name, s)
                assert backend.cache.get(("json", s)) is proto and backend.cache[("json", s)] is proto
            assert len(svc) == 1 and svc.compiles == 0 and svc.nbytes > 0
            # refused as before: timeouts, failure wrappers, corrupt-entry failures, None
            for bad in (
                InvalidGrammarObject("Grammar preprocessing timed out"),
                InvalidGrammarObject(
                    "Grammar compilation failed: json grammar was not compiled "
                    "within 1 s (DSPARK_HARDEN_GRAMMAR_COMPILE_TIMEOUT)"
                ),
                InvalidGrammarObject("persistent grammar cache entry is invalid: /x: checksum"),
                None,
            ):
                backend.set_cache(("json", "{}"), bad)
                assert ("json", "{}") not in backend.cache, (name, bad)
            backend.cache[("json", "{}")] = InvalidGrammarObject("Grammar preprocessing timed out")
            assert ("json", "{}") not in svc
            value, hit = backend.get_cached_or_future_value(("json", "{}"), False)
            assert not hit  # compiles instead of serving a cached timeout
            got = value.result(timeout=300)
            assert not isinstance(got, InvalidGrammarObject)
            # an invalid-grammar result is cached as stock caches it
            bad_schema = InvalidGrammarObject("unsupported schema")
            backend.set_cache(("json", '{"type": 5}'), bad_schema)
            value, hit = backend.get_cached_or_future_value(("json", '{"type":5}'), False)
            assert hit and isinstance(value, InvalidGrammarObject)
    finally:
        for p in reversed(patches):
            p.revert()


def test_service_set_cache_counts_bytes_and_evicts(hf_tokenizer, cache_dir):
    """Without patching: set_cache goes through the same byte/entry bounded insert as a compile."""
    from .conftest import persistent_backend, service_for

    backend = persistent_backend(hf_tokenizer, cache_dir)
    svc = service_for(backend, max_entries=2)
    protos = [backend._init_value_dispatch(("regex", r), False) for r in ("a+", "b+", "c+")]
    for r, p in zip(("a+", "b+", "c+"), protos):
        assert svc.set_cache(("regex", r), p) is True
    assert len(svc) == 2 and ("regex", "a+") not in svc and svc.evictions == 1
    value, hit = svc.lookup(("regex", "c+"), False)
    assert hit and value is not protos[2]
    assert torch.equal(_mask(value, len(hf_tokenizer)), _mask(protos[2], len(hf_tokenizer)))
    assert svc.nbytes == sum(p.ctx.memory_size_bytes for p in protos[1:])
    assert json.dumps(sorted(svc.keys()))  # keys stay canonical tuples
