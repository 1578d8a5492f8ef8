"""Every Prometheus metric family dspark-harden exports, in one place.

Conventions (Prometheus, not SGLang's ``sglang:`` prefix): names start with ``dspark_harden_``,
base units (``_seconds``, ``_bytes``), counters end in ``_total``, no colons, bounded label values
only (never schema hashes or request ids), a ``dp_rank`` label where aggregation across DP ranks
matters. :func:`convention_problems` is the single statement of these rules: ``declare()`` enforces
it at import and ``dspark-harden metrics-lint`` applies it to a live scrape.

Families are declared here as specs and instantiated lazily per process (after SGLang has set
``PROMETHEUS_MULTIPROC_DIR``), so they work in SGLang's Prometheus multiprocess mode, where every
process writes its own mmap files and the main process serves ``/metrics`` from all of them.
Gauges pass their ``multiprocess_mode`` explicitly (a gauge shared by processes with the same
labels must say how to combine them: ``max``, ``sum``, ``mostrecent``...). Label combinations
listed in ``Family.precreate`` are created when the process starts (by the observability
feature, for features active in that process), so a series exists before its first event; the
placeholder :data:`DP_RANK` in a combination stands for this process's ``dp_rank`` label value
(``roles.CONTEXT.dp_label``).

How to add a family (other features): declare it in a clearly commented section for your feature
below, with ``feature=<your Feature.name>`` and ``roles=`` the process roles that emit it, call
``metrics.get(name)`` at runtime (never at import or bind time in the main process: use
:func:`when_ready` for start-up publishing there), and document it in docs/metrics.md
(tests/test_metrics_docs.py keeps both in sync; tests/test_dashboards.py checks the dashboard).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

logger = logging.getLogger("dspark_harden")

PREFIX = "dspark_harden_"

# default latency buckets: 1 µs .. 10 s
LATENCY_BUCKETS = (
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

KINDS = ("counter", "gauge", "histogram")
# prometheus_client's gauge multiprocess modes ("all"/"liveall" add a pid label: avoid them)
GAUGE_MODES = frozenset({
    "min", "max", "sum", "mostrecent", "all",
    "livemin", "livemax", "livesum", "livemostrecent", "liveall",
})
# placeholder in Family.precreate combinations: this process's dp_rank label value
DP_RANK = "$dp_rank"

_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]*$")
_LABEL_RE = re.compile(r"^[a-z_][a-z0-9_]*$")
# unit suffixes that are not Prometheus base units (seconds, bytes, ratios)
_NON_BASE_UNITS = {
    "ms": "seconds", "msec": "seconds", "milliseconds": "seconds", "us": "seconds",
    "usec": "seconds", "microseconds": "seconds", "ns": "seconds", "nanoseconds": "seconds",
    "minutes": "seconds", "hours": "seconds", "days": "seconds",
    "kb": "bytes", "mb": "bytes", "gb": "bytes", "kib": "bytes", "mib": "bytes", "gib": "bytes",
    "kilobytes": "bytes", "megabytes": "bytes", "gigabytes": "bytes", "percent": "ratio",
}
_RESERVED_SUFFIXES = ("_bucket", "_count", "_sum", "_created")


def convention_problems(name: str, kind: str, labels: Iterable[str] = (), *, own: bool = True) -> list[str]:
    """Prometheus naming problems of one family (empty list when clean).

    ``name`` is the family name as exposed (counters with their ``_total``). ``own`` adds the
    rules specific to dspark-harden families (prefix).
    """
    out: list[str] = []
    labels = tuple(labels)
    if own and not name.startswith(PREFIX):
        out.append(f"{name}: must start with {PREFIX}")
    if ":" in name:
        out.append(f"{name}: must not contain ':' (colons are reserved for recording rules)")
    elif not _NAME_RE.match(name):
        out.append(f"{name}: must be lower snake_case [a-z_][a-z0-9_]*")
    if kind not in KINDS:
        out.append(f"{name}: unknown type {kind!r} (one of {', '.join(KINDS)})")
    if kind == "counter" and not name.endswith("_total"):
        out.append(f"{name}: counter must end with _total")
    if kind in ("gauge", "histogram") and name.endswith("_total"):
        out.append(f"{name}: only counters end with _total ({kind})")
    if kind in ("gauge", "histogram") and name.endswith(_RESERVED_SUFFIXES):
        out.append(f"{name}: suffixes {', '.join(_RESERVED_SUFFIXES)} are reserved for histogram/counter samples")
    words = name[: -len("_total")].split("_") if name.endswith("_total") else name.split("_")
    for word in words:
        base = _NON_BASE_UNITS.get(word)
        if base:
            out.append(f"{name}: unit '{word}' is not a base unit (use {base})")
    if len(set(labels)) != len(labels):
        out.append(f"{name}: duplicate label names {labels}")
    for label in labels:
        if not _LABEL_RE.match(label) or label.startswith("__"):
            out.append(f"{name}: bad label name {label!r}")
        if label == "le" and kind == "histogram" or label == "quantile":
            out.append(f"{name}: label {label!r} is reserved")
        if label == "pid":
            out.append(f"{name}: label 'pid' is added by multiprocess 'all' gauges; do not declare it")
    return out


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # counter | gauge | histogram
    doc: str
    labels: tuple = ()
    buckets: tuple = LATENCY_BUCKETS
    # gauges only: how the main process combines the per-process values of one label set
    multiprocess_mode: str = "mostrecent"
    # label combinations to pre-create so a series exists before its first event
    # (DP_RANK stands for this process's dp_rank label value)
    precreate: tuple = ()
    # the Feature.name whose activity the family reports ("core": always)
    feature: str = "core"
    # how to aggregate across ranks (documented in docs/metrics.md)
    aggregation: str = ""
    # process roles (Role values, e.g. "scheduler") that emit it; empty: any role.
    # Pre-creation happens only in these roles.
    roles: tuple = ()

    def __post_init__(self) -> None:
        problems = convention_problems(self.name, self.kind, self.labels)
        if not self.doc.strip():
            problems.append(f"{self.name}: empty documentation")
        if self.kind == "gauge" and self.multiprocess_mode not in GAUGE_MODES:
            problems.append(f"{self.name}: multiprocess_mode {self.multiprocess_mode!r} not one of {sorted(GAUGE_MODES)}")
        if self.kind == "gauge" and self.multiprocess_mode in ("all", "liveall"):
            problems.append(f"{self.name}: multiprocess_mode {self.multiprocess_mode!r} adds an unbounded pid label")
        for combo in self.precreate:
            if not isinstance(combo, tuple) or len(combo) != len(self.labels):
                problems.append(f"{self.name}: precreate combination {combo!r} does not match labels {self.labels}")
        if any(DP_RANK in combo for combo in self.precreate if isinstance(combo, tuple)) and not self.roles:
            problems.append(f"{self.name}: pre-creating {DP_RANK} needs roles= (the processes that own a dp_rank)")
        for role in self.roles:
            if role not in ("main", "controller", "scheduler", "detokenizer"):
                problems.append(f"{self.name}: unknown role {role!r}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def exposed_names(self) -> tuple:
        """Sample names this family exposes in the text format."""
        if self.kind == "histogram":
            return (self.name + "_bucket", self.name + "_sum", self.name + "_count")
        return (self.name,)


FAMILIES: dict[str, Family] = {}


def declare(*families: Family) -> None:
    for fam in families:
        if fam.name in FAMILIES:
            raise ValueError(f"metric {fam.name} declared twice")
        FAMILIES[fam.name] = fam


# ------------------------------------------------------------------------------------------
# core / platform (observability feature: dspark_harden.observability)
declare(
    Family(
        "dspark_harden_build_info", "gauge",
        "dspark-harden build information (value 1), one series per version pair.",
        labels=("version", "sglang_version"), multiprocess_mode="max",
        aggregation="max; identical on every process",
    ),
    Family(
        "dspark_harden_feature_bound", "gauge",
        "1 when the feature's patches are bound and verified in this process role, else 0; "
        "the status label is the self-check status (bound, upstream, disabled, unavailable).",
        labels=("feature", "role", "status"), multiprocess_mode="max",
        aggregation="max by (feature, role, status): processes of one role agree",
    ),
)

# ------------------------------------------------------------------------------------------
# observability: scheduler loop phases (dspark_harden.observability.phases)
SCHEDULER_PHASES = (
    "recv_requests", "process_input_requests", "get_next_batch_to_run",
    "run_batch", "process_batch_result", "idle",
)
declare(
    Family(
        "dspark_harden_scheduler_phase_seconds_total", "counter",
        "Wall-clock seconds spent inside each scheduler-loop phase (inclusive of what the phase calls).",
        labels=("dp_rank", "phase"), feature="scheduler-phase-metrics", roles=("scheduler",),
        precreate=tuple((DP_RANK, p) for p in SCHEDULER_PHASES),
        aggregation="sum by (phase) (rate(...)) for the fleet; keep dp_rank to compare ranks",
    ),
    Family(
        "dspark_harden_scheduler_phase_calls_total", "counter",
        "Number of calls of each scheduler-loop phase.",
        labels=("dp_rank", "phase"), feature="scheduler-phase-metrics", roles=("scheduler",),
        precreate=tuple((DP_RANK, p) for p in SCHEDULER_PHASES),
        aggregation="sum by (phase) (rate(...)); seconds_total / calls_total = mean seconds per call",
    ),
    Family(
        "dspark_harden_scheduler_phase_max_seconds", "gauge",
        "Longest single call of each scheduler-loop phase in the latest flush window "
        "(DSPARK_HARDEN_METRICS_FLUSH_INTERVAL_S, default 1 s; 0 when the phase did not run).",
        labels=("dp_rank", "phase"), multiprocess_mode="mostrecent",
        feature="scheduler-phase-metrics", roles=("scheduler",),
        precreate=tuple((DP_RANK, p) for p in SCHEDULER_PHASES),
        aggregation="max by (phase) (max_over_time(...[5m])); never sum",
    ),
)

# ------------------------------------------------------------------------------------------
# Feature sections: each feature declares its families below, in its own section.

# ------------------------------------------------------------------------------------------
# ingress (atomic-routed-batch) and health (health-scheduler): src/dspark_harden/ingress/,
# src/dspark_harden/health/; documented in docs/metrics.md "Ingress and health".
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
declare(
    Family(
        "dspark_harden_atomic_batches_total", "counter",
        "Uniformly routed batches the DP controller sent to one DP rank as ONE ZMQ message.",
        labels=("dp_rank",), feature="atomic-routed-batch", roles=("controller",),
        aggregation="sum by (dp_rank); one DP controller per server",
    ),
    Family(
        "dspark_harden_atomic_batch_requests", "histogram",
        "Number of requests in each atomic routed batch the DP controller sent.",
        labels=("dp_rank",), buckets=BATCH_SIZE_BUCKETS, feature="atomic-routed-batch",
        roles=("controller",), aggregation="sum of buckets by (dp_rank, le)",
    ),
    Family(
        "dspark_harden_route_rejections_total", "counter",
        "Requests the DP controller answered with HTTP 400 because their routed_dp_rank cannot be "
        "sent to (reason: out_of_range, inactive, no_socket); stock would crash the server.",
        labels=("reason",), feature="atomic-routed-batch", roles=("controller",),
        precreate=(("out_of_range",), ("inactive",), ("no_socket",)),
        aggregation="sum by (reason)",
    ),
    Family(
        "dspark_harden_scheduler_batch_messages_total", "counter",
        "Batch request messages (BatchTokenizedGenerateReqInput) a DP scheduler received; each is "
        "one scheduling opportunity for all its requests.",
        labels=("dp_rank",), feature="atomic-routed-batch", roles=("scheduler",),
        precreate=((DP_RANK,),), aggregation="sum by (dp_rank); only attn-TP rank 0 schedulers receive",
    ),
    Family(
        "dspark_harden_scheduler_batch_message_requests", "histogram",
        "Number of requests in each batch message a DP scheduler received.",
        labels=("dp_rank",), buckets=BATCH_SIZE_BUCKETS, feature="atomic-routed-batch",
        roles=("scheduler",), aggregation="sum of buckets by (dp_rank, le)",
    ),
    Family(
        "dspark_harden_health_scheduler_checks_total", "counter",
        "GET /health_scheduler answers by outcome: ok, or the 503 reason (no_state, shutting_down, "
        "starting, read_error, missing_ranks, duplicate_ranks, unexpected_ranks, "
        "non_positive_timestamp, future_timestamp, stale).",
        labels=("outcome",), feature="health-scheduler", roles=("main",),
        precreate=tuple((o,) for o in (
            "ok", "no_state", "shutting_down", "starting", "read_error", "missing_ranks",
            "duplicate_ranks", "unexpected_ranks", "non_positive_timestamp", "future_timestamp", "stale",
        )),
        aggregation="sum by (outcome); with several HTTP workers each counts its own probes",
    ),
)


# ------------------------------------------------------------------------------------------
# grammar service (feature "grammar-service"): src/dspark_harden/grammar/; documented in
# docs/metrics.md "Grammar service". Runtime helpers: dspark_harden.grammar.metrics.
_GRAMMAR_SOURCES = ("memory", "inflight", "disk", "compile", "local_compile")
declare(
    Family(
        "dspark_harden_grammar_lookups_total", "counter",
        "Grammar lookups by how they were resolved: memory (LRU hit), inflight (joined a compile "
        "already running for the same canonical key), disk (loaded a serialized entry), compile "
        "(compiled natively, nothing on disk), local_compile (compiled because the disk entry is a "
        "compile-locally marker).",
        labels=("dp_rank", "source"), feature="grammar-service", roles=("scheduler",),
        precreate=tuple((DP_RANK, s) for s in _GRAMMAR_SOURCES),
        aggregation="sum by (source); per rank by (dp_rank, source)",
    ),
    Family(
        "dspark_harden_grammar_resolution_seconds", "histogram",
        "Time from lookup until the request's own matcher copy is ready, by source.",
        labels=("dp_rank", "source"), feature="grammar-service", roles=("scheduler",),
        aggregation="sum of buckets by (source, le)",
    ),
    Family(
        "dspark_harden_grammar_phase_seconds", "histogram",
        "Time spent in one phase of the persistent cache: disk_read, verify (checksum/scope/key), "
        "deserialize, native_compile, serialize, measure_compile and measure_load (re-compile and trial load deciding serialized vs "
        "marker), entry_write_account (atomic publish + ledger + pruning).",
        labels=("dp_rank", "phase"), feature="grammar-service", roles=("scheduler",),
        aggregation="sum of buckets by (phase, le)",
    ),
    Family(
        "dspark_harden_grammar_disk_lock_wait_seconds", "histogram",
        "Time waiting for a disk entry's exclusive file lock (another process or thread compiling "
        "or publishing the same key).",
        labels=("dp_rank",), feature="grammar-service", roles=("scheduler",),
        aggregation="sum of buckets by (le)",
    ),
    Family(
        "dspark_harden_grammar_memory_cache_bytes", "gauge",
        "Bytes held by this process's in-memory grammar LRU (compiled grammars' own memory size).",
        labels=("dp_rank",), multiprocess_mode="livesum", feature="grammar-service", roles=("scheduler",),
        aggregation="sum: every scheduler holds its own cache",
    ),
    Family(
        "dspark_harden_grammar_memory_cache_entries", "gauge",
        "Entries in this process's in-memory grammar LRU.",
        labels=("dp_rank",), multiprocess_mode="livesum", feature="grammar-service", roles=("scheduler",),
        aggregation="sum: every scheduler holds its own cache",
    ),
    Family(
        "dspark_harden_grammar_disk_cache_bytes", "gauge",
        "Byte ledger of the shared disk cache namespace, as last written by this process.",
        labels=("dp_rank",), multiprocess_mode="max", feature="grammar-service", roles=("scheduler",),
        aggregation="max: all ranks of a host share one namespace (do not sum)",
    ),
    Family(
        "dspark_harden_grammar_evictions_total", "counter",
        "Entries removed to respect a limit: tier memory (reason bytes|entries) or disk (reason prune).",
        labels=("dp_rank", "tier", "reason"), feature="grammar-service", roles=("scheduler",),
        precreate=((DP_RANK, "memory", "bytes"), (DP_RANK, "memory", "entries"), (DP_RANK, "disk", "prune")),
        aggregation="sum by (tier, reason)",
    ),
    Family(
        "dspark_harden_grammar_corrupt_entries_total", "counter",
        "Disk entries rejected as corrupt, truncated or foreign (the request failed naming the file).",
        labels=("dp_rank",), feature="grammar-service", roles=("scheduler",),
        precreate=((DP_RANK,),), aggregation="sum; any increase needs operator action",
    ),
    Family(
        "dspark_harden_grammar_compile_timeouts_total", "counter",
        "Requests failed because their grammar was not ready within DSPARK_HARDEN_GRAMMAR_COMPILE_TIMEOUT "
        "(the compile itself continues and is cached for a retry).",
        labels=("dp_rank",), feature="grammar-service", roles=("scheduler",),
        precreate=((DP_RANK,),), aggregation="sum",
    ),
    Family(
        "dspark_harden_grammar_compile_failures_total", "counter",
        "Compiles that raised (not cached; invalid grammars are results, not failures).",
        labels=("dp_rank",), feature="grammar-service", roles=("scheduler",),
        precreate=((DP_RANK,),), aggregation="sum",
    ),
    Family(
        "dspark_harden_grammar_disk_stored_total", "counter",
        "Disk entries this process published, by what was stored: serialized grammar or marker.",
        labels=("dp_rank", "stored"), feature="grammar-service", roles=("scheduler",),
        precreate=((DP_RANK, "serialized"), (DP_RANK, "marker")), aggregation="sum by (stored)",
    ),
    Family(
        "dspark_harden_grammar_disk_errors_total", "counter",
        "Disk cache publications that failed: op publish (I/O error) or prune (could not get under "
        "the hard limit; the new entry was withdrawn).",
        labels=("dp_rank", "op"), feature="grammar-service", roles=("scheduler",),
        precreate=((DP_RANK, "publish"), (DP_RANK, "prune")), aggregation="sum by (op)",
    ),
)

# ------------------------------------------------------------------------------------------
# native DP2 exchange (feature "dp2-native-exchange"): src/dspark_harden/dp2/; documented in
# docs/metrics.md "Native DP2 exchange". Values are accumulated in-process per call and flushed
# at most once per second (dspark_harden.dp2.channels), so the hot path never touches prometheus.
DP2_CHANNELS = ("mlp", "verify_tier")
DP2_PHASES = ("call_total", "exchange_total", "peer_wait", "arrival_skew", "post_latest_arrival")
DP2_ERROR_CODES = (
    "timeout", "peer_died", "peer_closed", "poisoned", "sequence_divergence", "lapped",
    "ownership_changed", "used_after_fork", "mismatch", "caller_error", "futex", "clock",
    "missing_arrival", "unlink", "closed", "python_check",
)
declare(
    Family(
        "dspark_harden_dp2_exchange_calls_total", "counter",
        "Native DP2 exchanges completed by this rank, per channel (mlp: MLPSyncBatchInfo.all_gather; "
        "verify_tier: DSpark's verify-tier gather). Both ranks advance in lockstep.",
        labels=("channel", "dp_rank"), feature="dp2-native-exchange", roles=("scheduler",),
        precreate=tuple((c, DP_RANK) for c in DP2_CHANNELS),
        aggregation="per rank; the two ranks' counts differ by at most the unflushed window",
    ),
    Family(
        "dspark_harden_dp2_exchange_seconds_total", "counter",
        "Seconds summed over exchanges by phase: call_total (whole hardened call incl. Python), "
        "exchange_total (native call), peer_wait (after publishing, waiting for the peer), "
        "arrival_skew (|own arrival - peer arrival|), post_latest_arrival (finish - later arrival).",
        labels=("channel", "dp_rank", "phase"), feature="dp2-native-exchange", roles=("scheduler",),
        precreate=tuple((c, DP_RANK, p) for c in DP2_CHANNELS for p in DP2_PHASES),
        aggregation="rate(...) / rate(calls_total) = mean per call; keep dp_rank (do not sum ranks)",
    ),
    Family(
        "dspark_harden_dp2_exchange_max_seconds", "gauge",
        "Longest single exchange per phase in the latest flush window (1 s).",
        labels=("channel", "dp_rank", "phase"), multiprocess_mode="mostrecent",
        feature="dp2-native-exchange", roles=("scheduler",),
        precreate=tuple((c, DP_RANK, p) for c in DP2_CHANNELS for p in DP2_PHASES),
        aggregation="max by (channel, phase) (max_over_time(...[5m])); never sum",
    ),
    Family(
        "dspark_harden_dp2_exchange_futex_waits_total", "counter",
        "Futex sleeps while waiting for the peer (0 per call when the short spin sufficed).",
        labels=("channel", "dp_rank"), feature="dp2-native-exchange", roles=("scheduler",),
        precreate=tuple((c, DP_RANK) for c in DP2_CHANNELS),
        aggregation="rate by (channel, dp_rank)",
    ),
    Family(
        "dspark_harden_dp2_exchange_errors_total", "counter",
        "Exchange failures by code (see docs/dp2.md); any error stops both ranks (no gloo fallback).",
        labels=("channel", "dp_rank", "code"), feature="dp2-native-exchange", roles=("scheduler",),
        precreate=tuple((c, DP_RANK, e) for c in DP2_CHANNELS for e in DP2_ERROR_CODES),
        aggregation="sum by (code); alert on any increase",
    ),
    Family(
        "dspark_harden_dp2_exchange_sequence", "gauge",
        "Sequence number of the latest completed exchange (as of the latest flush).",
        labels=("channel", "dp_rank"), multiprocess_mode="mostrecent",
        feature="dp2-native-exchange", roles=("scheduler",),
        aggregation="per rank; the two ranks of a channel should be within the flush window",
    ),
    Family(
        "dspark_harden_dp2_exchange_enabled", "gauge",
        "1 while the channel is open in this rank (set at startup), 0 after close.",
        labels=("channel", "dp_rank"), multiprocess_mode="mostrecent",
        feature="dp2-native-exchange", roles=("scheduler",),
        aggregation="min by (channel): 1 only when every rank has it open",
    ),
)

# ------------------------------------------------------------------------------------------
# DSpark grammar masks (feature "dspark-masks"): src/dspark_harden/dspark_masks/; documented in
# docs/metrics.md "DSpark grammar masks". Emitted per DSpark verify step that has a grammar.
DSPARK_MASK_PHASES = ("barrier", "buffer_wait", "draft_copy_wait", "resolution", "traversal", "mask_upload", "total")
DSPARK_MASK_OUTCOMES = ("masked", "thinking_only")
declare(
    Family(
        "dspark_harden_dspark_mask_phase_seconds", "histogram",
        "Host seconds per DSpark grammar-mask step phase: barrier (upstream FSM advance), buffer_wait "
        "(slot's previous upload still reading the pinned buffer), draft_copy_wait (D2H of the draft chain), "
        "resolution (grammar objects -> matchers/roots), traversal (native batched traversal), mask_upload "
        "(H2D enqueue on the copy stream), total.",
        labels=("dp_rank", "phase"), feature="dspark-masks", roles=("scheduler",),
        precreate=tuple((DP_RANK, p) for p in DSPARK_MASK_PHASES),
        aggregation="sum by (phase) (rate(..._sum[5m])); keep dp_rank to compare ranks",
    ),
    Family(
        "dspark_harden_dspark_mask_active_matchers", "gauge",
        "Grammar matchers traversed in the latest DSpark verify step (requests in thinking phase without "
        "a think-end inside the draft are not active).",
        labels=("dp_rank",), multiprocess_mode="mostrecent", feature="dspark-masks", roles=("scheduler",),
        precreate=((DP_RANK,),),
        aggregation="sum over dp_rank for the fleet; per rank as is",
    ),
    Family(
        "dspark_harden_dspark_mask_steps_total", "counter",
        "DSpark verify steps with a grammar by outcome: masked (mask uploaded and applied) or thinking_only "
        "(no active matcher: no mask, logits untouched).",
        labels=("dp_rank", "outcome"), feature="dspark-masks", roles=("scheduler",),
        precreate=tuple((DP_RANK, o) for o in DSPARK_MASK_OUTCOMES),
        aggregation="sum by (outcome) (rate(...))",
    ),
)


# ------------------------------------------------------------------------------------------
# runtime: lazily created prometheus_client objects
#
# Multiprocess safety: prometheus_client picks its value class (in-process vs per-process mmap
# files) when ``prometheus_client.values`` is first imported. SGLang sets PROMETHEUS_MULTIPROC_DIR
# in the main process only in ``_set_envs_and_config``, *after* plugins were loaded, so nothing may
# create a metric in the main process before then (doing so would also break SGLang's own
# tokenizer metrics). The observability feature calls :func:`defer_until_configured` in the main
# process at bind time and :func:`configured` right after SGLang's ``_set_envs_and_config``;
# :func:`when_ready` runs start-up publishing at the right moment in every process.

_LOCK = threading.RLock()
_LIVE: dict[str, Any] = {}
_READY = True
_PENDING: list = []
_EARLY: set = set()


def get(name: str) -> Any:
    """The live prometheus_client metric for a declared family (created on first use)."""
    obj = _LIVE.get(name)
    if obj is not None:
        return obj
    with _LOCK:
        obj = _LIVE.get(name)
        if obj is None:
            fam = FAMILIES.get(name)
            if fam is None:
                raise KeyError(f"metric {name} is not declared in dspark_harden.metrics")
            if not _READY:
                _EARLY.add(name)
            obj = _create(fam)
            _LIVE[name] = obj
    return obj


def _create(fam: Family) -> Any:
    import prometheus_client as pc

    short = fam.name[: -len("_total")] if fam.kind == "counter" else fam.name
    if fam.kind == "counter":
        obj = pc.Counter(short, fam.doc, labelnames=fam.labels)
    elif fam.kind == "gauge":
        obj = pc.Gauge(fam.name, fam.doc, labelnames=fam.labels, multiprocess_mode=fam.multiprocess_mode)
    elif fam.kind == "histogram":
        obj = pc.Histogram(fam.name, fam.doc, labelnames=fam.labels, buckets=fam.buckets)
    else:  # pragma: no cover - guarded by Family.__post_init__
        raise ValueError(fam.kind)
    return obj


def child(name: str, *labelvalues: Any) -> Any:
    """``get(name).labels(*labelvalues)`` (or the label-less metric), for hot paths to cache."""
    obj = get(name)
    return obj.labels(*labelvalues) if FAMILIES[name].labels else obj


def precreate(name: str, combos: Iterable[tuple]) -> None:
    """Pre-create label combinations (e.g. ones known only at runtime) so their series exist.

    A gauge series that is new here is set to 0: in multiprocess mode a ``mostrecent`` gauge that
    was never set has no timestamp and is left out of the scrape.
    """
    fam = FAMILIES[name]
    obj = get(name)
    for combo in combos:
        combo = tuple(str(v) for v in combo)
        if len(combo) != len(fam.labels):
            raise ValueError(f"{name}: combination {combo} does not match labels {fam.labels}")
        if not fam.labels:
            if fam.kind == "gauge" and not getattr(obj, "_dspark_precreated", False):
                obj.set(0)
                obj._dspark_precreated = True
            continue
        with _LOCK:
            new = combo not in getattr(obj, "_metrics", {})
            ch = obj.labels(*combo)
        if new and fam.kind == "gauge":
            ch.set(0)


def precreate_process(role: str, active_features: Iterable[str], dp_label: str) -> list[str]:
    """Pre-create every declared combination of every family emitted in ``role`` whose feature is
    active here ("core" always is). Returns the names of the families touched."""
    active = set(active_features) | {"core"}
    done = []
    for fam in FAMILIES.values():
        if fam.roles and role not in fam.roles:
            continue
        if fam.feature not in active:
            continue
        combos = [tuple(dp_label if v == DP_RANK else v for v in combo) for combo in fam.precreate]
        if not fam.labels:
            combos = [()]
        if combos:
            precreate(fam.name, combos)
            done.append(fam.name)
    return done


# -- readiness (main process) ----------------------------------------------------------------

def ready() -> bool:
    return _READY


def defer_until_configured() -> None:
    """Main process, before SGLang decided its Prometheus mode: hold :func:`when_ready` work."""
    global _READY
    with _LOCK:
        if "prometheus_client.values" in sys.modules or _has_multiproc_env():
            return  # already decided (embedding app imported prometheus_client, or env preset)
        _READY = False


def configured() -> None:
    """SGLang has configured Prometheus (PROMETHEUS_MULTIPROC_DIR set when --enable-metrics):
    repair an early import, drop metrics created too early, run the deferred work."""
    global _READY
    with _LOCK:
        if _READY:
            pending = []
        else:
            _repair_value_class()
            for name in sorted(_EARLY):
                logger.warning(
                    "dspark-harden metric %s was created in the main process before SGLang configured "
                    "Prometheus multiprocess mode; it is re-created now and earlier values are lost "
                    "(use metrics.when_ready for start-up publishing)", name,
                )
                _forget(name)
            _EARLY.clear()
            _READY = True
            pending, _PENDING[:] = list(_PENDING), []
    for fn in pending:
        fn()


def when_ready(fn: Callable[[], None]) -> None:
    """Run ``fn`` now if metrics may be created in this process, else once SGLang configured them."""
    with _LOCK:
        if not _READY:
            _PENDING.append(fn)
            return
    fn()


def _has_multiproc_env() -> bool:
    import os

    # prometheus_client switches on presence, not value
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_multiproc_dir" in os.environ


def _repair_value_class() -> None:
    """If prometheus_client.values was imported before PROMETHEUS_MULTIPROC_DIR existed, its value
    class is the in-process one and no metric created from now on would reach /metrics. Re-pick it
    (prometheus_client reads ``values.ValueClass`` whenever a metric child is created)."""
    if not _has_multiproc_env():
        return
    mod = sys.modules.get("prometheus_client.values")
    if mod is None:
        return
    if not getattr(mod.ValueClass, "_multiprocess", False):
        logger.warning("dspark-harden: prometheus_client was imported before PROMETHEUS_MULTIPROC_DIR was set; "
                       "switching it to multiprocess values")
        mod.ValueClass = mod.get_value_class()


def _forget(name: str) -> None:
    obj = _LIVE.pop(name, None)
    if obj is None:
        return
    try:
        import prometheus_client as pc

        pc.REGISTRY.unregister(obj)
    except (KeyError, ValueError):  # pragma: no cover - not registered
        pass


def reset_for_tests() -> None:
    """Forget live objects and unregister them from prometheus_client's default registry."""
    global _READY
    with _LOCK:
        for name in list(_LIVE):
            _forget(name)
        _EARLY.clear()
        _PENDING.clear()
        _READY = True


def families(feature: Optional[str] = None) -> list[Family]:
    return [f for f in FAMILIES.values() if feature is None or f.feature == feature]
