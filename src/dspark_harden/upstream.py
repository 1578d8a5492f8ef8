"""Behaviour stock SGLang 0.5.23 already has, verified by probing the live code (never assumed).

Each probe inspects the real object; if an SGLang bump removes the behaviour, the feature turns
``failed`` and startup stops, because other hardenings rely on it.
"""

from __future__ import annotations

import importlib
import inspect

from .core.feature import Feature
from .core.hookspecs import hookimpl
from .core.patch import Role


def _source_of(target: str) -> str:
    module, _, qual = target.partition(":")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return inspect.getsource(obj)


def _probe_contains(target: str, *needles: str):
    def probe():
        src = _source_of(target)
        missing = [n for n in needles if n not in src]
        if missing:
            return False, f"{target} no longer contains {missing}"
        return True, f"{target} has it"

    return probe


def _probe_callable(target: str):
    def probe():
        module, _, qual = target.partition(":")
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return False, f"{target} does not exist"
        return callable(obj), f"{target} exists"

    return probe


ADVANCE_GRAMMAR_FSM = (
    "sglang.srt.managers.scheduler_components.batch_result_processor:SchedulerBatchResultProcessor.advance_grammar_fsm"
)


def _probe_advance_grammar_fsm_idempotent():
    """Call stock ``SchedulerBatchResultProcessor.advance_grammar_fsm`` twice on one real
    ``GenerationBatchResult`` of a spec-v2 decode step whose request has a real ``XGrammarGrammar``
    (xgrammar matcher for the regex ``abc`` over a 6-token vocabulary) and a verified run
    ``a b c <eos> x``; the behaviour the DSpark mask path relies on:

    - the first call advances the FSM over the run and stops at the terminating token (``x``, past
      ``<eos>``, is dropped: the retained run is ``a b c <eos>``) and marks the result advanced;
    - the second call changes nothing (a non-idempotent advance would feed ``a`` to a terminated
      matcher, or re-accept the run and abort the request).

    The request and batch are namespaces with the attributes the method reads (``grammar``,
    ``is_retracted``, ``finished()``, ``rid``, ``to_finish``; ``has_grammar``, ``forward_mode``,
    ``reqs``); the processor is the stock class (only its ``_accept_grammar_tokens`` is used)."""
    import types

    import torch
    import xgrammar as xgr

    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    vocab = ["<eos>", "a", "b", "c", "x", "y"]
    eos, a, b, c, x = 0, 1, 2, 3, 4
    info = xgr.TokenizerInfo(vocab, vocab_size=len(vocab), stop_token_ids=[eos])
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_regex("abc")
    grammar = XGrammarGrammar(xgr.GrammarMatcher(compiled), len(vocab), compiled, None, key_string="probe")
    req = types.SimpleNamespace(rid="dspark-harden-probe", grammar=grammar, is_retracted=False, to_finish=None,
                                finished=lambda: False)
    batch = types.SimpleNamespace(has_grammar=True, forward_mode=ForwardMode.DECODE, reqs=[req])
    run = [a, b, c, eos, x]
    result = GenerationBatchResult(next_token_ids=torch.tensor(run), accept_lens=torch.tensor([len(run)]),
                                   speculative_num_draft_tokens=len(run))
    proc = object.__new__(brp.SchedulerBatchResultProcessor)
    cls = brp.SchedulerBatchResultProcessor
    cls.advance_grammar_fsm(proc, result, batch)
    first = (list(grammar.accepted_tokens), result.grammar_advanced, result.grammar_retained_tokens,
             grammar.is_terminated(), req.to_finish)
    if first != ([a, b, c, eos], True, [[a, b, c, eos]], True, None):
        return False, (f"{ADVANCE_GRAMMAR_FSM}: one call over a b c <eos> x gave accepted={first[0]}, "
                       f"grammar_advanced={first[1]}, retained={first[2]}, terminated={first[3]}, "
                       f"to_finish={first[4]} (expected the FSM advanced once, truncated after <eos>)")
    cls.advance_grammar_fsm(proc, result, batch)
    second = (list(grammar.accepted_tokens), result.grammar_advanced, result.grammar_retained_tokens,
              grammar.is_terminated(), req.to_finish)
    if second != first:
        return False, (f"{ADVANCE_GRAMMAR_FSM} is not idempotent: a second call on the same result changed "
                       f"(accepted, advanced, retained, terminated, to_finish) from {first} to {second}")
    return True, f"{ADVANCE_GRAMMAR_FSM}: advances once, truncates after the terminating token, idempotent (called)"


UPSTREAM = [
    Feature(
        name="load-budget-throttle",
        area="ingress",
        description="DP controller refreshes its load budget at most every 20 ms",
        upstream_probe=_probe_contains(
            "sglang.srt.managers.data_parallel_controller:DataParallelController.refresh_load_budget",
            "_last_refresh_time", "0.02",
        ),
        roles=frozenset({Role.CONTROLLER}),
    ),
    Feature(
        name="grammar-fsm-advance",
        area="dspark-masks",
        description="single idempotent spec-v2 grammar FSM advance (advance_grammar_fsm + barrier)",
        upstream_probe=_probe_advance_grammar_fsm_idempotent,
        roles=frozenset({Role.SCHEDULER}),
    ),
    Feature(
        name="logical-host-pool-destroy",
        area="lifecycle",
        description="LogicalHostPool.destroy() matches the host-pool-group teardown interface",
        upstream_probe=_probe_callable("sglang.srt.mem_cache.memory_pool_host:LogicalHostPool.destroy"),
        roles=frozenset({Role.SCHEDULER}),
    ),
]


@hookimpl
def dspark_features():
    return UPSTREAM
