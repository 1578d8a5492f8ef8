"""The /health_scheduler decision, separated from HTTP so every 503 reason is unit-testable.

Inputs are what the tokenizer process can see without talking to a scheduler: the server state
flags of the ``TokenizerManager`` and the per-DP-rank load snapshots that stock schedulers publish
into shared memory (``sglang.srt.managers.load_snapshot``; written by
``Scheduler.publish_load_snapshot``, read with the same ``ShmLoadSnapshotReader`` the DP controller
and ``/v1/loads`` use). Timestamps are wall clock (``time.time()`` in the scheduler's
``load_inquirer``), so the check compares against ``time.time()`` here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

# Every outcome the check can report (also the ``outcome`` label values of
# dspark_harden_health_scheduler_checks_total). Order of the failure reasons is the order in
# which they are checked.
OK = "ok"
NO_STATE = "no_state"
SHUTTING_DOWN = "shutting_down"
STARTING = "starting"
READ_ERROR = "read_error"
MISSING_RANKS = "missing_ranks"
DUPLICATE_RANKS = "duplicate_ranks"
UNEXPECTED_RANKS = "unexpected_ranks"
NON_POSITIVE_TIMESTAMP = "non_positive_timestamp"
FUTURE_TIMESTAMP = "future_timestamp"
STALE = "stale"
#: a child process (scheduler of a DP rank, detokenizer, DP controller) died and the server is
#: stopping; set by the lifecycle feature as ``tokenizer_manager.dspark_harden_fault``
CHILD_DIED = "child_died"
#: a DP rank waits in the native DP2 exchange for a peer that is alive but does not arrive; the
#: waiting rank publishes it on the DP2 stall board (dspark_harden.dp2.board), naming the peer
DP2_STALLED = "dp2_stalled"

OUTCOMES = (
    OK,
    NO_STATE,
    SHUTTING_DOWN,
    STARTING,
    READ_ERROR,
    MISSING_RANKS,
    DUPLICATE_RANKS,
    UNEXPECTED_RANKS,
    NON_POSITIVE_TIMESTAMP,
    FUTURE_TIMESTAMP,
    STALE,
    CHILD_DIED,
    DP2_STALLED,
)


@dataclass
class Verdict:
    ok: bool
    reason: str
    message: str
    expected_ranks: Optional[int] = None
    ranks: dict = field(default_factory=dict)  # str(dp_rank) -> {"timestamp", "age_s"}
    bad_ranks: list = field(default_factory=list)

    @property
    def status_code(self) -> int:
        return 200 if self.ok else 503

    def to_dict(self) -> dict:
        out = {
            "status": "ok" if self.ok else "unhealthy",
            "reason": self.reason,
            "message": self.message,
        }
        if self.expected_ranks is not None:
            out["expected_dp_ranks"] = self.expected_ranks
        if self.ranks:
            out["ranks"] = self.ranks
        if self.bad_ranks:
            out["bad_ranks"] = self.bad_ranks
        return out


def _fail(reason: str, message: str, **kw: Any) -> Verdict:
    return Verdict(ok=False, reason=reason, message=message, **kw)


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return ("DP rank " if len(ranks) == 1 else "DP ranks ") + ", ".join(str(r) for r in ranks)


def evaluate_snapshots(
    snapshots: list,
    expected_ranks: int,
    *,
    now: float,
    max_staleness_s: float,
    max_future_skew_s: float,
) -> Verdict:
    """Healthy only when ranks {0..expected_ranks-1} each have exactly one snapshot whose
    timestamp is positive, at most ``max_future_skew_s`` in the future and at most
    ``max_staleness_s`` old."""
    counts: dict[int, int] = {}
    for snap in snapshots:
        counts[int(snap.dp_rank)] = counts.get(int(snap.dp_rank), 0) + 1
    expected = set(range(expected_ranks))
    ranks_detail: dict[str, dict] = {}
    for snap in snapshots:
        ts = float(snap.timestamp)
        ranks_detail.setdefault(str(int(snap.dp_rank)), {"timestamp": ts, "age_s": round(now - ts, 3)})
    common = dict(expected_ranks=expected_ranks, ranks=ranks_detail)

    missing = sorted(expected - counts.keys())
    if missing:
        return _fail(
            MISSING_RANKS,
            f"{_ranks_text(missing)} published no load snapshot (expected one per rank 0..{expected_ranks - 1})",
            bad_ranks=missing,
            **common,
        )
    dupes = sorted(r for r, c in counts.items() if c > 1)
    if dupes:
        return _fail(
            DUPLICATE_RANKS,
            f"{_ranks_text(dupes)} appear in more than one load snapshot slot",
            bad_ranks=dupes,
            **common,
        )
    extra = sorted(counts.keys() - expected)
    if extra:
        return _fail(
            UNEXPECTED_RANKS,
            f"load snapshots name {_ranks_text(extra)}, outside 0..{expected_ranks - 1}",
            bad_ranks=extra,
            **common,
        )

    by_rank = {int(s.dp_rank): float(s.timestamp) for s in snapshots}
    non_pos = sorted(r for r, ts in by_rank.items() if not (ts > 0) or not math.isfinite(ts))
    if non_pos:
        return _fail(
            NON_POSITIVE_TIMESTAMP,
            f"{_ranks_text(non_pos)} load snapshot has no positive timestamp "
            "(the scheduler created its slot but has not published yet)",
            bad_ranks=non_pos,
            **common,
        )
    future = sorted(r for r, ts in by_rank.items() if now - ts < -max_future_skew_s)
    if future:
        worst = max(by_rank[r] - now for r in future)
        return _fail(
            FUTURE_TIMESTAMP,
            f"{_ranks_text(future)} load snapshot is dated {worst:.1f} s in the future "
            f"(limit {max_future_skew_s:g} s; clock skew?)",
            bad_ranks=future,
            **common,
        )
    stale = sorted(r for r, ts in by_rank.items() if now - ts > max_staleness_s)
    if stale:
        worst = max(now - by_rank[r] for r in stale)
        return _fail(
            STALE,
            f"{_ranks_text(stale)} load snapshot is stale: last published {worst:.1f} s ago "
            f"(limit {max_staleness_s:g} s; scheduler stuck, stopped or dead?)",
            bad_ranks=stale,
            **common,
        )
    return Verdict(
        ok=True, reason=OK, message=f"all {expected_ranks} DP rank(s) published a fresh load snapshot", **common
    )


def evaluate_server(
    tokenizer_manager: Any,
    *,
    now_fn: Callable[[], float],
    max_staleness_s: float,
    max_future_skew_s: float,
    expected_ranks_fn: Optional[Callable[[Any], int]] = None,
    dp2_stalls_fn: Optional[Callable[[], list]] = None,
) -> Verdict:
    """The full check against a live ``TokenizerManager`` (or ``None`` when the HTTP global
    state does not exist yet). ``dp2_stalls_fn``: the current DP2 stall records
    (:func:`dspark_harden.dp2.board.health_stalls`), checked before the snapshots."""
    if tokenizer_manager is None:
        return _fail(NO_STATE, "the HTTP server has no tokenizer manager yet (global state missing)")
    fault = getattr(tokenizer_manager, "dspark_harden_fault", None)
    if isinstance(fault, dict) and fault.get("message"):
        rank = fault.get("dp_rank")
        return _fail(
            CHILD_DIED, f"{fault['message']}; the server is stopping", bad_ranks=[int(rank)] if rank is not None else []
        )
    if getattr(tokenizer_manager, "gracefully_exit", False):
        return _fail(SHUTTING_DOWN, "the server is shutting down")
    status = getattr(tokenizer_manager, "server_status", None)
    if getattr(status, "value", status) == "Starting":
        return _fail(STARTING, "the server is starting (warmup not finished)")
    if dp2_stalls_fn is not None:
        try:
            stalls = list(dp2_stalls_fn())
        except Exception as exc:  # noqa: BLE001 - an unreadable board is a 503 with its cause
            return _fail(READ_ERROR, f"reading the DP2 stall board failed: {type(exc).__name__}: {exc}")
        if stalls:
            return evaluate_dp2_stalls(stalls)
    try:
        expected = (expected_ranks_fn or default_expected_ranks)(tokenizer_manager)
        snapshots = tokenizer_manager.load_snapshot_reader.read_all()
    except Exception as exc:  # noqa: BLE001 - any read failure is a 503 with its cause
        return _fail(READ_ERROR, f"reading the load snapshots failed: {type(exc).__name__}: {exc}")
    return evaluate_snapshots(
        list(snapshots),
        expected,
        now=now_fn(),
        max_staleness_s=max_staleness_s,
        max_future_skew_s=max_future_skew_s,
    )


def evaluate_dp2_stalls(stalls: list) -> Verdict:
    """503 naming the DP rank(s) the others wait for in the native DP2 exchange."""
    late = sorted({int(r["peer_rank"]) for r in stalls})
    parts = [
        f"DP rank {int(r['rank'])} has waited {float(r['waited_s']):.1f} s for DP rank {int(r['peer_rank'])} "
        f"(DP2 channel {r.get('channel')}): {r.get('message', '')}"
        for r in stalls
    ]
    return _fail(
        DP2_STALLED,
        f"{_ranks_text(late)} stalled: alive but not taking part in the scheduler steps; " + "; ".join(parts),
        bad_ranks=late,
    )


def default_expected_ranks(tokenizer_manager: Any) -> int:
    """Number of DP ranks the tokenizer currently routes to (``elastic_worker_count`` follows
    Elastic EP scale events; it equals ``--dp-size`` otherwise)."""
    count = getattr(tokenizer_manager, "elastic_worker_count", None)
    if count is None:
        from sglang.srt.runtime_context import get_parallel

        count = get_parallel().num_dp_ranks
    count = int(count)
    if count < 1:
        raise ValueError(f"expected DP rank count is {count}")
    return count
