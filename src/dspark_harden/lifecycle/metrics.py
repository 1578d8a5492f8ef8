"""The lifecycle package's metric families, exported through
:func:`dspark_harden.lifecycle.feature.dspark_metrics`."""

from __future__ import annotations

from ..core.metrics import DP_RANK, Family, MetricGroup
from . import settings as S
from .gc_freeze import PAUSE_BUCKETS

MAIN_PHASES = ("drain", "abort", "schedulers", "children", "cleanup", "total")
SCHEDULER_PHASES = ("release", "barrier", "total")
GC_ROLES = ("main", "scheduler", "detokenizer")
GATE_OUTCOMES = (
    "evicted",
    "not_armed",
    "already_used",
    "bad_value",
    "hicache_off",
    "busy",
    "nothing_evicted",
    "failed",
)
POOL_OUTCOMES = ("destroyed", "failed")

SHUTDOWN_GROUP = MetricGroup(
    "Lifecycle: shutdown and child death (feature `lifecycle-shutdown`)",
    (
        Family(
            "dspark_harden_shutdown_phase_seconds",
            "gauge",
            "Seconds of the latest shutdown's phases. main: drain (SIGTERM to no request left or the drain "
            "window's end), abort (answering the rest with 503), schedulers (ShutdownReq to every scheduler "
            "gone), children (DP controller and detokenizer gone), cleanup (leftovers removed), total. "
            "scheduler: release (host resources), barrier (waiting for the peers), total (ShutdownReq to torn down).",
            labels=("role", "dp_rank", "phase"),
            multiprocess_mode="mostrecent",
            feature=S.SHUTDOWN,
            roles=("main", "scheduler"),
            precreate=tuple(("main", "none", p) for p in MAIN_PHASES),
            aggregation="`max by (role, phase)`; visible while the server still serves /metrics during a drain, "
            "and in the shutdown log line.",
        ),
        Family(
            "dspark_harden_shutdown_requests_total",
            "counter",
            "Requests by what a shutdown did with them: drained (finished inside the drain window), aborted "
            "(answered 503 when the window ended), refused (new work answered 503 while draining or after a death).",
            labels=("outcome",),
            feature=S.SHUTDOWN,
            roles=("main",),
            precreate=(("drained",), ("aborted",), ("refused",)),
            aggregation="`sum by (outcome) (increase(...))` across HTTP processes.",
        ),
        Family(
            "dspark_harden_shutdown_barriers_total",
            "counter",
            "Shutdown barriers per scheduler: passed (every peer arrived) or timeout (a peer was dead or stuck; "
            "torn down anyway after DSPARK_HARDEN_SHUTDOWN_BARRIER_TIMEOUT_S).",
            labels=("role", "dp_rank", "outcome"),
            feature=S.SHUTDOWN,
            roles=("scheduler",),
            precreate=(("scheduler", DP_RANK, "passed"), ("scheduler", DP_RANK, "timeout")),
            aggregation="`sum by (outcome)`; any timeout means a rank tore down with a peer missing.",
        ),
        Family(
            "dspark_harden_lifecycle_child_deaths_total",
            "counter",
            "Child processes whose death stopped the server, by role (scheduler, detokenizer, controller, other).",
            labels=("role",),
            feature=S.SHUTDOWN,
            roles=("main",),
            precreate=(("scheduler",), ("detokenizer",), ("controller",), ("other",)),
            aggregation="`sum by (role)`; the log line names the DP rank and the signal or exit code.",
        ),
        Family(
            "dspark_harden_lifecycle_requests_failed_total",
            "counter",
            "In-flight requests answered with HTTP 503 naming the cause because a child process died.",
            feature=S.SHUTDOWN,
            roles=("main",),
            aggregation="`sum(increase(...))`.",
        ),
        Family(
            "dspark_harden_lifecycle_leftovers_removed_total",
            "counter",
            "Shared-memory segments, semaphores and ZMQ ipc sockets of the server tree that were still present "
            "after its processes exited and were removed by the main process.",
            feature=S.SHUTDOWN,
            roles=("main",),
            aggregation="`sum(increase(...))`.",
        ),
    ),
    intro="Counted by the main process (phases also by each scheduler). A shutdown's numbers are also in its "
    "final INFO line. See [lifecycle.md](lifecycle.md).",
)

GC_GROUP = MetricGroup(
    "GC freeze (feature `gc-freeze`)",
    (
        Family(
            "dspark_harden_gc_pause_seconds",
            "histogram",
            "Duration of every garbage collection (gc.callbacks), by generation and whether the heap was frozen "
            "at the time (frozen=0: before the freeze after warm-up, 1: after).",
            labels=("role", "dp_rank", "generation", "frozen"),
            buckets=PAUSE_BUCKETS,
            feature=S.GC_FREEZE,
            roles=("main", "scheduler", "detokenizer"),
            aggregation='Per rank: `histogram_quantile(0.99, sum by (le, dp_rank, frozen) (rate(..._bucket{generation="2"}[5m])))`; '
            "a gen-2 pause on one DP rank stalls every rank, so compare ranks, never average them.",
        ),
        Family(
            "dspark_harden_gc_frozen_objects",
            "gauge",
            "Objects moved to the permanent generation by the freeze after warm-up (gc.get_freeze_count()).",
            labels=("role", "dp_rank"),
            multiprocess_mode="mostrecent",
            feature=S.GC_FREEZE,
            roles=("main", "scheduler", "detokenizer"),
            aggregation="Per process; `min by (role)` > 0 means every process of that role froze.",
        ),
        Family(
            "dspark_harden_gc_frozen",
            "gauge",
            "1 once the process froze its heap after warm-up, 0 before.",
            labels=("role", "dp_rank"),
            multiprocess_mode="mostrecent",
            feature=S.GC_FREEZE,
            roles=("main", "scheduler", "detokenizer"),
            aggregation="`min by (role)`.",
        ),
    ),
    intro="Each process labels its series with its role and `dp_rank` (`none` outside DP schedulers).",
)

HICACHE_GROUP = MetricGroup(
    "HiCache gate and host-pool teardown (features `hicache-gate`, `hostpool-teardown`)",
    (
        Family(
            "dspark_harden_hicache_gate_requests_total",
            "counter",
            "hicache_gate_evict_device_tokens requests through /set_internal_state by outcome: evicted, or the "
            "refusal (not_armed, already_used, bad_value, hicache_off, busy, nothing_evicted, failed).",
            labels=("dp_rank", "outcome"),
            feature=S.HICACHE_GATE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, o) for o in GATE_OUTCOMES),
            aggregation="`sum by (outcome)`; each scheduler is armed once.",
        ),
        Family(
            "dspark_harden_hicache_gate_evicted_tokens_total",
            "counter",
            "Device tokens the gate evicted (after backing device-only leaves up to host).",
            labels=("dp_rank",),
            feature=S.HICACHE_GATE,
            roles=("scheduler",),
            precreate=((DP_RANK,),),
            aggregation="`sum by (dp_rank)`.",
        ),
        Family(
            "dspark_harden_hostpool_destroys_total",
            "counter",
            "Host pools destroyed at shutdown by HostPoolGroup.destroy, by outcome (a failed pool no longer skips "
            "the ones after it).",
            labels=("dp_rank", "outcome"),
            feature=S.HOSTPOOL,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, o) for o in POOL_OUTCOMES),
            aggregation="`sum by (outcome)`; any failed one is named in the scheduler's ERROR line.",
        ),
    ),
    intro="From the schedulers. See [lifecycle.md](lifecycle.md).",
)

GROUPS = [SHUTDOWN_GROUP, GC_GROUP, HICACHE_GROUP]
