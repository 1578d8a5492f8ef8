"""Operator commands (``dspark-harden grammar-cache``) as real subprocesses over a real cache, and
the declared patches bound on the real SGLang classes (forked: they patch SGLang), including the
ReasonerGrammarBackend wrapper."""

from __future__ import annotations

import json
import os
import sys

import pytest

from dspark_harden.grammar import disk
from tests.harness import warm

from .conftest import make_settings, persistent_backend


def _cli(*args, env=None):
    proc = warm.run(
        [sys.executable, "-m", "dspark_harden", "grammar-cache", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    return proc.returncode, proc.stdout, proc.stderr


def _populate(tok, cache_dir, n=5):
    backend = persistent_backend(tok, cache_dir)
    for i in range(n):
        backend.grammar_compiler.compile_regex(f"cli[0-9]{{{i + 1}}}")
    backend.grammar_compiler.flush()
    return backend.grammar_compiler.ns


def test_stats_verify_quarantine_prune(hf_tokenizer, cache_dir):
    ns = _populate(hf_tokenizer, cache_dir)
    rc, out, err = _cli("stats", "--dir", str(cache_dir), "--json")
    assert rc == 0, err
    (st,) = json.loads(out)["namespaces"]
    assert st["entries"] == 5 and st["serialized"] + st["markers"] == 5 and st["bytes"] == st["ledger_bytes"]

    rc, out, err = _cli("verify", "--dir", str(cache_dir), "--json")
    assert rc == 0 and json.loads(out)["problems"] == 0, out + err

    victim = sorted(e.path for e in ns.iter_entries())[0]
    with open(victim, "r+b") as fh:
        fh.seek(0, 2)
        fh.truncate(fh.tell() - 3)
    rc, out, _ = _cli("verify", "--dir", str(cache_dir))
    assert rc == 1 and victim in out and "INVALID" in out and "MISMATCH" in out

    rc, out, _ = _cli("verify", "--dir", str(cache_dir), "--quarantine", "--json")
    report = json.loads(out)["namespaces"][0]
    assert [b["path"] for b in report["invalid"]] == [victim] and len(report["quarantined"]) == 1
    assert not os.path.exists(victim) and os.path.exists(report["quarantined"][0])
    assert report["ledger_ok"], report
    rc, _, _ = _cli("verify", "--dir", str(cache_dir))
    assert rc == 0

    rc, out, _ = _cli("prune", "--dir", str(cache_dir), "--max-bytes", "0", "--json")
    res = json.loads(out)
    assert rc == 0 and res["namespaces"][0]["after"] == 0 and res["namespaces"][0]["removed"] == 4
    assert ns.read_ledger() == 0 and list(ns.iter_entries()) == []


def test_prune_rebuilds_a_stale_ledger(hf_tokenizer, cache_dir):
    ns = _populate(hf_tokenizer, cache_dir, n=2)
    with open(ns.ledger_path, "wb") as fh:  # e.g. a crash between publish and accounting
        fh.write(disk.encode_ledger(1))
    rc, out, _ = _cli("verify", "--dir", str(cache_dir))
    assert rc == 1 and "MISMATCH" in out
    rc, _, _ = _cli("prune", "--dir", str(cache_dir))
    assert rc == 0 and ns.read_ledger() == ns.scan_bytes() > 1


def test_bad_setting_is_a_startup_error_naming_the_variable(cache_dir):
    from dspark_harden.core.settings import SettingsError

    with pytest.raises(SettingsError, match="DSPARK_HARDEN_GRAMMAR_CACHE_ENTRIES"):
        make_settings(cache_dir, DSPARK_HARDEN_GRAMMAR_CACHE_ENTRIES="0")
    with pytest.raises(SettingsError, match="DSPARK_HARDEN_GRAMMAR_DISK_LOAD_RATIO"):
        make_settings(cache_dir, DSPARK_HARDEN_GRAMMAR_DISK_LOAD_RATIO="-1")


@pytest.mark.forked
def test_declared_patches_bind_cover_reasoner_and_revert(hf_tokenizer, cache_dir):
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarBackend, InvalidGrammarObject
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarBackend, ReasonerGrammarObject
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    from dspark_harden.core.patch import Role
    from dspark_harden.grammar import feature as F
    from dspark_harden.grammar.schemas import BENCH_SCHEMAS, variants
    from dspark_harden.grammar.service import GrammarService
    from dspark_harden.grammar.xgr import PersistentCompiler

    patches = F.patches(Role.SCHEDULER, make_settings(cache_dir, DSPARK_HARDEN_GRAMMAR_WORKERS=2))
    assert {p.target.rsplit(":", 1)[1] for p in patches} == {
        "BaseGrammarBackend.__init__",
        "BaseGrammarBackend.get_cached_or_future_value",
        "BaseGrammarBackend.set_cache",
        "XGrammarGrammarBackend.__init__",
    }
    assert F.patches(Role.MAIN, make_settings(cache_dir)) == []
    assert F.patches(Role.SCHEDULER, make_settings(cache_dir, DSPARK_HARDEN_GRAMMAR=0)) == []
    stock_get = BaseGrammarBackend.get_cached_or_future_value
    for p in patches:
        p.apply()
    for p in patches:
        p.apply()  # idempotent
        assert p.live_check() is None
    try:
        inner = XGrammarGrammarBackend(
            hf_tokenizer, vocab_size=len(hf_tokenizer), model_eos_token_ids=[hf_tokenizer.eos_token_id]
        )
        assert isinstance(inner.grammar_compiler, PersistentCompiler)
        # host-wide claims are opt-in on a server (a waiter may wait longer than a compile: docs/grammar.md)
        assert inner.grammar_compiler.claims_enabled is False
        assert isinstance(inner._dspark_grammar, GrammarService) and inner.executor is inner._dspark_grammar.pool
        parser = ReasoningParser(model_type="deepseek-r1", stream_reasoning=False, tokenizer=hf_tokenizer)
        backend = ReasonerGrammarBackend(inner, parser, hf_tokenizer)
        svc = backend._dspark_grammar
        schema = dict(BENCH_SCHEMAS)["defs_ref"]
        futures = [backend.get_cached_or_future_value(("json", s), True) for s in variants(schema)]
        values = [f.result(timeout=300) for f, hit in futures if not hit]
        assert len(values) == 4 and svc.compiles == 1 and inner.grammar_compiler.native_compiles == 1
        assert all(isinstance(v, ReasonerGrammarObject) and v.grammar.matcher is not None for v in values)
        assert len({id(v.grammar.matcher) for v in values}) == 4
        assert all(v._is_thinking() for v in values)  # require_reasoning honoured per copy
        # the stock manager hands results back through set_cache: never cached twice, timeouts ignored
        backend.set_cache(("json", "x"), InvalidGrammarObject("Grammar preprocessing timed out"))
        assert ("json", "x") not in svc
        value, hit = backend.get_cached_or_future_value(("json", variants(schema)[0]), False)
        assert hit and isinstance(value, ReasonerGrammarObject) and value._is_generation()
        backend.reset()
        assert len(svc) == 0
        inner.grammar_compiler.flush()
        assert len(list(inner.grammar_compiler.ns.iter_entries())) == 1
    finally:
        for p in reversed(patches):
            p.revert()
    assert BaseGrammarBackend.get_cached_or_future_value is stock_get
    plain = XGrammarGrammarBackend(
        hf_tokenizer, vocab_size=len(hf_tokenizer), model_eos_token_ids=[hf_tokenizer.eos_token_id]
    )
    assert not hasattr(plain, "_dspark_grammar") and not isinstance(plain.grammar_compiler, PersistentCompiler)
