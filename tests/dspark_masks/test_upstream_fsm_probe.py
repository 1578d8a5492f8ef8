"""The ``grammar-fsm-advance`` upstream probe (issue 23 item 5) is behavioural: it calls stock
``SchedulerBatchResultProcessor.advance_grammar_fsm`` with a real xgrammar matcher. Mutations of the
stock method (compiled from its own source with one guard removed) must make it fail."""

from __future__ import annotations

import inspect
import textwrap

import pytest
from sglang.srt.managers.scheduler_components import batch_result_processor as brp

from dspark_harden import upstream as U

CLS = brp.SchedulerBatchResultProcessor


def _mutant(name: str, old: str, new: str):
    """The stock method ``name`` compiled from its own source with ``old`` replaced by ``new``."""
    stock = getattr(CLS, name)
    src = textwrap.dedent(inspect.getsource(stock))
    assert src.count(old) == 1, f"{name} no longer contains {old!r}"
    ns: dict = {}
    exec(compile(src.replace(old, new), inspect.getsourcefile(stock), "exec"), vars(brp), ns)  # noqa: S102
    return ns[name]


def test_probe_passes_on_stock():
    present, detail = U._probe_advance_grammar_fsm_idempotent()
    assert present, detail
    feat = next(f for f in U.UPSTREAM if f.name == "grammar-fsm-advance")
    assert feat.upstream_probe is U._probe_advance_grammar_fsm_idempotent


def test_probe_fails_without_the_idempotence_guard(monkeypatch):
    monkeypatch.setattr(
        CLS,
        "advance_grammar_fsm",
        _mutant(
            "advance_grammar_fsm", "if result.grammar_advanced or not batch.has_grammar:", "if not batch.has_grammar:"
        ),
    )
    present, detail = U._probe_advance_grammar_fsm_idempotent()
    assert not present and "not idempotent" in detail, detail


def test_probe_fails_without_the_suffix_truncation(monkeypatch):
    monkeypatch.setattr(
        CLS,
        "_accept_grammar_tokens",
        _mutant(
            "_accept_grammar_tokens",
            "if req.grammar.is_terminated():\n                break",
            "if False:\n                break",
        ),
    )
    present, detail = U._probe_advance_grammar_fsm_idempotent()
    assert not present and "truncated after <eos>" in detail, detail


def test_probe_fails_when_the_method_does_not_advance(monkeypatch):
    monkeypatch.setattr(CLS, "advance_grammar_fsm", lambda self, result, batch: None)
    present, detail = U._probe_advance_grammar_fsm_idempotent()
    assert not present and "one call" in detail, detail


def _bind_upstream_only():
    import pluggy

    from dspark_harden.core import binder, hookspecs
    from dspark_harden.core.patch import Role

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(U, name="dspark_harden.upstream")
    report = binder.bind(Role.SCHEDULER, pm=pm, environ={})
    return {st.name: st for st in report.features}["grammar-fsm-advance"]


@pytest.mark.forked  # binds: installs this manager's (empty) metric registry in the process
def test_binder_reports_upstream_on_stock_and_failed_on_a_mutant(monkeypatch):
    st = _bind_upstream_only()
    assert st.status == "upstream", (st.status, st.detail)
    monkeypatch.setattr(
        CLS,
        "advance_grammar_fsm",
        _mutant(
            "advance_grammar_fsm", "if result.grammar_advanced or not batch.has_grammar:", "if not batch.has_grammar:"
        ),
    )
    st = _bind_upstream_only()
    assert st.status == "failed" and "not idempotent" in st.detail, (st.status, st.detail)
