"""Both DP ranks configured alike: each rank's prefill-graph runner configuration, compared once.

The decision assumes the two ranks capture the same graphs: the shared bucket is picked from
gathered token counts, and the checks a peer's vote stands for are evaluated against *its* runner.
A rank that captured a different bucket list, request-slot count, chunked-prefix variant set,
padding factor or backend would turn one shared verdict into two different forward-time answers.

:func:`payload` encodes a runner's configuration as a fixed row of int64; :func:`check` exchanges
the two rows once, on the scheduler's first MLP-sync vote (the first loop iteration after the
graphs were captured, before any request is served; both ranks vote in lockstep), over a dedicated
channel of the native DP2 exchange when that exchange is configured in this process (asked through
the ``dspark_pair_exchange`` hook: this feature never imports the dp2 feature), else over the TP CPU
(gloo) group with ``torch.distributed.all_gather``. A mismatch raises
:class:`PrefillGraphConfigMismatch` on both ranks naming each differing field and both values.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger("dspark_harden.prefill_graph")

MAGIC = int.from_bytes(b"DSPKPGCF", "little") & 0x7FFFFFFFFFFFFFFF
FORMAT = 1
CHANNEL = "prefill_graph_config"
BACKENDS = {"none": 0, "breakable": 1, "full": 2}
#: row layout: (field, how a value is shown); index = position in the row
FIELDS = (
    "magic",
    "format",
    "backend",
    "request_slots",
    "num_buckets",
    "buckets_digest",
    "min_bucket",
    "max_bucket",
    "chunked_prefix_variants",
    "prefix_chunk_len",
    "padding_factor_millionths",
    "max_seq_len",
    "max_context_size",
    "captured_hidden_mode",
)
WIDTH = len(FIELDS)


class PrefillGraphConfigMismatch(RuntimeError):
    """The two DP ranks' prefill-graph configurations differ (refused before any request)."""


def _digest(values: Sequence[int]) -> int:
    doc = ",".join(str(int(v)) for v in values).encode()
    return int.from_bytes(hashlib.sha256(doc).digest()[:8], "little") & 0x7FFFFFFFFFFFFFFF


def payload(runner: Any, factor: float) -> list:
    """The row of ``runner`` (a PrefillCudaGraphRunner, or None / another runner: no prefill graph)."""
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner

    if not isinstance(runner, PrefillCudaGraphRunner):
        return [MAGIC, FORMAT, BACKENDS["none"]] + [0] * (WIDTH - 4) + [-1]
    name = str(getattr(runner, "prefill_backend_name", "")).lower()
    buckets = [int(b) for b in runner.capture_num_tokens]
    full = bool(runner._is_full_backend)
    variants = sum(1 << int(n) for n in (runner._prefix_capture_variants or ()))
    mode = getattr(runner, "capture_hidden_mode", None)
    return [
        MAGIC,
        FORMAT,
        BACKENDS.get(name, 3),
        int(runner._capture_req_slots) if full else 0,
        len(buckets),
        _digest(buckets),
        min(buckets, default=0),
        max(buckets, default=0),
        variants,
        int(getattr(runner, "_prefix_chunk_len", 0) or 0),
        int(round(float(factor) * 1_000_000)),
        -1 if runner.max_seq_len is None else int(runner.max_seq_len),
        -1 if runner.max_context_size is None else int(runner.max_context_size),
        -1 if mode is None else int(mode),
    ]


def _show(field: str, value: int, row: Sequence[int]) -> str:
    if field == "backend":
        return next((k for k, v in BACKENDS.items() if v == value), f"other({value})")
    if field == "buckets_digest":
        return f"{row[4]} buckets {row[6]}..{row[7]} (digest {value:016x})"
    if field == "chunked_prefix_variants":
        return "(" + ",".join(str(n) for n in range(63) if value >> n & 1) + ")"
    if field == "padding_factor_millionths":
        return f"{value / 1_000_000:g}"
    if field in ("max_seq_len", "max_context_size", "captured_hidden_mode") and value == -1:
        return "none"
    return str(value)


def compare(rows: Sequence[Sequence[int]]) -> Optional[str]:
    """``None`` when every rank's row agrees with rank 0's, else the message naming each field and both
    values (rank 0 and the first rank that differs)."""
    rows = [list(r) for r in rows]
    for r, row in enumerate(rows):
        if len(row) != WIDTH or row[0] != MAGIC or row[1] != FORMAT:
            return f"rank {r} sent a row that is not a prefill-graph configuration of format {FORMAT}: {row[:3]}"
    a = rows[0]
    other = next((r for r in range(1, len(rows)) if rows[r] != a), None)
    if other is None:
        return None
    b = rows[other]
    diffs = []
    for i, field in enumerate(FIELDS):
        if field in ("num_buckets", "min_bucket", "max_bucket"):
            continue  # shown with buckets_digest
        if a[i] != b[i]:
            diffs.append(f"{field}: dp_rank 0 = {_show(field, a[i], a)}, dp_rank {other} = {_show(field, b[i], b)}")
    return (
        "[prefill-graph-dp] the DP ranks' prefill CUDA-graph configurations differ ("
        + "; ".join(diffs)
        + "): one shared graph/eager verdict cannot hold for every rank. Start every rank with the same "
        "cuda_graph_config[prefill] and DSPARK_HARDEN_PREFILL_GRAPH_PADDING."
    )


def exchange_gloo(row: Sequence[int], group: Any) -> list:
    """Every rank's row over the TP CPU (gloo) group (DP2 with attention-TP1: the two ranks)."""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size(group)
    local = torch.tensor(list(row), dtype=torch.int64)
    out = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(out, local, group=group)
    return [t.tolist() for t in out]


def _native_exchange() -> Optional[Callable]:
    """The DP2 feature's native pair exchange when it runs in this process (``dspark_pair_exchange``
    hook), else ``None``."""
    from ..core import binder

    return binder.hooks().dspark_pair_exchange(channel=CHANNEL, width=WIDTH, fields=tuple(FIELDS))


def check(runner: Any, factor: float, *, exchange: Optional[Callable] = None, group: Any = None) -> None:
    """Exchange this rank's row with its peer's and refuse a mismatch (on both ranks)."""
    row = payload(runner, factor)
    if exchange is None:
        exchange = _native_exchange()
        if exchange is None:
            if group is None:
                from sglang.srt.runtime_context import get_parallel

                group = get_parallel().tp_group.cpu_group
            exchange = lambda r: exchange_gloo(r, group)  # noqa: E731
    rows = exchange(row)
    message = compare(rows)
    if message:
        logger.critical("%s", message)
        raise PrefillGraphConfigMismatch(message)
    logger.info(
        "dspark-harden prefill-graph-dp: both DP ranks' prefill-graph configurations agree (%s)",
        _show("buckets_digest", row[5], row),
    )
