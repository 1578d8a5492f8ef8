"""Metric families of the DSV4 eager-prefill memory features, exported through
:func:`dspark_harden.dsv4_memory.feature.dspark_metrics`; runtime helpers never raise."""

from __future__ import annotations

import logging

from ..core import metrics as M
from ..core.metrics import DP_RANK, Family, MetricGroup
from .settings import GUARDS_FEATURE, POOL_FEATURE, QNORM_FEATURE

logger = logging.getLogger("dspark_harden.dsv4_memory")

GROUP = MetricGroup(
    "DSV4 eager-prefill memory (features `dsv4-sparse-prefill-pool`, `dsv4-inplace-q-norm-rope`, `dsv4-planner-guards`)",
    (
        Family(
            "dspark_harden_dsv4_sparse_prefill_reserved_bytes",
            "gauge",
            "Bytes of the sparse-prefill output reservation (out bf16 + max_logits and lse fp32, x slots), set once "
            "at start-up.",
            labels=("dp_rank",),
            multiprocess_mode="max",
            feature=POOL_FEATURE,
            roles=("scheduler",),
            precreate=((DP_RANK,),),
            aggregation="`sum` across ranks for the host total (each rank its own GPU).",
        ),
        Family(
            "dspark_harden_dsv4_sparse_prefill_high_water_tokens",
            "gauge",
            "Largest sparse-prefill call (query tokens) served from the reservation so far; compare with the "
            "reservation's capacity.",
            labels=("dp_rank",),
            multiprocess_mode="max",
            feature=POOL_FEATURE,
            roles=("scheduler",),
            precreate=((DP_RANK,),),
            aggregation="`max by (dp_rank)`.",
        ),
        Family(
            "dspark_harden_dsv4_sparse_prefill_calls_total",
            "counter",
            "Sparse-prefill FlashMLA calls by outcome: served (outputs inside the reservation), refused "
            "(larger than the reservation, other geometry, or more outputs alive than reserved: the request failed) "
            "or captured (made while a CUDA graph was being captured: left to stock, its outputs live in the "
            "graph's private pool).",
            labels=("dp_rank", "outcome"),
            feature=POOL_FEATURE,
            roles=("scheduler",),
            precreate=((DP_RANK, "served"), (DP_RANK, "refused"), (DP_RANK, "captured")),
            aggregation="`sum by (outcome) (rate(...))`; any refused needs a larger reservation.",
        ),
        Family(
            "dspark_harden_dsv4_inplace_q_norm_rope_calls_total",
            "counter",
            "DSV4 q_head_norm Q projections normed and roped in place (no per-call output allocation).",
            labels=("dp_rank",),
            feature=QNORM_FEATURE,
            roles=("scheduler",),
            precreate=((DP_RANK,),),
            aggregation="`sum (rate(...))`.",
        ),
        Family(
            "dspark_harden_dsv4_planner_checks_total",
            "counter",
            "DSV4 compress plans checked on the host before launch, by outcome: passed or rejected (the plan "
            "would have indexed past an allocation; the batch failed with a named error).",
            labels=("dp_rank", "outcome"),
            feature=GUARDS_FEATURE,
            roles=("scheduler",),
            precreate=((DP_RANK, "passed"), (DP_RANK, "rejected")),
            aggregation="`sum by (outcome) (increase(...))`; any rejected is a bug upstream of the planner.",
        ),
    ),
    intro="Emitted by DSV4 scheduler processes on CUDA hosts (these features need CUDA). See "
    "[dsv4_memory.md](dsv4_memory.md).",
)


_dp = M.process_dp_label
_safe = M.never_raises


@_safe
def pool_reserved(nbytes: int) -> None:
    M.get("dspark_harden_dsv4_sparse_prefill_reserved_bytes").labels(_dp()).set(nbytes)


@_safe
def pool_call(pool) -> None:
    dp = _dp()
    M.get("dspark_harden_dsv4_sparse_prefill_calls_total").labels(dp, "served").inc()
    M.get("dspark_harden_dsv4_sparse_prefill_high_water_tokens").labels(dp).set(pool.high_water_tokens)


@_safe
def pool_refused() -> None:
    M.get("dspark_harden_dsv4_sparse_prefill_calls_total").labels(_dp(), "refused").inc()


@_safe
def pool_captured() -> None:
    M.get("dspark_harden_dsv4_sparse_prefill_calls_total").labels(_dp(), "captured").inc()


@_safe
def qnorm_call() -> None:
    M.get("dspark_harden_dsv4_inplace_q_norm_rope_calls_total").labels(_dp()).inc()


@_safe
def planner_check(passed: bool) -> None:
    M.get("dspark_harden_dsv4_planner_checks_total").labels(_dp(), "passed" if passed else "rejected").inc()
