"""xgrammar's own compiler cache, bounded (``DSPARK_HARDEN_GRAMMAR_XGR_CACHE_BYTES``): the setting's
validation, the real xgrammar compiler's configuration as the feature builds it (read back from the
object, no timing), and the store-or-marker decision that must keep using a cold compile time when
the serving compile may have been served partly from that cache. Real xgrammar 0.2.7, real
persistence helper process."""

from __future__ import annotations

import json

import pytest

from dspark_harden.core.settings import SettingsError
from dspark_harden.grammar import feature as F
from dspark_harden.grammar.bench import distinct_schema
from dspark_harden.grammar.persist_worker import decision_compile_s

from .conftest import make_settings, persistent_backend, stock_backend

VAR = "DSPARK_HARDEN_GRAMMAR_XGR_CACHE_BYTES"


def test_setting_default_zero_and_explicit_values(cache_dir):
    assert make_settings(cache_dir)[VAR] == 64 << 20 == F.DEFAULT_XGR_CACHE_BYTES
    assert make_settings(cache_dir, **{VAR: "0"})[VAR] == 0
    assert make_settings(cache_dir, **{VAR: " 1048576 "})[VAR] == 1 << 20
    assert make_settings(cache_dir, **{VAR: str((1 << 63) - 1)})[VAR] == (1 << 63) - 1


@pytest.mark.parametrize(
    "raw,reason",
    [
        ("", "must be a non-negative integer"),
        ("-1", "must be a non-negative integer"),
        ("1.5", "must be a non-negative integer"),
        ("64MiB", "must be a non-negative integer"),
        ("0x10", "must be a non-negative integer"),
        ("1e6", "must be a non-negative integer"),
        ("9223372036854775808", "64-bit integer"),
    ],
)
def test_bad_value_is_an_error_naming_the_variable_and_the_reason(cache_dir, raw, reason):
    with pytest.raises(SettingsError) as err:
        make_settings(cache_dir, **{VAR: raw})
    text = str(err.value)
    assert VAR in text and reason in text and repr(raw) in text, text


def _compile_two(compiler, backend):
    kw = {"any_whitespace": backend.any_whitespace, "max_whitespace_cnt": backend.max_whitespace_cnt}
    for i in range(2):
        compiler.compile_json_schema(distinct_schema(i), **kw)


@pytest.mark.parametrize("disk", ["1", "0"])
def test_the_scheduler_compiler_has_a_bounded_xgrammar_cache_by_default(hf_tokenizer, cache_dir, disk):
    backend = persistent_backend(hf_tokenizer, cache_dir, DSPARK_HARDEN_GRAMMAR_DISK=disk)
    pc = backend.grammar_compiler
    inner = pc.inner if disk == "1" else pc
    assert type(inner).__name__ == "GrammarCompiler"
    # the real object's configuration: bounded at the setting (stock's is -1, unbounded)
    assert inner.cache_limit_bytes == 64 << 20
    assert stock_backend(hf_tokenizer).grammar_compiler.cache_limit_bytes == -1
    assert inner.get_cache_size_bytes() == 0
    _compile_two(pc, backend)
    # on: what it compiled is held there, within the bound
    assert 0 < inner.get_cache_size_bytes() <= 64 << 20
    if disk == "1":
        assert pc.inner_cache_bytes == 64 << 20 and pc._cold_timing() is False
        pc.close()


def test_explicit_limit_and_off(hf_tokenizer, cache_dir):
    backend = persistent_backend(hf_tokenizer, cache_dir, **{VAR: str(3 << 20)})
    assert backend.grammar_compiler.inner.cache_limit_bytes == 3 << 20
    backend.grammar_compiler.close()
    backend = persistent_backend(hf_tokenizer, cache_dir, **{VAR: "0"})
    pc = backend.grammar_compiler
    assert pc.inner.cache_limit_bytes == -1 and pc.inner_cache_bytes == 0
    _compile_two(pc, backend)
    assert pc.inner.get_cache_size_bytes() == 0  # off: nothing is kept
    assert pc._cold_timing() is True
    pc.close()


def test_an_unbounded_cache_handed_in_is_not_taken_for_cold(hf_tokenizer, cache_dir):
    """A PersistentCompiler given a stock-default compiler (cache on, unbounded: limit -1, the same
    reading as off) notices the cache from its contents once it holds something."""
    import xgrammar as xg

    from dspark_harden.grammar import xgr

    backend = persistent_backend(hf_tokenizer, cache_dir)
    ours = backend.grammar_compiler
    pc = xgr.PersistentCompiler(
        xg.GrammarCompiler(backend._tokenizer_info), backend._tokenizer_info, ours.ns, ours.policy, inner_threads=1
    )
    assert pc.inner_cache_bytes == 0 and pc._cold_timing() is True
    pc.compile_regex("unbounded[0-9]+")
    assert pc._cold_timing() is False
    pc.flush()
    assert {o.get("decision_basis") for o in pc.persister.outcomes.values()} == {"helper"}
    pc.close()
    ours.close()


@pytest.mark.parametrize("limit,cold,basis", [(str(64 << 20), False, "helper"), ("0", True, "serving")])
def test_the_policy_decides_on_a_cold_compile(hf_tokenizer, cache_dir, limit, cold, basis):
    """With the cache on, every publication job says its serving compile time may be a cache hit, and
    the real helper bases the store-or-marker decision on its own compile (cache off in the helper);
    with it off, as before, on the lesser of the serving compile and the helper's."""
    backend = persistent_backend(hf_tokenizer, cache_dir, **{VAR: limit})
    pc = backend.grammar_compiler
    jobs = []
    submit = pc.persister.submit

    def spy(key_hex, parts, compile_s, claim=None, cold=True):
        jobs.append(cold)
        return submit(key_hex, parts, compile_s, claim=claim, cold=cold)

    pc.persister.submit = spy
    _compile_two(pc, backend)
    pc.flush()
    assert jobs == [cold, cold]
    outcomes = [o for o in pc.persister.outcomes.values() if o.get("status") == "published"]
    assert len(outcomes) == 2, pc.persister.outcomes
    for o in outcomes:
        assert o["decision_basis"] == basis, o
        assert 0 < o["decision_compile_s"] <= o["compile_cpu_s"] + 1e-9, o
        assert 0 < o["recorded_compile_s"] <= o["phases"]["measure_compile"] + 1e-9, o
    assert not any(json.dumps(o).count("NaN") for o in outcomes)
    pc.close()


def test_decision_ignores_a_serving_time_that_may_be_a_cache_hit():
    # (basis, decide_s, record_s): a cache-assisted serving compile (1 us) must not shrink the budget: the
    # helper's cold CPU time counts
    assert decision_compile_s(0.5, 0.2, {"compile_s": 1e-6, "compile_cold": False}) == ("helper", 0.2, 0.2)
    # paused helper (wall inflated): its CPU time, never the pauses
    assert decision_compile_s(3.0, 0.2, {"compile_s": 1e-6, "compile_cold": False}) == ("helper", 0.2, 0.2)
    # a multi-threaded compile (wall below CPU): decided on its one-thread cost, the parallel wall recorded
    assert decision_compile_s(0.06, 0.1, {"compile_s": 1e-6, "compile_cold": False}) == ("helper", 0.1, 0.06)
    # cold serving compile: the lesser of it and the helper's, as before the cache
    assert decision_compile_s(0.5, 0.2, {"compile_s": 0.1, "compile_cold": True}) == ("serving", 0.1, 0.1)
    assert decision_compile_s(0.05, 0.04, {"compile_s": 0.1, "compile_cold": True}) == ("serving", 0.04, 0.04)
    # a job from before the field existed: cold
    assert decision_compile_s(0.5, 0.2, {"compile_s": 0.1}) == ("serving", 0.1, 0.1)
