"""Real SGLang objects on CPU for the DP2 prefill-graph decision (tests and bench).

Each DP rank gets what a scheduler process holds: a real ``ReqToTokenPool``, a real
``MHATokenToKVPool`` + ``TokenToKVPoolAllocator``, a real ``RadixCache`` (one long sequence
inserted once, so a request's cached prefix is a real prefix match), real ``Req`` objects and real
``ScheduleBatch``es built by stock ``prepare_for_extend`` / ``prepare_for_decode`` /
``mix_with_running`` / ``prepare_for_idle``. One step then runs, per rank, stock
``dp_attn.prepare_mlp_sync_batch_raw`` (vote, ``MLPSyncBatchInfo`` row, stock ``all_gather``,
``_update_gather_batch``), stock ``SchedulerDPAttnAdapter.maybe_convert_decode_to_extend``, stock
``ForwardBatch.init_new`` with the capture mode the rank's worker passes, stock
``ModelRunner._prepare_eager_forward_batch`` (-> stock ``ForwardBatch.prepare_mlp_sync_batch``:
MAX_LEN padding, the idle rank's dummy extend, the decode relabel) and finally the prefill-graph
condition of stock ``ModelRunner._forward_raw`` compiled from its live source.

Stand-ins, each because the real object needs a GPU, a model or a running engine:

* ``_ModelRunnerStandIn``: the attributes of a ``ModelRunner`` that ``init_new``,
  ``prepare_mlp_sync_batch`` and ``_forward_raw``'s condition read (device ``cpu``, the model
  config, ``is_draft_worker``, ``spec_algorithm``, no LoRA / ngram / mrope, the prefill-graph
  runner, and an attention backend exposing only its pad fill value 1 and
  ``late_layer_num_tokens`` = None); the real ``ModelRunner._prepare_eager_forward_batch`` is
  called on it unbound.
* the cross-rank exchange: both ranks run in this process (rank 1 on a helper thread) and stock
  ``MLPSyncBatchInfo.all_gather`` runs on each with ``exchange_sync_rows`` bound, in a private copy
  of its globals, to an in-process two-party rendezvous that fills the gathered table like gloo
  ``all_gather_single``; ``get_parallel().tp_group`` is an object with ``active_ranks_cpu`` only.
* decode rows' next input token (stock reads it from the overlap ``FutureMap``): a fixed token.
* the prefill-graph runner is the bench's real-class runner (:func:`.runner.build_runner`) whose
  DeepSeek-V4 hooks are the real backend methods bound to a stand-in backend.

Runtime configuration is a real ``ServerArgs`` resolved by stock for ``--dp-size 2 --tp-size 2
--enable-dp-attention`` on a config-only DeepSeek-V3 checkpoint written to a temp dir (no weights),
published with stock ``publish``; the capture configuration (buckets, request slots, backend,
chunk size, speculative algorithm) is then written into the resolved config with stock
``RuntimeContext.override`` (CPU resolution disables prefill graphs).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import types
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from . import runner as R
from . import trace as T
from .runner import with_globals

BASE_LEN = 40000  # the one cached sequence: longest prefix a request can hit
KV_TOKENS = 1 << 17  # per rank
REQ_SLOTS = 160
TABLE_WIDTH = 1 << 16  # req_to_token width: longest sequence in a trace step


@dataclass(frozen=True)
class Sizes:
    """A rank's pools: the cached sequence (longest prefix hit), KV slots, request slots and the
    req_to_token width. The defaults hold the built-in generator's traces; :meth:`for_trace` grows them
    to an operator's trace (prefixes up to a model's context, wide decode batches)."""

    base_len: int = BASE_LEN
    kv_tokens: int = KV_TOKENS
    req_slots: int = REQ_SLOTS
    table_width: int = TABLE_WIDTH

    @classmethod
    def for_trace(cls, steps) -> "Sizes":
        prefix = reqs = longest = step_tokens = 0
        for step in steps:
            for rs in step.ranks:
                prefix = max([prefix, *(r.prefix for r in rs.reqs), *rs.seq])  # a decode row: its context
                reqs = max(reqs, len(rs.reqs) + len(rs.seq))
                longest = max([longest, *(r.prefix + r.extend for r in rs.reqs), *rs.seq])
                step_tokens = max(step_tokens, sum(r.extend for r in rs.reqs) + sum(rs.seq))
        base = max(BASE_LEN, prefix + 1)
        return cls(
            base_len=base,
            # the cached sequence, one step's new tokens and decode contexts, and a margin for DP padding
            kv_tokens=max(KV_TOKENS, base + step_tokens + (1 << 16)),
            req_slots=max(REQ_SLOTS, reqs + 8),
            table_width=max(TABLE_WIDTH, longest + 2),
        )


DECODE_TOKEN = 7
_DEFAULT_DECODE_SEQ = 512  # a mixed rank without "seq" mixes in one running request of this length


def _config_dir() -> str:
    """A config-only DeepSeek-V3 checkpoint (ModelConfig reads config.json; nothing loads weights)."""
    path = os.path.join(tempfile.gettempdir(), f"dspark-harden-prefill-world-{os.getuid()}-v2")
    cfg_path = os.path.join(path, "config.json")
    if os.path.exists(cfg_path):
        return path
    os.makedirs(path, exist_ok=True)
    yarn = {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 4.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 1 << 15,
        "rope_type": "yarn",
        "type": "yarn",
    }
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 2048,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "kv_lora_rank": 32,
        "q_lora_rank": 64,
        "qk_head_dim": 48,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "max_position_embeddings": 1 << 17,
        "rms_norm_eps": 1e-6,
        "rope_scaling": yarn,
        "rope_parameters": {**yarn, "rope_theta": 10000.0},
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "num_nextn_predict_layers": 0,
        "attention_bias": False,
    }
    tmp = cfg_path + f".{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(cfg, fh)
    os.replace(tmp, cfg_path)
    return path


_PUBLISHED: dict = {}


SERVER_HIDDEN = ("null", "last", "full")  # --return-hidden-states-mode (server-wide capture ceiling)


def publish_runtime(cfg, *, backend: str, spec: str, server_hidden: str = "null") -> Any:
    """Publish a real resolved DP2 ServerArgs in this process and write the capture configuration
    into it; returns the ModelConfig. Idempotent for the same arguments."""
    if server_hidden not in SERVER_HIDDEN:
        raise ValueError(f"server_hidden must be one of {SERVER_HIDDEN}, got {server_hidden!r}")
    key = (cfg, backend, spec, server_hidden)
    if _PUBLISHED.get("key") == key:
        return _PUBLISHED["model_config"]
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig
    from sglang.srt.runtime_context import get_context, publish
    from sglang.srt.server_args import ServerArgs

    if "server_args" not in _PUBLISHED:
        sa = ServerArgs(
            model_path=_config_dir(),
            device="cpu",
            dp_size=2,
            tp_size=2,
            enable_dp_attention=True,
            skip_tokenizer_init=True,
            page_size=1,
            load_format="dummy",
            cuda_graph_config={"prefill": {"backend": "full"}},
        )
        import logging

        quiet = logging.getLogger("sglang")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            publish(sa, role="scheduler")
        finally:
            quiet.setLevel(level)
        _PUBLISHED["server_args"] = sa
        _PUBLISHED["model_config"] = ModelConfig.from_server_args(sa)
    graph = CudaGraphConfig(
        prefill=PhaseConfig(
            backend=backend,
            bs=list(cfg.buckets),
            max_bs=max(cfg.buckets),
            full_prefill_max_req=cfg.slots if backend == "full" else None,
            max_seq_len=cfg.max_seq_len,
        )
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    get_context().override(
        "dspark-harden prefill world",
        cuda_graph_config=graph,
        chunked_prefill_size=cfg.chunked_prefill,
        max_running_requests=cfg.max_running_requests,
        return_hidden_states_mode=None if server_hidden == "null" else server_hidden,
        speculative_algorithm=None if spec == "none" else SpeculativeAlgorithm.from_string(spec.upper()).name,
    )
    _PUBLISHED["key"] = key
    return _PUBLISHED["model_config"]


class _TpGroupStandIn:
    """``get_parallel().tp_group``: stock ``all_gather`` reads only ``active_ranks_cpu`` (both live);
    ``_decode_sum_len_fits_custom_all_reduce`` (an all-decode step) reads ``ca_comm``: none here, as on a
    server without the custom all-reduce, so stock keeps its cost-based padding choice."""

    def __init__(self) -> None:
        import torch

        self.active_ranks_cpu = torch.ones(2, dtype=torch.int32)
        self.active_ranks = self.active_ranks_cpu
        self.cpu_group = None
        self.device_group = None
        self.device = "cpu"
        self.ca_comm = None


class _AttnBackendStandIn:
    """The two attention-backend reads of ``prepare_mlp_sync_batch`` and ``_pad_inputs_to_size``
    (DSV4's fill value is 1; ``late_layer_num_tokens`` None: no decoder-SWA late-layer exchange)."""

    folds_encoder_swa_replay = False

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def get_cpu_graph_seq_len_fill_value(self):
        return 1

    def late_layer_num_tokens(self, forward_batch):
        return None


class _KvTranslatorStandIn:
    """``model_runner.kv_index_translator``: identity (no DCP / NPU slot translation)."""

    class _Plan:
        def bind(self, forward_batch, translator, cols=None):
            return None

    def own_plan(self, forward_batch):
        return self._Plan()


class ModelRunnerStandIn:
    """What ``ForwardBatch.init_new`` / ``prepare_mlp_sync_batch`` / ``_forward_raw``'s prefill
    condition read from a ``ModelRunner`` (see the module docstring)."""

    def __init__(self, *, model_config, spec_algorithm, is_draft_worker: bool, prefill_runner) -> None:
        self.device = "cpu"
        self.gpu_id = 0
        self.model_config = model_config
        self.spec_algorithm = spec_algorithm
        self.is_draft_worker = is_draft_worker
        self.prefill_cuda_graph_runner = prefill_runner
        self.attn_backend = _AttnBackendStandIn()
        self.kv_index_translator = _KvTranslatorStandIn()
        self.ngram_embedding_manager = types.SimpleNamespace(enabled=False)
        self.lora_manager = None
        self.hisparse_coordinator = None
        self.prefill_attention_backend_str = "torch_native"
        self.watermark_state = None

    def attn_tp_sequence_sharded(self, num_tokens) -> bool:
        return False


@dataclass
class RankEngine:
    """One DP rank's scheduler-side state: real pools, allocator, tree cache, base sequence."""

    rank: int
    model_config: Any
    sizes: Sizes = Sizes()
    req_to_token_pool: Any = None
    allocator: Any = None
    tree: Any = None
    base: Any = None  # array('q') of the cached sequence
    live: list = field(default_factory=list)  # reqs to release after the step
    locs: list = field(default_factory=list)  # KV slots to free after the step
    serial: int = 0

    def __post_init__(self) -> None:
        import random

        import torch
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self.req_to_token_pool = ReqToTokenPool(
            size=self.sizes.req_slots,
            max_context_len=self.sizes.table_width,
            device="cpu",
            enable_memory_saver=False,
        )
        kv = MHATokenToKVPool(
            size=self.sizes.kv_tokens,
            page_size=1,
            dtype=torch.float32,
            head_num=1,
            head_dim=1,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        self.allocator = TokenToKVPoolAllocator(self.sizes.kv_tokens, torch.float32, "cpu", kv, need_sort=False)
        self.tree = RadixCache(
            CacheInitParams(
                disable=False,
                page_size=1,
                token_to_kv_pool_allocator=self.allocator,
                req_to_token_pool=self.req_to_token_pool,
            )
        )
        rng = random.Random(1000 + self.rank)
        vocab = self.model_config.vocab_size
        self.base = array("q", (rng.randrange(16, vocab) for _ in range(self.sizes.base_len)))
        slots = self.allocator.alloc(self.sizes.base_len)
        self.tree.insert(InsertParams(key=RadixKey(self.base), value=slots))

    # -- requests ------------------------------------------------------------------------------
    def _ids(self, prefix: int, length: int) -> array:
        """``prefix`` tokens of the cached sequence, then tokens that never match it."""
        head = self.base[:prefix]
        diverge = (self.base[prefix] + 1) % self.model_config.vocab_size if prefix < len(self.base) else 5
        return head + array("q", [max(diverge, 8)]) + array("q", [9]) * max(length - prefix - 1, 0)

    def new_req(
        self,
        *,
        prefix: int,
        extend: int,
        logprob: bool = False,
        hidden: bool = False,
        pool: bool = False,
        embeds: bool = False,
        mm: bool = False,
        replace: bool = False,
        max_new_tokens: int = 16,
    ):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.serial += 1
        length = prefix + extend
        params = SamplingParams(max_new_tokens=0 if pool else max_new_tokens, temperature=0.0)
        params.normalize(None)
        params.verify(self.model_config.vocab_size)
        overrides = None
        if replace:
            import torch
            from sglang.srt.managers.embed_types import PositionalEmbeds

            overrides = PositionalEmbeds(embeds=torch.zeros(1, 1), positions=[length - 1])
        req = Req(
            rid=f"r{self.rank}-{self.serial}",
            origin_input_text="",
            origin_input_ids=self._ids(prefix, length),
            sampling_params=params,
            return_logprob=logprob,
            return_hidden_states=hidden,
            input_embeds=[[0.0]] * length if embeds else None,
            positional_embed_overrides=overrides,
            token_indices_to_pool=[extend - 1] if pool else None,
            vocab_size=self.model_config.vocab_size,
        )
        if mm:
            import torch
            from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalInputs

            req.multimodal_inputs = MultimodalInputs(
                mm_items=[MultimodalDataItem(modality=Modality.IMAGE, feature=torch.zeros(1), offsets=[(0, 0)])]
            )
        # Scheduler.handle_generate_request: -1 (last token only) without logprobs, past the prompt for a
        # prefill-only request; a logprob request here asks for input logprobs of its new tokens
        req.logprob_start_len = prefix if logprob else (length if req.is_prefill_only else -1)
        req.init_next_round_input(self.tree)
        if req.prefix_len != prefix:
            raise RuntimeError(f"world: expected a prefix hit of {prefix} tokens, the tree matched {req.prefix_len}")
        req.extend_end = length
        self.live.append(req)
        return req

    # -- batches -------------------------------------------------------------------------------
    def _init_batch(self, reqs, spec_algorithm):
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        return ScheduleBatch.init_new(
            reqs, self.req_to_token_pool, self.allocator, self.tree, self.model_config, False, spec_algorithm
        )

    def extend_batch(self, reqs, spec_algorithm):
        """Stock ``prepare_for_extend``; input ids resolved as ``resolve_forward_inputs`` does."""
        batch = self._init_batch(reqs, spec_algorithm)
        batch.prepare_for_extend()
        self.locs.append(batch.out_cache_loc)
        return batch

    def decode_batch(self, seqs, spec_algorithm):
        """Running requests of these sequence lengths after stock ``prepare_for_decode`` (each was
        prefilled by a stock extend of its last prompt token over a cached prefix)."""
        import torch

        reqs = [self.new_req(prefix=max(int(s), 2) - 2, extend=1) for s in seqs]
        prefill = self.extend_batch(reqs, spec_algorithm)
        for req in reqs:  # what the prefill result processing leaves on a running request
            req.output_ids.append(DECODE_TOKEN)
            req.prefix_len = req.extend_end
        prefill.input_ids = torch.full((len(reqs),), DECODE_TOKEN, dtype=torch.int64)
        prefill.prefill_input_ids_cpu = None
        if not spec_algorithm.is_none():
            # a speculative decode step is the worker's draft + verify (spec_prepare_for_decode needs the
            # draft input): it never reaches the prefill graph and its stock vote is eager; only the mode
            # and the row count matter to the step
            from sglang.srt.model_executor.forward_batch_info import ForwardMode

            prefill.forward_mode = ForwardMode.DECODE
            return prefill
        prefill.prepare_for_decode()
        self.locs.append(prefill.out_cache_loc)
        return prefill

    def release(self) -> None:
        """Free the step's request slots; reset the allocator to its post-setup state with stock
        ``clear`` + ``alloc`` (it hands the cached sequence its same slots 1..base_len again, so the
        tree stays valid; freeing each step's slots one by one is a concatenation of the whole free
        list per call)."""
        for req in self.live:
            if req.kv.holds_kv:
                self.req_to_token_pool.free(req)
        self.live.clear()
        self.locs.clear()
        self.allocator.clear()
        self.allocator.alloc(self.sizes.base_len)


# -- the cross-rank exchange --------------------------------------------------------------------


class _Rendezvous:
    """Two-party in-process stand-in for gloo ``all_gather_single`` over the TP CPU group."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=120)
        self.rows: list = [None, None]

    def exchange_for(self, rank: int):
        def exchange_sync_rows(global_flat, local_row, group=None) -> None:
            self.rows[rank] = local_row.clone()
            self.barrier.wait()
            width = local_row.numel()
            for r in (0, 1):
                global_flat[r * width : (r + 1) * width] = self.rows[r]
            self.barrier.wait()

        return exchange_sync_rows


_FORWARD_RAW_CONDITION: dict = {}


def forward_raw_prefill_condition():
    """The condition under which stock ``ModelRunner._forward_raw`` replays the prefill graph (the
    ``elif`` whose body calls ``prefill_cuda_graph_runner.execute``), compiled from its live source."""
    if "code" in _FORWARD_RAW_CONDITION:
        return _FORWARD_RAW_CONDITION["code"]
    import ast
    import inspect
    import textwrap

    from sglang.srt.model_executor.model_runner import ModelRunner

    tree = ast.parse(textwrap.dedent(inspect.getsource(ModelRunner._forward_raw)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and any(
            isinstance(sub, ast.Attribute)
            and sub.attr == "execute"
            and "prefill_cuda_graph_runner" in ast.unparse(sub.value)
            for st in node.body
            for sub in ast.walk(st)
        ):
            found.append(node.test)
    if len(found) != 1:
        raise RuntimeError("ModelRunner._forward_raw no longer has one prefill-graph branch")
    _FORWARD_RAW_CONDITION["code"] = compile(ast.Expression(found[0]), "<stock ModelRunner._forward_raw>", "eval")
    return _FORWARD_RAW_CONDITION["code"]


_CPU_PREPARE: dict = {}


def _prepare_mlp_sync_batch_on_cpu():
    """Stock ``ForwardBatch.prepare_mlp_sync_batch`` with its module's ``_is_cpu`` read as True in
    a private copy of its globals (it pins the gathered token table otherwise: no CUDA driver);
    bound per ForwardBatch, nothing in SGLang is patched."""
    if "f" not in _CPU_PREPARE:
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        _CPU_PREPARE["f"] = with_globals(ForwardBatch.prepare_mlp_sync_batch, _is_cpu=True)
    return _CPU_PREPARE["f"]


def stock_replays(model_runner, forward_batch) -> bool:
    """Evaluate stock ``_forward_raw``'s prefill-graph condition for this rank."""
    from sglang.srt.model_executor import model_runner as mr_mod

    return bool(
        eval(
            forward_raw_prefill_condition(),
            mr_mod.__dict__,  # noqa: S307 - stock's own expression
            {"self": model_runner, "forward_batch": forward_batch},
        )
    )


# -- one DP2 step through the real pipeline -----------------------------------------------------


@dataclass
class RankResult:
    """What one rank did in one step (``fb`` is the real ForwardBatch after
    ``prepare_mlp_sync_batch``; ``fb_pre`` the fields right after ``init_new``)."""

    rank: int
    mode: str
    batch: Any = None  # the ScheduleBatch that reached the forward (None: no forward)
    view: Any = None  # decision.schedule_view as the vote computed it (harden side)
    fb: Any = None
    fb_pre: Optional[dict] = None
    replays: bool = False  # this rank ran the prefill graph
    raised: Optional[Any] = None  # PrefillGraphDivergence
    verdict: bool = False
    useful: int = 0
    decision: Any = None  # decision.SharedDecision (harden side)
    local_reason: Optional[str] = None
    guard_outcome: Optional[str] = None
    probe_fails: Optional[list] = None  # probe side: the forward-time checks the real padded batch fails


def snapshot(fb) -> dict:
    """The fields the guard and ``local_failures`` read, copied (prepare_mlp_sync_batch mutates)."""
    seq = fb.seq_lens_cpu
    return {
        "forward_mode": fb.forward_mode,
        "_original_forward_mode": getattr(fb, "_original_forward_mode", None),
        "global_forward_mode": fb.global_forward_mode,
        "batch_size": fb.batch_size,
        "extend_seq_lens_cpu": None if fb.extend_seq_lens_cpu is None else [int(x) for x in fb.extend_seq_lens_cpu],
        "extend_prefix_lens_cpu": None
        if fb.extend_prefix_lens_cpu is None
        else [int(x) for x in fb.extend_prefix_lens_cpu],
        "extend_logprob_start_lens_cpu": None
        if fb.extend_logprob_start_lens_cpu is None
        else [int(x) for x in fb.extend_logprob_start_lens_cpu],
        "seq_lens_cpu": None if seq is None else [int(x) for x in seq.tolist()],
        "capture_hidden_mode": fb.capture_hidden_mode,
        "return_logprob": bool(fb.return_logprob),
        "input_embeds": fb.input_embeds is not None,
        "replace_embeds": fb.replace_embeds is not None,
        "mm_inputs": bool(fb.contains_mm_inputs()),
        "token_indices_to_pool": None
        if fb.token_indices_to_pool is None
        else [[int(i) for i in t.tolist()] for t in fb.token_indices_to_pool],
        "spec_info": fb.spec_info,
        "num_tokens": None if fb.input_ids is None else int(len(fb.input_ids)),
        "global_num_tokens_cpu": None
        if fb.global_num_tokens_cpu is None
        else [int(x) for x in fb.global_num_tokens_cpu],
        "can_run_dp_prefill_cuda_graph": bool(fb.can_run_dp_prefill_cuda_graph),
        "dp_prefill_cuda_graph_max_prefix_len": int(fb.dp_prefill_cuda_graph_max_prefix_len or 0),
        "extend_num_tokens": None if fb.extend_num_tokens is None else int(fb.extend_num_tokens),
    }


class _FutureMapStandIn:
    """``resolve_forward_inputs`` reads a decode row's last sampled token from the overlap FutureMap."""

    def __init__(self, spec_algorithm, req_slots: int = REQ_SLOTS) -> None:
        import torch

        self.output_tokens_buf = torch.full((req_slots + 2,), DECODE_TOKEN, dtype=torch.int64)
        self.spec_algo = spec_algorithm


def build_batch(eng: RankEngine, rs: T.RankStep, spec_algorithm):
    """One rank's trace step as the real ScheduleBatch the scheduler hands to the MLP sync
    (``None``: an idle rank, which gets stock's idle batch there)."""
    if rs.mode == "idle":
        return None
    if rs.mode == "decode":
        return eng.decode_batch(rs.seq, spec_algorithm)
    reqs = [
        eng.new_req(
            prefix=q.prefix,
            extend=q.extend,
            logprob=q.logprob,
            hidden=q.hidden,
            pool=q.pool,
            embeds=q.embeds,
            mm=q.mm,
            replace=q.replace,
        )
        for q in rs.reqs
    ]
    batch = eng.extend_batch(reqs, spec_algorithm)
    if rs.mode == "mixed" and spec_algorithm.is_none():  # speculative_hook disables mixed chunks
        running = eng.decode_batch(rs.seq or (_DEFAULT_DECODE_SEQ,), spec_algorithm)
        batch.mix_with_running(running)
    return batch


SIDES = ("stock", "harden")
#: "probe": the harden vote records its view, then the verdict is forced to "graph" wherever stock can
#: pad to a shared bucket, and the runner records every forward-time check of the real, padded
#: ForwardBatch instead of deciding: the view's prediction is compared on every step, whatever the
#: real verdict would have been (:func:`view_differences`)
ALL_SIDES = SIDES + ("probe",)


class World:
    """Both DP ranks of one deployment (real objects; see the module docstring)."""

    def __init__(
        self,
        cfg,
        *,
        backend: str = "full",
        spec: str = "none",
        server_hidden: str = "null",
        factor: Optional[float] = None,
        runtime_hook=None,
        coordination_applied: bool = False,
        sizes: Optional[Sizes] = None,
    ) -> None:
        from sglang.srt.managers.scheduler_components import dp_attn
        from sglang.srt.model_executor.forward_batch_info import get_server_return_hidden_states_mode
        from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from . import admission as A
        from . import decision as D

        if backend not in ("full", "breakable"):
            raise ValueError(f"backend must be full or breakable, got {backend!r}")
        self.cfg, self.backend, self.spec = cfg, backend, spec
        self.factor = D.DEFAULT_PADDING_FACTOR if factor is None else factor
        self.server_hidden = server_hidden
        # stand-in for DSpark's DPSpecPrefillCoordinationPlan.apply, which marks every batch of a coordinated
        # step (stock prepare_mlp_sync_batch then keeps SUM_LEN padding whatever the verdict)
        self.coordination_applied = coordination_applied
        self.model_config = publish_runtime(cfg, backend=backend, spec=spec, server_hidden=server_hidden)
        self.spec_algorithm = (
            SpeculativeAlgorithm.NONE if spec == "none" else SpeculativeAlgorithm.from_string(spec.upper())
        )
        self.server_mode = get_server_return_hidden_states_mode()
        parallel = get_parallel()
        if not isinstance(getattr(parallel, "_stamp", {}).get("tp_group"), _TpGroupStandIn):
            parallel.override_permanently(tp_group=_TpGroupStandIn())
        import torch
        from sglang.srt.layers import dp_attention

        # what ModelRunner's DP-attention setup records (an all-decode step sizes its gathered buffer)
        dp_attention._DpGatheredBufferWrapper.set_metadata(self.model_config.hidden_size, torch.bfloat16, "cpu")
        self.dp_attn = dp_attn
        self.sizes = sizes or Sizes()
        self.engines = [RankEngine(r, self.model_config, self.sizes) for r in (0, 1)]
        self.rendezvous = _Rendezvous()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-prefill-world-rank1")
        stock_vote = R.stock(dp_attn._local_prefill_cuda_graph_vote)
        stock_update = R.stock(dp_attn._update_gather_batch)
        self.stock_can_run = R.stock(PrefillCudaGraphRunner.__dict__["can_run_graph"])
        stock_raw = R.stock(dp_attn.prepare_mlp_sync_batch_raw)
        stock_prepare = R.stock(dp_attn.SchedulerDPAttnAdapter.prepare_mlp_sync_batch)
        self.runtimes = [
            A.Runtime(
                factor=self.factor,
                dp_rank=r,
                bs=list(cfg.buckets),
                server_mode=self.server_mode,
                attn_tp_size=1,
                tolerates_sum_len=lambda: False,
            )
            for r in (0, 1)
        ]
        if runtime_hook is not None:
            for rt in self.runtimes:
                runtime_hook(rt)
        self.probe_runtimes = [
            A.Runtime(
                factor=self.factor,
                dp_rank=r,
                bs=list(cfg.buckets),
                server_mode=self.server_mode,
                attn_tp_size=1,
                tolerates_sum_len=lambda: False,
            )
            for r in (0, 1)
        ]
        self.probe_fails: list = [None, None]
        self.runners: dict = {}
        self.prepare: dict = {}
        self.adapters: dict = {}
        for side in ALL_SIDES:
            for r in (0, 1):
                runner = R.build_runner(cfg, server_mode=self.server_mode, backend=backend, spec=spec)
                if side == "harden":
                    runner.can_run_graph = types.MethodType(A.build_guard(self.stock_can_run, self.runtimes[r]), runner)
                    vote = A.build_vote(stock_vote, self.runtimes[r])
                    update = A.build_update_gather(stock_update, self.runtimes[r])
                elif side == "probe":
                    runner.can_run_graph = types.MethodType(self._probe_can_run(r), runner)
                    vote = A.build_vote(stock_vote, self.probe_runtimes[r])
                    update = self._probe_update(stock_update)
                else:
                    vote, update = stock_vote, stock_update
                info_cls = type(
                    "MLPSyncBatchInfo",
                    (dp_attn.MLPSyncBatchInfo,),
                    {
                        "all_gather": with_globals(
                            R.stock(dp_attn.MLPSyncBatchInfo.all_gather),
                            exchange_sync_rows=self.rendezvous.exchange_for(r),
                        ),
                    },
                )
                raw = with_globals(
                    stock_raw,
                    _local_prefill_cuda_graph_vote=vote,
                    _update_gather_batch=update,
                    MLPSyncBatchInfo=info_cls,
                )
                self.prepare[side, r] = with_globals(stock_prepare, prepare_mlp_sync_batch_raw=raw)
                mr = ModelRunnerStandIn(
                    model_config=self.model_config,
                    spec_algorithm=self.spec_algorithm,
                    is_draft_worker=False,
                    prefill_runner=runner,
                )
                eng = self.engines[r]
                self.adapters[side, r] = dp_attn.SchedulerDPAttnAdapter(
                    model_runner=mr,
                    req_to_token_pool=eng.req_to_token_pool,
                    token_to_kv_pool_allocator=eng.allocator,
                    tree_cache=eng.tree,
                    offload_tags=set(),
                    model_config=self.model_config,
                    enable_overlap=False,
                    spec_algorithm=self.spec_algorithm,
                    get_require_mlp_sync=lambda: True,
                )
                self.runners[side, r] = runner
        self.future_map = _FutureMapStandIn(self.spec_algorithm, self.sizes.req_slots)
        # compiled once here: CPython's AST compiler is not safe to enter from two threads at once
        D._stock_padding_code()
        forward_raw_prefill_condition()
        _prepare_mlp_sync_batch_on_cpu()

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    # -- the probe side ------------------------------------------------------------------------
    def _probe_update(self, stock_update):
        bs = list(self.cfg.buckets)

        def _update_gather_batch(batch, mlp_sync_info, *args, **kwargs):
            result = stock_update(batch, mlp_sync_info, *args, **kwargs)
            gathered = mlp_sync_info.global_num_tokens
            if mlp_sync_info.is_extend_in_batch and gathered and 0 < max(gathered) <= max(bs):
                batch.can_run_dp_prefill_cuda_graph = True  # counterfactual "graph": stock pads to the bucket
            return result

        return _update_gather_batch

    def _probe_can_run(self, rank: int):
        from . import decision as D

        world = self

        def can_run_graph(runner, forward_batch):
            fails = D.local_failures(
                runner, forward_batch, num_tokens=len(forward_batch.input_ids), schedule_time=False
            )
            if runner._has_inactive_dp_rank(forward_batch):
                fails = ["inactive_dp_rank"] + fails
            world.probe_fails[rank] = fails
            return False

        return can_run_graph

    # -- building each rank's ScheduleBatch ----------------------------------------------------
    def build(self, rank: int, rs: T.RankStep):
        return build_batch(self.engines[rank], rs, self.spec_algorithm)

    # -- the worker's capture mode (what it passes to ForwardBatch.init_new) ----------------------
    def worker_capture_mode(self, batch):
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        if self.spec_algorithm.is_dspark():
            return CaptureHiddenMode.FULL  # DSparkWorkerV2._forward_prefill: target prefill and idle ranks
        return None  # TpModelWorker: init_new derives it

    # -- one step ------------------------------------------------------------------------------
    def step(self, step: T.Step, side: str) -> list:
        from sglang.srt.managers.overlap_utils import resolve_forward_inputs
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.runtime_context import get_parallel

        from . import decision as D

        publish_runtime(self.cfg, backend=self.backend, spec=self.spec, server_hidden=self.server_hidden)
        try:
            batches = [self.build(r, rs) for r, rs in enumerate(step.ranks)]
            results = [RankResult(rank=r, mode=rs.mode, useful=rs.extend_tokens) for r, rs in enumerate(step.ranks)]
            views: list = [None, None]
            self.probe_fails = [None, None]
            rts = self.runtimes if side == "harden" else self.probe_runtimes if side == "probe" else None
            if rts is not None:
                for r in (0, 1):
                    rts[r].on_view = lambda v, r=r: views.__setitem__(r, v)
            fut = self.pool.submit(self.prepare[side, 1], self.adapters[side, 1], batches[1])
            try:
                out0 = self.prepare[side, 0](self.adapters[side, 0], batches[0])
            except BaseException:
                self.rendezvous.barrier.abort()
                raise
            finally:
                try:
                    out1 = fut.result(timeout=300)
                except BaseException:
                    self.rendezvous.barrier.abort()
                    raise
                finally:
                    if self.rendezvous.barrier.broken:
                        self.rendezvous.barrier.reset()
            outs = [out0, out1]
            for r in (0, 1):
                res, batch = results[r], outs[r]
                res.view = views[r]
                if side == "harden":
                    res.decision = self.runtimes[r].last
                    res.local_reason = self.runtimes[r].last_local_reason
                    self.runtimes[r].last = None
                if batch is None:
                    continue
                batch = self.adapters[side, r].maybe_convert_decode_to_extend(batch)
                res.batch = batch
                res.verdict = bool(batch.can_run_dp_prefill_cuda_graph)
                if self.coordination_applied:
                    batch.dp_spec_prefill_coordination_applied = True
                if not self.spec_algorithm.is_none() and batch.forward_mode.is_decode():
                    continue  # a speculative decode step: no prefill-graph forward (see decode_batch)
                resolve_forward_inputs(batch, self.future_map)
                mr = self.adapters[side, r].model_runner
                fb = ForwardBatch.init_new(
                    batch,
                    mr,
                    capture_hidden_mode=self.worker_capture_mode(batch),
                    return_hidden_states_before_norm=False,
                )
                res.fb_pre = snapshot(fb)
                fb.prepare_mlp_sync_batch = types.MethodType(_prepare_mlp_sync_batch_on_cpu(), fb)
                with get_parallel().override(attn_dp_rank=r, tp_rank=r):
                    ModelRunner._prepare_eager_forward_batch(mr, fb)
                res.fb = fb
                rt = self.runtimes[r]
                rt.last_guard = None
                try:
                    res.replays = stock_replays(mr, fb)
                except D.PrefillGraphDivergence as exc:
                    res.raised = exc
                res.guard_outcome = rt.last_guard if side == "harden" else None
                if side == "probe":
                    res.probe_fails = self.probe_fails[r]
            return results
        finally:
            for eng in self.engines:
                eng.release()


# -- the differential check: view vs the real ForwardBatch --------------------------------------

#: fields of a ForwardBatch the guard, ``local_failures`` and the backend hook read (``snapshot`` keys)
PRE_FIELDS = (
    "forward_mode",
    "_original_forward_mode",
    "global_forward_mode",
    "batch_size",
    "extend_seq_lens_cpu",
    "extend_prefix_lens_cpu",
    "extend_logprob_start_lens_cpu",
    "seq_lens_cpu",
    "capture_hidden_mode",
    "return_logprob",
    "input_embeds",
    "replace_embeds",
    "mm_inputs",
    "token_indices_to_pool",
    "spec_info",
    "extend_num_tokens",
)
POST_FIELDS = PRE_FIELDS + ("num_tokens", "global_num_tokens_cpu", "can_run_dp_prefill_cuda_graph", "prefix_variant")


def view_snapshot(view) -> dict:
    """:func:`snapshot` of a :class:`.decision.PredictedForwardBatch`."""
    seq = view.seq_lens_cpu
    return {
        "forward_mode": view.forward_mode,
        "_original_forward_mode": view._original_forward_mode,
        "global_forward_mode": view.global_forward_mode,
        "batch_size": view.batch_size,
        "extend_seq_lens_cpu": [int(x) for x in view.extend_seq_lens_cpu],
        "extend_prefix_lens_cpu": None
        if view.extend_prefix_lens_cpu is None
        else [int(x) for x in view.extend_prefix_lens_cpu],
        "extend_logprob_start_lens_cpu": None
        if view.extend_logprob_start_lens_cpu is None
        else [int(x) for x in view.extend_logprob_start_lens_cpu],
        "seq_lens_cpu": None if seq is None else [int(x) for x in (seq.tolist() if hasattr(seq, "tolist") else seq)],
        "capture_hidden_mode": view.capture_hidden_mode,
        "return_logprob": bool(view.return_logprob),
        "input_embeds": view.input_embeds is not None,
        "replace_embeds": view.replace_embeds is not None,
        "mm_inputs": bool(view.contains_mm_inputs()),
        "token_indices_to_pool": None
        if view.token_indices_to_pool is None
        else [[int(i) for i in t] for t in view.token_indices_to_pool],
        "spec_info": view.spec_info,
        "num_tokens": None if view.input_ids is None else len(view.input_ids),
        "global_num_tokens_cpu": None if view.global_num_tokens_cpu is None else list(view.global_num_tokens_cpu),
        "can_run_dp_prefill_cuda_graph": bool(view.can_run_dp_prefill_cuda_graph),
        "extend_num_tokens": None if view.extend_num_tokens is None else int(view.extend_num_tokens),
    }


def _variant(runner, max_prefix: int):
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import _chunked_prefix_variant

    if not runner._capture_chunked_prefix or max_prefix <= 0:
        return None
    n = runner._select_prefix_capture_chunks(max_prefix)
    return "uncapturable" if n is None else _chunked_prefix_variant(n)


def real_prefix_variant(runner, fb):
    """The chunked-prefix variant stock ``_shape_key`` picks for the real batch (its assert: uncapturable)."""
    try:
        return runner._shape_key(len(fb.input_ids), fb).variant_label
    except AssertionError:
        return "uncapturable"


def view_differences(world: "World", step: T.Step, results: list) -> list:
    """Every difference between what the schedule-time views predict and the real ForwardBatches
    of a ``probe`` step: the fields after ``init_new``, the fields after ``prepare_mlp_sync_batch``
    (idle rank: :func:`.decision.dummy_extend_view`), the chunked-prefix variant, and the named
    forward-time checks (``local_failures`` on the view at the bucket vs on the real batch)."""
    from . import decision as D

    out: list = []
    live = [r for r in results if r.batch is not None]
    if not live:
        return out
    gathered = list(live[0].batch.global_num_tokens or [])
    forced = bool(live[0].batch.can_run_dp_prefill_cuda_graph)
    bucket = D.stock_bucket(world.cfg.buckets, max(gathered)) if forced and gathered else None
    max_prefix = int(live[0].batch.dp_prefill_cuda_graph_max_prefix_len or 0)
    for res in results:
        runner = world.runners["probe", res.rank]
        where = f"rank {res.rank} ({res.mode})"
        if res.fb_pre is None:
            continue
        view = res.view
        if view is not None and not (view.forward_mode.is_extend() and res.fb_pre["forward_mode"].is_decode()):
            for k in PRE_FIELDS:
                if view_snapshot(view)[k] != res.fb_pre[k]:
                    out.append(
                        f"{where} after init_new: {k}: view {view_snapshot(view)[k]!r} != real {res.fb_pre[k]!r}"
                    )
        if bucket is None or res.fb is None or not res.fb.forward_mode.is_extend():
            continue
        if view is None and res.mode == "idle":
            predicted = D.dummy_extend_view(
                bucket, server_mode=world.server_mode, worker_mode=D.worker_capture_mode(world.spec_algorithm)
            )
            predicted.global_num_tokens_cpu = [bucket] * 2
            predicted.can_run_dp_prefill_cuda_graph = True
        elif view is not None:
            predicted = D.at_bucket(view, bucket)
        else:
            out.append(f"{where}: the real batch extends at forward time but the vote computed no view")
            continue
        real = snapshot(res.fb)
        real["prefix_variant"] = real_prefix_variant(runner, res.fb)
        pred = view_snapshot(predicted)
        local_max = max(predicted.extend_prefix_lens_cpu or [0])
        pred["prefix_variant"] = _variant(runner, max(local_max, max_prefix))
        for k in POST_FIELDS:
            if pred[k] != real[k]:
                out.append(f"{where} after prepare_mlp_sync_batch: {k}: view {pred[k]!r} != real {real[k]!r}")
        fails = D.local_failures(runner, predicted, num_tokens=bucket, schedule_time=False)
        real_fails = [f for f in (res.probe_fails or []) if f != "inactive_dp_rank"]
        if fails != real_fails:
            out.append(f"{where}: forward-time checks: view fails {fails} != real fails {real_fails}")
    return out
