"""``dspark-harden bench prefill-admission``: stock's DP2 prefill-graph admission vs ours on a trace.

Each rank's forward-time batch is a REAL ``ForwardBatch``: the trace step becomes, per rank, a real
``ScheduleBatch`` of real ``Req``s over real pools and a real ``RadixCache`` (stock
``prepare_for_extend`` / ``prepare_for_decode`` / ``mix_with_running`` / ``prepare_for_idle``), both
ranks run stock ``dp_attn.prepare_mlp_sync_batch_raw`` (the vote, the ``MLPSyncBatchInfo`` row,
stock ``all_gather``, ``_update_gather_batch``), stock ``maybe_convert_decode_to_extend``, stock
``ForwardBatch.init_new`` with the capture mode the rank's worker passes, stock
``ModelRunner._prepare_eager_forward_batch`` -> ``ForwardBatch.prepare_mlp_sync_batch``, and
whether the rank replays is stock ``ModelRunner._forward_raw``'s prefill-graph condition compiled
from its source, evaluated on that batch. The stock side runs exactly that (stock's own code path:
its splits are counted there); the harden side runs the same with the feature's three wrappers
(:mod:`.admission`) in place of the stock vote, finalisation and ``can_run_graph``.

Stand-ins (what needs a GPU, a model or a running engine; see :mod:`.world`): the model runner's
attributes, the transport between the two ranks (in-process, both ranks in this process), a decode
row's next token, and the prefill-graph runner's capture state (an object of the real
``PrefillCudaGraphRunner`` class whose state is what ``__init__`` derives from the capture
configuration; with the full backend, the real DeepSeek-V4 backend hooks bound to a stand-in
backend). The result is a count, not a timing: deterministic for a given trace and configuration.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import asdict, dataclass
from typing import Any, Optional

from . import decision as D
from . import trace as T

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


EAGER_VOTE = "dp_verdict"  # stock side: the shared min-reduced vote said eager


def _eager_reason(r, results, side: str, runner) -> str:
    """Why rank result ``r`` ran eager (``eager_tokens_by_reason``)."""
    if r.raised is not None:
        return f"divergence:{r.raised.check}"
    if side == "harden":
        if r.guard_outcome == "eager_uniform":
            return "eager_uniform"
        dec = r.decision
        if dec is not None and not dec.graph:
            own = r.local_reason
            peers = [p.local_reason for p in results if p is not r and p.local_reason]
            if dec.reason == "peer_vote":
                return own or (peers[0] if peers else "peer_vote")
            return dec.reason
        if dec is None:
            return r.local_reason or "stock_vote"
        return "forward_raw"  # admitted and the guard passed, yet _forward_raw ran eager (would be a split)
    if not r.verdict:
        return EAGER_VOTE
    if r.fb is None or not r.fb.forward_mode.is_extend():
        return "no_extend_forward"
    fails = D.local_failures(runner, r.fb, num_tokens=len(r.fb.input_ids), schedule_time=False)
    if runner._has_inactive_dp_rank(r.fb):
        fails = ["inactive_dp_rank"] + fails
    return fails[0] if fails else "can_run_graph"


def run(world, steps, *, progress=None) -> dict:
    """Replay ``steps`` through ``world`` (a :class:`.world.World`) on both sides."""
    report: dict = {"batches": sum(1 for s in steps if any(r.mode in ("extend", "mixed") for r in s.ranks))}
    raised_total = 0
    for side in ("stock", "harden"):
        tot = cov = splits = executed = useful = 0
        eager: dict = {}
        for i, step in enumerate(steps):
            results = world.step(step, side)
            tokens = [rs.extend_tokens for rs in step.ranks]
            tot += sum(tokens)
            for r, t in zip(results, tokens):
                if r.replays:
                    cov += t
                    useful += t
                    executed += len(r.fb.input_ids)
                elif t:
                    why = _eager_reason(r, results, side, world.runners[side, r.rank])
                    eager[why] = eager.get(why, 0) + t
                raised_total += side == "harden" and r.raised is not None
            splits += results[0].replays != results[1].replays
            if progress is not None:
                progress(side, i)
        report[side] = {
            "graph_token_coverage": round(cov / tot, 6) if tot else 0.0,
            "splits": int(splits),
            "padding_overhead": round((executed - useful) / useful, 6) if useful else 0.0,
            "eager_tokens_by_reason": dict(sorted(eager.items(), key=lambda kv: (-kv[1], kv[0]))),
        }
    report["harden"]["guard_raised"] = int(raised_total)
    return report


def main(args) -> int:
    from . import world as W

    try:
        steps = T.read_jsonl(args.trace) if args.trace else T.generate(
            T.TraceShape(**({"steps": args.steps} if args.steps else {})))
        cfg = capture_config(args.buckets)
    except (T.TraceError, ValueError, OSError) as exc:
        print(f"bench prefill-admission: {exc}", file=sys.stderr)
        return 2
    world = W.World(cfg, backend=args.backend, spec=args.spec, factor=args.factor)
    try:
        full = run(world, steps)
    finally:
        world.close()
    raised = full["harden"].pop("guard_raised")
    if args.json:
        print(json.dumps(full))
    else:
        source = args.trace or f"built-in generator {asdict(T.TraceShape(**({'steps': args.steps} if args.steps else {})))}"
        print(f"prefill-admission: {full['batches']} DP2 steps with prefill; trace: {source}")
        print(f"  capture: {args.backend} backend, {len(cfg.buckets)} buckets {cfg.buckets[0]}..{cfg.buckets[-1]}"
              f"{'' if args.buckets else ' (stock default for a 16384-token per-rank chunk)'}, "
              f"{cfg.slots if args.backend == 'full' else 'no fixed'} request slots; speculative: {args.spec}; "
              f"padding factor {args.factor:g} (stock {D.STOCK_PADDING_FACTOR})")
        for side in ("stock", "harden"):
            r = full[side]
            print(f"  {side:6s}: graph-token coverage {r['graph_token_coverage']:.4f}  splits {r['splits']}  "
                  f"padding overhead {r['padding_overhead']:.4f}")
            total = sum(r["eager_tokens_by_reason"].values())
            for why, n in r["eager_tokens_by_reason"].items():
                print(f"          eager {why:28s} {n:>10d} tokens ({n / total:.1%} of eager)")
    if raised:
        print(f"bench prefill-admission: the harden guard raised {raised} time(s): a forward-time check was not "
              f"folded into the vote (a bug; report it with the trace)", file=sys.stderr)
        return 1
    return 0
