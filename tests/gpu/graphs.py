"""The two capture mechanisms the GPU prefill-graph tests run under (tests/gpu only, CUDA only).

* ``cuda_graph``: one ``torch.cuda.CUDAGraph`` (what the ``full`` prefill backend captures);
* ``breakable``: SGLang 0.5.23's own ``BreakableCUDAGraph`` / ``BreakableCUDAGraphCapture``
  (sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph, needs cuda-python, present on
  the GPU machine): the body is captured as several CUDA-graph segments with eager breaks between them,
  each break re-run eagerly at replay (``eager_on_graph``), as the breakable prefill backend runs a
  model.

Both warm up on a side stream first, as stock's runners do. :func:`eager_break` is the body's break
point: under ``breakable`` the wrapped function becomes an eager break, otherwise it is called as is.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

KINDS = ("cuda_graph", "breakable")


def _breakable():
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import breakable_cuda_graph as B

    return B


def eager_break(kind: str, fn: Callable) -> Callable:
    """``fn`` as an eager break of a breakable capture (re-run at every replay), or ``fn`` itself."""
    return _breakable().eager_on_graph(fn) if kind == "breakable" else fn


def capture(kind: str, body: Callable[[], Any]) -> tuple:
    """Capture ``body`` (after one warm-up call on a side stream); returns ``(graph, output)``, where
    ``graph.replay()`` runs it again on the current stream and ``output`` is the captured output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if kind == "cuda_graph":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = body()
        return graph, out
    if kind != "breakable":
        raise ValueError(f"unknown capture kind {kind!r}")
    B = _breakable()
    graph = B.BreakableCUDAGraph()
    with B.BreakableCUDAGraphCapture(graph, pool=torch.cuda.graph_pool_handle(), stream=torch.cuda.Stream()):
        out = body()
    torch.cuda.synchronize()
    n = len(graph._segments)
    if n < 2:
        raise AssertionError(f"the breakable capture has {n} segment(s): the body's break did not split it")
    return graph, out
