"""What every traversal engine shares (the job description, the fail-closed error, the per-matcher
cache), in a module that imports neither torch nor xgrammar, so :mod:`.traversal` and
:mod:`.native` both import it instead of each other."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any


class TraversalError(RuntimeError):
    """The native traversal could not produce a complete, stock-equivalent mask (fail closed)."""


@dataclass
class Job:
    """One chain to traverse: batch ``row``, the xgrammar ``matcher`` in its current state, the
    chain position ``root`` whose row is filled from that state, and ``end`` (exclusive): the first
    node that stock rejects before looking at the grammar (a token ``>= vocab_size``), else the
    chain length. ``rid`` names the request in errors."""

    row: int
    matcher: Any
    root: int
    end: int
    rid: str = "?"


def per_matcher(cache: dict, matcher: Any, make) -> Any:
    """``make(matcher)``, cached per live matcher object: GrammarMatcher is not hashable, so the
    cache is keyed by id and each entry is checked by weak reference (dead entries are dropped
    once the cache passes 8192 entries)."""
    entry = cache.get(id(matcher))
    if entry is not None and entry[0]() is matcher:
        return entry[1]
    if len(cache) > 8192:
        for key in [k for k, (ref, _) in cache.items() if ref() is None]:
            del cache[key]
    value = make(matcher)
    cache[id(matcher)] = (weakref.ref(matcher), value)
    return value
