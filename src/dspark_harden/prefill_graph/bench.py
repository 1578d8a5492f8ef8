"""``dspark-harden bench prefill-admission``: stock's DP2 prefill-graph admission vs ours on a trace.

Both sides run the real stock code: ``dp_attn._local_prefill_cuda_graph_vote``, the real
``MLPSyncBatchInfo`` row packing (column ``can_run_prefill_cuda_graph``, min-reduced like
``all_gather`` does after the exchange), the real ``dp_attn._update_gather_batch``, and the real
``PrefillCudaGraphRunner.can_run_graph`` / ``can_replay_locally`` / ``_has_inactive_dp_rank`` on a
runner object of the real class whose state comes from a capture configuration (stock's default
prefill bucket list for ``--chunked-prefill-size 16384``, the full backend's request slots, the
chunked-prefix variants) and whose attention-backend hooks are the real DeepSeek-V4 backend
methods bound to a small stand-in (no GPU, no model). The harden side wraps the same functions
with the feature's own wrappers (:mod:`.admission`).

Stand-ins (what cannot exist without a GPU): the ``ScheduleBatch`` of each rank
(:class:`.trace.TraceBatch`), the cross-rank exchange (the two rows are stacked in-process), and
the ``ForwardBatch`` after ``ForwardBatch.prepare_mlp_sync_batch`` (:func:`.decision.after_mlp_sync`:
MAX_LEN to the shared bucket, idle rank -> stock's dummy extend). The result is a count, not a
timing: deterministic for a given trace and configuration.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import asdict, dataclass
from typing import Any, Optional

from . import decision as D
from . import trace as T
from .admission import Runtime, build_guard, build_update_gather, build_vote

DEFAULT_CHUNKED_PREFILL = 16384


@dataclass(frozen=True)
class CaptureConfig:
    buckets: tuple
    slots: int  # full backend request slots (stock auto: max(chunked_prefill_size // 512, 1))
    chunked_prefill: int = DEFAULT_CHUNKED_PREFILL
    context_len: int = 131072
    req_pool: int = 256
    max_running_requests: int = 256
    max_seq_len: Optional[int] = None  # cuda_graph_config[prefill].max_seq_len (DSV4 CUDA default: none)
    decoder_swa_bounded_replay: bool = True


def default_buckets(chunked_prefill: int = DEFAULT_CHUNKED_PREFILL) -> list:
    """Stock's default prefill capture list (``generate_prefill_cuda_graph_batch_sizes``)."""
    from sglang.srt.arg_groups.cuda_graph_hook import generate_prefill_cuda_graph_batch_sizes

    return generate_prefill_cuda_graph_batch_sizes(chunked_prefill)


def capture_config(buckets=None, *, chunked_prefill: int = DEFAULT_CHUNKED_PREFILL, **kw) -> CaptureConfig:
    bs = tuple(sorted(set(int(b) for b in (buckets or default_buckets(chunked_prefill)))))
    if not bs or bs[0] <= 0:
        raise ValueError("buckets must be positive token counts")
    slots = kw.pop("slots", None) or max(chunked_prefill // 512, 1)
    return CaptureConfig(buckets=bs, slots=min(slots, kw.get("req_pool", 256)), chunked_prefill=chunked_prefill, **kw)


def _with_globals(func, **names):
    return types.FunctionType(func.__code__, {**func.__globals__, **names}, func.__name__, func.__defaults__, func.__closure__)


def dsv4_hooks(cfg: CaptureConfig, server_mode: Any, spec: str = "none") -> Any:
    """The real ``DeepseekV4AttnBackend.can_run_prefill_cuda_graph`` / ``vote_prefill_cuda_graph``
    (and the tail-capacity helpers they call) bound to a stand-in backend carrying only the state
    they read; the two process-wide reads (server hidden-state mode, configured max_seq_len) are
    bound in a private copy of the functions' globals."""
    from sglang.srt.layers.attention import deepseek_v4_backend as dsv4
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    B = dsv4.DeepseekV4AttnBackend
    algorithm = SpeculativeAlgorithm.NONE if spec == "none" else SpeculativeAlgorithm.from_string(spec.upper())

    class Dsv4BackendStandIn:
        can_run_prefill_cuda_graph = B.can_run_prefill_cuda_graph
        vote_prefill_cuda_graph = _with_globals(B.vote_prefill_cuda_graph, get_server_return_hidden_states_mode=lambda: server_mode)
        _prefill_graph_fits_late_tail = B._prefill_graph_fits_late_tail
        _prefill_graph_tail_capacity = B._prefill_graph_tail_capacity
        _prefill_graph_seq_limit = _with_globals(B._prefill_graph_seq_limit, _prefill_graph_max_seq_len=lambda: cfg.max_seq_len)
        prefill_cuda_graph_default_max_seq_len = None

        def __init__(self) -> None:
            self.enable_decoder_swa_bounded_replay = cfg.decoder_swa_bounded_replay
            self._bcg_tail_capacity = None
            self.model_runner = types.SimpleNamespace(
                spec_algorithm=algorithm,
                server_args=types.SimpleNamespace(max_running_requests=cfg.max_running_requests),
                req_to_token_pool=types.SimpleNamespace(size=cfg.req_pool),
            )

    return Dsv4BackendStandIn()


def runner_capture_hidden_mode(server_mode: Any, *, backend: str, spec: str, is_draft_worker: bool = False) -> Any:
    """``PrefillCudaGraphRunner.__init__``'s captured hidden-state mode: LAST for a breakable EAGLE
    draft, FULL for an EAGLE target or the DFlash family (DFlash, DSpark), else the server's mode."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algorithm = SpeculativeAlgorithm.NONE if spec == "none" else SpeculativeAlgorithm.from_string(spec.upper())
    if backend == "breakable" and algorithm.is_eagle() and is_draft_worker:
        return CaptureHiddenMode.LAST
    if (algorithm.is_eagle() and not is_draft_worker) or algorithm.is_dflash_family():
        return CaptureHiddenMode.FULL
    return server_mode


def build_runner(cfg: CaptureConfig, *, server_mode: Any = None, backend: str = "full", spec: str = "none") -> Any:
    """A real ``PrefillCudaGraphRunner`` whose admission state is what ``__init__`` derives from
    ``cfg``; nothing is captured (no GPU). ``full``: a DeepSeek-V4 target (the real DSV4 backend
    hooks, request slots, chunked-prefix variants). ``breakable``: stock disables breakable prefill
    graphs for DSV4 (``disable_breakable_cudagraph_if_incompatible``), so this is a target whose
    attention backend has no prefill-graph hooks (e.g. DeepSeek-V3 MLA)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.runner import prefill_cuda_graph_runner as pcg

    server_mode = CaptureHiddenMode.NULL if server_mode is None else server_mode
    full = backend == "full"
    r = object.__new__(pcg.PrefillCudaGraphRunner)
    r.prefill_backend_name = Backend.FULL if full else Backend.BREAKABLE
    r.capture_num_tokens = list(cfg.buckets)  # get_prefill_num_tokens_to_capture: alignment 1 at attention-TP1
    r.max_num_tokens = max(cfg.buckets)
    r.max_bs = cfg.req_pool
    r.max_context_size = None
    r.max_seq_len = cfg.max_seq_len
    r._is_full_backend = full
    r._capture_req_slots = cfg.slots if full else 1
    r._captured_attn_metadata_max_bs = None
    r.enable_cp_bcg_capture = False
    r.prefill_cp_bcg_input = None
    r._qwen_bcg_hc_sidechannel = False
    r._qwen_bcg_mtp_draft = False
    r._fa4_prefill = False
    r.enable_lora = False
    r._capture_lora = False
    r.prefer_eager_mixed_prefill = False
    r.has_mha_companion_layers = False
    r.capture_hidden_mode = runner_capture_hidden_mode(server_mode, backend=backend, spec=spec)
    # chunked-prefix variants (__init__ / _resolve_prefix_chunk_shape with chunked_prefill_size)
    r._capture_chunked_prefix = full
    r._prefix_capture_variants = ()
    r._prefix_chunk_len = 0
    if full:
        max_prefix = cfg.context_len  # _max_addressable_prefix_len: min(req_to_token width, context_len)
        r._prefix_chunk_len = max(min(cfg.chunked_prefill, max_prefix * cfg.slots) // cfg.slots, 1)
        max_real_chunks = -(-max_prefix // r._prefix_chunk_len)
        r._prefix_capture_variants = tuple(n for n in pcg._CHUNKED_PREFIX_VARIANTS if n // 2 < max_real_chunks)
        hooks = dsv4_hooks(cfg, server_mode, spec)
        r._backend_can_run_prefill_cuda_graph = hooks.can_run_prefill_cuda_graph
        r._backend_vote_prefill_cuda_graph = hooks.vote_prefill_cuda_graph
    else:
        r._backend_can_run_prefill_cuda_graph = None
        r._backend_vote_prefill_cuda_graph = None
    r.dllm_attention = None
    r.model_runner = types.SimpleNamespace(is_draft_worker=False, lora_manager=None)
    return r


def _stock(func):
    """The stock object even if this process bound our patch over it."""
    while getattr(func, "__dspark_patch__", None) and getattr(func, "__wrapped__", None) is not None:
        func = func.__wrapped__
    return func


class Simulator:
    """Runs DP2 steps through stock's admission and ours (the same stock functions underneath)."""

    def __init__(self, cfg: CaptureConfig, *, factor: float = D.DEFAULT_PADDING_FACTOR):
        from sglang.srt.managers.scheduler_components import dp_attn
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.model_executor.model_runner import _prefill_cuda_graph_allows_context_parallel
        from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.cfg = cfg
        self.dp_attn = dp_attn
        self.server_mode = CaptureHiddenMode.NULL
        self.runner = build_runner(cfg, server_mode=self.server_mode)
        self.spec = SpeculativeAlgorithm.NONE
        self.allows_cp = _prefill_cuda_graph_allows_context_parallel
        self.stock_vote = _stock(dp_attn._local_prefill_cuda_graph_vote)
        self.stock_update = _stock(dp_attn._update_gather_batch)
        self.stock_can_run = _stock(PrefillCudaGraphRunner.__dict__["can_run_graph"])
        self.rts = [self._runtime(factor, rank) for rank in (0, 1)]
        self.h_vote = [build_vote(self.stock_vote, rt) for rt in self.rts]
        self.h_update = [build_update_gather(self.stock_update, rt) for rt in self.rts]
        self.h_guard = [build_guard(self.stock_can_run, rt) for rt in self.rts]

    def _runtime(self, factor: float, rank: int) -> Runtime:
        return Runtime(factor=factor, dp_rank=rank, bs=list(self.cfg.buckets), server_mode=self.server_mode,
                       attn_tp_size=1, tolerates_sum_len=lambda: False)

    # -- one side ----------------------------------------------------------------------------
    def _vote_kwargs(self, batch, tokens):
        return dict(local_batch=batch, num_tokens=tokens, prefill_graph_runner=self.runner, coordinated_prefill=True,
                    breakable_prefill=False, spec_algorithm=self.spec, model_config=None)

    def _infos(self, step, batches, votes):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        infos = []
        for rank, batch, vote in zip(step.ranks, batches, votes):
            infos.append(self.dp_attn.MLPSyncBatchInfo(
                num_dp_ranks=2, tp_size=1, cp_size=1, num_tokens=T.num_tokens(rank),
                num_tokens_for_logprob=T.num_tokens(rank), can_run_decode_cuda_graph=rank.mode in ("idle", "decode"),
                can_run_draft_cuda_graph=True, can_run_prefill_cuda_graph=vote,
                is_extend_in_batch=rank.mode in ("extend", "mixed"), local_can_run_tbo=False,
                local_forward_mode=(batch.forward_mode if batch is not None else ForwardMode.IDLE).value,
                prefill_cuda_graph_max_prefix_len=max((q.prefix for q in rank.reqs), default=0),
            ))
        return infos

    @staticmethod
    def _gather(infos):
        """What ``MLPSyncBatchInfo.all_gather`` derives after the exchange (both rows, stacked)."""
        import torch

        tp0 = torch.stack([i._get_local_tensor(device="cpu") for i in infos])
        out = []
        for info in infos:
            info.tp0_info_cpu = tp0
            info.global_num_tokens = tp0[:, 0].tolist()
            info.global_num_tokens_for_logprob = tp0[:, 1].tolist()
            info.can_run_decode_cuda_graph = bool(tp0[:, 2].min())
            info.is_extend_in_batch = bool(tp0[:, 3].max())
            info.can_run_prefill_cuda_graph = bool(tp0[:, 6].min())
            info.prefill_cuda_graph_max_prefix_len = int(tp0[:, 7].max())
            info.can_run_draft_cuda_graph = bool(tp0[:, 8].min())
            out.append(info)
        return out

    def _side(self, step, *, harden: bool) -> dict:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        batches = [T.schedule_batch(r) for r in step.ranks]
        votes = []
        for i, (rank, batch) in enumerate(zip(step.ranks, batches)):
            vote = self.h_vote[i] if harden else self.stock_vote
            votes.append(bool(vote(**self._vote_kwargs(batch, T.num_tokens(rank)))))
        infos = self._gather(self._infos(step, batches, votes))
        verdicts, gathered = [], []
        for i, (batch, info) in enumerate(zip(batches, infos)):
            target = batch if batch is not None else T.TraceBatch(
                forward_mode=ForwardMode.IDLE, reqs=[], extend_lens=[], prefix_lens=[], extend_logprob_start_lens=[],
                return_logprob=False, seq_lens_cpu=None,
            )
            update = self.h_update[i] if harden else self.stock_update
            update(target, info, True, None, skip_global_metadata=False)
            verdicts.append(bool(target.can_run_dp_prefill_cuda_graph))
            gathered.append(info.global_num_tokens)
        assert verdicts[0] == verdicts[1], "the gathered verdict differs between ranks"
        decisions, raised, executed, useful = [], [], 0, 0
        is_extend = infos[0].is_extend_in_batch
        for i, (rank, batch) in enumerate(zip(step.ranks, batches)):
            view = None
            if batch is not None and batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
                view = D.schedule_view(batch, server_mode=self.server_mode)
            fb = D.after_mlp_sync(view, num_tokens=T.num_tokens(rank), global_num_tokens=gathered[i],
                                  verdict=verdicts[i], is_extend_in_batch=is_extend, bs=self.cfg.buckets,
                                  server_mode=self.server_mode)
            graph = False
            if fb is not None and fb.forward_mode.is_extend():
                if harden:
                    try:
                        graph = self.h_guard[i](self.runner, fb)
                    except D.PrefillGraphDivergence as exc:
                        raised.append(exc.check)
                        graph = False
                else:
                    graph = bool(self.stock_can_run(self.runner, fb)) and fb.token_indices_to_pool is None \
                        and self.allows_cp(self.runner, fb)
            decisions.append(bool(graph))
            if graph:
                executed += len(fb.input_ids)
                useful += rank.extend_tokens
        return {"decisions": decisions, "verdict": verdicts[0], "raised": raised, "executed": executed, "useful": useful,
                "bucket": max(gathered[0]) if decisions[0] or decisions[1] else None}

    def run(self, steps) -> dict:
        report = {"batches": 0}
        for side in ("stock", "harden"):
            tot = cov = splits = executed = useful = raised = 0
            for step in steps:
                r = self._side(step, harden=side == "harden")
                tokens = [rank.extend_tokens for rank in step.ranks]
                tot += sum(tokens)
                cov += sum(t for t, d in zip(tokens, r["decisions"]) if d)
                splits += r["decisions"][0] != r["decisions"][1]
                executed += r["executed"]
                useful += r["useful"]
                raised += len(r["raised"])
            report[side] = {
                "graph_token_coverage": round(cov / tot, 6) if tot else 0.0,
                "splits": int(splits),
                "padding_overhead": round((executed - useful) / useful, 6) if useful else 0.0,
            }
            if side == "harden":
                report[side]["guard_raised"] = int(raised)
        report["batches"] = sum(1 for s in steps if any(r.mode in ("extend", "mixed") for r in s.ranks))
        return report


def main(args) -> int:
    try:
        steps = T.read_jsonl(args.trace) if args.trace else T.generate(T.TraceShape())
        cfg = capture_config(args.buckets)
    except (T.TraceError, ValueError, OSError) as exc:
        print(f"bench prefill-admission: {exc}", file=sys.stderr)
        return 2
    sim = Simulator(cfg, factor=args.factor)
    full = sim.run(steps)
    raised = full["harden"].pop("guard_raised")
    if args.json:
        print(json.dumps(full))
    else:
        source = args.trace or f"built-in generator {asdict(T.TraceShape())}"
        print(f"prefill-admission: {full['batches']} DP2 steps with prefill; trace: {source}")
        print(f"  capture: full backend, {len(cfg.buckets)} buckets {cfg.buckets[0]}..{cfg.buckets[-1]}"
              f"{'' if args.buckets else ' (stock default for --chunked-prefill-size 16384)'}, {cfg.slots} request slots; "
              f"padding factor {args.factor:g} (stock {D.STOCK_PADDING_FACTOR})")
        for side in ("stock", "harden"):
            r = full[side]
            print(f"  {side:6s}: graph-token coverage {r['graph_token_coverage']:.4f}  splits {r['splits']}  "
                  f"padding overhead {r['padding_overhead']:.4f}")
    if raised:
        print(f"bench prefill-admission: the harden guard raised {raised} time(s): a forward-time check was not "
              f"folded into the vote (a bug; report it with the trace)", file=sys.stderr)
        return 1
    return 0
