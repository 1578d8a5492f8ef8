"""The preload of a restarted scheduler (``DSPARK_HARDEN_GRAMMAR_DISK_PRELOAD``, xgr.py): real xgrammar, a
real disk cache published by the real persistence helper, real files.

A scheduler that starts over a populated disk cache loads its most recently used serialized entries in a
background thread; a lookup of a preloaded key is served without touching the disk. Shown by behaviour,
not by counting calls: the entry file is removed after the preload, and the lookup is still a ``disk``
resolution with no compile (a lookup that read the disk would find nothing and compile). The preloaded
grammar is the published one: its token masks equal a fresh compile's. Bounds: count (most recent
first, by the entries' mtime, which the preload itself does not refresh), bytes of compiled grammar, and
time (what no request took within ``PRELOAD_KEEP_S`` is dropped). A corrupt entry met by the preload is
moved to quarantine before any request meets it.

Mutations, each red here (run 2026-12-07): the lookup not consulting the preloaded map (source
``compile``); the preload reading with ``touch=True`` (mtimes refreshed); oldest first (the wrong two
loaded); the byte bound ignored; the keep window ignored (nothing dropped); no quarantine in the preload.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from dspark_harden.grammar import disk, xgr
from dspark_harden.grammar import feature as F

from .conftest import close_parts, make_settings, persistent_backend, stock_backend

REGEXES = [f"pre[a-z]{{{i + 1}}}[0-9]{{2}}_{i}" for i in range(4)]


def _compiler(tok, root, **overrides):
    """A PersistentCompiler as a scheduler installs it (no preload unless ``overrides`` asks)."""
    return persistent_backend(tok, root, DSPARK_HARDEN_GRAMMAR_DISK_LOAD_RATIO="1e9", **overrides).grammar_compiler


@pytest.fixture(scope="module")
def published(hf_tokenizer, tmp_path_factory):
    """A disk cache holding REGEXES as serialized entries (load ratio 1e9: never a marker), published by
    one real helper; each test gets a copy."""
    root = tmp_path_factory.mktemp("preload-src")
    backend = stock_backend(hf_tokenizer)
    F.install_persistent_compiler(backend, make_settings(root, DSPARK_HARDEN_GRAMMAR_DISK_LOAD_RATIO="1e9"))
    pc = backend.grammar_compiler
    for rx in REGEXES:
        pc.compile_regex(rx)
    pc.flush()
    close_parts(backend, pc)
    keys = [disk.key_digest(["regex", rx]) for rx in REGEXES]
    for key in keys:
        entry = disk.decode_entry("x", open(pc.ns.entry_path(key), "rb").read(), pc.ns.scope_hex, key)
        assert entry.kind == disk.KIND_SERIALIZED
    return root, keys


def _copy(published, tmp_path, ages=(400, 300, 200, 100)):
    """A copy of the published cache whose entries were last used ``ages`` seconds ago (REGEXES order)."""
    src, keys = published
    root = tmp_path / "cache"
    shutil.copytree(src, root)
    (path,) = disk.namespaces(str(root))
    ns = disk.Namespace.open_existing(path)
    now = os.stat(ns.entries).st_mtime
    for key, age in zip(keys, ages):
        os.utime(ns.entry_path(key), (now - age, now - age))
    return root, ns, keys


def _mtime(ns, key) -> float:
    return os.stat(ns.entry_path(key)).st_mtime


def _masks(tok, cg, text: str) -> list:
    import xgrammar as xg

    matcher = xg.GrammarMatcher(cg)
    bitmask = xg.allocate_token_bitmask(1, len(tok))
    out = []
    for tid in tok.encode(text, add_special_tokens=False):
        matcher.fill_next_token_bitmask(bitmask)
        out.append(bitmask.clone())
        assert matcher.accept_token(tid)
    return out


def test_a_restarted_scheduler_serves_preloaded_grammars_without_reading_the_disk(hf_tokenizer, published, tmp_path):
    """Through the feature's own wiring (install_persistent_compiler starts the preload thread): every
    entry loaded, none of their mtimes refreshed by the preload; a lookup is served from memory even
    with its file gone, refreshes the mtime of an entry that is still there (the disk cache's LRU
    order follows use), and gives the same token masks as a fresh compile of the regex."""
    root, ns, keys = _copy(published, tmp_path)
    before = {k: _mtime(ns, k) for k in keys}
    pc = _compiler(hf_tokenizer, root, DSPARK_HARDEN_GRAMMAR_DISK_PRELOAD="64")
    assert pc.wait_preload(timeout=120)
    assert pc.preload_stats["entries"] == len(keys) and pc.preload_stats["bytes"] > 0, pc.preload_stats
    assert {k: _mtime(ns, k) for k in keys} == before
    os.unlink(ns.entry_path(keys[0]))
    cg = pc.compile_regex(REGEXES[0])
    res = xgr.take_resolution()
    assert (res.source, set(res.phases), pc.native_compiles) == ("disk", {"preloaded"}, 0), res
    pc.compile_regex(REGEXES[1])
    assert xgr.take_resolution().phases.keys() == {"preloaded"}
    assert _mtime(ns, keys[1]) > before[keys[1]] and _mtime(ns, keys[2]) == before[keys[2]]
    import xgrammar as xg

    fresh = xg.GrammarCompiler(pc.tokenizer_info, cache_enabled=False).compile_regex(REGEXES[0])
    text = "prea42_0"
    got, want = _masks(hf_tokenizer, cg, text), _masks(hf_tokenizer, fresh, text)
    assert len(got) == len(want) > 0 and all((a == b).all() for a, b in zip(got, want))
    assert pc.preload_stats["used"] == 2
    # a second lookup of a taken key is not in the map any more (the service's LRU holds it): disk again
    pc.compile_regex(REGEXES[1])
    assert set(xgr.take_resolution().phases) >= {"disk_read", "deserialize"}


def test_the_most_recently_used_entries_first_bounded_by_count_and_bytes(hf_tokenizer, published, tmp_path):
    root, ns, keys = _copy(published, tmp_path)  # keys[3] used last, keys[0] first
    pc = _compiler(hf_tokenizer, root)
    stats = pc.preload(2)
    assert stats["entries"] == 2 and set(pc._preloaded) == {keys[3], keys[2]}, stats
    pc2 = _compiler(hf_tokenizer, root)
    stats2 = pc2.preload(64, max_bytes=stats["bytes"] - 1)
    assert 1 <= stats2["entries"] < len(keys) and stats2["bytes"] <= stats["bytes"] - 1, stats2
    assert keys[3] in pc2._preloaded


def test_what_no_request_took_in_the_keep_window_is_dropped(hf_tokenizer, published, tmp_path, monkeypatch):
    root, ns, keys = _copy(published, tmp_path)
    monkeypatch.setattr(xgr, "PRELOAD_KEEP_S", 0.0)
    pc = _compiler(hf_tokenizer, root)
    assert pc.preload(64)["entries"] == len(keys)
    pc.compile_regex(REGEXES[0])  # the window has passed: everything preloaded is dropped, the lookup reads
    assert set(xgr.take_resolution().phases) >= {"disk_read", "deserialize"}
    assert pc._preloaded == {} and pc.preload_stats["dropped"] == len(keys) and pc.preload_stats["used"] == 0


def test_a_corrupt_entry_met_by_the_preload_is_quarantined_before_any_request(
    hf_tokenizer, published, tmp_path, caplog
):
    root, ns, keys = _copy(published, tmp_path)
    path = ns.entry_path(keys[3])
    with open(path, "r+b") as fh:
        fh.seek(100)
        fh.write(b"\x00\xff")
    bad = open(path, "rb").read()
    caplog.set_level(logging.ERROR, logger="dspark_harden.grammar")
    pc = _compiler(hf_tokenizer, root)
    stats = pc.preload(64)
    assert stats["corrupt"] == 1 and stats["entries"] == len(keys) - 1, stats
    assert not os.path.exists(path)
    [moved] = os.listdir(ns.quarantine)
    assert open(os.path.join(ns.quarantine, moved), "rb").read() == bad
    assert any("checksum" in r.getMessage() and "moved to" in r.getMessage() for r in caplog.records)
    pc.compile_regex(REGEXES[3])  # compiled afresh, no corrupt lookup left for a request
    assert xgr.take_resolution().source == "compile" and pc.native_compiles == 1


def test_close_stops_the_preload_and_drops_what_it_holds(hf_tokenizer, published, tmp_path):
    root, ns, keys = _copy(published, tmp_path)
    pc = _compiler(hf_tokenizer, root)
    pc.preload(64)
    pc.close(join_s=30)
    assert pc._preloaded == {} and pc.preload_stats["dropped"] == len(keys)
    assert pc.start_preload(0) is None
