"""Grammar-aware DSpark drafting (issue 43): stock SGLang 0.5.23's own Markov draft
(``dspark_draft.draft_markov_block`` -> ``_draft_step`` -> ``MarkovSampleStep`` / ``MarkovGreedyStep``,
their torch forms on CPU) with the feature's wraps in place of the module's ``_draft_step`` and
``draft_markov_block``, a real ``VanillaMarkov`` head (random weights), real grammar objects from the
stock XGrammar backend (real xgrammar, a locally generated tokenizer), each advanced into the middle of
a valid instance.

Oracle: stock's verify mask over the finished chain ``[anchor, d_0 .. d_{gamma-1}]``
(``spec_utils.generate_token_bitmask``, what the target's verify is masked with): draft step ``k`` must
have been masked with its row ``k``. Checked three ways: every draft token the grammar is still live
for is allowed by that row; the greedy tokens equal an independent re-computation (base logits + the
head's bias, masked with row ``k``, argmax); under sampling the kept step logits (the draft distribution
the accept test reads) are -inf exactly where row ``k`` forbids and the drawn tokens follow them.

Stand-ins: requests are ``workload.Req`` (``rid`` + ``grammar``: stock reads only ``req.grammar``); the
TP sync is stock's ``SpecTpSync`` over a one-rank group (no broadcast). Forked: the wraps replace
attributes of a stock SGLang module.
"""

from __future__ import annotations

import random
import types

import pytest
import torch

from dspark_harden.dspark_masks import draft as D
from dspark_harden.dspark_masks.workload import GrammarFactory, Req, matcher_state

pytestmark = pytest.mark.forked

GAMMA = 6


@pytest.fixture(scope="module")
def factory():
    return GrammarFactory(vocab=2048, pad=64, mix="json")


@pytest.fixture
def dspark(monkeypatch):
    """Stock ``dspark_draft`` with the feature's wraps where the patches put them (module globals)."""
    from sglang.srt.speculative.dspark_components import dspark_draft as dd

    monkeypatch.setattr(dd, "_draft_step", D.wrap_draft_step(dd._draft_step))
    monkeypatch.setattr(dd, "draft_markov_block", D.wrap_markov_block(dd.draft_markov_block))
    return dd


def _head(vocab_size: int, seed: int):
    from sglang.srt.models.dspark import VanillaMarkov

    torch.manual_seed(seed)
    head = VanillaMarkov(vocab_size=vocab_size, markov_rank=8)
    with torch.no_grad():
        head.markov_w1.weight.normal_(0, 1.0)
        head.markov_w2.weight.normal_(0, 1.0)
    return head


def _requests(factory, bs: int, seed: int, no_grammar: int = 2):
    """``bs`` requests: the first ``no_grammar`` free, the others a grammar advanced over a random
    prefix of its valid instance; the anchor is the prefix's last token."""
    rng = random.Random(seed)
    reqs, anchors = [], []
    for r in range(bs):
        if r < no_grammar:
            reqs.append(Req(f"free-{r}", None))
            anchors.append(rng.randrange(factory.vocab_size))
            continue
        base, ids = factory.compiled[rng.randrange(len(factory.compiled))]
        g = base.copy()
        n = rng.randrange(1, len(ids) - 1)
        for t in ids[:n]:
            g.accept_token(t)
        reqs.append(Req(f"req-{r}", g))
        anchors.append(ids[n - 1])
    return reqs, torch.tensor(anchors, dtype=torch.int64)


def _verify_rows(reqs, chain: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Stock's verify mask of the linear chains, as [bs, chain, words] int32."""
    from sglang.srt.speculative.spec_utils import generate_token_bitmask

    bs, n = chain.shape
    nxt = torch.full((bs, n), -1, dtype=torch.int64)
    nxt[:, :-1] = torch.arange(1, n, dtype=torch.int64)
    sib = torch.full((bs, n), -1, dtype=torch.int64)
    mask, _ = generate_token_bitmask(reqs, nxt, sib, chain, vocab_size)
    return mask.view(bs, n, -1)


def _allowed(words: torch.Tensor, width: int, vocab_size: int) -> torch.Tensor:
    bits = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1).bool()
    out = torch.zeros(width, dtype=torch.bool)
    n = min(width, vocab_size)
    out[:n] = bits[:n]
    return out


def _live_steps(grammar, tokens: list) -> int:
    """How many draft steps the row's grammar is live for (stock's traversal over the chain stops
    at a terminated grammar); the grammar is left as it was."""
    n = 0
    accepted = 0
    try:
        for k, t in enumerate(tokens):
            if grammar.is_terminated():
                break
            n = k + 1
            if k == len(tokens) - 1:
                break
            grammar.accept_token(int(t))
            accepted += 1
    finally:
        if accepted:
            grammar.rollback(accepted)
    return n


def _run(dd, reqs, anchors, base, head, *, sampled: bool, vocab_size: int, seed: int = 7):
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    bs = base.shape[0]
    noise = dd.DraftNoise(key=dd.draft_noise_key(seed), offset=torch.zeros(1, dtype=torch.int64))
    D._LOCAL.batch = (reqs, vocab_size) if reqs is not None else None
    try:
        tokens, logits = dd.draft_markov_block(
            markov_head=head,
            base_logits=base,
            anchor_tokens=anchors,
            draft_hidden=None,
            step_temperatures=torch.ones(bs) if sampled else torch.zeros(bs),
            noise=noise,
            tp_sync=SpecTpSync(types.SimpleNamespace(world_size=1)),
            greedy_draft=not sampled,
        )
    finally:
        D._LOCAL.batch = None
    return tokens, logits


def test_greedy_draft_step_k_is_masked_with_the_verify_row_k(factory, dspark):
    """Fails if a step's mask is not the verify row of that step (e.g. step 0's mask reused for every
    step: the independent argmax differs and tokens leave the grammar), if a free row is masked, or if
    the block leaves a grammar advanced."""
    for seed in range(4):  # one fork for the four workloads (each fork re-imports SGLang and the grammars)
        bs, V = 12, factory.vocab_size
        width = V + 32  # the logits are wider than the vocab (padded lm_head)
        reqs, anchors = _requests(factory, bs, seed)
        head = _head(V, seed)
        torch.manual_seed(100 + seed)
        base = torch.randn(bs, GAMMA, width) * 3
        before = [matcher_state(r.grammar) for r in reqs]
        tokens, _ = _run(dspark, reqs, anchors, base.clone(), head, sampled=False, vocab_size=V)
        assert [matcher_state(r.grammar) for r in reqs] == before, "the draft left a grammar advanced"
        free_tokens, _ = _run(dspark, None, anchors, base.clone(), head, sampled=False, vocab_size=V)

        chain = torch.cat([anchors[:, None], tokens], dim=1)
        rows = _verify_rows(reqs, chain, V)
        masked_positions = 0
        for r, req in enumerate(reqs):
            if req.grammar is None:
                assert tokens[r].tolist() == free_tokens[r].tolist(), f"row {r} (no grammar) drafted differently"
                continue
            live = _live_steps(req.grammar, tokens[r].tolist())
            prev = int(anchors[r])
            for k in range(GAMMA):
                if k < live:
                    allowed = _allowed(rows[r, k], width, V)
                    logits = base[r, k].clone()
                    logits[:V] += head.markov_w2(head.markov_w1(torch.tensor([prev])))[0].detach()
                    want = int(torch.where(allowed, logits, torch.tensor(float("-inf"))).argmax())
                    assert bool(allowed[int(tokens[r, k])]), f"row {r} step {k}: token {int(tokens[r, k])} not allowed"
                    assert int(tokens[r, k]) == want, (
                        f"row {r} step {k}: drafted {int(tokens[r, k])}, masked argmax {want}"
                    )
                    masked_positions += 1
                prev = int(tokens[r, k])
        assert masked_positions >= (bs - 2) * 2  # the check ran over several steps of most rows


def test_sampled_draft_keeps_the_masked_distribution_and_draws_from_it(factory, dspark):
    """Under sampling the kept step logits (``corrected_logits``: the draft distribution the sampling
    accept test uses) are -inf exactly where the verify row forbids, finite where it allows, and the
    drawn tokens follow that distribution: 4,000 step-0 draws of one constrained row against its
    masked softmax (total variation < 0.05; Philox with a fixed key: deterministic). Fails if the mask
    is applied after the draw, or to the tokens but not the kept logits."""
    V = factory.vocab_size
    width = V + 32
    reqs, anchors = _requests(factory, 6, seed=3, no_grammar=1)
    head = _head(V, 3)
    torch.manual_seed(5)
    base = torch.randn(6, GAMMA, width)
    tokens, logits = _run(dspark, reqs, anchors, base.clone(), head, sampled=True, vocab_size=V)
    chain = torch.cat([anchors[:, None], tokens], dim=1)
    rows = _verify_rows(reqs, chain, V)
    for r, req in enumerate(reqs):
        if req.grammar is None:
            assert torch.isfinite(logits[r]).all(), "a free row's draft distribution was masked"
            continue
        live = _live_steps(req.grammar, tokens[r].tolist())
        for k in range(live):
            allowed = _allowed(rows[r, k], width, V)
            assert torch.equal(torch.isfinite(logits[r, k].float()), allowed), f"row {r} step {k}"
            assert bool(allowed[int(tokens[r, k])]), f"row {r} step {k}"

    # distribution of step 0 for one constrained row with several allowed tokens, at the draft's noise
    r = next(i for i, q in enumerate(reqs) if q.grammar is not None and int(_allowed(rows[i, 0], width, V).sum()) > 3)
    one = [reqs[r]]
    counts = torch.zeros(width)
    n = 4000
    probs = None
    for i in range(n):
        t, lg = _run(
            dspark, one, anchors[r : r + 1], base[r : r + 1, :1].clone(), head, sampled=True, vocab_size=V, seed=i
        )
        counts[int(t[0, 0])] += 1
        probs = torch.softmax(lg[0, 0].float(), dim=-1) if probs is None else probs
    tv = 0.5 * float((counts / n - probs).abs().sum())
    assert counts[~_allowed(rows[r, 0], width, V)].sum() == 0
    assert tv < 0.05, tv


def test_a_row_whose_draft_ends_the_grammar_stops_being_masked_and_is_counted(factory, dspark):
    """A grammar one token before its end: the draft's first token ends it (the only allowed tokens
    close the instance), later steps are not masked (the target rejects them), the block counts as cut,
    and the grammar is back where it was."""
    V = factory.vocab_size
    base_g, ids = factory.compiled[4]  # the regex, its last token before the stop token
    g = base_g.copy()
    for t in ids[:-1]:
        g.accept_token(t)
    reqs = [Req("end", g)]
    before = matcher_state(g)
    head = _head(V, 1)
    block = D._Block(reqs, V)
    logits = torch.randn(1, V)
    block.step(0, torch.tensor([ids[-2]]), logits)
    assert torch.isfinite(logits[0]).sum() >= 1 and bool(torch.isfinite(logits[0, ids[-1]]))
    block.step(1, torch.tensor([ids[-1]]), torch.randn(1, V))  # the stop token: the grammar terminates
    assert block.cut and block.alive == [] and block.masked == 1
    untouched = torch.randn(1, V)
    kept = untouched.clone()
    block.step(2, torch.tensor([5]), untouched)
    assert torch.equal(untouched, kept)
    block.rollback()
    assert matcher_state(g) == before
    del head


# --- start-up: the switch on a server whose draft cannot be masked is refused, before the weights load ---


def _bind_and_start(monkeypatch, environ: dict, **server_args):
    """The feature module bound by the real binder for a scheduler whose context carries a real
    ``ServerArgs``, then its start-up hook (what the plugin runs in the scheduler before the model
    loads). Returns the bind report; raises the start-up's ``BindError``."""
    import pluggy
    from sglang.srt.server_args import ServerArgs

    from dspark_harden.core import binder, hookspecs, roles
    from dspark_harden.core.patch import Role
    from dspark_harden.core.roles import ProcessContext
    from dspark_harden.dspark_masks import feature as F

    args = ServerArgs(model_path="dummy", **server_args)
    monkeypatch.setattr(roles, "CONTEXT", ProcessContext(Role.SCHEDULER, args, 0, 0))
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(F, name="dspark_harden.dspark_masks.feature")
    report = binder.bind(Role.SCHEDULER, pm=pm, environ=dict(environ))
    assert report.ok, report.failures()
    F.dspark_process_bound(role=Role.SCHEDULER, settings=binder.STATE.settings, report=report)
    return report


ON = {"DSPARK_HARDEN_DSPARK_DRAFT_MASKS": "1"}
DSPARK = dict(speculative_algorithm="DSPARK", speculative_draft_model_path="dummy-draft")
REFUSED = [  # server arguments, environment, what the refusal names
    (dict(speculative_algorithm="EAGLE", speculative_draft_model_path="d", device="cuda"), {}, "is EAGLE"),
    (dict(device="cpu"), {}, "--speculative-algorithm is unset"),
    (dict(DSPARK, device="cuda"), {}, "SGLANG_DSPARK_FOLDED_PROPOSAL=0"),
    (dict(DSPARK, device="cpu", grammar_backend="none"), {}, "--grammar-backend none"),
    # stock reads a value it cannot parse as its default (folded proposal on), and so does the check
    (dict(DSPARK, device="cuda"), {"SGLANG_DSPARK_FOLDED_PROPOSAL": "maybe"}, "SGLANG_DSPARK_FOLDED_PROPOSAL=0"),
]
BOUND = [
    (dict(DSPARK, device="cpu"), {}),
    (dict(DSPARK, device="cuda"), {"SGLANG_DSPARK_FOLDED_PROPOSAL": "0"}),
    (dict(DSPARK, device="cuda"), {"SGLANG_DSPARK_FOLDED_PROPOSAL": "n"}),  # stock reads "n" as off too
    (dict(DSPARK, device="cuda", disable_cuda_graph=True), {}),
]


def test_switch_on_a_server_it_cannot_mask_is_refused_at_startup_and_binds_where_it_can(monkeypatch):
    """Refused (EAGLE, no speculative decoding, the folded proposal inside the draft CUDA graph, no grammar
    backend), each naming its precondition and the switch; bound, with the three wraps in place, on CPU,
    with the eager proposal, without CUDA graphs. Fails if a refusal is missing or a servable server is
    refused."""
    from sglang.srt.speculative.dspark_components import dspark_draft as dd

    from dspark_harden.core import binder

    for server_args, env, needle in REFUSED:
        with monkeypatch.context() as m:
            m.delenv("SGLANG_DSPARK_FOLDED_PROPOSAL", raising=False)
            for k, v in env.items():
                m.setenv(k, v)
            with pytest.raises(
                binder.BindError, match=r"\[dspark-draft-masks\] DSPARK_HARDEN_DSPARK_DRAFT_MASKS=1: "
            ) as exc:
                _bind_and_start(m, ON, **server_args)
            assert needle in str(exc.value), str(exc.value)
            binder.revert_all()
    for server_args, env in BOUND:
        with monkeypatch.context() as m:
            m.delenv("SGLANG_DSPARK_FOLDED_PROPOSAL", raising=False)
            for k, v in env.items():
                m.setenv(k, v)
            report = _bind_and_start(m, ON, **server_args)
            st = next(f for f in report.features if f.name == "dspark-draft-masks")
            assert st.status == "bound", (server_args, st.status, st.detail)
            assert hasattr(dd._draft_step, "__wrapped__") and hasattr(dd.draft_markov_block, "__wrapped__")
            binder.revert_all()
    assert not hasattr(dd._draft_step, "__wrapped__")  # reverted: stock again
