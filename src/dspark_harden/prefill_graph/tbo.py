"""Two-batch overlap (TBO) and prefill graphs: upstream probes and the startup refusal.

The seed's two review findings are probed on the live stock code (reported ``upstream`` by
``dspark-harden check``, ``failed`` if an SGLang bump brings the bug back):

* an idle or absent batch still votes "can run TBO" in ``TboDPAttentionPreparer.prepare_all_gather``;
* decode-graph TBO capture (``TboCudaGraphRunnerPlugin.capture_one_batch_size``) returns early only
  when TBO is off, never for a model type.

Both run the real stock code objects; where the code reads process-wide state (``is_tbo_enabled``,
the DeepEP mode, the MoE a2a backend) it is executed with those names bound in a private copy of
its globals (``types.FunctionType``), so a probe never changes what the process sees.

Prefill graphs with TBO: stock 0.5.23 cannot capture them. ``PrefillCudaGraphRunner.capture_prepare``
calls ``tbo_plugin.capture_one_batch_size`` on an EXTEND batch, which calls
``compute_split_seq_index(EXTEND, extend_lens=None)`` and asserts; no prefill ``replay_prepare``
exists, and ``disable_breakable_cudagraph_if_incompatible`` already turns breakable prefill graphs
off under TBO. The fixed flat-token split with zero-length sentinel children (tbo_split.py,
tbo_graph.py) changes capture *and* replay of the DSV4 metadata and has not run on two GPUs, so it
is opt-in (``DSPARK_HARDEN_PREFILL_GRAPH_TBO=1``, full backend only); by default this feature
refuses the combination at startup (:func:`refusal`) instead of letting capture assert.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from typing import Any, Optional


def _with_globals(func: Any, **names: Any) -> Any:
    func = getattr(func, "__func__", func)
    return types.FunctionType(
        func.__code__, {**func.__globals__, **names}, func.__name__, func.__defaults__, func.__closure__
    )


class _IdleBatch:
    """An IDLE ``ScheduleBatch`` as ``prepare_all_gather`` reads it (scheduler's get_idle_batch)."""

    def __init__(self) -> None:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        self.forward_mode = ForwardMode.IDLE
        self.spec_info = None
        self.extend_num_tokens = 0
        self.extend_lens = []
        self.is_extend_in_batch = False
        self.reqs = []

    def batch_size(self) -> int:
        return 0


def probe_idle_votes_tbo() -> tuple:
    """``prepare_all_gather(None)`` and ``prepare_all_gather(<IDLE batch>)`` with TBO on must
    return ``local_can_run_tbo=True`` (an idle peer must not veto TBO)."""
    from sglang.srt.batch_overlap import two_batch_overlap as tbo
    from sglang.srt.layers.moe.utils import DeepEPMode, MoeA2ABackend

    results = {}
    for a2a in (MoeA2ABackend.NONE, MoeA2ABackend.DEEPEP):
        fn = _with_globals(
            tbo.TboDPAttentionPreparer.prepare_all_gather,
            is_tbo_enabled=lambda: True,
            get_deepep_mode=lambda: DeepEPMode.LOW_LATENCY,
            get_moe_a2a_backend=lambda a2a=a2a: a2a,
        )
        for name, batch in (("absent", None), ("idle", _IdleBatch())):
            can_run, _mode = fn(tbo.TboDPAttentionPreparer(), batch)
            results[f"{name}/{a2a.name.lower()}"] = bool(can_run)
    vetoes = [k for k, v in results.items() if not v]
    if vetoes:
        return (
            False,
            f"TboDPAttentionPreparer.prepare_all_gather: an idle/absent batch vetoes TBO ({', '.join(vetoes)})",
        )
    return True, "TboDPAttentionPreparer.prepare_all_gather: idle and absent batches vote can-run-TBO (" + ", ".join(
        results
    ) + ")"


def _early_return_tests(func: Any) -> list:
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(func, "__func__", func))))
    fn = tree.body[0]
    tests = []
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and any(isinstance(s, ast.Return) for s in node.body):
            tests.append(ast.unparse(node.test))
    return tests


def probe_decode_tbo_capture() -> tuple:
    """``TboCudaGraphRunnerPlugin.capture_one_batch_size`` may return early only on
    ``not is_tbo_enabled()``: no model-type (or other) condition may skip decode-graph TBO capture."""
    from sglang.srt.batch_overlap import two_batch_overlap as tbo

    tests = _early_return_tests(tbo.TboCudaGraphRunnerPlugin.capture_one_batch_size)
    if tests != ["not is_tbo_enabled()"]:
        return (
            False,
            f"TboCudaGraphRunnerPlugin.capture_one_batch_size returns early on {tests} (expected only 'not is_tbo_enabled()')",
        )
    return True, "TboCudaGraphRunnerPlugin.capture_one_batch_size skips capture only when TBO is off"


def probe_prefill_tbo_unsupported() -> tuple:
    """True when stock still cannot capture prefill graphs with TBO (then the refusal is needed):
    ``compute_split_seq_index(EXTEND, extend_lens=None)`` asserts and no prefill replay_prepare exists."""
    from sglang.srt.batch_overlap.two_batch_overlap import compute_split_seq_index
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner import prefill_cuda_graph_runner as pcg

    try:
        compute_split_seq_index(ForwardMode.EXTEND, 128, None, None)
        asserts = False
    except AssertionError:
        asserts = True
    src = inspect.getsource(pcg.PrefillCudaGraphRunner)
    capture_calls = "tbo_plugin.capture_one_batch_size" in src
    replay_calls = "tbo_plugin.replay_prepare" in src
    unsupported = asserts and capture_calls and not replay_calls
    return unsupported, (
        f"compute_split_seq_index(EXTEND, extend_lens=None) {'asserts' if asserts else 'returns'}; "
        f"prefill capture calls the TBO plugin: {capture_calls}; prefill replay_prepare: {replay_calls}"
    )


REFUSAL = (
    "two-batch overlap (--enable-two-batch-overlap) together with a {backend} prefill CUDA graph "
    "under DP attention is refused: stock SGLang 0.5.23 cannot capture prefill graphs with TBO "
    "(PrefillCudaGraphRunner.capture_prepare hands an EXTEND batch to the TBO plugin, whose "
    "compute_split_seq_index asserts on extend_lens=None, and there is no prefill replay_prepare), "
    "and the fixed flat-token split with zero-length sentinel children that makes it safe has not "
    "run on two GPUs yet: it is opt-in (DSPARK_HARDEN_PREFILL_GRAPH_TBO=1, full backend only; "
    "docs/prefill_graph.md lists what stays unproven). Use --cuda-graph-backend-prefill disabled "
    "with TBO, drop TBO, opt in, or set DSPARK_HARDEN_PREFILL_GRAPH=0 to get stock behaviour "
    "(which fails at capture)."
)
REFUSAL_BREAKABLE = (
    "DSPARK_HARDEN_PREFILL_GRAPH_TBO=1 covers the full prefill backend only: two-batch overlap with a "
    "breakable prefill CUDA graph stays refused (stock's disable_breakable_cudagraph_if_incompatible "
    "turns breakable prefill graphs off under TBO, and the TBO children's breakable capture/replay "
    "metadata hooks are not fanned out). Use --cuda-graph-backend-prefill full (not for DeepSeek V4 on "
    "0.5.23: its full prefill replay raises NotImplementedError for EXTEND; there, TBO prefill graphs do not apply)."
)


def refusal(server_args: Any, *, allow_full: bool = False) -> Optional[str]:
    """The startup refusal message when ``server_args`` combines TBO with a prefill graph
    (``allow_full``: DSPARK_HARDEN_PREFILL_GRAPH_TBO=1, the full backend is served)."""
    if not getattr(server_args, "enable_two_batch_overlap", False):
        return None
    backend = prefill_backend(server_args)
    if backend not in ("full", "breakable"):
        return None
    if allow_full:
        return None if backend == "full" else REFUSAL_BREAKABLE
    return REFUSAL.format(backend=backend)


def prefill_backend(server_args: Any) -> Optional[str]:
    """``cuda_graph_config.prefill.backend`` as a string, or ``None`` when it cannot be read."""
    cfg = getattr(server_args, "cuda_graph_config", None)
    prefill = getattr(cfg, "prefill", None) if cfg is not None else None
    if prefill is None and isinstance(cfg, dict):
        prefill = cfg.get("prefill")
    backend = getattr(prefill, "backend", None) if prefill is not None else None
    if backend is None:
        return None
    return str(getattr(backend, "value", backend)).lower()
