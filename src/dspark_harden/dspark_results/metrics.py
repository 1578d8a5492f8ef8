"""Metric families of the DSpark result materializer (feature ``dspark-result-materializer``)."""

from __future__ import annotations

from typing import Callable

from ..core.metrics import DP_RANK, Family, MetricGroup
from .materializer import OUTCOMES, PHASES
from .settings import FEATURE

PHASE_FAMILY = "dspark_harden_dspark_result_phase_seconds"
RESULTS_FAMILY = "dspark_harden_dspark_results_total"

GROUP = MetricGroup(
    "DSpark result materializer (feature `dspark-result-materializer`)",
    (
        Family(
            PHASE_FAMILY,
            "histogram",
            "Seconds per DSpark decode result and phase: queue (enqueue on the scheduler thread to the "
            "materializer thread taking it), copy_wait (the thread waiting on the D2H copy event), convert "
            "(tolist of token ids, accept/block-accept/cap lengths, logprob lists), consumer_wait (the "
            "scheduler thread blocked in copy_done.synchronize() until the record was ready: the time the "
            "materializer did not hide).",
            labels=("dp_rank", "phase"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, p) for p in PHASES),
            aggregation="`histogram_quantile(0.99, sum by (le, phase) (rate(..._bucket[5m])))`; keep `dp_rank` "
            "to compare ranks. `consumer_wait` near 0 with `copy_wait` > 0 means the wait left "
            "the scheduler thread.",
        ),
        Family(
            RESULTS_FAMILY,
            "counter",
            "DSpark decode results by outcome: materialized (record attached by the thread), "
            "converted_by_consumer (the copy was complete when the consumer arrived before the thread had "
            "started: the scheduler thread converted the step itself instead of handing the GIL over), "
            "failed (the copy wait or "
            "conversion raised: the step fails), timed_out (no record within "
            "DSPARK_HARDEN_DSPARK_RESULTS_TIMEOUT_S, or the queue stayed full), thread_dead (the "
            "materializer thread was not running), missing_record / wrong_step (a consumer found no record, "
            "or another step's).",
            labels=("dp_rank", "outcome"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, o) for o in OUTCOMES),
            aggregation="`sum by (outcome) (rate(...[5m]))`; any outcome but `materialized` and `converted_by_consumer` is a failed step.",
        ),
    ),
    intro="Emitted by scheduler processes on every DSpark decode (verify) step under overlap scheduling, "
    "only when `DSPARK_HARDEN_DSPARK_RESULTS=1`. See [dspark_results.md](dspark_results.md).",
)


def dp_label() -> str:
    from ..core.metrics import process_dp_label

    return process_dp_label()


def observer(label: str) -> Callable[[str, float], None]:
    from ..core import metrics

    cache: dict = {}

    @metrics.never_raises
    def observe(phase: str, seconds: float) -> None:
        ch = cache.get(phase)
        if ch is None:
            ch = cache[phase] = metrics.child(PHASE_FAMILY, label, phase)
        ch.observe(seconds)

    return observe


def counter(label: str) -> Callable[[str], None]:
    from ..core import metrics

    cache: dict = {}

    @metrics.never_raises
    def count(outcome: str) -> None:
        ch = cache.get(outcome)
        if ch is None:
            ch = cache[outcome] = metrics.child(RESULTS_FAMILY, label, outcome)
        ch.inc()

    return count
