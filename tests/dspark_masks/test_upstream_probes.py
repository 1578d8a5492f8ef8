"""Behavioural upstream probes (issue 23 item 5) of the stock contracts the DSpark path relies on:
each passes on stock SGLang 0.5.23, and a mutation of the stock code it calls (monkeypatched, or
compiled from its own source with one guard changed) makes it fail."""

from __future__ import annotations

import inspect
import textwrap

import pytest
from sglang.srt.managers import data_parallel_controller as dpc
from sglang.srt.managers import scheduler as S
from sglang.srt.model_executor.runner import prefill_cuda_graph_runner as pg
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from dspark_harden import upstream as U


def _mutant(owner, name: str, old: str, new: str, module):
    stock = getattr(owner, name)
    src = textwrap.dedent(inspect.getsource(stock))
    assert src.count(old) == 1, f"{name} no longer contains {old!r}"
    ns: dict = {}
    exec(compile(src.replace(old, new), inspect.getsourcefile(stock), "exec"), vars(module), ns)  # noqa: S102
    return ns[name]


PROBES = {
    "skip-finishing-one-token": U._probe_one_token_excluded_from_decode_merge,
    "dflash-request-validation": U._probe_validate_dflash_applies_to_dspark,
    "prefill-graph-nested-trim": U._probe_slice_output_rows_nested,
    "load-budget-throttle": U._probe_load_budget_throttle,
    "dsv4-indexer-metadata-in-place": U._probe_dsv4_indexer_metadata_copy_in_place,
}


@pytest.mark.parametrize("name", sorted(PROBES))
def test_probe_passes_on_stock_and_is_wired(name):
    present, detail = PROBES[name]()
    assert present, detail
    assert next(f for f in U.UPSTREAM if f.name == name).upstream_probe is PROBES[name]


# --- skip-finishing-one-token ------------------------------------------------------------------


def test_one_token_probe_fails_when_nothing_is_excluded(monkeypatch):
    monkeypatch.setattr(S.Scheduler, "_reqs_finishing_inflight", lambda self, batch: [])
    present, detail = U._probe_one_token_excluded_from_decode_merge()
    assert not present and "excluded []" in detail, detail


def test_one_token_probe_fails_when_logprob_requests_are_kept(monkeypatch):
    monkeypatch.setattr(
        S.Scheduler,
        "_reqs_finishing_inflight",
        _mutant(
            S.Scheduler,
            "_reqs_finishing_inflight",
            "and req.beam_group is None",
            "and req.beam_group is None and not req.return_logprob",
            S,
        ),
    )
    present, detail = U._probe_one_token_excluded_from_decode_merge()
    assert not present and "excluded ['one']" in detail, detail


def test_one_token_probe_fails_when_update_running_batch_ignores_them(monkeypatch):
    monkeypatch.setattr(
        S.Scheduler,
        "update_running_batch",
        _mutant(
            S.Scheduler,
            "update_running_batch",
            "batch.filter_batch(reqs_to_exclude=finishing_reqs)",
            "batch.filter_batch(reqs_to_exclude=[])",
            S,
        ),
    )
    present, detail = U._probe_one_token_excluded_from_decode_merge()
    assert not present and "excluded []" in detail, detail


def test_one_token_probe_fails_when_longer_requests_are_excluded_too(monkeypatch):
    monkeypatch.setattr(
        S.Scheduler,
        "_reqs_finishing_inflight",
        _mutant(S.Scheduler, "_reqs_finishing_inflight", "and req.next_output_finishes_by_length()", "", S),
    )
    present, detail = U._probe_one_token_excluded_from_decode_merge()
    assert not present and "max_new_tokens=4" in detail, detail


# --- dflash-request-validation -----------------------------------------------------------------


def test_dflash_probe_fails_when_dspark_leaves_the_family(monkeypatch):
    monkeypatch.setattr(SpeculativeAlgorithm, "is_dflash_family", lambda self: self.is_dflash())
    present, detail = U._probe_validate_dflash_applies_to_dspark()
    assert not present and "is_dflash_family" in detail, detail


def test_dflash_probe_fails_when_the_validator_accepts_everything(monkeypatch):
    monkeypatch.setattr(S, "validate_dflash_request", lambda req, enable_overlap: None)
    present, detail = U._probe_validate_dflash_applies_to_dspark()
    assert not present and "expected a refusal" in detail, detail


# --- prefill-graph-nested-trim -----------------------------------------------------------------


def test_trim_probe_fails_when_the_outer_sequence_is_sliced(monkeypatch):
    monkeypatch.setattr(pg, "_slice_output_rows", lambda output, n: None if output is None else output[:n])
    present, detail = U._probe_slice_output_rows_nested()
    assert not present and "expected" in detail, detail


def test_trim_probe_fails_when_lists_become_tuples(monkeypatch):
    monkeypatch.setattr(
        pg,
        "_slice_output_rows",
        _mutant(
            pg,
            "_slice_output_rows",
            "return [_slice_output_rows(item, num_tokens) for item in output]",
            "return tuple(_slice_output_rows(item, num_tokens) for item in output)",
            pg,
        ),
    )
    present, detail = U._probe_slice_output_rows_nested()
    assert not present and "'tuple'" in detail, detail


def test_trim_probe_fails_when_lists_are_rejected(monkeypatch):
    monkeypatch.setattr(
        pg, "_slice_output_rows", _mutant(pg, "_slice_output_rows", "if isinstance(output, list):", "if False:", pg)
    )
    present, detail = U._probe_slice_output_rows_nested()
    assert not present and "raised TypeError" in detail, detail


# --- load-budget-throttle ----------------------------------------------------------------------


def test_load_budget_probe_fails_without_the_throttle(monkeypatch):
    monkeypatch.setattr(
        dpc.DataParallelController,
        "refresh_load_budget",
        _mutant(dpc.DataParallelController, "refresh_load_budget", "< 0.02", "< 0.0", dpc),
    )
    present, detail = U._probe_load_budget_throttle()
    assert not present and "no 20 ms throttle" in detail, detail


def test_load_budget_probe_fails_when_it_never_refreshes_again(monkeypatch):
    monkeypatch.setattr(
        dpc.DataParallelController,
        "refresh_load_budget",
        _mutant(
            dpc.DataParallelController,
            "refresh_load_budget",
            "self._last_refresh_time = now",
            "self._last_refresh_time = now + 1e9",
            dpc,
        ),
    )
    present, detail = U._probe_load_budget_throttle()
    assert not present and "did not refresh" in detail, detail


# --- dsv4-indexer-metadata-in-place -----------------------------------------------------------


def test_dsv4_probe_fails_when_copy_metadata_rebinds(monkeypatch):
    from sglang.srt.layers.attention.dsv4 import metadata as M

    monkeypatch.setattr(
        M, "copy_metadata", _mutant(M, "copy_metadata", 'if hasattr(dst_val, "copy_"):', "if False:", M)
    )
    present, detail = U._probe_dsv4_indexer_metadata_copy_in_place()
    assert not present and "rebound" in detail, detail


def test_dsv4_probe_fails_when_copy_is_a_no_op(monkeypatch):
    from sglang.srt.layers.attention.dsv4 import metadata as M

    monkeypatch.setattr(M.PagedIndexerMetadata, "copy_", lambda self, other: None)
    present, detail = U._probe_dsv4_indexer_metadata_copy_in_place()
    assert not present and "fresh values" in detail, detail


def test_probes_are_cheap():
    import time

    t = time.perf_counter()
    for probe in PROBES.values():
        probe()
    assert time.perf_counter() - t < 2.0
