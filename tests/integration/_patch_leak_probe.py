"""Run by tests/integration/test_harness_parts.py::test_sglang_patch_left_in_the_pytest_process_fails_and_is_restored
(explicitly, in a pytest of its own with the suite's conftest, before _patch_leak_probe_after.py): tests
that patch real SGLang code in the pytest process, three of them leaving the patch in place. Not
collected by the suite (no ``test_`` prefix)."""

import sglang.srt.sampling.sampling_params as sp


def test_monkeypatch_undone_at_teardown_is_fine(monkeypatch):
    monkeypatch.setattr(sp.SamplingParams, "normalize", lambda self, tokenizer: None)


def test_leaves_a_method_replaced():
    sp.SamplingParams.normalize = lambda self, tokenizer: None


def test_leaves_a_method_added():
    sp.SamplingParams.planted_by_a_test = lambda self: None


def test_leaves_a_method_deleted():
    del sp.SamplingParams.verify
