"""Feature ``dspark-draft-graph-memory``: the DSpark draft CUDA-graph capture decision is one decision
for the whole draft graph group (issue 41 item 4; sglang issue #39886, fix PR #39954 open).

Stock 0.5.23 ``DSparkWorkerV2.init_cuda_graphs`` skips the draft graph capture when
``SpecTpSync.available_memory_gb(DSPARK_MEM, ..., group=self._draft_graph_group) < 1.0``. That method
reduces free memory to the group minimum only when its site is enabled, and ``SpecTpSync`` clears every
site when *its own* group has one rank: under DP attention with attention-TP 1 it is built on
``get_dp_tp_group()`` (one rank) while the draft graph group is the TP group (two ranks). Each rank then
decides on its own free memory; ranks on opposite sides of 1 GiB take different paths and the capturing
rank waits forever in the capture's collectives.

The patch (a wrap of ``SpecTpSync.available_memory_gb``) reduces the free memory to the minimum over the
group the caller names whenever it has more than one rank (one ``all_reduce`` MIN over its gloo
``cpu_group``, the collective stock runs when the site is on), so every rank takes the same path; a
failed reduction raises :class:`DraftGraphDecisionError` naming this rank's free memory (startup stops)
instead of deciding per rank. The probe (:func:`probe_decision`) runs the live method against a real
two-rank gloo group in this process whose peer reports -1 GiB: at startup it must show one decision
for the live (patched) method, and it reports whether stock still decides per rank (once a release
reduces by itself, the patch is unnecessary: the feature's detail says so).

Default on, scheduler processes only, wherever the server runs DSpark with an attention-TP group smaller
than the TP group (DP attention); elsewhere ``unavailable``. See docs/prefill_graph.md.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from ..core import roles
from ..core.feature import Feature, bound_status
from ..core.hookspecs import hookimpl
from ..core.patch import Kind, Patch, Role
from ..core.settings import Setting, flag01

logger = logging.getLogger("dspark_harden.draft_graph")

FEATURE = "dspark-draft-graph-memory"
SWITCH = "DSPARK_HARDEN_DRAFT_GRAPH_MEMORY"
TARGET = "sglang.srt.speculative.spec_tp_sync:SpecTpSync.available_memory_gb"
FINGERPRINT = "e6812ea92091bb0a"
#: read-only: the caller whose decision the patch makes one; it must still ask ``available_memory_gb``
#: with the draft graph group (source text, no import)
DECISION = "sglang.srt.speculative.dspark_components.dspark_worker_v2:DSparkWorkerV2.init_cuda_graphs"
MIRRORED_TEXT = {DECISION: "bc31cda200ab9497"}
UPSTREAM = "sglang issue #39886, fix PR #39954"
#: what the probe's peer rank reports (bytes): no real free-memory reading is negative
PEER_BYTES = -float(1 << 30)

SETTINGS = [
    Setting(
        SWITCH,
        flag01,
        True,
        "1: the DSpark draft CUDA-graph capture decision (free memory < 1 GiB skips the capture) is taken "
        "once for the draft graph group: free memory is reduced to the group minimum even where stock's "
        "SpecTpSync skips the reduction (DP attention with attention-TP 1), and a failed reduction stops "
        "startup naming this rank's free memory. On wherever DSpark runs with DP attention; 0: stock "
        "(each rank decides on its own free memory).",
        feature=FEATURE,
    )
]


class DraftGraphDecisionError(RuntimeError):
    """The draft graph group's free memory could not be reduced: no rank decides alone."""


def reduced_free_memory_gb(device: Any, gpu_id: int, group: Any) -> float:
    """Free memory of this rank (stock's own reading, ``get_available_gpu_memory`` as ``spec_tp_sync``
    resolves it), reduced to the minimum over ``group.cpu_group`` in bytes as float32: the value stock
    returns when its site is on."""
    import torch
    import torch.distributed as dist
    from sglang.srt.speculative import spec_tp_sync

    local = spec_tp_sync.get_available_gpu_memory(device, gpu_id, distributed=False)
    tensor = torch.tensor(local * (1 << 30), dtype=torch.float32)
    mine = tensor.item() / (1 << 30)
    rank, size = getattr(group, "rank_in_group", "?"), group.world_size
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group.cpu_group)
    except Exception as exc:  # noqa: BLE001 - any failure: refuse rather than decide per rank
        raise DraftGraphDecisionError(
            f"DSpark draft CUDA-graph decision: rank {rank} of the {size}-rank draft graph group has "
            f"{mine:.2f} GiB free, but the group minimum could not be reduced ({type(exc).__name__}: {exc}); "
            f"refusing to decide on this rank's memory alone: a rank that captures while another does not "
            f"hangs startup in the capture's collectives ({UPSTREAM}; {SWITCH}=0 restores stock)"
        ) from exc
    low = tensor.item() / (1 << 30)
    if low < mine:
        logger.warning(
            "dspark-harden: DSpark draft CUDA-graph decision: rank %s of the %d-rank draft graph group has "
            "%.2f GiB free, the group minimum is %.2f GiB: every rank decides on %.2f GiB (stock 0.5.23 "
            "would decide on this rank's own %.2f GiB: %s)",
            rank,
            size,
            mine,
            low,
            low,
            mine,
            UPSTREAM,
        )
    return low


def build(stock):
    def available_memory_gb(self, site, device, gpu_id, *, group):
        if getattr(group, "world_size", 1) <= 1:
            return stock(self, site, device, gpu_id, group=group)
        return reduced_free_memory_gb(device, gpu_id, group)

    return available_memory_gb


def probe_decision(method: Optional[Any] = None, label: str = "live", timeout_s: float = 30.0) -> tuple:
    """``(one_decision, detail)``: whether ``method`` (default: the live ``SpecTpSync.available_memory_gb``)
    reduces over the draft graph group in DSpark's DP-attention geometry. Runs it on a real ``SpecTpSync``
    built on a one-rank group (``get_dp_tp_group()`` under attention-TP 1) with a two-rank draft graph
    group whose ``cpu_group`` is a real gloo group of this process; the peer rank (a thread) reports
    -1 GiB through ``all_reduce`` MIN. A result below zero is the peer's value: one decision. Otherwise
    the method decided on this rank's memory alone, and the probe releases the peer itself. The group
    objects are namespaces with the attributes stock reads (``world_size``, ``rank_in_group``,
    ``cpu_group``); memory is read for ``device="cpu"`` (no CUDA touched at bind time)."""
    import datetime
    import types

    import torch
    import torch.distributed as dist
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite

    if method is None:
        method = SpecTpSync.available_memory_gb
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=timeout_s)
    pgs: list = [None, None]
    errors: list = []

    def make(rank: int) -> None:
        try:
            pgs[rank] = dist.ProcessGroupGloo(store, rank, 2, timeout)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"gloo rank {rank}: {type(exc).__name__}: {exc}")

    makers = [threading.Thread(target=make, args=(r,), daemon=True) for r in (0, 1)]
    for t in makers:
        t.start()
    for t in makers:
        t.join(timeout_s)
    if errors or None in pgs:
        return False, f"probe could not build its two-rank gloo group: {'; '.join(errors) or 'timed out'}"
    peer: dict = {}

    def peer_rank() -> None:
        t = torch.tensor(PEER_BYTES, dtype=torch.float32)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pgs[1])
        except Exception as exc:  # noqa: BLE001
            peer["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=peer_rank, name="dspark-harden-draft-graph-probe", daemon=True)
    thread.start()
    sync = SpecTpSync(types.SimpleNamespace(world_size=1, rank_in_group=0))
    group = types.SimpleNamespace(world_size=2, rank_in_group=0, cpu_group=pgs[0])
    quiet, logger.disabled = logger.disabled, True
    try:
        got = method(sync, SpecTpSyncSite.DSPARK_MEM, "cpu", 0, group=group)
    except Exception as exc:  # noqa: BLE001
        got, raised = None, f"{type(exc).__name__}: {exc}"
    else:
        raised = None
    finally:
        logger.disabled = quiet
    one = got is not None and got < 0
    if not one:  # nothing (or something else) reduced with the peer: release it
        try:
            dist.all_reduce(torch.tensor(0.0), op=dist.ReduceOp.MIN, group=pgs[0])
        except Exception:  # noqa: BLE001 - the peer then ends by its timeout
            pass
    thread.join(timeout_s)
    name = f"{label} SpecTpSync.available_memory_gb"
    if raised:
        return False, f"{name} raised {raised} in a 2-rank draft graph group over a 1-rank SpecTpSync group"
    if one:
        return True, f"{name} reduces over the 2-rank draft graph group of a 1-rank SpecTpSync (called)"
    return False, (
        f"{name} decides per rank: with a 1-rank SpecTpSync group and a 2-rank draft graph group whose peer "
        f"reports -1 GiB it returned this rank's own {got:.2f} GiB (called)"
    )


def preconditions(server_args: Any) -> list:
    """Why the feature cannot apply to this server (empty: it applies)."""
    from .feature import _resolved, geometry, speculative_algorithm_name

    view = _resolved(server_args) or server_args
    name = speculative_algorithm_name(view)
    if name != "DSPARK":
        return [f"speculative algorithm is {name}, not DSPARK (--speculative-algorithm DSPARK)"]
    tp, _attn_dp, attn_tp = geometry(server_args)
    if attn_tp >= tp:
        return [
            f"attention-TP {attn_tp} equals TP {tp}: stock's SpecTpSync already spans the draft graph group "
            f"(the per-rank decision needs DP attention: --tp 2 --dp 2 --enable-dp-attention)"
        ]
    return []


def _available(settings) -> Optional[str]:
    server_args = roles.judged_server_args()
    if server_args is None:
        return None  # self-check child: bind the target to prove it
    return "; ".join(preconditions(server_args)) or None


@hookimpl
def dspark_features():
    return [
        Feature(
            name=FEATURE,
            area="prefill-graph",
            description="one DSpark draft CUDA-graph capture decision: free memory reduced over the draft graph "
            "group under DP attention (stock decides per rank), or startup refused naming this rank's memory",
            switch=SWITCH,
            default_on=True,
            available=_available,
            roles=frozenset({Role.SCHEDULER}),
        )
    ]


@hookimpl
def dspark_settings():
    return list(SETTINGS)


@hookimpl
def dspark_stock_sources():
    from ..core.porting import StockSource

    return [
        StockSource(FEATURE, target, fp, "the draft graph decision the patch makes one")
        for target, fp in MIRRORED_TEXT.items()
    ]


def patches() -> list:
    return [
        Patch(
            feature=FEATURE,
            target=TARGET,
            kind=Kind.WRAP,
            roles={Role.SCHEDULER},
            build=build,
            fingerprint=FINGERPRINT,
            why="SpecTpSync clears its sites when its own group has one rank (get_dp_tp_group() under DP "
            "attention with attention-TP 1), so the DSPARK_MEM reduction over the 2-rank draft graph group is "
            "skipped: ranks on opposite sides of 1 GiB disagree on capturing the draft graph and the capture's "
            "collectives hang startup; the wrap reduces over the caller's group whenever it has >1 rank "
            "(stock for one rank) and raises, naming this rank's free memory, when it cannot",
            retire_when="sglang reduces available_memory_gb over the caller's group even when SpecTpSync's own "
            "group has one rank (PR #39954, fixes #39886): the startup probe then reports stock as one decision",
        )
    ]


@hookimpl
def dspark_patches(role, settings):
    if role is not Role.SCHEDULER or not settings[SWITCH]:
        return []
    return patches()


@hookimpl
def dspark_process_bound(role, settings, report):
    """Prove the fix on the live method and say whether stock still needs it; refuse otherwise."""
    st = bound_status(report, FEATURE)
    if role is not Role.SCHEDULER or st is None:
        return
    import inspect

    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    from ..core.binder import refuse
    from ..core.patch import source_drift

    problem = None
    drifted = source_drift({}, text=MIRRORED_TEXT, allow=settings["DSPARK_HARDEN_ALLOW_DRIFT"])
    if drifted:
        problem = "the stock draft graph decision changed: " + "; ".join(drifted) + " (DSPARK_HARDEN_ALLOW_DRIFT)"
    live = SpecTpSync.available_memory_gb
    one, live_detail = probe_decision(live) if problem is None else (False, "")
    if problem is None and not one:
        problem = f"the live draft graph memory decision is still per rank: {live_detail}"
    if problem:
        refuse(report, role, FEATURE, problem, st)
    stock_one, stock_detail = probe_decision(inspect.unwrap(live), label="stock")
    st.detail = f"{live_detail}; " + (
        f"{stock_detail}: stock makes one decision now, this patch is unnecessary: retire it ({UPSTREAM})"
        if stock_one
        else f"{stock_detail} ({UPSTREAM})"
    )
