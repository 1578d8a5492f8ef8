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
        upstream_probe=_probe_contains(
            "sglang.srt.managers.scheduler_components.batch_result_processor:SchedulerBatchResultProcessor.advance_grammar_fsm",
            "grammar_advanced",
        ),
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
