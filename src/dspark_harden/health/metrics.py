"""The health-scheduler feature's metric family, exported through
:func:`dspark_harden.health.feature.dspark_metrics`."""

from __future__ import annotations

from ..core.metrics import Family, MetricGroup

FEATURE = "health-scheduler"

GROUP = MetricGroup(
    "Health (feature `health-scheduler`)",
    (
        Family(
            "dspark_harden_health_scheduler_checks_total",
            "counter",
            "GET /health_scheduler answers by outcome: ok, or the 503 reason (no_state, shutting_down, "
            "starting, read_error, missing_ranks, duplicate_ranks, unexpected_ranks, "
            "non_positive_timestamp, future_timestamp, stale, child_died, dp2_stalled).",
            labels=("outcome",),
            feature=FEATURE,
            roles=("main",),
            precreate=tuple(
                (o,)
                for o in (
                    "ok",
                    "no_state",
                    "shutting_down",
                    "starting",
                    "read_error",
                    "missing_ranks",
                    "duplicate_ranks",
                    "unexpected_ranks",
                    "non_positive_timestamp",
                    "future_timestamp",
                    "stale",
                    "child_died",
                    "dp2_stalled",
                )
            ),
            aggregation="`sum by (outcome) (increase(...))`; with several HTTP workers each counts the probes it served.",
        ),
    ),
    intro="Counted by the HTTP process(es) that answer `GET /health_scheduler`. See [health.md](health.md).",
)
