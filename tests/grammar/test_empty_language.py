"""A grammar that admits no output at all (a ``$ref`` cycle with no base case) is an invalid grammar.

Differential, on the real SGLang ``XGrammarGrammarBackend`` and real xgrammar: stock compiles the
schema into a grammar object whose first ``accept_token`` raises ("Tokens not accepted" — the adversarial
soak saw that as HTTP 500 from a real DP2 server, docs/e2e.md); the grammar service answers an
``InvalidGrammarObject`` naming the reason (SGLang turns that into a 400), cached like any invalid
grammar, while grammars that do admit output — recursive ones included — are untouched."""

from __future__ import annotations

import json

import pytest

from dspark_harden.grammar import xgr

from .conftest import counting_backend, persistent_backend, service_for, stock_backend

CYCLE = json.dumps(
    {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/b"}, "b": {"$ref": "#/definitions/a"}}}
)
SELF = json.dumps({"$ref": "#"})
VALID = [
    ("json", json.dumps({"type": "object", "properties": {"x": {"$ref": "#"}}})),  # recursive, has a base case
    ("json", json.dumps({"const": 1})),
    ("regex", "(ab)*"),  # admits the empty string: end of sequence allowed at once
    ("ebnf", 'root ::= "a" root | "b"'),
]


def _invalid(value):
    return type(value).__name__ == "InvalidGrammarObject"


def test_stock_serves_the_cycle_and_fails_at_the_first_token(hf_tokenizer):
    backend = stock_backend(hf_tokenizer)
    for text in (CYCLE, SELF):
        value = backend._init_value_dispatch(("json", text), False)
        assert not _invalid(value)  # stock: a "valid" grammar ...
        mask = value.allocate_vocab_mask(value.vocab_size, 1, "cpu")
        value.fill_vocab_mask(mask, 0)
        assert not bool(mask.any())  # ... that allows no token at all
        with pytest.raises(ValueError, match="Tokens not accepted"):
            value.accept_token(hf_tokenizer.eos_token_id)


def test_service_answers_invalid_naming_the_reason_once_per_key(hf_tokenizer):
    backend, calls = counting_backend(hf_tokenizer)
    svc = service_for(backend)
    for text in (CYCLE, SELF):
        fut, cached = svc.lookup(("json", text), False)
        value = fut.result(timeout=120)
        assert _invalid(value), value
        assert xgr.EMPTY_LANGUAGE_MARK in value.error_message and "$ref cycle" in value.error_message
    n = calls["n"]
    again, cached = svc.lookup(("json", CYCLE), False)
    assert cached and _invalid(again) and calls["n"] == n  # cached: no second compile or check
    for key in VALID:
        fut, _ = svc.lookup(key, False)
        value = fut.result(timeout=120)
        assert not _invalid(value), (key, getattr(value, "error_message", None))
        mask = value.allocate_vocab_mask(value.vocab_size, 1, "cpu")
        value.fill_vocab_mask(mask, 0)
        assert bool(mask.any())
    svc.shutdown()


def test_the_check_also_covers_grammars_loaded_from_disk(hf_tokenizer, cache_dir):
    """The persistent compiler's second resolution (from the disk cache, or a compile-locally marker)
    goes through the same check: a restart does not turn the refusal into a 500."""
    first = persistent_backend(hf_tokenizer, cache_dir)
    svc = service_for(first)
    assert _invalid(svc.lookup(("json", CYCLE), False)[0].result(timeout=120))
    first.grammar_compiler.flush()
    svc.shutdown()
    second = persistent_backend(hf_tokenizer, cache_dir)
    svc2 = service_for(second)
    value = svc2.lookup(("json", CYCLE), False)[0].result(timeout=120)
    assert _invalid(value) and xgr.EMPTY_LANGUAGE_MARK in value.error_message
    svc2.shutdown()


def test_a_failing_check_serves_the_grammar_as_stock(hf_tokenizer, monkeypatch):
    """The check only adds a refusal: if it cannot run (here: xgrammar's bitmask allocation raises),
    the compiled grammar is served exactly as stock would serve it, never failed."""
    import xgrammar as xg

    def broken(*a, **k):
        raise RuntimeError("bitmask allocation failed")

    monkeypatch.setattr(xg, "allocate_token_bitmask", broken)
    backend = stock_backend(hf_tokenizer)
    svc = service_for(backend)
    value = svc.lookup(("json", CYCLE), False)[0].result(timeout=120)
    assert not _invalid(value) and type(value).__name__ == "XGrammarGrammar"
    svc.shutdown()
