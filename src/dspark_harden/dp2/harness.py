"""Two local processes with a real gloo group: shared by ``dspark-harden bench dp2`` and tests.

Each worker joins a loopback gloo group (the group stock ``MLPSyncBatchInfo.all_gather`` uses on
the DP-attention CPU path) and opens the native channel. Stand-in (documented): outside a real
scheduler there is no SGLang runtime context, so ``dp_attn.get_parallel()`` is replaced in the
worker by an object exposing only ``tp_group.active_ranks_cpu`` - the one attribute stock
``all_gather`` reads from it. Everything else (the stock class, the gloo collective, the native
channel, the hardened call) is the real code.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import random
import time
import traceback
import uuid
from types import SimpleNamespace
from typing import Any, Callable

from ..devtools.server import free_port

# ForwardMode values used for random rows (resolved in the worker from the live enum)
_MODES = ("EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY", "PREBUILT", "DRAFT_EXTEND_V2")


def init_worker(rank: int, port: int, session: str, spin_us: int = 50, timeout_ms: int = 10000):
    """Join the gloo group, install the get_parallel stand-in, open the hardened MLP sync."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1], backend="gloo")
    from sglang.srt.managers.scheduler_components import dp_attn

    active = torch.ones(2, dtype=torch.int32)
    dp_attn.get_parallel = lambda: SimpleNamespace(tp_group=SimpleNamespace(active_ranks_cpu=active))
    from . import mlp_sync
    from .channels import Dp2Runtime

    rt = Dp2Runtime()
    rt.configure(
        session_id=session, timeout_ms=timeout_ms, spin_us=spin_us, export=False, rank=rank, dp_label=str(rank)
    )
    sync = mlp_sync.MlpSync(dp_attn, mlp_sync.live_schema(dp_attn.MLPSyncBatchInfo))
    sync.open(rt)
    return SimpleNamespace(dist=dist, group=group, dp_attn=dp_attn, active=active, runtime=rt, sync=sync, torch=torch)


def random_info(dp_attn, rng: random.Random, rank: int) -> Any:
    """A random MLPSyncBatchInfo as prepare_mlp_sync_batch_raw would build it: idle ranks,
    extend / decode / mixed / verify modes, health checks, graph votes."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    mode = ForwardMode[rng.choice(_MODES)]
    idle = mode in (ForwardMode.IDLE, ForwardMode.PREBUILT) or rng.random() < 0.15
    if idle and rng.random() < 0.7:
        mode = ForwardMode.IDLE
    n = 0 if idle else rng.randint(1, 8192)
    return dp_attn.MLPSyncBatchInfo(
        num_dp_ranks=2,
        tp_size=1,
        cp_size=1,
        num_tokens=n,
        num_tokens_for_logprob=0 if idle else rng.randint(1, n),
        can_run_decode_cuda_graph=rng.random() < 0.6,
        can_run_draft_cuda_graph=rng.random() < 0.7,
        can_run_prefill_cuda_graph=rng.random() < 0.5,
        is_extend_in_batch=(not idle) and mode.is_extend(),
        local_can_run_tbo=idle or rng.random() < 0.5,
        local_forward_mode=mode.value,
        prefill_cuda_graph_max_prefix_len=0 if idle else rng.choice((0, rng.randint(0, 1 << 20))),
        is_health_check=(not idle) and rng.random() < 0.05,
        attention_pairs=0 if idle else rng.randint(0, 1 << 40),
    )


GATHERED = (
    "tp0_info_cpu",
    "global_num_tokens",
    "global_num_tokens_for_logprob",
    "can_run_decode_cuda_graph",
    "is_extend_in_batch",
    "can_run_prefill_cuda_graph",
    "prefill_cuda_graph_max_prefix_len",
    "can_run_draft_cuda_graph",
    "any_health_check",
    "global_attention_pairs",
    "dp_cooperation_info",
)


def _canon(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), str(value.device), value.tolist())
    if isinstance(value, list):
        return ("list", [(type(x).__name__, x) for x in value])
    return (type(value).__name__, value)


def differences(stock: Any, hardened: Any) -> list:
    """Field-for-field differences (value AND type) between two gathered MLPSyncBatchInfo,
    over every dataclass field except the timing ``sync_wait_seconds``."""
    out = []
    for f in dataclasses.fields(stock):
        if f.name == "sync_wait_seconds":
            continue
        a, b = _canon(getattr(stock, f.name)), _canon(getattr(hardened, f.name))
        if a != b:
            out.append(f"{f.name}: stock {a!r} != hardened {b!r}")
    return out


def run_pair(target: Callable, args: tuple, timeout: float = 600.0, ctx=None) -> list:
    """Run ``target(rank, port, session, queue, *args)`` in two spawned processes (``ctx``: a
    multiprocessing context, spawn by default); return both ranks' results (rank order). Raises
    RuntimeError with the worker traceback on failure."""
    ctx = ctx or mp.get_context("spawn")
    q = ctx.Queue()
    port, session = free_port(span=1), f"h-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    procs = [ctx.Process(target=_entry, args=(target, r, port, session, q) + tuple(args)) for r in (0, 1)]
    for p in procs:
        p.start()
    results: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < 2:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError("dp2 harness: workers did not finish in time")
            try:
                rank, ok, payload = q.get(timeout=min(remaining, 5.0))
            except Exception:  # noqa: BLE001 - queue.Empty
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"dp2 harness: worker exited with {dead[0].exitcode}") from None
                continue
            if not ok:
                raise RuntimeError(f"dp2 harness: rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[0], results[1]]


def _entry(target, rank, port, session, q, *args):
    try:
        q.put((rank, True, target(rank, port, session, *args)))
    except BaseException:  # noqa: BLE001 - report to the parent
        q.put((rank, False, traceback.format_exc()))
