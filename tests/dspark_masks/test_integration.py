"""The DSpark-only patches bound through the real binder, and the patched worker path (as
``DSparkWorkerV2._forward_decode`` calls it) against stock on the same inputs.

Binding tests run forked so no patch leaks. The device is the CPU here (no GPU on this machine):
the pipeline runs its synchronous CPU protocol; tests/gpu covers the CUDA streams and events.
Stand-in: ``sampling_info`` is a namespace with the two attributes the function touches
(``vocab_size`` read, ``grammar_mask`` cleared); requests are workload ``Req`` objects.
"""

from __future__ import annotations

import importlib
import sys
import types

import pluggy
import pytest
import sglang.srt.speculative.dspark_components.dspark_worker_v2 as W  # warm import for the forks
import sglang.srt.speculative.spec_utils as SU
import torch

from dspark_harden.core import binder, hookspecs
from dspark_harden.core.patch import Role
from dspark_harden.dspark_masks import feature as F
from dspark_harden.dspark_masks import integration as I
from dspark_harden.dspark_masks.pipeline import PipelineError
from dspark_harden.dspark_masks.workload import GrammarFactory, Req, matcher_state

ON = {F.SWITCH: "1"}


def _importable(name):
    try:
        return importlib.import_module(name)
    except ImportError:  # ngram_worker needs sgl_kernel's CUDA ops: not importable on this CPU machine
        return None


OTHER_ALGORITHMS = [
    m
    for m in (
        _importable("sglang.srt.speculative.eagle_worker_common"),
        _importable("sglang.srt.speculative.dflash_worker_v2"),
        _importable("sglang.srt.speculative.ngram_worker"),
    )
    if m is not None
]


def manager():
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(F, name="dspark_harden.dspark_masks.feature")
    return pm


def bind(environ=ON):
    return binder.bind(Role.SCHEDULER, pm=manager(), environ=dict(environ))


@pytest.fixture(scope="module")
def factory():
    return GrammarFactory(vocab=2048, pad=64, mix="all")


def stock_objects():
    return SU.GrammarTree, SU.build_grammar_vocab_mask


@pytest.mark.forked
def test_binds_in_the_dspark_module_only_and_reverts():
    tree, build = stock_objects()
    report = bind()
    assert report.ok, report.failures()
    st = [f for f in report.features if f.name == F.FEATURE][0]
    assert st.status == "bound" and {t.target for t in st.targets} == {I.TREE_TARGET, I.BUILD_TARGET}
    assert W.GrammarTree is not tree and issubclass(W.GrammarTree, tree)
    assert W.build_grammar_vocab_mask is not build
    # the shared originals and every other algorithm keep the stock objects
    assert SU.GrammarTree is tree and SU.build_grammar_vocab_mask is build
    assert len(OTHER_ALGORITHMS) >= 2  # EAGLE and DFlash import on CPU
    for mod in OTHER_ALGORITHMS:
        assert mod.GrammarTree is tree and mod.build_grammar_vocab_mask is build, mod.__name__
    # nothing else anywhere was re-pointed (propagate=False)
    for name, mod in list(sys.modules.items()):
        if mod is None or mod is W:
            continue
        d = getattr(mod, "__dict__", {})
        assert d.get("build_grammar_vocab_mask", build) is build, name
        assert d.get("GrammarTree", tree) is tree, name
    binder.revert_all()
    assert W.GrammarTree is tree and W.build_grammar_vocab_mask is build
    report = bind()
    assert report.ok and W.GrammarTree is not tree
    binder.revert_all()


@pytest.mark.forked
def test_disabled_by_default():
    tree, build = stock_objects()
    report = bind(environ={})
    st = [f for f in report.features if f.name == F.FEATURE][0]
    assert st.status == "disabled" and not st.targets
    assert W.GrammarTree is tree and W.build_grammar_vocab_mask is build


@pytest.mark.forked
def test_semantic_pin_drift_fails_the_bind_unless_allowed(monkeypatch):
    target = "sglang.srt.speculative.spec_utils:traverse_tree"
    monkeypatch.setitem(I.SEMANTIC_PINS, target, "0000000000000000")
    report = bind()
    assert not report.ok
    assert any("traverse_tree: stock source drifted" in line for line in report.failures()), report.failures()
    binder.revert_all()
    report = bind(environ={**ON, "DSPARK_HARDEN_ALLOW_DRIFT": target})
    assert report.ok, report.failures()
    binder.revert_all()


def _barrier_that_advances(req, token, calls):
    def barrier():
        calls.append("barrier")
        req.grammar.accept_token(token)  # the previous step's committed token (upstream FSM advance)
        return None

    return barrier


@pytest.mark.forked
def test_patched_worker_path_equals_stock_over_steps(factory):
    """Several verify steps through the patched names, exactly as the worker calls them, against the
    stock function on twin requests: identical masks, identical masked logits, barrier first."""
    report = bind()
    assert report.ok, report.failures()
    V = factory.vocab_size
    for step in range(6):
        wl_ours = factory.workload(24, 6, seed=100 + step)
        wl_stock = factory.workload(24, 6, seed=100 + step)  # twin grammar objects, same states
        # the barrier advances one request's grammar by a valid token before the traversal reads it
        target = next(
            i
            for i, r in enumerate(wl_ours.reqs)
            if type(r.grammar).__name__ == "XGrammarGrammar" and not r.grammar.is_terminated()
        )
        m = torch.zeros((1, (V + 31) // 32), dtype=torch.int32)
        wl_ours.reqs[target].grammar.matcher.fill_next_token_bitmask(m, 0)
        token = next(t for t in range(V) if (int(m[0, t // 32]) >> (t % 32)) & 1)
        calls_ours, calls_stock = [], []
        b_ours = _barrier_that_advances(wl_ours.reqs[target], token, calls_ours)
        b_stock = _barrier_that_advances(wl_stock.reqs[target], token, calls_stock)

        info_ours = types.SimpleNamespace(vocab_size=V, grammar_mask="leftover")
        tree = W.GrammarTree.from_linear_chain(wl_ours.draft.clone())
        gm = W.build_grammar_vocab_mask(
            reqs=wl_ours.reqs, tree=tree, sampling_info=info_ours, device="cpu", barrier=b_ours
        )
        info_stock = types.SimpleNamespace(vocab_size=V, grammar_mask="leftover")
        nxt = torch.full((24, 6), -1, dtype=torch.int64)
        nxt[:, :-1] = torch.arange(1, 6)
        stock_tree = SU.GrammarTree.from_host(nxt, torch.full((24, 6), -1, dtype=torch.int64), wl_stock.draft)
        want = SU.build_grammar_vocab_mask(
            reqs=wl_stock.reqs, tree=stock_tree, sampling_info=info_stock, device="cpu", barrier=b_stock
        )
        assert calls_ours == calls_stock == ["barrier"]
        assert info_ours.grammar_mask is None and info_stock.grammar_mask is None
        got_mask = torch.full_like(want.vocab_mask, -1) if gm is None else gm.vocab_mask.clone()
        assert torch.equal(got_mask, want.vocab_mask), f"step {step}: masks differ"
        logits_ours = torch.randn((24 * 6, V), generator=torch.Generator().manual_seed(step))
        logits_stock = logits_ours.clone()
        if gm is not None:
            gm.apply(logits_ours)
        want.apply(logits_stock)
        assert torch.equal(logits_ours, logits_stock)
        assert [matcher_state(r.grammar) for r in wl_ours.reqs] == [matcher_state(r.grammar) for r in wl_stock.reqs]
    rt = I.runtime()
    assert rt.outcomes["masked"] == 6
    assert set(rt.last_phases) >= {
        "barrier",
        "buffer_wait",
        "draft_copy_wait",
        "resolution",
        "traversal",
        "mask_upload",
        "total",
    }
    binder.revert_all()


@pytest.mark.forked
def test_thinking_only_step_returns_no_mask_and_clears_the_leftover(factory):
    from dspark_harden.core import metrics

    assert bind().ok
    V = factory.vocab_size
    base, ids = factory.compiled[0]
    obj = factory.reasoner(base.copy(), reasoning=True)
    reqs = [Req("t", obj), Req("n", None)]
    draft = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]], dtype=torch.int64)
    info = types.SimpleNamespace(vocab_size=V, grammar_mask="leftover")
    gm = W.build_grammar_vocab_mask(
        reqs=reqs, tree=W.GrammarTree.from_linear_chain(draft), sampling_info=info, device="cpu", barrier=None
    )
    assert gm is None and info.grammar_mask is None
    assert I.runtime().outcomes == {"masked": 0, "thinking_only": 1}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in metrics.get("dspark_harden_dspark_mask_steps_total").collect()[0].samples
    }
    assert samples[("dspark_harden_dspark_mask_steps_total", (("dp_rank", "none"), ("outcome", "thinking_only")))] == 1
    # the next step works (the slot was released)
    g = base.copy()
    gm = W.build_grammar_vocab_mask(
        reqs=[Req("p", g), Req("n", None)],
        tree=W.GrammarTree.from_linear_chain(torch.tensor([[5] + ids[:3], [1, 2, 3, 4]])),
        sampling_info=info,
        device="cpu",
        barrier=None,
    )
    assert gm is not None
    gm.apply(torch.zeros((8, V)))
    binder.revert_all()


@pytest.mark.forked
def test_fail_closed_paths_name_the_request_and_keep_the_pipeline_usable(factory):
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    from dspark_harden.dspark_masks.resolve import UnsupportedGrammarError

    assert bind().ok
    V = factory.vocab_size
    base, ids = factory.compiled[0]
    draft = torch.tensor([[5] + ids[:3]], dtype=torch.int64)
    info = types.SimpleNamespace(vocab_size=V, grammar_mask=None)
    with pytest.raises(PipelineError, match="no request carries a grammar object"):
        W.build_grammar_vocab_mask(
            reqs=[Req("empty-1", None)],
            tree=W.GrammarTree.from_linear_chain(draft),
            sampling_info=info,
            device="cpu",
            barrier=None,
        )
    with pytest.raises(UnsupportedGrammarError, match="request odd-2"):
        W.build_grammar_vocab_mask(
            reqs=[Req("odd-2", InvalidGrammarObject("x"))],
            tree=W.GrammarTree.from_linear_chain(draft),
            sampling_info=info,
            device="cpu",
            barrier=None,
        )
    with pytest.raises(PipelineError, match="GrammarTree patch .* is not live"):
        W.build_grammar_vocab_mask(
            reqs=[Req("p", base.copy())],
            tree=SU.GrammarTree.from_host(draft, draft, draft),
            sampling_info=info,
            device="cpu",
            barrier=None,
        )
    with pytest.raises(PipelineError, match="only linear-chain"):
        W.GrammarTree.from_device(draft, draft, draft)
    from dspark_harden.dspark_masks.pipeline import GeometryError

    with pytest.raises(GeometryError, match="chain length changed from 4 to 5"):
        W.GrammarTree.from_linear_chain(torch.zeros((1, 5), dtype=torch.int64))
    gm = W.build_grammar_vocab_mask(
        reqs=[Req("ok", base.copy())],
        tree=W.GrammarTree.from_linear_chain(draft),
        sampling_info=info,
        device="cpu",
        barrier=None,
    )
    assert gm is not None
    gm.apply(torch.zeros((4, V)))
    binder.revert_all()


def test_server_args_the_native_path_cannot_reproduce_are_refused():
    ok = types.SimpleNamespace(grammar_backend=None, enable_strict_thinking=False)
    assert F.server_args_problems(ok) == []
    assert F.server_args_problems(types.SimpleNamespace(grammar_backend="xgrammar")) == []
    bad = F.server_args_problems(types.SimpleNamespace(grammar_backend="llguidance", enable_strict_thinking=True))
    assert len(bad) == 2 and "llguidance" in bad[0] and "--enable-strict-thinking" in bad[1]


def test_settings_are_strict():
    from dspark_harden.core.settings import SettingsError, load_settings

    specs = F.dspark_settings()
    s = load_settings(specs, environ={})
    assert s[F.SWITCH] is False and s[F.ENGINE] == "auto" and s[F.THREADS] == 2
    with pytest.raises(SettingsError) as err:
        load_settings(specs, environ={F.SWITCH: "yes", F.ENGINE: "fast", F.THREADS: "0"})
    text = str(err.value)
    assert F.SWITCH in text and F.ENGINE in text and F.THREADS in text
