"""The observability feature's metric families: the platform families every process publishes
(feature ``core``) and the scheduler-loop phase timers (feature ``scheduler-phase-metrics``).
Exported through :func:`dspark_harden.observability.feature.dspark_metrics`."""

from __future__ import annotations

from ..core.metrics import DP_RANK, Family, MetricGroup

PHASE_FEATURE = "scheduler-phase-metrics"
SCHEDULER_PHASES = (
    "recv_requests",
    "process_input_requests",
    "get_next_batch_to_run",
    "run_batch",
    "process_batch_result",
    "idle",
    "check_hicache_events",
)
#: the in-flight HiCache transfers sampled per dp_rank (stock UnifiedRadixCache's ongoing_* maps)
HICACHE_KINDS = ("write_through", "load_back", "backup", "prefetch")
#: kinds with a token count (stock's ongoing_backup keeps no size: operations only)
HICACHE_TOKEN_KINDS = ("write_through", "load_back", "prefetch")

PLATFORM = MetricGroup(
    "Platform (feature `observability`)",
    (
        Family(
            "dspark_harden_build_info",
            "gauge",
            "dspark-harden build information (value 1), one series per version pair.",
            labels=("version", "sglang_version"),
            multiprocess_mode="max",
            aggregation="`max by (version, sglang_version)`; identical on every process.",
        ),
        Family(
            "dspark_harden_feature_bound",
            "gauge",
            "1 when the feature's patches are bound and verified in this process role, else 0; "
            "the status label is the self-check status (bound, upstream, disabled, unavailable).",
            labels=("feature", "role", "status"),
            multiprocess_mode="max",
            aggregation="`max by (feature, role, status)`; processes of one role agree. `count(max by (feature) (dspark_harden_feature_bound) == 1)` = features active.",
        ),
    ),
    intro="Published in every process (main, DP controller, schedulers, detokenizer) right after the plugin "
    "bound (in the main process: right after SGLang configured Prometheus). A failed feature never "
    "shows in `dspark_harden_feature_bound`: startup was refused.",
)

PHASES = MetricGroup(
    "Scheduler phases (feature `scheduler-phase-metrics`)",
    (
        Family(
            "dspark_harden_scheduler_phase_seconds_total",
            "counter",
            "Wall-clock seconds spent inside each scheduler-loop phase (inclusive of what the phase calls).",
            labels=("dp_rank", "phase"),
            feature=PHASE_FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, p) for p in SCHEDULER_PHASES),
            aggregation="`sum by (phase) (rate(...))` for the server; keep `dp_rank` to compare ranks.",
        ),
        Family(
            "dspark_harden_scheduler_phase_calls_total",
            "counter",
            "Number of calls of each scheduler-loop phase.",
            labels=("dp_rank", "phase"),
            feature=PHASE_FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, p) for p in SCHEDULER_PHASES),
            aggregation="`sum by (phase) (rate(...))`; seconds rate / calls rate = mean seconds per call.",
        ),
        Family(
            "dspark_harden_scheduler_phase_max_seconds",
            "gauge",
            "Longest single call of each scheduler-loop phase in the latest flush window "
            "(DSPARK_HARDEN_METRICS_FLUSH_INTERVAL_S, default 1 s; 0 when the phase did not run).",
            labels=("dp_rank", "phase"),
            multiprocess_mode="mostrecent",
            feature=PHASE_FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, p) for p in SCHEDULER_PHASES),
            aggregation="`max by (phase) (max_over_time(...[5m]))`; never sum.",
        ),
    ),
    intro="One series per `dp_rank` and `phase`, phases `recv_requests`, `process_input_requests`, "
    "`get_next_batch_to_run`, `run_batch`, `process_batch_result`, `idle` (the scheduler-loop methods; "
    "inclusive times) and `check_hicache_events` (stock `UnifiedRadixCache.check_hicache_events`, the "
    "HiCache poll that `get_next_batch_to_run` runs with `--enable-hierarchical-cache`: its time is inside "
    "`get_next_batch_to_run`'s; 0 calls without HiCache). Recorded on the first attention-TP rank of each DP "
    "group; values are pushed at most once per `DSPARK_HARDEN_METRICS_FLUSH_INTERVAL_S` (default 1 s).",
)

HICACHE = MetricGroup(
    "HiCache transfers in flight (feature `scheduler-phase-metrics`)",
    (
        Family(
            "dspark_harden_hicache_ongoing_operations",
            "gauge",
            "HiCache operations in flight per kind, read from stock UnifiedRadixCache's maps: write_through "
            "(device->host copies not yet acknowledged, ongoing_write_through), load_back (host->device, "
            "ongoing_load_back), backup (host->storage, ongoing_backup), prefetch (storage->host, ongoing_prefetch).",
            labels=("dp_rank", "kind"),
            multiprocess_mode="mostrecent",
            feature=PHASE_FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, k) for k in HICACHE_KINDS),
            aggregation="Per rank: `max by (dp_rank, kind) (max_over_time(...[5m]))`; a kind that stays high on one "
            "rank is a transfer backlog there. Sum over `dp_rank` for the server's total.",
        ),
        Family(
            "dspark_harden_hicache_ongoing_tokens",
            "gauge",
            "Tokens of the HiCache operations in flight per kind: write_through and load_back are the tokens "
            "the cache controller has queued or submitted and not yet acknowledged (write_queue + ack_write_queue, "
            "load_queue + ack_load_queue) and prefetch the host slots reserved by the prefetches in flight. No "
            "backup series: stock's ongoing_backup map keeps no size.",
            labels=("dp_rank", "kind"),
            multiprocess_mode="mostrecent",
            feature=PHASE_FEATURE,
            roles=("scheduler",),
            precreate=tuple((DP_RANK, k) for k in HICACHE_TOKEN_KINDS),
            aggregation="Per rank like the operations; tokens / operations = mean tokens per transfer in flight.",
        ),
    ),
    intro="Sampled on the scheduler thread at every flush of the scheduler-phase values (at most once per "
    "`DSPARK_HARDEN_METRICS_FLUSH_INTERVAL_S`, default 1 s), from the tree whose `check_hicache_events` ran "
    "last; 0 without `--enable-hierarchical-cache`. Stock already exports the *finished* transfers "
    "(`sglang:hicache_backup_duration_seconds`, `sglang:hicache_backup_tokens_total` and friends, labelled "
    "by stock's collector, not `dp_rank`): these gauges are what is still in flight, never a second count "
    "of the same events. See [observability.md](observability.md#hicache-transfers).",
)

GROUPS = (PLATFORM, PHASES, HICACHE)
