"""The module run after tests/integration/_patch_leak_probe.py: it sees stock SGLang code again. Not
collected by the suite (no ``test_`` prefix)."""

import inspect

import sglang.srt.sampling.sampling_params as sp


def test_later_modules_see_stock_code():
    assert inspect.getsourcefile(sp.SamplingParams.normalize) == sp.__file__
    assert not hasattr(sp.SamplingParams, "planted_by_a_test")
    assert callable(sp.SamplingParams.verify)
