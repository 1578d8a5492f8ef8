"""A test-only CPU "hardware" platform for stock SGLang 0.5.23 (no change to SGLang itself).

Stand-in: this machine has no GPU, and the PyPI ``sglang-kernel`` is the CUDA build, so neither
SGLang's in-tree CPU engine (``SGLANG_USE_CPU_ENGINE=1``, needs the source-only CPU sgl-kernel) nor
``--device cpu`` alone can serve (shared/design/cpu-e2e.md). SGLang discovers hardware platforms
through the entry-point group ``sglang.srt.platforms``; this one registers there as
``dspark_test_cpu`` and gives the *unmodified* ``python -m sglang.launch_server`` a platform that
runs every op through its ``forward_native`` (pure torch) path and every parallel group over gloo:

- ``CpuDeviceMixin`` + ``SRTPlatform`` with ``_enum = PlatformEnum.OOT``: device "cpu", default
  ``PlatformCapabilities()`` (no Triton, no graphs, no pynccl), attention backend
  ``torch_native``, pin memory off, dispatch key ``native``, distributed backend ``gloo``;
- opt-in only: :func:`activate` returns the platform iff ``DSPARK_TEST_CPU_PLATFORM=1`` (so it can
  never activate on a GPU host by accident); any value other than ``0``/``1`` is an error;
- :meth:`DsparkTestCpuPlatform.init_backend` (called by ``model_runner`` at import, in every
  scheduler process) makes four adjustments that stock code decides from
  ``SGLANG_USE_CPU_ENGINE`` instead of from the platform; each was found from a real failure
  under ``--enable-dp-attention`` (they are harmless without it, so they are applied always):

  1. ``TorchNativeAttnBackend`` lacks ``get_cuda_graph_seq_len_fill_value`` /
     ``get_cpu_graph_seq_len_fill_value`` (DP-attention padding in
     ``ForwardBatch._pad_inputs_to_size`` raises ``NotImplementedError``): fill value 1;
  2. ``forward_batch_info._is_cpu = True`` (else ``pin_memory`` -> "Found no NVIDIA driver");
  3. ``dp_attention._is_cpu = True`` and ``dp_attention.memcpy_func = memcpy_cpu`` (else Triton
     "0 active drivers");
  4. ``parallel_state._is_cpu = True`` (else the ``sglang::reg_all_gather_into_tensor`` custom op
     has no CPU kernel); ``logits_processor._is_cpu`` likewise, as a precaution.

  Every attribute is checked to exist when this module is imported (statically, from the module
  sources, so importing this module never imports SGLang's model stack) and again before it is
  set, so an SGLang bump that renames one fails loudly instead of silently serving differently.

SGLang's ``SGLANG_PLUGINS`` allow-list also filters *platform* plugins during auto-discovery, so
servers set ``SGLANG_PLATFORM=dspark_test_cpu`` as well (the harness does).
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
from typing import Optional

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from . import PLATFORM_ENV

logger = logging.getLogger("dspark_testsupport")

QUALNAME = "dspark_testsupport.cpu_platform.DsparkTestCpuPlatform"

# module -> module-level names init_backend() overrides (each must exist in stock SGLang)
ADJUSTED_MODULE_ATTRS: dict[str, tuple[str, ...]] = {
    "sglang.srt.model_executor.forward_batch_info": ("_is_cpu",),
    "sglang.srt.layers.dp_attention": ("_is_cpu", "memcpy_func", "memcpy_cpu"),
    "sglang.srt.distributed.parallel_state": ("_is_cpu",),
    "sglang.srt.layers.logits_processor": ("_is_cpu",),
}
ATTN_BACKEND_MODULE = "sglang.srt.layers.attention.torch_native_backend"
ATTN_BACKEND_CLASS = "TorchNativeAttnBackend"
FILL_VALUE_METHODS = ("get_cuda_graph_seq_len_fill_value", "get_cpu_graph_seq_len_fill_value")
SEQ_LEN_FILL_VALUE = 1


def platform_enabled(environ: Optional[dict] = None) -> bool:
    """Strict parse of ``DSPARK_TEST_CPU_PLATFORM`` (unset/``0``: off, ``1``: on, else error)."""
    raw = (os.environ if environ is None else environ).get(PLATFORM_ENV)
    if raw is None or raw == "0":
        return False
    if raw == "1":
        return True
    raise ValueError(f"{PLATFORM_ENV} must be exactly '0' or '1', got {raw!r}")


def _source_file(module: str) -> str:
    """Path of an ``sglang.*`` module's source, found WITHOUT importing it or its parent packages.

    The platform is resolved while ``sglang.srt.utils`` is still half-imported (it reads
    ``current_platform`` at import), so importing or even ``find_spec``-ing SGLang submodules here
    would hit a circular import.
    """
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)  # top-level "sglang": already in sys.modules
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        base = os.path.join(root, *rest.split("."))
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    raise ImportError(f"dspark_test_cpu platform: SGLang module {module} not found under {roots}")


def _parse(module: str) -> ast.Module:
    path = _source_file(module)
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def _module_level_names(module: str) -> set[str]:
    """Names bound at module level in ``module``'s source (assignments, defs, imports), without importing it."""
    tree = _parse(module)
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for tgt in node.targets:
                if isinstance(tgt, ast.Name):
                    names.add(tgt.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
    return names


def check_stock_surfaces() -> None:
    """Assert (statically) that every SGLang attribute this platform adjusts still exists."""
    missing = []
    for module, attrs in ADJUSTED_MODULE_ATTRS.items():
        names = _module_level_names(module)
        missing += [f"{module}.{a}" for a in attrs if a not in names]
    if ATTN_BACKEND_CLASS not in _module_level_names(ATTN_BACKEND_MODULE):
        missing.append(f"{ATTN_BACKEND_MODULE}.{ATTN_BACKEND_CLASS}")
    if "get_cuda_graph_seq_len_fill_value" not in _module_level_names_of_class(
        "sglang.srt.layers.attention.base_attn_backend", "AttentionBackend"
    ):
        missing.append(
            "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.get_cuda_graph_seq_len_fill_value"
        )
    assert not missing, (
        "dspark_test_cpu platform: SGLang no longer has "
        + ", ".join(missing)
        + " (written against sglang 0.5.23): update tests/support/dspark_testsupport/cpu_platform.py"
    )


def _module_level_names_of_class(module: str, cls: str) -> set[str]:
    for node in _parse(module).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return set()


check_stock_surfaces()


def _fill_value(self) -> int:
    """Padded seq lens under DP attention: 1 (what the CUDA backends use for torch-native paths)."""
    return SEQ_LEN_FILL_VALUE


def adjust_sglang_for_cpu() -> list[str]:
    """The four DP-attention adjustments (see module docstring). Idempotent; returns what it set."""
    import importlib

    done = []
    for module, attrs in ADJUSTED_MODULE_ATTRS.items():
        mod = importlib.import_module(module)
        for attr in attrs:
            assert hasattr(mod, attr), f"dspark_test_cpu platform: {module}.{attr} does not exist in this SGLang"
        mod._is_cpu = True
        done.append(f"{module}._is_cpu")
        if module.endswith("dp_attention"):
            mod.memcpy_func = mod.memcpy_cpu
            done.append(f"{module}.memcpy_func=memcpy_cpu")
    backend_mod = importlib.import_module(ATTN_BACKEND_MODULE)
    backend = getattr(backend_mod, ATTN_BACKEND_CLASS)
    for name in FILL_VALUE_METHODS:
        if name not in backend.__dict__:
            setattr(backend, name, _fill_value)
            done.append(f"{ATTN_BACKEND_CLASS}.{name}")
    return done


# -- DSpark on CPU ---------------------------------------------------------------------------------
#
# Stock ``speculative_hook._handle_dspark`` (the DSPARK server-args handler) opens with a device gate
# that, unlike ``_handle_dflash`` and ``_check_oot_speculative_algorithm``, does not consult an
# out-of-tree platform's ``supports_speculative_algorithm``:
#
#     if not cfg.device.startswith(("cuda", "npu", "xpu")):
#         raise ValueError("DSpark speculative decoding only supports CUDA, NPU or XPU device.")
#
# The CPU form is the stock function, compiled from its own source with exactly that gate replaced
# by the out-of-tree check DFLASH uses (every other line unchanged; the gate's text is asserted, so
# an SGLang bump that changes it fails loudly). Installed in the main process from
# ``apply_server_args_defaults`` (resolution runs platform defaults before speculative handling).
DSPARK_HANDLER_MODULE = "sglang.srt.arg_groups.speculative_hook"
DSPARK_HANDLER = "_handle_dspark"
DSPARK_DEVICE_GATE = (
    '    if not cfg.device.startswith(("cuda", "npu", "xpu")):\n'
    "        raise ValueError(\n"
    '            "DSpark speculative decoding only supports CUDA, NPU or XPU device."\n'
    "        )\n"
)
DSPARK_OOT_GATE = '    _check_oot_speculative_algorithm(algorithm="DSPARK", device=cfg.device)\n'
SPECULATIVE_ALGORITHMS = frozenset({"DSPARK"})
DRAFT_ATTENTION_BACKENDS = frozenset({"torch_native"})


def install_dspark_cpu_handler() -> bool:
    """Replace ``speculative_hook._handle_dspark`` by its CPU form (idempotent; True if installed now)."""
    import importlib
    import inspect
    import textwrap

    mod = importlib.import_module(DSPARK_HANDLER_MODULE)
    stock = getattr(mod, DSPARK_HANDLER)
    if getattr(stock, "__dspark_cpu_form__", False):
        return False
    src = textwrap.dedent(inspect.getsource(stock))
    assert src.count(DSPARK_DEVICE_GATE) == 1, (
        f"dspark_test_cpu platform: {DSPARK_HANDLER_MODULE}.{DSPARK_HANDLER} no longer opens with the device gate "
        f"this platform replaces (written against sglang 0.5.23): update tests/support/dspark_testsupport/cpu_platform.py"
    )
    assert callable(getattr(mod, "_check_oot_speculative_algorithm", None))
    namespace: dict = {}
    code = compile(src.replace(DSPARK_DEVICE_GATE, DSPARK_OOT_GATE), inspect.getsourcefile(stock), "exec")
    exec(code, mod.__dict__, namespace)  # noqa: S102 - the stock source, one gate replaced
    cpu_form = namespace[DSPARK_HANDLER]
    cpu_form.__dspark_cpu_form__ = True
    cpu_form.__wrapped__ = stock
    setattr(mod, DSPARK_HANDLER, cpu_form)
    return True


# Stock functions that run a Triton kernel, or on ``_is_cpu`` an op of the CPU build of sgl-kernel
# (``from sgl_kernel import <op>``, which the PyPI CUDA build does not have), on the DSpark path:
#
# - ``cache_move.copy_all_layer_kv_cache_func`` (speculative KV slot moves, the pool's warm-up)
#   -> ``copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc)``: for every layer buffer
#   (base pointer, row stride in bytes) copy row ``src_loc[i]`` to row ``tgt_loc[i]``, all sources
#   read before any target is written (the Triton kernel is safe in place too);
# - ``allocation.assign_req_to_token_pool_func`` (speculative decode slot allocation)
#   -> ``assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start, end, out_cache_loc,
#   pool_len)``: row ``req_pool_indices[i]`` of ``req_to_token`` gets ``out_cache_loc``'s next
#   ``end[i] - start[i]`` entries at ``[start[i], end[i])``.
#
# The CPU forms below are those ops' contracts in plain torch / ctypes; the module's ``_is_cpu`` is
# set so the stock function takes its own CPU branch. Every name is asserted to exist.


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    import ctypes

    tgt = [int(x) for x in tgt_loc.tolist()]
    src = [int(x) for x in src_loc.tolist()]
    if not tgt:
        return
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(int(base) + s * int(stride), int(stride)) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(int(base) + t * int(stride), row, int(stride))


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    del pool_len  # req_to_token's row length
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = int(end) - int(start)
        if n > 0:
            req_to_token[int(row), int(start) : int(end)] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += max(n, 0)


# module -> (stock function that branches on _is_cpu, sgl-kernel CPU op name, CPU form)
CPU_OP_FORMS = {
    "sglang.kernels.ops.kvcache.cache_move": (
        "copy_all_layer_kv_cache_func",
        "copy_all_layer_kv_cache_cpu",
        copy_all_layer_kv_cache_cpu,
    ),
    "sglang.srt.mem_cache.allocation": (
        "assign_req_to_token_pool_func",
        "assign_req_to_token_pool_cpu",
        assign_req_to_token_pool_cpu,
    ),
}


def adjust_dspark_for_cpu() -> list[str]:
    """Scheduler processes: the CPU op forms above, and ``torch_native`` as a draft attention backend
    (stock extension point ``choices.add_draft_attention_backend_choices``; the draft worker checks
    the list in the scheduler, so it is extended there as well as in the main process)."""
    import importlib

    done = []
    for module, (func, op, form) in CPU_OP_FORMS.items():
        mod = importlib.import_module(module)
        for attr in ("_is_cpu", func):
            assert hasattr(mod, attr), f"dspark_test_cpu platform: {module}.{attr} does not exist in this SGLang"
        mod._is_cpu = True
        setattr(mod, op, form)
        done.append(f"{module}.{op}=<CPU form>")
    done += add_draft_attention_backends()
    done += install_record_stream_cpu_form()
    done += install_target_verify_cpu_form()
    return done


# Stock ``DSparkWorkerV2._forward_decode`` calls ``batch.seq_lens.record_stream(
# torch.get_device_module(self.device).current_stream())`` unconditionally; on the CPU that is a
# ``torch.cpu.Stream`` and ``Tensor.record_stream`` raises "unknown parameter type".
# ``record_stream`` only tells the CUDA caching allocator not to reuse a block before a stream is
# done with it; CPU tensors have no stream-ordered allocator, so its CPU form is a no-op (non-CPU
# tensors keep the stock method).
_STOCK_RECORD_STREAM = None


def _record_stream_cpu_form(self, stream):
    if self.device.type == "cpu":
        return None
    return _STOCK_RECORD_STREAM(self, stream)


def install_record_stream_cpu_form() -> list[str]:
    import torch

    global _STOCK_RECORD_STREAM
    if torch.Tensor.record_stream is _record_stream_cpu_form:
        return []
    _STOCK_RECORD_STREAM = torch.Tensor.record_stream
    torch.Tensor.record_stream = _record_stream_cpu_form
    return ["torch.Tensor.record_stream=<no-op on CPU tensors>"]


def add_draft_attention_backends() -> list[str]:
    from sglang.srt.arg_groups import choices

    missing = [b for b in sorted(DRAFT_ATTENTION_BACKENDS) if b not in choices.DRAFT_ATTENTION_BACKEND_CHOICES]
    if missing:
        choices.add_draft_attention_backend_choices(missing)
    return [f"draft attention backend {b}" for b in missing]


# Stock ``DSparkDraftMixin.write_target_hidden_kv`` (models/dspark.py) writes the draft's context
# K/V either through the Triton kernel ``fused_kv_write.fused_kv_norm_rope_write`` (when
# ``_fused_kv_write_bundle(pool)`` returns a bundle: bf16 weights, plain RoPE, a K/V pool) or
# through its own unfused torch branch (``kv_proj_only`` -> ``apply_k_norm`` -> ``apply_k_rope`` ->
# ``pool.set_kv_buffer``). The CPU form declines the bundle on the loaded draft model (instance
# attribute, from ``post_load_model``), so the stock unfused branch runs.
DSPARK_DRAFT_MIXIN = ("sglang.srt.models.dspark", "DSparkDraftMixin", "_fused_kv_write_bundle")


def _no_fused_kv_write_bundle(pool):
    return None


def adjust_loaded_model(model) -> list[str]:
    import sys

    mod = sys.modules.get(DSPARK_DRAFT_MIXIN[0])
    mixin = getattr(mod, DSPARK_DRAFT_MIXIN[1], None) if mod is not None else None
    if mixin is None or not isinstance(model, mixin):
        return []
    assert callable(getattr(mixin, DSPARK_DRAFT_MIXIN[2], None)), (
        f"dspark_test_cpu platform: {'.'.join(DSPARK_DRAFT_MIXIN)} does not exist in this SGLang"
    )
    model._fused_kv_write_bundle = _no_fused_kv_write_bundle
    done = [f"{type(model).__name__}._fused_kv_write_bundle=None (stock unfused KV write)"]
    # Stock DFlashAttention.forward takes the Triton ``table_qk_norm_rope_`` when
    # ``use_table_qk_norm_rope`` (bf16, neox RoPE over the whole head), else its own torch
    # q/k norm + RoPE branch: the CPU form turns the flag off per attention module.
    attn_cls = getattr(sys.modules.get("sglang.srt.models.dflash"), "DFlashAttention", None)
    n = 0
    for module in model.modules():
        if attn_cls is not None and isinstance(module, attn_cls) and getattr(module, "use_table_qk_norm_rope", False):
            module.use_table_qk_norm_rope = False
            n += 1
    if n:
        done.append(f"DFlashAttention.use_table_qk_norm_rope=False on {n} module(s) (stock torch q/k norm + RoPE)")
    return done


def speculative_cache_locs_cpu(
    *, req_pool_indices, req_to_token, start_offset, end_offset, batch_size, draft_token_num, device
):
    """Platform form of ``cache_locs.assign_extend_cache_locs_func`` (stock out-of-tree hook
    ``get_speculative_cache_locs_fn``): row i's ``draft_token_num`` slots are
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``, rows concatenated."""
    import torch

    out = torch.empty((batch_size * draft_token_num,), dtype=torch.int64, device=device)
    for i, (row, start, end) in enumerate(zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist())):
        out[i * draft_token_num : (i + 1) * draft_token_num] = req_to_token[int(row), int(start) : int(end)]
    return out


# DSpark/DFlash TARGET_VERIFY attention (the draft's block forward and the target's verify forward).
#
# ``DSparkDraftProposer._run_forward`` runs the draft as a ``ForwardMode.TARGET_VERIFY`` batch:
# ``seq_lens`` = the committed context (whose draft K/V the worker injected from the target's hidden
# states), ``out_cache_loc`` = the block's ``query_token_num`` slots, ``spec_info`` = a
# ``DFlashVerifyInput`` with ``custom_mask=None``; ``DSparkVerifier.run_non_compact`` runs the target
# the same way with the verify window. Stock ``TorchNativeAttnBackend.forward_extend`` has no
# TARGET_VERIFY branch: ``_run_sdpa_forward_extend`` reads ``forward_batch.extend_prefix_lens``, which
# such a batch does not set (``AttributeError: 'NoneType' object has no attribute 'shape'``).
#
# What the CUDA backends compute for that batch (sglang 0.5.23):
# - FlashInfer (``FlashInferAttnBackend.forward_extend``, paged branch, with
#   ``DFlashVerifyInput.generate_attn_arg_prefill``): ``qo_indptr`` a uniform stride of
#   ``draft_token_num`` per request, the KV of request i = ``req_to_token[row_i, :seq_lens[i] +
#   draft_token_num]`` (the block's K/V written at ``out_cache_loc`` first), no custom mask,
#   ``causal = not layer.is_cross_attention and layer.attn_type != ENCODER_ONLY`` (FlashInfer's
#   causal mask is bottom-right aligned: block query j sees KV positions ``<= seq_lens[i] + j``);
# - Triton (``TritonAttnBackend.forward_extend``, TARGET_VERIFY metadata): prefix KV
#   ``req_to_token[row_i, :seq_lens[i]]`` plus the block's own K/V at ``out_cache_loc``, the same
#   causal rule (ENCODER_ONLY -> bidirectional over prefix + block), ``custom_mask`` None.
# The two read the same slots (the verify window's ``out_cache_loc`` are ``req_to_token[row_i,
# seq_lens[i]:seq_lens[i] + n]``, assigned by ``assign_extend_cache_locs``). The CPU form below is
# that computation with torch SDPA: write the block's K/V at ``out_cache_loc`` (as both do), gather
# prefix + block K/V from the pool, one SDPA per request with an explicit boolean mask (all-true for
# a bidirectional layer, ``kv_pos <= prefix + j`` for a causal one). Everything the CUDA paths do
# that this form does not reproduce is refused by name (ragged verify layouts, tree custom masks,
# sliding windows, logit caps, cross attention), never approximated.
TARGET_VERIFY_CPU_FORM = (ATTN_BACKEND_MODULE, ATTN_BACKEND_CLASS, "forward_extend")


class TargetVerifyCpuFormError(NotImplementedError):
    pass


def target_verify_attention_cpu(backend, q, k, v, layer, forward_batch, save_kv_cache=True):
    """TARGET_VERIFY attention of ``TorchNativeAttnBackend`` (see the comment above)."""
    import torch
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    from torch.nn.functional import scaled_dot_product_attention

    spec = forward_batch.spec_info

    def refuse(what):
        raise TargetVerifyCpuFormError(
            f"dspark_test_cpu TARGET_VERIFY attention: {what} is not supported by the CPU form"
        )

    if spec is None:
        refuse("a TARGET_VERIFY batch without spec_info")
    if getattr(spec, "custom_mask", None) is not None:
        refuse("a tree custom_mask")
    if getattr(spec, "ragged_verify_layout", None) is not None:
        refuse("a ragged verify layout")
    if layer.is_cross_attention:
        refuse("cross attention")
    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        refuse(f"a sliding window ({layer.sliding_window_size})")
    if getattr(layer, "logit_cap", 0) and layer.logit_cap > 0:
        refuse("a logit cap")
    if layer.qk_head_dim != layer.v_head_dim:
        refuse("qk_head_dim != v_head_dim")
    n = int(getattr(spec, "num_tokens_per_req", -1))
    if n <= 0:
        n = int(spec.draft_token_num)
    bs = int(forward_batch.seq_lens.shape[0])
    cache_loc = forward_batch.out_cache_loc
    if q.shape[0] != bs * n or cache_loc.shape[0] != bs * n:
        refuse(f"{q.shape[0]} query rows / {cache_loc.shape[0]} cache slots for {bs} requests x {n} tokens")
    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        pool.set_kv_buffer(layer, KVWriteLoc(cache_loc, backend.swa_out_cache_loc), k, v)
    elif k is None or v is None:
        refuse("a forward without the block's K/V")
    k_cache = pool.get_key_buffer(layer.layer_id)
    v_cache = pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    causal = layer.attn_type != AttentionType.ENCODER_ONLY
    nq, nkv = layer.tp_q_head_num, layer.tp_k_head_num
    q3 = q.view(-1, nq, layer.qk_head_dim)
    out = q.new_empty((q3.shape[0], nq, layer.v_head_dim))
    k3 = k.view(-1, nkv, layer.qk_head_dim) if k is not None else None
    v3 = v.view(-1, layer.tp_v_head_num, layer.v_head_dim) if v is not None else None
    for i, (row, prefix) in enumerate(zip(forward_batch.req_pool_indices.tolist(), forward_batch.seq_lens.tolist())):
        rows = slice(i * n, (i + 1) * n)
        prefix_ids = req_to_token[int(row), : int(prefix)].to(torch.int64)
        if save_kv_cache:
            ids = torch.cat([prefix_ids, cache_loc[rows].to(torch.int64)])
            key, value = k_cache[ids], v_cache[ids]
        else:
            key = torch.cat([k_cache[prefix_ids], k3[rows].to(k_cache.dtype)])
            value = torch.cat([v_cache[prefix_ids], v3[rows].to(v_cache.dtype)])
        query = q3[rows]
        key, value = key.to(query.dtype), value.to(query.dtype)
        kv_len = int(prefix) + n
        if causal:
            mask = torch.arange(kv_len).unsqueeze(0) <= (int(prefix) + torch.arange(n)).unsqueeze(1)
        else:
            mask = torch.ones((n, kv_len), dtype=torch.bool)
        o = scaled_dot_product_attention(
            query.movedim(0, 1).unsqueeze(0),
            key.movedim(0, 1).unsqueeze(0),
            value.movedim(0, 1).unsqueeze(0),
            attn_mask=mask.to(query.device),
            scale=layer.scaling,
            enable_gqa=nq != nkv,
        )
        out[rows] = o.squeeze(0).movedim(0, 1)
    return out.view(q.shape[0], nq * layer.v_head_dim)


_STOCK_TORCH_NATIVE_FORWARD_EXTEND = None


def _torch_native_forward_extend_cpu_form(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    if forward_batch.forward_mode.is_target_verify():
        return target_verify_attention_cpu(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache)
    return _STOCK_TORCH_NATIVE_FORWARD_EXTEND(
        self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs
    )


def install_target_verify_cpu_form() -> list[str]:
    """``TorchNativeAttnBackend.forward_extend``: TARGET_VERIFY batches take the CPU form, every other
    mode the stock method (idempotent)."""
    import importlib

    global _STOCK_TORCH_NATIVE_FORWARD_EXTEND
    backend = getattr(importlib.import_module(ATTN_BACKEND_MODULE), ATTN_BACKEND_CLASS)
    current = backend.__dict__.get("forward_extend")
    assert callable(current), (
        f"dspark_test_cpu platform: {ATTN_BACKEND_CLASS}.forward_extend does not exist in this SGLang"
    )
    if current is _torch_native_forward_extend_cpu_form:
        return []
    _STOCK_TORCH_NATIVE_FORWARD_EXTEND = current
    backend.forward_extend = _torch_native_forward_extend_cpu_form
    return [f"{ATTN_BACKEND_CLASS}.forward_extend=<TARGET_VERIFY CPU form>"]


class DsparkTestCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """Out-of-tree CPU platform for tests (see module docstring)."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    capabilities = PlatformCapabilities()

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return "torch_native"

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def get_dispatch_key_name(self) -> str:
        return "native"

    def get_torch_distributed_backend_str(self) -> str:
        return "gloo"

    def get_graph_runner_cls(self):
        return None

    def get_speculative_cache_locs_fn(self):
        return speculative_cache_locs_cpu

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm in SPECULATIVE_ALGORITHMS

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return algorithm in SPECULATIVE_ALGORITHMS and backend in DRAFT_ATTENTION_BACKENDS

    def apply_server_args_defaults(self, server_args) -> None:
        add_draft_attention_backends()
        if install_dspark_cpu_handler():
            logger.info(
                "dspark_test_cpu platform: %s.%s replaced by its CPU form", DSPARK_HANDLER_MODULE, DSPARK_HANDLER
            )

    def post_load_model(self, model) -> None:
        done = adjust_loaded_model(model)
        if done:
            logger.info("dspark_test_cpu platform: %s (pid %d)", ", ".join(done), os.getpid())

    def init_backend(self) -> None:
        done = adjust_sglang_for_cpu() + adjust_dspark_for_cpu()
        logger.info("dspark_test_cpu platform: adjusted %s (pid %d)", ", ".join(done), os.getpid())


def activate() -> Optional[str]:
    """Entry point (group ``sglang.srt.platforms``): the platform class iff ``DSPARK_TEST_CPU_PLATFORM=1``."""
    if not platform_enabled():
        return None
    return QUALNAME
