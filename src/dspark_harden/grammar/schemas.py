"""The schema set shared by ``dspark-harden bench grammar`` and tests/grammar.

Mixed sizes (measured with xgrammar 0.2.7 on the local 32k byte-level BPE): cheap ones that
compile in a few ms, string/format-heavy ones whose compile is expensive but whose serialized
form loads quickly (stored serialized), and wide/nested ones whose serialized JSON is many MB
and loads slower than they compile (stored as compile-locally markers).

:func:`variants` produces the spellings of one schema that stock treats as distinct keys:
pretty-printed, trailing newline, schema keywords in another order (NOT the order of
``properties``: that changes the grammar).
"""

from __future__ import annotations

import json
from typing import Any


def _obj(n: int, prefix: str = "f", typ: Any = "string", required: bool = True) -> dict:
    out: dict = {"type": "object", "properties": {f"{prefix}{i}": {"type": typ} for i in range(n)}}
    if required:
        out["required"] = [f"{prefix}{i}" for i in range(n)]
    return out


BENCH_SCHEMAS: list[tuple[str, dict]] = [
    (
        "flag_enum",
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "c": {"enum": ["a", "b", "c"]}},
            "required": ["ok", "c"],
        },
    ),
    (
        "int_range",
        {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 1000}, "x": {"type": "number"}},
            "required": ["n"],
        },
    ),
    ("strings3", _obj(3)),
    (
        "formats",
        {
            "type": "object",
            "properties": {
                "email": {"type": "string", "format": "email"},
                "site": {"type": "string", "format": "uri"},
                "when": {"type": "string", "format": "date-time"},
                "id": {"type": "string", "format": "uuid"},
                "ip": {"type": "string", "format": "ipv4"},
            },
            "required": ["email", "when", "id"],
        },
    ),
    (
        "pattern",
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "day": {"type": "string", "format": "date"},
                "name": {"type": "string", "minLength": 2, "maxLength": 20},
            },
            "required": ["code", "day"],
        },
    ),
    (
        "contact",
        {
            "type": "object",
            "properties": {"email": {"type": "string", "format": "email"}, "ok": {"type": "boolean"}},
            "required": ["email"],
        },
    ),
    (
        "profile",
        {
            "type": "object",
            "properties": {
                "first": {"type": "string", "maxLength": 24},
                "city": {"type": "string", "minLength": 1, "maxLength": 16},
            },
            "required": ["first"],
        },
    ),
    (
        "nested",
        {
            "type": "object",
            "properties": {"user": _obj(4, "u"), "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
            "required": ["user"],
        },
    ),
    (
        "any_of",
        {
            "type": "object",
            "properties": {"v": {"anyOf": [{"type": "string"}, {"type": "integer"}, _obj(3, "a")]}},
            "required": ["v"],
        },
    ),
    (
        "defs_ref",
        {
            "$defs": {"addr": _obj(4, "ad")},
            "type": "object",
            "properties": {"home": {"$ref": "#/$defs/addr"}, "work": {"$ref": "#/$defs/addr"}},
            "required": ["home"],
        },
    ),
    ("optional12", {"type": "object", "properties": {f"o{i}": {"type": ["string", "null"]} for i in range(12)}}),
    (
        "wide_medium",
        {
            "type": "object",
            "properties": {
                f"g{j}": _obj(8, f"g{j}_", ["string", "integer", "number", "boolean"][j % 4]) for j in range(8)
            },
        },
    ),
    (
        "array_big",
        {
            "type": "object",
            "properties": {f"g{j}": {"type": "array", "items": _obj(10, f"h{j}_")} for j in range(12)},
            "required": [f"g{j}" for j in range(12)],
        },
    ),
]

# Extra schemas for the canonical-key EBNF identity test: every construct whose member order could
# matter to xgrammar.
EXTRA_TEST_SCHEMAS: list[tuple[str, dict]] = [
    ("const_object", {"type": "object", "properties": {"k": {"const": {"z": 1, "a": [2, {"y": 3, "b": 4}]}}}}),
    ("enum_objects", {"enum": [{"b": 1, "a": 2}, "x", 1e2, None, True]}),
    (
        "pattern_props",
        {
            "type": "object",
            "patternProperties": {"^z_": {"type": "integer"}, "^a_": {"type": "string"}},
            "additionalProperties": False,
        },
    ),
    (
        "additional_schema",
        {
            "type": "object",
            "properties": {"b": {"type": "string"}},
            "additionalProperties": {
                "type": "object",
                "properties": {"z": {"type": "integer"}, "a": {"type": "boolean"}},
            },
        },
    ),
    ("prefix_items", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}),
    ("one_all_of", {"oneOf": [_obj(2, "z"), _obj(2, "a")], "allOf": [{"type": "object"}]}),
    (
        "defs_order",
        {
            "definitions": {"zeta": {"type": "integer"}, "alpha": {"type": "string"}},
            "type": "object",
            "properties": {"z": {"$ref": "#/definitions/zeta"}, "a": {"$ref": "#/definitions/alpha"}},
        },
    ),
    (
        "unicode",
        {
            "type": "object",
            "properties": {"ünï": {"type": "string", "description": "naïve ☃"}, "esc": {"const": "tab\there \u00e9"}},
            "required": ["ünï"],
        },
    ),
    (
        "numbers",
        {
            "type": "object",
            "properties": {
                "p": {"type": "number", "minimum": 1.5e1, "maximum": 100.0},
                "q": {"type": "integer", "minimum": 0, "maximum": 10},
            },
        },
    ),
    (
        "required_order",
        {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "string"}}, "required": ["b", "a"]},
    ),
]


def all_test_schemas() -> list[tuple[str, dict]]:
    return BENCH_SCHEMAS + EXTRA_TEST_SCHEMAS


def _reorder_keywords(node: Any) -> Any:
    """Reverse the keyword order of every schema node, keeping the order inside properties etc."""
    if isinstance(node, dict):
        out = {}
        for k in reversed(list(node)):
            v = node[k]
            if k in ("properties", "patternProperties", "$defs", "definitions"):
                out[k] = {n: _reorder_keywords(s) for n, s in v.items()}
            elif k in ("items", "additionalProperties", "not"):
                out[k] = _reorder_keywords(v)
            elif k in ("anyOf", "oneOf", "allOf", "prefixItems"):
                out[k] = [_reorder_keywords(s) for s in v]
            else:
                out[k] = v
        return out
    return node


def variants(schema: dict) -> list[str]:
    """Four spellings stock SGLang caches separately; all share one canonical key."""
    return [
        json.dumps(schema),
        json.dumps(schema, indent=2),
        json.dumps(schema, separators=(",", ":")) + "\n",
        json.dumps(_reorder_keywords(schema), indent=1),
    ]
