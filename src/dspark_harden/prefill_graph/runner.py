"""The prefill-graph runner a bench or test world admits against: a real ``PrefillCudaGraphRunner``
object whose admission state is what its ``__init__`` derives from a capture configuration (nothing
is captured: no GPU), plus the small helpers both the world (:mod:`.world`) and the bench
(:mod:`.bench`) build on (stock objects under our patches, functions over private globals)."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Optional

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


def with_globals(func, **names):
    """``func`` over a private copy of its globals with ``names`` replaced (the process-wide
    functions stay untouched)."""
    return types.FunctionType(
        func.__code__, {**func.__globals__, **names}, func.__name__, func.__defaults__, func.__closure__
    )


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
        vote_prefill_cuda_graph = with_globals(
            B.vote_prefill_cuda_graph, get_server_return_hidden_states_mode=lambda: server_mode
        )
        _prefill_graph_fits_late_tail = B._prefill_graph_fits_late_tail
        _prefill_graph_tail_capacity = B._prefill_graph_tail_capacity
        _prefill_graph_seq_limit = with_globals(
            B._prefill_graph_seq_limit, _prefill_graph_max_seq_len=lambda: cfg.max_seq_len
        )
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


def stock(func):
    """The stock object even if this process bound our patch over it."""
    while getattr(func, "__dspark_patch__", None) and getattr(func, "__wrapped__", None) is not None:
        func = func.__wrapped__
    return func
