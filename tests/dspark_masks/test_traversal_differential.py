"""Differential tests: our batched native traversal vs stock SGLang 0.5.23's Python DFS
(``spec_utils.generate_token_bitmask``), on real grammar objects built by the stock XGrammar
backend (real tokenizer, real xgrammar), bit for bit, and grammar state untouched.

Stand-in: requests are :class:`~dspark_harden.dspark_masks.workload.Req` (``rid`` + ``grammar``);
stock reads only ``req.grammar``.
"""

from __future__ import annotations

import pytest
import torch

from dspark_harden.dspark_masks.resolve import UnsupportedGrammarError, resolve_jobs
from dspark_harden.dspark_masks.traversal import ChainTraverser, TraversalError, batch_traverse_available
from dspark_harden.dspark_masks.workload import GrammarFactory, Req, matcher_state

ENGINES = ["native", "scalar", "threads", "level"] + (["batch"] if batch_traverse_available() else [])


@pytest.fixture(scope="module")
def factory():
    return GrammarFactory(vocab=2048, pad=64, mix="all")


@pytest.fixture(scope="module")
def factory32k():
    return GrammarFactory(vocab=32000, pad=64, mix="json")


@pytest.fixture(scope="module")
def traversers():
    out = {e: ChainTraverser(e, threads=2) for e in ENGINES}
    yield out
    for t in out.values():
        t.close()


def stock_mask(reqs, draft, vocab_size):
    from sglang.srt.speculative.spec_utils import generate_token_bitmask

    bs, chain = draft.shape
    nxt = torch.full((bs, chain), -1, dtype=torch.int64)
    nxt[:, :-1] = torch.arange(1, chain, dtype=torch.int64)
    sib = torch.full((bs, chain), -1, dtype=torch.int64)
    mask, _ = generate_token_bitmask(reqs, nxt, sib, draft, vocab_size)
    if mask is None:  # no request has a grammar: stock builds nothing
        mask = torch.full((bs * chain, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    return mask


def ours_mask(traverser, reqs, draft, vocab_size):
    bs, chain = draft.shape
    out = torch.full((bs * chain, (vocab_size + 31) // 32), 12345, dtype=torch.int32)  # garbage: all overwritten
    # as the runtime does: the native engine clips each chain at its first out-of-vocab token itself
    jobs, _ = resolve_jobs(reqs, draft, vocab_size, clip_end=not traverser.clips_end)
    traverser.traverse(jobs, draft, out, vocab_size)
    return out


def check_equal(traverser, reqs, draft, vocab_size, kinds=None):
    before = [matcher_state(r.grammar) for r in reqs]
    ours = ours_mask(traverser, reqs, draft, vocab_size)
    after_ours = [matcher_state(r.grammar) for r in reqs]
    want = stock_mask(reqs, draft, vocab_size)
    after_stock = [matcher_state(r.grammar) for r in reqs]
    assert after_ours == before, "our traversal changed a grammar's state"
    assert after_stock == before, "stock traversal changed a grammar's state (reference broken)"
    if not torch.equal(ours, want):
        chain = draft.shape[1]
        bad = sorted({int(i) // chain for i in (ours != want).any(1).nonzero().flatten()})
        detail = [(r, kinds[r] if kinds else "", draft[r].tolist()) for r in bad[:5]]
        pytest.fail(f"{traverser.engine}: masks differ in rows of requests {bad[:10]}: {detail}")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_equal_stock(factory, traversers, engine, seed):
    bs, chain = [(64, 8), (17, 5), (3, 2), (40, 12)][seed % 4]
    wl = factory.workload(bs, chain, seed=seed, no_grammar=0.15, reasoning=0.25, corrupt=0.4)
    check_equal(traversers[engine], wl.reqs, wl.draft, wl.vocab_size, wl.kinds)


@pytest.mark.parametrize("engine", ENGINES)
def test_32k_tokenizer_64x8_equals_stock(factory32k, traversers, engine):
    wl = factory32k.workload(64, 8, seed=99)
    check_equal(traversers[engine], wl.reqs, wl.draft, wl.vocab_size, wl.kinds)


def _valid_chain(factory, which=0, accepted=3, chain=8):
    base, ids = factory.compiled[which]
    g = base.copy()
    for t in ids[:accepted]:
        g.accept_token(t)
    row = [ids[accepted - 1]] + ids[accepted : accepted + chain - 1]
    assert len(row) == chain
    return g, row, ids


@pytest.mark.parametrize("engine", ENGINES)
def test_invalid_token_at_every_depth(factory, traversers, engine):
    V = factory.vocab_size
    for depth in range(1, 8):
        for bad in (factory.tokenizer.convert_tokens_to_ids("<|pad|>"), V + 5, V - 1):
            g, row, _ = _valid_chain(factory)
            row[depth] = bad
            reqs = [Req("x", g), Req("none", None)]
            check_equal(traversers[engine], reqs, torch.tensor([row, row], dtype=torch.int64), V)


@pytest.mark.parametrize("engine", ENGINES)
def test_grammar_terminating_at_every_depth(factory, traversers, engine):
    """The instance completes inside the chain and the stop token follows at each depth."""
    V = factory.vocab_size
    base, ids = factory.compiled[4]  # regex: short instance
    n = len(ids) - 1  # tokens before the eos
    for stop_at in range(1, 8):
        k = n - (stop_at - 1)  # accepted prefix so that the eos lands at chain position stop_at
        if k < 1:
            continue
        g = base.copy()
        for t in ids[:k]:
            g.accept_token(t)
        row = ([ids[k - 1]] + ids[k:] + [5, 6, 7, 8, 9, 10, 11])[:8]
        assert row[stop_at] == factory.eos_id
        check_equal(traversers[engine], [Req("t", g)], torch.tensor([row], dtype=torch.int64), V)


@pytest.mark.parametrize("engine", ENGINES)
def test_terminated_matcher_at_root(factory, traversers, engine):
    V = factory.vocab_size
    base, ids = factory.compiled[4]
    g = base.copy()
    for t in ids:
        g.accept_token(t)
    assert g.is_terminated()
    row = [ids[-1], 1, 2, 3]
    plain, plain_row, _ = _valid_chain(factory, accepted=1, chain=4)
    reqs = [Req("done", g), Req("plain", plain)]
    draft = torch.tensor([row, plain_row], dtype=torch.int64)
    check_equal(traversers[engine], reqs, draft, V)


@pytest.mark.parametrize("engine", ENGINES)
def test_think_end_at_every_depth(factory, traversers, engine):
    V = factory.vocab_size
    end = factory.think_end_ids[0]
    base, ids = factory.compiled[0]
    for pos in range(1, 9):  # 8: not inside the chain
        obj = factory.reasoner(base.copy(), reasoning=True)
        obj.accept_token(100)
        row = ([100] + [200 + i for i in range(pos - 1)] + [end] + ids)[:8]
        check_equal(traversers[engine], [Req("think", obj)], torch.tensor([row], dtype=torch.int64), V)
        # the generation phase after it: root 0 on the inner matcher
    gen = factory.reasoner(base.copy(), reasoning=False)
    for t in ids[:2]:
        gen.accept_token(t)
    check_equal(traversers[engine], [Req("gen", gen)], torch.tensor([[ids[1]] + ids[2:9]], dtype=torch.int64), V)


@pytest.mark.parametrize("engine", ENGINES)
def test_multi_token_think_end_with_partial_match_carried_in(factory, traversers, engine):
    """Think-end sequence of 3 tokens; the wrapper already matched 1 of them before the step, and
    the chain holds a false start (KMP fallback) before the real completion."""
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject

    V = factory.vocab_size
    seq = (300, 301, 302)
    base, ids = factory.compiled[1]
    for pre in ([300], [], [300, 301]):
        for layout in ([301, 300, 300, 301, 302], [301, 302], [5, 300, 301, 5, 300, 301, 302], [300, 301, 300]):
            obj = ReasonerGrammarObject(base.copy(), think_end_ids=seq)
            obj.maybe_init_reasoning(True)
            for t in [50] + pre:
                obj.accept_token(t)
            row = ([pre[-1] if pre else 50] + layout + ids)[:8]
            check_equal(traversers[engine], [Req("mt", obj)], torch.tensor([row], dtype=torch.int64), V)


@pytest.mark.parametrize("engine", ENGINES)
def test_reasoning_in_grammar_and_no_inner_grammar(factory, traversers, engine):
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject

    V = factory.vocab_size
    g, row, _ = _valid_chain(factory, which=2, accepted=2)
    covered = ReasonerGrammarObject(g, think_end_ids=factory.think_end_ids)
    covered.maybe_init_reasoning(True)
    covered.set_reasoning_in_grammar()
    empty = ReasonerGrammarObject(
        None, think_end_ids=factory.think_end_ids, allocate_vocab_mask_fn=factory.backend.allocate_vocab_mask
    )
    empty.maybe_init_reasoning(True)
    never = ReasonerGrammarObject(_valid_chain(factory)[0], think_end_ids=factory.think_end_ids)  # no phase
    reqs = [Req("covered", covered), Req("empty", empty), Req("never", never)]
    draft = torch.tensor([row, row, row], dtype=torch.int64)
    check_equal(traversers[engine], reqs, draft, V)
    # without any active matcher the step is thinking-only: no jobs at all
    jobs, with_grammar = resolve_jobs(reqs[1:], draft[1:], V)
    assert jobs == [] and with_grammar == 2


def test_unsupported_grammars_fail_closed_naming_the_request(factory):
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject
    from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject

    V = factory.vocab_size
    g, row, _ = _valid_chain(factory)
    draft = torch.tensor([row], dtype=torch.int64)
    with pytest.raises(UnsupportedGrammarError, match="request bad-1: grammar object .*InvalidGrammarObject"):
        resolve_jobs([Req("bad-1", InvalidGrammarObject("nope"))], draft, V)
    strict = ReasonerGrammarObject(
        g, think_end_ids=factory.think_end_ids, enable_token_filter=True, think_excluded_token_ids=[5]
    )
    strict.maybe_init_reasoning(True)
    with pytest.raises(UnsupportedGrammarError, match="request strict-2: the strict-thinking token filter"):
        resolve_jobs([Req("strict-2", strict)], draft, V)
    wrapped_bad = ReasonerGrammarObject(InvalidGrammarObject("x"), think_end_ids=factory.think_end_ids)
    wrapped_bad.maybe_init_reasoning(False)
    with pytest.raises(UnsupportedGrammarError, match="request w-3: reasoning wrapper around"):
        resolve_jobs([Req("w-3", wrapped_bad)], draft, V)

    class Sub(type(g)):
        pass

    sub = Sub(g.matcher, g.vocab_size, g.ctx, g.override_stop_tokens)
    with pytest.raises(UnsupportedGrammarError, match="request sub-4"):
        resolve_jobs([Req("sub-4", sub)], draft, V)
    neg = list(row)
    neg[3] = -2
    with pytest.raises(TraversalError, match="request neg-5: negative draft token -2 at chain position 3"):
        resolve_jobs([Req("neg-5", g)], torch.tensor([neg], dtype=torch.int64), V)


def test_traverser_rejects_bad_buffers_and_duplicate_rows(factory):
    V = factory.vocab_size
    g, row, _ = _valid_chain(factory)
    draft = torch.tensor([row], dtype=torch.int64)
    t = ChainTraverser("scalar")
    jobs, _ = resolve_jobs([Req("a", g)], draft, V)
    with pytest.raises(TraversalError, match="bitmask must be"):
        t.traverse(jobs, draft, torch.empty((8, 3), dtype=torch.int32), V)
    with pytest.raises(TraversalError, match="draft tokens must be"):
        t.traverse(jobs, draft.to(torch.int32), torch.empty((8, (V + 31) // 32), dtype=torch.int32), V)
    with pytest.raises(TraversalError, match="assigned to two matchers"):
        t.traverse(jobs + jobs, draft, torch.empty((8, (V + 31) // 32), dtype=torch.int32), V)
    with pytest.raises(ValueError, match="unknown traversal engine"):
        ChainTraverser("fast")
    if not batch_traverse_available():
        with pytest.raises(TraversalError, match="batch_traverse_draft_tree"):
            ChainTraverser("batch")


def test_level_engine_leaves_matchers_as_found_when_a_token_is_refused(factory, monkeypatch):
    """Fail-closed path of the level engine: a matcher refusing a token its own mask allowed (forced
    here by wrapping xgrammar's batch_accept_token) raises naming the request, and every matcher
    that accepted tokens before the failure is rolled back."""
    import xgrammar as xgr

    from dspark_harden.dspark_masks.traversal import Job

    V = factory.vocab_size
    g1, row1, _ = _valid_chain(factory, which=0)
    g2, row2, _ = _valid_chain(factory, which=1)
    draft = torch.tensor([row1, row2], dtype=torch.int64)
    before = [matcher_state(g1), matcher_state(g2)]
    orig = xgr.BatchGrammarMatcher.batch_accept_token
    calls = {"n": 0}

    def accept(matchers, tokens, debug_print=False):
        calls["n"] += 1
        res = orig(matchers, tokens)
        if calls["n"] == 3:
            for i, m in enumerate(matchers):
                if m is g2.matcher and res[i]:
                    m.rollback(1)  # undo, and report a refusal
                    res[i] = False
        return res

    monkeypatch.setattr(xgr.BatchGrammarMatcher, "batch_accept_token", staticmethod(accept))
    t = ChainTraverser("level")
    jobs = [Job(0, g1.matcher, 0, 8, "ok"), Job(1, g2.matcher, 0, 8, "liar")]
    with pytest.raises(TraversalError, match="request liar: matcher refused draft token"):
        t.traverse(jobs, draft, torch.empty((16, (V + 31) // 32), dtype=torch.int32), V)
    assert calls["n"] == 3
    assert [matcher_state(g1), matcher_state(g2)] == before
