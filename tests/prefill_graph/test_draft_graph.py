"""Feature ``dspark-draft-graph-memory`` (issue 41 item 4; sglang #39886): the DSpark draft CUDA-graph
capture decision is one decision for the draft graph group.

Two real processes join a real gloo group (127.0.0.1, a file store) and each runs stock
``DSparkWorkerV2.init_cuda_graphs`` (the live function) on a worker namespace holding what stock builds in
DSpark's DP-attention geometry: a real ``SpecTpSync`` on a one-rank gloo group (``get_dp_tp_group()``
under attention-TP 1) and a draft graph group over both ranks (``_draft_graph_group``: the real 2-rank
gloo group as its ``cpu_group``). What the draft worker is asked (``capture_decode_cuda_graph``) is the
decision. Stand-ins, for the GPU that cannot exist here: sglang's free-memory query
(``sglang.srt.utils.common.get_free_cpu_memory``, read by stock ``get_available_gpu_memory`` for
``device="cpu"``, and ``get_cpu_ids_by_node`` -> one node) returns each rank's configured free memory,
and ``dspark_worker_v2.is_cuda_alike`` returns True so stock takes its GPU decision. The draft's
pipeline scope (``draft_pp_context``, entered after the decision, needs SGLang's model-parallel state) is a
null context. Everything else, stock's reduction included, is the real code.

Mutation (tests/prefill_graph/mutations.py, D1): the wrap calling stock for every group (the per-rank
decision restored) turns ``test_the_patch_makes_one_decision_for_the_draft_graph_group`` and the probe
test red.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest

# imported at collection: forked ranks then pay for their own setup only
from sglang.srt.speculative.dspark_components import dspark_worker_v2 as W
from sglang.srt.speculative.spec_tp_sync import SpecTpSync, SpecTpSyncSite

from dspark_harden.prefill_graph import draft_graph as DG

GIB = 1 << 30


def _rank(rank: int, store: str, rounds: list, fix: bool, leave: bool, out) -> None:
    """One rank: for each ``(free_gib_rank0, free_gib_rank1)`` round, run stock ``init_cuda_graphs`` and
    report ``(rank, round, capture decision, available_memory_gb, warnings)``; errors are reported too.
    ``leave``: rank 1 joins the group, then exits before the decision (a peer that died)."""
    import contextlib
    import datetime
    import logging
    import types

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    singles = [dist.new_group([r]) for r in (0, 1)]  # every rank creates every group
    try:
        from sglang.srt.utils import common

        free = {"gib": 0.0}
        common.get_free_cpu_memory = lambda: int(free["gib"] * GIB)  # stand-in: this rank's free memory
        common.get_cpu_ids_by_node = lambda: ["0"]
        W.is_cuda_alike = lambda: True  # stand-in: a GPU platform
        W.draft_pp_context = contextlib.nullcontext  # the draft's pp scope: after the decision, no pp here
        warnings: list = []

        class _Catch(logging.Handler):
            def emit(self, record):
                warnings.append(record.getMessage())

        logging.getLogger("dspark_harden.draft_graph").addHandler(_Catch(level=logging.WARNING))
        if fix:
            DG.patches()[0].apply()
        if leave and rank == 1:
            dist.barrier()
            os._exit(0)
        if leave:
            dist.barrier()
        asked: list = []
        draft_group = types.SimpleNamespace(world_size=2, rank_in_group=rank, cpu_group=dist.group.WORLD)
        worker = types.SimpleNamespace(
            _hosts_draft=True,
            _decode_graph_allowed=True,
            _tp_sync=SpecTpSync(types.SimpleNamespace(world_size=1, rank_in_group=0, cpu_group=singles[rank])),
            device="cpu",
            gpu_id=0,
            _draft_graph_group=draft_group,
            _draft_context=contextlib.nullcontext,
            _maybe_build_draft_sampler=lambda: None,
            _draft_sampler=None,
            _proposer=types.SimpleNamespace(attach_draft_sampler=lambda s: None),
            _deferred_commit=lambda: None,
            draft_model_runner=types.SimpleNamespace(capture_tail_hooks=[]),
            _draft_worker=types.SimpleNamespace(
                init_cuda_graphs=lambda capture_decode_cuda_graph: asked.append(capture_decode_cuda_graph)
            ),
        )
        for i, gibs in enumerate(rounds):
            free["gib"] = gibs[rank]
            del warnings[:]
            try:
                W.DSparkWorkerV2.init_cuda_graphs(worker)
                logged = list(warnings)
                mem = worker._tp_sync.available_memory_gb(SpecTpSyncSite.DSPARK_MEM, "cpu", 0, group=draft_group)
            except Exception as exc:  # noqa: BLE001
                out.put((rank, i, "error", f"{type(exc).__name__}: {exc}", []))
                return
            out.put((rank, i, asked[-1], round(mem, 6), logged))
    except BaseException as exc:  # noqa: BLE001
        out.put((rank, -1, "crashed", f"{type(exc).__name__}: {exc}", []))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _run(tmp_path, rounds, *, fix, leave=False) -> dict:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_rank, args=(r, store, rounds, fix, leave, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    expected = 1 if leave else 2 * len(rounds)
    got = {}
    for _ in range(expected):
        rank, i, *rest = out.get(timeout=120)
        got[(rank, i)] = tuple(rest)
    for p in procs:
        p.join(60)
        assert p.exitcode is not None, "a rank did not exit"
    return got


def test_stock_decides_per_rank_across_1_gib(tmp_path):
    """The red: stock 0.5.23, ranks with 0.5 and 3 GiB free: rank 0 skips the capture, rank 1 captures
    (on a GPU rank 1 then waits forever in the capture's collectives)."""
    got = _run(tmp_path, [(0.5, 3.0)], fix=False)
    assert got[(0, 0)][:2] == (False, 0.5), got
    assert got[(1, 0)][:2] == (True, 3.0), got


def test_the_patch_makes_one_decision_for_the_draft_graph_group(tmp_path):
    """The green: with the wrap bound both ranks decide on the group minimum -- both skip at 0.5 / 3 GiB
    (rank 1 warns naming both values), both capture at 3 / 5 GiB (stock's capture kept), both skip when
    both are below 1 GiB."""
    got = _run(tmp_path, [(0.5, 3.0), (3.0, 5.0), (0.25, 0.75)], fix=True)
    assert got[(0, 0)][:2] == got[(1, 0)][:2] == (False, 0.5), got
    assert got[(0, 1)][:2] == got[(1, 1)][:2] == (True, 3.0), got
    assert got[(0, 2)][:2] == got[(1, 2)][:2] == (False, 0.25), got
    assert got[(0, 0)][2] == [] and len(got[(1, 0)][2]) == 1, got
    assert (
        "rank 1 of the 2-rank draft graph group has 3.00 GiB free, the group minimum is 0.50 GiB" in got[(1, 0)][2][0]
    )


def test_a_failed_reduction_refuses_naming_this_ranks_free_memory(tmp_path):
    """The peer died before the decision: rank 0 does not decide alone, it raises naming its free memory
    (the real gloo reduction fails on the closed connection)."""
    got = _run(tmp_path, [(0.5, 3.0)], fix=True, leave=True)
    kind, msg = got[(0, 0)][:2]
    assert kind == "error", got
    assert msg.startswith("DraftGraphDecisionError: DSpark draft CUDA-graph decision: rank 0 of the 2-rank"), msg
    assert "has 0.50 GiB free, but the group minimum could not be reduced" in msg, msg


@pytest.mark.forked
def test_probe_red_on_stock_green_with_the_patch_round_trip():
    """The startup probe on the live method: stock decides per rank; the bound wrap reduces; reverted,
    stock again; re-applied, one decision again (apply -> revert -> apply)."""
    patch = DG.patches()[0]
    stock = SpecTpSync.__dict__["available_memory_gb"]
    one, detail = DG.probe_decision()
    assert not one and "live SpecTpSync.available_memory_gb decides per rank" in detail, detail
    assert "returned this rank's own" in detail, detail
    patch.apply()
    one, detail = DG.probe_decision()
    assert one and "reduces over the 2-rank draft graph group" in detail, detail
    assert SpecTpSync.__dict__["available_memory_gb"].__wrapped__ is stock
    patch.revert()
    assert SpecTpSync.__dict__["available_memory_gb"] is stock
    assert not DG.probe_decision()[0]
    patch.apply()
    assert DG.probe_decision()[0]
    patch.apply()  # twice: no-op
    assert SpecTpSync.__dict__["available_memory_gb"].__wrapped__ is stock
    patch.revert()
    patch.revert()
    assert SpecTpSync.__dict__["available_memory_gb"] is stock


def _sa(**kw):
    import types

    base = dict(speculative_algorithm="DSPARK", tp_size=2, dp_size=2, enable_dp_attention=True, attn_cp_size=1)
    return types.SimpleNamespace(**{**base, **kw})


def test_preconditions_from_the_server_args():
    assert DG.preconditions(_sa()) == []
    assert "not DSPARK (--speculative-algorithm DSPARK)" in DG.preconditions(_sa(speculative_algorithm="EAGLE"))[0]
    assert "not DSPARK" in DG.preconditions(_sa(speculative_algorithm=None))[0]
    no_dpa = DG.preconditions(_sa(dp_size=1, enable_dp_attention=False))
    assert "attention-TP 2 equals TP 2" in no_dpa[0] and "--enable-dp-attention" in no_dpa[0]


@pytest.mark.forked
@pytest.mark.parametrize(
    "args,environ,status,words",
    [
        ({}, {}, "bound", "GiB (called) (sglang issue #39886"),
        ({"speculative_algorithm": "EAGLE"}, {}, "unavailable", "not DSPARK"),
        ({"speculative_algorithm": "EAGLE"}, {DG.SWITCH: "1"}, "failed", f"enabled by {DG.SWITCH}=1 but unavailable"),
        ({}, {DG.SWITCH: "0"}, "disabled", f"{DG.SWITCH}=0"),
    ],
)
def test_bind_decides_from_the_process_server_args(args, environ, status, words):
    """Through the real binder and the process-bound hook (which runs the probe on the live method)."""
    from dspark_harden import entry
    from dspark_harden.core import binder, roles
    from dspark_harden.core.patch import Role

    roles.CONTEXT = roles.ProcessContext(role=Role.SCHEDULER, server_args=None, tp_rank=0, dp_rank=0)
    roles.CHECK_SERVER_ARGS = _sa(**args)  # judged like `check -- <launch arguments>`: nothing else starts
    report = binder.bind(Role.SCHEDULER, environ=environ)
    error = None
    try:
        binder.raise_if_failed(report)
        entry._notify_bound(Role.SCHEDULER, report)
    except binder.BindError as exc:
        error = str(exc)
    st = next(f for f in report.features if f.name == DG.FEATURE)
    assert st.status == status, (st, error)
    assert words in st.detail, st.detail
    if status == "bound":
        assert error is None or DG.FEATURE not in error, error
        assert isinstance(SpecTpSync.__dict__["available_memory_gb"].__wrapped__, type(lambda: 0))
    elif status == "failed":
        assert error is not None and DG.SWITCH in error, error
    else:
        assert not st.targets
