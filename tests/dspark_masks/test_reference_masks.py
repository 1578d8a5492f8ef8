"""The independent mask reference the GPU host compares every engine with
(``workload.reference_masks``: plain xgrammar calls in stock's order, no engine of ours) equals the
engines on many random batches here, and leaves the matchers as it found them. Real xgrammar, the
locally generated 32k tokenizer; no SGLang (it runs on the GPU host too)."""

from __future__ import annotations

import pytest
import torch

from dspark_harden.dspark_masks.traversal import ChainTraverser
from dspark_harden.dspark_masks.workload import NativeFactory, native_jobs, reference_masks


@pytest.fixture(scope="module")
def native():
    return NativeFactory(vocab=32000, pad=64)


@pytest.mark.parametrize("engine", ["scalar", "level"])
def test_reference_equals_the_engines_and_restores_matchers(native, engine):
    t = ChainTraverser(engine, threads=2)
    V = native.vocab_size
    differing = 0
    for seed in range(12):
        matchers, roots, draft = native.batch(48, 8, seed=seed)
        before = [m and (m.is_terminated() or m.find_jump_forward_string()) for m in matchers]
        ref = reference_masks(matchers, roots, draft, V)
        assert [m and (m.is_terminated() or m.find_jump_forward_string()) for m in matchers] == before
        got = torch.empty_like(ref)
        t.traverse(native_jobs(matchers, roots, draft, V), draft, got, V)
        differing += int(not torch.equal(got, ref))
        # the batch exercises what the reference must get right: rows stock never fills
        assert (ref == -1).all(dim=1).any()
    t.close()
    assert differing == 0
