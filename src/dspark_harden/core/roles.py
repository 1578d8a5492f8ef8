"""Which SGLang process are we in? Decided from the caller of ``load_plugins()``.

The caller's frame also carries the process's ``server_args`` and ranks (scheduler, DP controller
and detokenizer are started with them), which features use to validate geometry at bind time.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from .patch import Role

# function that calls sglang.srt.plugins.load_plugins() -> role (sglang 0.5.23)
_CALLERS = {
    "run_scheduler_process": Role.SCHEDULER,
    "run_data_parallel_controller_process": Role.CONTROLLER,
    "run_detokenizer_process": Role.DETOKENIZER,
}


@dataclass(frozen=True)
class ProcessContext:
    role: Role
    server_args: Any = None  # sglang ServerArgs where the caller had it (not in the main process)
    tp_rank: Optional[int] = None
    dp_rank: Optional[int] = None  # DP (attention) rank of a scheduler, None elsewhere

    @property
    def dp_label(self) -> str:
        """Value for the ``dp_rank`` metric label ("none" outside DP schedulers)."""
        return "none" if self.dp_rank is None else str(self.dp_rank)


def _dp_rank_of(server_args: Any, tp_rank: Optional[int], dp_rank: Optional[int]) -> Optional[int]:
    if dp_rank is not None:
        return dp_rank
    if server_args is None or tp_rank is None:
        return None
    # 0.5.23 resolves --dp-size N --enable-dp-attention into attn_dp_size (dp_size may read 1)
    attn_dp = getattr(server_args, "attn_dp_size", None) or 0
    if not attn_dp and getattr(server_args, "enable_dp_attention", False):
        attn_dp = getattr(server_args, "dp_size", 1) or 1
    if attn_dp <= 1:
        return None
    attn_tp = max(1, server_args.tp_size // attn_dp)
    return tp_rank // attn_tp


def detect_context(forced: Optional[str] = None) -> ProcessContext:
    frame = sys._getframe(1)
    found_role, found_locals = None, {}
    while frame is not None:
        role = _CALLERS.get(frame.f_code.co_name)
        if role is not None and frame.f_globals.get("__name__", "").startswith("sglang."):
            found_role, found_locals = role, dict(frame.f_locals)
            break
        frame = frame.f_back
    name = forced or os.environ.get("DSPARK_HARDEN_ROLE")
    role = Role(name) if name else (found_role or Role.MAIN)
    server_args = found_locals.get("server_args")
    tp_rank = found_locals.get("tp_rank")
    return ProcessContext(
        role=role,
        server_args=server_args,
        tp_rank=tp_rank,
        dp_rank=_dp_rank_of(server_args, tp_rank, found_locals.get("dp_rank")),
    )


def detect_role(forced: Optional[str] = None) -> Role:
    return detect_context(forced).role


CONTEXT: Optional[ProcessContext] = None  # set by the entry point once per process
