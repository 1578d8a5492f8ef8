"""The native DP2 exchange's metric families, exported through
:func:`dspark_harden.dp2.feature.dspark_metrics`. Values are accumulated in-process per call and
flushed at most once per second (:mod:`dspark_harden.dp2.channels`), so the hot path never touches
prometheus."""

from __future__ import annotations

from ..core.metrics import DP_RANK, Family, MetricGroup
from .settings import FEATURE

DP2_CHANNELS = ("mlp", "verify_tier")
DP2_PHASES = ("call_total", "exchange_total", "peer_wait", "arrival_skew", "post_latest_arrival")
#: upper edges (ns) of the per-phase histogram, the native call's own (dspark_dp2_hist_edge_ns, checked at
#: open): low resolution, finer in the microseconds where an exchange lives
DP2_HIST_EDGES_NS = (1000, 2000, 5000, 10000, 20000, 50000, 100000, 1000000, 10000000, 100000000, 1000000000)
DP2_HIST_EDGES_S = tuple(n / 1e9 for n in DP2_HIST_EDGES_NS)
DP2_ERROR_CODES = (
    "timeout",
    "peer_died",
    "peer_closed",
    "poisoned",
    "sequence_divergence",
    "lapped",
    "ownership_changed",
    "used_after_fork",
    "mismatch",
    "caller_error",
    "futex",
    "clock",
    "missing_arrival",
    "unlink",
    "closed",
    "python_check",
)

GROUP = MetricGroup(
    "Native DP2 exchange (feature `dp2-native-exchange`)",
    (
        Family(
            "dspark_harden_dp2_exchange_calls_total",
            "counter",
            "Native DP2 exchanges completed by this rank, per channel (mlp: MLPSyncBatchInfo.all_gather; "
            "verify_tier: DSpark's verify-tier gather). Both ranks advance in lockstep.",
            labels=("channel", "dp_rank"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((c, DP_RANK) for c in DP2_CHANNELS),
            aggregation="Per rank: `rate(...)` by (`channel`, `dp_rank`); never sum (each exchange counts once per rank).",
        ),
        Family(
            "dspark_harden_dp2_exchange_seconds_total",
            "counter",
            "Seconds summed over exchanges by phase: call_total (whole hardened call incl. Python), "
            "exchange_total (native call), peer_wait (after publishing, waiting for the peer), "
            "arrival_skew (|own arrival - peer arrival|), post_latest_arrival (finish - later arrival).",
            labels=("channel", "dp_rank", "phase"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((c, DP_RANK, p) for c in DP2_CHANNELS for p in DP2_PHASES),
            aggregation='`rate(x{phase="p"}) / rate(calls_total)` = mean per call; keep `dp_rank`: a high `peer_wait` on one rank means the *other* rank is slower.',
        ),
        Family(
            "dspark_harden_dp2_exchange_max_seconds",
            "gauge",
            "Longest single exchange per phase in the latest flush window (1 s).",
            labels=("channel", "dp_rank", "phase"),
            multiprocess_mode="mostrecent",
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((c, DP_RANK, p) for c in DP2_CHANNELS for p in DP2_PHASES),
            aggregation="`max by (channel, phase) (max_over_time(...[5m]))`; never sum.",
        ),
        Family(
            "dspark_harden_dp2_exchange_phase_seconds",
            "histogram",
            "Per-exchange distribution of each phase (the phases of _seconds_total), in 11 low-resolution "
            "buckets from 1 us to 1 s: the native call buckets its own phases, Python the whole call; flushed "
            "with the sums at most once per second.",
            labels=("channel", "dp_rank", "phase"),
            buckets=DP2_HIST_EDGES_S,
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((c, DP_RANK, p) for c in DP2_CHANNELS for p in DP2_PHASES),
            aggregation='Per rank: `histogram_quantile(0.99, sum by (le, dp_rank) (rate(x_bucket{channel="mlp",'
            'phase="post_latest_arrival"}[5m])))`; the buckets are coarse (1, 2, 5, 10, 20, 50, 100 us, 1, 10, '
            "100 ms, 1 s): read quantiles as bucket ranges. `arrival_skew` is the peer's lateness, "
            "`post_latest_arrival` the channel's own cost.",
        ),
        Family(
            "dspark_harden_dp2_exchange_futex_waits_total",
            "counter",
            "Futex sleeps while waiting for the peer (0 per call when the short spin sufficed).",
            labels=("channel", "dp_rank"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((c, DP_RANK) for c in DP2_CHANNELS),
            aggregation="`rate(...)` per rank; compare with `calls_total` to see how often ranks arrive more than the spin budget apart.",
        ),
        Family(
            "dspark_harden_dp2_exchange_errors_total",
            "counter",
            "Exchange failures by code (see docs/dp2.md); any error stops both ranks (no gloo fallback).",
            labels=("channel", "dp_rank", "code"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((c, DP_RANK, e) for c in DP2_CHANNELS for e in DP2_ERROR_CODES),
            aggregation='`sum by (code) (increase(...))`; the rank with `code!="poisoned"` is the one that detected the problem.',
        ),
        Family(
            "dspark_harden_dp2_exchange_stalls_total",
            "counter",
            "Timeout periods (SGLANG_DSPARK_DP2_SHM_TIMEOUT_MS) one exchange spent waiting for a peer that is "
            "alive but late; the exchange keeps waiting (up to SGLANG_DSPARK_DP2_SHM_HARD_TIMEOUT_MS).",
            labels=("channel", "dp_rank"),
            feature=FEATURE,
            roles=("scheduler",),
            precreate=tuple((c, DP_RANK) for c in DP2_CHANNELS),
            aggregation="`sum by (dp_rank) (increase(...))`: the rank that stalls is the one *not* counting.",
        ),
        Family(
            "dspark_harden_dp2_exchange_sequence",
            "gauge",
            "Sequence number of the latest completed exchange (as of the latest flush).",
            labels=("channel", "dp_rank"),
            multiprocess_mode="mostrecent",
            feature=FEATURE,
            roles=("scheduler",),
            aggregation="Per rank; the two ranks of a channel differ by at most one flush window of calls.",
        ),
        Family(
            "dspark_harden_dp2_exchange_enabled",
            "gauge",
            "1 while the channel is open in this rank (set at startup), 0 after close.",
            labels=("channel", "dp_rank"),
            multiprocess_mode="mostrecent",
            feature=FEATURE,
            roles=("scheduler",),
            aggregation="`min by (channel)`: 1 only when both ranks have it open.",
        ),
    ),
    intro="Every family comes from the two DP scheduler processes (DP2 / attention-TP1, so `dp_rank` is 0 or "
    "1) and is labelled with the `channel`: `mlp` (the `MLPSyncBatchInfo.all_gather` that runs every "
    "scheduler step) or `verify_tier` (DSpark's verify-tier gather, only with DSpark). The native call "
    "accumulates its own sums and maxima; Python pushes them to Prometheus at most once per second, so "
    "a scrape can lag the other rank by up to one flush. See [dp2.md](dp2.md).",
)
