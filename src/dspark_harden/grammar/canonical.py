"""Canonical grammar cache keys.

Two request keys share a cache entry only when xgrammar provably derives the same grammar from
them. For JSON-bearing keys (``json`` schemas and ``structural_tag`` documents) that means:

* insignificant whitespace is removed (compact separators, non-ASCII kept verbatim);
* the keywords of a *schema node* (``type``, ``properties``, ``required``, ...) and of a
  structural-tag node are sorted — xgrammar looks keywords up by name;
* the ORDER OF ENTRIES INSIDE ``properties`` (and the other maps whose order xgrammar uses:
  ``patternProperties``, ``$defs``, ``definitions``, ``dependentSchemas``) IS KEPT: xgrammar
  emits object members in declared order, so reordering them changes the grammar
  (measured-facts.md, "Corrections");
* values whose text is data rather than schema (``const``, ``enum``, ``default``, ``examples``,
  unknown keywords, ``required``) keep their member order; only whitespace goes;
* numbers keep their exact source text (``1e2`` is not rewritten as ``100.0``).

Keys that are not valid strict JSON, that contain duplicate object members (whose meaning
depends on the parser), or whose canonical form cannot be encoded as UTF-8 pass through
unchanged, so they fail (or succeed) exactly where stock fails. Non-JSON key types (regex, ebnf)
and the ``$$ANY$$`` sentinel are never touched. tests/grammar/test_canonical.py checks, for every
schema in the test set, that xgrammar produces identical EBNF from the original and the
canonical key.
"""

from __future__ import annotations

import functools
import json
from typing import Any

ANY_JSON = "$$ANY$$"

# keywords whose value is one schema
_SCHEMA_VALUED = frozenset({
    "items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems",
})
# keywords whose value is a list of schemas
_SCHEMA_LIST_VALUED = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
# keywords whose value is a map name -> schema whose ORDER is kept
_ORDERED_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# structural-tag fields holding a JSON schema
_STRUCTURAL_SCHEMA_FIELDS = frozenset({"json_schema", "schema"})


class _NotCanonical(Exception):
    pass


class _Num(str):
    """A JSON number kept as its source text."""


class _Obj(list):
    """A JSON object as an ordered list of (key, value) pairs."""


def _is_array(v: Any) -> bool:
    return isinstance(v, list) and not isinstance(v, _Obj)


def _pairs(pairs: list) -> _Obj:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _NotCanonical("duplicate object member")
    return _Obj(pairs)


def _reject_constant(name: str) -> Any:
    raise _NotCanonical(f"non-standard constant {name}")


_DECODER = json.JSONDecoder(
    object_pairs_hook=_pairs, parse_float=_Num, parse_int=_Num, parse_constant=_reject_constant
)


def _dump_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _emit_data(v: Any) -> str:
    """Data: compact, member order preserved."""
    if isinstance(v, _Obj):
        return "{" + ",".join(_dump_str(k) + ":" + _emit_data(x) for k, x in v) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_emit_data(x) for x in v) + "]"
    if isinstance(v, _Num):
        return str(v)
    if isinstance(v, str):
        return _dump_str(v)
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None:
        return "null"
    raise _NotCanonical(f"unexpected value {type(v).__name__}")  # pragma: no cover


def _emit_schema(v: Any) -> str:
    """A schema node: keywords sorted, sub-schemas canonicalised, data kept in order."""
    if not isinstance(v, _Obj):
        return _emit_data(v)  # boolean schemas, or anything xgrammar will reject
    out = []
    for k, x in sorted(v, key=lambda kv: kv[0]):
        if k in _SCHEMA_VALUED:
            if _is_array(x):  # draft-4 tuple form of "items"
                s = "[" + ",".join(_emit_schema(e) for e in x) + "]"
            else:
                s = _emit_schema(x)
        elif k in _SCHEMA_LIST_VALUED and _is_array(x):
            s = "[" + ",".join(_emit_schema(e) for e in x) + "]"
        elif k in _ORDERED_SCHEMA_MAPS and isinstance(x, _Obj):
            s = "{" + ",".join(_dump_str(n) + ":" + _emit_schema(sub) for n, sub in x) + "}"
        else:
            s = _emit_data(x)
        out.append(_dump_str(k) + ":" + s)
    return "{" + ",".join(out) + "}"


def _emit_structural(v: Any) -> str:
    if isinstance(v, _Obj):
        out = []
        for k, x in sorted(v, key=lambda kv: kv[0]):
            s = _emit_schema(x) if k in _STRUCTURAL_SCHEMA_FIELDS else _emit_structural(x)
            out.append(_dump_str(k) + ":" + s)
        return "{" + ",".join(out) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_emit_structural(x) for x in v) + "]"
    return _emit_data(v)


def _base_type(key_type: str) -> str:
    # ReasonerGrammarBackend variants look like "json:open_answer" / "json:think_budget=5"
    return key_type.partition(":")[0]


@functools.lru_cache(maxsize=16384)
def canonical_string(key_type: str, key_string: str) -> str:
    """The canonical form of ``key_string`` for ``key_type`` (unchanged where not provably safe)."""
    base = _base_type(key_type)
    if base not in ("json", "structural_tag") or key_string == ANY_JSON or not isinstance(key_string, str):
        return key_string
    try:
        value = _DECODER.decode(key_string)
        out = _emit_schema(value) if base == "json" else _emit_structural(value)
        out.encode("utf-8")  # lone surrogates: leave the key exactly as the client sent it
    except (ValueError, _NotCanonical, UnicodeEncodeError, RecursionError):
        return key_string
    return out


def canonical_key(key: tuple) -> tuple:
    """``(key_type, key_string)`` with the string canonicalised (see module docstring)."""
    key_type, key_string = key
    if not isinstance(key_type, str) or not isinstance(key_string, str):
        return key
    return (key_type, canonical_string(key_type, key_string))
