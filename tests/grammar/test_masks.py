"""Differential: for every schema in the test set, matchers served by the grammar service — fresh
compile, in-flight join, memory hit, disk-deserialized entry, compile-locally marker — and the
stock backend's matcher accept/reject the same token sequences and fill identical bitmasks."""

from __future__ import annotations

import random

import pytest
import torch
import xgrammar as xg

from dspark_harden.grammar.schemas import all_test_schemas, variants

from .conftest import persistent_backend, service_for, stock_backend

SCHEMAS = all_test_schemas()
STEPS = 24


def _walk(stock, ours: dict, vocab: int, seed: int) -> int:
    """Drive all matchers with the same tokens; compare masks at every step. Returns steps made."""
    rng = random.Random(seed)
    ref = xg.allocate_token_bitmask(1, vocab)
    got = xg.allocate_token_bitmask(1, vocab)
    for step in range(STEPS):
        if stock.is_terminated():
            for name, m in ours.items():
                assert m.is_terminated(), name
            return step
        stock.fill_next_token_bitmask(ref)
        bits = torch.nonzero(((ref[0].unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:vocab]).flatten().tolist()
        assert bits, "stock mask allows nothing"
        for name, m in ours.items():
            got.fill_(0)
            m.fill_next_token_bitmask(got)
            assert torch.equal(ref, got), f"{name}: mask differs at step {step}"
        allowed = set(bits)
        rejected = next((t for t in rng.sample(range(vocab), 64) if t not in allowed), None)
        if rejected is not None:
            assert not stock.accept_token(rejected)
            for name, m in ours.items():
                assert not m.accept_token(rejected), f"{name} accepted a token stock rejects"
        token = rng.choice(bits)
        assert stock.accept_token(token)
        for name, m in ours.items():
            assert m.accept_token(token), f"{name} rejected a token stock accepts"
    return STEPS


@pytest.fixture(scope="module")
def sources(hf_tokenizer, tmp_path_factory):
    """Per schema: {source name: matcher} plus the stock matcher."""
    ser_dir = tmp_path_factory.mktemp("serialized")
    mark_dir = tmp_path_factory.mktemp("markers")
    # huge ratio: every entry stored serialized; tiny ratio: every entry a marker
    warm_ser = persistent_backend(hf_tokenizer, ser_dir, DSPARK_HARDEN_GRAMMAR_DISK_LOAD_RATIO="1e9")
    warm_mark = persistent_backend(hf_tokenizer, mark_dir, DSPARK_HARDEN_GRAMMAR_DISK_LOAD_RATIO="1e-9")
    cold_svc = {n: service_for(b) for n, b in (("ser", warm_ser), ("mark", warm_mark))}
    out = {}
    stock = stock_backend(hf_tokenizer)
    for name, schema in SCHEMAS:
        spell = variants(schema)
        f, _ = stock.get_cached_or_future_value(("json", spell[0]), False)
        entry = {"stock": f.result()}
        # cold: owner + in-flight joiner (a different spelling)
        own, _ = cold_svc["ser"].lookup(("json", spell[1]), False)
        join, _ = cold_svc["ser"].lookup(("json", spell[2]), False)
        entry["compile"], entry["inflight"] = own.result(timeout=300), join.result(timeout=300)
        mem, hit = cold_svc["ser"].lookup(("json", spell[3]), False)
        assert hit
        entry["memory"] = mem
        cold_svc["mark"].lookup(("json", spell[0]), False)[0].result(timeout=300)
        out[name] = entry
    warm_ser.grammar_compiler.flush()
    warm_mark.grammar_compiler.flush()
    # restart: new backends over the same directories
    disk_svc = service_for(persistent_backend(hf_tokenizer, ser_dir))
    mark_svc = service_for(persistent_backend(hf_tokenizer, mark_dir))
    for name, schema in SCHEMAS:
        spell = variants(schema)
        d = disk_svc.lookup(("json", spell[3]), False)[0]
        m = mark_svc.lookup(("json", spell[1]), False)[0]
        out[name]["disk"], out[name]["local_compile"] = d.result(timeout=300), m.result(timeout=300)
        assert d.source == "disk", name
        assert m.source == "local_compile", name
    return out


@pytest.mark.parametrize("name", [n for n, _ in SCHEMAS])
def test_masks_identical_to_stock(sources, hf_tokenizer, name):
    entry = sources[name]
    stock = entry["stock"].matcher
    ours = {k: v.matcher for k, v in entry.items() if k != "stock"}
    assert set(ours) == {"compile", "inflight", "memory", "disk", "local_compile"}
    for seed in (1, 2):
        for m in [stock, *ours.values()]:
            m.reset()
        steps = _walk(stock, ours, len(hf_tokenizer), seed)
        assert steps > 0
