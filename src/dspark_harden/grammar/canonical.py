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

import hashlib
import json
import sys
import threading
from collections import OrderedDict
from typing import Any

ANY_JSON = "$$ANY$$"

# keywords whose value is one schema
_SCHEMA_VALUED = frozenset(
    {
        "items",
        "additionalProperties",
        "additionalItems",
        "not",
        "if",
        "then",
        "else",
        "contains",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
    }
)
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


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_float=_Num, parse_int=_Num, parse_constant=_reject_constant)


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


# The memo of canonical forms is bounded by bytes as well as entries (issue 18): a key is looked up
# by its text when short and by its SHA-256 when longer, so a long request string is never kept;
# a canonical form above MEMO_MAX_ENTRY_BYTES is not memoised at all (it is recomputed per lookup:
# ~60 ms for a 700 KB schema on a loaded 2-core machine, small next to its compile), and the
# memo evicts least-recently-used entries while above MEMO_MAX_BYTES or MEMO_MAX_ENTRIES.
MEMO_MAX_ENTRIES = 16384
MEMO_MAX_BYTES = 64 << 20
MEMO_MAX_ENTRY_BYTES = 2 << 20
MEMO_DIGEST_ABOVE = 512  # key strings longer than this (characters) are memoised by digest


class _Memo:
    """A thread-safe LRU of canonical forms bounded by entries and by the bytes it retains."""

    def __init__(self, max_entries: int, max_bytes: int, max_entry_bytes: int):
        self.max_entries, self.max_bytes, self.max_entry_bytes = max_entries, max_bytes, max_entry_bytes
        self._lock = threading.Lock()
        self._items: "OrderedDict[tuple, tuple[str, int]]" = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.skipped = 0

    @staticmethod
    def key(key_type: str, key_string: str) -> tuple:
        if len(key_string) <= MEMO_DIGEST_ABOVE:
            return (key_type, key_string)
        return (key_type, hashlib.sha256(key_string.encode("utf-8", "surrogatepass")).digest())

    def get(self, mkey: tuple):
        with self._lock:
            item = self._items.get(mkey)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(mkey)
            self.hits += 1
            return item[0]

    def put(self, mkey: tuple, out: str) -> None:
        size = sys.getsizeof(out) + sys.getsizeof(mkey[1])  # what the memo keeps alive
        if size > self.max_entry_bytes:
            with self._lock:
                self.skipped += 1
            return
        with self._lock:
            old = self._items.pop(mkey, None)
            if old is not None:
                self.nbytes -= old[1]
            self._items[mkey] = (out, size)
            self.nbytes += size
            while self._items and (self.nbytes > self.max_bytes or len(self._items) > self.max_entries):
                _, (_, b) = self._items.popitem(last=False)
                self.nbytes -= b

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.nbytes = 0
            self.hits = self.misses = self.skipped = 0

    def stats(self) -> dict:
        with self._lock:
            return {
                "entries": len(self._items),
                "bytes": self.nbytes,
                "hits": self.hits,
                "misses": self.misses,
                "skipped": self.skipped,
            }


_MEMO = _Memo(MEMO_MAX_ENTRIES, MEMO_MAX_BYTES, MEMO_MAX_ENTRY_BYTES)


def memo_stats() -> dict:
    """Entries, retained bytes, hits, misses and skipped (too large to memoise) of the memo."""
    return _MEMO.stats()


def memo_clear() -> None:
    _MEMO.clear()


def canonical_string(key_type: str, key_string: str) -> str:
    """The canonical form of ``key_string`` for ``key_type`` (unchanged where not provably safe)."""
    base = _base_type(key_type)
    if base not in ("json", "structural_tag") or key_string == ANY_JSON or not isinstance(key_string, str):
        return key_string
    mkey = _MEMO.key(key_type, key_string)
    out = _MEMO.get(mkey)
    if out is None:
        out = _canonicalise(base, key_string)
        _MEMO.put(mkey, out)
    return out


def _canonicalise(base: str, key_string: str) -> str:
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
