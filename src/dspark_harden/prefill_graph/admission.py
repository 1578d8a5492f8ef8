"""The three wrappers the feature binds (built around the real stock functions).

* :func:`build_vote` wraps ``dp_attn._local_prefill_cuda_graph_vote``: stock's vote with the
  *local* padding bound lifted (padding is decided on the shared bucket after the exchange),
  AND every forward-time check evaluated on the geometry this rank will present
  (:func:`.decision.local_failures` on :func:`.decision.schedule_view`). Still one 0/1 value in
  the stock ``can_run_prefill_cuda_graph`` column, so both exchange paths carry it unchanged.
* :func:`build_update_gather` wraps ``dp_attn._update_gather_batch``: after stock copied the
  gathered verdict onto the batch, :func:`.decision.finalize` derives bucket, padding bound and
  idle-participant validity from the gathered token counts, identically on every rank.
* :func:`build_guard` wraps ``PrefillCudaGraphRunner.can_run_graph``: a shared "eager" verdict is
  eager; under a shared "graph" verdict every check (including the two ``_forward_raw`` adds)
  must pass on this rank. A failing check whose inputs are gathered or uniform
  (:func:`.decision.uniform_failures`) fails on every rank alike: eager everywhere, as stock
  (``eager_uniform``); any other failure raises :class:`.decision.PrefillGraphDivergence` (never
  eager alone). A draft runner under a DP table runs eager (draft prefill graphs are refused at
  startup, see feature.speculative_refusal).

The bench builds the same wrappers around the same stock functions with its own
:class:`Runtime`, so the numbers it reports come from the code the server runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from . import decision as D

logger = logging.getLogger("dspark_harden.prefill_graph")


@dataclass
class StepState:
    """Handed from the vote to the post-exchange finalisation of the same scheduler step."""

    runner: Any = None
    worker_mode: Any = None  # the capture mode this rank's worker passes to ForwardBatch.init_new
    idle_relabel: bool = False  # decision.idle_relabels_to_target_verify
    local_ok: bool = True
    local_reason: Optional[str] = None
    local_tokens: int = 0


@dataclass
class Runtime:
    """Per-process configuration and observers of the decision."""

    factor: float = D.DEFAULT_PADDING_FACTOR
    dp_rank: Any = None
    #: ``bs`` list stock pads to; ``None``: read ``cuda_graph_config.prefill.bs`` at call time
    bs: Optional[list] = None
    #: server hidden-state mode; ``None``: read ``get_server_return_hidden_states_mode()`` once
    server_mode: Any = None
    attn_tp_size: Optional[int] = None
    tolerates_sum_len: Optional[Callable[[], bool]] = None
    #: ``on_decision(decision, local_reason, useful_tokens)`` after each finalisation
    on_decision: Optional[Callable] = None
    #: ``on_divergence(exc)`` before a guard raises
    on_divergence: Optional[Callable] = None
    #: ``on_replay(request_slots)`` when the guard lets an admitted step replay (its batch's request count)
    on_replay: Optional[Callable] = None
    #: ``on_uniform(check, pending)`` when every rank runs an admitted step eager (a uniform failure)
    on_uniform: Optional[Callable] = None
    #: the admitted decision of this step, recorded when the guard has run: (decision, local reason, tokens)
    pending: Optional[tuple] = None
    #: ``on_view(view)`` with each schedule-time view the vote evaluated (tests, bench)
    on_view: Optional[Callable] = None
    step: StepState = field(default_factory=StepState)
    last: Optional[D.SharedDecision] = None
    last_local_reason: Optional[str] = None
    #: the guard's last outcome: "graph", "eager" (shared eager), "eager_uniform", "divergence", "draft"
    last_guard: Optional[str] = None
    #: decision.idle_relabels_to_target_verify, from the first vote's model config and algorithm
    idle_relabel: Optional[bool] = None
    #: ``config_check(runner)``: run once on the first vote (config_digest.check in the server)
    config_check: Optional[Callable] = None
    #: DSPARK_HARDEN_PREFILL_GRAPH_TBO=1: graphs were captured with TBO children; admit only steps on
    #: which every rank runs TBO (tbo_graph.tbo_synchronized), and the guard requires the split
    tbo_graphs: bool = False

    def get_bs(self) -> list:
        if self.bs is not None:
            return self.bs
        from sglang.srt.runtime_context import get_exec

        return list(get_exec().graph.cuda_graph_config.prefill.bs or [])

    def get_server_mode(self) -> Any:
        if self.server_mode is None:
            from sglang.srt.model_executor.forward_batch_info import get_server_return_hidden_states_mode

            self.server_mode = get_server_return_hidden_states_mode()
        return self.server_mode

    def get_attn_tp(self) -> int:
        if self.attn_tp_size is None:
            from sglang.srt.runtime_context import get_parallel

            self.attn_tp_size = int(get_parallel().attn_tp_size)
        return self.attn_tp_size

    def sum_len(self) -> bool:
        if self.tolerates_sum_len is not None:
            return bool(self.tolerates_sum_len())
        from sglang.srt.model_executor.forward_batch_info import prefill_graph_tolerates_sum_len

        return bool(prefill_graph_tolerates_sum_len())


RUNTIME = Runtime()  # the server's (configured in dspark_process_bound)


def _is_runner(obj: Any) -> bool:
    from sglang.srt.model_executor.runner import PrefillCudaGraphRunner

    return isinstance(obj, PrefillCudaGraphRunner)


def build_vote(stock: Callable, runtime: Optional[Runtime] = None) -> Callable:
    def _local_prefill_cuda_graph_vote(
        *,
        local_batch,
        num_tokens,
        prefill_graph_runner,
        coordinated_prefill,
        breakable_prefill,
        spec_algorithm,
        model_config,
    ):
        rt = runtime or RUNTIME
        kwargs = dict(
            local_batch=local_batch,
            num_tokens=num_tokens,
            prefill_graph_runner=prefill_graph_runner,
            coordinated_prefill=coordinated_prefill,
            breakable_prefill=breakable_prefill,
            spec_algorithm=spec_algorithm,
            model_config=model_config,
        )
        runner = prefill_graph_runner
        worker_mode = D.worker_capture_mode(spec_algorithm)
        if rt.idle_relabel is None:
            rt.idle_relabel = D.idle_relabels_to_target_verify(model_config, spec_algorithm)
        if rt.config_check is not None:
            check, rt.config_check = rt.config_check, None
            check(runner)  # once, on the first vote (both ranks vote in lockstep): item "ranks configured alike"
        if local_batch is None or local_batch.forward_mode.is_idle() or not _is_runner(runner):
            ok = stock(**kwargs)
            rt.step = StepState(
                runner=runner if _is_runner(runner) else None,
                worker_mode=worker_mode,
                idle_relabel=rt.idle_relabel,
                local_ok=bool(ok),
                local_reason=None if ok else "stock_vote",
                local_tokens=0,
            )
            return ok
        local = int(num_tokens)
        if 0 < local <= runner.max_num_tokens:
            # lift the local padding bound: padding is judged on the shared bucket after the exchange
            kwargs["num_tokens"] = runner._pad_to_bucket(local, runner.capture_num_tokens)
        # stock first: it votes eager for most decode steps (DSpark, logprob, grammar, no decode graph),
        # and the O(batch) schedule-time view matters only where it votes graph
        ok = bool(stock(**kwargs))
        view = None
        if ok or rt.on_view is not None:
            view = D.schedule_view(
                local_batch,
                server_mode=rt.get_server_mode(),
                decode_as_extend=local_batch.forward_mode.is_decode(),
                worker_mode=worker_mode,
            )
            if rt.on_view is not None:
                rt.on_view(view)
        reason = None if ok else _why_stock_said_eager(runner, local_batch, local, rt, worker_mode)
        if ok:
            fails = (
                ["stock_vote"] if view is None else D.local_failures(runner, view, num_tokens=None, schedule_time=True)
            )
            # per-bucket request slots (full backend): min(slots, bucket) for the smallest bucket this rank can get
            if view is not None and runner._is_full_backend and local <= runner.max_num_tokens:
                if view.batch_size > min(runner._capture_req_slots, kwargs["num_tokens"]):
                    fails.append("request_slots")
            if fails:
                ok, reason = False, fails[0]
        rt.step = StepState(
            runner=runner,
            worker_mode=worker_mode,
            idle_relabel=rt.idle_relabel,
            local_ok=ok,
            local_reason=reason,
            local_tokens=local,
        )
        return ok

    _local_prefill_cuda_graph_vote.__doc__ = stock.__doc__
    return _local_prefill_cuda_graph_vote


def _why_stock_said_eager(runner, batch, local_tokens: int, rt: Runtime, worker_mode: Any = None) -> str:
    """Name the check behind a stock "eager" vote (metrics); only runs on that path."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    if batch.forward_mode not in (ForwardMode.EXTEND, ForwardMode.MIXED):
        return "forward_mode"
    if local_tokens > runner.max_num_tokens:
        return "num_tokens"
    vote = runner._backend_vote_prefill_cuda_graph
    try:
        if vote is not None and not vote(batch):
            return "backend_hook"
        view = D.schedule_view(batch, server_mode=rt.get_server_mode(), worker_mode=worker_mode)
        fails = D.local_failures(runner, view, num_tokens=None, schedule_time=True) if view is not None else []
    except Exception:  # noqa: BLE001 - diagnosis only
        return "stock_vote"
    return fails[0] if fails else "stock_vote"


def build_update_gather(stock: Callable, runtime: Optional[Runtime] = None) -> Callable:
    def _update_gather_batch(batch, mlp_sync_info, *args, **kwargs):
        result = stock(batch, mlp_sync_info, *args, **kwargs)
        rt = runtime or RUNTIME
        step, rt.step = rt.step, StepState()
        gathered = getattr(mlp_sync_info, "global_num_tokens", None)
        if step.runner is None or gathered is None or len(gathered) < 2 or rt.sum_len():
            return result
        if not mlp_sync_info.is_extend_in_batch:
            return result  # no prefill this step: nothing to decide
        dec = D.finalize(
            gathered,
            vote=bool(batch.can_run_dp_prefill_cuda_graph),
            runner=step.runner,
            bs=rt.get_bs(),
            factor=rt.factor,
            server_mode=rt.get_server_mode(),
            attn_tp_size=rt.get_attn_tp(),
            worker_mode=step.worker_mode,
            idle_relabel=step.idle_relabel,
        )
        if dec.graph and rt.tbo_graphs:
            from .tbo_graph import tbo_synchronized

            if not tbo_synchronized(getattr(mlp_sync_info, "tp0_info_cpu", None)):
                dec = D.SharedDecision(False, None, "tbo_unsynchronized", dec.max_tokens, "a rank does not run TBO")
        batch.can_run_dp_prefill_cuda_graph = dec.graph
        rt.last = dec
        rt.last_local_reason = step.local_reason
        flush_pending(rt)  # an admitted step whose guard never ran (no prefill forward) counts as admitted
        if dec.graph:
            rt.pending = (dec, step.local_reason, step.local_tokens)  # recorded by the guard
        elif rt.on_decision is not None:
            rt.on_decision(dec, step.local_reason, step.local_tokens)
        return result

    _update_gather_batch.__doc__ = stock.__doc__
    return _update_gather_batch


def flush_pending(rt: Runtime) -> None:
    pending, rt.pending = rt.pending, None
    if pending is not None and rt.on_decision is not None:
        rt.on_decision(*pending)


_UNIFORM_LOGGED: set = set()


def build_guard(stock: Callable, runtime: Optional[Runtime] = None) -> Callable:
    def can_run_graph(self, forward_batch):
        if forward_batch.global_num_tokens_cpu is None:
            return stock(self, forward_batch)  # not DP-synced: a rank-local decision cannot split a group
        rt = runtime or RUNTIME
        mr = getattr(self, "model_runner", None)
        if getattr(mr, "is_draft_worker", False):
            # the decision covers the target runner; a worker that captures draft prefill graphs is refused
            # at startup (feature.speculative_refusal). Should a draft runner still get here under a DP
            # table, it runs eager, on every rank alike (its batch would inherit the target's verdict
            # for a bucket no admission checked)
            rt.last_guard = "draft"
            return False
        if not forward_batch.can_run_dp_prefill_cuda_graph:
            rt.last_guard = "eager"
            return False  # shared eager: eager on every rank
        fails = []
        if rt.tbo_graphs and getattr(forward_batch, "tbo_split_seq_index", None) is None:
            fails.append("tbo_split")
        if self._has_inactive_dp_rank(forward_batch):
            fails.append("inactive_dp_rank")
        fails.extend(
            D.local_failures(self, forward_batch, num_tokens=len(forward_batch.input_ids), schedule_time=False)
        )
        if not fails and not stock(self, forward_batch):
            fails.append("can_run_graph")
        if fails:
            uniform = D.uniform_failures(self, forward_batch, fails)
            if uniform:
                # every rank fails this check identically (gathered / uniform inputs): all run eager, as stock
                rt.last_guard = "eager_uniform"
                pending, rt.pending = rt.pending, None
                if rt.on_uniform is not None:
                    rt.on_uniform(uniform[0], pending)
                if uniform[0] not in _UNIFORM_LOGGED:
                    _UNIFORM_LOGGED.add(uniform[0])
                    logger.warning(
                        "dspark-harden prefill-graph-dp (dp_rank %s): an admitted step runs eager on every rank: "
                        "forward-time check %r failed with inputs that are the same on every rank (%s); logged once "
                        'per check, counted as outcome="eager_uniform"',
                        rt.dp_rank,
                        uniform[0],
                        D.geometry(forward_batch),
                    )
                return False
            rt.last_guard = "divergence"
            rt.pending = None
            exc = D.PrefillGraphDivergence(
                check=fails[0], failed=fails, dp_rank=rt.dp_rank, geometry=D.geometry(forward_batch)
            )
            if rt.on_divergence is not None:
                rt.on_divergence(exc)
            logger.critical("%s", exc)
            raise exc
        rt.last_guard = "graph"
        flush_pending(rt)
        if rt.on_replay is not None:
            rt.on_replay(int(forward_batch.batch_size))
        return True

    can_run_graph.__doc__ = stock.__doc__
    can_run_graph.__qualname__ = getattr(stock, "__qualname__", "PrefillCudaGraphRunner.can_run_graph")
    return can_run_graph
