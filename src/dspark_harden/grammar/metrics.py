"""The grammar service's metric families (declared here, exported through the feature's
``dspark_metrics`` hook) and their runtime helpers.

Every helper is cheap and never raises: metrics must not fail a request.
"""

from __future__ import annotations

import logging

from ..core import metrics as M
from ..core.metrics import DP_RANK, Family, MetricGroup
from .settings import FEATURE

logger = logging.getLogger("dspark_harden.grammar")

SOURCES = ("memory", "inflight", "disk", "compile", "local_compile", "oversized", "corrupt", "refused")
MARKER_REASONS = (
    "slow_load",
    "predicted_slow",
    "too_large",
    "serialize_failed",
    "memory_limit",
    "deadline",
    "helper_failed",
    "slow_load_served",
)
SKIP_REASONS = ("queue_full", "queued", "retries_exhausted", "cpu_budget")
DISK_ERROR_OPS = ("publish", "prune", "helper", "lock_timeout", "protocol", "read")
# mirrors disk.DEGRADE_REASONS (a test keeps them equal; importing it here would load the disk module into every
# process that builds the registry); the persister's transient causes and the claims' outcomes are these
DEGRADE_REASONS = ("unsafe", "permission", "read_only", "no_space", "lock_timeout", "error")
TRANSIENT_CAUSES = (
    "killed",
    "starved",
    "stuck",
    "crashed",
    "publish_timeout",
    "protocol",
    "lock_timeout",
    "publish_error",
    "helper_unavailable",
)
CLAIM_OUTCOMES = ("claimed", "local", "hit", "expired", "claimant_dead", "released", "invalid", "error")
RATIO_BUCKETS = (1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)
PHASES = (
    "claim_wait",
    "disk_read",
    "verify",
    "deserialize",
    "native_compile",
    "serialize",
    "measure_compile",
    "measure_load",
    "entry_write_account",
)

FAMILIES = (
    Family(
        "dspark_harden_grammar_lookups_total",
        "counter",
        "Grammar lookups by how they were resolved: memory (LRU hit), inflight (joined a compile "
        "already running for the same canonical key), disk (loaded a serialized entry), compile "
        "(compiled natively, nothing on disk), local_compile (compiled because the disk entry is a "
        "compile-locally marker), oversized (the disk entry is larger than this server's "
        "DSPARK_HARDEN_GRAMMAR_DISK_MAX_ENTRY_BYTES: not read, compiled locally), corrupt (the disk entry was "
        "invalid: moved to the namespace's quarantine and the request served by a fresh compile, or, where it "
        "could not be moved, the request failed naming the file; never served from it), refused (the grammar text was above DSPARK_HARDEN_GRAMMAR_MAX_BYTES: "
        "failed at once, never compiled).",
        labels=("dp_rank", "source"),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=tuple((DP_RANK, s) for s in SOURCES),
        aggregation="`sum by (source) (rate(...))`; the hit ratio is `(memory+inflight+disk)/all`.",
    ),
    Family(
        "dspark_harden_grammar_resolution_seconds",
        "histogram",
        "Time from lookup until the request's own matcher copy is ready, by source.",
        labels=("dp_rank", "source"),
        feature=FEATURE,
        roles=("scheduler",),
        aggregation="`histogram_quantile(0.99, sum by (le, source) (rate(..._bucket[5m])))`.",
    ),
    Family(
        "dspark_harden_grammar_phase_seconds",
        "histogram",
        "Time spent in one phase of the persistent cache: claim_wait (waiting on another process's "
        "compile-in-progress claim), disk_read, verify (checksum/scope/key), "
        "deserialize, native_compile, serialize, measure_compile and measure_load (re-compile and trial load deciding serialized vs "
        "marker), entry_write_account (atomic publish + ledger + pruning).",
        labels=("dp_rank", "phase"),
        feature=FEATURE,
        roles=("scheduler",),
        aggregation="`sum by (phase) (rate(..._sum[5m]))` shows where time goes.",
    ),
    Family(
        "dspark_harden_grammar_memory_cache_bytes",
        "gauge",
        "Bytes held by this process's in-memory grammar LRU (compiled grammars' own memory size).",
        labels=("dp_rank",),
        multiprocess_mode="livesum",
        feature=FEATURE,
        roles=("scheduler",),
        aggregation="`sum`: each scheduler has its own LRU.",
    ),
    Family(
        "dspark_harden_grammar_memory_cache_entries",
        "gauge",
        "Entries in this process's in-memory grammar LRU.",
        labels=("dp_rank",),
        multiprocess_mode="livesum",
        feature=FEATURE,
        roles=("scheduler",),
        aggregation="`sum`.",
    ),
    Family(
        "dspark_harden_grammar_disk_cache_bytes",
        "gauge",
        "Byte ledger of the shared disk cache namespace, as last written by this process.",
        labels=("dp_rank",),
        multiprocess_mode="max",
        feature=FEATURE,
        roles=("scheduler",),
        aggregation="`max`: ranks of one host share the namespace; never sum.",
    ),
    Family(
        "dspark_harden_grammar_evictions_total",
        "counter",
        "Entries removed to respect a limit: tier memory (reason bytes|entries) or disk (reason prune).",
        labels=("dp_rank", "tier", "reason"),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=((DP_RANK, "memory", "bytes"), (DP_RANK, "memory", "entries"), (DP_RANK, "disk", "prune")),
        aggregation="`sum by (tier, reason) (rate(...))`; steady memory evictions mean the LRU limits are too small for the schema mix.",
    ),
    Family(
        "dspark_harden_grammar_corrupt_entries_total",
        "counter",
        "Disk entries rejected as corrupt, truncated or foreign (moved to quarantine, ERROR logged, the "
        "grammar compiled afresh; the request failed only where the move failed).",
        labels=("dp_rank",),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=((DP_RANK,),),
        aggregation="`sum (increase(...))`; any increase needs `dspark-harden grammar-cache verify`.",
    ),
    Family(
        "dspark_harden_grammar_compile_timeouts_total",
        "counter",
        "Requests failed because their grammar was not ready within DSPARK_HARDEN_GRAMMAR_COMPILE_TIMEOUT "
        "(the compile itself continues and is cached for a retry).",
        labels=("dp_rank",),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=((DP_RANK,),),
        aggregation="`sum (increase(...))`.",
    ),
    Family(
        "dspark_harden_grammar_compile_failures_total",
        "counter",
        "Compiles that raised (not cached; invalid grammars are results, not failures).",
        labels=("dp_rank",),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=((DP_RANK,),),
        aggregation="`sum (increase(...))`.",
    ),
    Family(
        "dspark_harden_grammar_disk_stored_total",
        "counter",
        "Disk entries this process published, by what was stored: serialized grammar or marker.",
        labels=("dp_rank", "stored"),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=((DP_RANK, "serialized"), (DP_RANK, "marker")),
        aggregation="`sum by (stored) (increase(...))`.",
    ),
    Family(
        "dspark_harden_grammar_disk_errors_total",
        "counter",
        "Disk cache operations that failed: op publish (I/O error), prune (could not get under "
        "the hard limit; the new entry was withdrawn), helper (the persistence helper could not start), "
        "lock_timeout (a cache lock was not taken within DSPARK_HARDEN_GRAMMAR_DISK_LOCK_TIMEOUT: the "
        "publication was skipped), protocol (the helper wrote a line that was not its job's: it was "
        "restarted), read (an entry could not be read: compiled locally).",
        labels=("dp_rank", "op"),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=tuple((DP_RANK, op) for op in DISK_ERROR_OPS),
        aggregation="`sum by (op) (increase(...))`; any increase needs attention (disk full, limit too small, "
        "a stopped or wedged process holding a cache lock, a library printing into the helper).",
    ),
    Family(
        "dspark_harden_grammar_disk_markers_total",
        "counter",
        "Compile-locally markers this process published, by measured reason: slow_load, predicted_slow, "
        "too_large (serialized entry above DSPARK_HARDEN_GRAMMAR_DISK_MAX_ENTRY_BYTES), serialize_failed, "
        "memory_limit (the persistence helper hit its address-space limit), deadline (the job used more than "
        "DSPARK_HARDEN_GRAMMAR_DISK_HELPER_DEADLINE CPU seconds), helper_failed (it "
        "crashed the same way on every retry), slow_load_served (a serialized entry this process loaded slower than "
        "the cold compile recorded in it: demoted). Transient failures store no marker (disk_helper_transient_total).",
        labels=("dp_rank", "reason"),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=tuple((DP_RANK, r) for r in MARKER_REASONS),
        aggregation="`sum by (reason) (increase(...))`; memory_limit/deadline name grammars too costly to persist.",
    ),
    Family(
        "dspark_harden_grammar_disk_cache_enabled",
        "gauge",
        "1 while this scheduler's persistent grammar cache is in use; 0 when it runs memory-only because the "
        "cache root could not be used at start (see dspark_harden_grammar_disk_degraded_total) or the disk "
        "cache is switched off.",
        labels=("dp_rank",),
        multiprocess_mode="livemin",
        feature=FEATURE,
        roles=("scheduler",),
        aggregation="`min`: 0 on any rank means that rank compiles every grammar it misses.",
    ),
    Family(
        "dspark_harden_grammar_disk_degraded_total",
        "counter",
        "Grammar backends that started memory-only because the disk cache root was unusable, by reason: "
        "unsafe (not owned by this uid, group/world-writable, or a symbolic link), permission, read_only, "
        "no_space, lock_timeout, error. The WARNING names the root and the cause.",
        labels=("dp_rank", "reason"),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=tuple((DP_RANK, r) for r in DEGRADE_REASONS),
        aggregation="`sum by (reason) (increase(...))`; any increase: fix the root (`dspark-harden check` "
        "reports it) and restart.",
    ),
    Family(
        "dspark_harden_grammar_disk_helper_transient_total",
        "counter",
        "Persistence attempts that failed for a cause not measured to be the grammar's, so no "
        "compile-locally marker was stored and the job was retried (up to "
        "DSPARK_HARDEN_GRAMMAR_DISK_HELPER_RETRIES): killed (SIGKILL from outside: OOM killer, operator), "
        "starved (4x the deadline in wall time without using it in CPU: host load), stuck (every thread asleep "
        "without CPU for 30 s of running time: a deadlock; the helper is replaced), crashed (died otherwise), "
        "publish_timeout, protocol, lock_timeout, publish_error (I/O error, e.g. ENOSPC), helper_unavailable.",
        labels=("dp_rank", "cause"),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=tuple((DP_RANK, c) for c in TRANSIENT_CAUSES),
        aggregation="`sum by (cause) (increase(...))`; steady killed means host memory pressure.",
    ),
    Family(
        "dspark_harden_grammar_disk_publish_skipped_total",
        "counter",
        "Publications not attempted: queue_full (DSPARK_HARDEN_GRAMMAR_DISK_PUBLISH_QUEUE jobs already "
        "waiting or retrying), queued (the same key is already waiting), retries_exhausted (every attempt "
        "failed transiently: nothing was stored, a later miss tries again) or cpu_budget (the persistence "
        "helper had used its DSPARK_HARDEN_GRAMMAR_DISK_HELPER_CPU_SHARE of a core).",
        labels=("dp_rank", "reason"),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=tuple((DP_RANK, r) for r in SKIP_REASONS),
        aggregation="`sum by (reason) (increase(...))`; steady queue_full means more new schemas than one helper persists.",
    ),
    Family(
        "dspark_harden_grammar_disk_deferred_total",
        "counter",
        "Publications kept for a key's second use: deferred (its first compile took less than "
        "DSPARK_HARDEN_GRAMMAR_DISK_PERSIST_MIN_COMPILE_S, nothing was persisted) and published_on_reuse (a "
        "later lookup used the key again, from memory or by joining its compile, and it was submitted then).",
        labels=("dp_rank", "event"),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=tuple((DP_RANK, e) for e in ("deferred", "published_on_reuse")),
        aggregation="`sum by (event) (increase(...))`; deferred far above published_on_reuse: mostly one-use schemas.",
    ),
    Family(
        "dspark_harden_grammar_disk_preloaded_total",
        "counter",
        "Grammars a (re)started scheduler loaded from its disk cache before any request asked "
        "(DSPARK_HARDEN_GRAMMAR_DISK_PRELOAD: the most recently used serialized entries), by event: loaded, "
        "used (a lookup was served from it without reading the disk) and dropped (no request took it within "
        "10 minutes of the preload's end: dropped at the first lookup after that, or when the scheduler stopped).",
        labels=("dp_rank", "event"),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=tuple((DP_RANK, e) for e in ("loaded", "used", "dropped")),
        aggregation="`sum by (event) (increase(...))`; dropped close to loaded: the preload costs more than it "
        "saves here, lower DSPARK_HARDEN_GRAMMAR_DISK_PRELOAD.",
    ),
    Family(
        "dspark_harden_grammar_disk_publish_queue_jobs",
        "gauge",
        "Publication jobs waiting for the persistence helper in this process (bounded by "
        "DSPARK_HARDEN_GRAMMAR_DISK_PUBLISH_QUEUE; a job holds the key text only).",
        labels=("dp_rank",),
        multiprocess_mode="livesum",
        feature=FEATURE,
        roles=("scheduler",),
        precreate=((DP_RANK,),),
        aggregation="`sum`.",
    ),
    Family(
        "dspark_harden_grammar_disk_claims_total",
        "counter",
        "Host-wide compile-in-progress claims met on a disk miss, by outcome: claimed (this process took the "
        "claim and compiles the key), local (this process's claim, given up after its compile: handing the key "
        "to another process was predicted dearer than compiling it, so each process compiles it and nobody "
        "waits), hit (waited on another process's claim and loaded its published entry "
        "or marker), expired (the wait bound, derived from the claimant's measured claim-to-publication "
        "time and capped by the request's timeout, passed: compiled itself), claimant_dead (the claimant's "
        "pid is gone or reused: its claim was removed), released (the claim went away without an entry -- "
        "the claimant's local decision or a failed compile: compiled itself at once), invalid (a claim file that cannot be trusted was ignored: compiled "
        "itself), error (the claim could not be created: compiled without one).",
        labels=("dp_rank", "outcome"),
        feature=FEATURE,
        roles=("scheduler",),
        precreate=tuple((DP_RANK, o) for o in CLAIM_OUTCOMES),
        aggregation="`sum by (outcome) (increase(...))`; host-wide compiles saved = hit; steady expired means "
        "publication is slower than the claimant's estimate (a busy or stopped helper). The time "
        'waited is `phase_seconds{phase="claim_wait"}`.',
    ),
    Family(
        "dspark_harden_grammar_serialized_memory_ratio",
        "histogram",
        "Serialized entry size over the compiled grammar's memory_size_bytes, per serialization the "
        "persistence helper completed (xgrammar 0.2.7: 1x to over 100x; see docs/grammar.md).",
        labels=("dp_rank",),
        buckets=RATIO_BUCKETS,
        feature=FEATURE,
        roles=("scheduler",),
        aggregation="`histogram_quantile(0.99, sum by (le) (rate(..._bucket[1h])))`.",
    ),
)

GROUP = MetricGroup(
    "Grammar service (feature `grammar-service`)",
    FAMILIES,
    intro="Every family comes from the scheduler processes (one grammar backend each); `dp_rank` is the "
    "scheduler's DP rank (`none` without DP). See [grammar.md](grammar.md).",
)


dp_label = M.process_dp_label
_safe = M.never_raises


@_safe
def lookup(source: str, seconds: float) -> None:
    dp = dp_label()
    M.get("dspark_harden_grammar_lookups_total").labels(dp, source).inc()
    M.get("dspark_harden_grammar_resolution_seconds").labels(dp, source).observe(seconds)


@_safe
def observe_phases(phases: dict) -> None:
    dp = dp_label()
    h = M.get("dspark_harden_grammar_phase_seconds")
    for name, sec in phases.items():
        h.labels(dp, name).observe(sec)


@_safe
def inc_corrupt() -> None:
    M.get("dspark_harden_grammar_corrupt_entries_total").labels(dp_label()).inc()


@_safe
def inc_timeout() -> None:
    M.get("dspark_harden_grammar_compile_timeouts_total").labels(dp_label()).inc()


@_safe
def inc_failure() -> None:
    M.get("dspark_harden_grammar_compile_failures_total").labels(dp_label()).inc()


@_safe
def inc_disk_error(op: str) -> None:
    M.get("dspark_harden_grammar_disk_errors_total").labels(dp_label(), op).inc()


@_safe
def inc_stored(kind: str, reason: str = "") -> None:
    dp = dp_label()
    M.get("dspark_harden_grammar_disk_stored_total").labels(dp, kind).inc()
    if kind == "marker" and reason:
        M.get("dspark_harden_grammar_disk_markers_total").labels(dp, reason).inc()


@_safe
def preloaded(event: str, n: int = 1) -> None:
    if n:
        M.get("dspark_harden_grammar_disk_preloaded_total").labels(dp_label(), event).inc(n)


@_safe
def inc_deferred(event: str) -> None:
    M.get("dspark_harden_grammar_disk_deferred_total").labels(dp_label(), event).inc()


@_safe
def inc_publish_skipped(reason: str) -> None:
    M.get("dspark_harden_grammar_disk_publish_skipped_total").labels(dp_label(), reason).inc()


@_safe
def set_publish_queue(n: int) -> None:
    M.get("dspark_harden_grammar_disk_publish_queue_jobs").labels(dp_label()).set(n)


@_safe
def observe_serialized_ratio(ratio: float) -> None:
    M.get("dspark_harden_grammar_serialized_memory_ratio").labels(dp_label()).observe(ratio)


@_safe
def claim(outcome: str) -> None:
    M.get("dspark_harden_grammar_disk_claims_total").labels(dp_label(), outcome).inc()


@_safe
def inc_evictions(tier: str, reason: str, n: int = 1) -> None:
    if n:
        M.get("dspark_harden_grammar_evictions_total").labels(dp_label(), tier, reason).inc(n)


@_safe
def set_memory(nbytes: int, entries: int) -> None:
    dp = dp_label()
    M.get("dspark_harden_grammar_memory_cache_bytes").labels(dp).set(nbytes)
    M.get("dspark_harden_grammar_memory_cache_entries").labels(dp).set(entries)


@_safe
def set_disk_bytes(nbytes: int) -> None:
    M.get("dspark_harden_grammar_disk_cache_bytes").labels(dp_label()).set(nbytes)


@_safe
def inc_helper_transient(cause: str) -> None:
    M.get("dspark_harden_grammar_disk_helper_transient_total").labels(dp_label(), cause).inc()


@_safe
def disk_degraded(reason: str) -> None:
    dp = dp_label()
    M.get("dspark_harden_grammar_disk_degraded_total").labels(dp, reason).inc()
    M.get("dspark_harden_grammar_disk_cache_enabled").labels(dp).set(0)


@_safe
def set_disk_enabled(on: bool) -> None:
    M.get("dspark_harden_grammar_disk_cache_enabled").labels(dp_label()).set(1 if on else 0)
