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
        missing.append("sglang.srt.layers.attention.base_attn_backend.AttentionBackend.get_cuda_graph_seq_len_fill_value")
    assert not missing, (
        "dspark_test_cpu platform: SGLang no longer has " + ", ".join(missing)
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

    def init_backend(self) -> None:
        done = adjust_sglang_for_cpu()
        logger.info("dspark_test_cpu platform: adjusted %s (pid %d)", ", ".join(done), os.getpid())


def activate() -> Optional[str]:
    """Entry point (group ``sglang.srt.platforms``): the platform class iff ``DSPARK_TEST_CPU_PLATFORM=1``."""
    if not platform_enabled():
        return None
    return QUALNAME
