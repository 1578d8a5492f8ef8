"""Canonical keys: every spelling of a schema maps to one key, and that key makes xgrammar derive
exactly the grammar (identical EBNF) the original spelling does."""

from __future__ import annotations

import json

import pytest

from dspark_harden.grammar.canonical import ANY_JSON, canonical_key, canonical_string
from dspark_harden.grammar.schemas import all_test_schemas, variants

SCHEMAS = all_test_schemas()


@pytest.fixture(scope="module")
def compiler(hf_tokenizer):
    import xgrammar as xg

    info = xg.TokenizerInfo.from_huggingface(
        hf_tokenizer, vocab_size=len(hf_tokenizer), stop_token_ids=[hf_tokenizer.eos_token_id]
    )
    return xg.GrammarCompiler(info, cache_enabled=False)


def _ebnf(compiler, text: str) -> str:
    try:
        return str(compiler.compile_json_schema(text, any_whitespace=True).grammar)
    except Exception as exc:  # noqa: BLE001 - an error must be identical too
        return f"error: {exc}"


@pytest.mark.parametrize("name,schema", SCHEMAS, ids=[n for n, _ in SCHEMAS])
def test_variants_share_one_key_with_identical_ebnf(compiler, name, schema):
    spellings = variants(schema)
    assert len(set(spellings)) == 4  # stock caches each separately
    keys = {canonical_string("json", s) for s in spellings}
    assert len(keys) == 1, keys
    (canon,) = keys
    reference = _ebnf(compiler, spellings[0])
    assert not reference.startswith("error"), reference
    assert _ebnf(compiler, canon) == reference
    for s in spellings[1:]:
        assert _ebnf(compiler, s) == reference
    assert json.loads(canon) == json.loads(spellings[0])


def test_properties_order_is_not_canonicalised(compiler):
    a = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "required": ["a", "b"]}
    b = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}
    ka, kb = canonical_string("json", json.dumps(a)), canonical_string("json", json.dumps(b))
    assert ka != kb
    # ... because xgrammar really derives different grammars from them
    assert _ebnf(compiler, ka) != _ebnf(compiler, kb)


def test_data_values_keep_member_order_and_number_text():
    s = '{"const": {"z": 1, "a": 1e2}, "type": "object"}'
    assert canonical_string("json", s) == '{"const":{"z":1,"a":1e2},"type":"object"}'


@pytest.mark.parametrize("bad", ['{"a": 1', "not json", '{"a": NaN}', '{"a": 1, "a": 2}', '"\\ud800"'])
def test_unparsable_or_ambiguous_keys_pass_through(bad):
    assert canonical_string("json", bad) == bad


def test_non_json_key_types_and_any_sentinel_untouched():
    assert canonical_key(("regex", " [a-z]+ ")) == ("regex", " [a-z]+ ")
    assert canonical_key(("ebnf", 'root ::= "a" ')) == ("ebnf", 'root ::= "a" ')
    assert canonical_key(("json", ANY_JSON)) == ("json", ANY_JSON)
    # reasoning-parser variants canonicalise like their base type
    assert canonical_key(("json:open_answer", '{ "type" : "string" }')) == ("json:open_answer", '{"type":"string"}')


STRUCTURAL_TAGS = [
    {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<f="],
            "tags": [
                {
                    "type": "tag",
                    "begin": "<f=a>",
                    "end": "</f>",
                    "content": {
                        "type": "json_schema",
                        "json_schema": {
                            "type": "object",
                            "properties": {"z": {"type": "integer"}, "a": {"type": "string"}},
                            "required": ["z"],
                        },
                    },
                }
            ],
        },
    },
    {
        "structures": [
            {
                "begin": "<tool=x>",
                "end": "</tool>",
                "schema": {"properties": {"q": {"type": "string"}, "b": {"type": "boolean"}}, "type": "object"},
            }
        ],
        "triggers": ["<tool="],
    },
]


def _reverse(node):
    if isinstance(node, dict):
        return {k: (node[k] if k == "properties" else _reverse(node[k])) for k in reversed(list(node))}
    if isinstance(node, list):
        return [_reverse(x) for x in node]
    return node


@pytest.mark.parametrize("tag", STRUCTURAL_TAGS, ids=["format", "legacy"])
def test_structural_tags_canonical_key_yields_identical_grammar(hf_tokenizer, tag):
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    backend = XGrammarGrammarBackend(
        hf_tokenizer, vocab_size=len(hf_tokenizer), model_eos_token_ids=[hf_tokenizer.eos_token_id]
    )
    spellings = [json.dumps(tag), json.dumps(tag, indent=3), json.dumps(_reverse(tag))]
    keys = {canonical_string("structural_tag", s) for s in spellings}
    assert len(keys) == 1
    ebnfs = {str(backend.dispatch_structural_tag(s).ctx.grammar) for s in spellings + list(keys)}
    assert len(ebnfs) == 1


def _big_schema(tag: str, n: int) -> str:
    props = {f"{tag}{i}": {"type": "string", "enum": [f"{tag}-{i}-" + "x" * 40]} for i in range(n)}
    return json.dumps({"type": "object", "properties": props})


def test_memo_does_not_retain_large_schemas():
    """issue 18: the memo of canonical forms is bounded by bytes; a schema whose canonical form is
    above the per-entry bound is not kept at all (neither the request's string nor the result)."""
    import gc
    import sys
    import tracemalloc

    from dspark_harden.grammar import canonical as C

    C.memo_clear()
    big = _big_schema("big", 60000)  # ~4.4 MB, canonical form above MEMO_MAX_ENTRY_BYTES
    assert len(big) > C.MEMO_MAX_ENTRY_BYTES
    before = sys.getrefcount(big)
    out = canonical_string("json", big)
    assert out != big and json.loads(out) == json.loads(big)
    assert sys.getrefcount(big) == before, "the memo keeps the request's schema string alive"
    assert sys.getrefcount(out) == 2, "the memo keeps the canonical form alive"
    st = C.memo_stats()
    assert st["entries"] == 0 and st["bytes"] == 0 and st["skipped"] == 1
    # many large-but-memoisable schemas: retained memory stays under the byte bound
    tracemalloc.start()
    try:
        gc.collect()
        base, _ = tracemalloc.get_traced_memory()
        for i in range(6):
            canonical_string("json", _big_schema(f"m{i}_", 15000))  # ~1.1 MB each
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    st = C.memo_stats()
    assert st["bytes"] <= C.MEMO_MAX_BYTES
    assert retained <= st["bytes"] + (1 << 20), (retained, st)
    # a long key is memoised by digest: the memo never holds the caller's string
    C.memo_clear()
    mid = _big_schema("mid", 50)
    assert len(mid) > C.MEMO_DIGEST_ABOVE
    before = sys.getrefcount(mid)
    first = canonical_string("json", mid)
    assert sys.getrefcount(mid) == before
    assert canonical_string("json", mid) is first and C.memo_stats()["hits"] == 1


def test_memo_evicts_by_bytes_and_entries(monkeypatch):
    from dspark_harden.grammar import canonical as C

    memo = C._Memo(max_entries=3, max_bytes=10_000, max_entry_bytes=4_000)
    monkeypatch.setattr(C, "_MEMO", memo)
    schemas = [_big_schema(f"e{i}_", 20) for i in range(5)]  # ~1.5 KB canonical each
    outs = [canonical_string("json", s) for s in schemas]
    st = C.memo_stats()
    assert st["entries"] == 3 and st["bytes"] <= 10_000
    assert canonical_string("json", schemas[-1]) is outs[-1]  # most recent kept
    assert canonical_string("json", schemas[0]) is not outs[0]  # oldest evicted (recomputed)
    tight = C._Memo(max_entries=100, max_bytes=5_000, max_entry_bytes=4_000)
    monkeypatch.setattr(C, "_MEMO", tight)
    for s in schemas:
        canonical_string("json", s)
    assert C.memo_stats()["bytes"] <= 5_000 and C.memo_stats()["entries"] < 5
